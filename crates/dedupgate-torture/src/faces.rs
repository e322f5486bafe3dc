//! The gate under test, whichever face it has: every face is driven through the core's
//! [`Store`] trait so that one recorder, one worker and one checker serve them all.
//!
//! - [`open`]: a store from a STORE string, any form `dedupgate` itself takes (`memory:`,
//!   `embedded:PATH` or a path, `redis://…`, `postgres://…`, `tiered:FAST,DURABLE`,
//!   `http://HOST:PORT` for the HTTP face, …), parsed and opened by `dedupgate-stores`.
//! - [`HttpStore`]: the HTTP face (a `dedupgate serve` or [`serve_gate`]) seen as a [`Store`],
//!   the client crate's own, always opened here with its retries turned off
//!   ([`HttpStoreOptions::without_retries`]): the harness makes every retry a separate recorded
//!   operation, so a history holds exactly what reached the gate.

use std::sync::Arc;
use std::time::Duration;

pub use dedupgate_client::{HttpStore, HttpStoreOptions};
use dedupgate_core::Store;

/// Why a store would not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The STORE string names no form the harness drives.
    #[error("{0} (or http:// for the HTTP face)")]
    Spec(#[from] dedupgate_stores::SpecError),
    /// The store refused to open.
    #[error(transparent)]
    Store(#[from] dedupgate_stores::OpenStoreError),
}

/// Opens the store a STORE string names (see the module doc for the forms).
pub async fn open(spec: &str) -> Result<Arc<dyn Store>, OpenError> {
    let parsed: dedupgate_stores::StoreSpec = spec.parse()?;
    let options = dedupgate_stores::OpenOptions {
        http: HttpStoreOptions::without_retries(),
    };
    Ok(dedupgate_stores::open_with(&parsed, &options).await?)
}

/// [`open`], tried up to `tries` times 50 ms apart: a store behind a faulty network (the TCP
/// fault proxy) may fail to open now and then, which is not what a run checks.
pub async fn open_retrying(spec: &str, tries: u32) -> Result<Arc<dyn Store>, OpenError> {
    let mut n = 1;
    loop {
        match open(spec).await {
            Ok(s) => return Ok(s),
            Err(e) if n >= tries => return Err(e),
            Err(_) => {
                n += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves the HTTP API over `store` on `listener` until `shutdown` resolves: the same
/// `dedupgate-server` the `dedupgate serve` command runs, so the harness can run a gate process
/// of its own (`dedupgate-torture gate`) and SIGKILL it.
pub async fn serve_gate(
    store: Arc<dyn Store>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = dedupgate_server::AppState::new(store, dedupgate_server::ServerConfig::default());
    dedupgate_server::serve(listener, state, shutdown).await
}
