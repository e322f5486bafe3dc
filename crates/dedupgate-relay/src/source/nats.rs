//! NATS JetStream source: a durable pull consumer of one stream (created with explicit acks
//! when missing), up to [`IN_FLIGHT`] messages in hand; each is processed through
//! [`ConsumerGate::process`] (keyed by `Nats-Msg-Id` unless a template is set) and settled with
//! [`nats::settle`]: ack, nak with a delay, or term. No in-progress acks are sent, so the
//! consumer's ack wait (30 s when the relay creates it) must exceed a forward's time.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy};
use dedupgate_consumers::{nats, ConsumerGate};
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{Forward, IN_FLIGHT};
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
                        let message_id = message
                            .headers
                            .as_ref()
                            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                            .map(|v| v.as_str().to_owned());
                        let handled = gate
                            .process(
                                message_id.as_deref(),
                                nats::MESSAGE_ID_HEADER,
                                &message.payload,
                                nats::attempt(&message),
                                handler,
                            )
                            .await;
                        let action = forward.settle_action(&handled, &message.payload).await;
                        if let Err(e) = nats::settle(&message, action).await {
                            // JetStream redelivers it after the ack wait.
                            tracing::warn!(error = %e, "relay: nats settle failed");
                        }
                    });
                }
                // A missed heartbeat or a pull that failed: the stream goes on by itself.
                Some(Err(e)) => tracing::warn!(error = %e, "relay: nats receive failed"),
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
