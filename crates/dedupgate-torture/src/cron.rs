//! The `dedupgate run` face (the cron gate) as a torture workload: a worker delivers each event
//! by running `dedupgate run --key K --store S -- dedupgate-torture effect …`, whose CMD performs
//! the effect through the fence-checking [`Sink`] with the `DEDUPGATE_FENCE` that `run` passes
//! it. The worker never sees the gate's answers, only what the process tells a cron daemon:
//! its exit code and its stderr. So it logs each invocation (`cron-<worker>.jsonl`: a `start`
//! line before the spawn, the child's pid, a `killed` line when it SIGKILLs `dedupgate run` at a
//! random moment, an `end` line with the exit code) and [`check`] judges I1-I5 from that log,
//! the effect ledger and the final reads:
//!
//! - exit 0: CMD ran and its completion (retriable) or mark (idempotent) is acknowledged;
//! - exit 3 (`--skip-exit-code 3`): skipped as a duplicate; stderr names who ran it;
//! - exit 1: CMD failed (the sink refused its write as late), the key was released;
//! - exit 125, a SIGKILL or a timeout: unknown.
//!
//! A grant's store instant is read from its fence (`fence / FENCE_PER_MS`, see
//! [`dedupgate_core::decide`]): a second effect whose fence says it was granted before the first
//! claim's lease could have ended is a duplicate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use dedupgate_core::decide::FENCE_PER_MS;
use dedupgate_core::State;
use rand::rngs::StdRng;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::delivery::{Delivery, DeliveryMode};
use crate::history::{wall_ns, Event, HAnswer, HOp};
use crate::ledger::{Effect, JsonlLog, Sink};
use crate::oracle::{effect_pairs, OracleReport};

/// Exit code `dedupgate run` is told to use for a skipped (duplicate) run.
pub const SKIP_EXIT: i32 = 3;

/// How a worker runs `dedupgate run` (part of its plan).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CronPlan {
    /// The `dedupgate` binary.
    pub dedupgate_exe: PathBuf,
    /// The `dedupgate-torture` binary (CMD is its `effect` subcommand).
    pub torture_exe: PathBuf,
    /// `--store` of `dedupgate run`.
    pub store: String,
    /// Percent of invocations the worker SIGKILLs at a random moment (the gate's kill: `run`
    /// is the gate here).
    pub kill_pct: u32,
    /// Longest wait before such a kill, ms.
    pub kill_after_ms_max: u64,
    /// Longest sleep of CMD after its effect (where a kill lands between effect and completion).
    pub gap_ms_max: u64,
}

/// One line of a cron log.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum CronLine {
    /// About to spawn `dedupgate run`.
    Start {
        /// Attempt id (CMD writes it into the ledger and prints it).
        attempt: String,
        /// The delivery.
        delivery: Delivery,
        /// Wall-clock ns.
        at_ns: u64,
    },
    /// Spawned, with this pid.
    Spawned {
        /// Attempt id.
        attempt: String,
        /// Its pid (the owner `run` records is `host:pid/nonce`).
        pid: u32,
    },
    /// The worker SIGKILLed it.
    Killed {
        /// Attempt id.
        attempt: String,
    },
    /// It ended.
    End {
        /// Attempt id.
        attempt: String,
        /// Its exit code, None when a signal ended it.
        code: Option<i32>,
        /// The end of its stderr.
        stderr: String,
        /// Wall-clock ns.
        at_ns: u64,
    },
}

/// A cron log, appended one line per `write(2)`, like the answer logs.
#[derive(Debug)]
pub struct CronLog {
    file: JsonlLog,
}

impl CronLog {
    /// Creates `cron-<worker>.jsonl` in `run_dir`.
    pub fn create(run_dir: &Path, worker: &str) -> io::Result<Self> {
        Ok(Self {
            file: JsonlLog::create(run_dir, "cron", worker)?,
        })
    }

