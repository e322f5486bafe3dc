//! [`Unsettled`]: idempotent mode's record of a rejected delivery whose dead letter is not
//! confirmed yet. The key was marked before the forward, so a redelivery finds it marked and
//! would be acked as a duplicate: the message would reach neither the sink nor the dead-letter
//! sink. The record is written before the dead letter is sent and deleted once it is confirmed;
//! a redelivery of a marked key that finds it is dead-lettered instead of acked.
//!
//! It lives in the route's own namespace and store, under [`record_key`], with the route's ttl
//! (the mark's), so it is never kept longer than the mark it qualifies.

use dedupgate_core::{Gate, GateError};
use sha2::{Digest, Sha256};

/// Where the unsettled records of one route live.
#[derive(Clone)]
pub(crate) struct Unsettled {
    pub(crate) gate: Gate,
    pub(crate) namespace: String,
    pub(crate) ttl_ms: Option<u64>,
}

/// The record's key for gate key `key`: a fixed prefix and the key's SHA-256 (hex), so it stays
/// within the gate's key limit (1024 bytes) whatever the key's length.
fn record_key(key: &str) -> String {
    format!(
        "dedupgate-relay.unsettled:{}",
        hex::encode(Sha256::digest(key.as_bytes()))
    )
}

impl Unsettled {
    /// Records that `key`'s delivery is rejected for `reason` and its dead letter not yet
    /// confirmed.
    pub(crate) async fn record(&self, key: &str, reason: &str) -> Result<(), GateError> {
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
    pub(crate) async fn recorded(&self, key: &str) -> Result<Option<String>, GateError> {
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
    pub(crate) async fn clear(&self, key: &str) {
        if let Err(e) = self.gate.forget(&self.namespace, &record_key(key)).await {
            tracing::warn!(error = %e, "relay: an unsettled record was not deleted; a later copy of its message may be dead-lettered again");
        }
    }
}
