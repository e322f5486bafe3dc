//! `dedupgate proxy`: the Idempotency-Key reverse proxy (dedupgate-proxy) in front of one
//! upstream, over the STORE it is given.
//!
//! Settings come from flags (or their `DEDUPGATE_PROXY_*` environment variables) over the TOML
//! file of `--config` (routes and header policy, docs/proxy.md) over built-in defaults. The
//! encryption key comes from a file or the environment, never from a flag, so it never shows in
//! `ps` or a shell history.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use dedupgate_proxy::http::HeaderName;
use dedupgate_proxy::{
    parse_duration_ms, ConfigFile, IdempotencyConfig, ProxyConfig, ProxyServer, Requirement,
    Sealer, ServeError, UpstreamConfig,
};

use dedupgate_stores::{self as store_spec, StoreSpec};

/// Default listen address: loopback, beside `serve`'s 7878.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7879";
/// Added to the upstream timeout to size the default lease: time to store the response.
const LEASE_MARGIN_MS: u64 = 5_000;

/// Flags of `dedupgate proxy`.
#[derive(clap::Args, Debug)]
pub struct ProxyArgs {
    /// The API to protect: http://host:port[/base] or https://… .
    #[arg(long, env = "DEDUPGATE_PROXY_UPSTREAM")]
    upstream: String,
    /// Address to listen on [default: 127.0.0.1:7879].
    #[arg(long, env = "DEDUPGATE_PROXY_LISTEN")]
    listen: Option<String>,
    /// Where records live: a path or embedded:PATH (durable), memory:, redis://…, postgres://…,
    /// tiered:FAST,DURABLE [default: ./dedupgate-data].
    #[arg(long, env = "DEDUPGATE_PROXY_STORE")]
    store: Option<String>,
    /// TOML file with routes (methods, path patterns, required/optional) and header policy.
    #[arg(long, env = "DEDUPGATE_PROXY_CONFIG")]
    config: Option<PathBuf>,
    /// Namespace of the proxy's records [default: idempotency].
    #[arg(long, env = "DEDUPGATE_PROXY_NAMESPACE")]
    namespace: Option<String>,
    /// How long responses are kept and replayed [default: 24h].
    #[arg(long, env = "DEDUPGATE_PROXY_TTL")]
    ttl: Option<String>,
    /// Lease of an in-flight request, renewed while it runs [default: upstream timeout + 5s].
    #[arg(long, env = "DEDUPGATE_PROXY_LEASE")]
    lease: Option<String>,
    /// Let a duplicate of an in-flight request wait this long and replay the first one's
    /// response, instead of answering 409 at once.
    #[arg(long, env = "DEDUPGATE_PROXY_WAIT")]
    wait: Option<String>,
    /// How the proxy words the errors it answers itself: problem (RFC 9457 problem JSON) or
    /// stripe (Stripe's error object and statuses, which Stripe's SDKs parse); a route of the
    /// config file may say otherwise [default: problem].
    #[arg(long, env = "DEDUPGATE_PROXY_ERRORS", value_name = "FORMAT",
          value_parser = ["problem", "stripe"])]
    errors: Option<String>,
    /// Require an Idempotency-Key on the default routes (POST and PATCH everywhere).
    #[arg(long, env = "DEDUPGATE_PROXY_REQUIRE_KEY")]
    require_key: bool,
    /// Limit on connecting to the upstream, on its response headers, and on silence in a body
    /// [default: 30s].
    #[arg(long, env = "DEDUPGATE_PROXY_UPSTREAM_TIMEOUT")]
    upstream_timeout: Option<String>,
    /// PEM file of CA certificates trusted for an https:// upstream (beside the webpki roots).
    #[arg(long, env = "DEDUPGATE_PROXY_UPSTREAM_CA")]
    upstream_ca: Option<PathBuf>,
    /// Send the caller's Host header upstream instead of the upstream's authority.
    #[arg(long, env = "DEDUPGATE_PROXY_PRESERVE_HOST")]
    preserve_host: bool,
    /// Header whose value scopes keys to a caller [default: authorization].
    #[arg(long, env = "DEDUPGATE_PROXY_SCOPE_HEADER")]
    scope_header: Option<String>,
    /// Response header to store and replay although normally dropped (set-cookie); repeatable.
    #[arg(long = "allow-header")]
    allow_headers: Vec<String>,
    /// Response header never stored or replayed; repeatable.
    #[arg(long = "deny-header")]
    deny_headers: Vec<String>,
    /// Largest request body in bytes [default: 10485760].
    #[arg(long, env = "DEDUPGATE_PROXY_REQUEST_BYTES_MAX")]
    request_bytes_max: Option<u64>,
    /// Time a gated request's body has to arrive once its head has; then 408, nothing claimed
    /// [default: 30s].
    #[arg(long, env = "DEDUPGATE_PROXY_BODY_READ_TIMEOUT")]
    body_read_timeout: Option<String>,
    /// Largest stored response body in bytes [default: 10485760].
    #[arg(long, env = "DEDUPGATE_PROXY_RESPONSE_BYTES_MAX")]
    response_bytes_max: Option<u64>,
    /// File holding the 256-bit key (64 hex digits or base64) that encrypts stored responses.
    /// DEDUPGATE_PROXY_ENCRYPTION_KEY may hold the key itself instead.
    #[arg(long, env = "DEDUPGATE_PROXY_ENCRYPTION_KEY_FILE")]
    encryption_key_file: Option<PathBuf>,
    /// Connections served at once, 1..=1000000 [default: 10000].
    #[arg(long, env = "DEDUPGATE_PROXY_CONNECTIONS_MAX",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    connections_max: Option<usize>,
}