    fn line(&mut self, l: &CronLine) -> io::Result<()> {
        self.file.line(l)
    }
}

/// What one invocation came to, for the worker (busy means: try again later).
pub struct CronOutcome {
    /// The event is in progress elsewhere.
    pub busy: bool,
}

/// Runs one delivery through `dedupgate run`.
#[allow(clippy::too_many_arguments)]
pub async fn deliver(
    plan: &CronPlan,
    log: &mut CronLog,
    rng: &mut StdRng,
    run_dir: &Path,
    worker: &str,
    attempt: &str,
    d: &Delivery,
    lease_ms: u64,
    timeout_ms: u64,
) -> io::Result<CronOutcome> {
    log.line(&CronLine::Start {
        attempt: attempt.to_owned(),
        delivery: d.clone(),
        at_ns: wall_ns(),
    })?;
    let mode = match d.mode {
        DeliveryMode::Retriable => "retriable",
        DeliveryMode::Idempotent => "idempotent",
    };
    let mut cmd = tokio::process::Command::new(&plan.dedupgate_exe);
    cmd.args(["run", "--store", &plan.store, "--namespace", &d.namespace])
        .args(["--key", &d.key, "--mode", mode, "--ttl", "1h"])
        .arg("--lease")
        .arg(format!("{lease_ms}ms"))
        .args(["--skip-exit-code", &SKIP_EXIT.to_string(), "--"])
        .arg(&plan.torture_exe)
        .arg("effect")
        .arg("--dir")
        .arg(run_dir)
        .args(["--attempt", attempt, "--worker", worker])
        .arg("--lease-ms")
        .arg(lease_ms.to_string())
        .arg("--gap-ms-max")
        .arg(plan.gap_ms_max.to_string());
    if d.mode == DeliveryMode::Idempotent {
        cmd.arg("--idempotent");
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn()?;
    log.line(&CronLine::Spawned {
        attempt: attempt.to_owned(),
        pid: child.id().unwrap_or(0),
    })?;
    let mut stderr = child.stderr.take();
    let read_err = async move {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = tokio::io::AsyncReadExt::read_to_end(s, &mut buf).await;
        }
        buf
    };
    let kill_at = (rng.gen_range(0..100) < plan.kill_pct)
        .then(|| Duration::from_millis(rng.gen_range(0..=plan.kill_after_ms_max)));
    let err_task = tokio::spawn(read_err);
    let status = match kill_at {
        Some(after) => {
            tokio::select! {
                s = child.wait() => Some(s?),
                _ = tokio::time::sleep(after) => None,
            }
        }
        None => match tokio::time::timeout(Duration::from_millis(timeout_ms), child.wait()).await {
            Ok(s) => Some(s?),
            Err(_) => None,
        },
    };
    let status = match status {
        Some(s) => s,
        None => {
            // SIGKILL: `run` dies at once; CMD, if it started, is orphaned and goes on.
            let _ = child.start_kill();
            if kill_at.is_some() {
                log.line(&CronLine::Killed {
                    attempt: attempt.to_owned(),
                })?;
            }
            child.wait().await?
        }
    };
    let stderr = tokio::time::timeout(Duration::from_secs(2), err_task)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let stderr = String::from_utf8_lossy(&stderr);
    let tail: String = {
        let s = stderr.trim();
        let cut = s.len().saturating_sub(600);
        s[s.floor_char_boundary_compat(cut)..].to_owned()
    };
    let code = status.code();
    log.line(&CronLine::End {
        attempt: attempt.to_owned(),
        code,
        stderr: tail.clone(),
        at_ns: wall_ns(),
    })?;
    Ok(CronOutcome {
        busy: code == Some(SKIP_EXIT) && tail.contains("is running now"),
    })
}

