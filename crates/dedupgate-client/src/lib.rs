//! # dedupgate-client
//!
//! A Rust client of the dedupgate HTTP API (API.md):
//!
//! - [`Client`]: typed calls (`claim`, `complete`, `release`, `extend`, `mark`, `get`, `forget`,
//!   `batch`, `health`) that return the core's own types ([`Claim`], [`Mark`], [`Record`]) and
//!   fail with [`ClientError`], which carries a [`GateError`] for the answers the core defines
//!   (lease lost, fingerprint mismatch, invalid request, unavailable).
//! - [`RetryPolicy`]: how a call is retried on 503 and on transport errors, and why that is safe.
//! - [`HttpStore`]: a server as a core [`Store`](dedupgate_core::Store), so that every face
//!   can talk to a remote gate as to any other store; [`HttpStoreOptions`] says how it retries.
//! - [`load`]: the keep-alive HTTP load generator behind `dedupgate bench`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dedupgate_client::ClientError> {
//! use dedupgate_client::Client;
//! use dedupgate_core::{Claim, ClaimOptions};
//! let gate = Client::new("http://127.0.0.1:7878")?;
//! if let Claim::New(lease) = gate.claim("payments", "evt_1", ClaimOptions::default()).await? {
//!     // ... charge the card, passing lease.fence downstream ...
//!     gate.complete("payments", "evt_1", &lease.token, None, None).await?;
//! }
//! # Ok(()) }
//! ```

pub mod load;
mod store;

pub use store::{HttpStore, HttpStoreOptions};

use std::time::Duration;

use dedupgate_core::{
    Claim, ClaimOptions, GateError, InvalidInput, Mark, Record, StoreError, Token,
};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

/// How calls are retried.
///
/// A call is retried when the server answers 503 `unavailable` (nothing was decided) or the
/// request could not be sent or its answer was lost (connection refused or reset, timeout).
/// That is safe because every operation of the API is idempotent or made so:
///
/// - `claim` always carries an `owner` (one generated per call when the caller gives none), so a
///   retried claim whose first answer was lost gets the same token and fence back instead of
///   locking its own caller out as a duplicate (API.md: "a claim naming the same owner as the
///   current holder answers new again").
/// - `complete` retried with the token that already did it is answered again without a change;
///   `release` retried after its first try did it answers `lease_lost` (API.md: a released
///   token is no longer the holder's), so the client then looks the key up and reports the
///   release done when no live record holds the key; `extend` just renews the lease once more;
///   `get` and `forget` are naturally idempotent.
/// - `mark` retried after a lost answer answers `duplicate`: the caller skips the work. That is
///   the at-most-once promise of the idempotent ordering, never a second run.
/// - `batch` items are each one of the above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries per call, the first included (1 = never retry).
    pub attempts_max: u32,
    /// Backoff before the first retry; doubles each retry (full jitter).
    pub backoff_initial_ms: u64,
    /// Longest backoff between two tries.
    pub backoff_max_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts_max: 5,
            backoff_initial_ms: 50,
            backoff_max_ms: 2_000,
        }
    }
}

impl RetryPolicy {
    /// The pause before retry number `retry` (0-based), with full jitter.
    fn backoff(&self, retry: u32, retry_after_s: Option<u64>) -> Duration {
        let cap = self
            .backoff_initial_ms
            .saturating_mul(1u64 << retry.min(20))
            .min(self.backoff_max_ms);
        let mut bytes = [0u8; 8];
        let jitter = match getrandom::getrandom(&mut bytes) {
            Ok(()) => u64::from_le_bytes(bytes) % cap.max(1),
            Err(_) => cap / 2,
        };
        // The server's Retry-After is a floor, bounded by our own maximum.
        let floor = retry_after_s
            .map(|s| s.saturating_mul(1000).min(self.backoff_max_ms))
            .unwrap_or(0);
        Duration::from_millis(jitter.max(floor))
    }
}

