//! Which ids the entries table may hold: a Bloom filter in front of the engine's reads.
//!
//! The writer reads every op's entry before it decides. For a new key that read finds nothing,
//! and in fjall "nothing" is the dearest answer: a walk down every memtable's skip list, then a
//! Bloom probe (and sometimes a block read) in every segment. Under a load of new keys that was
//! about half of the writer thread's time. One probe of this filter answers most of those reads
//! instead: "absent" for sure, or "maybe", and then the engine reads as before.
//!
//! The one rule that keeps it correct: **every id in the table is in the filter** (a filter
//! may hold ids that are gone; a missing one would turn a duplicate into "new"). So:
//! - every id the engine puts is added before the put reaches the engine;
//! - a filter answers only once a scan has added every id stored before it was made. The scan
//!   runs on a thread of its own over a snapshot taken after the filter began taking puts, so
//!   any id is in the snapshot, or was put later and added directly. Until it finishes (after
//!   each open, for instance) every read goes to the engine;
//! - removals leave their bits behind, and a filter that has grown too full or too stale is
//!   replaced the same way: a new one takes puts, a scan fills it, and it answers from then on.
//!
//! Nothing of it is on disk: it is rebuilt at every open, so no crash can leave it wrong.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use fastbloom::BloomFilter;

/// Fewest ids a filter is sized for (~4.8 MiB of bits at the false-positive rate below).
const CAPACITY_MIN: u64 = 1 << 22;
/// The share of absent ids a full filter still calls "maybe" (they then read the engine).
const FALSE_POSITIVE_RATE: f64 = 0.01;
/// A scan checks whether it was cancelled after this many ids.
const CANCEL_CHECK_EVERY: u64 = 4_096;

/// What a scan over a snapshot of the table reports: the ids it found, as a filter, and how
/// many there were; or why it stopped.
type ScanResult = Result<(BloomFilter, u64), String>;

/// Calls `each` with every id of a snapshot of the table (taken when the scan was made, read
/// on the scan's thread) until `each` returns false; an unreadable table ends it with an error.
pub(crate) type IdScan =
    Box<dyn FnOnce(&mut dyn FnMut(&[u8]) -> bool) -> Result<(), String> + Send>;

