//! The client's `HttpStore` against the conformance suite: a dedupgate server (in this process,
//! over a memory store on a clock the suite moves by hand) seen as one more `Store`, the way
//! `--store http://…` and the torture harness use it, with and without the client's retries.

use std::sync::Arc;

use dedupgate_client::{HttpStore, HttpStoreOptions};
use dedupgate_core::testkit::{run_all, ClockedHarness};
use dedupgate_core::{ManualClock, MemoryStore};
use dedupgate_server::{AppState, ServerConfig};
use tokio::sync::oneshot;

/// Serves a memory store on a free port; the server stops when the returned sender drops.
async fn server_over_memory(clock: &ManualClock) -> (String, oneshot::Sender<()>) {
    let memory = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = AppState::new(memory, ServerConfig::default());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(dedupgate_server::serve(listener, state, async move {
        let _ = stopped.await;
    }));
    (url, stop)
}

async fn passes(options: HttpStoreOptions) {
    let clock = ManualClock::new(1_764_000_000_000);
    let (url, _stop) = server_over_memory(&clock).await;
    let store = Arc::new(HttpStore::new(&url, options).unwrap());
    run_all(&ClockedHarness { clock, store }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_store_without_retries_passes_the_conformance_suite() {
    passes(HttpStoreOptions::without_retries()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_store_with_the_clis_retries_passes_the_conformance_suite() {
    passes(HttpStoreOptions::default()).await;
}
