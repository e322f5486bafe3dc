//! # dedupgate-consumers
//!
//! Broker consumers through the gate: each delivery's handler runs at most once per key, the way
//! Apache Camel's idempotent consumer and AWS Powertools' idempotency utility do it, with
//! [`dedupgate_core::Gate::run_with`] making every decision.
//!
//! - [`ConsumerGate`]: a [`Gate`] plus the namespace, the [`Mode`], where the key comes from
//!   ([`KeySource`]: the broker's message id or a [`KeyTemplate`] over the JSON payload) and the
//!   retry delays. [`ConsumerGate::process`] turns one delivery into a [`Handled`] outcome; it
//!   knows no broker.
//! - [`Handled`]: what happened (ran, duplicate, in progress elsewhere, failed, rejected, gate
//!   unavailable) and [`Handled::action`], the one [`Action`] the broker must take: ack, retry
//!   after a delay, or reject without requeue.
//! - [`rabbitmq`] (feature `rabbitmq`, lapin): [`rabbitmq::handle`] processes one
//!   [`lapin::message::Delivery`] and acks, nacks with requeue or rejects it; the key is the AMQP
//!   `message_id` property.
//! - [`nats`] (feature `nats`, async-nats): [`nats::handle`] does the same for a JetStream pull
//!   consumer's message (ack, nak with a delay, term); the key is the `Nats-Msg-Id` header.
//!
//! The rules, for both brokers:
//!
//! | outcome | action |
//! |---|---|
//! | the handler ran (retriable: completed with its value; idempotent: marked first) | ack |
//! | duplicate of a completed key | ack, the handler does not run |
//! | duplicate of a key another consumer holds | retry after the in-progress delay (at most the holder's remaining lease) |
//! | retriable handler failed | the claim is released; retry |
//! | idempotent handler failed | reject without requeue (dead-letter / term): never retried |
//! | no usable key, or the key was seen with another payload | reject without requeue, logged with the reason |
//! | the gate could not decide, or could not record a completed run | retry after the unavailable delay; never ack |
//!
//! The fingerprint of every delivery is the SHA-256 of its payload bytes, so a message id reused
//! for another payload is rejected instead of being taken for a duplicate.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use dedupgate_core::keys::{KeyTemplate, RenderError};
use dedupgate_core::op::DURATION_MS_MAX;
use dedupgate_core::{
    ClaimOptions, Clock, Gate, GateError, InvalidInput, Mode, Namespace, Record, Run, RunError,
    State, SystemClock,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

/// Default wait before a duplicate whose key another consumer holds is delivered again.
pub const IN_PROGRESS_RETRY_DEFAULT: Duration = Duration::from_secs(1);
/// Default wait before a delivery the gate could not decide is delivered again.
pub const UNAVAILABLE_RETRY_DEFAULT: Duration = Duration::from_secs(1);

/// Where a delivery's key comes from.
#[derive(Clone, Debug)]
pub enum KeySource {
    /// The broker's message id: AMQP `message_id`, NATS `Nats-Msg-Id`.
    MessageId,
    /// A key template rendered over the JSON payload (API.md "Key templates").
    Template(KeyTemplate),
}

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
    /// The key comes from a template and the payload is not JSON.
    #[error("the payload is not JSON, so key template {template:?} cannot be rendered: {source}")]
    NotJson {
        /// The template.
        template: String,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The template could not be rendered for this payload (a missing or null field, …).
    #[error("key template {template:?}: {source}")]
    Template {
        /// The template.
        template: String,
        /// Which field and why.
        source: RenderError,
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
    /// Deliver it again after `after` (AMQP: wait, then nack with requeue; JetStream: nak with
    /// this delay).
    Retry {
        /// How long to wait.
        after: Duration,
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
    },
    /// The handler failed. Retriable: the claim was released and the message is retried.
    /// Idempotent: the key stays marked and the message is rejected, never retried.
    Failed {
        /// The key.
        key: String,
        /// The handler's error.
        error: E,
        /// The ordering, which decides the action.
        mode: Mode,
    },
    /// The handler ran but the gate could not record its completion (store down, lease lost):
    /// the message is retried, so the handler may run again once the lease runs out.
    Unrecorded {
        /// The key.
        key: String,
        /// Why the completion failed.
        error: GateError,
        /// When to deliver it again.
        retry_after: Duration,
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
            Handled::Ran { .. } | Handled::Duplicate { .. } => Action::Ack,
            Handled::InProgress { retry_after, .. } => Action::Retry {
                after: *retry_after,
            },
            Handled::Failed {
                mode: Mode::Retriable,
                ..
            } => Action::Retry {
                after: Duration::ZERO,
            },
            Handled::Failed {
                mode: Mode::Idempotent,
                ..
            } => Action::Reject,
            Handled::Unrecorded { retry_after, .. } | Handled::Unavailable { retry_after, .. } => {
                Action::Retry {
                    after: *retry_after,
                }
            }
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
            Handled::InProgress { key, retry_after } => write!(
                f,
                "{key}: duplicate, in progress elsewhere; retry in {} ms",
                retry_after.as_millis()
            ),
            Handled::Failed { key, error, mode } => write!(
                f,
                "{key}: handler failed ({mode:?}, {}): {error}",
                if *mode == Mode::Retriable {
                    "released, retried"
                } else {
                    "rejected, not retried"
                }
            ),
            Handled::Unrecorded { key, error, .. } => {
                write!(f, "{key}: ran, completion not recorded, retried: {error}")
            }
            Handled::Unavailable { key, error, .. } => {
                write!(f, "{key}: gate unavailable, retried: {error}")
            }
            Handled::Rejected(why) => write!(f, "rejected: {why}"),
        }
    }
}

/// One delivery as the handler sees it.
#[derive(Clone, Debug)]
pub struct Message {
    /// The dedup key.
    pub key: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// True when the broker says this is a redelivery.
    pub redelivered: bool,
}

impl Message {
    /// The payload parsed as JSON.
    pub fn json<V: DeserializeOwned>(&self) -> Result<V, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// A [`Gate`] set up for one consumer group: namespace, ordering, key source and retry delays.
/// Clones share the gate.
#[derive(Clone, Debug)]
pub struct ConsumerGate {
    gate: Gate,
    namespace: String,
    mode: Mode,
    key: KeySource,
    ttl_ms: Option<u64>,
    lease_ms: Option<u64>,
    in_progress_retry: Duration,
    unavailable_retry: Duration,
}

impl ConsumerGate {
    /// Retriable mode, keyed by message id, default ttl, lease and delays. Fails when
    /// `namespace` is not a valid namespace (1..=128 bytes of `[A-Za-z0-9._:-]`).
    pub fn new(gate: Gate, namespace: &str) -> Result<Self, InvalidInput> {
        Namespace::new(namespace)?;
        Ok(Self {
            gate,
            namespace: namespace.to_owned(),
            mode: Mode::Retriable,
            key: KeySource::MessageId,
            ttl_ms: None,
            lease_ms: None,
            in_progress_retry: IN_PROGRESS_RETRY_DEFAULT,
            unavailable_retry: UNAVAILABLE_RETRY_DEFAULT,
        })
    }

    /// Sets the ordering.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Takes keys from a template over the JSON payload instead of the message id.
    pub fn key_template(mut self, template: KeyTemplate) -> Self {
        self.key = KeySource::Template(template);
        self
    }

    /// Record retention (default: the gate's): 1 ms to 10 years, refused otherwise here rather
    /// than on every delivery.
    pub fn ttl(mut self, ttl: Duration) -> Result<Self, InvalidInput> {
        self.ttl_ms = Some(duration_ms("ttl", ttl)?);
        Ok(self)
    }

    /// Claim lease in retriable mode (default: the gate's), 1 ms to 10 years. The gate renews it
    /// while the handler runs; a consumer that dies loses it after this long and a redelivery
    /// takes over.
    pub fn lease(mut self, lease: Duration) -> Result<Self, InvalidInput> {
        self.lease_ms = Some(duration_ms("lease", lease)?);
        Ok(self)
    }

    /// How long a duplicate of a key held by another consumer waits before it is delivered
    /// again (capped by the holder's remaining lease).
    pub fn in_progress_retry(mut self, delay: Duration) -> Self {
        self.in_progress_retry = delay;
        self
    }

    /// How long a delivery waits before it is delivered again when the gate cannot decide.
    pub fn unavailable_retry(mut self, delay: Duration) -> Self {
        self.unavailable_retry = delay;
        self
    }

    /// The gate underneath.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The key of a delivery, from its message id or its payload. `id_field` names the id's
    /// property or header, for the rejection message.
    pub fn key_for(
        &self,
        message_id: Option<&str>,
        id_field: &'static str,
        payload: &[u8],
    ) -> Result<String, Rejection> {
        match &self.key {
            KeySource::MessageId => match message_id {
                Some(id) if !id.is_empty() => Ok(id.to_owned()),
                _ => Err(Rejection::NoMessageId { field: id_field }),
            },
            KeySource::Template(template) => {
                let event: serde_json::Value =
                    serde_json::from_slice(payload).map_err(|source| Rejection::NotJson {
                        template: template.as_str().to_owned(),
                        source,
                    })?;
                let now_ms = i64::try_from(SystemClock::default().now_ms()).unwrap_or(i64::MAX);
                template
                    .render(&event, now_ms)
                    .map_err(|source| Rejection::Template {
                        template: template.as_str().to_owned(),
                        source,
                    })
            }
        }
    }

    /// Runs `handler` for one delivery through the gate and says what happened; the broker
    /// adapters ([`rabbitmq::handle`], [`nats::handle`]) then act on [`Handled::action`].
    /// Every outcome but `Ran` and `Duplicate` is logged (tracing) with its reason.
    pub async fn process<H, Fut, T, E>(
        &self,
        message_id: Option<&str>,
        id_field: &'static str,
        payload: &[u8],
        redelivered: bool,
        handler: H,
    ) -> Handled<T, E>
    where
        H: FnOnce(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize,
        E: fmt::Display,
    {
        let key = match self.key_for(message_id, id_field, payload) {
            Ok(key) => key,
            Err(why) => return self.logged(Handled::Rejected(why)),
        };
        let opts = ClaimOptions {
            ttl_ms: self.ttl_ms,
            lease_ms: self.lease_ms,
            fingerprint: Some(hex::encode(Sha256::digest(payload))),
            owner: None,
        };
        // The payload is copied for the handler only when it runs, not for duplicates.
        let run = self
            .gate
            .run_with(&self.namespace, &key, self.mode, opts, || {
                handler(Message {
                    key: key.clone(),
                    payload: payload.to_vec(),
                    redelivered,
                })
            })
            .await;
        let handled = match run {
            Ok(Run::Ran(value)) => Handled::Ran { key, value },
            Ok(Run::Duplicate(record)) => match (record.state, record.lease_expires_at_ms) {
                (State::InProgress, lease_end_ms) => {
                    let retry_after = self.in_progress_delay(lease_end_ms);
                    Handled::InProgress { key, retry_after }
                }
                (State::Completed, _) => Handled::Duplicate { key, record },
            },
            Err(RunError::Handler(error)) => Handled::Failed {
                key,
                error,
                mode: self.mode,
            },
            Err(RunError::Unrecorded { error }) => Handled::Unrecorded {
                key,
                error,
                retry_after: self.unavailable_retry,
            },
            Err(RunError::Gate(GateError::FingerprintMismatch)) => {
                Handled::Rejected(Rejection::FingerprintMismatch { key })
            }
            // Only the message's own key can make it invalid (the namespace was checked when the
            // consumer was built): anything else is this consumer's configuration, which must
            // not cost the message; it is retried (and logged) like an undecided one.
            Err(RunError::Gate(GateError::Invalid(invalid))) if invalid.field == "key" => {
                Handled::Rejected(Rejection::InvalidKey(invalid))
            }
            // Store errors and anything else the gate could not decide: fail closed, retry.
            Err(RunError::Gate(error)) => Handled::Unavailable {
                key,
                error,
                retry_after: self.unavailable_retry,
            },
        };
        self.logged(handled)
    }

    /// The in-progress delay, capped by the holder's remaining lease so that a crashed holder's
    /// key is retried as soon as it can be taken over.
    fn in_progress_delay(&self, lease_end_ms: Option<u64>) -> Duration {
        let Some(lease_end_ms) = lease_end_ms else {
            return self.in_progress_retry;
        };
        let left_ms = lease_end_ms.saturating_sub(SystemClock::default().now_ms());
        self.in_progress_retry.min(Duration::from_millis(left_ms))
    }

    fn logged<T, E: fmt::Display>(&self, handled: Handled<T, E>) -> Handled<T, E> {
        let ns = self.namespace.as_str();
        match &handled {
            Handled::Ran { .. } | Handled::Duplicate { .. } | Handled::InProgress { .. } => {
                tracing::debug!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            Handled::Failed { .. } | Handled::Unrecorded { .. } | Handled::Unavailable { .. } => {
                tracing::warn!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            Handled::Rejected(_) => {
                tracing::error!(namespace = ns, outcome = handled.label(), "{handled}");
            }
        }
        handled
    }
}

/// A duration in the gate's range (whole milliseconds, 1 ms to 10 years).
fn duration_ms(field: &'static str, d: Duration) -> Result<u64, InvalidInput> {
    match u64::try_from(d.as_millis()) {
        Ok(ms) if (1..=DURATION_MS_MAX).contains(&ms) => Ok(ms),
        _ => Err(InvalidInput::new(
            field,
            format!("must be 1 ms to {DURATION_MS_MAX} ms, got {d:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::MemoryStore;

    fn consumer() -> ConsumerGate {
        ConsumerGate::new(Gate::new(MemoryStore::new()), "orders").unwrap()
    }

    /// A retention or lease the gate would refuse is a configuration error when the consumer
    /// is built, not a reason to reject every delivery (which a queue without a dead-letter
    /// exchange would drop).
    #[test]
    fn out_of_range_ttl_and_lease_are_refused_when_the_consumer_is_built() {
        for bad in [
            Duration::ZERO,
            Duration::from_micros(999),
            Duration::from_secs(20 * 365 * 86_400),
        ] {
            let Err(ttl) = consumer().ttl(bad) else {
                panic!("ttl {bad:?} accepted")
            };
            assert_eq!(ttl.field, "ttl", "{bad:?}");
            let Err(lease) = consumer().lease(bad) else {
                panic!("lease {bad:?} accepted")
            };
            assert_eq!(lease.field, "lease", "{bad:?}");
        }
        let ok = consumer()
            .ttl(Duration::from_secs(86_400))
            .and_then(|c| c.lease(Duration::from_millis(1)))
            .expect("in range");
        assert_eq!((ok.ttl_ms, ok.lease_ms), (Some(86_400_000), Some(1)));
    }
}
