//! What happened to one delivery ([`Handled`], [`Rejection`]) and the one [`Action`] the broker
//! must take for it: ack, retry after a delay, or reject without requeue.

use std::fmt;
use std::time::Duration;

use dedupgate_core::keys::RenderError;
use dedupgate_core::{GateError, InvalidInput, Mode, Record};

/// The header a dead letter carries why it was dead-lettered in (the outcome as logged): the
/// Kafka consumer's dead letters, and the relay's for every source.
pub const REASON_HEADER: &str = "dedupgate-reason";

/// Why a delivery was rejected without requeue: retrying it could never succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The key comes from the message id and the message has none (or an empty one).
    #[error("the message has no {field}, and the key comes from it")]
    NoMessageId {
        /// The property or header that was missing.
        field: &'static str,
    },
    /// The key comes from a record header (Kafka) and the record has none by that name, or an
    /// empty or non-UTF-8 one.
    #[error("the record has no usable header {name:?} (missing, empty or not UTF-8), and the key comes from it")]
    NoHeader {
        /// The header's name.
        name: String,
    },
    /// The key comes from a template and the payload is not JSON.
    #[error("the payload is not JSON, so key template {template:?} cannot be rendered: {cause}")]
    NotJson {
        /// The template.
        template: String,
        /// The parse error.
        cause: serde_json::Error,
    },
    /// The template could not be rendered for this payload (a missing or null field, …).
    #[error("key template {template:?}: {cause}")]
    Template {
        /// The template.
        template: String,
        /// Which field and why.
        cause: RenderError,
    },
    /// The key is not a valid gate key (empty, longer than 1024 bytes).
    #[error("invalid key: {0}")]
    InvalidKey(InvalidInput),
    /// The key was seen before with a different payload: key reuse, not a duplicate.
    #[error("key {key:?} was seen with a different payload (fingerprint mismatch)")]
    FingerprintMismatch {
        /// The key.
        key: String,
    },
}

/// What the broker must do with a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Acknowledge: the message is done with.
    Ack,
    /// Deliver it again after `after` (AMQP: wait, then nack with requeue, or reject with
    /// requeue for a failure; JetStream: nak with this delay).
    Retry {
        /// How long to wait.
        after: Duration,
        /// True when the handler failed on this delivery. AMQP then rejects with requeue, which
        /// a quorum queue counts against its delivery limit and in `x-delivery-count`; a nack
        /// (a delivery not processed, such as one whose key another consumer holds) is not
        /// counted by RabbitMQ 4.
        failure: bool,
    },
    /// Reject without requeue (AMQP: dead-lettered if the queue has a dead-letter exchange;
    /// JetStream: term).
    Reject,
}

/// What happened to one delivery. [`Handled::action`] says what the broker must do.
#[derive(Debug)]
#[non_exhaustive]
pub enum Handled<T, E> {
    /// The handler ran and returned `value` (retriable: the value is stored for duplicates).
    Ran {
        /// The key.
        key: String,
        /// The handler's value.
        value: T,
    },
    /// A duplicate of a completed key: the handler did not run. `record.result` holds the first
    /// run's value (retriable mode).
    Duplicate {
        /// The key.
        key: String,
        /// The stored record.
        record: Record,
    },
    /// A duplicate of a key another consumer holds right now: delivered again after
    /// `retry_after`, by which time the holder has completed (then it is acked as a duplicate),
    /// released or lost its lease (then it runs).
    InProgress {
        /// The key.
        key: String,
        /// When to deliver it again.
        retry_after: Duration,
        /// The holder's owner, when its claim named one.
        holder: Option<String>,
    },
    /// The handler failed. Retriable: the claim was released and the message is retried after
    /// `retry_after`, or, on delivery `max_attempts` or when the error is permanent
    /// ([`Permanence`](crate::Permanence)), rejected without requeue. Idempotent: the key stays
    /// marked and the message is rejected, never retried.
    Failed {
        /// The key.
        key: String,
        /// The handler's error.
        error: E,
        /// The ordering.
        mode: Mode,
        /// Which delivery failed (1 = the first), when the broker counts them.
        attempt: Option<u32>,
        /// When to deliver it again; `None`: rejected without requeue (idempotent mode, or the
        /// last attempt allowed).
        retry_after: Option<Duration>,
        /// Retriable mode: why the claim could not be released, when it could not (it is then
        /// held until its lease runs out).
        unreleased: Option<GateError>,
        /// The error said it would come back alike on every retry: rejected at once.
        permanent: bool,
    },
    /// The handler ran but the gate could not record its completion (the store stayed down
    /// while the gate asked again, or the lease was lost). The message is acked: the work is
    /// done, and a redelivery would only run it again once the lease ran out. A copy of the
    /// message published again after that (the record is still in progress, then expired)
    /// would run it again; logged as an error.
    Unrecorded {
        /// The key.
        key: String,
        /// Why the completion failed.
        error: GateError,
    },
    /// The gate could not decide; the handler did not run. Retried, never acked.
    Unavailable {
        /// The key.
        key: String,
        /// Why.
        error: GateError,
        /// When to deliver it again.
        retry_after: Duration,
    },
    /// The delivery can never be processed: rejected without requeue.
    Rejected(Rejection),
}

