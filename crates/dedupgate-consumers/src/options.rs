//! A consumer's settings: where keys come from, the retry delays and the failure policy, with
//! their defaults and bounds, and the [`ConsumerGate`] builder methods that check them.

use std::time::Duration;

use dedupgate_core::keys::KeyTemplate;
use dedupgate_core::model::TAG_BYTES_MAX;
use dedupgate_core::op::DURATION_MS_MAX;
use dedupgate_core::{Gate, InvalidInput, Mode, Namespace};

use crate::ConsumerGate;

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

/// Where a delivery's key comes from.
#[derive(Clone, Debug)]
pub enum KeySource {
    /// The broker's message id: AMQP `message_id`, NATS `Nats-Msg-Id`.
    MessageId,
    /// A key template rendered over the JSON payload (API.md "Key templates").
    Template(KeyTemplate),
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
    use dedupgate_core::{Clock, SystemClock};

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
}
