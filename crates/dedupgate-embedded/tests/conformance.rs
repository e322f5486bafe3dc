//! The conformance suite of dedupgate-core, run against the embedded store on a manual clock.

use std::sync::Arc;

use dedupgate_core::testkit::{run_all, ClockedHarness};
use dedupgate_core::ManualClock;
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_store_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_764_000_000_000);
    let options = EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        ..EmbeddedOptions::default()
    };
    let store = Arc::new(EmbeddedStore::open(dir.path().join("data"), options).unwrap());
    let h = ClockedHarness {
        store: store.clone(),
        clock,
    };
    run_all(&h).await;
    // Concurrent callers shared commits: the suite's 64-task cases must not cost a fsync each.
    assert!(store.commits_total() > 0);
}
