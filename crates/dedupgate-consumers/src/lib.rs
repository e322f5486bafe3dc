//! # dedupgate-consumers
//!
//! Broker consumers through the gate: each delivery's handler runs at most once per key, the way
//! Apache Camel's idempotent consumer and AWS Powertools' idempotency utility do it, with
//! [`dedupgate_core::Gate::run_with`] making every decision.
//!
//! - [`ConsumerGate`]: a [`Gate`] plus the namespace, the [`Mode`], where the key comes from
//!   ([`KeySource`]: the broker's message id or a [`KeyTemplate`] over the JSON payload), the
//!   retry delays and the [`FailureRetry`] policy for a failed handler.
//!   [`ConsumerGate::process`] turns one delivery (its payload, id and [`Attempt`], the broker's
//!   delivery count) into a [`Handled`] outcome; it knows no broker.
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
//! | duplicate of a key another consumer holds | retry after the in-progress delay (at most the holder's remaining lease, but not under 100 ms) |
//! | retriable handler failed | the claim is released; retry after the failure delay (below), as a failure (AMQP: reject with requeue, which a quorum queue counts; JetStream: nak with the delay) |
//! | retriable handler failed on delivery `max_attempts` (when set, and the broker counts deliveries) | the claim is released; reject without requeue (dead-letter / term), logged with the error |
//! | idempotent handler failed | reject without requeue (dead-letter / term): never retried |
//! | no usable key, or the key was seen with another payload | reject without requeue, logged with the reason |
//! | the gate could not decide (the handler did not run) | retry after the unavailable delay; never ack |
//! | the handler ran, but its completion could not be recorded (the store stayed down while the gate asked again for ~2 s, or the lease was lost) | ack, logged as an error: a redelivery would find the key still held and run the handler again once the lease ran out |
//!
//! The failure delay grows with the broker's delivery count `n` (JetStream: the message's
//! `delivered`; RabbitMQ: `x-delivery-count`, which quorum queues set, or the `rejected` counts of
//! `x-death`, plus one): `initial × 2^(n−1)`, capped at `max` (by default 1 s, 2 s, 4 s, … up to
//! 60 s; [`ConsumerGate::failure_retry`]), plus up to a quarter more at random, so that messages
//! that failed together (a downstream outage) do not all come back in the same instant. When the
//! broker gives no count (a classic RabbitMQ
//! queue's redelivery says only "redelivered") the delay is `initial`, and `max_attempts` cannot
//! apply. `max_attempts` is unset by default: a rejected message is dropped by a queue without a
//! dead-letter exchange, so giving up is the user's choice ([`ConsumerGate::max_attempts`]).
//!
//! When the key is the message id, the delivery's fingerprint is the SHA-256 of its payload
//! bytes, so a message id reused for another payload is rejected instead of being taken for a
//! duplicate. A key template makes the key from the payload, and events it maps to one key are
//! duplicates by design even when the rest of the payload differs (`{ts|window:5m}` merges the
//! events of five minutes), so template keys carry no fingerprint.
//!
//! Every claim names an owner unique to the delivery attempt (`host:pid/nonce-seq`, or
//! [`ConsumerGate::worker`]`/nonce-seq`), so a duplicate finding the key in progress says who
//! holds it. It is never shared by two deliveries: the gate gives a claim naming the holder's own
//! owner back to it, which for a per-consumer owner would let two copies of one message run at
//! once on one consumer.

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use dedupgate_core::keys::{KeyTemplate, RenderError};
use dedupgate_core::model::TAG_BYTES_MAX;
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
/// Shortest wait before a duplicate of a key held elsewhere is delivered again, however little
/// of the holder's lease this host thinks is left (unless the in-progress delay itself is
/// shorter).
pub const IN_PROGRESS_RETRY_FLOOR: Duration = Duration::from_millis(100);
/// Default wait before a delivery the gate could not decide is delivered again.
pub const UNAVAILABLE_RETRY_DEFAULT: Duration = Duration::from_secs(1);
/// Default wait after a retriable handler's first failure (see [`FailureRetry`]).
pub const FAILURE_RETRY_INITIAL_DEFAULT: Duration = Duration::from_secs(1);
/// Default cap of the growing wait after a retriable handler's failures.
pub const FAILURE_RETRY_MAX_DEFAULT: Duration = Duration::from_secs(60);
/// Longest failure delay [`ConsumerGate::failure_retry`] accepts. The RabbitMQ adapter waits the
/// delay while holding the unacked delivery, and RabbitMQ closes the channel of a delivery left
/// unacked past its `consumer_timeout` (30 minutes by default); 10 minutes (12.5 with the
/// jitter) leaves the handler the rest.
pub const FAILURE_RETRY_LIMIT: Duration = Duration::from_secs(600);
/// Longest [`ConsumerGate::worker`] name, in bytes: the owner adds `/`, a 16-digit nonce, `-`
/// and a sequence of up to 20 digits, and must fit the gate's 256-byte owner.
pub const WORKER_BYTES_MAX: usize = 200;
const _: () = assert!(WORKER_BYTES_MAX + 1 + 16 + 1 + 20 <= TAG_BYTES_MAX);

