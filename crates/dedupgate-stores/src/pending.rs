//! A store that could not be opened yet because its server is unavailable: [`open_or_pending`]
//! hands out a [`PendingStore`] that answers every operation `unavailable` (nothing decided, safe
//! to retry) while a background task keeps opening the spec with backoff, and forwards to the
//! store once it opened. A long-running face (the proxy) can so start, answer 503 while the
//! store is down, and work without a restart once it answers.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use dedupgate_core::error::chain_text;
use dedupgate_core::{GateError, Outcome, RecordId, Store, StoreError, StoreStats, ValidOp};

use crate::{open, OpenStoreError, StoreSpec};

/// Pauses between attempts at opening: from `first`, doubled after each failure, up to `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Pause after the first failure.
    pub first: Duration,
    /// Longest pause.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(250),
            max: Duration::from_secs(5),
        }
    }
}

/// Opens `spec`. When it fails only because its server is unavailable
/// ([`OpenStoreError::is_unavailable`]), returns a [`PendingStore`] that keeps trying in the
/// background (with `backoff`, each failure logged), together with that first error. Any other
/// failure (a bad URL, a refused configuration, a corrupt directory) is returned as the error:
/// retrying would not help.
pub async fn open_or_pending(
    spec: &StoreSpec,
    backoff: Backoff,
) -> Result<(Arc<dyn Store>, Option<OpenStoreError>), OpenStoreError> {
    match open(spec).await {
        Ok(store) => Ok((store, None)),
        Err(e) if e.is_unavailable() => {
            let pending = PendingStore::spawn(spec.clone(), backoff, chain_text(&e));
            Ok((Arc::new(pending), Some(e)))
        }
        Err(e) => Err(e),
    }
}

/// A store being opened in the background: `unavailable` until then, the opened store after.
#[derive(Debug)]
pub struct PendingStore {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    spec: String,
    store: OnceLock<Arc<dyn Store>>,
    last_error: Mutex<String>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("spec", &self.spec)
            .field("open", &self.store.get().is_some())
            .finish()
    }
}

impl PendingStore {
    /// Starts the background task (on the current tokio runtime); `first_error` is why the
    /// first attempt failed.
    pub fn spawn(spec: StoreSpec, backoff: Backoff, first_error: String) -> Self {
        let shared = Arc::new(Shared {
            spec: crate::redact(&spec_text(&spec)),
            store: OnceLock::new(),
            last_error: Mutex::new(first_error),
        });
        let task = tokio::spawn(reopen(spec, backoff, shared.clone()));
        Self { shared, task }
    }

    /// True once the store opened.
    pub fn is_open(&self) -> bool {
        self.shared.store.get().is_some()
    }

    fn not_open(&self) -> StoreError {
        let why = self
            .shared
            .last_error
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default();
        StoreError::Unavailable(format!(
            "the store {} is not open yet (retrying in the background): {why}",
            self.shared.spec
        ))
    }
}

impl Drop for PendingStore {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn reopen(spec: StoreSpec, backoff: Backoff, shared: Arc<Shared>) {
    let mut pause = backoff.first;
    let mut attempt: u64 = 1;
    loop {
        tokio::time::sleep(pause).await;
        attempt += 1;
        match open(&spec).await {
            Ok(store) => {
                tracing::info!(
                    store = %store.describe(),
                    attempt,
                    "the store opened: idempotent requests are served from now on"
                );
                let _ = shared.store.set(store);
                return;
            }
            Err(e) => {
                let text = chain_text(&e);
                pause = (pause * 2).min(backoff.max);
                if e.is_unavailable() {
                    tracing::warn!(
                        attempt,
                        retry_in_ms = pause.as_millis() as u64,
                        "the store is still unavailable: {text}"
                    );
                } else {
                    tracing::error!(
                        attempt,
                        retry_in_ms = pause.as_millis() as u64,
                        "the store's server answers but the store refuses to open: {text}"
                    );
                }
                if let Ok(mut last) = shared.last_error.lock() {
                    *last = text;
                }
            }
        }
    }
}

#[async_trait]
impl Store for PendingStore {
    // An invalid op never gets here (a `ValidOp` was checked when it was built), so it is
    // refused as invalid (400) whether or not the store is up, never "unavailable" (503).
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        match self.shared.store.get() {
            Some(s) => s.apply(id, op).await,
            None => Err(GateError::Store(self.not_open())),
        }
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        match self.shared.store.get() {
            Some(s) => s.apply_batch(ops).await,
            None => ops
                .iter()
                .map(|_| Err(GateError::Store(self.not_open())))
                .collect(),
        }
    }

    async fn health(&self) -> Result<(), StoreError> {
        match self.shared.store.get() {
            Some(s) => s.health().await,
            None => Err(self.not_open()),
        }
    }

    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        match self.shared.store.get() {
            Some(s) => s.sweep_expired(batch_max).await,
            None => Err(self.not_open()),
        }
    }

    /// The opened store's answer; until it opens, false, so a face's sweep timer keeps calling
    /// [`Store::sweep_expired`], which forwards once the store is open.
    fn sweeps_itself(&self) -> bool {
        self.shared.store.get().is_some_and(|s| s.sweeps_itself())
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        match self.shared.store.get() {
            Some(s) => s.stats().await,
            None => Err(self.not_open()),
        }
    }

    fn describe(&self) -> String {
        match self.shared.store.get() {
            Some(s) => s.describe(),
            None => format!("{} (not open yet)", self.shared.spec),
        }
    }
}

