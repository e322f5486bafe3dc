//! The memory store: the reference model of the gate, for tests and development.
//!
//! **It forgets everything when the process exits.** Never use it where a duplicate costs money.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::decide::{decide, Change};
use crate::error::{GateError, StoreError};
use crate::model::{Entry, RecordId, Token};
use crate::op::{Op, Outcome};
use crate::store::{Store, StoreStats};

/// Shards that split the lock so concurrent callers on different keys rarely wait for each other.
const SHARDS: usize = 32;

/// A store in process memory. Forgets on restart.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Vec<Mutex<HashMap<RecordId, Entry>>>,
    clock: Arc<dyn Clock>,
    swept_total: AtomicU64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock::default()))
    }

    /// An empty store on the given clock (tests move a [`crate::ManualClock`]).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            clock,
            swept_total: AtomicU64::new(0),
        }
    }

    fn shard(&self, id: &RecordId) -> &Mutex<HashMap<RecordId, Entry>> {
        use std::hash::{BuildHasher, RandomState};
        // One hasher per process is enough: shards only spread lock contention.
        static HASHER: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
        let h = HASHER.get_or_init(RandomState::new).hash_one(id);
        &self.shards[(h as usize) % SHARDS]
    }

    fn apply_now(&self, id: RecordId, op: Op) -> Result<Outcome, GateError> {
        let mut map = self.shard(&id).lock().unwrap_or_else(|p| p.into_inner());
        let now_ms = self.clock.now_ms();
        let decision = decide(&id, op, map.get(&id), now_ms, Token::generate);
        match decision.change {
            Change::Keep => {}
            Change::Put(entry) => {
                map.insert(id, entry);
            }
        }
        decision.answer
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn apply(&self, id: RecordId, op: Op) -> Result<Outcome, GateError> {
        self.apply_now(id, op)
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, Op)>) -> Vec<Result<Outcome, GateError>> {
        ops.into_iter()
            .map(|(id, op)| self.apply_now(id, op))
            .collect()
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        let now_ms = self.clock.now_ms();
        let mut removed = 0usize;
        for shard in &self.shards {
            if removed >= batch_max {
                break;
            }
            let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
            let expired: Vec<RecordId> = map
                .iter()
                .filter(|(_, e)| !e.is_live(now_ms))
                .map(|(id, _)| id.clone())
                .take(batch_max - removed)
                .collect();
            for id in expired {
                map.remove(&id);
                removed += 1;
            }
        }
        self.swept_total
            .fetch_add(removed as u64, Ordering::Relaxed);
        Ok(removed as u64)
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let held = self
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len() as u64)
            .sum();
        Ok(StoreStats {
            records_held: Some(held),
            swept_total: Some(self.swept_total.load(Ordering::Relaxed)),
        })
    }

    fn describe(&self) -> String {
        "memory: (forgets on restart)".to_owned()
    }
}
