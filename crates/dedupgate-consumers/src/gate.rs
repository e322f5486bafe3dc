//! [`ConsumerGate`]: one delivery through the gate, from its key to its [`Handled`] outcome (the
//! claim's owner, the fingerprint, the in-progress delay and the failure policy applied, logged).

use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use dedupgate_core::{
    ClaimOptions, Clock, Gate, GateError, Mode, Run, RunError, State, SystemClock,
};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::{
    Attempt, FailureRetry, Handled, KeySource, Message, Permanence, Rejection,
    IN_PROGRESS_RETRY_FLOOR,
};

/// A [`Gate`] set up for one consumer group: namespace, ordering, key source and retry delays.
/// Clones share the gate.
#[derive(Clone, Debug)]
pub struct ConsumerGate {
    pub(crate) gate: Gate,
    pub(crate) namespace: String,
    pub(crate) mode: Mode,
    pub(crate) key: KeySource,
    pub(crate) ttl_ms: Option<u64>,
    pub(crate) lease_ms: Option<u64>,
    pub(crate) in_progress_retry: Duration,
    pub(crate) unavailable_retry: Duration,
    pub(crate) failure_retry: FailureRetry,
    pub(crate) worker: String,
}

impl ConsumerGate {
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
    /// adapters ([`rabbitmq::handle`](crate::rabbitmq::handle), [`nats::handle`](crate::nats::handle)) then act on [`Handled::action`].
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
        E: fmt::Display + Permanence,
    {
        let key = self.key_for(message_id, id_field, payload);
        self.process_key(key, payload, attempt, handler).await
    }

    /// [`ConsumerGate::process`] for an adapter that makes the key itself (Kafka: from a
    /// record header, or a template over the payload and the headers): `key` is that key, or
    /// why none could be made (the delivery is then rejected). The fingerprint follows
    /// [`KeySource`] as in `process`: the payload's hash unless the key comes from a template.
    pub async fn process_key<H, Fut, T, E>(
        &self,
        key: Result<String, Rejection>,
        payload: &[u8],
        attempt: Attempt,
        handler: H,
    ) -> Handled<T, E>
    where
        H: FnOnce(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize,
        E: fmt::Display + Permanence,
    {
        let key = match key {
            Ok(key) => key,
            Err(why) => return self.logged(Handled::Rejected(why)),
        };
        let opts = self.claim_options(payload);
        // The payload is copied for the handler only when it runs, not for duplicates.
        let run = self
            .gate
            .run_fenced(&self.namespace, &key, self.mode, opts, |fence| {
                handler(Message {
                    key: key.clone(),
                    payload: payload.to_vec(),
                    redelivered: attempt.redelivered,
                    attempt: attempt.number,
                    fence,
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

    /// The options of one claim of a delivery with `payload`: this consumer's ttl and lease,
    /// the payload's fingerprint (unless the key comes from a template) and an owner unique to
    /// the attempt.
    pub(crate) fn claim_options(&self, payload: &[u8]) -> ClaimOptions {
        ClaimOptions {
            ttl_ms: self.ttl_ms,
            lease_ms: self.lease_ms,
            // See the crate's docs: a template's key already says which payloads are one event.
            fingerprint: match self.key {
                KeySource::MessageId => Some(hex::encode(Sha256::digest(payload))),
                KeySource::Template(_) => None,
            },
            owner: Some(self.attempt_owner()),
        }
    }

    /// A failed handler: retried after the failure delay, or (idempotent mode, the last
    /// attempt allowed, or an error that would come back alike) rejected.
    fn failed<T, E: Permanence>(
        &self,
        key: String,
        error: E,
        unreleased: Option<GateError>,
        attempt: Option<u32>,
    ) -> Handled<T, E> {
        let policy = &self.failure_retry;
        let permanent = error.is_permanent();
        let retry_after = match self.mode {
            Mode::Idempotent => None,
            Mode::Retriable if permanent => None,
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
            permanent,
        }
    }

    /// Where keys come from.
    pub fn key_source(&self) -> &KeySource {
        &self.key
    }

    /// The wait after a delivery the gate could not decide (also the Kafka consumer's wait
    /// before it tries a failed dead-letter publish again).
    pub fn unavailable_delay(&self) -> Duration {
        self.unavailable_retry
    }

    /// The in-progress delay, capped by the holder's remaining lease so that a crashed holder's
    /// key is retried as soon as it can be taken over. The lease is on the store's clock and
    /// `left` on this host's: a host ahead of the store would compute nothing left while the
    /// holder still holds the key, so the delay keeps a floor instead of redelivering at once.
    pub(crate) fn in_progress_delay(&self, lease_end_ms: Option<u64>) -> Duration {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Action;
    use dedupgate_core::keys::KeyTemplate;
    use dedupgate_core::MemoryStore;

    fn consumer() -> ConsumerGate {
        ConsumerGate::new(Gate::new(MemoryStore::new()), "orders").unwrap()
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

    /// An error that says it would fail alike every time ([`Permanence`]) is rejected on its
    /// first delivery in retriable mode, the claim released, whatever `max_attempts` allows.
    #[tokio::test]
    async fn a_permanent_failure_is_rejected_at_once_with_the_claim_released() {
        struct Refused;
        impl fmt::Display for Refused {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("cannot carry it")
            }
        }
        impl Permanence for Refused {
            fn is_permanent(&self) -> bool {
                true
            }
        }
        let gate = consumer();
        let handled = gate
            .process(Some("o-1"), "id", b"{}", Attempt::FIRST, |_msg| async {
                Err::<(), _>(Refused)
            })
            .await;
        assert_eq!(handled.action(), Action::Reject, "{handled}");
        assert!(
            handled.to_string().contains("would fail alike every time"),
            "{handled}"
        );
        assert_eq!(gate.gate().get("orders", "o-1").await.unwrap(), None);
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
