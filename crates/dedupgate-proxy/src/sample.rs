//! A sample API (feature `sample`) that counts how often each request executes, to put the
//! proxy in front of in tests, examples, benchmarks and the README.
//!
//! Every request to any path executes once and answers JSON describing what it saw. A request
//! is identified by its `Idempotency-Key` plus `Authorization` (so a test can ask how often a
//! given request ran). Query parameters shape the answer:
//! `delay_ms` (sleep first), `status` (answer code), `fail_first` (the first N executions of this
//! request answer 503), `bytes` (answer this many bytes of `application/octet-stream` instead).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use axum::Router;
use bytes::Bytes;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Largest body the sample accepts, and answers with `bytes`.
const SAMPLE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Execution counts, shared between the running API and the test that reads them.
#[derive(Debug, Default)]
pub struct Counts {
    by_request: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
}

impl Counts {
    /// How often the request with this `Idempotency-Key` (and no `Authorization`) ran.
    pub fn of(&self, idempotency_key: &str) -> u64 {
        self.of_caller(idempotency_key, None)
    }

    /// How often the request with this key and `Authorization` value ran.
    pub fn of_caller(&self, idempotency_key: &str, authorization: Option<&str>) -> u64 {
        let id = request_id(Some(idempotency_key), authorization);
        let map = self.by_request.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&id).copied().unwrap_or(0)
    }

    /// Executions of every request.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }
}

fn request_id(key: Option<&str>, auth: Option<&str>) -> String {
    format!("{}\u{0}{}", key.unwrap_or(""), auth.unwrap_or(""))
}

#[derive(Debug, Deserialize)]
struct Shape {
    delay_ms: Option<u64>,
    status: Option<u16>,
    fail_first: Option<u64>,
    bytes: Option<usize>,
}

/// The sample API as an axum router over `counts`.
pub fn router(counts: Arc<Counts>) -> Router {
    Router::new()
        .fallback(execute)
        .with_state(counts)
        .layer(axum::extract::DefaultBodyLimit::max(SAMPLE_BYTES_MAX))
}

async fn execute(
    State(counts): State<Arc<Counts>>,
    Query(shape): Query<Shape>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let id = request_id(text("idempotency-key"), text("authorization"));
    let count = {
        let mut map = counts.by_request.lock().unwrap_or_else(|p| p.into_inner());
        let c = map.entry(id).or_insert(0);
        *c += 1;
        *c
    };
    let execution = counts.total.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(ms) = shape.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let builder = Response::builder()
        .header("x-execution", execution)
        .header("set-cookie", format!("session={execution}; HttpOnly"));
    if shape.fail_first.is_some_and(|n| count <= n) {
        return builder
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .header("content-type", "text/plain")
            .body(Body::from("temporarily unavailable\n"))
            .expect("a valid response");
    }
    let status = shape
        .status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(if method == Method::POST {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        });
    if let Some(n) = shape.bytes {
        let data: Vec<u8> = (0..n.min(SAMPLE_BYTES_MAX))
            .map(|i| (i % 251) as u8)
            .collect();
        return builder
            .status(status)
            .header("content-type", "application/octet-stream")
            .body(Body::from(data))
            .expect("a valid response");
    }
    let answer = serde_json::json!({
        "execution": execution,
        "count": count,
        "method": method.as_str(),
        "path": uri.path(),
        "body_bytes": body.len(),
        "body_sha256": hex::encode(Sha256::digest(&body)),
        "host": text("host"),
        "x_forwarded_for": text("x-forwarded-for"),
        "x_forwarded_proto": text("x-forwarded-proto"),
        "x_forwarded_host": text("x-forwarded-host"),
    });
    builder
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(answer.to_string()))
        .expect("a valid response")
}

/// A running sample API.
#[derive(Debug, Clone)]
pub struct SampleApi {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Its execution counts.
    pub counts: Arc<Counts>,
}

impl SampleApi {
    /// Serves the sample API on `listener` in a background task.
    pub fn spawn(listener: tokio::net::TcpListener) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let app = router(counts.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "sample API stopped");
            }
        });
        Ok(Self { addr, counts })
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
