//! Concurrent histories recorded on every store and face, checked for linearizability against
//! the memory store's semantics (`decide`). Seeds are printed; `DEDUPGATE_TORTURE_SEED` replays
//! the operations (not the interleaving).

use std::sync::Arc;

use dedupgate_core::Store;
use dedupgate_torture::linrun::{self, LinRunConfig};
use dedupgate_torture::{check, faces, LinConfig};

async fn histories(store: Arc<dyn Store>, what: &str, cfg: LinConfig, rounds: u64) {
    let seed = dedupgate_torture::seed(what);
    let tag: u32 = rand::random();
    for round in 0..rounds {
        let run = LinRunConfig::small(format!("lin.{tag:x}.{round}"));
        let events = linrun::run(store.clone(), &run, seed.wrapping_add(round)).await;
        let report = check(&events, &cfg);
        eprintln!("{what} round {round}: {}", report.summary());
        assert!(
            report.violations().is_empty() && report.inconclusive() == 0,
            "{what}: seed {seed} round {round}: {}",
            report.summary()
        );
    }
}

fn skew1() -> LinConfig {
    LinConfig {
        skew_ms: 1,
        ..LinConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_histories_are_linearizable() {
    let dir = tempfile::tempdir().unwrap();
    let store = faces::open(&format!("embedded:{}", dir.path().join("d").display()))
        .await
        .unwrap();
    histories(store, "lin embedded", LinConfig::default(), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_histories_are_linearizable() {
    let url = std::env::var("DEDUPGATE_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    histories(faces::open(&url).await.unwrap(), "lin redis", skew1(), 2).await;
}

/// PostgreSQL's plain reads do not wait for a writer's commit, so its clock may appear to step
/// back by a commit's duration along the order (`PG_CLOCK_SLACK_MS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_histories_are_linearizable() {
    let url = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let cfg = LinConfig {
        clock_slack_ms: dedupgate_torture::runner::PG_CLOCK_SLACK_MS,
        ..skew1()
    };
    histories(faces::open(&url).await.unwrap(), "lin postgres", cfg, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_face_histories_are_linearizable() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(faces::serve_gate(
        Arc::new(dedupgate_core::MemoryStore::new()),
        listener,
        async move {
            let _ = stop_rx.await;
        },
    ));
    let store = faces::open(&format!("http://{addr}")).await.unwrap();
    histories(store, "lin http", skew1(), 2).await;
    let _ = stop_tx.send(());
    let _ = server.await;
}

/// The two-tier store: Redis answers repeats of completed keys, PostgreSQL decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_store_histories_are_linearizable() {
    let redis = std::env::var("DEDUPGATE_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let pg = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let store = faces::open(&format!("tiered:{redis},{pg}")).await.unwrap();
    let cfg = LinConfig {
        clock_slack_ms: dedupgate_torture::runner::PG_CLOCK_SLACK_MS,
        ..skew1()
    };
    histories(store, "lin tiered", cfg, 2).await;
}
