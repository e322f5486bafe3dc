//! The memory store against the conformance suite, on a clock the suite moves by hand.

use std::sync::Arc;

use dedupgate_core::testkit::{run_all, ClockedHarness};
use dedupgate_core::{ManualClock, MemoryStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_passes_the_conformance_suite() {
    let clock = ManualClock::new(1_764_000_000_000);
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    run_all(&ClockedHarness { clock, store }).await;
}
