//! [`IdempotencyLayer`]: the Idempotency-Key semantics as a tower layer. The proxy server is
//! this layer around a forwarding service; a Rust service puts it around its own router.
//!
//! The layer only translates: a gated request becomes a `Claim` (key = caller scope, method,
//! path and `Idempotency-Key`; fingerprint = method, path, body), and the core's answer becomes
//! the response: `New` runs the inner service (renewing the lease meanwhile) and then `Complete`s
//! with the stored response or `Release`s on 5xx/409/429/failure; a completed `Duplicate` is
//! replayed; an in-progress one is a 409 (or a wait); a fingerprint mismatch is a 422.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dedupgate_core::{
    Claim, ClaimOptions, CompleteOptions, Defaults, GateError, InvalidInput, Outcome, RecordId,
    State, Store, Token, ValidOp,
};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::Notify;
use tower_layer::Layer;
use tower_service::Service;

use crate::config::IdempotencyConfig;
use crate::error::ConfigError;
use crate::key::{caller_scope, fingerprint, idempotency_key, record_key};
use crate::problem::ErrorFormat;
use crate::stored::StoredResponse;
use crate::BoxError;

/// Longest pause between polls of an in-flight duplicate under `wait`.
const WAIT_POLL_MS_MAX: u64 = 250;
/// Longest pause between attempts at storing a completed response while the store is unavailable.
const COMPLETE_BACKOFF_MS_MAX: u64 = 1_000;
/// Longest the proxy keeps trying to store a completed response (at most the lease, renewed
/// meanwhile) before it answers 503 instead of the response it could not store.
const COMPLETE_DEADLINE_MS_MAX: u64 = 30_000;

struct Shared {
    store: Arc<dyn Store>,
    config: IdempotencyConfig,
    in_flight: InFlight,
}

/// Counts gated requests between claim and complete/release, including those whose caller hung
/// up, so a shutdown can let them finish instead of leaving their claims to the lease.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

/// One gated request in flight; dropping it ends it.
struct InFlightGuard(Arc<Shared>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.in_flight.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.in_flight.idle.notify_waiters();
        }
    }
}

fn enter(shared: &Arc<Shared>) -> InFlightGuard {
    shared.in_flight.count.fetch_add(1, Ordering::AcqRel);
    InFlightGuard(shared.clone())
}

/// Gives the wrapped service Idempotency-Key semantics over a dedupgate [`Store`].
///
/// The inner service must accept and return bodies that can be built from [`Bytes`] (axum's
/// `Body` and this crate's [`crate::ProxyBody`] can), because a gated request is buffered to be
/// fingerprinted and a first response is buffered to be stored.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.shared.store.describe())
            .field("config", &self.shared.config)
            .finish()
    }
}

impl IdempotencyLayer {
    /// A layer over `store`. Fails on a configuration the store would refuse.
    pub fn new(store: Arc<dyn Store>, config: IdempotencyConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            shared: Arc::new(Shared {
                store,
                config,
                in_flight: InFlight::default(),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &IdempotencyConfig {
        &self.shared.config
    }

    /// Gated requests between their claim and their complete or release right now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.count.load(Ordering::Acquire)
    }

    /// Resolves once no gated request is in flight (callers who hung up included).
    pub async fn idle(&self) {
        let f = &self.shared.in_flight;
        loop {
            let notified = f.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a wake-up between the two is not missed.
            notified.as_mut().enable();
            if f.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] makes.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("store", &self.shared.store.describe())
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    /// The configuration in force.
    pub fn config(&self) -> &IdempotencyConfig {
        &self.shared.config
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, B, RB> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<RB>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The instance that was polled ready serves this call; a fresh clone takes its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(handle(shared, inner, req))
    }
}

/// What became of one attempt at the inner service.
enum Attempt<RB, E> {
    /// The inner service failed: release, pass the error on.
    Failed(E),
    /// A response that must not be kept (5xx, 409, 429): release, pass it on unbuffered.
    Release(Response<RB>),
    /// The response body broke off: release, answer 502.
    BodyFailed(BoxError),
    /// A final response, buffered: complete with it.
    Done {
        stored: StoredResponse,
        first: Response<RB>,
    },
}

async fn handle<S, B, RB>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<B>,
) -> Result<Response<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let config = &shared.config;
    let mut req = req;
    let errors = config.error_format(req.method(), req.uri().path());
    // The inner service words its own errors (the proxy's 502 and 504) the same way.
    req.extensions_mut().insert(errors);
    let requirement = config.requirement(req.method(), req.uri().path());
    let required = match requirement {
        None | Some(crate::config::Requirement::Off) => return passthrough(inner, req).await,
        Some(r) => r == crate::config::Requirement::Required,
    };
    let key = match idempotency_key(req.headers()) {
        Ok(Some(k)) => k,
        Ok(None) if required => {
            return Ok(errors.response(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!(
                    "{} {} requires an Idempotency-Key header",
                    req.method(),
                    req.uri().path()
                ),
            ))
        }
        Ok(None) => return passthrough(inner, req).await,
        Err(e) => return Ok(errors.response(StatusCode::BAD_REQUEST, "invalid_request", e)),
    };

    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.request_bytes_max) {
        return Ok(too_large(errors, config.request_bytes_max));
    }
    let limit = usize::try_from(config.request_bytes_max).unwrap_or(usize::MAX);
    let read_for = Duration::from_millis(config.body_read_timeout_ms);
    let body = match tokio::time::timeout(read_for, Limited::new(body, limit).collect()).await {
        Err(_) => return Ok(body_too_slow(errors, read_for)),
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if is_length_limit(e.as_ref()) => {
            return Ok(too_large(errors, config.request_bytes_max))
        }
        Ok(Err(e)) => {
            return Ok(errors.response(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("the request body could not be read: {e}"),
            ))
        }
    };

