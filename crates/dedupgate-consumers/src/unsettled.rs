//! [`Unsettled`]: idempotent mode's record of a rejected delivery whose dead letter (a DLQ
//! publish, an AMQP reject to a dead-letter exchange, a JetStream term) is not confirmed yet.
//! The key was marked before the handler ran, so a redelivery finds it marked and would be acked
//! as a duplicate: the message would reach neither the handler nor the dead letters. The record
//! is written before the dead letter is sent and deleted once it is confirmed; a redelivery of a
//! marked key that finds it is dead-lettered instead of acked.
//!
//! It lives in the consumer's own namespace and store, under a hashed key, with the consumer's
//! ttl (the mark's), so it is never kept longer than the mark it qualifies. A crash between the
//! mark and the record still loses the message: idempotent mode is at most once.

use dedupgate_core::{Gate, GateError, Mode};
use sha2::{Digest, Sha256};

use crate::{Action, ConsumerGate, Handled};

/// Where the unsettled records of one consumer (or relay route) live.
#[derive(Clone, Debug)]
pub struct Unsettled {
    gate: Gate,
    namespace: String,
    ttl_ms: Option<u64>,
}

/// The record's key for gate key `key`: a fixed prefix and the key's SHA-256 (hex), so it stays
/// within the gate's key limit (1024 bytes) whatever the key's length.
fn record_key(key: &str) -> String {
    format!(
        "dedupgate.unsettled:{}",
        hex::encode(Sha256::digest(key.as_bytes()))
    )
}

impl Unsettled {
    /// Records in `namespace` of `gate`, kept `ttl_ms` (the marks' ttl; `None`: the store's
    /// default, as the marks).
    pub fn new(gate: Gate, namespace: impl Into<String>, ttl_ms: Option<u64>) -> Self {
        Self {
            gate,
            namespace: namespace.into(),
            ttl_ms,
        }
    }

    /// Records that `key`'s delivery is rejected for `reason` and its dead letter not yet
    /// confirmed.
    pub async fn record(&self, key: &str, reason: &str) -> Result<(), GateError> {
        let result = serde_json::json!({ "reason": reason });
        self.gate
            .mark(
                &self.namespace,
                &record_key(key),
                self.ttl_ms,
                None,
                Some(result),
            )
            .await
            // A record already there (an earlier delivery's) says the same.
            .map(|_| ())
    }

    /// The reason of `key`'s rejection when an earlier delivery left its dead letter
    /// unconfirmed.
    pub async fn recorded(&self, key: &str) -> Result<Option<String>, GateError> {
        let record = self.gate.get(&self.namespace, &record_key(key)).await?;
        Ok(record.map(|r| {
            r.result
                .as_ref()
                .and_then(|v| v["reason"].as_str())
                .map_or_else(|| format!("{key}: rejected"), str::to_owned)
        }))
    }

    /// Deletes the record once the dead letter is confirmed. A record left behind (the store
    /// down) costs at most a second dead letter for a later copy, never a lost message.
    pub async fn clear(&self, key: &str) {
        if let Err(e) = self.gate.forget(&self.namespace, &record_key(key)).await {
            tracing::warn!(error = %e, "an unsettled record was not deleted; a later copy of its message may be dead-lettered again");
        }
    }
}

impl ConsumerGate {
    /// Where this consumer keeps its [`Unsettled`] records: its namespace, with its ttl.
    pub fn unsettled(&self) -> Unsettled {
        Unsettled::new(self.gate.clone(), self.namespace.clone(), self.ttl_ms)
    }

