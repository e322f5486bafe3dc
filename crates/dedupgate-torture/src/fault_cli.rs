//! The `storage-faults` and `clock-jumps` subcommands of `dedupgate-torture`, and their part of
//! `summarize`. Kept here so the binary only names them.

use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;

use crate::clock_jumps::{self, ClockJumpConfig};
use crate::faultrun::FaultRunError;
use crate::storage_faults::{self, StorageFaultConfig};

/// Which storage fault.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageKind {
    /// Failed writes and fsyncs (libfiu), turned on and off at runtime.
    FailedIo,
    /// Loss of never-synced writes: SIGKILL, unsynced data dropped, restart.
    PowerLoss,
}

/// Flags shared by both subcommands.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// Directory of the run's files (default: a fresh one under the temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Seed (default: random, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker processes at a time.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Print the whole report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Append the report (one JSON line) to this file, for `summarize`.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Delete the run directory afterwards when every check passed.
    #[arg(long)]
    pub clean: bool,
}

/// `storage-faults`: failed I/O or power loss under the embedded store, over HTTP.
#[derive(clap::Args, Debug)]
pub struct StorageFaultsArgs {
    /// The fault.
    #[arg(long, value_enum)]
    pub kind: StorageKind,
    /// Fault phases (failed-io) or power losses (power-loss).
    #[arg(long, default_value_t = 10)]
    pub episodes: u64,
    /// Probability that a sync fails while faults are on (failed-io).
    #[arg(long, default_value_t = 0.2)]
    pub sync_fail_probability: f64,
    /// Probability that a write fails while faults are on (failed-io).
    #[arg(long, default_value_t = 0.02)]
    pub write_fail_probability: f64,
    /// failed-io: end with a simulated power loss that also loses what was written before a
    /// failed sync, instead of a plain SIGKILL.
    #[arg(long)]
    pub then_power_loss: bool,
    /// Sleep before each sync of the store's files, µs (power-loss: a slow disk).
    #[arg(long, default_value_t = 2_000)]
    pub sync_delay_us: u64,
    /// The shared flags.
    #[command(flatten)]
    pub common: Common,
}

/// `clock-jumps`: the gate's clock jumped (libfaketime) while workers use it.
#[derive(clap::Args, Debug)]
pub struct ClockJumpsArgs {
    /// STORE of the gate (embedded:PATH jumps only backward; redis://, postgres:// both ways).
    #[arg(long)]
    pub store: String,
    /// Jumps.
    #[arg(long, default_value_t = 20)]
    pub jumps: u64,
    /// The shared flags.
    #[command(flatten)]
    pub common: Common,
}

fn seed_dir(c: &Common, what: &str) -> (u64, PathBuf) {
    let seed = match c.seed {
        Some(s) => {
            eprintln!("{what}: seed {s}");
            s
        }
        None => crate::seed(what),
    };
    let dir = c.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("dedupgate-{what}-{}-{seed}", std::process::id()))
    });
    eprintln!("{what}: files in {}", dir.display());
    (seed, dir)
}

