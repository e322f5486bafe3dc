//! The common frame of the storage-fault and clock-jump runs ([`crate::storage_faults`],
//! [`crate::clock_jumps`]): a gate process of the run's own (with whatever environment the fault
//! needs: an LD_PRELOAD injector, libfaketime) serving the HTTP API, worker processes hammering
//! it, and at the end a drain, final reads and the oracles ([`crate::oracle`], [`crate::lin`]).
//! The fault itself is driven by the caller between [`FaultRun::start`] and
//! [`FaultRun::drain`]; [`FaultRun::check`] reads everything back and runs the oracles.
//!
//! Workers here are never SIGKILLed or paused: each of these runs isolates one fault kind, so a
//! finding points at it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::Store;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::delivery::{Delivery, DeliveryMode};
use crate::faces::{HttpStore, HttpStoreOptions};
use crate::history::{Event, HAnswer};
use crate::ledger::{read_answer_logs, read_ledger};
use crate::lin::{self, LinConfig};
use crate::oracle::{self, OracleReport};
use crate::worker::{Worker, WorkerPlan};

/// Why a fault run could not be carried out (findings are in [`Checked`], not here).
#[derive(Debug, thiserror::Error)]
pub enum FaultRunError {
    /// A file or process operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The gate process did not come up.
    #[error("the gate did not answer at {url} within {secs} s; its log ends with:\n{log_tail}")]
    GateDown {
        /// Its URL.
        url: String,
        /// How long the harness waited.
        secs: u64,
        /// The end of its log.
        log_tail: String,
    },
    /// A tool the fault needs is missing or failed.
    #[error("{0}")]
    Tool(String),
}

/// How to start the gate process.
#[derive(Clone, Debug, Serialize)]
pub struct GateCmd {
    /// The program: `dedupgate` (runs `serve`) or `dedupgate-torture` (runs `gate`).
    pub program: PathBuf,
    /// STORE it serves.
    pub store: String,
    /// Extra environment (LD_PRELOAD and the injector's settings).
    pub env: Vec<(String, String)>,
}

impl GateCmd {
    /// The shipped `dedupgate serve` when `DEDUPGATE_BIN` names the `dedupgate` binary (the
    /// soak script sets it to a fresh build), else this harness's own `gate` subcommand: the same
    /// `dedupgate-server` over the same store opening, always built from the tree under test,
    /// without the CLI's logging (so the fail-closed lines of its log are not counted then).
    pub fn find(torture_exe: &Path, store: &str) -> Self {
        let program = std::env::var_os("DEDUPGATE_BIN")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .unwrap_or_else(|| torture_exe.to_owned());
        Self {
            program,
            store: store.to_owned(),
            env: vec![],
        }
    }

    fn is_dedupgate(&self) -> bool {
        self.program.file_name().and_then(|n| n.to_str()) == Some("dedupgate")
    }
}

/// Shape of the load.
#[derive(Clone, Debug, Serialize)]
pub struct Load {
    /// Worker processes at a time.
    pub workers: usize,
    /// Lease of every claim, ms.
    pub lease_ms: u64,
    /// Unique events per worker process (each delivered to two processes).
    pub unique_per_spawn: usize,
    /// Hot keys shared by every worker.
    pub hot_keys: usize,
    /// Hot-key deliveries per worker process.
    pub hot_per_spawn: usize,
    /// Tries per call on unknown answers.
    pub tries_max: u32,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            workers: 3,
            lease_ms: 300,
            unique_per_spawn: 12,
            hot_keys: 3,
            hot_per_spawn: 6,
            tries_max: 3,
        }
    }
}

/// What the oracles found at the end of a fault run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Checked {
    /// The effect oracle (I1-I5).
    pub oracle: OracleReport,
    /// Operations checked for linearizability (0 when the check does not apply).
    pub lin_ops: usize,
    /// Keys checked for linearizability.
    pub lin_keys: usize,
    /// Linearizability violations, described.
    pub lin_violations: Vec<String>,
    /// Keys the linearizability search gave up on.
    pub lin_inconclusive: usize,
    /// Keys that pass only thanks to the configured clock slack (they fail with none).
    pub lin_clock_slack_keys: usize,
    /// Answers that were "unavailable" from the store (the gate failed closed), from the logs.
    pub unavailable_answers: u64,
    /// Worker processes started.
    pub worker_spawns: u64,
    /// Gate processes started (the first, and each restart).
    pub gate_starts: u64,
}

