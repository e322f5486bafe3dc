//! RabbitMQ (AMQP 0-9-1) through lapin: [`handle`] runs one [`Delivery`] through a
//! [`ConsumerGate`] and acks, nacks with requeue or rejects it as [`Handled::action`] says.
//!
//! The key is the AMQP `message_id` property (or a key template over the JSON payload). AMQP has
//! no delayed requeue, so a retry waits its delay before the nack: a duplicate whose key another
//! consumer holds keeps its prefetch slot meanwhile, which is what keeps it from spinning.
//! Rejected deliveries go to the queue's dead-letter exchange, when it has one.

use std::fmt;
use std::future::Future;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::{Connection, ConnectionProperties};
use serde::Serialize;

use crate::{Action, ConsumerGate, Handled, Message};

/// Where the key comes from, for rejection messages.
pub const MESSAGE_ID_FIELD: &str = "AMQP message_id property";

/// Why a delivery could not be settled with the broker. The delivery stays unacked, so the
/// broker redelivers it once the channel closes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// Connecting failed.
    #[error("rabbitmq: cannot connect: {0}")]
    Connect(#[source] lapin::Error),
    /// The ack, nack or reject failed (a closed channel or connection).
    #[error("rabbitmq: could not {action} the delivery: {source}")]
    Settle {
        /// `ack`, `nack` or `reject`.
        action: &'static str,
        /// The broker error.
        source: lapin::Error,
    },
}

/// Connection properties that run lapin on the current tokio runtime.
pub fn connection_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// Connects to `uri` (`amqp://guest:guest@127.0.0.1:5672/%2f`) on the current tokio runtime.
pub async fn connect(uri: &str) -> Result<Connection, RabbitError> {
    Connection::connect(uri, connection_properties())
        .await
        .map_err(RabbitError::Connect)
}

/// Processes one delivery through the gate, then settles it: ack, nack with requeue (after the
/// retry delay) or reject without requeue. Returns what happened.
///
/// ```no_run
/// # async fn demo(gate: dedupgate_consumers::ConsumerGate, consumer: lapin::Consumer) -> Result<(), Box<dyn std::error::Error>> {
/// use futures::StreamExt;
/// let mut consumer = consumer;
/// while let Some(delivery) = consumer.next().await {
///     let handled = dedupgate_consumers::rabbitmq::handle(&gate, &delivery?, |msg| async move {
///         println!("charging {}", msg.key);
///         Ok::<_, std::io::Error>("done")
///     })
///     .await?;
///     println!("{handled}");
/// }
/// # Ok(()) }
/// ```
pub async fn handle<H, Fut, T, E>(
    gate: &ConsumerGate,
    delivery: &Delivery,
    handler: H,
) -> Result<Handled<T, E>, RabbitError>
where
    H: FnOnce(Message) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize,
    E: fmt::Display,
{
    let message_id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str());
    let handled = gate
        .process(
            message_id,
            MESSAGE_ID_FIELD,
            &delivery.data,
            delivery.redelivered,
            handler,
        )
        .await;
    settle(delivery, handled.action()).await?;
    Ok(handled)
}

/// Carries out `action` on `delivery`.
pub async fn settle(delivery: &Delivery, action: Action) -> Result<(), RabbitError> {
    let result = match action {
        Action::Ack => delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|source| ("ack", source)),
        Action::Retry { after } => {
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
            delivery
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
                .map_err(|source| ("nack", source))
        }
        Action::Reject => delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map_err(|source| ("reject", source)),
    };
    result
        .map(|_| ())
        .map_err(|(action, source)| RabbitError::Settle { action, source })
}