/// The spec as its user wrote it (before redaction), for messages.
fn spec_text(spec: &StoreSpec) -> String {
    match spec {
        StoreSpec::Memory => "memory:".to_owned(),
        StoreSpec::Embedded(dir) => format!("embedded:{}", dir.display()),
        StoreSpec::Redis(u)
        | StoreSpec::RedisCluster(u)
        | StoreSpec::Postgres(u)
        | StoreSpec::Http(u) => u.clone(),
        StoreSpec::Tiered(fast, durable) => {
            format!("tiered:{},{}", spec_text(fast), spec_text(durable))
        }
    }
}

// Both tests open Redis stores, inside a tiered store too.
#[cfg(all(test, feature = "redis", feature = "tiered"))]
mod tests {
    use super::*;
    use dedupgate_core::testkit::ApplyOp;
    use dedupgate_core::Op;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Nothing listens on the port: the open is pending and every operation answers
    /// `unavailable`; a refused option is an error at once, never pending.
    #[tokio::test]
    async fn unreachable_server_is_pending_and_a_bad_option_is_refused() {
        let port = free_port();
        let spec: StoreSpec = format!("tiered:memory:,redis://127.0.0.1:{port}")
            .parse()
            .unwrap();
        let (store, first) = open_or_pending(&spec, Backoff::default()).await.unwrap();
        let first = first.expect("the first open failed");
        assert!(first.is_unavailable(), "{first}");
        let id = RecordId::new("pending", "k").unwrap();
        let r = store.apply_op(id, Op::Get).await;
        assert!(
            matches!(r, Err(GateError::Store(StoreError::Unavailable(_)))),
            "{r:?}"
        );
        assert!(store.health().await.is_err());
        assert!(store.describe().contains("not open yet"));
        // An invalid op is invalid (400), not unavailable (503), even before the store opens.
        let bad = Op::Claim {
            ttl_ms: 0,
            lease_ms: 1_000,
            fingerprint: None,
            owner: None,
        };
        let r = store
            .apply_op(RecordId::new("pending", "k").unwrap(), bad.clone())
            .await;
        assert!(matches!(r, Err(GateError::Invalid(_))), "{r:?}");
        let answers = store
            .apply_ops(vec![
                (RecordId::new("pending", "a").unwrap(), bad),
                (RecordId::new("pending", "b").unwrap(), Op::Get),
            ])
            .await;
        assert!(
            matches!(answers[0], Err(GateError::Invalid(_))),
            "{answers:?}"
        );
        assert!(
            matches!(
                answers[1],
                Err(GateError::Store(StoreError::Unavailable(_)))
            ),
            "{answers:?}"
        );

        let spec: StoreSpec = format!("redis://127.0.0.1:{port}?wait_replicas=x")
            .parse()
            .unwrap();
        let err = open_or_pending(&spec, Backoff::default())
            .await
            .err()
            .expect("a bad option is refused");
        assert!(!err.is_unavailable(), "{err}");
    }

    /// A server that answers but refuses the store (a wrong Redis password, a PostgreSQL
    /// database that does not exist) is an error at once, never a pending store retrying in
    /// the background.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refusal_by_a_running_server_is_refused_not_pending() {
        use dedupgate_redis::testkit::RedisServer;

        let server = tokio::task::spawn_blocking(|| RedisServer::start(&[]))
            .await
            .unwrap()
            .expect("start redis-server");
        // Set after start: the testkit waits for a PING that a password would answer NOAUTH.
        let out = server
            .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
            .unwrap();
        assert_eq!(out.trim(), "OK");
        for url in [
            format!("redis://:wrong@127.0.0.1:{}", server.port()),
            format!("redis://127.0.0.1:{}", server.port()),
            format!("tiered:memory:,redis://:wrong@127.0.0.1:{}", server.port()),
        ] {
            let spec: StoreSpec = url.parse().unwrap();
            let err = open_or_pending(&spec, Backoff::default())
                .await
                .err()
                .unwrap_or_else(|| panic!("{url}: refused, not pending"));
            assert!(!err.is_unavailable(), "{url}: {err}");
            let text = chain_text(&err);
            assert!(text.contains("authentication"), "{url}: {text}");
            assert!(!text.contains("wrong@"), "password shown: {text}");
        }
        let right: StoreSpec = format!("redis://:s3cret@127.0.0.1:{}", server.port())
            .parse()
            .unwrap();
        let (store, first) = open_or_pending(&right, Backoff::default()).await.unwrap();
        assert!(first.is_none(), "{first:?}");
        assert!(store.health().await.is_ok());

        let pg = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let missing = format!(
            "{}/dedupgate_no_such_db_{}",
            pg.rsplit_once('/').unwrap().0,
            std::process::id()
        );
        let spec: StoreSpec = missing.parse().unwrap();
        let err = open_or_pending(&spec, Backoff::default())
            .await
            .err()
            .unwrap_or_else(|| panic!("{missing}: refused, not pending"));
        assert!(!err.is_unavailable(), "{err}");
        assert!(chain_text(&err).contains("3D000"), "{}", chain_text(&err));
    }
}
