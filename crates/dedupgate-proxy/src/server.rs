//! [`ProxyServer`]: the reverse proxy. An HTTP/1.1 server (keep-alive, chunked bodies, header
//! read timeout, a connection cap) whose every connection is read through the
//! [`crate::guard::FramingGuard`], and whose requests go through [`IdempotencyLayer`] to the
//! [`Upstream`] forwarder.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::Store;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::Limited;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::ProxyBody;
use crate::config::IdempotencyConfig;
use crate::error::ServeError;
use crate::forward::{ClientAddr, Upstream, UpstreamConfig};
use crate::guard::{FramingGuard, AMBIGUOUS_FRAMING};
use crate::layer::{IdempotencyLayer, IdempotencyService};

/// Everything the proxy server needs.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Where to forward.
    pub upstream: UpstreamConfig,
    /// How to gate.
    pub idempotency: IdempotencyConfig,
    /// Open connections served at once; more wait in the listen backlog.
    pub connections_max: usize,
    /// Time a client has to send a complete request head.
    pub header_read_timeout_ms: u64,
    /// On shutdown, time in-flight requests get to finish (and be stored) before the server stops.
    pub shutdown_grace_ms: u64,
}

impl ProxyConfig {
    /// A proxy on `listen` in front of `upstream` with the defaults.
    pub fn new(listen: SocketAddr, upstream: UpstreamConfig) -> Self {
        Self {
            listen,
            upstream,
            idempotency: IdempotencyConfig::default(),
            connections_max: 10_000,
            header_read_timeout_ms: 30_000,
            shutdown_grace_ms: 30_000,
        }
    }
}

/// A bound, not yet running proxy.
pub struct ProxyServer {
    listener: TcpListener,
    layer: IdempotencyLayer,
    service: IdempotencyService<Upstream>,
    connections: Arc<Semaphore>,
    request_bytes_max: u64,
    header_read_timeout: Duration,
    shutdown_grace: Duration,
    upstream: String,
}

impl std::fmt::Debug for ProxyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyServer")
            .field("listen", &self.listener.local_addr().ok())
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl ProxyServer {
    /// Binds the listener and builds the forwarder. Fails on bad configuration or a busy port.
    pub async fn bind(config: ProxyConfig, store: Arc<dyn Store>) -> Result<Self, ServeError> {
        let upstream = Upstream::new(&config.upstream)?;
        let request_bytes_max = config.idempotency.request_bytes_max;
        let layer = IdempotencyLayer::new(store, config.idempotency)?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|error| ServeError::Bind {
                    addr: config.listen,
                    error,
                })?;
        Ok(Self {
            listener,
            service: layer.layer(upstream),
            layer,
            connections: Arc::new(Semaphore::new(config.connections_max.max(1))),
            request_bytes_max,
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms.max(1)),
            shutdown_grace: Duration::from_millis(config.shutdown_grace_ms),
            upstream: config.upstream.url,
        })
    }

    /// The address it listens on (useful after binding port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then lets in-flight requests finish within the grace time.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let graceful = GracefulShutdown::new();
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                p = self.connections.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                () = &mut shutdown => break,
            };
            let (stream, peer) = tokio::select! {
                r = self.listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: pause rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let service = self.service.clone();
            let bytes_max = self.request_bytes_max;
            let svc = hyper::service::service_fn(move |req| {
                serve_one(service.clone(), peer, bytes_max, req)
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(self.header_read_timeout)
                .keep_alive(true)
                .serve_connection(TokioIo::new(FramingGuard::new(stream)), svc);
            let conn = graceful.watch(conn);
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, %peer, "connection ended with an error");
                }
                drop(permit);
            });
        }
        tracing::info!("proxy shutting down; letting in-flight requests finish");
        // Connections first, then gated requests whose callers hung up: their responses are
        // still stored (or their claims released) so a retry is answered, not left to the lease.
        let drained = async {
            graceful.shutdown().await;
            self.layer.idle().await;
        };
        if tokio::time::timeout(self.shutdown_grace, drained)
            .await
            .is_err()
        {
            tracing::warn!(
                in_flight = self.layer.in_flight(),
                "shutdown grace ran out with requests still in flight; their leases will expire"
            );
        }
        Ok(())
    }
}

