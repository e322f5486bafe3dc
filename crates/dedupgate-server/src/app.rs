//! The router: API.md's routes ([`ROUTES`]), their handlers, and the layer that applies the
//! in-flight cap, the request timeout, latency and error metrics to every request (after its
//! body has been read, so a slow sender holds no in-flight slot).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::future::Future;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{BoxError, Router};
use dedupgate_core::{GateError, Outcome, Store};
use http_body::Body as HttpBody;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;

use crate::auth::{Auth, Principal};
use crate::config::ServerConfig;
use crate::metrics::{Exposition, Metrics};
use crate::problem::{Problem, ProblemCode};
use crate::wire::{self, OpKind, Parsed};

/// How long `/healthz` waits for the store before calling it down.
const HEALTH_TIMEOUT_MS: u64 = 2_000;

/// One route of the HTTP API. The router is built from [`ROUTES`] and nothing else, so the
/// OpenAPI test that compares this table with `docs/openapi.json` covers the router itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// HTTP method, upper case.
    pub method: &'static str,
    /// Path.
    pub path: &'static str,
}

/// Every route the server answers.
pub const ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/claim",
    },
    Route {
        method: "POST",
        path: "/v1/complete",
    },
    Route {
        method: "POST",
        path: "/v1/release",
    },
    Route {
        method: "POST",
        path: "/v1/extend",
    },
    Route {
        method: "POST",
        path: "/v1/mark",
    },
    Route {
        method: "GET",
        path: "/v1/record",
    },
    Route {
        method: "DELETE",
        path: "/v1/record",
    },
    Route {
        method: "POST",
        path: "/v1/batch",
    },
    Route {
        method: "GET",
        path: "/healthz",
    },
    Route {
        method: "GET",
        path: "/metrics",
    },
];

/// Shared state of every request: the store, the configuration, auth and metrics.
pub struct AppState {
    store: Arc<dyn Store>,
    config: ServerConfig,
    auth: Auth,
    metrics: Metrics,
    in_flight: Arc<Semaphore>,
    /// Bytes of request bodies being received right now (see [`AppState::read_body`]).
    receiving: AtomicUsize,
}

/// Bodies are read before a request takes an in-flight slot, so the slots do not bound the
/// memory they hold: at most this many bodies of the largest size are received at once, in
/// bytes (256 MiB with the default 16 MiB limit); a request whose body would pass it is
/// answered 503 with `Retry-After`, nothing decided.
pub const BODIES_RECEIVED_AT_ONCE: usize = 16;

/// Most bytes of a refused body (413) the server reads, and drops, beside its answer to an
/// HTTP/1 client that did not send `Expect: 100-continue`. Such a client (Python's
/// `http.client`, most libraries) sends its whole body before it reads the answer, and a
/// connection closed with its bytes unread reaches it as a reset or a broken pipe, never as
/// the 413. A body announced larger, or still arriving at the request timeout, is not read.
pub const REFUSED_BODY_DRAIN_BYTES_MAX: u64 = 64 << 20;

/// Whether the client sends its body without waiting to be asked: HTTP/1 without
/// `Expect: 100-continue` (over HTTP/2 a refused stream is reset on its own, and a client that
/// waits for 100 Continue sends nothing after a 413).
fn sends_body_unasked(parts: &axum::http::request::Parts) -> bool {
    parts.version <= axum::http::Version::HTTP_11 && !expects_continue(&parts.headers)
}

/// Whether the client waits to be asked (`Expect: 100-continue`) before it sends its body:
/// reading such a body makes hyper send `100 Continue`, and the client then uploads it.
fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The answer to a request refused before its body was read (401, 413) goes at once; the body
/// is read beside it and dropped, bounded by `deadline` and `bytes_max` (a body announced
/// larger is not read, and its connection closes after the answer).
fn drain_refused_body<B>(
    body: std::pin::Pin<Box<B>>,
    bytes_max: u64,
    deadline: tokio::time::Instant,
) where
    B: HttpBody<Data = Bytes> + Send + 'static,
{
    if body.size_hint().lower() <= bytes_max {
        tokio::spawn(tokio::time::timeout_at(deadline, drain(body, bytes_max)));
    }
}

/// Reads and drops what is left of a body, up to `bytes_max` bytes.
async fn drain<B>(mut body: std::pin::Pin<Box<B>>, bytes_max: u64)
where
    B: HttpBody<Data = Bytes>,
{
    let mut drained = 0u64;
    while drained <= bytes_max {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    drained += data.len() as u64;
                }
            }
            Some(Err(_)) | None => return,
        }
    }
}

