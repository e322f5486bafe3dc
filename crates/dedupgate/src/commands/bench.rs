//! `dedupgate bench --server URL`: HTTP load against a running gate (dedupgate_client::load):
//! N keep-alive connections sending single claims, batches of claims, or both, then claims/s,
//! requests/s and p50/p99 latency.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use dedupgate_client::load::{self, LoadConfig, LoadMode, LoadReport};
use dedupgate_server::parse_duration_ms;

/// What to measure.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchMode {
    /// `POST /v1/claim`, one claim per request.
    Single,
    /// `POST /v1/batch` with --batch-size claims per request.
    Batch,
    /// Single, then batch.
    Both,
}

/// Flags of `dedupgate bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// The gate, e.g. http://127.0.0.1:7878.
    #[arg(long, env = "DEDUPGATE_SERVER")]
    server: String,
    /// Concurrent keep-alive connections.
    #[arg(long, short = 'c', default_value_t = 50)]
    connections: usize,
    /// How long each mode runs.
    #[arg(long, default_value = "10s")]
    duration: String,
    /// single, batch or both.
    #[arg(long, value_enum, default_value_t = BenchMode::Both)]
    mode: BenchMode,
    /// Claims per batch request.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Keys are key:N with N uniform below this (like redis-benchmark -r).
    #[arg(long, default_value_t = 1_000_000)]
    keyspace: u64,
    /// Namespace of the claims.
    #[arg(long, default_value = "bench")]
    namespace: String,
    /// Bearer token, if the server wants one.
    #[arg(long, env = "DEDUPGATE_TOKEN", hide_env_values = true)]
    bearer_token: Option<String>,
    /// Print one JSON object per mode instead of the table.
    #[arg(long)]
    json: bool,
}

fn print(mode: &str, connections: usize, report: &LoadReport, as_json: bool) -> anyhow::Result<()> {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    if as_json {
        crate::commands::print_line(serde_json::json!({
                "mode": mode,
                "connections": connections,
                "ops_per_s": report.ops_per_s().round(),
                "requests_per_s": report.requests_per_s().round(),
                "p50_ms": ms(report.p50),
                "p99_ms": ms(report.p99),
                "max_ms": ms(report.max),
                "requests_ok": report.requests_ok,
                "requests_failed": report.requests_failed,
        }))
    } else {
        crate::commands::print_line(format_args!(
            "{mode:<14} {connections:>5} conns  {:>10.0} claims/s  {:>9.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  max {:>8.3} ms  failed {}",
            report.ops_per_s(),
            report.requests_per_s(),
            ms(report.p50),
            ms(report.p99),
            ms(report.max),
            report.requests_failed
        ))
    }
}

/// Runs the benchmark.
pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let duration = Duration::from_millis(
        parse_duration_ms(&args.duration).map_err(|e| anyhow::anyhow!("--duration: {e}"))?,
    );
    if args.batch_size == 0 || args.batch_size > dedupgate_core::BATCH_OPS_MAX {
        anyhow::bail!("--batch-size must be 1..={}", dedupgate_core::BATCH_OPS_MAX);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let modes: Vec<(String, LoadMode)> = match args.mode {
        BenchMode::Single => vec![("single".into(), LoadMode::Single)],
        BenchMode::Batch => vec![(
            format!("batch-{}", args.batch_size),
            LoadMode::Batch {
                ops_per_request: args.batch_size,
            },
        )],
        BenchMode::Both => vec![
            ("single".into(), LoadMode::Single),
            (
                format!("batch-{}", args.batch_size),
                LoadMode::Batch {
                    ops_per_request: args.batch_size,
                },
            ),
        ],
    };
    let mut failed = false;
    for (name, mode) in modes {
        let config = LoadConfig {
            server: args.server.clone(),
            connections: args.connections,
            duration,
            mode,
            namespace: args.namespace.clone(),
            keyspace: args.keyspace,
            bearer: args.bearer_token.clone(),
        };
        let report = runtime
            .block_on(load::run(config))
            .with_context(|| format!("bench {name}"))?;
        failed |= report.requests_failed > 0;
        print(&name, args.connections, &report, args.json)?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
