//! The one trait every store implements. Each operation is atomic in the store: the read of the
//! current entry, [`crate::decide`] and the write happen as one step, never as check-then-act
//! across calls. A success answer is durable (as far as the store promises) before it returns.

use async_trait::async_trait;

use crate::error::{GateError, StoreError};
use crate::model::RecordId;
use crate::op::Outcome;
use crate::valid::ValidOp;

/// Most operations one batch may carry (API.md).
pub const BATCH_OPS_MAX: usize = 10_000;

/// Figures a store reports for metrics. `None` where the store cannot count cheaply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Entries held now, expired-but-unswept ones included.
    pub records_held: Option<u64>,
    /// Expired entries removed since the store opened.
    pub swept_total: Option<u64>,
}

/// A place that remembers records and decides operations on them atomically.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Decides one operation atomically. The op was validated when it was built, so a store
    /// does not check it again. Errors are [`GateError`]s: a refusal (lease lost, fingerprint
    /// mismatch) or [`StoreError`] when nothing could be decided.
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError>;

    /// Decides many operations in order, each atomically, sharing one durable commit where the
    /// store can. Later ops on the same id see earlier ones. The answer has one item per op.
    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        let mut out = Vec::with_capacity(ops.len());
        for (id, op) in ops {
            out.push(self.apply(id, op).await);
        }
        out
    }

    /// Answers `Ok` only while the store can decide.
    async fn health(&self) -> Result<(), StoreError>;

    /// Removes up to `batch_max` entries that expired, returning how many went. Stores whose
    /// engine expires entries itself (Redis) return 0.
    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError>;

    /// True when the store removes its expired entries by itself (a sweeper of its own, or an
    /// engine that expires keys), so a face's sweep timer leaves it alone: each store has one
    /// owner that sweeps it. [`Store::sweep_expired`] still works when called.
    fn sweeps_itself(&self) -> bool {
        false
    }

    /// Figures for metrics.
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        Ok(StoreStats::default())
    }

    /// What the store is, for the start-up log line (never a password).
    fn describe(&self) -> String;
}
