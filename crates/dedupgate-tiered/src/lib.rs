//! # dedupgate-tiered
//!
//! [`TieredStore`]: the two-tier gate (`--store tiered:FAST,DURABLE`) over any two
//! [`dedupgate_core::Store`]s. The durable store decides everything; the fast store (e.g. Redis
//! in front of PostgreSQL) only answers repeats of keys the durable store already **completed**,
//! which cannot change until they expire or an operator forgets them, so those answers are safe
//! to cache.
//!
//! How: when a durable answer shows a completed record, the tier stores a copy of that record in
//! the fast store as a `Mark` under a cache id (namespace [`CACHE_NAMESPACE`], key the SHA-256
//! of the real namespace and key) whose result wraps the full durable [`Record`] and whose ttl
//! ends at the durable expiry. A later `claim`, `mark` or `get` of that key first reads the
//! cache; a hit is decoded back into the durable record, so the answer equals the durable one.
//! Everything else — misses, in-progress keys, fingerprint mismatches, complete, release,
//! extend, forget — goes to the durable store.
//!
//! Losing the fast store (a flush, a restart without persistence, a ttl shorter than a
//! redrive) only turns hits into misses, and a failing fast store is skipped: neither ever
//! changes an answer. [`TierCounters`] count hits, misses and fast-store failures.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupgate_core::decide::decide_read_only;
use dedupgate_core::{
    Claim, Clock, Defaults, Entry, EntryState, GateError, Mark, MarkOptions, Op, Outcome, Record,
    RecordId, State, Store, StoreError, StoreStats, SystemClock, ValidOp,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The namespace of cache entries in the fast store.
pub const CACHE_NAMESPACE: &str = "dedupgate.tiered";

/// A cached record closer than this to its expiry (on the tier's clock) is not trusted: the
/// fast and durable stores' clocks may differ by up to this much.
pub const DEFAULT_EXPIRY_MARGIN_MS: u64 = 1_000;

/// How long a cache lookup or fill may take before the tier goes on without it: a slow fast
/// store must not make the gate slower than its durable store.
pub const DEFAULT_FAST_TIMEOUT_MS: u64 = 100;

/// Figures of the fast tier since the store opened.
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Operations answered from the fast store.
    pub hits: AtomicU64,
    /// Cache lookups that went on to the durable store.
    pub misses: AtomicU64,
    /// Fast-store calls that failed (and were skipped).
    pub fast_errors: AtomicU64,
}

/// The two-tier store. See the crate documentation.
pub struct TieredStore {
    fast: Arc<dyn Store>,
    durable: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    expiry_margin_ms: u64,
    fast_timeout: Duration,
    counters: TierCounters,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// What the fast store holds as a cache entry's result.
#[derive(Serialize, Deserialize)]
struct Cached {
    dedupgate_tiered_v1: Record,
}

impl TieredStore {
    /// A tier over `fast` and `durable`, judging cached expiry on the system clock.
    pub fn new(fast: Arc<dyn Store>, durable: Arc<dyn Store>) -> Self {
        Self::with_clock(fast, durable, Arc::new(SystemClock::default()))
    }

    /// A tier whose cached expiry is judged on `clock` (tests share a manual clock with the
    /// stores below).
    pub fn with_clock(
        fast: Arc<dyn Store>,
        durable: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            fast,
            durable,
            clock,
            expiry_margin_ms: DEFAULT_EXPIRY_MARGIN_MS,
            fast_timeout: Duration::from_millis(DEFAULT_FAST_TIMEOUT_MS),
            counters: TierCounters::default(),
        }
    }

    /// Sets how long a cache lookup or fill may take (default 100 ms). Cache invalidation by
    /// `forget` is never cut short.
    pub fn with_fast_timeout_ms(mut self, timeout_ms: u64) -> Self {
        self.fast_timeout = Duration::from_millis(timeout_ms);
        self
    }

