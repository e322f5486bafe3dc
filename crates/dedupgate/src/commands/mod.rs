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
    // Colours only on a terminal: logs sent to a file or a collector stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM: the signal that starts a graceful shutdown of the
/// long-running subcommands (`serve`, `proxy`).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
