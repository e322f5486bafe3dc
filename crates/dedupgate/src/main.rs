//! `dedupgate`: one binary over the crates of the workspace. Each subcommand lives in
//! `commands/` and is a thin adapter: it parses flags, opens a store, and calls a library crate.

mod commands;
mod store_spec;

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
    Serve(commands::serve::ServeArgs),
    /// claim|complete|release|extend|mark|get|forget: the API from the shell.
    #[command(flatten)]
    Api(commands::api::ApiCommand),
    /// HTTP load against a running gate: claims/s and p50/p99.
    Bench(commands::bench::BenchArgs),
    /// The Idempotency-Key reverse proxy in front of an HTTP API (API.md).
    Proxy(commands::proxy::ProxyArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    commands::init_tracing();
    let result = match cli.command {
        Command::Serve(args) => commands::serve::run(args),
        Command::Api(cmd) => commands::api::run(cmd),
        Command::Bench(args) => commands::bench::run(args),
        Command::Proxy(args) => commands::proxy::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dedupgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}