/// How a retriable handler's failures are retried: after `initial × 2^(n−1)` for the broker's
/// `n`-th delivery, capped at `max`; with `max_attempts` set, a failure on delivery
/// `max_attempts` or later is rejected without requeue instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureRetry {
    /// The delay after a failed first delivery (and after any failure the broker does not count).
    pub initial: Duration,
    /// The cap of the delay.
    pub max: Duration,
    /// The delivery whose failure gives up (rejects); `None`: never give up.
    pub max_attempts: Option<u32>,
}

impl Default for FailureRetry {
    fn default() -> Self {
        Self {
            initial: FAILURE_RETRY_INITIAL_DEFAULT,
            max: FAILURE_RETRY_MAX_DEFAULT,
            max_attempts: None,
        }
    }
}

impl FailureRetry {
    /// The delay after a failure of delivery `attempt` (1 = the first); `initial` when the
    /// broker gave no count.
    pub fn delay(&self, attempt: Option<u32>) -> Duration {
        // 31 doublings fit a u32 shift and exceed any accepted cap (FAILURE_RETRY_LIMIT is
        // under 2^20 ms); the multiplication saturates, so a huge count stays at the cap.
        let doublings = attempt.unwrap_or(1).saturating_sub(1).min(31);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// [`FailureRetry::delay`] plus up to a quarter of it more, at random (never less): spreads
    /// the retries of messages that failed together.
    pub fn jittered_delay(&self, attempt: Option<u32>) -> Duration {
        let delay = self.delay(attempt);
        delay + delay.mul_f64(rand::random::<f64>() / 4.0)
    }

    /// True when a failure of delivery `attempt` is the last one allowed.
    pub fn gives_up(&self, attempt: Option<u32>) -> bool {
        matches!((self.max_attempts, attempt), (Some(max), Some(n)) if n >= max)
    }
}

/// Which delivery of a message this is, as far as the broker says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first delivery, `n` for the `n`-th; `None` when the broker says only that it
    /// delivered the message before.
    pub number: Option<u32>,
    /// True when the broker delivered the message before.
    pub redelivered: bool,
}

impl Attempt {
    /// The first delivery.
    pub const FIRST: Attempt = Attempt {
        number: Some(1),
        redelivered: false,
    };

    /// The `n`-th delivery (a count of 0 is taken for 1).
    pub fn nth(n: u32) -> Self {
        let n = n.max(1);
        Self {
            number: Some(n),
            redelivered: n > 1,
        }
    }

    /// From a redelivered flag alone: the first delivery when false, an uncounted one when true.
    pub fn from_redelivered(redelivered: bool) -> Self {
        if redelivered {
            Self {
                number: None,
                redelivered: true,
            }
        } else {
            Self::FIRST
        }
    }
}

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
    /// `retry_after`, or, on delivery `max_attempts`, rejected without requeue. Idempotent: the
    /// key stays marked and the message is rejected, never retried.
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

/// One delivery as the handler sees it.
#[derive(Clone, Debug)]
pub struct Message {
    /// The dedup key.
    pub key: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// True when the broker says this is a redelivery.
    pub redelivered: bool,
    /// Which delivery this is (1 = the first), when the broker counts them.
    pub attempt: Option<u32>,
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
    failure_retry: FailureRetry,
    worker: String,
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
            failure_retry: FailureRetry::default(),
            worker: default_worker(),
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
    /// again (capped by the holder's remaining lease, but never below
    /// [`IN_PROGRESS_RETRY_FLOOR`] or this delay, whichever is shorter). Refused unless 1 ms ≤
    /// `delay` ≤ [`FAILURE_RETRY_LIMIT`]: a zero delay would spin.
    pub fn in_progress_retry(mut self, delay: Duration) -> Result<Self, InvalidInput> {
        self.in_progress_retry = retry_delay("in_progress_retry", delay)?;
        Ok(self)
    }