    /// The action for `handled` with idempotent mode's unsettled dead letters applied, for an
    /// adapter whose dead letter is the broker's reject (AMQP reject, JetStream term) or its
    /// own publish (Kafka): a failed handler's reject is recorded first, and a duplicate whose
    /// earlier reject is recorded is rejected again, not acked. With a [`Pending`], the action
    /// is `Reject`: [`Unsettled::clear`] its key once the reject is confirmed.
    ///
    /// The outcome is read before the returned future starts, so an adapter's spawned task
    /// does not need the handler's value and error to be `Sync`.
    pub(crate) fn settle_action<T, E: std::fmt::Display>(
        &self,
        handled: &Handled<T, E>,
    ) -> impl std::future::Future<Output = (Action, Option<Pending>)> + Send + 'static {
        let action = handled.action();
        let retry = Action::Retry {
            after: self.unavailable_retry,
            failure: false,
        };
        let case = match handled {
            _ if self.mode != Mode::Idempotent => None,
            Handled::Failed { key, .. } if action == Action::Reject => {
                Some((key.clone(), Some(handled.to_string())))
            }
            Handled::Duplicate { key, .. } => Some((key.clone(), None)),
            _ => None,
        };
        let unsettled = case.is_some().then(|| self.unsettled());
        async move {
            let (Some((key, failed)), Some(unsettled)) = (case, unsettled) else {
                return (action, None);
            };
            if let Some(reason) = failed {
                // Best effort: without the record, a reject that fails loses the message, as
                // at-most-once allows; the reject itself is not held back for it.
                if let Err(e) = unsettled.record(&key, &reason).await {
                    tracing::error!(error = %e, key = %key, "a marked key's pending dead letter cannot be recorded; if the reject fails, the message is lost");
                }
                return (action, Some(Pending { key, reason }));
            }
            match unsettled.recorded(&key).await {
                Ok(None) => (action, None),
                Ok(Some(reason)) => {
                    tracing::warn!(key = %key, "a copy of a rejected message whose dead letter was not confirmed is rejected again: {reason}");
                    (Action::Reject, Some(Pending { key, reason }))
                }
                Err(e) => {
                    tracing::warn!(error = %e, key = %key, "cannot tell whether a marked key's dead letter is settled; the delivery is retried");
                    (retry, None)
                }
            }
        }
    }
}

/// A reject whose dead letter is recorded as unsettled: its key, and why it was rejected.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) key: String,
    /// The dead letter's reason (the Kafka consumer publishes it; a broker's reject has none).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) reason: String,
}

#[cfg(test)]
mod tests {
    use dedupgate_core::{Gate, MemoryStore, Mode};

    use crate::{Action, Attempt, ConsumerGate, Handled};

    fn consumer(mode: Mode) -> ConsumerGate {
        ConsumerGate::new(Gate::new(MemoryStore::new()), "orders")
            .unwrap()
            .mode(mode)
    }

    async fn deliver(gate: &ConsumerGate, fails: bool) -> Handled<(), String> {
        gate.process(
            Some("o-1"),
            "id",
            b"{}",
            Attempt::FIRST,
            |_msg| async move {
                if fails {
                    Err("boom".to_owned())
                } else {
                    Ok(())
                }
            },
        )
        .await
    }

    /// Idempotent mode: a failed handler's reject is recorded, a duplicate that finds the
    /// record is rejected again, and once cleared a duplicate is acked.
    #[tokio::test]
    async fn a_duplicate_of_an_unsettled_reject_is_rejected_until_cleared() {
        let gate = consumer(Mode::Idempotent);
        let failed = deliver(&gate, true).await;
        let (action, pending) = gate.settle_action(&failed).await;
        assert_eq!(action, Action::Reject);
        let pending = pending.expect("recorded");
        assert_eq!(pending.key, "o-1");
        assert_eq!(
            gate.unsettled().recorded("o-1").await.unwrap(),
            Some(failed.to_string())
        );

        let copy = deliver(&gate, false).await;
        assert!(matches!(copy, Handled::Duplicate { .. }), "{copy}");
        let (action, pending) = gate.settle_action(&copy).await;
        assert_eq!(action, Action::Reject);
        assert_eq!(pending.expect("recorded").reason, failed.to_string());

        gate.unsettled().clear("o-1").await;
        let (action, pending) = gate.settle_action(&copy).await;
        assert_eq!((action, pending.is_none()), (Action::Ack, true));
    }

    /// Retriable mode releases the claim on failure, so there is nothing to record.
    #[tokio::test]
    async fn retriable_mode_records_nothing() {
        let gate = consumer(Mode::Retriable).max_attempts(1).unwrap();
        let failed = deliver(&gate, true).await;
        let (action, pending) = gate.settle_action(&failed).await;
        assert_eq!(action, failed.action());
        assert!(pending.is_none());
        assert_eq!(gate.unsettled().recorded("o-1").await.unwrap(), None);
    }
}
