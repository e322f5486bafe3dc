//! [`Upstream`]: the forwarding service under the layer. It rewrites a request for the upstream
//! (URL, `Host`, `X-Forwarded-*`, no hop-by-hop headers), sends it over a pooled keep-alive
//! client (rustls for `https://`), and turns transport failures and timeouts into 502/504
//! problems so that the layer releases the claim.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use dedupgate_core::error::chain_text;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_service::Service;

use crate::body::{IdleTimeout, ProxyBody};
use crate::error::ConfigError;
use crate::headers::strip_hop_by_hop;
use crate::layer::is_length_limit;
use crate::problem::ErrorFormat;

/// The peer address of a request, put into its extensions by the server for `X-Forwarded-For`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// Idle connections kept per upstream host.
const POOL_IDLE_PER_HOST_MAX: usize = 256;

/// Where and how to reach the upstream.
#[derive(Clone, Debug)]
pub struct UpstreamConfig {
    /// `http://host:port[/base]` or `https://…`.
    pub url: String,
    /// Limit on connecting, on waiting for response headers, and on silence within a body.
    pub timeout_ms: u64,
    /// Extra PEM CA certificates trusted for `https://` upstreams (beside the webpki roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// Send the caller's `Host` upstream instead of the upstream's own authority.
    pub preserve_host: bool,
}

impl UpstreamConfig {
    /// An upstream at `url` with a 30 s timeout.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            timeout_ms: 30_000,
            ca_file: None,
            preserve_host: false,
        }
    }
}

struct Target {
    scheme: Scheme,
    authority: Authority,
    /// Base path without a trailing slash ("" for none).
    base_path: String,
}

/// Forwards requests to one upstream.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    target: Arc<Target>,
    timeout: Duration,
    preserve_host: bool,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Upstream({}://{}{})",
            self.target.scheme, self.target.authority, self.target.base_path
        )
    }
}

impl Upstream {
    /// A forwarder. Fails on a bad URL or unreadable CA file.
    pub fn new(config: &UpstreamConfig) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::Upstream {
            url: config.url.clone(),
            reason: reason.to_owned(),
        };
        let uri: Uri = config.url.parse().map_err(|_| bad("not a URL"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| bad("needs http:// or https://"))?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(bad("only http:// and https:// are supported"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad("needs a host"))?;
        if uri.query().is_some() {
            return Err(bad("must not have a query"));
        }
        if config.timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "upstream timeout must be positive".into(),
            ));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let timeout = Duration::from_millis(config.timeout_ms);

        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let tls = tls_config(config.ca_file.as_deref())?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(POOL_IDLE_PER_HOST_MAX)
            .build(https);
        Ok(Self {
            client,
            target: Arc::new(Target {
                scheme,
                authority,
                base_path,
            }),
            timeout,
            preserve_host: config.preserve_host,
        })
    }

    fn rewrite(&self, req: Request<ProxyBody>) -> Result<Request<ProxyBody>, String> {
        let (mut parts, body) = req.into_parts();
        let caller_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        strip_hop_by_hop(&mut parts.headers);
        let h = &mut parts.headers;
        if let Some(ClientAddr(peer)) = parts.extensions.get::<ClientAddr>() {
            let ip = peer.ip().to_string();
            let value = match h.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
                Some(prev) => format!("{prev}, {ip}"),
                None => ip,
            };
            if let Ok(v) = HeaderValue::from_str(&value) {
                h.insert(X_FORWARDED_FOR, v);
            }
        }
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        if let Some(host) = &caller_host {
            h.insert(X_FORWARDED_HOST, host.clone());
        }
        if self.preserve_host {
            if let Some(host) = caller_host {
                h.insert(header::HOST, host);
            }
        } else {
            let host =
                HeaderValue::from_str(self.target.authority.as_str()).map_err(|e| e.to_string())?;
            h.insert(header::HOST, host);
        }
        let pq = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let path = if self.target.base_path.is_empty() {
            pq.to_owned()
        } else {
            format!("{}{}", self.target.base_path, pq)
        };
        parts.uri = Uri::builder()
            .scheme(self.target.scheme.clone())
            .authority(self.target.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| e.to_string())?;
        parts.version = Version::HTTP_11;
        Ok(Request::from_parts(parts, body))
    }
}

fn tls_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, ConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let pem = std::fs::read(path)
            .map_err(|e| ConfigError::Tls(format!("{}: {e}", path.display())))?;
        let mut added = 0;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert = cert.map_err(|e| ConfigError::Tls(format!("{}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| ConfigError::Tls(format!("{}: {e}", path.display())))?;
            added += 1;
        }
        if added == 0 {
            return Err(ConfigError::Tls(format!(
                "{}: no PEM certificates found",
                path.display()
            )));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl Service<Request<ProxyBody>> for Upstream {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        let this = self.clone();
        // The idempotency layer says how this request's route words errors.
        let errors = req
            .extensions()
            .get::<ErrorFormat>()
            .copied()
            .unwrap_or_default();
        Box::pin(async move {
            let req = match this.rewrite(req) {
                Ok(r) => r,
                Err(e) => {
                    return Ok(errors.response(StatusCode::BAD_REQUEST, "invalid_request", e))
                }
            };
            let res = match tokio::time::timeout(this.timeout, this.client.request(req)).await {
                Err(_) => {
                    return Ok(errors.response(
                        StatusCode::GATEWAY_TIMEOUT,
                        "gateway_timeout",
                        format!("the upstream did not answer within {:?}", this.timeout),
                    ))
                }
                Ok(Err(e)) if is_length_limit(&e) => {
                    return Ok(errors.response(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "payload_too_large",
                        "the request body exceeds the proxy's limit",
                    ))
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %chain_text(&e), "upstream request failed");
                    return Ok(errors.response(
                        StatusCode::BAD_GATEWAY,
                        "bad_gateway",
                        format!("the upstream could not be reached: {}", chain_text(&e)),
                    ));
                }
                Ok(Ok(res)) => res,
            };
            let (mut parts, body) = res.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Ok(Response::from_parts(
                parts,
                ProxyBody::new(IdleTimeout::new(body, this.timeout)),
            ))
        })
    }
}