    /// How long a delivery waits before it is delivered again when the gate cannot decide.
    /// Refused unless 1 ms ≤ `delay` ≤ [`FAILURE_RETRY_LIMIT`]: a zero delay would spin.
    pub fn unavailable_retry(mut self, delay: Duration) -> Result<Self, InvalidInput> {
        self.unavailable_retry = retry_delay("unavailable_retry", delay)?;
        Ok(self)
    }

    /// The delays after a retriable handler's failures: `initial` after a failed first
    /// delivery, doubling with each further delivery the broker counts, capped at `max`
    /// (defaults 1 s and 60 s), each plus up to a quarter more at random. Refused unless 1 ms ≤ `initial` ≤ `max` ≤
    /// [`FAILURE_RETRY_LIMIT`]: a zero delay is what makes a poison message spin.
    pub fn failure_retry(mut self, initial: Duration, max: Duration) -> Result<Self, InvalidInput> {
        if initial < Duration::from_millis(1) {
            return Err(InvalidInput::new(
                "failure_retry_initial",
                format!("must be at least 1 ms, got {initial:?}"),
            ));
        }
        if max < initial || max > FAILURE_RETRY_LIMIT {
            return Err(InvalidInput::new(
                "failure_retry_max",
                format!(
                    "must be from the initial delay ({initial:?}) to {FAILURE_RETRY_LIMIT:?}, got {max:?}"
                ),
            ));
        }
        self.failure_retry.initial = initial;
        self.failure_retry.max = max;
        Ok(self)
    }

    /// Gives up on a retriable message whose handler failed on its `n`-th delivery or later:
    /// the claim is released and the message rejected without requeue (dead-lettered; dropped
    /// by a queue without a dead-letter exchange; JetStream: term), logged with the error.
    /// Counts are the broker's, which include every requeue, not only failures: deliveries
    /// requeued because another consumer held the key or because the gate was unavailable
    /// (JetStream; RabbitMQ quorum queues before 4.0). A store outage of a minute at the default
    /// 1 s unavailable retry adds about 60, so set `n` well above the requeues an outage can
    /// cause, or a message may be given up on its first real failure (its failure delay then
    /// also starts near the cap). A broker that gives no count (a classic RabbitMQ queue)
    /// never reaches it. Unset by default. Refused when 0.
    pub fn max_attempts(mut self, n: u32) -> Result<Self, InvalidInput> {
        if n == 0 {
            return Err(InvalidInput::new(
                "max_attempts",
                "must be at least 1, got 0",
            ));
        }
        self.failure_retry.max_attempts = Some(n);
        Ok(self)
    }

    /// Names this consumer in the owner of its claims (default `host:pid`), for the answers
    /// and logs that say who holds a key: 1..=[`WORKER_BYTES_MAX`] bytes. Each claim adds a
    /// suffix unique to the delivery, so consumers may share a name.
    pub fn worker(mut self, name: &str) -> Result<Self, InvalidInput> {
        if name.is_empty() || name.len() > WORKER_BYTES_MAX {
            return Err(InvalidInput::new(
                "worker",
                format!("must be 1..={WORKER_BYTES_MAX} bytes, got {}", name.len()),
            ));
        }
        self.worker = name.to_owned();
        Ok(self)
    }