/// A problem JSON answer, as the server sent it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Problem {
    /// HTTP status.
    pub status: u16,
    /// API.md's stable code.
    pub code: String,
    /// Human detail.
    #[serde(default)]
    pub detail: String,
}

impl Problem {
    /// The core error this problem stands for, when the core defines one.
    pub fn to_gate_error(&self) -> Option<GateError> {
        Some(match self.code.as_str() {
            "lease_lost" => GateError::LeaseLost,
            "fingerprint_mismatch" => GateError::FingerprintMismatch,
            "invalid_request" => {
                GateError::Invalid(InvalidInput::new("request", self.detail.clone()))
            }
            "unavailable" => GateError::Store(StoreError::Unavailable(self.detail.clone())),
            _ => return None,
        })
    }
}

/// Why a call got no success answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// An answer the core defines: lease lost, fingerprint mismatch, invalid request, or
    /// unavailable (503 still, after the retries).
    #[error(transparent)]
    Gate(#[from] GateError),
    /// Another problem answer: unauthorized, forbidden, payload_too_large, not_found (route).
    #[error("{} {}: {}", .0.status, .0.code, .0.detail)]
    Rejected(Problem),
    /// The server could not be reached or its answer was lost, after the retries.
    #[error("transport error (the server could not be reached, or its answer was lost)")]
    Transport(#[source] reqwest::Error),
    /// The base URL is unusable or the answer is not what API.md says.
    #[error("protocol: {0}")]
    Protocol(String),
}

impl ClientError {
    /// API.md's code of the error (`transport` and `protocol` for the client's own).
    pub fn code(&self) -> &str {
        match self {
            ClientError::Gate(e) => e.code(),
            ClientError::Rejected(p) => &p.code,
            ClientError::Transport(_) => "transport",
            ClientError::Protocol(_) => "protocol",
        }
    }
}

/// Options of a mark; `None` takes the server's default.
#[derive(Clone, Debug, Default)]
pub struct MarkOptions {
    /// Record retention.
    pub ttl_ms: Option<u64>,
    /// Payload hash.
    pub fingerprint: Option<String>,
    /// Stored and replayed to duplicates.
    pub result: Option<Value>,
}

/// A client of one server. Cheap to clone (connections are pooled and kept alive).
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    bearer: Option<String>,
    retry: RetryPolicy,
}

/// Per-request timeout unless [`Client::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