impl Checked {
    /// True when no invariant broke.
    pub fn ok(&self) -> bool {
        self.oracle.ok() && self.lin_violations.is_empty()
    }

    /// Every violation, one line each.
    pub fn violations(&self) -> Vec<String> {
        let o = &self.oracle;
        o.duplicates
            .iter()
            .chain(&o.lost)
            .chain(&o.fence_violations)
            .chain(&o.replay_mismatches)
            .chain(&self.lin_violations)
            .cloned()
            .collect()
    }

    /// The figures every fault run prints.
    pub fn summary(&self) -> String {
        let o = &self.oracle;
        format!(
            "events {}, answers {} ({} unknown, {} unavailable), effects {} (re-executions {}) | duplicates {}, lost {}, fence violations {}, replay mismatches {} | linearizability: {} keys, {} ops, {} violations, {} inconclusive, {} keys needing the clock slack",
            o.events_checked,
            o.answers_read,
            o.answers_unknown,
            self.unavailable_answers,
            o.effects_accepted,
            o.reexecutions,
            o.duplicates.len(),
            o.lost.len(),
            o.fence_violations.len(),
            o.replay_mismatches.len(),
            self.lin_keys,
            self.lin_ops,
            self.lin_violations.len(),
            self.lin_inconclusive,
            self.lin_clock_slack_keys,
        )
    }
}

/// A running fault run: the gate, the workers, every delivery handed out.
pub struct FaultRun {
    /// Where every file of the run goes.
    pub run_dir: PathBuf,
    gate_cmd: GateCmd,
    exe: PathBuf,
    load: Load,
    run_tag: String,
    listen: String,
    gate: Option<Child>,
    gate_n: u64,
    slots: Vec<Child>,
    /// False once the faults have stopped: finished workers are not replaced any more.
    tending: bool,
    spawn: u64,
    all: BTreeSet<Delivery>,
    /// The run's random choices (the caller's faults draw from it too).
    pub rng: StdRng,
    http: Arc<dyn Store>,
}

