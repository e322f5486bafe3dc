//! NATS JetStream through async-nats: [`handle`] runs one message of a pull consumer through a
//! [`ConsumerGate`] and acks, naks (with the retry delay) or terms it as [`Handled::action`]
//! says.
//!
//! The key is the `Nats-Msg-Id` header (or a key template over the JSON payload). JetStream drops
//! a republished `Nats-Msg-Id` only within the stream's duplicate window (2 minutes by default);
//! the gate covers its ttl, and redeliveries after a missed ack. The consumer needs
//! `AckPolicy::Explicit`. Acks are double acks: [`handle`] returns once the server has the ack.
//!
//! A failed handler's message is naked with the failure delay for its `delivered` count, and
//! termed on delivery `max_attempts` ([`ConsumerGate::max_attempts`]). The consumer's own
//! `max_deliver` still applies: past it JetStream stops delivering the message without a term,
//! so set `max_attempts` at or below it to have the last failure termed and logged.
//!
//! While the handler runs, [`handle`] tells the server the message is in progress every
//! [`PROGRESS_EVERY`], which restarts the consumer's ack wait: a handler that runs longer than
//! the ack wait is not delivered again meanwhile (each such redelivery would find the key held,
//! be naked, and count against `max_deliver`). A consumer's ack wait should be at least twice
//! that period; [`handle_with_progress`] takes another.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message as JsMessage};
use serde::Serialize;

use crate::{Action, Attempt, ConsumerGate, Handled, Message};

/// The header the key comes from.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// How often [`handle`] says a message is still in progress (JetStream's default ack wait is
/// 30 s).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Why a message could not be settled with the server. Unsettled, it is redelivered after the
/// consumer's ack wait.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The ack, nak or term failed.
    #[error("nats: could not {action} the message: {cause}")]
    Settle {
        /// `ack`, `nak` or `term`.
        action: &'static str,
        /// The client error.
        cause: async_nats::Error,
    },
}

/// Processes one JetStream message through the gate, then settles it: ack (double ack), nak
/// with the retry delay, or term. Returns what happened.
///
/// Idempotent mode: a failed handler's term is recorded as [`Unsettled`](crate::Unsettled)
/// until it is sent, and a duplicate whose earlier term is still recorded (it was not sent) is
/// termed again, not acked; it is returned as the `Duplicate` it is.
///
/// ```no_run
/// # async fn demo(gate: dedupgate_consumers::ConsumerGate, consumer: async_nats::jetstream::consumer::PullConsumer) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use futures::StreamExt;
/// let mut messages = consumer.messages().await?;
/// while let Some(message) = messages.next().await {
///     let handled = dedupgate_consumers::nats::handle(&gate, &message?, |msg| async move {
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
    message: &JsMessage,
    handler: H,
) -> Result<Handled<T, E>, NatsError>
where
    H: FnOnce(Message) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize,
    E: fmt::Display + crate::Permanence,
{
    handle_with_progress(gate, message, PROGRESS_EVERY, handler).await
}

/// [`handle`], saying the message is in progress every `every` while it is processed (for a
/// consumer whose ack wait is under twice [`PROGRESS_EVERY`]).
pub async fn handle_with_progress<H, Fut, T, E>(
    gate: &ConsumerGate,
    message: &JsMessage,
    every: Duration,
    handler: H,
) -> Result<Handled<T, E>, NatsError>
where
    H: FnOnce(Message) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize,
    E: fmt::Display + crate::Permanence,
{
    let processing = gate.process(
        message_id(message),
        MESSAGE_ID_HEADER,
        &message.payload,
        attempt(message),
        handler,
    );
    let handled = with_progress(message, every, processing).await;
    let (action, pending) = gate.settle_action(&handled).await;
    settle(message, action).await?;
    if let Some(pending) = pending {
        gate.unsettled().clear(&pending.key).await;
    }
    Ok(handled)
}

/// The message's `Nats-Msg-Id`, when it has one.
pub fn message_id(message: &JsMessage) -> Option<&str> {
    message
        .headers
        .as_ref()
        // A received header is parsed into the standard name, which a `&str` lookup (a custom
        // name) does not match; the `&str` form finds one set on a locally built map.
        .and_then(|headers| {
            headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .or_else(|| headers.get(MESSAGE_ID_HEADER))
        })
        .map(|value| value.as_str())
}

/// Drives `work` (a message's processing, and whatever must follow it before the message is
/// settled) while telling the server every `every` that `message` is in progress, which
/// restarts the consumer's ack wait; returns `work`'s output. For an adapter that settles the
/// message itself (the relay, which dead-letters before it acks).
pub async fn with_progress<F: Future>(message: &JsMessage, every: Duration, work: F) -> F::Output {
    tokio::pin!(work);
    // A day at most: longer is no progress ack at all, and `now + every` must not overflow.
    let every = every.clamp(Duration::from_millis(1), Duration::from_secs(86_400));
    let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = progress.tick() => {
                // Sent from a task of its own: a publish that waits (the client reconnecting)
                // must not stop the work, whose lease renewal runs in this future. Best
                // effort: a lost one only lets the ack wait run out as it would have.
                let message = message.clone();
                tokio::spawn(async move {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "nats: in-progress ack not sent");
                    }
                });
            }
        }
    }
}

/// Which delivery `message` is: JetStream counts every delivery in the message's info
/// (`delivered`, 1 for the first). A message without JetStream info (no ack reply subject)
/// counts as uncounted.
pub fn attempt(message: &JsMessage) -> Attempt {
    match message.info() {
        // A count that does not fit (negative: no real server sends one) is no count at all,
        // never "the last attempt".
        Ok(info) => match u32::try_from(info.delivered) {
            Ok(n) => Attempt::nth(n),
            Err(_) => Attempt {
                number: None,
                redelivered: true,
            },
        },
        Err(_) => Attempt {
            number: None,
            redelivered: false,
        },
    }
}

/// Carries out `action` on `message`.
pub async fn settle(message: &JsMessage, action: Action) -> Result<(), NatsError> {
    let (name, result) = match action {
        Action::Ack => ("ack", message.double_ack().await),
        Action::Retry { after, .. } => {
            let delay = (!after.is_zero()).then_some(after);
            ("nak", message.ack_with(AckKind::Nak(delay)).await)
        }
        Action::Reject => ("term", message.ack_with(AckKind::Term).await),
    };
    result.map_err(|cause| NatsError::Settle {
        action: name,
        cause,
    })
}