impl Client {
    /// A client of the server at `base_url` (e.g. `http://127.0.0.1:7878`).
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, Duration::from_millis(DEFAULT_TIMEOUT_MS))
    }

    fn build(base_url: &str, timeout: Duration) -> Result<Self, ClientError> {
        let Some(authority) = base_url
            .strip_prefix("http://")
            .or_else(|| base_url.strip_prefix("https://"))
        else {
            return Err(ClientError::Protocol(format!(
                "server URL {base_url:?} must start with http:// or https://"
            )));
        };
        if authority.trim_start_matches('/').is_empty() {
            return Err(ClientError::Protocol(format!(
                "server URL {base_url:?} names no host (e.g. http://127.0.0.1:7878)"
            )));
        }
        let base = base_url.trim_end_matches('/').to_owned();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(ClientError::Transport)?;
        Ok(Self {
            http,
            base,
            bearer: None,
            retry: RetryPolicy::default(),
        })
    }

    /// Sends `Authorization: Bearer TOKEN` with every call.
    pub fn with_bearer(mut self, token: impl Into<String>) -> Self {
        self.bearer = Some(token.into());
        self
    }

    /// Changes the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Changes the per-request timeout (rebuilds the connection pool).
    pub fn with_timeout(self, timeout: Duration) -> Result<Self, ClientError> {
        let rebuilt = Self::build(&self.base, timeout)?;
        Ok(Self {
            bearer: self.bearer,
            retry: self.retry,
            ..rebuilt
        })
    }

    /// Sends a request, retrying as [`RetryPolicy`] says; returns the status and body of the
    /// last answer that was not a 503 (or the 503's problem when the retries ran out), and
    /// whether an earlier try may have reached the server (its answer was lost, or it timed
    /// out), so that the answer may be to a repeat of a call that already took effect.
    async fn send(
        &self,
        method: Method,
        path: &str,
        query: Option<[(&str, &str); 2]>,
        body: Option<Vec<u8>>,
    ) -> (Result<(StatusCode, bytes::Bytes), ClientError>, bool) {
        let url = format!("{}{path}", self.base);
        let mut retry = 0u32;
        let mut repeated = false;
        loop {
            let mut request = self.http.request(method.clone(), &url);
            if let Some(q) = &query {
                request = request.query(q);
            }
            if let Some(b) = &body {
                request = request
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(b.clone());
            }
            if let Some(t) = &self.bearer {
                request = request.bearer_auth(t);
            }
            let last = retry + 1 >= self.retry.attempts_max;
            let (retry_after, outcome) = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok());
                    match response.bytes().await {
                        Ok(_) if status == StatusCode::SERVICE_UNAVAILABLE && !last => {
                            tracing::debug!(path, retry, "503 from the gate; retrying");
                            (retry_after, None)
                        }
                        Ok(bytes) => (None, Some(Ok((status, bytes)))),
                        Err(e) if last => (None, Some(Err(ClientError::Transport(e)))),
                        Err(e) => {
                            tracing::debug!(path, retry, error = %e, "answer lost; retrying");
                            repeated = true;
                            (None, None)
                        }
                    }
                }
                Err(e) if last || !(e.is_connect() || e.is_timeout() || e.is_request()) => {
                    (None, Some(Err(ClientError::Transport(e))))
                }
                Err(e) => {
                    tracing::debug!(path, retry, error = %e, "transport error; retrying");
                    // A refused connection sent nothing; a timeout may have been decided.
                    repeated |= !e.is_connect();
                    (None, None)
                }
            };
            if let Some(outcome) = outcome {
                return (outcome, repeated);
            }
            tokio::time::sleep(self.retry.backoff(retry, retry_after)).await;
            retry += 1;
        }
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        query: Option<[(&str, &str); 2]>,
        body: Option<Value>,
    ) -> Result<Value, ClientError> {
        self.call_repeated(method, path, query, body).await.0
    }

    /// [`Client::call`], and whether the answer may be to a repeat of a call that already took
    /// effect (see [`Client::send`]).
    async fn call_repeated(
        &self,
        method: Method,
        path: &str,
        query: Option<[(&str, &str); 2]>,
        body: Option<Value>,
    ) -> (Result<Value, ClientError>, bool) {
        let body = body.map(|b| serde_json::to_vec(&b).expect("JSON values serialize"));
        let (sent, repeated) = self.send(method, path, query, body).await;
        let answer = sent.and_then(|(status, bytes)| {
            if status.is_success() {
                serde_json::from_slice(&bytes)
                    .map_err(|e| ClientError::Protocol(format!("answer is not JSON: {e}")))
            } else {
                Err(problem_error(status, &bytes))
            }
        });
        (answer, repeated)
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, ClientError> {
        self.call(Method::POST, path, None, Some(body)).await
    }

    /// `POST /v1/claim`. Without `opts.owner` a fresh owner is generated for this call, so the
    /// call's own retries are safe (see [`RetryPolicy`]).
    pub async fn claim(
        &self,
        namespace: &str,
        key: &str,
        opts: ClaimOptions,
    ) -> Result<Claim, ClientError> {
        let owner = opts
            .owner
            .unwrap_or_else(|| format!("client-{}", Token::generate().as_str()));
        let mut body = json!({"namespace": namespace, "key": key, "owner": owner});
        put_opt(&mut body, "ttl_ms", opts.ttl_ms);
        put_opt(&mut body, "lease_ms", opts.lease_ms);
        put_opt(&mut body, "fingerprint", opts.fingerprint);
        decode(self.post("/v1/claim", body).await?)
    }

    /// `POST /v1/complete`: the completed record.
    pub async fn complete(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        result: Option<Value>,
        ttl_ms: Option<u64>,
    ) -> Result<Record, ClientError> {
        let mut body = json!({"namespace": namespace, "key": key, "token": token.as_str()});
        put_opt(&mut body, "result", result);
        put_opt(&mut body, "ttl_ms", ttl_ms);
        let answer = self.post("/v1/complete", body).await?;
        decode(field(answer, "record")?)
    }

    /// `POST /v1/release`: the key is free again.
    ///
    /// A release is `lease_lost` once its token has released (API.md), so a retry whose first
    /// try did release, with its answer lost, is `lease_lost` too. Only then the client looks
    /// the key up: no live record means the key is free, which is what the release was for,
    /// and the call succeeds; a live record (someone else's claim) keeps the `lease_lost`.
    pub async fn release(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
    ) -> Result<(), ClientError> {
        let body = json!({"namespace": namespace, "key": key, "token": token.as_str()});
        let answer = match self
            .call_repeated(Method::POST, "/v1/release", None, Some(body))
            .await
        {
            (Err(ClientError::Gate(GateError::LeaseLost)), true) => {
                return match self.get(namespace, key).await? {
                    None => Ok(()),
                    Some(_) => Err(ClientError::Gate(GateError::LeaseLost)),
                };
            }
            (answer, _) => answer?,
        };
        match answer.get("released") {
            Some(Value::Bool(true)) => Ok(()),
            _ => Err(ClientError::Protocol(format!(
                "unexpected release answer {answer}"
            ))),
        }
    }

    /// `POST /v1/extend`: the new lease end (unix ms).
    pub async fn extend(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        lease_ms: u64,
    ) -> Result<u64, ClientError> {
        let body = json!({"namespace": namespace, "key": key, "token": token.as_str(), "lease_ms": lease_ms});
        decode(field(
            self.post("/v1/extend", body).await?,
            "lease_expires_at_ms",
        )?)
    }

    /// `POST /v1/mark`.
    pub async fn mark(
        &self,
        namespace: &str,
        key: &str,
        opts: MarkOptions,
    ) -> Result<Mark, ClientError> {
        let mut body = json!({"namespace": namespace, "key": key});
        put_opt(&mut body, "ttl_ms", opts.ttl_ms);
        put_opt(&mut body, "fingerprint", opts.fingerprint);
        put_opt(&mut body, "result", opts.result);
        decode(self.post("/v1/mark", body).await?)
    }

    /// `GET /v1/record`: the live record, or `None`.
    pub async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, ClientError> {
        let query = [("namespace", namespace), ("key", key)];
        match self
            .call(Method::GET, "/v1/record", Some(query), None)
            .await
        {
            Ok(v) => decode(v).map(Some),
            Err(ClientError::Rejected(p)) if p.code == "not_found" => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `DELETE /v1/record` (admin): true when a live record was deleted.
    pub async fn forget(&self, namespace: &str, key: &str) -> Result<bool, ClientError> {
        let query = [("namespace", namespace), ("key", key)];
        let answer = self
            .call(Method::DELETE, "/v1/record", Some(query), None)
            .await?;
        decode(field(answer, "deleted")?)
    }

    /// `POST /v1/batch` with raw ops (`{"op":"claim",…}`): one item per op, each its success
    /// body or its problem. Claims without an owner are sent as they are (no owner is added), so
    /// give one if the batch may be retried.
    pub async fn batch(&self, ops: Vec<Value>) -> Result<Vec<Result<Value, Problem>>, ClientError> {
        self.batch_repeated(ops).await.0
    }

    /// [`Client::batch`], and whether the answer may be to a repeat of a batch that already
    /// took effect (see [`Client::send`]): a release in it may then have freed its key before.
    pub(crate) async fn batch_repeated(
        &self,
        ops: Vec<Value>,
    ) -> (Result<Vec<Result<Value, Problem>>, ClientError>, bool) {
        let body = json!({ "ops": ops });
        let (answer, repeated) = self
            .call_repeated(Method::POST, "/v1/batch", None, Some(body))
            .await;
        (answer.and_then(batch_items), repeated)
    }

    /// `GET /healthz`: Ok while the server's store answers.
    pub async fn health(&self) -> Result<(), ClientError> {
        self.call(Method::GET, "/healthz", None, None)
            .await
            .map(|_| ())
    }
}

/// A batch answer's items: each its success body or its problem.
fn batch_items(answer: Value) -> Result<Vec<Result<Value, Problem>>, ClientError> {
    let Some(Value::Array(items)) = answer.get("results").cloned() else {
        return Err(ClientError::Protocol("batch answer has no results".into()));
    };
    items
        .into_iter()
        .map(|item| match item.get("error") {
            Some(p) => serde_json::from_value(p.clone())
                .map(Err)
                .map_err(|e| ClientError::Protocol(format!("bad batch error item: {e}"))),
            None => Ok(Ok(item)),
        })
        .collect()
}

fn put_opt<T: serde::Serialize>(body: &mut Value, name: &str, value: Option<T>) {
    if let Some(v) = value {
        body[name] = serde_json::to_value(v).expect("plain values serialize");
    }
}

fn field(mut answer: Value, name: &str) -> Result<Value, ClientError> {
    answer
        .get_mut(name)
        .map(Value::take)
        .ok_or_else(|| ClientError::Protocol(format!("answer lacks {name}: {answer}")))
}

fn decode<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ClientError> {
    serde_json::from_value(value)
        .map_err(|e| ClientError::Protocol(format!("unexpected answer: {e}")))
}

/// The `type` of dedupgate's 404 for a path the API does not have (`not_found` like a missing
/// record's, which is why it has a type of its own).
const NO_SUCH_ROUTE_TYPE: &str = "urn:dedupgate:problem:no-such-route";

fn problem_error(status: StatusCode, body: &[u8]) -> ClientError {
    #[derive(serde::Deserialize)]
    struct Type {
        #[serde(rename = "type", default)]
        type_: String,
    }
    if serde_json::from_slice::<Type>(body).is_ok_and(|t| t.type_ == NO_SUCH_ROUTE_TYPE) {
        // Not a missing record: the base URL does not lead to the API (a wrong path prefix).
        return ClientError::Protocol(format!(
            "HTTP {status}: the server has no such route; the base URL must be the gate's own \
             (the one /healthz and /v1/claim are under)"
        ));
    }
    match serde_json::from_slice::<Problem>(body) {
        Ok(problem) => problem.into(),
        Err(_) => ClientError::Protocol(format!(
            "HTTP {status} without problem JSON: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_honours_retry_after() {
        let p = RetryPolicy::default();
        for retry in 0..30 {
            assert!(p.backoff(retry, None) <= Duration::from_millis(p.backoff_max_ms));
        }
        assert!(p.backoff(0, Some(1)) >= Duration::from_millis(1000));
        assert!(p.backoff(0, Some(3600)) <= Duration::from_millis(p.backoff_max_ms));
    }

    #[test]
    fn problems_map_to_core_errors() {
        let e = problem_error(
            StatusCode::CONFLICT,
            br#"{"status":409,"code":"lease_lost","detail":"x"}"#,
        );
        assert!(matches!(e, ClientError::Gate(GateError::LeaseLost)));
        let e = problem_error(
            StatusCode::FORBIDDEN,
            br#"{"status":403,"code":"forbidden","detail":"x"}"#,
        );
        assert_eq!(e.code(), "forbidden");
        let e = problem_error(StatusCode::BAD_GATEWAY, b"<html>");
        assert_eq!(e.code(), "protocol");
        assert!(Client::new("ftp://x").is_err());
    }

    #[test]
    fn a_server_url_without_a_host_is_said_so() {
        for url in ["http://", "https:///", "http:"] {
            let said = Client::new(url).err().map(|e| e.to_string());
            let want = if url == "http:" {
                "must start with"
            } else {
                "names no host"
            };
            assert!(
                said.as_deref().is_some_and(|s| s.contains(want)),
                "{url}: {said:?}"
            );
        }
        assert!(Client::new("http://127.0.0.1:7878/").is_ok());
    }
}