    /// The fast store's answers to `ops`, or failures when it takes longer than allowed.
    async fn fast_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        let n = ops.len();
        match tokio::time::timeout(self.fast_timeout, self.fast.apply_batch(ops)).await {
            Ok(answers) => answers,
            Err(_) => (0..n)
                .map(|_| {
                    Err(GateError::Store(StoreError::Unavailable(
                        "the fast store timed out".to_owned(),
                    )))
                })
                .collect(),
        }
    }

    /// Sets how close to its expiry a cached record stops being trusted (default 1 s).
    pub fn with_expiry_margin_ms(mut self, margin_ms: u64) -> Self {
        self.expiry_margin_ms = margin_ms;
        self
    }

    /// Hits, misses and fast-store failures so far.
    pub fn counters(&self) -> &TierCounters {
        &self.counters
    }

    /// The fast store's id for `id`: one namespace, the key a hash of the real identity (a
    /// namespace and key together may not fit one key, and the hash keeps the fast store's
    /// entries apart from any real namespace).
    pub fn cache_id(id: &RecordId) -> RecordId {
        let mut h = Sha256::new();
        h.update(id.namespace.as_str().as_bytes());
        h.update([0u8]);
        h.update(id.key.as_str().as_bytes());
        RecordId::new(CACHE_NAMESPACE, hex::encode(h.finalize()))
            .expect("the cache namespace and a hex key are valid")
    }

    /// The durable record a fast-store answer holds, if it is one this tier may answer with.
    fn cached_record(
        &self,
        id: &RecordId,
        answer: Result<Outcome, GateError>,
        now_ms: u64,
    ) -> Option<Record> {
        let rec = match answer {
            Ok(Outcome::Found(Some(rec))) => rec,
            Ok(_) => return None,
            Err(e) => {
                self.fast_failed("get", &e);
                return None;
            }
        };
        let cached: Cached = serde_json::from_value(rec.result?).ok()?;
        let dur = cached.dedupgate_tiered_v1;
        let fresh = dur.expires_at_ms > now_ms.saturating_add(self.expiry_margin_ms);
        (dur.namespace == id.namespace
            && dur.key == id.key
            && dur.state == State::Completed
            && fresh)
            .then_some(dur)
    }

    fn fast_failed(&self, what: &str, e: &GateError) {
        self.counters.fast_errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(error = %e, "tiered: fast store {what} failed; answering from the durable store");
    }

    /// The answer a cached durable record gives `op` at `now_ms`, if the cache may give it: the
    /// answer of [`decide_read_only`] on the record, when it changes nothing and is not a
    /// refusal. A decision that would write (a free or taken-over key) belongs to the durable
    /// store, and so does a refusal (a fingerprint mismatch), which the durable store, the
    /// authority, answers itself.
    fn answer_from_cache(id: &RecordId, op: &ValidOp, dur: Record, now_ms: u64) -> Option<Outcome> {
        let entry = completed_entry(dur);
        decide_read_only(id, op, Some(&entry), now_ms)?.ok()
    }

    /// Removes the cache entries of `ids` (best effort).
    async fn invalidate(&self, ids: &[RecordId]) {
        if ids.is_empty() {
            return;
        }
        let ops = ids
            .iter()
            .map(|id| (Self::cache_id(id), ValidOp::forget()))
            .collect();
        for r in self.fast.apply_batch(ops).await {
            if let Err(e) = r {
                self.fast_failed("forget", &e);
            }
        }
    }

    async fn decide(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        let n = ops.len();
        let mut answers: Vec<Option<Result<Outcome, GateError>>> = (0..n).map(|_| None).collect();

        // Ops that may be answered from the cache: claims, marks and gets on an id that
        // no earlier op of this batch touched (a later op must see earlier ones).
        let mut seen: HashSet<&RecordId> = HashSet::with_capacity(n);
        let mut lookups: Vec<usize> = Vec::new();
        let mut forgotten: Vec<RecordId> = Vec::new();
        for (i, (id, op)) in ops.iter().enumerate() {
            let first = seen.insert(id);
            let cacheable = matches!(**op, Op::Claim { .. } | Op::Mark { .. } | Op::Get);
            if first && cacheable {
                lookups.push(i);
            }
            if matches!(**op, Op::Forget) {
                forgotten.push(id.clone());
            }
        }
        // Forget clears the cache before and after the durable store forgets.
        self.invalidate(&forgotten).await;

        if !lookups.is_empty() {
            let gets = lookups
                .iter()
                .map(|&i| (Self::cache_id(&ops[i].0), ValidOp::get()))
                .collect();
            let found = self.fast_batch(gets).await;
            let now_ms = self.clock.now_ms();
            for (&i, answer) in lookups.iter().zip(found) {
                let (id, op) = &ops[i];
                let hit = self
                    .cached_record(id, answer, now_ms)
                    .and_then(|dur| Self::answer_from_cache(id, op, dur, now_ms));
                match hit {
                    Some(outcome) => {
                        self.counters.hits.fetch_add(1, Ordering::Relaxed);
                        answers[i] = Some(Ok(outcome));
                    }
                    None => {
                        self.counters.misses.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }

        // Everything not answered goes to the durable store, in order, in one batch.
        let mut rest_index = Vec::new();
        let mut rest = Vec::new();
        for (i, (id, op)) in ops.into_iter().enumerate() {
            if answers[i].is_none() {
                rest_index.push(i);
                rest.push((id, op));
            }
        }
        let rest_ids: Vec<RecordId> = rest.iter().map(|(id, _)| id.clone()).collect();
        let decided = if rest.is_empty() {
            Vec::new()
        } else {
            self.durable.apply_batch(rest).await
        };

        // Cache the completed records the durable store showed (once per id, never for an id
        // forgotten in this batch).
        let now_ms = self.clock.now_ms();
        let mut cached: HashSet<&RecordId> = forgotten.iter().collect();
        let mut fills = Vec::new();
        for (id, answer) in rest_ids.iter().zip(&decided) {
            let rec = match answer {
                Ok(Outcome::Claimed(Claim::Duplicate { record }))
                | Ok(Outcome::Marked(Mark::New { record } | Mark::Duplicate { record }))
                | Ok(Outcome::Completed(record))
                | Ok(Outcome::Found(Some(record))) => record,
                _ => continue,
            };
            if rec.state != State::Completed || !cached.insert(id) {
                continue;
            }
            let ttl_ms = rec.expires_at_ms.saturating_sub(now_ms);
            if ttl_ms <= self.expiry_margin_ms {
                continue;
            }
            let Ok(result) = serde_json::to_value(Cached {
                dedupgate_tiered_v1: rec.clone(),
            }) else {
                continue;
            };
            let fill = MarkOptions {
                ttl_ms: Some(ttl_ms),
                fingerprint: None,
                result: Some(result),
            };
            // A ttl past the longest one a mark takes is not cached.
            let Ok(fill) = ValidOp::mark(fill, Defaults::default()) else {
                continue;
            };
            fills.push((Self::cache_id(id), fill));
        }
        for (i, answer) in rest_index.into_iter().zip(decided) {
            answers[i] = Some(answer);
        }
        if !fills.is_empty() {
            for r in self.fast_batch(fills).await {
                if let Err(e) = r {
                    self.fast_failed("mark", &e);
                }
            }
        }
        self.invalidate(&forgotten).await;

        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    Err(GateError::Store(StoreError::Unavailable(
                        "the durable store gave no answer".to_owned(),
                    )))
                })
            })
            .collect()
    }
}

