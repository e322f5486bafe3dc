//! What `dedup`'s ledger asks of a store beyond [`Store`]: a key set, a bare "was this key let
//! through within the ttl" kept as 16-byte ids, far cheaper than gate records for keys that
//! arrive thousands per call.
//!
//! - [`KeySetCall`]: one round trip to the set (forget, record, check), validated here.
//! - [`KeySet`]: a store that keeps such a set natively beside its gate records (the embedded
//!   store does). A store without one keeps a ledger as gate records through [`Store`] alone,
//!   so faces ask a store for its key set and fall back to gate records when it has none.

use async_trait::async_trait;

use crate::op::DURATION_MS_MAX;
use crate::{GateError, InvalidInput, Namespace, Store};

/// Bytes that name a key in the set: the caller's digest of the key (a SHA-256 prefix).
pub type KeyId = [u8; 16];

/// One round trip to the key set: first `forget` is removed, then `record` is stored (expiring
/// `ttl_ms` from now), then each of `check` is looked up; with `record_new` the ones found
/// absent or expired are stored too, in the same commit.
///
/// The two orders of a ledger: "record, then emit" (at most once: `record_new`) and "emit, then
/// record" (nothing lost: `check` alone, and the keys emitted go in the next call's `record`).
/// A key that appears twice in `check` is new at most once.
#[derive(Debug, Clone)]
pub struct KeySetCall {
    /// The namespace every key of the call belongs to.
    pub namespace: Namespace,
    /// Keys to store as seen.
    pub record: Vec<KeyId>,
    /// Keys to look up.
    pub check: Vec<KeyId>,
    /// Whether a key of `check` found new is stored too.
    pub record_new: bool,
    /// Empty, or the gate key of each key of `check` (in [`KeySetCall::namespace`]): a key
    /// found new in the set is known after all while its gate record is live.
    pub gate_keys: Vec<String>,
    /// How long stored keys are remembered (1 ms to [`DURATION_MS_MAX`]).
    pub ttl_ms: u64,
    /// Keys to remove (an operator's `dedupgate forget`), so that their next sighting is new.
    /// Their answers follow those of `check`: true when a live member was removed.
    pub forget: Vec<KeyId>,
}

impl KeySetCall {
    /// Refuses a ttl out of range; changes nothing.
    pub fn validate(&self) -> Result<(), GateError> {
        if !self.gate_keys.is_empty() && self.gate_keys.len() != self.check.len() {
            return Err(InvalidInput::new(
                "gate_keys",
                format!(
                    "{} gate keys for {} keys to check",
                    self.gate_keys.len(),
                    self.check.len()
                ),
            )
            .into());
        }
        if self.ttl_ms == 0 || self.ttl_ms > DURATION_MS_MAX {
            return Err(InvalidInput::new(
                "ttl_ms",
                format!("must be 1..={DURATION_MS_MAX}, got {}", self.ttl_ms),
            )
            .into());
        }
        Ok(())
    }
}

/// A store that keeps a key set beside its gate records: a set member never answers a gate
/// claim, but a call may consult each checked key's gate record ([`KeySetCall::gate_keys`]).
#[async_trait]
pub trait KeySet: Store {
    /// One [`KeySetCall`], committed durably before it answers: per key of `check`, true when
    /// it was new; then per key of `forget`, true when a live member was removed.
    async fn key_set(&self, call: KeySetCall) -> Result<Vec<bool>, GateError>;
}
