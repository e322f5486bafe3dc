//! The router: API.md's routes ([`ROUTES`]), their handlers, and the layer that applies the
//! in-flight cap, the request timeout, latency and error metrics to every request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::future::Future;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, MethodRouter};
use axum::Router;
use dedupgate_core::{GateError, Outcome, Store};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Deserialize;
use tokio::sync::Semaphore;

use crate::auth::Auth;
use crate::config::ServerConfig;
use crate::metrics::Metrics;
use crate::problem::{Problem, ProblemCode};
use crate::wire::{self, OpKind, Parsed, RecordReq};

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
            metrics: Metrics::new(config.namespace_labels_max),
            in_flight: Arc::new(Semaphore::new(config.limits.in_flight_max)),
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

    /// Reads a request body, refusing it with 413 once it passes the configured limit.
    async fn read_body(&self, body: Body) -> Result<Bytes, Problem> {
        let limit = self.config.limits.body_bytes_max;
        match Limited::new(body, limit).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.is::<LengthLimitError>() => Err(Problem::too_large(format!(
                "the request body is larger than {limit} bytes"
            ))),
            Err(e) => Err(Problem::invalid(format!(
                "could not read the request body: {e}"
            ))),
        }
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

    async fn single(&self, kind: OpKind, request: Request) -> Response {
        let answer = async {
            let (parts, body) = request.into_parts();
            let principal = self.auth.authenticate(self.authorization(&parts.headers))?;
            let body = self.read_body(body).await?;
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

    async fn record(&self, kind: OpKind, request: Request) -> Response {
        // Only the head is used; the body (not Sync) must not live across the store call.
        let (parts, _) = request.into_parts();
        let answer = async {
            let principal = self.auth.authenticate(self.authorization(&parts.headers))?;
            let Query(q) = Query::<RecordReq>::try_from_uri(&parts.uri).map_err(|e| {
                Problem::invalid(format!("query must carry namespace and key: {e}"))
            })?;
            let id = wire::record_id(q.namespace, q.key, &self.config.limits)?;
            principal.allows(id.namespace.as_str(), kind.admin())?;
            let op = match kind {
                OpKind::Forget => dedupgate_core::Op::Forget,
                _ => dedupgate_core::Op::Get,
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

    async fn batch(&self, request: Request) -> Response {
        match self.batch_inner(request).await {
            Ok(out) => json(StatusCode::OK, out),
            Err(problem) => problem.into_response(),
        }
    }

    async fn batch_inner(&self, request: Request) -> Result<Vec<u8>, Problem> {
        #[derive(Deserialize)]
        struct BatchReq<'a> {
            #[serde(borrow)]
            ops: Vec<wire::BatchItem<'a>>,
        }
        let (parts, body) = request.into_parts();
        let principal = self.auth.authenticate(self.authorization(&parts.headers))?;
        let body = self.read_body(body).await?;
        let BatchReq { ops } = serde_json::from_slice(&body)
            .map_err(|e| Problem::invalid(format!("the body must be {{\"ops\":[…]}}: {e}")))?;
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

    async fn metrics_text(&self) -> Response {
        let stats = self.store.stats().await.ok();
        let text = self.metrics.render(stats.as_ref());
        let mut response = (StatusCode::OK, text).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
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

type S = Arc<AppState>;

fn post_op(kind: OpKind, route: &'static str) -> MethodRouter<S> {
    post(move |State(app): State<S>, request: Request| async move {
        app.guarded(route, app.single(kind, request)).await
    })
}

fn record_route(kind: OpKind, route: &'static str) -> MethodRouter<S> {
    let handler = move |State(app): State<S>, request: Request| async move {
        app.guarded(route, app.record(kind, request)).await
    };
    if kind == OpKind::Forget {
        delete(handler)
    } else {
        get(handler)
    }
}

fn method_router(route: &Route) -> MethodRouter<S> {
    let path = route.path;
    match (route.method, path) {
        ("POST", "/v1/claim") => post_op(OpKind::Claim, path),
        ("POST", "/v1/complete") => post_op(OpKind::Complete, path),
        ("POST", "/v1/release") => post_op(OpKind::Release, path),
        ("POST", "/v1/extend") => post_op(OpKind::Extend, path),
        ("POST", "/v1/mark") => post_op(OpKind::Mark, path),
        ("GET", "/v1/record") => record_route(OpKind::Get, path),
        ("DELETE", "/v1/record") => record_route(OpKind::Forget, path),
        ("POST", "/v1/batch") => post(move |State(app): State<S>, request: Request| async move {
            app.guarded(path, app.batch(request)).await
        }),
        ("GET", "/healthz") => {
            get(move |State(app): State<S>| async move { app.guarded(path, app.health()).await })
        }
        ("GET", "/metrics") => {
            get(
                move |State(app): State<S>| async move { app.guarded(path, app.metrics_text()).await },
            )
        }
        (method, path) => unreachable!("ROUTES lists {method} {path} without a handler"),
    }
}

/// The route label of a request path: its ROUTES path, or `other` (bounded: never the raw path).
fn route_label(uri: &Uri) -> &'static str {
    ROUTES
        .iter()
        .find(|r| r.path == uri.path())
        .map_or("other", |r| r.path)
}

impl AppState {
    /// What every request goes through, around its handler (which also reads the body): the
    /// in-flight cap (503 with Retry-After beyond it), the request timeout, the in-flight gauge,
    /// the latency histogram and the error counter. Called by each handler rather than as a
    /// middleware layer, which would box and clone the route's service on every request.
    async fn guarded(
        &self,
        route: &'static str,
        handler: impl Future<Output = Response>,
    ) -> Response {
        let started = Instant::now();
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

/// The HTTP API over `state`: every route of [`ROUTES`], problem JSON for unknown routes and
/// methods; each handler runs inside [`AppState::guarded`].
pub fn router(state: Arc<AppState>) -> Router {
    let mut router: Router<S> = Router::new();
    for route in ROUTES {
        router = router.route(route.path, method_router(route));
    }
    router
        .fallback(|State(app): State<S>| async move {
            app.guarded("other", async {
                Problem::not_found("no such route").into_response()
            })
            .await
        })
        .method_not_allowed_fallback(|State(app): State<S>, uri: Uri| async move {
            app.guarded(route_label(&uri), async {
                Problem::method_not_allowed("this route does not take that method").into_response()
            })
            .await
        })
        .with_state(state)
}
