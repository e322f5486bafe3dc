//! `dedupgate serve`: the gate as an HTTP service (dedupgate-server) over the STORE it is given.
//!
//! Settings come from, in this order of precedence: flags, `DEDUPGATE_*` environment variables,
//! the TOML file of `--config`, built-in defaults (docs/configuration.md). Bearer tokens come
//! only from the file, so they never show in `ps` or a shell history.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use dedupgate_core::Defaults;
use dedupgate_server::{parse_duration_ms, AppState, FileConfig, Limits, ServerConfig};

use dedupgate_stores::{self as store_spec, StoreSpec};

/// Default listen address: loopback, so a fresh install is not reachable from the network.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7878";

/// Flags of `dedupgate serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (HTTP/1.1 and h2c) [default: 127.0.0.1:7878].
    #[arg(long, env = "DEDUPGATE_LISTEN")]
    listen: Option<String>,
    /// Where records live: a path or embedded:PATH (durable), memory:, redis://…, postgres://…,
    /// tiered:FAST,DURABLE [default: ./dedupgate-data].
    #[arg(long, env = "DEDUPGATE_STORE")]
    store: Option<String>,
    /// Optional TOML file with these settings and the bearer tokens.
    #[arg(long, env = "DEDUPGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Serve without bearer tokens on a non-loopback address (anyone who can reach the port may
    /// claim, complete and delete keys).
    #[arg(long, env = "DEDUPGATE_ALLOW_UNAUTHENTICATED_REMOTE")]
    allow_unauthenticated_remote: bool,
    /// Record retention when a request gives no ttl_ms [default: 24h].
    #[arg(long, env = "DEDUPGATE_DEFAULT_TTL")]
    default_ttl: Option<String>,
    /// Lease when a claim gives no lease_ms [default: 30s].
    #[arg(long, env = "DEDUPGATE_DEFAULT_LEASE")]
    default_lease: Option<String>,
    /// Largest request body in bytes [default: 16777216].
    #[arg(long, env = "DEDUPGATE_BODY_BYTES_MAX")]
    body_bytes_max: Option<usize>,
    /// Longest key in bytes, at most 1024 [default: 1024].
    #[arg(long, env = "DEDUPGATE_KEY_BYTES_MAX")]
    key_bytes_max: Option<usize>,
    /// Longest namespace in bytes, at most 128 [default: 128].
    #[arg(long, env = "DEDUPGATE_NAMESPACE_BYTES_MAX")]
    namespace_bytes_max: Option<usize>,
    /// Largest stored result (compact JSON) in bytes [default: 65536].
    #[arg(long, env = "DEDUPGATE_RESULT_BYTES_MAX")]
    result_bytes_max: Option<usize>,
    /// Most ops per batch, at most 10000 [default: 10000].
    #[arg(long, env = "DEDUPGATE_BATCH_OPS_MAX")]
    batch_ops_max: Option<usize>,
    /// Longest a request may take before it is answered 503 [default: 10s].
    #[arg(long, env = "DEDUPGATE_REQUEST_TIMEOUT")]
    request_timeout: Option<String>,
    /// Requests answered at once; more get 503 with Retry-After [default: 1024].
    #[arg(long, env = "DEDUPGATE_IN_FLIGHT_MAX")]
    in_flight_max: Option<usize>,
    /// Pause between sweeps of expired records [default: 1s].
    #[arg(long, env = "DEDUPGATE_SWEEP_INTERVAL")]
    sweep_interval: Option<String>,
    /// Most expired records removed per sweep call [default: 10000].
    #[arg(long, env = "DEDUPGATE_SWEEP_BATCH_MAX")]
    sweep_batch_max: Option<usize>,
    /// Distinct namespace labels in metrics before the rest count as "other" [default: 1000].
    #[arg(long, env = "DEDUPGATE_NAMESPACE_LABELS_MAX")]
    namespace_labels_max: Option<usize>,
}

/// Everything `serve` needs, precedence applied.
#[derive(Debug)]
struct Resolved {
    listen: String,
    store: StoreSpec,
    allow_unauthenticated_remote: bool,
    config: ServerConfig,
}

fn duration(flag: &str, value: Option<&String>, default_ms: u64) -> anyhow::Result<u64> {
    value.map_or(Ok(default_ms), |v| {
        parse_duration_ms(v).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
    })
}

