//! The key set: what `dedupgate dedup --ledger embedded:DIR` remembers between runs.
//!
//! A gate record carries a state, a token, a fence, an owner and a result, and a claim that is
//! later completed writes it twice. A pipeline's ledger needs none of that, only "was this key
//! let through within the ttl": a member is 16 bytes that name a key (the caller's SHA-256 prefix
//! of it) in a namespace, mapped to the instant it expires. A new key costs one put of 35 bytes
//! or so, a known one one lookup; members carry no expiry index (a second put per key): the
//! sweeper walks the set in key order, a bounded step per sweep (see [`sweep_step`]).
//!
//! The set lives beside the gate's records in the same directory, under the same lock, writer
//! and fsync rules: a [`KeySetCall`] that writes is one transaction and one fdatasync, answered
//! only after it. It is a separate set: a gate op never sees it (`dedupgate forget` on an
//! embedded store removes a key's member with [`KeySetCall::forget`] beside the gate op), and a
//! key-set member never answers a gate claim. The other way round, a call may name each checked key's gate record
//! ([`KeySetCall::gate_keys`]): a key the set does not hold is still known while that record is
//! live (completed, or in progress under a live lease), so a ledger kept as gate records (by a
//! build before the key set, or by runs through a server) keeps counting.
//!
//! Encoding (part of [`crate::FORMAT_VERSION`]): member key = 16 id bytes, then the namespace's
//! bytes (random bytes first, so the engine's comparisons end early); value = a version byte
//! ([`MEMBER_ENCODING_V1`]), then the expiry instant as u64 big-endian unix ms.

use std::collections::HashSet;

use dedupgate_core::op::DURATION_MS_MAX;
use dedupgate_core::{GateError, InvalidInput, Namespace, RecordId};

use crate::codec::{decode_entry, encode_id, DecodeError};
use crate::engine::{EngineError, Txn};

/// Bytes that name a key in the set: the caller's digest of the key (a SHA-256 prefix).
pub type KeyId = [u8; 16];

/// Version of the member encoding written by this build.
pub const MEMBER_ENCODING_V1: u8 = 1;

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

/// Appends a member's storage key to `out` (cleared first).
pub fn encode_member(id: &KeyId, namespace: &Namespace, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(id);
    out.extend_from_slice(namespace.as_str().as_bytes());
}

/// A member's stored value.
pub fn encode_expiry(expires_at_ms: u64) -> [u8; 9] {
    let mut v = [0u8; 9];
    v[0] = MEMBER_ENCODING_V1;
    v[1..].copy_from_slice(&expires_at_ms.to_be_bytes());
    v
}

/// The expiry instant of a stored value; an error for anything this build did not write.
pub fn decode_expiry(bytes: &[u8]) -> Result<u64, DecodeError> {
    match bytes {
        [MEMBER_ENCODING_V1, rest @ ..] => rest
            .try_into()
            .map(u64::from_be_bytes)
            .map_err(|_| DecodeError(format!("key-set value of {} bytes, not 9", bytes.len()))),
        [v, ..] => Err(DecodeError(format!(
            "key-set value encoding {v} is unknown"
        ))),
        [] => Err(DecodeError("empty key-set value".into())),
    }
}

/// What a call found that stops it before anything is written.
#[derive(Debug)]
pub(crate) struct Unreadable(pub String);

