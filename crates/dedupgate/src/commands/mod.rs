//! One module per subcommand.
//!
//! `bench` needs the `http-client` feature, `proxy` the `proxy` feature and `relay` the
//! `relay` feature: a build without them has no such subcommand.

pub mod api;
pub mod audit;
#[cfg(feature = "http-client")]
pub mod bench;
pub mod dedup;
pub mod help;
pub mod id;
pub mod pipeline;
#[cfg(feature = "proxy")]
pub mod proxy;
#[cfg(feature = "relay")]
pub mod relay;
pub mod run;
pub mod serve;

use std::io::{self, Write};

/// The reader of the output went away (`dedupgate dedup … | head -1`). Not a failure: the
/// command stops writing and exits quietly, as jq and ripgrep do (docs/cli.md).
#[derive(Debug)]
pub struct OutputClosed;

impl std::fmt::Display for OutputClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the output was closed by its reader")
    }
}

impl std::error::Error for OutputClosed {}

/// An output whose broken pipe (EPIPE) comes out as an [`OutputClosed`] error, so it is told
/// apart from a broken pipe to a store or server, which is a failure.
pub struct ClosedAware<W>(pub W);

impl<W: Write> Write for ClosedAware<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(mark_closed)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf).map_err(mark_closed)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(mark_closed)
    }
}

fn mark_closed(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        io::Error::new(io::ErrorKind::BrokenPipe, OutputClosed)
    } else {
        e
    }
}

/// True when `e`, or an error it wraps, is an [`OutputClosed`].
pub fn is_output_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<OutputClosed>()
            || cause
                .downcast_ref::<io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.is::<OutputClosed>())
    })
}

/// Prints `text` and a newline on stdout; a closed stdout is not an error (see
/// [`OutputClosed`]), any other failure is.
pub fn print_line(text: impl std::fmt::Display) -> anyhow::Result<()> {
    let mut out = ClosedAware(io::stdout().lock());
    let written = writeln!(out, "{text}").and_then(|()| out.flush());
    match written {
        Err(e) if e.get_ref().is_some_and(|i| i.is::<OutputClosed>()) => Ok(()),
        other => Ok(other?),
    }
}

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
/// long-running subcommands (`serve`, `proxy`, `relay`).
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