/// The stored entry a cached completed record stands for: the token that completed it is not
/// cached (no answer shows it), and only in-progress entries keep a claim's ttl.
fn completed_entry(dur: Record) -> Entry {
    Entry {
        state: EntryState::Completed,
        fence: dur.fence,
        token: None,
        fingerprint: dur.fingerprint,
        owner: dur.owner,
        created_at_ms: dur.created_at_ms,
        expires_at_ms: dur.expires_at_ms,
        lease_expires_at_ms: dur.lease_expires_at_ms,
        completed_at_ms: dur.completed_at_ms,
        result: dur.result,
        ttl_ms: None,
    }
}

#[async_trait]
impl Store for TieredStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        self.decide(vec![(id, op)]).await.pop().unwrap_or_else(|| {
            Err(GateError::Store(StoreError::Unavailable(
                "no answer".to_owned(),
            )))
        })
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        self.decide(ops).await
    }

    /// The tier can decide exactly when the durable store can.
    async fn health(&self) -> Result<(), StoreError> {
        self.durable.health().await
    }

    /// Sweeps each tier that does not sweep itself, so a tier with its own sweeper has one owner.
    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        let durable = if self.durable.sweeps_itself() {
            0
        } else {
            self.durable.sweep_expired(batch_max).await?
        };
        let fast = if self.fast.sweeps_itself() {
            0
        } else {
            self.fast.sweep_expired(batch_max).await.unwrap_or(0)
        };
        Ok(durable + fast)
    }

    /// Only when both tiers do: otherwise a face's sweep timer sweeps the one that does not.
    fn sweeps_itself(&self) -> bool {
        self.durable.sweeps_itself() && self.fast.sweeps_itself()
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.durable.stats().await
    }

    fn describe(&self) -> String {
        format!(
            "tiered: fast {} in front of durable {}",
            self.fast.describe(),
            self.durable.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(id: &RecordId) -> Record {
        Record {
            namespace: id.namespace.clone(),
            key: id.key.clone(),
            state: State::Completed,
            fence: 7_000,
            fingerprint: Some("fp".into()),
            owner: None,
            created_at_ms: 100,
            expires_at_ms: 10_000,
            lease_expires_at_ms: None,
            completed_at_ms: Some(150),
            result: Some(serde_json::json!({"ok": true})),
        }
    }

    fn claim(fingerprint: Option<&str>) -> Op {
        Op::Claim {
            ttl_ms: 1_000,
            lease_ms: 1_000,
            fingerprint: fingerprint.map(str::to_owned),
            owner: None,
        }
    }

    #[test]
    fn a_cached_record_answers_duplicates_and_gets_as_the_durable_store_would() {
        let id = RecordId::new("ns", "k").unwrap();
        let rec = completed(&id);
        let answer = |op: &Op| {
            let op = ValidOp::try_from(op.clone()).expect("the test's ops are valid");
            TieredStore::answer_from_cache(&id, &op, rec.clone(), 500)
        };
        assert_eq!(
            answer(&claim(Some("fp"))),
            Some(Outcome::Claimed(Claim::Duplicate {
                record: rec.clone()
            }))
        );
        let mark = Op::Mark {
            ttl_ms: 1_000,
            fingerprint: None,
            result: None,
        };
        assert_eq!(
            answer(&mark),
            Some(Outcome::Marked(Mark::Duplicate {
                record: rec.clone()
            }))
        );
        assert_eq!(answer(&Op::Get), Some(Outcome::Found(Some(rec.clone()))));
    }

    #[test]
    fn refusals_and_writes_go_to_the_durable_store() {
        let id = RecordId::new("ns", "k").unwrap();
        let rec = completed(&id);
        let answer = |op: &Op, now_ms| {
            let op = ValidOp::try_from(op.clone()).expect("the test's ops are valid");
            TieredStore::answer_from_cache(&id, &op, rec.clone(), now_ms)
        };
        assert_eq!(answer(&claim(Some("other")), 500), None, "a mismatch");
        assert_eq!(answer(&Op::Forget, 500), None, "forget writes");
        assert_eq!(answer(&claim(None), 10_000), None, "expired: a new claim");
    }
}
