//! NATS JetStream source: a durable pull consumer of one stream (created with explicit acks
//! and a 30 s ack wait when missing), up to [`IN_FLIGHT`] messages in hand; each is processed
//! through [`ConsumerGate::process`] (keyed by [`nats::message_id`] unless a template is set)
//! and settled with [`nats::settle`]: ack, nak with a delay, or term. While a message is in
//! hand (forward, dead letter) [`nats::with_progress`] tells the server so every third of the
//! consumer's ack wait, so a slow sink does not have JetStream deliver a second copy meanwhile.
//!
//! The consumers crate's [`nats::handle`] is not used whole: it settles as soon as the gate
//! answers, and the relay must first send a reject to the dead-letter sink (and ack only once
//! that is confirmed). Its parts are: the message id, the delivery count, progress and settle.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
use dedupgate_consumers::{nats, ConsumerGate};
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{Forward, IN_FLIGHT};
use crate::metrics::RouteMetrics;
use crate::RelayError;

pub(crate) async fn run(
    gate: ConsumerGate,
    server: &str,
    stream: &str,
    consumer: &str,
    forward: Forward,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let failed = |reason: String| RelayError::Source {
        route: forward.route.clone(),
        reason: format!("nats stream {stream:?} consumer {consumer:?}: {reason}"),
    };
    let client = async_nats::connect(server)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let js = jetstream::new(client);
    let pull_consumer: jetstream::consumer::PullConsumer = js
        .get_stream(stream)
        .await
        .map_err(|e| failed(e.to_string()))?
        .get_or_create_consumer(
            consumer,
            pull::Config {
                durable_name: Some(consumer.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
    // A third of the ack wait: two progress acks may be lost before the server redelivers.
    let progress_every = pull_consumer.cached_info().config.ack_wait / 3;
    let mut messages = pull_consumer
        .stream()
        .max_messages_per_batch(usize::from(IN_FLIGHT))
        .messages()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let handler = forward.handler();
    let mut tasks = JoinSet::new();
    let mut outcome = Ok(());
    loop {
        if tasks.len() >= usize::from(IN_FLIGHT) {
            tasks.join_next().await;
            continue;
        }
        tokio::select! {
            _ = stop.changed() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            next = messages.next() => match next {
                Some(Ok(message)) => {
                    let gate = gate.clone();
                    let forward = forward.clone();
                    let handler = handler.clone();
                    tasks.spawn(async move {
                        let work = async {
                            let handled = gate
                                .process(
                                    nats::message_id(&message),
                                    nats::MESSAGE_ID_HEADER,
                                    &message.payload,
                                    nats::attempt(&message),
                                    handler,
                                )
                                .await;
                            forward.settle_action(&handled, &message.payload).await
                        };
                        let action = nats::with_progress(&message, progress_every, work).await;
                        if let Err(e) = nats::settle(&message, action).await {
                            // JetStream redelivers it after the ack wait.
                            tracing::warn!(error = %e, "relay: nats settle failed");
                        }
                    });
                }
                // A missed heartbeat or a pull that failed (the server away: the client
                // reconnects by itself): the stream goes on, and /metrics counts it.
                Some(Err(e)) => {
                    RouteMetrics::bump(&forward.metrics.source_errors);
                    tracing::warn!(error = %e, "relay: nats receive failed");
                }
                None => {
                    outcome = Err(failed("the message stream ended".into()));
                    break;
                }
            },
        }
    }
    super::drain(&forward.route, &mut tasks).await;
    outcome
}
