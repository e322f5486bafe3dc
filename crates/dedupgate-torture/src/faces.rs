//! The gate under test, whichever face it has: every face is driven through the core's
//! [`Store`] trait so that one recorder, one worker and one checker serve them all.
//!
//! - [`open`]: a store from a STORE string: `http://HOST:PORT` for the HTTP face, or any form
//!   `dedupgate` itself takes (`memory:`, `embedded:PATH` or a path, `redis://…`,
//!   `postgres://…`, `tiered:FAST,DURABLE`, …), parsed and opened by `dedupgate-stores`.
//! - [`HttpStore`]: the HTTP face (a `dedupgate serve` or [`serve_gate`]) seen as a [`Store`],
//!   through `dedupgate-client` with its retries turned off: the harness makes every retry a
//!   separate recorded operation, so a history holds exactly what reached the gate.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupgate_client::{Client, ClientError, MarkOptions, RetryPolicy};
use dedupgate_core::{ClaimOptions, GateError, Op, Outcome, RecordId, Store, StoreError};

/// Why a store would not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The STORE string names no form the harness drives.
    #[error("{0} (or http:// for the HTTP face)")]
    Spec(#[from] dedupgate_stores::SpecError),
    /// The store refused to open.
    #[error(transparent)]
    Store(#[from] dedupgate_stores::OpenStoreError),
    /// The HTTP face's client would not build.
    #[error("opening {spec}: {source}")]
    Http {
        /// The base URL.
        spec: String,
        /// Why.
        #[source]
        source: ClientError,
    },
}

/// Opens the store a STORE string names (see the module doc for the forms).
pub async fn open(spec: &str) -> Result<Arc<dyn Store>, OpenError> {
    let spec = spec.trim();
    if spec.starts_with("http://") || spec.starts_with("https://") {
        let store = HttpStore::new(spec).map_err(|source| OpenError::Http {
            spec: spec.to_owned(),
            source,
        })?;
        return Ok(Arc::new(store));
    }
    let parsed: dedupgate_stores::StoreSpec = spec.parse()?;
    Ok(dedupgate_stores::open(&parsed).await?)
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

/// The HTTP face as a [`Store`]. Transport errors and 503s are [`StoreError::Unavailable`]:
/// unknown outcomes.
#[derive(Clone, Debug)]
pub struct HttpStore {
    client: Client,
    base: String,
}

impl HttpStore {
    /// A store talking to the server at `base` (no retries, 10 s per call).
    pub fn new(base: &str) -> Result<Self, ClientError> {
        let client = Client::new(base)?
            .with_retry(RetryPolicy {
                attempts_max: 1,
                backoff_initial_ms: 1,
                backoff_max_ms: 1,
            })
            .with_timeout(Duration::from_secs(10))?;
        Ok(Self {
            client,
            base: base.to_owned(),
        })
    }
}

fn gate_error(e: ClientError) -> GateError {
    match e {
        ClientError::Gate(g) => g,
        other => GateError::Store(StoreError::Unavailable(other.to_string())),
    }
}

#[async_trait]
impl Store for HttpStore {
    async fn apply(&self, id: RecordId, op: Op) -> Result<Outcome, GateError> {
        let (ns, key) = (id.namespace.to_string(), id.key.to_string());
        let c = &self.client;
        match op {
            Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner: Some(owner),
            } => c
                .claim(
                    &ns,
                    &key,
                    ClaimOptions {
                        ttl_ms: Some(ttl_ms),
                        lease_ms: Some(lease_ms),
                        fingerprint,
                        owner: Some(owner),
                    },
                )
                .await
                .map(Outcome::Claimed)
                .map_err(gate_error),
            // The typed claim adds an owner when none is given; a batch item is sent as it is.
            Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner: None,
            } => {
                let mut item = serde_json::json!({"op": "claim", "namespace": ns, "key": key,
                    "ttl_ms": ttl_ms, "lease_ms": lease_ms});
                if let Some(f) = fingerprint {
                    item["fingerprint"] = f.into();
                }
                let mut items = c.batch(vec![item]).await.map_err(gate_error)?;
                match items.pop() {
                    Some(Ok(v)) => serde_json::from_value(v)
                        .map(Outcome::Claimed)
                        .map_err(|e| GateError::Store(StoreError::Corrupt(e.to_string()))),
                    Some(Err(p)) => Err(p.to_gate_error().unwrap_or_else(|| {
                        GateError::Store(StoreError::Unavailable(format!("{p:?}")))
                    })),
                    None => Err(GateError::Store(StoreError::Corrupt(
                        "empty batch answer".into(),
                    ))),
                }
            }
            Op::Complete {
                token,
                result,
                ttl_ms,
            } => c
                .complete(&ns, &key, &token, result, ttl_ms)
                .await
                .map(Outcome::Completed)
                .map_err(gate_error),
            Op::Release { token } => c
                .release(&ns, &key, &token)
                .await
                .map(|()| Outcome::Released)
                .map_err(gate_error),
            Op::Extend { token, lease_ms } => c
                .extend(&ns, &key, &token, lease_ms)
                .await
                .map(|lease_expires_at_ms| Outcome::Extended {
                    lease_expires_at_ms,
                })
                .map_err(gate_error),
            Op::Mark {
                ttl_ms,
                fingerprint,
                result,
            } => c
                .mark(
                    &ns,
                    &key,
                    MarkOptions {
                        ttl_ms: Some(ttl_ms),
                        fingerprint,
                        result,
                    },
                )
                .await
                .map(Outcome::Marked)
                .map_err(gate_error),
            Op::Get => c
                .get(&ns, &key)
                .await
                .map(Outcome::Found)
                .map_err(gate_error),
            Op::Forget => c
                .forget(&ns, &key)
                .await
                .map(Outcome::Forgotten)
                .map_err(gate_error),
        }
    }

    async fn health(&self) -> Result<(), StoreError> {
        self.client
            .health()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }

    async fn sweep_expired(&self, _batch_max: usize) -> Result<u64, StoreError> {
        // The server sweeps on its own.
        Ok(0)
    }

    fn describe(&self) -> String {
        format!("http: {}", self.base)
    }
}