impl<T, E> Handled<T, E> {
    /// What the broker must do with the delivery.
    pub fn action(&self) -> Action {
        match self {
            Handled::Ran { .. } | Handled::Duplicate { .. } | Handled::Unrecorded { .. } => {
                Action::Ack
            }
            Handled::InProgress { retry_after, .. } => Action::Retry {
                after: *retry_after,
                failure: false,
            },
            Handled::Failed {
                permanent: true, ..
            } => Action::Reject,
            Handled::Failed {
                retry_after: Some(after),
                ..
            } => Action::Retry {
                after: *after,
                failure: true,
            },
            Handled::Failed {
                retry_after: None, ..
            } => Action::Reject,
            Handled::Unavailable { retry_after, .. } => Action::Retry {
                after: *retry_after,
                failure: false,
            },
            Handled::Rejected(_) => Action::Reject,
        }
    }

    /// The key, when one could be made.
    pub fn key(&self) -> Option<&str> {
        match self {
            Handled::Ran { key, .. }
            | Handled::Duplicate { key, .. }
            | Handled::InProgress { key, .. }
            | Handled::Failed { key, .. }
            | Handled::Unrecorded { key, .. }
            | Handled::Unavailable { key, .. } => Some(key),
            Handled::Rejected(_) => None,
        }
    }

    /// True when the handler ran to success on this delivery.
    pub fn ran(&self) -> bool {
        matches!(self, Handled::Ran { .. })
    }

    /// A short label for logs and counters: `ran`, `duplicate`, `in_progress`, `failed`,
    /// `unrecorded`, `unavailable`, `rejected`.
    pub fn label(&self) -> &'static str {
        match self {
            Handled::Ran { .. } => "ran",
            Handled::Duplicate { .. } => "duplicate",
            Handled::InProgress { .. } => "in_progress",
            Handled::Failed { .. } => "failed",
            Handled::Unrecorded { .. } => "unrecorded",
            Handled::Unavailable { .. } => "unavailable",
            Handled::Rejected(_) => "rejected",
        }
    }
}

impl<T, E: fmt::Display> fmt::Display for Handled<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Handled::Ran { key, .. } => write!(f, "{key}: ran"),
            Handled::Duplicate { key, .. } => write!(f, "{key}: duplicate, already completed"),
            Handled::InProgress {
                key,
                retry_after,
                holder,
            } => write!(
                f,
                "{key}: duplicate, in progress elsewhere (held by {}); retry in {} ms",
                holder.as_deref().unwrap_or("an unnamed worker"),
                retry_after.as_millis()
            ),
            Handled::Failed {
                key,
                error,
                mode,
                attempt,
                retry_after,
                unreleased,
                permanent,
            } => {
                let delivery = match attempt {
                    Some(n) => format!("delivery {n}"),
                    None => "delivery count unknown".to_owned(),
                };
                let released = match unreleased {
                    None => "released".to_owned(),
                    Some(e) => format!("not released ({e}), held until its lease runs out"),
                };
                match (mode, retry_after) {
                    (Mode::Retriable, _) if *permanent => write!(
                        f,
                        "{key}: handler failed (retriable, {delivery}, would fail alike every time): {released}, rejected without requeue: {error}"
                    ),
                    (Mode::Idempotent, _) => write!(
                        f,
                        "{key}: handler failed (idempotent, {delivery}): rejected, never retried: {error}"
                    ),
                    (Mode::Retriable, Some(after)) => write!(
                        f,
                        "{key}: handler failed (retriable, {delivery}): {released}, retried in {} ms: {error}",
                        after.as_millis()
                    ),
                    (Mode::Retriable, None) => write!(
                        f,
                        "{key}: handler failed (retriable, {delivery}, max_attempts reached): {released}, rejected without requeue: {error}"
                    ),
                }
            }
            Handled::Unrecorded { key, error, .. } => {
                write!(
                    f,
                    "{key}: ran, but its completion was not recorded, acked (a copy of the message \
                     that comes after the lease runs out would run again): {error}"
                )
            }
            Handled::Unavailable { key, error, .. } => {
                write!(f, "{key}: gate unavailable, retried: {error}")
            }
            Handled::Rejected(why) => write!(f, "rejected: {why}"),
        }
    }
}
