//! The memory store: the reference model of the gate, for tests and development.
//!
//! **It forgets everything when the process exits.** Never use it where a duplicate costs money.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::decide::{decide, Change};
use crate::error::{GateError, StoreError};
use crate::model::{Entry, RecordId, Token};
use crate::op::Outcome;
use crate::store::{Store, StoreStats};
use crate::valid::ValidOp;

/// Shards that split the lock so concurrent callers on different keys rarely wait for each other.
const SHARDS: usize = 32;

/// A store in process memory. Forgets on restart.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    clock: Arc<dyn Clock>,
    swept_total: AtomicU64,
}

/// One lock's share of the records, and when each is next due for a look, soonest first, so a
/// sweep finds expired records without scanning the live ones.
///
/// Each record has one current item in `expiries`, at its `queued_ms`, never later than its
/// expiry: a put that keeps or extends the expiry (an extend, a complete, a re-claim) leaves
/// the item alone, so a key written a million times still has one item. When the sweep reaches
/// the item of a record that is still live, it queues it again at its expiry. Only a put that
/// brings the expiry earlier queues a new item; the old one is then stale and dropped when
/// popped.
#[derive(Debug, Default)]
struct Shard {
    records: HashMap<RecordId, Held>,
    expiries: BinaryHeap<Reverse<(u64, RecordId)>>,
}