/// Gives back the bytes a body reserved in [`AppState::receiving`] when its read ends.
struct Receiving<'a> {
    total: &'a AtomicUsize,
    held: usize,
}

impl Receiving<'_> {
    /// Reserves `n` more bytes, or says the budget is spent (nothing reserved then).
    fn reserve(&mut self, n: usize, budget: usize) -> bool {
        let before = self.total.fetch_add(n, Ordering::Relaxed);
        if before + n > budget {
            self.total.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        self.held += n;
        true
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.held, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("store", &self.store.describe())
            .field("config", &self.config)
            .finish()
    }
}

impl AppState {
    /// State over `store` with `config` (limits must already be validated).
    pub fn new(store: Arc<dyn Store>, config: ServerConfig) -> Arc<Self> {
        Arc::new(Self {
            auth: Auth::new(&config.tokens),
            metrics: Metrics::new(config.namespace_labels_max, &config.metrics_namespaces),
            in_flight: Arc::new(Semaphore::new(config.limits.in_flight_max)),
            receiving: AtomicUsize::new(0),
            store,
            config,
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    fn authorization<'a>(&self, headers: &'a HeaderMap) -> Option<&'a [u8]> {
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes)
    }

    /// Authenticates a request and reads its body, before the request takes an in-flight slot
    /// (see [`AppState::guarded`]): a client that sends its body slowly, or never, holds no
    /// slot while it does.
    async fn receive<B>(
        &self,
        request: axum::http::Request<B>,
    ) -> Result<(Principal<'_>, Bytes), Problem>
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let principal = match self.auth.authenticate(self.authorization(&parts.headers)) {
            Ok(principal) => principal,
            Err(problem) => {
                // A caller without a token may make the server read (and drop) no more than an
                // accepted body: `body_bytes_max`, and never past the 413's own bound.
                if sends_body_unasked(&parts) {
                    let limits = &self.config.limits;
                    let bytes_max =
                        (limits.body_bytes_max as u64).min(REFUSED_BODY_DRAIN_BYTES_MAX);
                    let deadline = tokio::time::Instant::now()
                        + Duration::from_millis(limits.request_timeout_ms);
                    drain_refused_body(Box::pin(body), bytes_max, deadline);
                }
                return Err(problem);
            }
        };
        let body = self.read_body(body, sends_body_unasked(&parts)).await?;
        Ok((principal, body))
    }