    let scope = caller_scope(
        parts
            .headers
            .get(&config.scope_header)
            .map(|v| v.as_bytes()),
    );
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let id = match RecordId::new(
        config.namespace.clone(),
        record_key(&scope, &parts.method, parts.uri.path(), &key),
    ) {
        Ok(id) => id,
        Err(e) => return Ok(errors.response(StatusCode::BAD_REQUEST, "invalid_request", e)),
    };
    let fp = fingerprint(&parts.method, path_and_query, &body);
    let req = Request::from_parts(parts, B::from(body));

    // From the claim on, the work runs in its own task: if the caller hangs up, the upstream
    // call still finishes and its response is still stored (or the claim released), so the
    // caller's retry is replayed rather than executed again.
    let guard = enter(&shared);
    let task = async move {
        let _guard = guard;
        gated(shared, inner, errors, id, fp, req).await
    };
    match tokio::spawn(task).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "idempotency task failed");
            Ok(errors.response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the request task failed; it may or may not have run",
            ))
        }
    }
}

async fn passthrough<S, B, RB>(mut inner: S, req: Request<B>) -> Result<Response<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    futures::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(req).await
}

/// 408, and the connection closes: the rest of the body may still be on its way.
fn body_too_slow<RB: From<Bytes>>(errors: ErrorFormat, waited: Duration) -> Response<RB> {
    let mut res = errors.response(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        format!("the request body did not arrive within {waited:?}; nothing was claimed"),
    );
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

fn too_large<RB: From<Bytes>>(errors: ErrorFormat, max: u64) -> Response<RB> {
    errors.response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        format!("the request body exceeds {max} bytes"),
    )
}

pub(crate) fn is_length_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

fn aad(id: &RecordId) -> Vec<u8> {
    format!("{}/{}", id.namespace, id.key).into_bytes()
}

async fn gated<S, B, RB>(
    shared: Arc<Shared>,
    inner: S,
    errors: ErrorFormat,
    id: RecordId,
    fp: String,
    req: Request<B>,
) -> Result<Response<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    RB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let config = &shared.config;
    let deadline = config
        .wait_ms
        .map(|w| tokio::time::Instant::now() + Duration::from_millis(w));
    let mut pause_ms = 10;
    loop {
        let defaults = Defaults {
            ttl_ms: config.ttl_ms,
            lease_ms: config.lease_ms,
        };
        let opts = ClaimOptions {
            fingerprint: Some(fp.clone()),
            ..Default::default()
        };
        let claim_started = Instant::now();
        let record = match apply(&shared, &id, ValidOp::claim(opts, defaults)).await {
            Ok(Outcome::Claimed(Claim::New(lease))) => {
                let claimed = claim_started.elapsed();
                return execute(&shared, inner, errors, &id, lease.token, req, claimed).await;
            }
            Ok(Outcome::Claimed(Claim::Duplicate { record })) => record,
            Ok(other) => {
                tracing::error!(
                    outcome = other.label(),
                    "store answered a claim with another outcome"
                );
                return Ok(errors.response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the store gave an unexpected answer",
                ));
            }
            Err(e) => return Ok(gate_error(errors, &e)),
        };
        match record.state {
            State::Completed => {
                tracing::debug!(
                    claim_us = micros(claim_started.elapsed()),
                    "replayed a stored response"
                );
                return Ok(replay(&shared, errors, &id, record.result.as_ref()));
            }
            State::InProgress => {
                let now = tokio::time::Instant::now();
                match deadline {
                    Some(d) if now + Duration::from_millis(pause_ms) < d => {
                        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                        pause_ms = (pause_ms * 2).min(WAIT_POLL_MS_MAX);
                    }
                    _ => {
                        let mut res: Response<RB> = errors.response(
                            StatusCode::CONFLICT,
                            "request_in_progress",
                            "a request with this Idempotency-Key is still being processed; retry later",
                        );
                        res.headers_mut()
                            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                        return Ok(res);
                    }
                }
            }
        }
    }
}