/// Most bytes of a refused (413) request body the proxy reads, and drops, beside its answer
/// to a client that did not send `Expect: 100-continue`. Such a client (Python's
/// `http.client`, most libraries) sends its whole body before it reads the answer, and a
/// connection closed with its bytes unread reaches it as a reset or a broken pipe, never as
/// the 413. A body announced larger is not read (the connection closes after the 413).
const REFUSED_BODY_DRAIN_BYTES_MAX: u64 = 64 << 20;
/// How long the proxy goes on reading a refused body.
const REFUSED_BODY_DRAIN_FOR: Duration = Duration::from_secs(30);

/// Reads and drops a body, up to [`REFUSED_BODY_DRAIN_BYTES_MAX`] bytes.
async fn drain(mut body: Incoming) {
    use http_body_util::BodyExt;
    let mut drained = 0u64;
    while drained <= REFUSED_BODY_DRAIN_BYTES_MAX {
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

/// Whether a request's transfer codings are none or one `chunked`, the only ones the proxy
/// can forward. Otherwise the status to answer: 501 for a coding it does not support
/// (RFC 9112 6.1: a server answers 501 to a transfer coding it does not understand), 400 for
/// `chunked` applied more than once (which RFC 9112 6.1 forbids; hyper would undo it once).
fn transfer_codings_ok(headers: &http::HeaderMap) -> Result<(), (StatusCode, String)> {
    let codings: Vec<String> = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|c| String::from_utf8_lossy(c).trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    if let Some(other) = codings.iter().find(|c| *c != "chunked") {
        return Err((
            StatusCode::NOT_IMPLEMENTED,
            format!("the transfer coding {other:?} is not supported; only chunked is"),
        ));
    }
    if codings.len() > 1 {
        return Err((
            StatusCode::BAD_REQUEST,
            "chunked is applied more than once (RFC 9112 6.1 forbids it)".to_owned(),
        ));
    }
    Ok(())
}

async fn serve_one(
    mut service: IdempotencyService<Upstream>,
    peer: SocketAddr,
    request_bytes_max: u64,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    let errors = service
        .config()
        .error_format(req.method(), req.uri().path());
    if req.headers().contains_key(AMBIGUOUS_FRAMING) {
        let mut res: Response<ProxyBody> = errors.response(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Content-Length and Transfer-Encoding together make the request's length ambiguous (request smuggling); refused",
        );
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(res);
    }
    if let Err((status, detail)) = transfer_codings_ok(req.headers()) {
        // hyper undoes one `chunked` only: forwarded without its Transfer-Encoding header, a
        // body still under another coding would reach the upstream as if it were plain bytes.
        let mut res: Response<ProxyBody> = errors.response(status, "invalid_request", detail);
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(res);
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(declared) = declared.filter(|&n| n > request_bytes_max) {
        let mut res: Response<ProxyBody> = errors.response(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body exceeds {request_bytes_max} bytes"),
        );
        let expects_continue = req
            .headers()
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if declared <= REFUSED_BODY_DRAIN_BYTES_MAX && !expects_continue {
            // The 413 goes now; the body is read beside it and dropped.
            let body = req.into_body();
            tokio::spawn(tokio::time::timeout(REFUSED_BODY_DRAIN_FOR, drain(body)));
        } else {
            res.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        return Ok(res);
    }
    let limit = usize::try_from(request_bytes_max).unwrap_or(usize::MAX);
    let mut req = req.map(|b| ProxyBody::new(Limited::new(b, limit)));
    req.extensions_mut().insert(ClientAddr(peer));
    service.call(req).await
}