    /// Reads a request body: 413 when its announced length (`Content-Length`) is over the
    /// configured limit or once it passes the limit while it is read, 400 when it has not
    /// arrived whole within the request timeout, and 503 with `Retry-After` when the bodies
    /// being received would pass [`BODIES_RECEIVED_AT_ONCE`] of the limit. Nothing is decided
    /// in any of these cases. A 413 goes at once; with `drain_refused` the rest of the body is
    /// read beside it and dropped (see [`REFUSED_BODY_DRAIN_BYTES_MAX`]).
    async fn read_body<B>(&self, body: B, drain_refused: bool) -> Result<Bytes, Problem>
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let limit = self.config.limits.body_bytes_max;
        let timeout_ms = self.config.limits.request_timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let mut body = Box::pin(body);
        let announced = body.size_hint().lower();
        let read = if announced > limit as u64 {
            Err(Problem::too_large(format!(
                "the request body ({announced} bytes) is larger than {limit} bytes"
            )))
        } else {
            let budget = limit.saturating_mul(BODIES_RECEIVED_AT_ONCE);
            let receiving = Receiving {
                total: &self.receiving,
                held: 0,
            };
            tokio::time::timeout_at(
                deadline,
                self.collect_body(body.as_mut(), limit, budget, receiving),
            )
            .await
            .unwrap_or_else(|_| {
                Err(Problem::invalid(format!(
                    "the request body did not arrive within {timeout_ms} ms; nothing was decided"
                )))
            })
        };
        if let Err(problem) = &read {
            if drain_refused && problem.status == 413 {
                drain_refused_body(body, REFUSED_BODY_DRAIN_BYTES_MAX, deadline);
            }
        }
        read
    }

    /// Collects a body, refusing it with 413 once it passes `limit`, and with 503 when its
    /// bytes would take the bodies being received past `budget`. Stops at the refusal: the
    /// rest of the body is left unread.
    async fn collect_body<B>(
        &self,
        mut body: std::pin::Pin<&mut B>,
        limit: usize,
        budget: usize,
        mut receiving: Receiving<'_>,
    ) -> Result<Bytes, Problem>
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        // A small body arrives as one frame: kept as it is, without copying or a buffer list.
        let mut first = Bytes::new();
        let mut joined: Vec<u8> = Vec::new();
        let mut received = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                let e: BoxError = e.into();
                Problem::invalid(format!("could not read the request body: {e}"))
            })?;
            // Trailers carry nothing the API reads.
            let Ok(data) = frame.into_data() else {
                continue;
            };
            received = received.saturating_add(data.len());
            if received > limit {
                return Err(Problem::too_large(format!(
                    "the request body is larger than {limit} bytes"
                )));
            }
            if !receiving.reserve(data.len(), budget) {
                return Err(Problem::unavailable(format!(
                    "the server is receiving more than {budget} bytes of request bodies; \
                     retry later (nothing was decided)"
                )));
            }
            if first.is_empty() && joined.is_empty() {
                first = data;
            } else {
                if joined.is_empty() {
                    joined.extend_from_slice(&first);
                }
                joined.extend_from_slice(&data);
            }
        }
        Ok(if joined.is_empty() {
            first
        } else {
            Bytes::from(joined)
        })
    }

    /// Calls the store for one op, timing it and counting the decision.
    async fn decide(&self, parsed: Parsed) -> Result<Outcome, Problem> {
        let label = self.metrics.namespace_label(parsed.id.namespace.as_str());
        let started = Instant::now();
        let answer = self.store.apply(parsed.id, parsed.op).await;
        self.metrics
            .store_call(parsed.kind.name(), started.elapsed());
        self.metrics.decision(&label, &answer);
        answer.map_err(|e| self.gate_problem(&e))
    }

    fn gate_problem(&self, err: &GateError) -> Problem {
        if let GateError::Store(cause) = err {
            tracing::warn!(code = err.code(), %cause, "the store could not decide");
        }
        Problem::from_gate(err)
    }

    async fn single(&self, kind: OpKind, principal: Principal<'_>, body: Bytes) -> Response {
        let answer = async {
            let parsed = wire::parse_body(kind, &body, &self.config.defaults, &self.config.limits)?;
            principal.allows(parsed.id.namespace.as_str(), kind.admin())?;
            let outcome = self.decide(parsed).await?;
            let mut out = Vec::with_capacity(256);
            wire::write_outcome(&mut out, &outcome)?;
            Ok::<_, Problem>(out)
        }
        .await;
        match answer {
            Ok(out) => json(StatusCode::OK, out),
            Err(problem) => problem.into_response(),
        }
    }

    async fn record(&self, kind: OpKind, parts: axum::http::request::Parts) -> Response {
        let answer = async {
            let principal = self.auth.authenticate(self.authorization(&parts.headers))?;
            let q = wire::record_query(parts.uri.query())?;
            let id = wire::record_id(q.namespace, q.key, &self.config.limits)?;
            principal.allows(id.namespace.as_str(), kind.admin())?;
            let op = match kind {
                OpKind::Forget => dedupgate_core::ValidOp::forget(),
                _ => dedupgate_core::ValidOp::get(),
            };
            let outcome = self.decide(Parsed { kind, id, op }).await?;
            let mut out = Vec::with_capacity(512);
            wire::write_outcome(&mut out, &outcome)?;
            Ok::<_, Problem>(out)
        }
        .await;
        match answer {
            Ok(out) => json(StatusCode::OK, out),
            Err(problem) => problem.into_response(),
        }
    }

    async fn batch(&self, principal: Principal<'_>, body: Bytes) -> Response {
        match self.batch_inner(principal, body).await {
            Ok(out) => json(StatusCode::OK, out),
            Err(problem) => problem.into_response(),
        }
    }

    async fn batch_inner(&self, principal: Principal<'_>, body: Bytes) -> Result<Vec<u8>, Problem> {
        let ops = wire::parse_batch(&body)?;
        let max = self.config.limits.batch_ops_max;
        if ops.len() > max {
            return Err(Problem::invalid(format!(
                "a batch holds at most {max} ops, got {}",
                ops.len()
            )));
        }
        // Parse every item first; refused items keep their slot and never reach the store.
        let mut slots: Vec<Result<(), Problem>> = Vec::with_capacity(ops.len());
        let mut labels = Vec::with_capacity(ops.len());
        let mut store_ops = Vec::with_capacity(ops.len());
        let mut last_namespace: Option<String> = None;
        for item in &ops {
            let parsed = wire::parse_batch_item(item, &self.config.defaults, &self.config.limits)
                .and_then(|p| {
                    principal.allows(p.id.namespace.as_str(), p.kind.admin())?;
                    Ok(p)
                });
            match parsed {
                Ok(p) => {
                    // Items of a batch mostly share a namespace: reuse the previous label.
                    let label = match labels.last() {
                        Some(last)
                            if last_namespace.as_deref() == Some(p.id.namespace.as_str()) =>
                        {
                            Arc::clone(last)
                        }
                        _ => {
                            last_namespace = Some(p.id.namespace.as_str().to_owned());
                            self.metrics.namespace_label(p.id.namespace.as_str())
                        }
                    };
                    labels.push(label);
                    store_ops.push((p.id, p.op));
                    slots.push(Ok(()));
                }
                Err(problem) => slots.push(Err(problem)),
            }
        }
        let sent = store_ops.len();
        let answers = if sent == 0 {
            Vec::new()
        } else {
            let started = Instant::now();
            let answers = self.store.apply_batch(store_ops).await;
            self.metrics.store_call("batch", started.elapsed());
            answers
        };
        if answers.len() != sent {
            return Err(Problem::unavailable(format!(
                "the store answered {} of {sent} ops",
                answers.len()
            )));
        }
        let mut out = Vec::with_capacity(64 + 200 * slots.len());
        out.extend_from_slice(b"{\"results\":[");
        let mut answers = answers.into_iter().zip(labels);
        for (i, slot) in slots.into_iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let item = slot.and_then(|()| {
                let (answer, label) = answers.next().expect("one answer per sent op");
                self.metrics.decision(&label, &answer);
                answer.map_err(|e| self.gate_problem(&e))
            });
            let mark = out.len();
            let written = item.and_then(|outcome| wire::write_outcome(&mut out, &outcome));
            if let Err(problem) = written {
                out.truncate(mark);
                self.metrics.error(problem.code);
                out.extend_from_slice(b"{\"error\":");
                out.extend_from_slice(&problem.to_json_bytes());
                out.push(b'}');
            }
        }
        out.extend_from_slice(b"]}");
        Ok(out)
    }

    async fn health(&self) -> Response {
        let timeout = Duration::from_millis(HEALTH_TIMEOUT_MS);
        match tokio::time::timeout(timeout, self.store.health()).await {
            Ok(Ok(())) => json(StatusCode::OK, b"{\"status\":\"ok\"}".to_vec()),
            Ok(Err(e)) => {
                tracing::warn!(cause = %e, "health check failed");
                Problem::unavailable(e.to_string()).into_response()
            }
            Err(_) => Problem::unavailable(format!(
                "the store did not answer within {HEALTH_TIMEOUT_MS} ms"
            ))
            .into_response(),
        }
    }

    async fn metrics_text(&self, format: Exposition) -> Response {
        let stats = self.store.stats().await.ok();
        let text = self.metrics.render(stats.as_ref(), format);
        let mut response = (StatusCode::OK, text).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(format.content_type()),
        );
        response
    }
}