fn gate_error<RB: From<Bytes>>(errors: ErrorFormat, e: &GateError) -> Response<RB> {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let detail = match e {
        GateError::FingerprintMismatch => {
            "this Idempotency-Key was used with a different request (method, path or body)"
                .to_owned()
        }
        other => other.to_string(),
    };
    if status.is_server_error() {
        tracing::warn!(error = %e, "store could not decide");
    }
    errors.response(status, e.code(), detail)
}

fn replay<RB: From<Bytes>>(
    shared: &Shared,
    errors: ErrorFormat,
    id: &RecordId,
    result: Option<&serde_json::Value>,
) -> Response<RB> {
    let stored = result
        .ok_or_else(|| "the record holds no stored response".to_owned())
        .and_then(|v| {
            StoredResponse::from_result(v, shared.config.sealer.as_ref(), &aad(id))
                .map_err(|e| e.to_string())
        });
    match stored {
        Ok(s) => s.to_response(true),
        Err(e) => {
            tracing::error!(error = %e, key = %id.key, "a completed request cannot be replayed");
            // The request did run: never run it again; say why it cannot be shown.
            errors.response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored_response_unreadable",
                format!("this request was already processed but its stored response cannot be read: {e}"),
            )
        }
    }
}

/// Statuses after which the claim is released so that a retry runs again (API.md).
fn releases(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Runs a claimed request and stores (or releases) its outcome. At debug level it logs where
/// the time went: the durable claim, the upstream, and storing the response, which is how the
/// proxy's cost on a durable store was attributed (docs/benchmarks-proxy.md).
async fn execute<S, B, RB>(
    shared: &Shared,
    mut inner: S,
    errors: ErrorFormat,
    id: &RecordId,
    token: Token,
    req: Request<B>,
    claimed: Duration,
) -> Result<Response<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: Body<Data = Bytes> + From<Bytes>,
    RB::Error: Into<BoxError>,
{
    let config = &shared.config;
    let limit = usize::try_from(config.response_bytes_max).unwrap_or(usize::MAX);
    let work = async {
        let res = match futures::future::poll_fn(|cx| inner.poll_ready(cx)).await {
            Ok(()) => inner.call(req).await,
            Err(e) => Err(e),
        };
        let res = match res {
            Ok(r) => r,
            Err(e) => return Attempt::Failed(e),
        };
        if releases(res.status()) {
            return Attempt::Release(res);
        }
        let (parts, body) = res.into_parts();
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) if is_length_limit(e.as_ref()) => {
                tracing::warn!(
                    bytes_max = config.response_bytes_max,
                    "upstream response too large to store"
                );
                let p: Response<Bytes> = errors.response(
                    StatusCode::BAD_GATEWAY,
                    "response_too_large",
                    format!(
                        "the request was processed, but its response exceeds the {} bytes the proxy stores",
                        config.response_bytes_max
                    ),
                );
                let (pp, pb) = p.into_parts();
                let stored = StoredResponse::new(pp.status, &pp.headers, pb, config);
                let first = stored.to_response(false);
                return Attempt::Done { stored, first };
            }
            Err(e) => return Attempt::BodyFailed(e),
        };
        let stored = StoredResponse::new(parts.status, &parts.headers, bytes.clone(), config);
        // The first caller gets every header the upstream sent (Set-Cookie included).
        let mut first = Response::from_parts(parts, RB::from(bytes.clone()));
        let h = first.headers_mut();
        h.remove(header::TRANSFER_ENCODING);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        Attempt::Done { stored, first }
    };
    let upstream_started = Instant::now();
    let attempt = with_lease(shared, id, &token, work).await;
    let upstream = upstream_started.elapsed();
    let store_started = Instant::now();
    let timings = |what: &str| {
        tracing::debug!(
            claim_us = micros(claimed),
            upstream_us = micros(upstream),
            store_us = micros(store_started.elapsed()),
            "{what}"
        );
    };
    match attempt {
        Attempt::Failed(e) => {
            release(shared, id, token).await;
            timings("upstream failed; claim released");
            Err(e)
        }
        Attempt::Release(res) => {
            release(shared, id, token).await;
            timings("response not kept; claim released");
            Ok(res)
        }
        Attempt::BodyFailed(e) => {
            release(shared, id, token).await;
            timings("response body broke off; claim released");
            Ok(errors.response(
                StatusCode::BAD_GATEWAY,
                "bad_gateway",
                format!("the upstream response broke off: {e}"),
            ))
        }
        Attempt::Done { stored, first } => {
            let result = stored.to_result(config.sealer.as_ref(), &aad(id));
            let stored = with_lease(shared, id, &token, complete(shared, id, &token, result)).await;
            match stored {
                Ok(()) => {
                    timings("response stored");
                    Ok(first)
                }
                Err(why) => {
                    // API.md: a final response is stored, then returned. One that could not be
                    // stored is not returned as if it had been: a caller told "done" does not
                    // retry, and a retry after the lease runs out would run the request again.
                    timings("response not stored");
                    Ok(errors.response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable",
                        format!(
                            "the upstream processed this request, but its response could not be \
                             stored ({why}); its outcome is unknown to the proxy: a retry with \
                             this Idempotency-Key gets 409 while the claim's lease lasts and may \
                             run the request again after it runs out"
                        ),
                    ))
                }
            }
        }
    }
}