fn resolve(args: ServeArgs) -> anyhow::Result<Resolved> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let base = ServerConfig::default();
    let limits = Limits {
        body_bytes_max: args
            .body_bytes_max
            .or(file.body_bytes_max)
            .unwrap_or(base.limits.body_bytes_max),
        key_bytes_max: args
            .key_bytes_max
            .or(file.key_bytes_max)
            .unwrap_or(base.limits.key_bytes_max),
        namespace_bytes_max: args
            .namespace_bytes_max
            .or(file.namespace_bytes_max)
            .unwrap_or(base.limits.namespace_bytes_max),
        result_bytes_max: args
            .result_bytes_max
            .or(file.result_bytes_max)
            .unwrap_or(base.limits.result_bytes_max),
        batch_ops_max: args
            .batch_ops_max
            .or(file.batch_ops_max)
            .unwrap_or(base.limits.batch_ops_max),
        request_timeout_ms: duration(
            "request timeout",
            args.request_timeout
                .as_ref()
                .or(file.request_timeout.as_ref()),
            base.limits.request_timeout_ms,
        )?,
        in_flight_max: args
            .in_flight_max
            .or(file.in_flight_max)
            .unwrap_or(base.limits.in_flight_max),
    }
    .validated()?;
    let defaults = Defaults {
        ttl_ms: duration(
            "default ttl",
            args.default_ttl.as_ref().or(file.default_ttl.as_ref()),
            base.defaults.ttl_ms,
        )?,
        lease_ms: duration(
            "default lease",
            args.default_lease.as_ref().or(file.default_lease.as_ref()),
            base.defaults.lease_ms,
        )?,
    };
    let config = ServerConfig {
        defaults,
        limits,
        sweep_interval_ms: duration(
            "sweep interval",
            args.sweep_interval
                .as_ref()
                .or(file.sweep_interval.as_ref()),
            base.sweep_interval_ms,
        )?,
        sweep_batch_max: args
            .sweep_batch_max
            .or(file.sweep_batch_max)
            .unwrap_or(base.sweep_batch_max)
            .max(1),
        namespace_labels_max: args
            .namespace_labels_max
            .or(file.namespace_labels_max)
            .unwrap_or(base.namespace_labels_max),
        metrics_namespaces: file.metrics_namespaces,
        tokens: file.tokens,
    };
    for (i, t) in config.tokens.iter().enumerate() {
        if t.token.len() < 16 {
            bail!(
                "token {} ({}) is shorter than 16 characters: use a long random secret",
                i + 1,
                t.name.as_deref().unwrap_or("unnamed")
            );
        }
    }
    let store = match args.store.or(file.store) {
        Some(s) => s.parse()?,
        None => StoreSpec::default(),
    };
    Ok(Resolved {
        listen: args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_owned()),
        store,
        allow_unauthenticated_remote: args.allow_unauthenticated_remote
            || file.allow_unauthenticated_remote.unwrap_or(false),
        config,
    })
}

/// Runs `dedupgate serve` until SIGTERM or SIGINT.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let resolved = resolve(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(resolved))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(r: Resolved) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&r.listen)
        .await
        .with_context(|| format!("cannot listen on {}", r.listen))?;
    let addr = listener.local_addr()?;
    let auth_on = !r.config.tokens.is_empty();
    if !auth_on && !addr.ip().is_loopback() && !r.allow_unauthenticated_remote {
        bail!(
            "refusing to serve without auth on non-loopback address {addr}: add [[tokens]] to \
             the config file, listen on 127.0.0.1, or pass --allow-unauthenticated-remote"
        );
    }
    let store: Arc<dyn dedupgate_core::Store> = store_spec::open(&r.store)
        .await
        .map_err(|e| super::pipeline::backend::serving_open_failed(e, "serve"))?;
    let auth = if auth_on {
        format!("on ({} tokens)", r.config.tokens.len())
    } else {
        "off (no tokens configured)".to_owned()
    };
    tracing::info!(
        "dedupgate serve listening on http://{addr} store={} auth={auth}",
        store.describe()
    );
    let state = AppState::new(store, r.config);
    dedupgate_server::serve(listener, state, super::shutdown_signal()).await?;
    tracing::info!("dedupgate serve stopped: in-flight requests finished");
    Ok(())
}
