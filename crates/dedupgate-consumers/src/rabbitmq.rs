//! RabbitMQ (AMQP 0-9-1) through lapin: [`handle`] runs one [`Delivery`] through a
//! [`ConsumerGate`] and acks, nacks with requeue or rejects it as [`Handled::action`] says.
//!
//! The key is the AMQP `message_id` property (or a key template over the JSON payload). AMQP has
//! no delayed requeue, so a retry waits its delay before it requeues: the delivery keeps its
//! prefetch slot meanwhile, which is what keeps it from spinning. [`handle`] returns only after
//! the delay, so a loop that awaits each delivery in turn handles nothing else while a message
//! waits, whatever the prefetch: spawn a task per delivery to keep `prefetch` of them in flight.
//! A failed handler's delivery is requeued with `basic.reject` (a failure, which a quorum queue
//! counts in `x-delivery-count` and against its delivery limit, 20 by default in RabbitMQ 4:
//! past it the queue dead-letters or drops the message whatever
//! [`ConsumerGate::max_attempts`] says), any other retry with `basic.nack` (not processed, which
//! RabbitMQ 4 does not count). Rejected deliveries go to the queue's dead-letter exchange, when
//! it has one.
//!
//! The delivery count comes from `x-delivery-count` (quorum queues) or the `rejected` entries of
//! `x-death` (a dead-letter loop that brings rejected messages back); a classic queue says only
//! `redelivered`, so its redeliveries are uncounted.

use std::fmt;
use std::future::Future;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use serde::Serialize;

use crate::{Action, Attempt, ConsumerGate, Handled, Message};

/// Where the key comes from, for rejection messages.
pub const MESSAGE_ID_FIELD: &str = "AMQP message_id property";

/// Why a delivery could not be settled with the broker. The delivery stays unacked, so the
/// broker redelivers it once the channel closes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// Connecting failed.
    #[error("rabbitmq: cannot connect: {0}")]
    Connect(lapin::Error),
    /// The ack, nack or reject failed (a closed channel or connection).
    #[error("rabbitmq: could not {action} the delivery: {cause}")]
    Settle {
        /// `ack`, `nack` or `reject`.
        action: &'static str,
        /// The broker error.
        cause: lapin::Error,
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
/// Idempotent mode: a failed handler's reject is recorded as [`Unsettled`](crate::Unsettled)
/// until the broker takes it, and a duplicate whose earlier reject is still recorded (the
/// reject failed: a closed channel) is rejected again, not acked; it is returned as the
/// `Duplicate` it is.
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
    E: fmt::Display + crate::Permanence,
{
    let handled = gate
        .process(
            message_id(delivery),
            MESSAGE_ID_FIELD,
            &delivery.data,
            attempt(delivery),
            handler,
        )
        .await;
    let (action, pending) = gate.settle_action(&handled).await;
    settle(delivery, action).await?;
    if let Some(pending) = pending {
        gate.unsettled().clear(&pending.key).await;
    }
    Ok(handled)
}

/// The delivery's AMQP `message_id` property, when it has one.
pub fn message_id(delivery: &Delivery) -> Option<&str> {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str())
}

/// Which delivery this is: one more than the deliveries the broker counted before it
/// (`x-delivery-count`, or the largest `count` of an `x-death` entry whose `reason` is
/// `rejected`, whichever is larger); the first when the broker says it is no redelivery;
/// uncounted otherwise.
pub fn attempt(delivery: &Delivery) -> Attempt {
    let headers = delivery.properties.headers().as_ref();
    let previous = headers
        .and_then(|h| h.inner().get("x-delivery-count"))
        .and_then(count)
        .into_iter()
        .chain(headers.and_then(rejected_deaths))
        .max();
    match previous {
        Some(n) => Attempt {
            number: Some(u32::try_from(n).unwrap_or(u32::MAX).saturating_add(1)),
            redelivered: delivery.redelivered || n > 0,
        },
        None => Attempt::from_redelivered(delivery.redelivered),
    }
}

/// The largest `count` of the `x-death` entries for `rejected` (each entry counts one queue
/// and reason).
fn rejected_deaths(headers: &FieldTable) -> Option<u64> {
    headers
        .inner()
        .get("x-death")?
        .as_array()?
        .as_slice()
        .iter()
        .filter_map(AMQPValue::as_field_table)
        .filter(|death| {
            let reason = death.inner().get("reason");
            let bytes = match reason {
                Some(AMQPValue::LongString(s)) => Some(s.as_bytes()),
                Some(AMQPValue::ShortString(s)) => Some(s.as_str().as_bytes()),
                _ => None,
            };
            bytes == Some(b"rejected".as_slice())
        })
        .filter_map(|death| death.inner().get("count").and_then(count))
        .max()
}

/// A non-negative integer header value of any AMQP integer type.
fn count(value: &AMQPValue) -> Option<u64> {
    let n: i128 = match *value {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n.into(),
        _ => return None,
    };
    u64::try_from(n).ok()
}

/// Carries out `action` on `delivery`.
pub async fn settle(delivery: &Delivery, action: Action) -> Result<(), RabbitError> {
    let result = match action {
        Action::Ack => delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|source| ("ack", source)),
        Action::Retry { after, failure } => {
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
            if failure {
                delivery
                    .reject(BasicRejectOptions { requeue: true })
                    .await
                    .map_err(|source| ("reject", source))
            } else {
                delivery
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await
                    .map_err(|source| ("nack", source))
            }
        }
        Action::Reject => delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map_err(|source| ("reject", source)),
    };
    result
        .map(|_| ())
        .map_err(|(action, cause)| RabbitError::Settle { action, cause })
}
