//! Sweeping: one bounded batch of expired records, walked through the expiry index, then
//! expired key-set chunks with what is left of the budget.

use std::sync::atomic::Ordering;

use dedupgate_core::StoreError;

use crate::codec::{self, decode_entry, expiry_key};
use crate::engine::{EngineError, Txn};
use crate::keyset;

use super::meta::{raise_clock_floor, META_HELD};
use super::{engine_store_error, Writer};

impl Writer {
    /// Sweeps one bounded batch of records, then expired key-set chunks with what is left of the
    /// budget: how many went, and whether more may be waiting.
    pub(crate) fn sweep(&mut self, batch_max: usize) -> Result<(u64, bool), StoreError> {
        let now_ms = self.clock.now_ms();
        let mut removed = 0u64;
        let mut more = false;
        let mut set_removed = 0u64;
        let mut set_more = false;
        let engine = self.engine.as_mut().expect("checked by the caller");
        let members = &mut self.keyset_members;
        let result = engine.write(&mut |txn: &mut dyn Txn| {
            removed = 0;
            set_removed = 0;
            let wrote = sweep_in(txn, now_ms, batch_max, &mut removed, &mut more)?;
            // What is left of this sweep's budget (the trait's "up to batch_max"), in key-set
            // ids (whole chunks: at least one).
            let budget = batch_max.saturating_sub(usize::try_from(removed).unwrap_or(usize::MAX));
            let mut chunks = 0;
            if budget > 0 {
                let swept = keyset::sweep_step(txn, members.as_mut(), now_ms, budget)?;
                (set_removed, chunks, set_more) = (swept.ids, swept.chunks, swept.more);
            }
            if removed > 0 || chunks > 0 {
                // What was swept had expired by now: a key swept here must not be new again
                // where it was still live.
                raise_clock_floor(txn, now_ms)?;
            }
            Ok(wrote || chunks > 0)
        });
        let more = more || set_more;
        let removed = removed + set_removed;
        match result {
            Ok(()) => {
                if removed > 0 {
                    self.publish_view();
                }
                self.shared
                    .swept_total
                    .fetch_add(removed, Ordering::Relaxed);
                Ok((removed, more))
            }
            Err(e) => {
                self.fail(&e);
                Err(engine_store_error(&e))
            }
        }
    }
}

/// Removes up to `batch_max` expired entries, walking the expiry index from the oldest record
/// whose bucket has passed, examining at most about `batch_max` ids. Sets `more` when passed
/// records remain. Returns whether anything was written.
fn sweep_in(
    txn: &mut dyn Txn,
    now_ms: u64,
    batch_max: usize,
    removed: &mut u64,
    more: &mut bool,
) -> Result<bool, EngineError> {
    // Records whose bucket is at or before now sort before (now + 1, sequence 0).
    let bound = expiry_key(now_ms.saturating_add(1), 0);
    let mut records = Vec::new();
    let mut val_buf = Vec::new();
    let mut examined = 0usize;
    let mut wrote = false;
    *more = false;
    'fetch: loop {
        records.clear();
        // A record names at most EXPIRY_RECORD_IDS_MAX ids: a fetch is a bounded amount.
        txn.index_before(&bound, 64, &mut records)?;
        if records.is_empty() {
            break;
        }
        for (key, record) in &records {
            if examined >= batch_max {
                *more = true;
                break 'fetch;
            }
            let ids = codec::expiry_ids(record).map_err(|e| EngineError::Corrupt(e.0))?;
            for id in ids {
                examined += 1;
                if txn.get(id, &mut val_buf)? {
                    match decode_entry(&val_buf) {
                        Ok(e) if !e.is_live(now_ms) => {
                            txn.remove(id)?;
                            *removed += 1;
                        }
                        // Renewed since this record was written: a newer record names it.
                        Ok(_) => {}
                        // Left for an operator; sweeping it would turn "corrupt" into "absent".
                        Err(e) => tracing::error!(error = %e, "sweeper left an undecodable entry"),
                    }
                }
            }
            txn.index_remove(key)?;
            wrote = true;
        }
    }
    if *removed > 0 {
        let held = txn.meta_get(META_HELD)?.unwrap_or(0);
        txn.meta_put(META_HELD, held.saturating_sub(*removed))?;
    }
    Ok(wrote)
}
