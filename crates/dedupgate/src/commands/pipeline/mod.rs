//! Shared parts of the pipeline subcommands (`dedup`, `id`, `audit`) and of `run`:
//! [`input`] (JSON Lines and CSV from files or stdin), [`keyspec`] (what makes two records
//! the same), [`backend`] (the gate in-process or over HTTP), and the rejects file and
//! progress bar below.

pub mod backend;
pub mod input;
pub mod keyspec;
pub mod parallel;
pub mod records;

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::Path;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use self::input::Position;

/// A usage error of a pipeline command (bad flags, flags that contradict each other, an output
/// that names an input): the command exits 2 (docs/cli.md), where a failed run exits 1.
/// Found with `anyhow::Error::downcast_ref` through any context added on the way out.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A usage error (exit 2) saying `message`.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// True when `e`, or an error it wraps, is a [`UsageError`].
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.downcast_ref::<UsageError>().is_some()
}

/// Prints `e` as `dedupgate COMMAND: message: cause: …` and gives the exit code of a pipeline
/// command that failed: 2 for a usage error, else 1; an output closed by its reader is no
/// failure (nothing printed, 0).
pub fn report_failure(command: &str, e: &anyhow::Error) -> std::process::ExitCode {
    if crate::commands::is_output_closed(e) {
        return std::process::ExitCode::SUCCESS;
    }
    if e.downcast_ref::<Interrupted>().is_some() {
        // The stopped summary said what was done; 128 + SIGINT, as a shell reports it.
        eprintln!("dedupgate {command}: {e}");
        return std::process::ExitCode::from(EXIT_INTERRUPTED);
    }
    // Errors that write their cause into their message do not also return it as their source,
    // so the chain says each cause once.
    eprintln!("dedupgate {command}: {e:#}");
    std::process::ExitCode::from(if is_usage(e) { 2 } else { 1 })
}

/// Lines between two progress bar updates (an update is cheap, but not free per line).
pub const PROGRESS_EVERY_LINES: u64 = 16_384;

/// Where rejected records go: `--rejects FILE` (JSON Lines: file, line, reason, record), or
/// nowhere, in which case the first reject stops the run with its position and reason.
pub struct Rejects {
    out: Option<BufWriter<File>>,
    /// Records set aside in the rejects file so far.
    pub count: u64,
}

impl Rejects {
    /// Opens `--rejects FILE`, if given.
    pub fn open(path: Option<&Path>) -> anyhow::Result<Self> {
        let out = match path {
            Some(p) => Some(BufWriter::new(File::create(p).with_context(|| {
                format!("cannot create rejects file {}", p.display())
            })?)),
            None => None,
        };
        Ok(Self { out, count: 0 })
    }

    /// Records one reject, or fails (stopping the run) when there is no rejects file.
    pub fn reject(
        &mut self,
        pos: &Position,
        reason: &str,
        record: serde_json::Value,
    ) -> anyhow::Result<()> {
        match &mut self.out {
            Some(out) => {
                let line =
                    json!({"file": pos.file, "line": pos.line, "reason": reason, "record": record});
                serde_json::to_writer(&mut *out, &line)?;
                out.write_all(b"\n")?;
                self.count += 1;
                Ok(())
            }
            None => anyhow::bail!(
                "{pos}: {reason} (give --rejects FILE to set such records aside and go on)"
            ),
        }
    }

    /// True when a rejects file was given.
    pub fn has_file(&self) -> bool {
        self.out.is_some()
    }

    /// Flushes the rejects file.
    pub fn finish(&mut self) -> anyhow::Result<()> {
        if let Some(out) = &mut self.out {
            out.flush().context("writing the rejects file")?;
        }
        Ok(())
    }
}

/// The raw line as a JSON value for a rejects file: the text when it is UTF-8, else its bytes
/// lossily decoded.
pub fn line_value(line: &[u8]) -> serde_json::Value {
    serde_json::Value::String(String::from_utf8_lossy(line).into_owned())
}

/// The progress bar's line with a known size: `{wide_bar}` takes what the terminal's width
/// leaves, so the line never wraps (a fixed 40-column bar wrapped on 80 columns).
pub const BAR_TEMPLATE: &str = "{wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}";
/// The progress line of stdin (no known size).
pub const SPINNER_TEMPLATE: &str = "{spinner} {bytes} {binary_bytes_per_sec}";

/// A progress bar on stderr when it is a terminal (never when piped or `--quiet`).
pub fn progress(total_bytes: Option<u64>, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    match total_bytes {
        Some(total) => ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
            .with_style(
                ProgressStyle::with_template(BAR_TEMPLATE)
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            ),
        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template(SPINNER_TEMPLATE)
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    }
}

/// Exit status of a pipeline command stopped by SIGINT (128 + 2, as a shell reports it).
pub const EXIT_INTERRUPTED: u8 = 130;

/// SIGINT (Ctrl-C) stopped the run: it stops between records like a failure, so what was
/// written is flushed (and, with a ledger, recorded) and the stopped summary says so.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted (SIGINT)")
    }
}

impl std::error::Error for Interrupted {}

/// Set once SIGINT arrives: the command checks the flag between records and stops cleanly. A
/// second SIGINT exits at once with [`EXIT_INTERRUPTED`].
pub fn interrupt_flag() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let set = flag.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let watcher = std::thread::Builder::new()
        .name("sigint".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                let _ = ready_tx.send(());
                return;
            };
            rt.block_on(async {
                let mut sigint =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt());
                let _ = ready_tx.send(());
                if let Ok(sigint) = &mut sigint {
                    sigint.recv().await;
                    set.store(true, std::sync::atomic::Ordering::Relaxed);
                    // A run blocked reading stdin sees the flag only at its next record: a
                    // second SIGINT stops it at once, as an uncaught one would have.
                    sigint.recv().await;
                    std::process::exit(i32::from(EXIT_INTERRUPTED));
                }
            });
        });
    // The handler is in place before the run starts (a SIGINT before it kills the process).
    if watcher.is_ok() {
        let _ = ready_rx.recv();
    }
    flag
}

/// `Err(Interrupted)` once SIGINT has come.
pub fn check_interrupt(flag: &std::sync::atomic::AtomicBool) -> anyhow::Result<()> {
    if flag.load(std::sync::atomic::Ordering::Relaxed) {
        Err(Interrupted.into())
    } else {
        Ok(())
    }
}

/// The summary line every pipeline command ends with on stderr (unless `--quiet`):
/// `dedupgate CMD: [stopped: ]read N, a N, b N (1.23s)`. Counts of zero in `optional` are
/// left out; the parts add up to `read` (a stopped run names what it had read and not
/// written, so the sum is never short).
pub fn summary(
    command: &str,
    stopped: bool,
    read: u64,
    parts: &[(&str, u64)],
    optional: &[(&str, u64)],
    started: std::time::Instant,
) -> String {
    let mut line = format!(
        "dedupgate {command}: {}read {read}",
        if stopped { "stopped: " } else { "" }
    );
    for (name, n) in parts {
        line.push_str(&format!(", {name} {n}"));
    }
    for (name, n) in optional {
        if *n > 0 {
            line.push_str(&format!(", {name} {n}"));
        }
    }
    line.push_str(&format!(" ({:.2}s)", started.elapsed().as_secs_f64()));
    line
}

/// A runtime for the gate calls of a pipeline command (one thread: the work is sequential).
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Unix milliseconds now (for `{now}` in templates and for messages).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