trait FloorBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorBoundary for str {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        while i > 0 && !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// The CMD of a cron delivery (`dedupgate-torture effect`): performs the effect through the
/// sink with the fence `dedupgate run` passed in `DEDUPGATE_FENCE`, prints the attempt (it
/// becomes the stored result's `stdout_tail`), sleeps a little (a kill of `run` lands between
/// effect and completion) and exits 0, or 1 when the sink refused the write as late.
pub fn effect_main(
    dir: &Path,
    attempt: &str,
    worker: &str,
    lease_ms: u64,
    gap_ms_max: u64,
    idempotent: bool,
) -> io::Result<i32> {
    let var = |k: &str| {
        std::env::var(k).map_err(|_| io::Error::other(format!("{k} is not set by dedupgate run")))
    };
    let ns = var("DEDUPGATE_NAMESPACE")?;
    let key = var("DEDUPGATE_KEY")?;
    let fence: u64 = var("DEDUPGATE_FENCE")?
        .parse()
        .map_err(|_| io::Error::other("DEDUPGATE_FENCE is not a number"))?;
    let lease_end = (!idempotent).then(|| fence / FENCE_PER_MS + lease_ms);
    let sink = Sink::open(dir)?;
    let accepted = sink.write(&ns, &key, fence, attempt, worker, lease_end)?;
    println!(
        "{}",
        serde_json::json!({"attempt": attempt, "fence": fence, "accepted": accepted})
    );
    if gap_ms_max > 0 {
        std::thread::sleep(Duration::from_millis(
            rand::thread_rng().gen_range(0..=gap_ms_max),
        ));
    }
    Ok(if accepted { 0 } else { 1 })
}

/// Every line of every cron log of a run.
pub fn read_cron_logs(run_dir: &Path) -> io::Result<Vec<CronLine>> {
    let mut out = Vec::new();
    let names = JsonlLog::list(run_dir, "cron")?;
    for p in names {
        let text = std::fs::read_to_string(&p)?;
        // A torn last line (the worker was killed inside its write) is skipped.
        out.extend(text.lines().filter_map(|l| serde_json::from_str(l).ok()));
    }
    Ok(out)
}

#[derive(Debug, Default)]
struct Inv {
    delivery: Option<Delivery>,
    pid: Option<u32>,
    killed: bool,
    code: Option<i32>,
    ended: bool,
    stderr: String,
}

impl Inv {
    fn acked(&self) -> bool {
        self.ended && self.code == Some(0)
    }
}

/// What a cron run adds to the fault counts: invocations, and those SIGKILLed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CronCounts {
    /// `dedupgate run` processes started.
    pub invocations: u64,
    /// Of which SIGKILLed by their worker.
    pub run_sigkills: u64,
    /// Exited 0 (ran, acknowledged).
    pub ran: u64,
    /// Exited 3 (skipped as a duplicate).
    pub skipped: u64,
    /// Exited 125 (the gate failed: unknown).
    pub gate_failed: u64,
    /// Exited 1 (CMD failed: its late write was refused by the sink).
    pub cmd_failed: u64,
    /// Unknown: killed (by the worker or with it), or never ended.
    pub unknown: u64,
    /// Exit codes no invocation may have.
    pub wrong_exits: Vec<String>,
}

