//! Clock jumps of the gate process (libfaketime), with the gate hammered over HTTP by worker
//! processes ([`crate::faultrun`]).
//!
//! The gate runs under `libfaketimeMT.so.1` with `FAKETIME_TIMESTAMP_FILE` and
//! `FAKETIME_NO_CACHE=1`, so every clock read of the gate consults the file the harness rewrites
//! to jump its wall clock; `FAKETIME_DONT_FAKE_MONOTONIC=1` leaves the monotonic clock (tokio's
//! timers) alone. The workers, the oracle and the store servers keep the real clock.
//!
//! - Over Redis and PostgreSQL every decision is taken on the store server's clock, so jumps of
//!   the gate's clock in both directions (seconds to days) must change nothing: no duplicate, no
//!   loss, and the answers stay linearizable on the real clock.
//! - The embedded store decides on the gate's own clock, floored at the highest instant it has
//!   used: jumps BACKWARD must leave that clock standing still (never going back), so fences keep
//!   increasing and nothing is decided twice. A forward jump on the embedded store legitimately
//!   ends leases and windows early (its clock is the gate's clock); that is documented in
//!   `docs/reliability.md`, not tested as a failure, and this run never jumps it forward past
//!   the real time.
//!
//! Besides I1-I5, every run checks that the store's clock, as the answers reveal it, never went
//! back: no operation was decided at an instant earlier than one an operation that had already
//! returned was decided at ([`clock_regressions`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Mark};
use rand::Rng;
use serde::Serialize;

use crate::faultrun::{Checked, FaultRun, FaultRunError, GateCmd, Load};
use crate::history::{Event, HAnswer};
use crate::lin::LinConfig;

/// Where Debian's libfaketime package installs the multithreaded library.
pub const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Shape of a clock-jump run.
#[derive(Clone, Debug, Serialize)]
pub struct ClockJumpConfig {
    /// STORE of the gate.
    pub store: String,
    /// Where every file of the run goes.
    pub run_dir: PathBuf,
    /// The `dedupgate-torture` binary.
    pub exe: PathBuf,
    /// Seed of every random choice.
    pub seed: u64,
    /// Jumps.
    pub jumps: u64,
    /// Jump forward too (Redis, PostgreSQL); else only back, and back to the real time.
    pub forward: bool,
    /// Time between jumps, ms (uniform).
    pub gap_ms: (u64, u64),
    /// The load.
    pub load: Load,
}

impl ClockJumpConfig {
    /// A CI-sized run; `forward` unless the store is embedded.
    pub fn ci(store: &str, run_dir: PathBuf, exe: PathBuf, seed: u64, jumps: u64) -> Self {
        Self {
            store: store.to_owned(),
            run_dir,
            exe,
            seed,
            jumps,
            forward: !is_embedded(store),
            gap_ms: (100, 400),
            load: Load::default(),
        }
    }
}

fn is_embedded(store: &str) -> bool {
    !(store.starts_with("redis")
        || store.starts_with("postgres")
        || store.starts_with("memory")
        || store.starts_with("tiered:"))
}

/// Jumps made, counted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClockJumpCounts {
    /// Jumps that moved the gate's clock forward.
    pub forward: u64,
    /// Jumps that moved it backward.
    pub backward: u64,
    /// Jumps from behind back to the real time (embedded: never past it).
    pub returns_to_real_time: u64,
    /// Largest jump, seconds.
    pub largest_s: u64,
    /// libfaketime was mapped into the gate process (`/proc/PID/maps`).
    pub faketime_loaded: bool,
    /// Times the harness saw the gate's clock off the real time by more than a second, in the
    /// `Date` header of its answers (forward jumps only: hyper keeps its cached date until the
    /// clock passes it again, so a step back does not show there).
    pub seen_in_gate: u64,
    /// Decisions the store took at an instant more than 50 ms before the call was sent: over
    /// the embedded store, the clock held at its high-water mark while the gate's clock was
    /// behind (proof the backward jumps reached the store, and that it did not follow them).
    pub held_decisions: u64,
    /// Decisions at an instant earlier than one already returned (must be 0).
    pub clock_regressions: u64,
}

/// A clock-jump run's report.
#[derive(Clone, Debug, Serialize)]
pub struct ClockJumpReport {
    /// The configuration.
    pub config: ClockJumpConfig,
    /// The gate program.
    pub gate: String,
    /// Jumps made.
    pub faults: ClockJumpCounts,
    /// Store-clock regressions, described.
    pub regressions: Vec<String>,
    /// What the oracles found.
    pub checked: Checked,
    /// Wall time, ms.
    pub elapsed_ms: u64,
}

impl ClockJumpReport {
    /// True when every check passed.
    pub fn ok(&self) -> bool {
        self.checked.ok() && self.regressions.is_empty()
    }