/// Runs `call` inside `txn` at `now_ms`: answers one bool per key of `check` (true: new), then
/// one per key of `forget` (true: a live member was removed), in `answers`. Reads come first: an
/// unreadable member stops the call before any write (`Ok(Err(..))`, nothing to commit).
/// Returns whether anything was written.
pub(crate) fn apply(
    txn: &mut dyn Txn,
    call: &KeySetCall,
    now_ms: u64,
    answers: &mut Vec<bool>,
) -> Result<Result<bool, Unreadable>, EngineError> {
    let expires = encode_expiry(now_ms.saturating_add(call.ttl_ms));
    let mut key = Vec::with_capacity(16 + call.namespace.as_str().len());
    let mut value = Vec::with_capacity(16);
    answers.clear();
    answers.resize(call.check.len() + call.forget.len(), false);
    // Members to forget, read first like every other key: their answers, and which exist.
    let mut forgotten = HashSet::with_capacity(call.forget.len());
    for (i, id) in call.forget.iter().enumerate() {
        encode_member(id, &call.namespace, &mut key);
        match stored_expiry(txn, &key, &mut value)? {
            Ok(Some(expires_at_ms)) => {
                answers[call.check.len() + i] = expires_at_ms > now_ms;
                forgotten.insert(id);
            }
            Ok(None) => {}
            Err(e) => return Ok(Err(e)),
        }
    }
    // Lookups in key order share their path down the memtable and segment indexes; among equal
    // ids the first in `check` is the one that may be new.
    let mut order: Vec<usize> = (0..call.check.len()).collect();
    order.sort_unstable_by(|&a, &b| call.check[a].cmp(&call.check[b]).then(a.cmp(&b)));
    let recorded: HashSet<&KeyId> = call.record.iter().collect();
    let mut previous: Option<&KeyId> = None;
    for &i in &order {
        let id = &call.check[i];
        if previous == Some(id) {
            continue; // a repeat within the call: not new
        }
        previous = Some(id);
        if recorded.contains(id) {
            continue; // stored by this very call
        }
        answers[i] = if forgotten.contains(id) {
            true // removed by this very call, before the lookups
        } else {
            encode_member(id, &call.namespace, &mut key);
            match stored_expiry(txn, &key, &mut value)? {
                Ok(Some(expires_at_ms)) => expires_at_ms <= now_ms,
                Ok(None) => true,
                Err(e) => return Ok(Err(e)),
            }
        };
        if answers[i] {
            if let Some(gate_key) = call.gate_keys.get(i) {
                match gate_record_holds(txn, &call.namespace, gate_key, now_ms, &mut key)? {
                    Ok(held) => answers[i] = !held,
                    Err(e) => return Ok(Err(e)),
                }
            }
        }
    }
    let mut wrote = false;
    for id in forgotten {
        encode_member(id, &call.namespace, &mut key);
        txn.set_remove(&key)?;
        wrote = true;
    }
    // In key order, like the lookups: consecutive inserts share their path down the memtable.
    let mut record: Vec<&KeyId> = call.record.iter().collect();
    record.sort_unstable();
    for id in record {
        encode_member(id, &call.namespace, &mut key);
        txn.set_put(&key, &expires)?;
        wrote = true;
    }
    if call.record_new {
        for &i in &order {
            if answers[i] {
                encode_member(&call.check[i], &call.namespace, &mut key);
                txn.set_put(&key, &expires)?;
                wrote = true;
            }
        }
    }
    Ok(Ok(wrote))
}

/// The expiry of the member stored under `key` (`None`: absent). A value this build cannot read
/// is [`Unreadable`], never "absent": an operator must look (or start a fresh ledger).
fn stored_expiry(
    txn: &mut dyn Txn,
    key: &[u8],
    value: &mut Vec<u8>,
) -> Result<Result<Option<u64>, Unreadable>, EngineError> {
    if !txn.set_get(key, value)? {
        return Ok(Ok(None));
    }
    Ok(decode_expiry(value)
        .map(Some)
        .map_err(|e| Unreadable(format!("{}: {e}", hex(key)))))
}