/// Checks I1-I5 for a cron run: `lines` every cron log, `events` the final reads (a `Get` of
/// every event through the library, after the drain), `lease_ms` the lease every run asked for.
pub fn check(
    effects: &[Effect],
    lines: &[CronLine],
    events: &[Event],
    deliveries: &BTreeSet<Delivery>,
    lease_ms: u64,
) -> (OracleReport, CronCounts) {
    let mut invs: BTreeMap<String, Inv> = BTreeMap::new();
    for l in lines {
        match l {
            CronLine::Start {
                attempt, delivery, ..
            } => invs.entry(attempt.clone()).or_default().delivery = Some(delivery.clone()),
            CronLine::Spawned { attempt, pid } => {
                invs.entry(attempt.clone()).or_default().pid = Some(*pid)
            }
            CronLine::Killed { attempt } => invs.entry(attempt.clone()).or_default().killed = true,
            CronLine::End {
                attempt,
                code,
                stderr,
                ..
            } => {
                let i = invs.entry(attempt.clone()).or_default();
                i.ended = true;
                i.code = *code;
                i.stderr = stderr.clone();
            }
        }
    }
    let mut c = CronCounts::default();
    let mut r = OracleReport::default();
    type Id = (String, String);
    let mut by_key: HashMap<Id, Vec<(&String, &Inv)>> = HashMap::new();
    for (att, i) in &invs {
        let Some(d) = &i.delivery else { continue };
        c.invocations += 1;
        r.answers_read += 1;
        if i.killed {
            c.run_sigkills += 1;
        }
        match (i.ended, i.code) {
            (true, Some(0)) => c.ran += 1,
            (true, Some(SKIP_EXIT)) => c.skipped += 1,
            (true, Some(125)) => c.gate_failed += 1,
            (true, Some(1)) => c.cmd_failed += 1,
            (true, None) | (false, _) => c.unknown += 1,
            (true, Some(other)) => c.wrong_exits.push(format!(
                "{}/{} {att}: exit {other}: {}",
                d.namespace, d.key, i.stderr
            )),
        }
        if !(i.ended && matches!(i.code, Some(0) | Some(SKIP_EXIT) | Some(1))) {
            r.answers_unknown += 1;
        }
        if i.stderr.contains("lease lost")
            || i.stderr.contains("could not be released")
            || i.stderr.contains("completion was not recorded")
        {
            r.stale_completions_refused += 1;
        }
        by_key
            .entry((d.namespace.clone(), d.key.clone()))
            .or_default()
            .push((att, i));
    }
    let mode: HashMap<Id, DeliveryMode> = deliveries
        .iter()
        .map(|d| ((d.namespace.clone(), d.key.clone()), d.mode))
        .collect();
    r.events_checked = mode.len() as u64;

    // I1 from the ledger.
    let fx_by_key = effect_pairs(
        effects,
        &mode,
        &mut r,
        |f| invs.get(&f.attempt).is_some_and(|i| i.ended),
        |a, b| {
            let a_grant = a.fence / FENCE_PER_MS;
            let b_grant = b.fence / FENCE_PER_MS;
            if invs.get(&a.attempt).is_some_and(Inv::acked) {
                Some(format!(
                    "effect by {} after {}'s run was acknowledged (exit 0)",
                    b.attempt, a.attempt
                ))
            } else if b_grant + 1 < a_grant + lease_ms {
                Some(format!(
                    "{} was granted at {b_grant} ms inside {}'s lease (granted {a_grant} ms, lease {lease_ms} ms)",
                    b.attempt, a.attempt
                ))
            } else {
                None
            }
        },
    );

    // Final reads: the last known Get of each key.
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by_key(|e| e.call_ns);
    let mut final_read: HashMap<Id, &Event> = HashMap::new();
    for e in sorted {
        if matches!(e.op, HOp::Get) && !e.answer.is_unknown() {
            final_read.insert(e.key_id(), e);
        }
    }
    for (id, m) in &mode {
        let label = format!("{}/{}", id.0, id.1);
        let runs = by_key.get(id).cloned().unwrap_or_default();
        let acked: Vec<&(&String, &Inv)> = runs.iter().filter(|(_, i)| i.acked()).collect();
        if acked.len() > 1 {
            // Two runs that both ran CMD and had it acknowledged: two holders completed.
            r.fence_violations.push(format!(
                "{label}: {} runs acknowledged ({:?})",
                acked.len(),
                acked.iter().map(|(a, _)| a).collect::<Vec<_>>()
            ));
        }
        let record = match final_read.get(id).map(|e| &e.answer) {
            Some(HAnswer::Found { record }) => record.clone(),
            _ => {
                r.lost.push(format!("{label}: no final read"));
                continue;
            }
        };
        let Some(rec) = record else {
            if !acked.is_empty() || *m == DeliveryMode::Retriable {
                r.lost.push(format!(
                    "{label}: no record at the end (acknowledged runs {:?})",
                    acked.iter().map(|(a, _)| a).collect::<Vec<_>>()
                ));
            }
            continue;
        };
        let owner = rec
            .result
            .as_ref()
            .and_then(|v| v.get("owner"))
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_owned();
        // `host:pid/nonce` (older runs wrote `host:pid`).
        let owner_pid: Option<u32> = owner
            .rsplit_once(':')
            .and_then(|(_, p)| p.split('/').next()?.parse().ok());
        if *m == DeliveryMode::Retriable {
            if rec.state != State::Completed {
                r.lost
                    .push(format!("{label}: still in progress after the drain"));
            }
            if !fx_by_key.contains_key(id) {
                r.lost.push(format!("{label}: completed but no effect ran"));
            }
            let tail = rec
                .result
                .as_ref()
                .and_then(|v| v.get("stdout_tail"))
                .and_then(|v| v.as_str())
                .unwrap_or("");
            if let Some((att, _)) = acked.first() {
                if !tail.contains(&format!("\"attempt\":\"{att}\"")) {
                    r.lost.push(format!(
                        "{label}: {att}'s run was acknowledged, the stored result is {tail:?}"
                    ));
                }
            }
        } else if let Some((att, i)) = acked.first() {
            if i.pid != owner_pid {
                r.lost.push(format!(
                    "{label}: {att} (pid {:?}) ran, the stored mark is {owner:?}'s",
                    i.pid
                ));
            }
        }
        // I5: a skip that names who ran it names the stored owner.
        for (att, i) in &runs {
            if i.code != Some(SKIP_EXIT) || !i.stderr.contains("already ran") {
                continue;
            }
            let named = i.stderr.contains(&format!(" by {owner},"))
                || i.stderr.contains(&format!(" by {owner})"));
            if !owner.is_empty() && !named {
                r.replay_mismatches.push(format!(
                    "{label}: {att} was told {:?}, the stored owner is {owner:?}",
                    i.stderr
                ));
            }
        }
    }
    (r, c)
}

