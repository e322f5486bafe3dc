//! The conformance suite of dedupgate-core, every rule, on the local PostgreSQL.

mod common;

use std::sync::Arc;

use dedupgate_core::testkit::{run_all, RealTimeHarness};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_passes_the_conformance_suite() {
    let url = common::url();
    let schema = common::fresh_schema("conformance");
    let store = common::open(&url, &schema, 16).await;
    common::with_schema_dropped(&url, &schema, async move {
        let harness = RealTimeHarness(Arc::new(store));
        run_all(&harness).await;
    })
    .await;
}

/// The concurrent overlapping batches case alone (it is also in the suite above), for a
/// quick look at the race it guards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_store_decides_concurrent_overlapping_batches() {
    let url = common::url();
    let schema = common::fresh_schema("overlap");
    let store = common::open(&url, &schema, 16).await;
    common::with_schema_dropped(&url, &schema, async move {
        let harness = RealTimeHarness(Arc::new(store));
        let (_, case) = dedupgate_core::testkit::cases()
            .into_iter()
            .find(|(name, _)| *name == "concurrent_overlapping_batches_one_new_per_key")
            .expect("the case exists");
        case(&harness).await;
    })
    .await;
}
