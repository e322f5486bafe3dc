//! One module per subcommand.

pub mod api;
pub mod audit;
pub mod bench;
pub mod dedup;
pub mod id;
pub mod pipeline;
pub mod proxy;
pub mod run;
pub mod serve;

/// Logs go to stderr, filtered by `RUST_LOG` (default: info for dedupgate, warn for the rest).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,dedupgate=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