fn duration(flag: &str, value: &str) -> anyhow::Result<u64> {
    parse_duration_ms(value).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

fn header(flag: &str, value: &str) -> anyhow::Result<HeaderName> {
    HeaderName::from_bytes(value.trim().to_ascii_lowercase().as_bytes())
        .with_context(|| format!("{flag}: bad header name {value:?}"))
}

struct Resolved {
    store: StoreSpec,
    config: ProxyConfig,
}

fn resolve(args: ProxyArgs) -> anyhow::Result<Resolved> {
    let mut upstream = UpstreamConfig::new(args.upstream);
    if let Some(t) = &args.upstream_timeout {
        upstream.timeout_ms = duration("--upstream-timeout", t)?;
    }
    upstream.ca_file = args.upstream_ca;
    upstream.preserve_host = args.preserve_host;

    let mut base = IdempotencyConfig {
        lease_ms: upstream.timeout_ms.saturating_add(LEASE_MARGIN_MS),
        ..IdempotencyConfig::default()
    };
    if args.require_key {
        for r in &mut base.routes {
            r.key = Requirement::Required;
        }
    }
    let file = match &args.config {
        Some(path) => ConfigFile::load(path)?,
        None => ConfigFile::default(),
    };
    let mut c = file.apply(base)?;
    if let Some(ns) = args.namespace {
        c.namespace = ns;
    }
    if let Some(t) = &args.ttl {
        c.ttl_ms = duration("--ttl", t)?;
    }
    if let Some(t) = &args.lease {
        c.lease_ms = duration("--lease", t)?;
    }
    if let Some(t) = &args.wait {
        c.wait_ms = Some(duration("--wait", t)?);
    }
    if let Some(e) = &args.errors {
        c.errors = e.parse().map_err(|e| anyhow::anyhow!("--errors: {e}"))?;
    }
    if let Some(h) = &args.scope_header {
        c.scope_header = header("--scope-header", h)?;
    }
    for h in &args.allow_headers {
        c.allow_headers.insert(header("--allow-header", h)?);
    }
    for h in &args.deny_headers {
        c.deny_headers.insert(header("--deny-header", h)?);
    }
    if let Some(n) = args.request_bytes_max {
        c.request_bytes_max = n;
    }
    if let Some(n) = args.response_bytes_max {
        c.response_bytes_max = n;
    }
    if let Some(t) = &args.body_read_timeout {
        c.body_read_timeout_ms = duration("--body-read-timeout", t)?;
    }
    let key_text = match (
        &args.encryption_key_file,
        std::env::var("DEDUPGATE_PROXY_ENCRYPTION_KEY"),
    ) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read encryption key file {}", path.display()))?,
        ),
        (None, Ok(k)) if !k.is_empty() => Some(k),
        _ => None,
    };
    if let Some(k) = key_text {
        c.sealer = Some(Sealer::from_text(&k)?);
    }
    c.validate()?;

    let listen = args.listen.unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
    let listen = listen
        .parse()
        .with_context(|| format!("--listen {listen:?}: expected IP:PORT"))?;
    let mut config = ProxyConfig::new(listen, upstream);
    config.idempotency = c;
    if let Some(n) = args.connections_max {
        config.connections_max = n;
    }
    let store = match args.store {
        Some(s) => s.parse()?,
        None => StoreSpec::default(),
    };
    Ok(Resolved { store, config })
}

/// Runs `dedupgate proxy` until SIGTERM or SIGINT.
pub fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let resolved = resolve(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(resolved))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(r: Resolved) -> anyhow::Result<()> {
    // A store whose server is down at start (Redis, PostgreSQL) does not stop the proxy: it
    // starts, answers gated requests 503 `unavailable` and keeps opening the store with
    // backoff; other requests pass through meanwhile. A refused configuration still stops it.
    let (store, pending) = store_spec::open_or_pending(&r.store, store_spec::Backoff::default())
        .await
        .map_err(|e| super::pipeline::backend::serving_open_failed(e, "proxy"))?;
    let upstream = r.config.upstream.url.clone();
    let encrypted = r.config.idempotency.sealer.is_some();
    let describe = store.describe();
    let server = ProxyServer::bind(r.config, store)
        .await
        .map_err(|e| match &e {
            ServeError::Bind { error, .. } if error.kind() == std::io::ErrorKind::AddrInUse => {
                anyhow::anyhow!("cannot start the proxy: {e}; give another address with --listen")
            }
            _ => anyhow::Error::new(e).context("cannot start the proxy"),
        })?;
    let addr = server.local_addr()?;
    match pending {
        None => tracing::info!(
            "dedupgate proxy listening on http://{addr} upstream={upstream} store={describe} encrypted_at_rest={encrypted}"
        ),
        Some(e) => tracing::warn!(
            "dedupgate proxy listening on http://{addr} upstream={upstream} store={describe} encrypted_at_rest={encrypted}; \
             requests with an Idempotency-Key get 503 until the store opens, retried in the \
             background with backoff (up to {} s): {:#}",
            store_spec::Backoff::default().max.as_secs(),
            anyhow::Error::new(e)
        ),
    }
    server.run(super::shutdown_signal()).await?;
    tracing::info!("dedupgate proxy stopped");
    Ok(())
}
