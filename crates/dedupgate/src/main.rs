//! `dedupgate`: one binary over the crates of the workspace. Each subcommand lives in
//! `commands/` and is a thin adapter: it parses flags, opens a store, and calls a library crate.

mod commands;

// The default STORE is an embedded directory and the commands' options include its settings:
// the other engines are optional, this one is not.
#[cfg(not(feature = "embedded"))]
compile_error!("dedupgate needs its \"embedded\" feature: build with --features embedded");

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// dedupgate: let only the first copy of an event through.
#[derive(Parser, Debug)]
#[command(name = "dedupgate", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The gate as an HTTP service (API.md).
    #[command(after_help = commands::help::SERVE)]
    Serve(commands::serve::ServeArgs),
    /// claim|complete|release|extend|mark|get|forget: the API from the shell.
    #[command(flatten)]
    Api(commands::api::ApiCommand),
    /// HTTP load against a running gate: claims/s and p50/p99.
    #[cfg(feature = "http-client")]
    #[command(after_help = commands::help::BENCH)]
    Bench(commands::bench::BenchArgs),
    /// The Idempotency-Key reverse proxy in front of an HTTP API (API.md).
    #[cfg(feature = "proxy")]
    #[command(after_help = commands::help::SERVE)]
    Proxy(commands::proxy::ProxyArgs),
    /// Forward a source's messages to a sink once per key (Kafka, RabbitMQ, NATS).
    #[cfg(feature = "relay")]
    #[command(after_help = commands::help::RELAY)]
    Relay(commands::relay::RelayArgs),
    /// Run CMD at most once per key within the ttl (the cron gate).
    #[command(after_help = commands::help::RUN)]
    Run(commands::run::RunArgs),
    /// Drop duplicate records of JSON Lines or CSV, optionally across runs (--ledger).
    #[command(after_help = commands::help::DEDUP)]
    Dedup(commands::dedup::DedupArgs),
    /// Add deterministic ids (API.md) to JSON Lines or CSV records.
    #[command(after_help = commands::help::ID)]
    Id(commands::id::IdArgs),
    /// Report duplicates in files or a PostgreSQL table; exit 1 when there are any.
    #[command(after_help = commands::help::AUDIT)]
    Audit(commands::audit::AuditArgs),
}

/// mimalloc instead of the system allocator: a request through the HTTP face allocates and frees
/// dozens of small buffers, and glibc's malloc/free were about a sixth of the server's
/// instructions per request (callgrind).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    commands::init_tracing();
    let result = match cli.command {
        Command::Serve(args) => commands::serve::run(args),
        Command::Api(cmd) => commands::api::run(cmd),
        #[cfg(feature = "http-client")]
        Command::Bench(args) => commands::bench::run(args),
        #[cfg(feature = "proxy")]
        Command::Proxy(args) => commands::proxy::run(args),
        #[cfg(feature = "relay")]
        Command::Relay(args) => commands::relay::run(args),
        Command::Run(args) => commands::run::run(args),
        Command::Dedup(args) => commands::dedup::run(args),
        Command::Id(args) => commands::id::run(args),
        Command::Audit(args) => commands::audit::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dedupgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}