fn finish<R: Serialize>(
    c: &Common,
    dir: &std::path::Path,
    kind: &str,
    report: &R,
    summary: String,
    violations: Vec<String>,
    ok: bool,
) -> Result<ExitCode, FaultRunError> {
    let line = serde_json::json!({ "kind": kind, "report": report });
    if c.json {
        println!(
            "{}",
            serde_json::to_string_pretty(report).map_err(std::io::Error::other)?
        );
    }
    if let Some(f) = &c.report {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(f)?;
        writeln!(file, "{line}")?;
    }
    println!("{summary}");
    for v in &violations {
        println!("VIOLATION {v}");
    }
    if c.clean && ok {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Runs `storage-faults`.
pub async fn storage_faults_main(a: StorageFaultsArgs) -> Result<ExitCode, FaultRunError> {
    let what = match a.kind {
        StorageKind::FailedIo => "failed-io",
        StorageKind::PowerLoss => "power-loss",
    };
    let (seed, dir) = seed_dir(&a.common, what);
    let mut cfg = StorageFaultConfig::ci(
        dir.join("data"),
        dir.join("run"),
        std::env::current_exe()?,
        seed,
        a.episodes,
    );
    cfg.sync_fail_probability = a.sync_fail_probability;
    cfg.write_fail_probability = a.write_fail_probability;
    cfg.sync_delay_us = a.sync_delay_us;
    cfg.power_loss_at_end = a.then_power_loss;
    cfg.load.workers = a.common.workers;
    match a.kind {
        StorageKind::FailedIo => {
            let r = storage_faults::failed_io(cfg).await?;
            finish(
                &a.common,
                &dir,
                "failed_io",
                &r,
                r.summary(),
                r.checked.violations(),
                r.ok(),
            )
        }
        StorageKind::PowerLoss => {
            let r = storage_faults::power_loss(cfg).await?;
            finish(
                &a.common,
                &dir,
                "power_loss",
                &r,
                r.summary(),
                r.checked.violations(),
                r.ok(),
            )
        }
    }
}

/// Runs `clock-jumps`.
pub async fn clock_jumps_main(a: ClockJumpsArgs) -> Result<ExitCode, FaultRunError> {
    let (seed, dir) = seed_dir(&a.common, "clock-jumps");
    let mut cfg = ClockJumpConfig::ci(
        &a.store,
        dir.join("run"),
        std::env::current_exe()?,
        seed,
        a.jumps,
    );
    cfg.load.workers = a.common.workers;
    let r = clock_jumps::run(cfg).await?;
    finish(
        &a.common,
        &dir,
        "clock_jumps",
        &r,
        r.summary(),
        [r.checked.violations(), r.regressions.clone()].concat(),
        r.ok(),
    )
}

/// Sums the `failed_io`, `power_loss` and `clock_jumps` lines of a report file (the other
/// kinds are summed by the binary's `summarize`).
pub fn summarize(text: &str) -> String {
    use std::collections::BTreeMap;
    let mut rows: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        let n = |p: &str| v.pointer(p).and_then(|x| x.as_u64()).unwrap_or(0);
        let len = |p: &str| {
            v.pointer(p)
                .and_then(|x| x.as_array())
                .map_or(0, |a| a.len() as u64)
        };
        let (row, faults): (String, Vec<(&str, u64)>) = match kind {
            "failed_io" => (
                if v.pointer("/report/config/power_loss_at_end")
                    == Some(&serde_json::Value::Bool(true))
                {
                    "failed I/O then power loss, embedded over http".into()
                } else {
                    "failed I/O, embedded over http".into()
                },
                vec![
                    ("phases", n("/report/faults/phases")),
                    ("injected", n("/report/faults/injected_total")),
                    ("fail_closed_seen", n("/report/faults/fail_closed_seen")),
                    ("fail_closed_logged", n("/report/faults/fail_closed_logged")),
                    ("reopens_logged", n("/report/faults/reopens_logged")),
                    (
                        "recovered_without_restart",
                        n("/report/faults/recovered_without_restart"),
                    ),
                    ("recovery_ms_max_sum", n("/report/faults/recovery_ms_max")),
                    (
                        "final_loss_bytes_poisoned",
                        n("/report/faults/final_power_loss/bytes_poisoned"),
                    ),
                ],
            ),
            "power_loss" => (
                "power loss, embedded over http".into(),
                vec![
                    ("power_losses", n("/report/faults/power_losses")),
                    (
                        "losses_that_dropped_data",
                        n("/report/faults/losses_that_dropped_data"),
                    ),
                    ("bytes_cut", n("/report/faults/dropped/bytes_cut")),
                    ("bytes_zeroed", n("/report/faults/dropped/bytes_zeroed")),
                    ("files_removed", n("/report/faults/dropped/files_removed")),
                    (
                        "renames_reverted",
                        n("/report/faults/dropped/renames_reverted"),
                    ),
                ],
            ),
            "clock_jumps" => {
                let store = v
                    .pointer("/report/config/store")
                    .and_then(|s| s.as_str())
                    .unwrap_or("?");
                let kind = store.split([':', '/']).next().unwrap_or(store);
                (
                    format!("clock jumps, {kind} over http"),
                    vec![
                        ("forward", n("/report/faults/forward")),
                        ("backward", n("/report/faults/backward")),
                        (
                            "returns_to_real_time",
                            n("/report/faults/returns_to_real_time"),
                        ),
                        ("seen_in_gate", n("/report/faults/seen_in_gate")),
                        ("held_decisions", n("/report/faults/held_decisions")),
                        ("clock_regressions", len("/report/regressions")),
                    ],
                )
            }
            _ => continue,
        };
        let e = rows.entry(row).or_default();
        *e.entry("runs".into()).or_default() += 1;
        for (k, x) in faults.into_iter().chain([
            ("events", n("/report/checked/oracle/events_checked")),
            ("answers", n("/report/checked/oracle/answers_read")),
            ("unknown", n("/report/checked/oracle/answers_unknown")),
            ("unavailable", n("/report/checked/unavailable_answers")),
            ("effects", n("/report/checked/oracle/effects_accepted")),
            ("duplicates", len("/report/checked/oracle/duplicates")),
            ("lost", len("/report/checked/oracle/lost")),
            (
                "fence_violations",
                len("/report/checked/oracle/fence_violations"),
            ),
            (
                "replay_mismatches",
                len("/report/checked/oracle/replay_mismatches"),
            ),
            ("lin_ops", n("/report/checked/lin_ops")),
            ("lin_violations", len("/report/checked/lin_violations")),
        ]) {
            *e.entry(k.into()).or_default() += x;
        }
    }
    let mut out = String::new();
    for (k, m) in rows {
        out.push_str(&format!("{k}:"));
        for (name, value) in m {
            out.push_str(&format!(" {name}={value}"));
        }
        out.push('\n');
    }
    out
}