    /// One line of figures.
    pub fn summary(&self) -> String {
        let f = &self.faults;
        format!(
            "clock jumps over {} (seed {}, gate {}): {} forward, {} backward, {} back to the real time (largest {} s), libfaketime loaded {}, seen in the gate {} times, decisions on a held clock {}, store-clock regressions {} | {}",
            self.config.store,
            self.config.seed,
            self.gate,
            f.forward,
            f.backward,
            f.returns_to_real_time,
            f.largest_s,
            f.faketime_loaded,
            f.seen_in_gate,
            f.held_decisions,
            f.clock_regressions,
            self.checked.summary()
        )
    }
}

/// The store instant an answer reveals it was decided at, if any.
fn decided_at(e: &Event) -> Option<u64> {
    match (&e.op, &e.answer) {
        (
            crate::history::HOp::Claim { lease_ms, .. },
            HAnswer::Claimed {
                claim: Claim::New(l),
            },
        ) => Some(l.lease_expires_at_ms.saturating_sub(*lease_ms)),
        (_, HAnswer::Completed { record }) => record.completed_at_ms,
        (
            _,
            HAnswer::Marked {
                mark: Mark::New { record },
            },
        ) => Some(record.created_at_ms),
        _ => None,
    }
}

/// Operations decided at a store instant more than `slack_ms` earlier than the instant of an
/// operation that had returned before they were called: the store's clock went back.
pub fn clock_regressions(events: &[Event], slack_ms: u64) -> Vec<String> {
    let mut returned: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|e| Some((e.return_ns?, decided_at(e)?)))
        .collect();
    returned.sort();
    let mut calls: Vec<(&Event, u64)> = events
        .iter()
        .filter_map(|e| Some((e, decided_at(e)?)))
        .collect();
    calls.sort_by_key(|(e, _)| e.call_ns);
    let (mut i, mut high) = (0, 0u64);
    let mut out = vec![];
    for (e, t) in calls {
        while i < returned.len() && returned[i].0 < e.call_ns {
            high = high.max(returned[i].1);
            i += 1;
        }
        if t + slack_ms < high {
            out.push(format!(
                "{}/{} by {}: decided at {t} ms after an answer decided at {high} ms had returned",
                e.namespace, e.key, e.client
            ));
        }
    }
    out
}

/// Writes the gate's clock offset (seconds, relative to the real time).
fn set_offset(file: &Path, offset_s: i64) -> std::io::Result<()> {
    // Written aside and renamed, so the gate never reads half a line.
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, format!("{offset_s:+}\n"))?;
    std::fs::rename(&tmp, file)
}