/// A record and the instant of its current item in the expiry heap.
#[derive(Debug)]
struct Held {
    entry: Entry,
    queued_ms: u64,
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
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            clock,
            swept_total: AtomicU64::new(0),
        }
    }

    fn shard(&self, id: &RecordId) -> &Mutex<Shard> {
        use std::hash::{BuildHasher, RandomState};
        // One hasher per process is enough: shards only spread lock contention.
        static HASHER: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
        let h = HASHER.get_or_init(RandomState::new).hash_one(id);
        &self.shards[(h as usize) % SHARDS]
    }

    fn apply_now(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        let mut shard = self.shard(&id).lock().unwrap_or_else(|p| p.into_inner());
        let Shard { records, expiries } = &mut *shard;
        let now_ms = self.clock.now_ms();
        let held = records.get_mut(&id);
        let current = held.as_ref().map(|held| &held.entry);
        let decision = decide(&id, op, current, now_ms, Token::generate);
        if let Change::Put(entry) = decision.change {
            let at = entry.expires_at_ms;
            match held {
                Some(held) => {
                    if at < held.queued_ms {
                        expiries.push(Reverse((at, id)));
                        held.queued_ms = at;
                    }
                    held.entry = entry;
                }
                None => {
                    expiries.push(Reverse((at, id.clone())));
                    records.insert(
                        id,
                        Held {
                            entry,
                            queued_ms: at,
                        },
                    );
                }
            }
        }
        decision.answer
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        self.apply_now(id, op)
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
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
        // Every item popped counts against the batch, stale or not: a sweep's work (and the
        // time it holds a shard's lock) stays bounded by `batch_max`.
        let mut examined = 0usize;
        for shard in &self.shards {
            if examined >= batch_max {
                break;
            }
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let Shard { records, expiries } = &mut *shard;
            while examined < batch_max {
                match expiries.peek() {
                    Some(Reverse((at, _))) if *at <= now_ms => {}
                    _ => break,
                }
                let Some(Reverse((at, id))) = expiries.pop() else {
                    break;
                };
                examined += 1;
                match records.get_mut(&id) {
                    // Stale: the record is gone, or a put brought its expiry earlier.
                    None => {}
                    Some(held) if held.queued_ms != at => {}
                    Some(held) if !held.entry.is_live(now_ms) => {
                        records.remove(&id);
                        removed += 1;
                    }
                    Some(held) => {
                        held.queued_ms = held.entry.expires_at_ms;
                        expiries.push(Reverse((held.queued_ms, id)));
                    }
                }
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
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).records.len() as u64)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::op::Op;
    use crate::testkit::ApplyOp;

    fn id(key: &str) -> RecordId {
        RecordId::new("sweep", key).unwrap()
    }

    fn mark(ttl_ms: u64) -> Op {
        Op::Mark {
            ttl_ms,
            fingerprint: None,
            result: None,
        }
    }

    async fn held(store: &MemoryStore) -> u64 {
        store.stats().await.unwrap().records_held.unwrap()
    }

    /// The sweep removes expired records, in bounded batches, and never a live one: not even a
    /// record whose first put has expired but which was put again with a later expiry.
    #[tokio::test]
    async fn sweep_removes_only_expired_records_in_bounded_batches() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        for i in 0..100 {
            store
                .apply_op(id(&format!("short-{i}")), mark(1_000))
                .await
                .unwrap();
            store
                .apply_op(id(&format!("long-{i}")), mark(60_000))
                .await
                .unwrap();
        }
        // A claim taken over after its lease: put twice, the second time with a later expiry.
        let claim = Op::Claim {
            ttl_ms: 1_000,
            lease_ms: 500,
            fingerprint: None,
            owner: None,
        };
        store.apply_op(id("again"), claim.clone()).await.unwrap();
        clock.advance(600);
        let taken = store.apply_op(id("again"), claim).await.unwrap();
        assert!(
            matches!(taken, Outcome::Claimed(crate::Claim::New(_))),
            "{taken:?}"
        );
        assert_eq!(held(&store).await, 201);

        assert_eq!(
            store.sweep_expired(1_000).await.unwrap(),
            0,
            "nothing expired yet"
        );
        clock.advance(500); // 1,100 ms after the first puts: the short marks expired
        let mut removed = 0;
        for _ in 0..10 {
            let n = store.sweep_expired(30).await.unwrap();
            assert!(n <= 30, "bounded by batch_max: {n}");
            removed += n;
        }
        assert_eq!(removed, 100);
        assert_eq!(
            held(&store).await,
            101,
            "the long marks and the taken-over claim stay"
        );
        assert!(store.apply_op(id("again"), Op::Get).await.is_ok());

        clock.advance(60_000);
        assert_eq!(store.sweep_expired(1_000).await.unwrap(), 101);
        assert_eq!(held(&store).await, 0);
        assert_eq!(store.sweep_expired(1_000).await.unwrap(), 0);
        assert_eq!(queued(&store), 0);
    }

    /// Items in every shard's expiry heap.
    fn queued(store: &MemoryStore) -> usize {
        store
            .shards
            .iter()
            .map(|s| s.lock().unwrap().expiries.len())
            .sum()
    }

    /// A key written over and over keeps one item in the expiry heap (a put that moves its
    /// expiry earlier adds one), and a sweep's work is bounded by `batch_max` even when the
    /// items it pops are stale or belong to live records.
    #[tokio::test]
    async fn a_record_written_often_keeps_one_heap_item() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        let claim = Op::Claim {
            ttl_ms: 3_600_000,
            lease_ms: 1_000,
            fingerprint: None,
            owner: None,
        };
        let Outcome::Claimed(crate::Claim::New(lease)) =
            store.apply_op(id("busy"), claim).await.unwrap()
        else {
            panic!("not new");
        };
        for _ in 0..1_000 {
            clock.advance(10);
            let extend = Op::Extend {
                token: lease.token.clone(),
                lease_ms: 1_000,
            };
            store.apply_op(id("busy"), extend).await.unwrap();
        }
        assert_eq!(queued(&store), 1, "a thousand extends, one item");
        // Completing with a shorter ttl brings the expiry earlier: one more item.
        let complete = Op::Complete {
            token: lease.token.clone(),
            result: None,
            ttl_ms: Some(5_000),
        };
        store.apply_op(id("busy"), complete).await.unwrap();
        assert_eq!(queued(&store), 2);
        for i in 0..50 {
            store
                .apply_op(id(&format!("live-{i}")), mark(1_000))
                .await
                .unwrap();
        }
        clock.advance(5_000);
        // Due: the completed key (expired), the 50 marks (expired) and, later, the stale item.
        assert_eq!(store.sweep_expired(20).await.unwrap(), 20, "bounded");
        let mut rest = 0;
        for _ in 0..5 {
            rest += store.sweep_expired(20).await.unwrap();
        }
        assert_eq!(rest, 31);
        assert_eq!(held(&store).await, 0);
        assert_eq!(
            queued(&store),
            1,
            "the stale item is due at the claim's hour"
        );
        clock.advance(3_600_000);
        assert_eq!(
            store.sweep_expired(20).await.unwrap(),
            0,
            "a stale pop removes nothing"
        );
        assert_eq!(queued(&store), 0);
    }
}