/// Whether the gate record of `gate_key` is live and would make a claim of it a duplicate
/// (completed, or in progress under a live lease). A key no gate record can have is not held;
/// an undecodable record is [`Unreadable`], never "absent".
fn gate_record_holds(
    txn: &mut dyn Txn,
    namespace: &Namespace,
    gate_key: &str,
    now_ms: u64,
    buf: &mut Vec<u8>,
) -> Result<Result<bool, Unreadable>, EngineError> {
    let Ok(id) = RecordId::new(namespace.as_str(), gate_key) else {
        return Ok(Ok(false));
    };
    encode_id(&id, buf);
    let mut value = Vec::new();
    if !txn.get(buf, &mut value)? {
        return Ok(Ok(false));
    }
    let entry = match decode_entry(&value) {
        Ok(e) => e,
        Err(e) => {
            let ns = namespace.as_str();
            return Ok(Err(Unreadable(format!("{ns} / {gate_key:?}: {e}"))));
        }
    };
    Ok(Ok(entry.holds(now_ms)))
}

/// Meta key of where the sweeper's walk goes on: the first 8 bytes of the last member it
/// examined, big-endian (0: from the start). A hint: losing it restarts the walk, and every open
/// resumes it, so a store opened only for runs shorter than a walk still sweeps the whole set.
const META_SWEEP_FROM: &str = "keyset_sweep_from";

/// One bounded step of the sweeper's walk through the set: examines up to `max` members after
/// `cursor` and removes the expired ones. Moves `cursor` to the last member examined, or empties
/// it when the walk reached the end (the next step starts over). `None` (a new writer) resumes
/// from the hint in meta, which each step that moves updates (unsynced unless the sweep commits
/// anyway: a hint needs no fsync of its own). Returns how many went.
///
/// Disk use stays bounded by (new keys per second) x (ttl + one walk of the set); a walk takes
/// (members / `max`) sweeps, and the sweeper keeps stepping while steps find expired members.
pub(crate) fn sweep_step(
    txn: &mut dyn Txn,
    cursor: &mut Option<Vec<u8>>,
    now_ms: u64,
    max: usize,
) -> Result<u64, EngineError> {
    let walk = match cursor {
        Some(walk) => walk,
        None => {
            let from = txn.meta_get(META_SWEEP_FROM)?.unwrap_or(0);
            cursor.insert(if from == 0 {
                Vec::new()
            } else {
                from.to_be_bytes().to_vec()
            })
        }
    };
    let mut members = Vec::new();
    txn.set_after(walk, max, &mut members)?;
    let mut removed = 0;
    for (key, value) in &members {
        match decode_expiry(value) {
            Ok(expires_at_ms) if expires_at_ms <= now_ms => {
                txn.set_remove(key)?;
                removed += 1;
            }
            Ok(_) => {}
            // Left for an operator; sweeping it would turn "unreadable" into "absent".
            Err(e) => {
                tracing::error!(member = %hex(key), error = %e, "sweeper left an undecodable key-set member")
            }
        }
    }
    let next: &[u8] = match members.last() {
        Some((last, _)) if members.len() == max => last,
        _ => &[],
    };
    if walk.as_slice() != next {
        walk.clear();
        walk.extend_from_slice(next);
        let mut prefix = [0u8; 8];
        let n = walk.len().min(8);
        prefix[..n].copy_from_slice(&walk[..n]);
        txn.meta_put(META_SWEEP_FROM, u64::from_be_bytes(prefix))?;
    }
    Ok(removed)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_foreign_bytes_are_refused() {
        for t in [0, 1, 1_700_000_000_000, u64::MAX] {
            assert_eq!(decode_expiry(&encode_expiry(t)), Ok(t));
        }
        assert!(decode_expiry(&[]).is_err());
        assert!(decode_expiry(&[2, 0, 0, 0, 0, 0, 0, 0, 1]).is_err());
        assert!(decode_expiry(&[1, 0, 0]).is_err());
    }

    #[test]
    fn member_keys_start_with_the_id_and_separate_namespaces() {
        let (a, b) = (Namespace::new("a").unwrap(), Namespace::new("ab").unwrap());
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        encode_member(&[7; 16], &a, &mut ka);
        encode_member(&[7; 16], &b, &mut kb);
        assert_eq!(&ka[..16], &[7; 16]);
        assert_ne!(ka, kb);
    }
}