/// A filter being filled: it takes every put from the instant it was made, and the scan started
/// then adds every id stored before.
struct Build {
    filter: BloomFilter,
    capacity: u64,
    /// Ids new to `filter` put since it was made (some may be in the scan too: an overcount
    /// only brings the next rebuild sooner).
    added: u64,
    result: mpsc::Receiver<ScanResult>,
    cancel: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Build {
    fn stop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// See the module documentation.
pub(crate) struct IdFilter {
    /// The same hash for every filter of this process (a union needs it); seeded at random, so
    /// ids chosen to collide cost their sender reads, not everyone.
    hasher: std::collections::hash_map::RandomState,
    /// The filter that answers, once one is complete.
    live: Option<Live>,
    building: Option<Build>,
    /// Set after a scan failed: no new build until the engine reopens (reads go on as before).
    scan_failed: bool,
}

struct Live {
    filter: BloomFilter,
    capacity: u64,
    /// Ids the scan that completed it found, and ids new to it since (their bits were unset).
    scanned: u64,
    added: u64,
    /// Ids removed from the table since it was completed (their bits stay set).
    removed: u64,
}

impl Live {
    /// Ids it holds bits for, as far as it knows (removed ones included).
    fn held(&self) -> u64 {
        self.scanned + self.added
    }

    /// Whether it should be replaced: fuller than it was sized for, or holding bits for more
    /// removed ids than live ones (both raise the share of reads that still go to the engine).
    fn worn(&self) -> bool {
        self.held() > self.capacity
            || (self.removed > CAPACITY_MIN / 4 && self.removed > self.held() / 2)
    }
}

fn bloom(capacity: u64) -> BloomFilter {
    BloomFilter::with_false_pos(FALSE_POSITIVE_RATE)
        .expected_items(usize::try_from(capacity).unwrap_or(usize::MAX))
}

impl IdFilter {
    pub(crate) fn new() -> Self {
        Self {
            hasher: std::collections::hash_map::RandomState::new(),
            live: None,
            building: None,
            scan_failed: false,
        }
    }

    /// False only when the table certainly holds no entry under `id` (the id is hashed only
    /// when a filter answers).
    pub(crate) fn may_hold(&self, id: &[u8]) -> bool {
        match &self.live {
            Some(live) => live.filter.contains_hash(self.hasher.hash_one(id)),
            None => true,
        }
    }

    /// Records an id about to be put into the table (hashed only when a filter takes it).
    pub(crate) fn add(&mut self, id: &[u8]) {
        if self.live.is_none() && self.building.is_none() {
            return;
        }
        let hash = self.hasher.hash_one(id);
        if let Some(live) = &mut self.live {
            if !live.filter.insert_hash(hash) {
                live.added += 1;
            }
        }
        if let Some(build) = &mut self.building {
            if !build.filter.insert_hash(hash) {
                build.added += 1;
            }
        }
    }

    /// Records an id removed from the table.
    pub(crate) fn removed(&mut self) {
        if let Some(live) = &mut self.live {
            live.removed += 1;
        }
    }

    /// Called between transactions: completes a build whose scan has finished, and starts one
    /// when none answers yet or the one that does is worn. `approximate_ids` estimates the
    /// table's size (to size a first filter); `scan` starts a scan of a snapshot taken now.
    pub(crate) fn maintain(
        &mut self,
        approximate_ids: impl FnOnce() -> u64,
        scan: impl FnOnce() -> Result<IdScan, String>,
    ) {
        if let Some(build) = &mut self.building {
            match build.result.try_recv() {
                Err(mpsc::TryRecvError::Empty) => return,
                Ok(Ok((scanned, ids))) => {
                    let mut build = self.building.take().expect("checked above");
                    build.filter.union(&scanned);
                    build.stop();
                    self.live = Some(Live {
                        filter: build.filter,
                        capacity: build.capacity,
                        scanned: ids,
                        added: build.added,
                        removed: 0,
                    });
                }
                Ok(Err(why)) => {
                    self.abandon(&why);
                    return;
                }
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.abandon("the scan stopped without an answer");
                    return;
                }
            }
        }
        if self.scan_failed || self.live.as_ref().is_some_and(|live| !live.worn()) {
            return;
        }
        // Removed ids put again count in both `added` and `removed`: the last scan's count
        // keeps a floor under the estimate.
        let wanted = match &self.live {
            Some(live) => live.held().saturating_sub(live.removed).max(live.scanned),
            None => approximate_ids(),
        };
        let capacity = wanted.saturating_mul(2).max(CAPACITY_MIN);
        match scan() {
            Ok(ids) => self.start_build(capacity, ids),
            Err(why) => self.abandon(&why),
        }
    }

    /// Gives up building until the engine reopens: the filter that answers, if any, goes on
    /// answering (worn, never wrong), else every read goes to the engine.
    fn abandon(&mut self, why: &str) {
        if self.live.is_some() {
            tracing::warn!(error = %why, "the id filter could not be rebuilt; the current one answers until the store reopens");
        } else {
            tracing::warn!(error = %why, "the id filter could not be built; every read goes to the engine until the store reopens");
        }
        if let Some(mut build) = self.building.take() {
            build.stop();
        }
        self.scan_failed = true;
    }

    fn start_build(&mut self, capacity: u64, ids: IdScan) {
        let (tx, result) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let (hasher, stop) = (self.hasher.clone(), Arc::clone(&cancel));
        let spawned = std::thread::Builder::new()
            .name("dedupgate-idscan".into())
            .spawn(move || {
                let mut filter = bloom(capacity);
                let mut n = 0u64;
                let scanned = ids(&mut |id| {
                    filter.insert_hash(hasher.hash_one(id));
                    n += 1;
                    n % CANCEL_CHECK_EVERY != 0 || !stop.load(Ordering::Relaxed)
                });
                if !stop.load(Ordering::Relaxed) {
                    let _ = tx.send(scanned.map(|()| (filter, n)));
                }
            });
        match spawned {
            Ok(thread) => {
                self.building = Some(Build {
                    filter: bloom(capacity),
                    capacity,
                    added: 0,
                    result,
                    cancel,
                    thread: Some(thread),
                });
            }
            Err(e) => self.abandon(&format!("no thread for the scan: {e}")),
        }
    }

    /// Whether a filter answers.
    #[cfg(test)]
    pub(crate) fn answering(&self) -> bool {
        self.live.is_some()
    }
}

impl Drop for IdFilter {
    fn drop(&mut self) {
        if let Some(build) = &mut self.building {
            build.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
        range.map(|i| format!("id-{i}").into_bytes()).collect()
    }

    fn scan_of(ids: Vec<Vec<u8>>) -> IdScan {
        Box::new(move |each| {
            for id in &ids {
                if !each(id) {
                    break;
                }
            }
            Ok(())
        })
    }

    /// Runs `maintain` until a started build has completed (or failed).
    fn complete(filter: &mut IdFilter) {
        while filter.building.is_some() {
            std::thread::sleep(std::time::Duration::from_millis(1));
            filter.maintain(|| unreachable!(), || unreachable!());
        }
    }

    #[test]
    fn answers_nothing_until_a_scan_covered_what_was_stored_before() {
        let mut filter = IdFilter::new();
        let stored = ids(0..1000);
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        // A scan that waits until told: meanwhile the filter must not answer.
        let ready = stored.clone();
        let slow: IdScan = Box::new(move |each| {
            let _ = gate_rx.recv();
            ready.iter().for_each(|id| {
                each(id);
            });
            Ok(())
        });
        filter.maintain(|| 1000, || Ok(slow));
        assert!(
            filter.may_hold(b"never stored"),
            "no filter answers before its scan completes"
        );
        drop(gate_tx);
        complete(&mut filter);
        assert!(filter.answering());
        for id in &stored {
            assert!(filter.may_hold(id), "a stored id is always held");
        }
    }

    #[test]
    fn ids_put_during_a_scan_are_held_though_the_snapshot_lacks_them() {
        let mut filter = IdFilter::new();
        filter.maintain(|| 0, || Ok(scan_of(ids(0..100))));
        let late = ids(100..200);
        for id in &late {
            filter.add(id);
        }
        complete(&mut filter);
        for id in ids(0..200) {
            assert!(filter.may_hold(&id));
        }
        let absent = (1000..2000)
            .filter(|i| !filter.may_hold(format!("id-{i}").as_bytes()))
            .count();
        assert!(
            absent > 900,
            "most absent ids are answered absent ({absent} of 1000)"
        );
    }

    #[test]
    fn a_worn_filter_is_replaced_and_forgets_removed_ids_but_never_a_stored_one() {
        let mut filter = IdFilter::new();
        filter.maintain(|| 0, || Ok(scan_of(Vec::new())));
        complete(&mut filter);
        let gone = ids(0..10_000);
        for id in &gone {
            filter.add(id);
        }
        // Everything was removed again, more than the filter's slack for stale bits.
        for _ in 0..(CAPACITY_MIN / 4 + 1) {
            filter.removed();
        }
        let kept = ids(20_000..20_010);
        filter.maintain(|| unreachable!(), || Ok(scan_of(kept.clone())));
        assert!(filter.building.is_some(), "a worn filter starts a rebuild");
        let during = ids(30_000..30_010);
        for id in &during {
            filter.add(id);
        }
        // The old filter answers meanwhile: a put during the build is held by it too.
        for id in &during {
            assert!(filter.may_hold(id));
        }
        complete(&mut filter);
        for id in kept.iter().chain(&during) {
            assert!(filter.may_hold(id));
        }
        let still = gone.iter().filter(|id| filter.may_hold(id)).count();
        assert!(
            still < 1_000,
            "removed ids mostly forgotten ({still} of 10,000 still held)"
        );
    }

    #[test]
    fn a_failed_scan_leaves_every_read_to_the_engine() {
        let mut filter = IdFilter::new();
        let failing: IdScan = Box::new(|each| {
            each(b"a");
            Err("unreadable segment".to_string())
        });
        filter.maintain(|| 0, || Ok(failing));
        complete(&mut filter);
        assert!(!filter.answering());
        assert!(filter.may_hold(b"anything"));
        // And no new scan starts until the engine reopens (a new filter).
        filter.maintain(|| unreachable!(), || unreachable!());
    }
}