/// A clock-jump run (see the module doc).
pub async fn run(cfg: ClockJumpConfig) -> Result<ClockJumpReport, FaultRunError> {
    let started = Instant::now();
    if !Path::new(FAKETIME_LIB).is_file() {
        return Err(FaultRunError::Tool(format!(
            "{FAKETIME_LIB} is missing (apt-get install faketime)"
        )));
    }
    std::fs::create_dir_all(&cfg.run_dir)?;
    let file = cfg.run_dir.join("faketime");
    set_offset(&file, 0)?;
    let mut gate = GateCmd::find(&cfg.exe, &cfg.store);
    gate.env = vec![
        ("LD_PRELOAD".into(), FAKETIME_LIB.into()),
        ("FAKETIME_TIMESTAMP_FILE".into(), file.display().to_string()),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ];
    let gate_name = gate.program.display().to_string();
    let mut run = FaultRun::start(
        cfg.run_dir.clone(),
        cfg.exe.clone(),
        gate,
        cfg.load.clone(),
        cfg.seed,
    )
    .await?;
    let mut counts = ClockJumpCounts {
        faketime_loaded: run
            .gate_pid()
            .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/maps")).ok())
            .is_some_and(|m| m.contains("libfaketime")),
        ..Default::default()
    };
    let mut offset: i64 = 0;
    for _ in 0..cfg.jumps {
        let gap = run.rng.gen_range(cfg.gap_ms.0..=cfg.gap_ms.1);
        run.sleep_tending(Duration::from_millis(gap)).await?;
        // Seconds to two days, log-uniform, so small and huge jumps both happen.
        let size = 10f64.powf(run.rng.gen_range(0.0..5.24)) as i64;
        let next = if cfg.forward {
            if run.rng.gen_bool(0.5) {
                offset + size
            } else {
                offset - size
            }
        } else if offset < 0 && run.rng.gen_bool(0.4) {
            0
        } else {
            offset - size
        };
        if next == offset {
            continue;
        }
        if next > offset && next == 0 && !cfg.forward {
            counts.returns_to_real_time += 1;
        } else if next > offset {
            counts.forward += 1;
        } else {
            counts.backward += 1;
        }
        counts.largest_s = counts.largest_s.max(next.abs_diff(offset));
        offset = next;
        set_offset(&file, offset)?;
        if offset.unsigned_abs() > 1 && gate_clock_is_off(&run) {
            counts.seen_in_gate += 1;
        }
    }
    if cfg.forward && counts.seen_in_gate == 0 {
        // The walk may never have stood ahead of the real time (where the `Date` header shows
        // a jump), or its probes timed out on a loaded machine: one more jump ahead, probed a
        // few times, so the report still says whether the gate's clock follows the file.
        let ahead = offset.max(0) + 3_600;
        counts.forward += 1;
        counts.largest_s = counts.largest_s.max(ahead.abs_diff(offset));
        offset = ahead;
        set_offset(&file, offset)?;
        for _ in 0..5 {
            if gate_clock_is_off(&run) {
                counts.seen_in_gate += 1;
                break;
            }
            run.sleep_tending(Duration::from_millis(500)).await?;
        }
    }
    set_offset(&file, 0)?;
    run.drain().await?;
    let slack = crate::runner::clock_slack_ms(&cfg.store);
    // Over the embedded store the floor holds the clock still after a step back, so the lease
    // instants lag the real time: the linearizability check's windows do not apply there.
    let lin = (!is_embedded(&cfg.store)).then_some(LinConfig {
        skew_ms: 1,
        steps_max: 200_000,
        monotonic_clock: true,
        clock_slack_ms: slack,
    });
    let run_dir = run.run_dir.clone();
    let checked = run.check(lin).await?;
    let events = crate::ledger::read_answer_logs(&run_dir)?;
    let regressions = clock_regressions(&events, slack);
    counts.held_decisions = events
        .iter()
        .filter(|e| decided_at(e).is_some_and(|t| t + 50 < e.call_ns / 1_000_000))
        .count() as u64;
    counts.clock_regressions = regressions.len() as u64;
    Ok(ClockJumpReport {
        config: cfg,
        gate: gate_name,
        faults: counts,
        regressions,
        checked,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

/// Whether the gate's process shows the jumped clock: the `Date` header of its health answer
/// against the real time.
fn gate_clock_is_off(run: &FaultRun) -> bool {
    let Some(addr) = run.listen_addr() else {
        return false;
    };
    let Some(date) = http_date(&addr) else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    date.abs_diff(now) > 1
}

/// The `Date` header of `GET /healthz`, as unix seconds.
fn http_date(addr: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let line = buf
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("date:"))?;
    parse_http_date(line[5..].trim())
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn parse_http_date(s: &str) -> Option<u64> {
    let parts: Vec<&str> = s.split_whitespace().collect();
    if parts.len() != 6 {
        return None;
    }
    let day: u64 = parts[1].parse().ok()?;
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| *m == parts[2])? as u64
        + 1;
    let year: i64 = parts[3].parse().ok()?;
    let hms: Vec<u64> = parts[4].split(':').filter_map(|x| x.parse().ok()).collect();
    if hms.len() != 3 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y.div_euclid(400);
    let yoe = (y - era * 400) as u64;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe as i64 - 719_468;
    Some(days as u64 * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::HOp;

    #[test]
    fn http_dates_parse() {
        assert_eq!(
            parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(784_111_777)
        );
    }

    fn mark(client: &str, call: u64, ret: u64, at: u64) -> Event {
        let record: dedupgate_core::Record = serde_json::from_value(serde_json::json!({
            "namespace": "ns", "key": client, "state": "completed", "fence": 1,
            "created_at_ms": at, "expires_at_ms": at + 1000, "completed_at_ms": at
        }))
        .unwrap();
        Event {
            client: client.into(),
            namespace: "ns".into(),
            key: client.into(),
            op: HOp::Mark {
                ttl_ms: 1000,
                fingerprint: None,
                result: None,
            },
            call_ns: call,
            return_ns: Some(ret),
            answer: HAnswer::Marked {
                mark: Mark::New { record },
            },
        }
    }

    #[test]
    fn a_store_clock_that_goes_back_is_caught() {
        let fine = vec![mark("a", 0, 10, 100), mark("b", 20, 30, 100)];
        assert!(clock_regressions(&fine, 0).is_empty());
        let back = vec![mark("a", 0, 10, 100), mark("b", 20, 30, 40)];
        assert_eq!(clock_regressions(&back, 0).len(), 1);
        // Overlapping calls may be decided in either order.
        let overlap = vec![mark("a", 0, 30, 100), mark("b", 20, 40, 40)];
        assert!(clock_regressions(&overlap, 0).is_empty());
    }
}