impl std::fmt::Debug for FaultRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultRun")
            .field("run_dir", &self.run_dir)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The last `n` lines of a file (for error messages).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl FaultRun {
    /// Starts the gate (`gate_cmd`, with `env` added on top of its own for this first start) and
    /// the first workers.
    pub async fn start(
        run_dir: PathBuf,
        exe: PathBuf,
        gate_cmd: GateCmd,
        load: Load,
        seed: u64,
    ) -> Result<Self, FaultRunError> {
        std::fs::create_dir_all(&run_dir)?;
        if std::fs::read_dir(&run_dir)?
            .any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("answers-")))
        {
            return Err(FaultRunError::Tool(format!(
                "{} holds another run's logs; give a fresh directory",
                run_dir.display()
            )));
        }
        let listen = format!("127.0.0.1:{}", free_port()?);
        let http: Arc<dyn Store> = Arc::new(
            HttpStore::new(
                &format!("http://{listen}"),
                HttpStoreOptions::without_retries(),
            )
            .map_err(|e| FaultRunError::Tool(e.to_string()))?,
        );
        let mut run = Self {
            run_dir,
            gate_cmd,
            exe,
            load,
            run_tag: format!(
                "{:x}.{:x}",
                seed,
                (crate::history::wall_ns() / 1_000_000) ^ u64::from(std::process::id())
            ),
            listen,
            gate: None,
            gate_n: 0,
            slots: vec![],
            tending: true,
            spawn: 0,
            all: BTreeSet::new(),
            rng: StdRng::seed_from_u64(seed),
            http,
        };
        run.start_gate(&[]).await?;
        for _ in 0..run.load.workers {
            let c = run.spawn_worker()?;
            run.slots.push(c);
        }
        Ok(run)
    }

    /// The gate's address (`HOST:PORT`).
    pub fn listen_addr(&self) -> Option<String> {
        Some(self.listen.clone())
    }

    /// The gate's process id (for fiu-ctrl).
    pub fn gate_pid(&self) -> Option<u32> {
        self.gate.as_ref().map(|g| g.id())
    }

    /// The log file of gate start `n`.
    pub fn gate_log(&self, n: u64) -> PathBuf {
        self.run_dir.join(format!("gate-{n}.log"))
    }

    /// Gate processes started so far.
    pub fn gate_starts(&self) -> u64 {
        self.gate_n
    }

    /// Starts the gate with `extra_env` on top of [`GateCmd::env`] and waits until it answers
    /// its health check.
    pub async fn start_gate(
        &mut self,
        extra_env: &[(String, String)],
    ) -> Result<(), FaultRunError> {
        let log = std::fs::File::create(self.gate_log(self.gate_n))?;
        let mut cmd = Command::new(&self.gate_cmd.program);
        if self.gate_cmd.is_dedupgate() {
            cmd.args([
                "serve",
                "--store",
                &self.gate_cmd.store,
                "--listen",
                &self.listen,
            ]);
        } else {
            cmd.args([
                "gate",
                "--store",
                &self.gate_cmd.store,
                "--listen",
                &self.listen,
            ]);
        }
        cmd.env("RUST_LOG", "info,fjall=warn,lsm_tree=warn")
            .envs(self.gate_cmd.env.iter().cloned())
            .envs(extra_env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.gate = Some(cmd.spawn()?);
        self.gate_n += 1;
        self.wait_healthy(Duration::from_secs(30)).await
    }

    /// Waits until the gate answers its health check "ok" (its store is available).
    pub async fn wait_healthy(&mut self, within: Duration) -> Result<(), FaultRunError> {
        let deadline = Instant::now() + within;
        loop {
            if self.http.health().await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(FaultRunError::GateDown {
                    url: format!("http://{}", self.listen),
                    secs: within.as_secs(),
                    log_tail: tail(&self.gate_log(self.gate_n.saturating_sub(1)), 15),
                });
            }
            self.tend()?;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// True when the gate answers its health check "ok" right now.
    pub async fn healthy(&self) -> bool {
        self.http.health().await.is_ok()
    }

    /// SIGKILLs the gate and waits for it to be gone.
    pub fn kill_gate(&mut self) -> std::io::Result<()> {
        if let Some(mut g) = self.gate.take() {
            g.kill()?;
            g.wait()?;
        }
        Ok(())
    }

    fn deliveries(&mut self, spawn: u64) -> Vec<Delivery> {
        let mut out = Vec::new();
        let tag = self.run_tag.clone();
        let ns = |m: DeliveryMode| match m {
            DeliveryMode::Retriable => format!("faults.{tag}.r"),
            DeliveryMode::Idempotent => format!("faults.{tag}.i"),
        };
        let mode_of = |j: usize| {
            if j % 2 == 0 {
                DeliveryMode::Retriable
            } else {
                DeliveryMode::Idempotent
            }
        };
        for batch in [spawn, spawn.saturating_sub(1)] {
            for j in 0..self.load.unique_per_spawn {
                let mode = mode_of(j);
                out.push(Delivery {
                    mode,
                    namespace: ns(mode),
                    key: format!("u{batch}-{j}"),
                });
            }
        }
        for _ in 0..self.load.hot_per_spawn {
            let h = self.rng.gen_range(0..self.load.hot_keys.max(1));
            let mode = mode_of(h);
            out.push(Delivery {
                mode,
                namespace: ns(mode),
                key: format!("hot{h}"),
            });
        }
        out.shuffle(&mut self.rng);
        out.dedup();
        out
    }

    /// Built from JSON so that fields other engineers add to [`WorkerPlan`] (optional ones)
    /// take their defaults here.
    fn plan(&self, worker: String, seed: u64, deliveries: Vec<Delivery>) -> WorkerPlan {
        serde_json::from_value(serde_json::json!({
            "worker": worker,
            "seed": seed,
            "lease_ms": self.load.lease_ms,
            "ttl_ms": 3_600_000u64,
            "pause_pct": 0,
            "call_timeout_ms": 5_000u64,
            "effect_gap_ms_max": 5u64,
            "tries_max": self.load.tries_max,
            "deliveries": deliveries,
        }))
        .expect("a plan with every required field")
    }

    fn spawn_worker(&mut self) -> std::io::Result<Child> {
        let spawn = self.spawn;
        self.spawn += 1;
        let deliveries = self.deliveries(spawn);
        self.all.extend(deliveries.iter().cloned());
        let seed = self.rng.gen();
        let p = self.plan(format!("w{spawn}"), seed, deliveries);
        let plan_path = self.run_dir.join(format!("plan-w{spawn}.json"));
        std::fs::write(
            &plan_path,
            serde_json::to_vec(&p).map_err(std::io::Error::other)?,
        )?;
        let log = std::fs::File::create(self.run_dir.join(format!("w{spawn}.log")))?;
        Command::new(&self.exe)
            .arg("worker")
            .arg("--store")
            .arg(format!("http://{}", self.listen))
            .arg("--dir")
            .arg(&self.run_dir)
            .arg("--plan")
            .arg(&plan_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
    }

    /// Replaces every worker that finished with a new one (keeps the load on).
    pub fn tend(&mut self) -> std::io::Result<()> {
        if !self.tending {
            return Ok(());
        }
        for i in 0..self.slots.len() {
            if self.slots[i].try_wait()?.is_some() {
                self.slots[i] = self.spawn_worker()?;
            }
        }
        Ok(())
    }

    /// Sleeps `d`, keeping the load on.
    pub async fn sleep_tending(&mut self, d: Duration) -> std::io::Result<()> {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.tend()?;
            tokio::time::sleep(Duration::from_millis(5).min(until - Instant::now())).await;
        }
        Ok(())
    }

    /// Faults have stopped: lets the workers finish their lists, lets leases run out and
    /// drains every retriable event once more. Then the caller may crash and restart the gate
    /// (to prove that what was acknowledged survives) before [`FaultRun::check`].
    pub async fn drain(&mut self) -> Result<(), FaultRunError> {
        self.tending = false;
        let deadline = Instant::now() + Duration::from_secs(120);
        for slot in self.slots.iter_mut() {
            while slot.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    let _ = slot.kill();
                    let _ = slot.wait();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(self.load.lease_ms * 2 + 100)).await;
        let retriable: Vec<Delivery> = self
            .all
            .iter()
            .filter(|d| d.mode == DeliveryMode::Retriable)
            .cloned()
            .collect();
        let mut drain_plan = self.plan("drain".into(), 1, retriable);
        drain_plan.effect_gap_ms_max = 0;
        drain_plan.tries_max = 10;
        let mut drain = Worker::new(self.http.clone(), &self.run_dir, drain_plan)?;
        drain.run().await?;
        Ok(())
    }

    /// Reads every event back and checks. `lin` selects the linearizability check (the
    /// store's clock must follow the host's for it to apply).
    pub async fn check(mut self, lin: Option<LinConfig>) -> Result<Checked, FaultRunError> {
        let mut reader = Worker::new(
            self.http.clone(),
            &self.run_dir,
            self.plan("final".into(), 2, vec![]),
        )?;
        for d in &self.all {
            reader.read(&d.namespace, &d.key).await?;
        }
        drop(reader);
        self.kill_gate()?;

        let effects = read_ledger(&self.run_dir)?;
        let events = read_answer_logs(&self.run_dir)?;
        let mut checked = Checked {
            oracle: oracle::check(&effects, &events, &self.all),
            unavailable_answers: count_unavailable(&events),
            worker_spawns: self.spawn,
            gate_starts: self.gate_n,
            ..Default::default()
        };
        if let Some(cfg) = lin {
            let report = lin::check(&events, &cfg);
            checked.lin_keys = report.keys.len();
            checked.lin_ops = report.ops();
            checked.lin_inconclusive = report.inconclusive();
            if cfg.clock_slack_ms > 0 {
                let strict = lin::check(
                    &events,
                    &LinConfig {
                        clock_slack_ms: 0,
                        ..cfg.clone()
                    },
                );
                checked.lin_clock_slack_keys = strict
                    .violations()
                    .len()
                    .saturating_sub(report.violations().len());
            }
            checked.lin_violations = report
                .violations()
                .iter()
                .map(|k| match &k.verdict {
                    lin::Verdict::Violation { detail } => {
                        format!("{}/{}: {detail}", k.namespace, k.key)
                    }
                    _ => String::new(),
                })
                .collect();
        }
        Ok(checked)
    }
}

impl Drop for FaultRun {
    fn drop(&mut self) {
        for slot in self.slots.iter_mut() {
            let _ = slot.kill();
            let _ = slot.wait();
        }
        let _ = self.kill_gate();
    }
}

/// Answers the gate gave as "unavailable" because its store said so (failed closed), as
/// opposed to a connection refused by a dead gate.
pub fn count_unavailable(events: &[Event]) -> u64 {
    events
        .iter()
        .filter(|e| match &e.answer {
            HAnswer::Unknown { why } => {
                why.contains("store unavailable") && !why.contains("transport")
            }
            _ => false,
        })
        .count() as u64
}

/// Lines of the gate's logs (every start) containing `needle`.
pub fn count_in_gate_logs(run: &FaultRun, needle: &str) -> u64 {
    (0..run.gate_starts())
        .map(|n| {
            std::fs::read_to_string(run.gate_log(n))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(needle))
                .count() as u64
        })
        .sum()
}
