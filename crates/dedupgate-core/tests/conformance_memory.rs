//! The memory store against the conformance suite, on a clock the suite moves by hand.

use std::sync::Arc;

use async_trait::async_trait;
use dedupgate_core::testkit::{run_all, Harness};
use dedupgate_core::{ManualClock, MemoryStore, Store};

struct MemoryHarness {
    clock: ManualClock,
    store: Arc<dyn Store>,
}

#[async_trait]
impl Harness for MemoryHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }
    async fn advance(&self, ms: u64) {
        self.clock.advance(ms);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_passes_the_conformance_suite() {
    let clock = ManualClock::new(1_764_000_000_000);
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    run_all(&MemoryHarness { clock, store }).await;
}