/// Spawns the `effect` CMD path check: the `dedupgate` binary next to `torture_exe`
/// (`target/<profile>/dedupgate`), which `cargo test --workspace` builds.
pub fn dedupgate_exe_near(torture_exe: &Path) -> Option<PathBuf> {
    let mut dir = torture_exe.parent();
    while let Some(d) = dir {
        let c = d.join("dedupgate");
        if c.is_file() {
            return Some(c);
        }
        dir = d.parent();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::{Key, Namespace, Record};
    use serde_json::json;

    const NS: &str = "ns";

    fn delivery(mode: DeliveryMode) -> Delivery {
        Delivery {
            mode,
            namespace: NS.into(),
            key: "k".into(),
        }
    }

    fn run(
        attempt: &str,
        mode: DeliveryMode,
        pid: u32,
        code: Option<i32>,
        stderr: &str,
    ) -> Vec<CronLine> {
        vec![
            CronLine::Start {
                attempt: attempt.into(),
                delivery: delivery(mode),
                at_ns: 0,
            },
            CronLine::Spawned {
                attempt: attempt.into(),
                pid,
            },
            CronLine::End {
                attempt: attempt.into(),
                code,
                stderr: stderr.into(),
                at_ns: 1,
            },
        ]
    }

    fn effect(attempt: &str, fence: u64) -> Effect {
        Effect {
            namespace: NS.into(),
            key: "k".into(),
            fence,
            attempt: attempt.into(),
            worker: "w".into(),
            effect_ns: fence,
            lease_expires_at_ms: None,
            accepted: true,
            fence_before: 0,
        }
    }

    fn final_read(owner: &str, tail: &str) -> Vec<Event> {
        let record = Record {
            namespace: Namespace::new(NS).unwrap(),
            key: Key::new("k").unwrap(),
            state: State::Completed,
            fence: 1,
            fingerprint: None,
            owner: Some(owner.into()),
            created_at_ms: 0,
            expires_at_ms: 100_000,
            lease_expires_at_ms: None,
            completed_at_ms: Some(1),
            result: Some(json!({"owner": owner, "stdout_tail": tail})),
        };
        vec![Event {
            client: "drain".into(),
            namespace: NS.into(),
            key: "k".into(),
            op: HOp::Get,
            call_ns: 10,
            return_ns: Some(11),
            answer: HAnswer::Found {
                record: Some(record),
            },
        }]
    }

    fn check1(
        effects: &[Effect],
        lines: Vec<CronLine>,
        events: &[Event],
        mode: DeliveryMode,
    ) -> OracleReport {
        check(effects, &lines, events, &[delivery(mode)].into(), 300).0
    }

    /// `a` started and was killed (no end line) after its effect at fence 1_000_000; `b` then ran
    /// to exit 0 with its effect at `b_fence` and is the stored run.
    fn killed_a_then_b_ran(b_fence: u64) -> OracleReport {
        let mut lines = run("b", DeliveryMode::Retriable, 2, Some(0), "");
        lines.insert(
            0,
            CronLine::Start {
                attempt: "a".into(),
                delivery: delivery(DeliveryMode::Retriable),
                at_ns: 0,
            },
        );
        let fx = [effect("a", 1_000_000), effect("b", b_fence)];
        check1(
            &fx,
            lines,
            &final_read("h:2/5f1e", "{\"attempt\":\"b\"}"),
            DeliveryMode::Retriable,
        )
    }

    #[test]
    fn a_takeover_after_the_lease_is_a_re_execution() {
        // a was killed (no end line) after its effect; b claimed 400 ms later and ran.
        let r = killed_a_then_b_ran(1_400_000);
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.reexecutions, 1);
    }

    #[test]
    fn a_takeover_inside_the_lease_or_after_an_acknowledged_run_is_a_duplicate() {
        let r = killed_a_then_b_ran(1_100_000);
        assert_eq!(r.duplicates.len(), 1, "{r:?}");

        let mut lines = run("a", DeliveryMode::Retriable, 1, Some(0), "");
        lines.extend(run("b", DeliveryMode::Retriable, 2, None, ""));
        let fx = [effect("a", 1_000_000), effect("b", 9_000_000)];
        let r = check1(
            &fx,
            lines,
            &final_read("h:1", "{\"attempt\":\"a\"}"),
            DeliveryMode::Retriable,
        );
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
    }

    #[test]
    fn an_acknowledged_run_must_be_the_stored_one_and_skips_must_name_it() {
        let mut lines = run("a", DeliveryMode::Retriable, 1, Some(0), "");
        lines.extend(run(
            "c",
            DeliveryMode::Retriable,
            3,
            Some(SKIP_EXIT),
            "dedupgate run: skipped: \"k\" already ran (completed 2026 by h:9, exit 0); kept",
        ));
        let fx = [effect("a", 1_000_000)];
        let r = check1(
            &fx,
            lines,
            &final_read("h:1", "{\"attempt\":\"x\"}"),
            DeliveryMode::Retriable,
        );
        assert_eq!(r.lost.len(), 1, "{r:?}");
        assert_eq!(r.replay_mismatches.len(), 1, "{r:?}");
    }

    #[test]
    fn two_effects_in_the_idempotent_ordering_are_duplicates() {
        let mut lines = run("a", DeliveryMode::Idempotent, 1, Some(0), "");
        lines.extend(run("b", DeliveryMode::Idempotent, 2, Some(0), ""));
        let fx = [effect("a", 1_000_000), effect("b", 9_000_000)];
        let r = check1(&fx, lines, &final_read("h:1", ""), DeliveryMode::Idempotent);
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
        assert_eq!(r.fence_violations.len(), 1, "{r:?}");
    }
}