/// Drives `work` while renewing the lease every third of its length, so a slow upstream call
/// is never taken over by a retry.
async fn with_lease<T>(
    shared: &Shared,
    id: &RecordId,
    token: &Token,
    work: impl Future<Output = T>,
) -> T {
    let lease_ms = shared.config.lease_ms;
    let period = Duration::from_millis((lease_ms / 3).max(1));
    let keep_alive = async {
        loop {
            tokio::time::sleep(period).await;
            let op = ValidOp::extend(token.clone(), lease_ms);
            // Not fatal here: a lost lease shows when the response is stored.
            if let Err(e) = apply(shared, id, op).await {
                tracing::warn!(error = %e, "could not renew the lease of an in-flight request");
            }
        }
    };
    tokio::pin!(work);
    tokio::select! {
        value = &mut work => value,
        _ = keep_alive => unreachable!("the keep-alive loop never ends"),
    }
}

/// `op` applied to `id` once the core has built it (the configured durations and the
/// fingerprint, a SHA-256, always pass; a refusal is still reported, never assumed away).
async fn apply(
    shared: &Shared,
    id: &RecordId,
    op: Result<ValidOp, InvalidInput>,
) -> Result<Outcome, GateError> {
    shared.store.apply(id.clone(), op?).await
}

async fn release(shared: &Shared, id: &RecordId, token: Token) {
    if let Err(e) = apply(shared, id, ValidOp::release(token)).await {
        // The lease runs out instead; a retry then runs again.
        tracing::warn!(error = %e, "could not release a failed request's claim");
    }
}

/// Stores a completed response, retrying with backoff while the store is unavailable, for up to
/// the lease (at most [`COMPLETE_DEADLINE_MS_MAX`]); the caller keeps the lease alive meanwhile.
/// Any other answer (the lease was lost, say) ends the attempts at once.
async fn complete(
    shared: &Shared,
    id: &RecordId,
    token: &Token,
    result: serde_json::Value,
) -> Result<(), String> {
    let deadline = Instant::now()
        + Duration::from_millis(shared.config.lease_ms.min(COMPLETE_DEADLINE_MS_MAX));
    let mut backoff_ms = 50;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let opts = CompleteOptions {
            result: Some(result.clone()),
            ttl_ms: Some(shared.config.ttl_ms),
        };
        match apply(shared, id, ValidOp::complete(token.clone(), opts)).await {
            Ok(_) => return Ok(()),
            Err(GateError::Store(e)) if Instant::now() < deadline => {
                tracing::warn!(error = %e, attempt, "could not store a response; retrying");
                tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                backoff_ms = (backoff_ms * 2).min(COMPLETE_BACKOFF_MS_MAX);
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    attempt,
                    "a processed request's response was not stored; answering 503"
                );
                return Err(e.to_string());
            }
        }
    }
}
