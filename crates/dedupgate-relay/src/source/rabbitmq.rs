//! RabbitMQ source: a consumer on one queue, with a prefetch of [`IN_FLIGHT`]; each delivery
//! is processed in a task of its own through [`ConsumerGate::process`] and settled with
//! [`rabbitmq::settle`] (a requeue's delay included), so the queue is acked only after the sink
//! confirmed. On shutdown the consumer stops, the deliveries in hand settle (for up to
//! [`SHUTDOWN_GRACE`](super::SHUTDOWN_GRACE)), and the channel closes (the broker requeues
//! anything unacked).

use dedupgate_consumers::{rabbitmq, ConsumerGate};
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::{Forward, IN_FLIGHT};
use crate::RelayError;

pub(crate) async fn run(
    gate: ConsumerGate,
    uri: &str,
    queue: &str,
    forward: Forward,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let failed = |reason: String| RelayError::Source {
        route: forward.route.clone(),
        reason: format!("amqp queue {queue:?}: {reason}"),
    };
    let connection = rabbitmq::connect(uri)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| failed(e.to_string()))?;
    channel
        .basic_qos(IN_FLIGHT, BasicQosOptions::default())
        .await
        .map_err(|e| failed(e.to_string()))?;
    let tag = format!("dedupgate-relay-{}", forward.route);
    let mut deliveries = channel
        .basic_consume(
            queue,
            &tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
    let handler = forward.handler();
    let mut tasks = JoinSet::new();
    let mut outcome = Ok(());
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            next = deliveries.next() => match next {
                Some(Ok(delivery)) => {
                    let gate = gate.clone();
                    let forward = forward.clone();
                    let handler = handler.clone();
                    tasks.spawn(async move {
                        let handled = gate
                            .process(
                                rabbitmq::message_id(&delivery),
                                rabbitmq::MESSAGE_ID_FIELD,
                                &delivery.data,
                                rabbitmq::attempt(&delivery),
                                handler,
                            )
                            .await;
                        let action = forward.settle_action(&handled, &delivery.data).await;
                        if let Err(e) = rabbitmq::settle(&delivery, action).await {
                            // The broker redelivers it when the channel closes.
                            tracing::warn!(error = %e, "relay: amqp settle failed");
                        }
                    });
                }
                Some(Err(e)) => {
                    outcome = Err(failed(e.to_string()));
                    break;
                }
                None => {
                    outcome = Err(failed("the consumer was cancelled by the broker".into()));
                    break;
                }
            },
        }
    }
    super::drain(&forward.route, &mut tasks).await;
    let _ = channel.close(200, "relay stopping").await;
    let _ = connection.close(200, "relay stopping").await;
    outcome
}