    /// The failure retry policy in force.
    pub fn failure_policy(&self) -> FailureRetry {
        self.failure_retry
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
                    serde_json::from_slice(payload).map_err(|cause| Rejection::NotJson {
                        template: template.as_str().to_owned(),
                        cause,
                    })?;
                let now_ms = i64::try_from(SystemClock::default().now_ms()).unwrap_or(i64::MAX);
                template
                    .render(&event, now_ms)
                    .map_err(|cause| Rejection::Template {
                        template: template.as_str().to_owned(),
                        cause,
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
        attempt: Attempt,
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
            // See the crate's docs: a template's key already says which payloads are one event.
            fingerprint: match self.key {
                KeySource::MessageId => Some(hex::encode(Sha256::digest(payload))),
                KeySource::Template(_) => None,
            },
            owner: Some(self.attempt_owner()),
        };
        // The payload is copied for the handler only when it runs, not for duplicates.
        let run = self
            .gate
            .run_with(&self.namespace, &key, self.mode, opts, || {
                handler(Message {
                    key: key.clone(),
                    payload: payload.to_vec(),
                    redelivered: attempt.redelivered,
                    attempt: attempt.number,
                })
            })
            .await;
        let handled = match run {
            Ok(Run::Ran(value)) => Handled::Ran { key, value },
            Ok(Run::Duplicate(record)) => match record.state {
                State::InProgress => Handled::InProgress {
                    key,
                    retry_after: self.in_progress_delay(record.lease_expires_at_ms),
                    holder: record.owner,
                },
                State::Completed => Handled::Duplicate { key, record },
            },
            Err(RunError::Handler(error)) => self.failed(key, error, None, attempt.number),
            Err(RunError::HandlerUnreleased { error, release }) => {
                self.failed(key, error, Some(release), attempt.number)
            }
            Err(RunError::Unrecorded { error }) => Handled::Unrecorded { key, error },
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

    /// A failed handler: retried after the failure delay, or (idempotent mode, or the last
    /// attempt allowed) rejected.
    fn failed<T, E>(
        &self,
        key: String,
        error: E,
        unreleased: Option<GateError>,
        attempt: Option<u32>,
    ) -> Handled<T, E> {
        let policy = &self.failure_retry;
        let retry_after = match self.mode {
            Mode::Idempotent => None,
            Mode::Retriable if policy.gives_up(attempt) => None,
            Mode::Retriable => Some(policy.jittered_delay(attempt)),
        };
        Handled::Failed {
            key,
            error,
            mode: self.mode,
            attempt,
            retry_after,
            unreleased,
        }
    }

    /// The in-progress delay, capped by the holder's remaining lease so that a crashed holder's
    /// key is retried as soon as it can be taken over. The lease is on the store's clock and
    /// `left` on this host's: a host ahead of the store would compute nothing left while the
    /// holder still holds the key, so the delay keeps a floor instead of redelivering at once.
    fn in_progress_delay(&self, lease_end_ms: Option<u64>) -> Duration {
        let Some(lease_end_ms) = lease_end_ms else {
            return self.in_progress_retry;
        };
        let left =
            Duration::from_millis(lease_end_ms.saturating_sub(SystemClock::default().now_ms()));
        let floor = self.in_progress_retry.min(IN_PROGRESS_RETRY_FLOOR);
        self.in_progress_retry.min(left).max(floor)
    }

    /// The owner of one claim: this consumer's name, a per-process nonce and a per-process
    /// sequence. No two claims share it, so the gate's same-owner re-claim (which gives the
    /// holder its claim back) never lets a second copy of a message run beside the first. The
    /// nonce keeps two processes apart that share host and pid (containers on the host's
    /// network).
    fn attempt_owner(&self) -> String {
        static NONCE: OnceLock<u64> = OnceLock::new();
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        // RandomState's keys come from the operating system's random source: no extra
        // dependency for 64 bits that only need to differ between processes.
        let nonce = *NONCE.get_or_init(|| {
            std::collections::hash_map::RandomState::new().hash_one(std::process::id())
        });
        let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        format!("{}/{nonce:016x}-{seq}", self.worker)
    }

    fn logged<T, E: fmt::Display>(&self, handled: Handled<T, E>) -> Handled<T, E> {
        let ns = self.namespace.as_str();
        match &handled {
            Handled::Ran { .. } | Handled::Duplicate { .. } | Handled::InProgress { .. } => {
                tracing::debug!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            // Giving up drops the message unless the queue dead-letters it: an error.
            Handled::Failed {
                mode: Mode::Retriable,
                retry_after: None,
                ..
            } => {
                tracing::error!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            // Acked, but the key stays held and then expires without its result.
            Handled::Unrecorded { .. } => {
                tracing::error!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            Handled::Failed { .. } | Handled::Unavailable { .. } => {
                tracing::warn!(namespace = ns, outcome = handled.label(), "{handled}");
            }
            Handled::Rejected(_) => {
                tracing::error!(namespace = ns, outcome = handled.label(), "{handled}");
            }
        }
        handled
    }
}

/// This host and process, `host:pid`, the default [`ConsumerGate::worker`] name (as
/// `dedupgate run` names its owner).
fn default_worker() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "localhost".to_owned());
    let mut worker = format!("{host}:{}", std::process::id());
    if worker.len() > WORKER_BYTES_MAX {
        // Cut on a character boundary: a long non-ASCII hostname must not panic.
        let mut cut = WORKER_BYTES_MAX;
        while !worker.is_char_boundary(cut) {
            cut -= 1;
        }
        worker.truncate(cut);
    }
    worker
}

/// A retry delay, checked: 1 ms to [`FAILURE_RETRY_LIMIT`].
fn retry_delay(field: &'static str, delay: Duration) -> Result<Duration, InvalidInput> {
    if delay < Duration::from_millis(1) || delay > FAILURE_RETRY_LIMIT {
        return Err(InvalidInput::new(
            field,
            format!("must be from 1 ms to {FAILURE_RETRY_LIMIT:?}, got {delay:?}"),
        ));
    }
    Ok(delay)
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

    #[test]
    fn failure_retry_ranges_are_refused_when_the_consumer_is_built() {
        let ms = Duration::from_millis;
        for (initial, max, field) in [
            (Duration::ZERO, ms(10), "failure_retry_initial"),
            (Duration::from_micros(999), ms(10), "failure_retry_initial"),
            (ms(20), ms(10), "failure_retry_max"),
            (ms(1), FAILURE_RETRY_LIMIT + ms(1), "failure_retry_max"),
        ] {
            let Err(e) = consumer().failure_retry(initial, max) else {
                panic!("{initial:?}..{max:?} accepted")
            };
            assert_eq!(e.field, field, "{initial:?}..{max:?}");
        }
        let Err(e) = consumer().max_attempts(0) else {
            panic!("max_attempts 0 accepted")
        };
        assert_eq!(e.field, "max_attempts");
        for bad in [String::new(), "w".repeat(WORKER_BYTES_MAX + 1)] {
            let Err(e) = consumer().worker(&bad) else {
                panic!("worker of {} bytes accepted", bad.len())
            };
            assert_eq!(e.field, "worker");
        }
        let ok = consumer()
            .failure_retry(ms(1), FAILURE_RETRY_LIMIT)
            .and_then(|c| c.max_attempts(1))
            .and_then(|c| c.worker(&"w".repeat(WORKER_BYTES_MAX)))
            .expect("in range");
        assert_eq!(
            ok.failure_policy(),
            FailureRetry {
                initial: ms(1),
                max: FAILURE_RETRY_LIMIT,
                max_attempts: Some(1)
            }
        );
        assert_eq!(consumer().failure_policy(), FailureRetry::default());
        assert_eq!(FailureRetry::default().max_attempts, None);
    }

    #[test]
    fn the_failure_delay_doubles_per_counted_delivery_up_to_the_cap() {
        let ms = Duration::from_millis;
        let policy = FailureRetry {
            initial: ms(10),
            max: ms(50),
            max_attempts: Some(3),
        };
        let delays: Vec<_> = [
            None,
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(u32::MAX),
        ]
        .into_iter()
        .map(|n| policy.delay(n))
        .collect();
        assert_eq!(
            delays,
            [ms(10), ms(10), ms(10), ms(20), ms(40), ms(50), ms(50)]
        );
        let big = FailureRetry {
            initial: FAILURE_RETRY_LIMIT,
            max: FAILURE_RETRY_LIMIT,
            max_attempts: None,
        };
        assert_eq!(big.delay(Some(u32::MAX)), FAILURE_RETRY_LIMIT);
        // Jitter: never below the delay, at most a quarter above, and not one fixed value.
        let jittered: std::collections::BTreeSet<Duration> =
            (0..64).map(|_| policy.jittered_delay(Some(3))).collect();
        assert!(
            jittered.iter().all(|d| *d >= ms(40) && *d <= ms(50)),
            "{jittered:?}"
        );
        assert!(jittered.len() > 1, "no jitter: {jittered:?}");
        let gives_up: Vec<_> = [None, Some(1), Some(2), Some(3), Some(9)]
            .into_iter()
            .map(|n| policy.gives_up(n))
            .collect();
        assert_eq!(gives_up, [false, false, false, true, true]);
        assert!(!FailureRetry::default().gives_up(Some(u32::MAX)));
    }

    /// The decision alone, over the reference store: a failing retriable handler is retried
    /// with growing delays as a failure, given up (released, rejected) on `max_attempts`, and
    /// never given up when the broker does not count deliveries.
    #[tokio::test]
    async fn a_failing_handler_backs_off_then_is_rejected_with_the_claim_released() {
        let ms = Duration::from_millis;
        let gate = consumer()
            .failure_retry(ms(10), ms(25))
            .and_then(|c| c.max_attempts(4))
            .unwrap();
        let fail = |_msg: Message| async { Err::<(), _>("poison") };
        let mut actions = Vec::new();
        for n in 1..=4 {
            let handled = gate
                .process(Some("o-1"), "id", b"{}", Attempt::nth(n), fail)
                .await;
            assert_eq!(handled.label(), "failed");
            actions.push(handled.action());
        }
        // Each delay, plus up to a quarter of jitter.
        let retry_within = |action: &Action, delay: Duration| {
            matches!(action, Action::Retry { after, failure: true }
                if *after >= delay && *after <= delay + delay / 4)
        };
        assert!(retry_within(&actions[0], ms(10)), "{actions:?}");
        assert!(retry_within(&actions[1], ms(20)), "{actions:?}");
        assert!(retry_within(&actions[2], ms(25)), "{actions:?}");
        assert_eq!(actions[3], Action::Reject);
        assert_eq!(gate.gate().get("orders", "o-1").await.unwrap(), None);
        let uncounted = gate
            .process(
                Some("o-1"),
                "id",
                b"{}",
                Attempt::from_redelivered(true),
                fail,
            )
            .await;
        assert!(retry_within(&uncounted.action(), ms(10)), "{uncounted}");
        assert!(uncounted.to_string().contains("delivery count unknown"));
        let idempotent = consumer().mode(Mode::Idempotent);
        let handled = idempotent
            .process(Some("o-2"), "id", b"{}", Attempt::FIRST, fail)
            .await;
        assert_eq!(handled.action(), Action::Reject);
    }

    #[test]
    fn retry_delays_are_refused_out_of_range_and_in_progress_ones_keep_a_floor() {
        let ms = Duration::from_millis;
        for bad in [
            Duration::ZERO,
            Duration::from_micros(999),
            FAILURE_RETRY_LIMIT + ms(1),
        ] {
            let Err(e) = consumer().in_progress_retry(bad) else {
                panic!("in-progress delay {bad:?} accepted")
            };
            assert_eq!(e.field, "in_progress_retry");
            let Err(e) = consumer().unavailable_retry(bad) else {
                panic!("unavailable delay {bad:?} accepted")
            };
            assert_eq!(e.field, "unavailable_retry");
        }
        let now = SystemClock::default().now_ms();
        let gate = consumer();
        // A holder with 10 s left: the in-progress delay (1 s by default) as configured.
        assert_eq!(
            gate.in_progress_delay(Some(now + 10_000)),
            IN_PROGRESS_RETRY_DEFAULT
        );
        // A lease this host sees as ended (or as ending within the floor): not at once.
        assert_eq!(
            gate.in_progress_delay(Some(now - 5_000)),
            IN_PROGRESS_RETRY_FLOOR
        );
        // A configured delay below the floor is kept.
        let quick = consumer().in_progress_retry(ms(20)).unwrap();
        assert_eq!(quick.in_progress_delay(Some(now - 5_000)), ms(20));
    }

    /// A template's key says which payloads are one event: events it maps to one key are
    /// duplicates even when the rest of the payload differs. With the message id as the key, a
    /// reused id with another payload is still refused.
    #[tokio::test]
    async fn template_keys_take_no_fingerprint_and_message_ids_do() {
        let template = KeyTemplate::parse("{asset}_{ts|window:5m}").unwrap();
        let gate = consumer().key_template(template);
        let ran = |n: u8| move |_msg: Message| async move { Ok::<_, String>(n) };
        let first = br#"{"asset":"BTC","ts":"2026-11-22T10:01:00Z"}"#;
        let later = br#"{"asset":"BTC","ts":"2026-11-22T10:03:00Z"}"#;
        let a = gate
            .process(None, "id", first, Attempt::FIRST, ran(1))
            .await;
        assert!(matches!(a, Handled::Ran { value: 1, .. }), "{a}");
        let b = gate
            .process(None, "id", later, Attempt::FIRST, ran(2))
            .await;
        assert!(matches!(b, Handled::Duplicate { .. }), "{b}");
        assert_eq!(b.action(), Action::Ack);

        let gate = consumer();
        let a = gate
            .process(Some("m-1"), "id", first, Attempt::FIRST, ran(1))
            .await;
        assert!(matches!(a, Handled::Ran { .. }), "{a}");
        let b = gate
            .process(Some("m-1"), "id", later, Attempt::FIRST, ran(2))
            .await;
        assert!(
            matches!(b, Handled::Rejected(Rejection::FingerprintMismatch { .. })),
            "{b}"
        );
    }

    /// A processed message's key blocks redeliveries for the consumer's ttl, also when the ttl
    /// is shorter than the lease (the completed record kept the lease's expiry).
    #[tokio::test]
    async fn a_processed_key_is_free_once_its_ttl_ends_even_below_the_lease() {
        let clock = dedupgate_core::ManualClock::new(1_000_000);
        let store = MemoryStore::with_clock(std::sync::Arc::new(clock.clone()));
        let gate = ConsumerGate::new(Gate::new(store), "orders")
            .unwrap()
            .ttl(Duration::from_secs(2))
            .unwrap()
            .lease(Duration::from_secs(30))
            .unwrap();
        let ran = |n: u8| move |_msg: Message| async move { Ok::<_, String>(n) };
        let deliver = |n| gate.process(Some("m-1"), "id", b"{}", Attempt::FIRST, ran(n));
        let a = deliver(1).await;
        assert!(matches!(a, Handled::Ran { value: 1, .. }), "{a}");
        clock.advance(1_000);
        let b = deliver(2).await;
        assert!(
            matches!(b, Handled::Duplicate { .. }),
            "within the ttl: {b}"
        );
        clock.advance(1_500);
        let c = deliver(3).await;
        assert!(
            matches!(c, Handled::Ran { value: 3, .. }),
            "after the ttl: {c}"
        );
    }

    /// A handler that ran is acked even when its completion could not be recorded: requeuing
    /// it would run it again once the lease ran out.
    #[tokio::test]
    async fn a_run_whose_completion_was_not_recorded_is_acked() {
        let gate = consumer();
        let inner = gate.clone();
        // The record is forgotten under the holder, so the completion finds no claim.
        let handled = gate
            .process(
                Some("o-9"),
                "id",
                b"{}",
                Attempt::FIRST,
                |_msg| async move {
                    inner.gate.forget("orders", "o-9").await.unwrap();
                    Ok::<_, String>(())
                },
            )
            .await;
        assert!(
            matches!(
                handled,
                Handled::Unrecorded {
                    error: GateError::LeaseLost,
                    ..
                }
            ),
            "{handled}"
        );
        assert_eq!(handled.action(), Action::Ack);
    }

    /// Two copies of one message on one consumer at once: the second finds the key held by
    /// the first, named, and does not run. Each claim's owner is unique to its delivery, so
    /// the gate's same-owner re-claim cannot hand the second copy the first one's claim.
    #[tokio::test]
    async fn a_second_copy_on_the_same_consumer_does_not_run_beside_the_first() {
        let gate = consumer().worker("worker-7").unwrap();
        let inner = gate.clone();
        let handled = gate
            .process(
                Some("o-1"),
                "id",
                b"{}",
                Attempt::FIRST,
                |_msg| async move {
                    let copy = inner
                        .process(Some("o-1"), "id", b"{}", Attempt::FIRST, |_msg| async {
                            Ok::<_, String>("the copy ran beside the first")
                        })
                        .await;
                    Ok::<_, String>(copy.to_string())
                },
            )
            .await;
        let Handled::Ran { value, .. } = handled else {
            panic!("the first copy: {handled}")
        };
        assert!(
            value.starts_with("o-1: duplicate, in progress elsewhere (held by worker-7/"),
            "{value}"
        );
    }
}