fn json(status: StatusCode, body: Vec<u8>) -> Response {
    // Built directly: `(status, body).into_response()` would set a content type to replace.
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// What a route's handler does.
#[derive(Clone, Copy, Debug)]
enum Endpoint {
    Single(OpKind),
    Record(OpKind),
    Batch,
    Health,
    Metrics,
}

fn endpoint(route: &Route) -> Endpoint {
    match (route.method, route.path) {
        ("POST", "/v1/claim") => Endpoint::Single(OpKind::Claim),
        ("POST", "/v1/complete") => Endpoint::Single(OpKind::Complete),
        ("POST", "/v1/release") => Endpoint::Single(OpKind::Release),
        ("POST", "/v1/extend") => Endpoint::Single(OpKind::Extend),
        ("POST", "/v1/mark") => Endpoint::Single(OpKind::Mark),
        ("GET", "/v1/record") => Endpoint::Record(OpKind::Get),
        ("DELETE", "/v1/record") => Endpoint::Record(OpKind::Forget),
        ("POST", "/v1/batch") => Endpoint::Batch,
        ("GET", "/healthz") => Endpoint::Health,
        ("GET", "/metrics") => Endpoint::Metrics,
        (method, path) => unreachable!("ROUTES lists {method} {path} without a handler"),
    }
}

/// Where a request goes: a route of [`ROUTES`], a known path asked with a method it does not
/// take (405), or nothing (404).
enum Dispatch {
    Route(&'static Route),
    WrongMethod(&'static str),
    NoRoute,
}

fn dispatch(method: &Method, path: &str) -> Dispatch {
    let mut known_path = None;
    for route in ROUTES {
        if route.path != path {
            continue;
        }
        // As with axum's `get`, a GET route also answers HEAD (hyper sends no body for HEAD).
        if route.method == method.as_str() || (*method == Method::HEAD && route.method == "GET") {
            return Dispatch::Route(route);
        }
        known_path = Some(route.path);
    }
    known_path.map_or(Dispatch::NoRoute, Dispatch::WrongMethod)
}

/// The `Allow` header of a 405 on `path`: its methods in [`ROUTES`] order, HEAD after GET.
fn allow_header(path: &str) -> HeaderValue {
    let mut allow: Vec<&str> = Vec::new();
    for route in ROUTES.iter().filter(|r| r.path == path) {
        allow.push(route.method);
        if route.method == "GET" {
            allow.push("HEAD");
        }
    }
    HeaderValue::from_str(&allow.join(",")).expect("method names are valid header text")
}

impl AppState {
    /// Answers one request: routes it by [`ROUTES`] (problem JSON 404 for an unknown path, 405
    /// with `Allow` for a method the path does not take) and runs its handler inside
    /// [`AppState::guarded`]. [`crate::serve`] calls it straight from hyper, without a router
    /// or a boxed service per request; [`router`] wraps the same function for axum.
    pub async fn handle<B>(&self, request: axum::http::Request<B>) -> Response
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match dispatch(request.method(), request.uri().path()) {
            Dispatch::Route(route) => {
                let path = route.path;
                // Each handler's future (a kilobyte or more: the request, the parsed op, the
                // store call) is boxed once, so the futures around it, which are moved by
                // value as they are built and polled, stay small.
                //
                // Routes with a body read it first, outside the guard: the in-flight cap and the
                // request timeout apply to deciding, not to waiting for a slow client.
                let started = Instant::now();
                match endpoint(route) {
                    Endpoint::Single(kind) => {
                        Box::pin(async move {
                            match self.receive(request).await {
                                Ok((principal, body)) => {
                                    self.guarded(path, started, self.single(kind, principal, body))
                                        .await
                                }
                                Err(problem) => self.finish(path, started, problem.into_response()),
                            }
                        })
                        .await
                    }
                    Endpoint::Record(kind) => {
                        Box::pin(async move {
                            let (parts, body) = request.into_parts();
                            let whole = self.skip_body(&parts.headers, body).await;
                            let answer = self.guarded(path, started, self.record(kind, parts));
                            close_unless(whole, answer.await)
                        })
                        .await
                    }
                    Endpoint::Batch => {
                        Box::pin(async move {
                            match self.receive(request).await {
                                Ok((principal, body)) => {
                                    self.guarded(path, started, self.batch(principal, body))
                                        .await
                                }
                                Err(problem) => self.finish(path, started, problem.into_response()),
                            }
                        })
                        .await
                    }
                    Endpoint::Health => {
                        let (parts, body) = request.into_parts();
                        let whole = self.skip_body(&parts.headers, body).await;
                        let answer = self.guarded(path, started, Box::pin(self.health()));
                        close_unless(whole, answer.await)
                    }
                    Endpoint::Metrics => {
                        let format = Exposition::negotiate(
                            request
                                .headers()
                                .get(header::ACCEPT)
                                .map(HeaderValue::as_bytes),
                        );
                        let (parts, body) = request.into_parts();
                        let whole = self.skip_body(&parts.headers, body).await;
                        let answer =
                            self.guarded(path, started, Box::pin(self.metrics_text(format)));
                        close_unless(whole, answer.await)
                    }
                }
            }
            Dispatch::WrongMethod(path) => {
                let (parts, body) = request.into_parts();
                let whole = self.skip_body(&parts.headers, body).await;
                let mut response = self
                    .guarded(
                        path,
                        Instant::now(),
                        Box::pin(async {
                            Problem::method_not_allowed("this route does not take that method")
                                .into_response()
                        }),
                    )
                    .await;
                response
                    .headers_mut()
                    .insert(header::ALLOW, allow_header(path));
                close_unless(whole, response)
            }
            Dispatch::NoRoute => {
                let (parts, body) = request.into_parts();
                let whole = self.skip_body(&parts.headers, body).await;
                let response = self
                    .guarded(
                        "other",
                        Instant::now(),
                        Box::pin(async { Problem::no_such_route("no such route").into_response() }),
                    )
                    .await;
                close_unless(whole, response)
            }
        }
    }
}

/// Marks `response` as the connection's last unless the request's body was read whole.
fn close_unless(whole: bool, mut response: Response) -> Response {
    if !whole {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

impl AppState {
    /// Reads and drops the body of a request whose route takes none (a record query, a probe,
    /// a wrong method or path), up to `body_bytes_max` and within the request timeout; false
    /// when it was not read whole. Left unread, hyper closes the connection after the answer
    /// without saying so, and a client that sends its next request on it sees the connection
    /// drop with no answer (found by schemathesis: `PUT /v1/extend` with a JSON body).
    /// A body the client has not sent yet because it waits for `100 Continue` (see
    /// [`expects_continue`]) is not asked for: reading it would make hyper send the 100 and
    /// the client upload a body that is never needed, so the answer closes the connection.
    async fn skip_body<B>(&self, headers: &HeaderMap, body: B) -> bool
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
    {
        if body.is_end_stream() {
            return true;
        }
        if expects_continue(headers) {
            return false;
        }
        let limit = self.config.limits.body_bytes_max as u64;
        if body.size_hint().lower() > limit {
            return false;
        }
        let mut body = Box::pin(body);
        let read = async {
            let mut received = 0u64;
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else { return false };
                if let Ok(data) = frame.into_data() {
                    received += data.len() as u64;
                    if received > limit {
                        return false;
                    }
                }
            }
            true
        };
        let timeout = Duration::from_millis(self.config.limits.request_timeout_ms);
        tokio::time::timeout(timeout, read).await.unwrap_or(false)
    }

    /// What every request goes through, around its handler (a request's body has been read
    /// before, by [`AppState::receive`]): the in-flight cap (503 with Retry-After beyond it),
    /// the request timeout, the in-flight gauge, the latency histogram and the error counter.
    /// Called by each handler rather than as a middleware layer, which would box and clone the
    /// route's service on every request. `started` is when the request arrived.
    async fn guarded(
        &self,
        route: &'static str,
        started: Instant,
        handler: impl Future<Output = Response>,
    ) -> Response {
        // Monitoring stays answerable under overload; everything else takes a permit or gets 503.
        let monitoring = matches!(route, "/healthz" | "/metrics");
        let permit = if monitoring {
            None
        } else {
            match self.in_flight.try_acquire() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    self.metrics.error("unavailable");
                    return Problem::unavailable(format!(
                        "more than {} requests in flight; retry later",
                        self.config.limits.in_flight_max
                    ))
                    .into_response();
                }
            }
        };
        // Scrapes are not counted, so the gauge shows the load, not the act of watching it.
        let _in_flight = (!monitoring).then(|| {
            self.metrics.in_flight().inc();
            InFlight(&self.metrics)
        });
        let timeout_ms = self.config.limits.request_timeout_ms;
        let response = match tokio::time::timeout(Duration::from_millis(timeout_ms), handler).await
        {
            Ok(response) => response,
            Err(_) => {
                tracing::warn!(route, timeout_ms, "request timed out");
                Problem::unavailable(format!(
                    "no answer within {timeout_ms} ms; the operation may or may not have been \
                     applied (a retried claim with the same owner gets its claim back)"
                ))
                .into_response()
            }
        };
        drop(permit);
        self.finish(route, started, response)
    }

    /// Counts an answer in the latency histogram and, if it is a problem, the error counter.
    fn finish(&self, route: &'static str, started: Instant, response: Response) -> Response {
        self.metrics.request(route, started.elapsed());
        if let Some(ProblemCode(code)) = response.extensions().get::<ProblemCode>() {
            self.metrics.error(code);
        }
        response
    }
}

/// Keeps the in-flight gauge right even when a request's future is dropped (client went away).
struct InFlight<'a>(&'a Metrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight().dec();
    }
}

/// The HTTP API over `state` as an axum router (for embedding it in another axum app, or
/// driving it with tower in tests): every request goes to [`AppState::handle`], the same
/// function [`crate::serve`] runs.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new().fallback(move |request: Request| {
        let state = Arc::clone(&state);
        async move { state.handle(request).await }
    })
}
