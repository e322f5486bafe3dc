//! The orchestrator of a torture run: starts a gate process (HTTP face) or lets the workers
//! open the store themselves (library face), starts worker processes, fires faults and counts
//! each one it fired, then stops the faults, lets leases run out, drains, reads everything back
//! and hands it to the oracles ([`crate::oracle`], [`crate::lin`]).
//!
//! Faults, each counted in [`FaultCounts`]:
//! - SIGKILL of a random worker at a random moment (a *crash cycle*: kill, then a new worker
//!   process with the next batch of deliveries, which redelivers the killed one's batch);
//! - SIGKILL of the gate process and a restart on the same port and data (HTTP face over a
//!   durable store only: a memory gate forgets by design);
//! - SIGSTOP of a lease holder: a worker stops itself right after a claim, before its effect
//!   (`pause_pct`); the orchestrator sees the stopped state in `/proc` and sends SIGCONT after a
//!   random 1.5-3x the lease, by which time another worker has usually taken the key over.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::Store;
use dedupgate_postgres::testkit::OwnedPg;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::delivery::{Delivery, DeliveryMode};
use crate::faces::{self, HttpStore, HttpStoreOptions};
use crate::ledger::{read_answer_logs, read_ledger};
use crate::lin::{self, LinConfig};
use crate::oracle::{self, OracleReport};
use crate::tcpfault::{route_through, TcpFaultCounts, TcpFaultPlan, TcpFaultProxy};
use crate::worker::{PauseNote, Worker, WorkerPlan};

/// Which face the workers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Face {
    /// The Rust library over the store itself (the store must be shared: Redis, PostgreSQL).
    Library,
    /// The HTTP service, run by this harness as its own `gate` process.
    Http,
    /// `dedupgate run` (the cron gate) over the store, its CMD performing the effect
    /// ([`crate::cron`]); `kill_gate_pct` is then the percent of `run` processes SIGKILLed.
    Cron,
    /// `dedupgate proxy` (the Idempotency-Key proxy) over the store, in front of an upstream
    /// the harness owns ([`crate::proxyface`]); `kill_gate_pct` SIGKILLs the proxy process.
    Proxy,
}

/// Shape of a run.
#[derive(Clone, Debug, Serialize)]
pub struct RunConfig {
    /// STORE of the gate (HTTP face) or of the workers (library face).
    pub store: String,
    /// Face.
    pub face: Face,
    /// Worker processes at a time.
    pub workers: usize,
    /// Crash cycles (SIGKILL of a worker or of the gate, then a restart).
    pub cycles: u64,
    /// Percent of cycles that kill the gate instead of a worker (HTTP face, durable store).
    pub kill_gate_pct: u32,
    /// Percent of held leases after which the holder SIGSTOPs itself.
    pub pause_pct: u32,
    /// Lease of every claim.
    pub lease_ms: u64,
    /// Unique events per worker process (each is delivered to two processes).
    pub unique_per_spawn: usize,
    /// Hot keys shared by every worker.
    pub hot_keys: usize,
    /// Hot-key deliveries per worker process.
    pub hot_per_spawn: usize,
    /// Gap between two faults, ms (uniform in the range).
    pub cycle_gap_ms: (u64, u64),
    /// Where every file of the run goes.
    pub run_dir: PathBuf,
    /// The `dedupgate-torture` binary (for the worker and gate processes).
    pub exe: PathBuf,
    /// Seed of every random choice.
    pub seed: u64,
    /// Check the answer logs for linearizability too.
    pub lin: bool,
    /// Clock allowance of the linearizability check.
    pub lin_skew_ms: u64,
    /// Part of every namespace of the run, so runs on a shared server never meet.
    pub run_tag: String,
    /// Start a Redis server of the run's own (AOF, fsync on every write) and use it as the
    /// store: `store` is then ignored and the server can be SIGKILLed (`kill_store_pct`).
    pub owned_redis: bool,
    /// Start a PostgreSQL server of the run's own (fsync on) and use it as the store: `store` is
    /// then ignored and the server can be `kill -9`ed and restarted (`kill_store_pct`).
    pub owned_postgres: bool,
    /// Percent of cycles that SIGKILL the owned Redis or PostgreSQL server and restart it.
    pub kill_store_pct: u32,
    /// Route the store's connections (`redis://`, `postgres://`) through a TCP fault proxy of
    /// the run's own with this random plan; turned off when the faults stop.
    pub tcp_faults: Option<TcpFaultPlan>,
    /// Percent of cycles that cut every connection through the TCP fault proxy at once.
    pub tcp_cut_all_pct: u32,
    /// The `dedupgate` binary (cron and proxy faces); `DEDUPGATE_BIN`, else the one next to
    /// `exe`, when None.
    pub dedupgate_exe: Option<PathBuf>,
    /// Kill the gate even over the memory store, which forgets everything: only to prove that
    /// the oracles see the losses and duplicates that follow.
    pub allow_volatile_gate_kills: bool,
}

impl RunConfig {
    /// A CI-sized run: 3 workers, `cycles` crash cycles, lease 300 ms.
    pub fn ci(
        store: &str,
        face: Face,
        cycles: u64,
        run_dir: PathBuf,
        exe: PathBuf,
        seed: u64,
    ) -> Self {
        Self {
            store: store.to_owned(),
            face,
            workers: 3,
            cycles,
            kill_gate_pct: 0,
            pause_pct: 5,
            lease_ms: 300,
            unique_per_spawn: 12,
            hot_keys: 3,
            hot_per_spawn: 6,
            cycle_gap_ms: (20, 150),
            run_dir,
            exe,
            seed,
            lin: true,
            lin_skew_ms: 1,
            allow_volatile_gate_kills: false,
            dedupgate_exe: None,
            owned_redis: false,
            owned_postgres: false,
            kill_store_pct: 0,
            tcp_faults: None,
            tcp_cut_all_pct: 0,
            run_tag: format!(
                "{:x}.{:x}",
                seed,
                (crate::history::wall_ns() / 1_000_000) ^ u64::from(std::process::id())
            ),
        }
    }
}

/// Faults fired, by kind, and process figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FaultCounts {
    /// Crash cycles completed.
    pub cycles: u64,
    /// Workers SIGKILLed.
    pub worker_sigkills: u64,
    /// Gate processes SIGKILLed (and restarted).
    pub gate_sigkills: u64,
    /// Store servers (Redis, PostgreSQL) SIGKILLed and restarted.
    pub store_sigkills: u64,
    /// Cycles that cut every connection through the TCP fault proxy (each connection cut is
    /// counted in `tcp.commanded_cuts`).
    pub tcp_cut_all: u64,
    /// What the TCP fault proxy fired, when the run had one.
    pub tcp: Option<TcpFaultCounts>,
    /// `dedupgate run` invocations and their outcomes (cron face).
    pub cron: Option<crate::cron::CronCounts>,
    /// Requests through `dedupgate proxy` and their answers (proxy face).
    pub proxy: Option<crate::proxyface::ProxyCounts>,
    /// Lease holders seen stopped (SIGSTOP).
    pub sigstops: u64,
    /// SIGCONTs sent to them after 1.5-3x the lease.
    pub sigconts: u64,
    /// Worker processes started.
    pub worker_spawns: u64,
    /// Worker processes that finished their deliveries.
    pub worker_exits: u64,
    /// Gate (proxy) starts that failed and were tried again: a proxy restarted under TCP faults
    /// may fail to open its store and exit.
    pub gate_start_retries: u64,
    /// Takeovers of a paused holder's event started while it was stopped.
    pub takeovers: u64,
}

/// What a run found.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// The configuration.
    pub config: RunConfig,
    /// Faults fired.
    pub faults: FaultCounts,
    /// The effect oracle's findings.
    pub oracle: OracleReport,
    /// Linearizability: keys, ops, unknown, violations (details), inconclusive keys.
    pub lin_keys: usize,
    /// Operations checked for linearizability.
    pub lin_ops: usize,
    /// Linearizability violations, described.
    pub lin_violations: Vec<String>,
    /// Keys the linearizability search gave up on.
    pub lin_inconclusive: usize,
    /// Answers of a kind no fault may produce: an error other than `unavailable` (the store
    /// said its data is corrupt or it is misconfigured) or a refusal other than `lease_lost`.
    /// Under network faults the gate must answer unavailable, never anything else.
    pub wrong_errors: Vec<String>,
    /// Wall time of the run.
    pub elapsed_ms: u64,
}

impl RunReport {
    /// True when every check passed (inconclusive linearizability keys do not fail a run; they
    /// are reported).
    pub fn ok(&self) -> bool {
        self.oracle.ok() && self.lin_violations.is_empty() && self.wrong_errors.is_empty()
    }

    /// A short human summary.
    pub fn summary(&self) -> String {
        let o = &self.oracle;
        let f = &self.faults;
        format!(
            "{} over {:?}: seed {} | cycles {} (worker SIGKILL {}, gate SIGKILL {}, store SIGKILL {}, TCP cut-all {}){}, SIGSTOP {} / SIGCONT {}, spawns {} | events {}, answers {} ({} unknown), effects {} (late writes rejected {}, re-executions {}, effects without completion answer {}), stale completions refused {} | duplicates {}, lost {}, fence violations {}, replay mismatches {}, wrong errors {} | linearizability: {} keys, {} ops, {} violations, {} inconclusive | {} ms",
            self.config.store,
            self.config.face,
            self.config.seed,
            f.cycles,
            f.worker_sigkills,
            f.gate_sigkills,
            f.store_sigkills,
            f.tcp_cut_all,
            f.proxy.as_ref().map_or(String::new(), |p| format!(
                " [dedupgate proxy: {} requests, {} fresh, {} replayed, {} in flight (409), {} 5xx, {} unknown]",
                p.requests, p.fresh, p.replayed, p.in_flight, p.server_errors, p.unknown
            )) + &f.cron.as_ref().map_or(String::new(), |c| format!(
                " [dedupgate run: {} invocations, {} SIGKILLed, {} ran, {} skipped, {} CMD refused, {} gate failed, {} unknown]",
                c.invocations, c.run_sigkills, c.ran, c.skipped, c.cmd_failed, c.gate_failed, c.unknown
            )) + &f.tcp.as_ref().map_or(String::new(), |t| format!(
                " [TCP proxy: {} connections, {} buffers, {} delayed, {} cut at random, {} cut on command, {} truncated, {} refused upstream down]",
                t.connections, t.buffers, t.delays, t.cuts, t.commanded_cuts, t.truncations, t.upstream_refused
            )),
            f.sigstops,
            f.sigconts,
            f.worker_spawns,
            o.events_checked,
            o.answers_read,
            o.answers_unknown,
            o.effects_accepted,
            o.late_writes_rejected,
            o.reexecutions,
            o.effects_without_completion_answer,
            o.stale_completions_refused,
            o.duplicates.len(),
            o.lost.len(),
            o.fence_violations.len(),
            o.replay_mismatches.len(),
            self.wrong_errors.len(),
            self.lin_keys,
            self.lin_ops,
            self.lin_violations.len(),
            self.lin_inconclusive,
            self.elapsed_ms
        )
    }
}

/// Why a run could not be carried out (not a finding: findings are in [`RunReport`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A file or process operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The store would not open.
    #[error(transparent)]
    Open(#[from] faces::OpenError),
    /// The gate process did not come up.
    #[error("the gate did not answer at {0} within 20 s")]
    GateDown(String),
    /// The configuration cannot work.
    #[error("bad configuration: {0}")]
    Config(String),
    /// The store URL cannot be routed through the TCP fault proxy.
    #[error(transparent)]
    Route(#[from] crate::tcpfault::RouteError),
}

struct Slot {
    child: Child,
    /// The worker's name (for its pause note).
    name: Option<String>,
    stopped_until: Option<Instant>,
    /// Just after a SIGCONT `/proc` may still show the stop; not a new one.
    quiet_until: Option<Instant>,
    /// The takeover of the stopped holder's event; SIGCONT waits for it to finish, so the
    /// holder always wakes up stale.
    rescue: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

struct Gate {
    child: Child,
    listen: String,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn_gate(cfg: &RunConfig, listen: &str, n: u64) -> std::io::Result<Child> {
    let log = std::fs::File::create(cfg.run_dir.join(format!("gate-{n}.log")))?;
    Command::new(&cfg.exe)
        .args(["gate", "--store", &cfg.store, "--listen", listen])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
}

async fn wait_healthy(url: &str) -> Result<(), RunError> {
    let store = HttpStore::new(url, HttpStoreOptions::without_retries())
        .map_err(|e| RunError::Config(e.to_string()))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if store.health().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(RunError::GateDown(url.to_owned()))
}

fn is_stopped(pid: u32) -> bool {
    // /proc/PID/stat: "pid (comm) S ..."; comm may hold spaces, so read after the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

fn signal(child: &Child, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        // The process may have exited already; nothing to do then.
        let _ = rustix::process::kill_process(pid, sig);
    }
}

fn deliveries_for(cfg: &RunConfig, spawn: u64, rng: &mut StdRng) -> Vec<Delivery> {
    let mut out = Vec::new();
    let ns = |m: DeliveryMode| match m {
        DeliveryMode::Retriable => format!("torture.{}.r", cfg.run_tag),
        DeliveryMode::Idempotent => format!("torture.{}.i", cfg.run_tag),
    };
    let mode_of = |j: usize| {
        if j % 2 == 0 {
            DeliveryMode::Retriable
        } else {
            DeliveryMode::Idempotent
        }
    };
    // This spawn's batch and the previous one's (a redelivery of what may have been killed).
    for batch in [spawn, spawn.saturating_sub(1)] {
        for j in 0..cfg.unique_per_spawn {
            let mode = mode_of(j);
            out.push(Delivery {
                mode,
                namespace: ns(mode),
                key: format!("u{batch}-{j}"),
            });
        }
    }
    for _ in 0..cfg.hot_per_spawn {
        let h = rng.gen_range(0..cfg.hot_keys.max(1));
        let mode = mode_of(h);
        out.push(Delivery {
            mode,
            namespace: ns(mode),
            key: format!("hot{h}"),
        });
    }
    out.shuffle(rng);
    out.dedup();
    out
}

fn plan(cfg: &RunConfig, worker: String, seed: u64, deliveries: Vec<Delivery>) -> WorkerPlan {
    WorkerPlan {
        worker,
        seed,
        lease_ms: cfg.lease_ms,
        ttl_ms: 3_600_000,
        pause_pct: cfg.pause_pct,
        call_timeout_ms: 5_000,
        effect_gap_ms_max: 5,
        tries_max: 3,
        deliveries,
    }
}

fn dedupgate_exe(cfg: &RunConfig) -> Result<PathBuf, RunError> {
    match &cfg.dedupgate_exe {
        Some(p) => Ok(p.clone()),
        None => std::env::var_os("DEDUPGATE_BIN")
            .map(PathBuf::from)
            .filter(|p| p.is_file())
            .or_else(|| crate::cron::dedupgate_exe_near(&cfg.exe))
            .ok_or_else(|| {
                RunError::Config(format!(
                "the {:?} face needs the dedupgate binary next to {} (cargo build -p dedupgate)",
                cfg.face,
                cfg.exe.display()
            ))
            }),
    }
}

fn spawn_proxy(cfg: &RunConfig, upstream: &str, listen: &str, n: u64) -> Result<Child, RunError> {
    let log = std::fs::File::create(cfg.run_dir.join(format!("proxy-{n}.log")))?;
    Ok(Command::new(dedupgate_exe(cfg)?)
        .args(["proxy", "--upstream", upstream, "--listen", listen])
        .args(["--store", &cfg.store, "--upstream-timeout", "5s"])
        .arg("--lease")
        .arg(format!("{}ms", cfg.lease_ms))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

/// Starts the proxy and waits until it listens. A proxy that cannot open its store exits (its
/// store open can fail under the TCP faults); it is started again, as a supervisor would, and
/// each such start is counted.
async fn start_proxy(
    cfg: &RunConfig,
    upstream: &str,
    listen: &str,
    n: u64,
    retries: &mut u64,
) -> Result<Child, RunError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempt = 0;
    loop {
        let mut child = spawn_proxy(cfg, upstream, listen, n * 100 + attempt)?;
        loop {
            if tokio::net::TcpStream::connect(listen).await.is_ok() {
                return Ok(child);
            }
            if child.try_wait()?.is_some() || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        if Instant::now() > deadline {
            return Err(RunError::GateDown(listen.to_owned()));
        }
        *retries += 1;
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_listening(listen: &str) -> Result<(), RunError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(RunError::GateDown(listen.to_owned()))
}

fn proxy_plan(listen: &str) -> crate::proxyface::ProxyPlan {
    crate::proxyface::ProxyPlan {
        url: format!("http://{listen}"),
        timeout_ms: 10_000,
    }
}

fn cron_plan(cfg: &RunConfig, kill_pct: u32) -> Result<crate::cron::CronPlan, RunError> {
    let dedupgate_exe = dedupgate_exe(cfg)?;
    Ok(crate::cron::CronPlan {
        dedupgate_exe,
        torture_exe: cfg.exe.clone(),
        store: cfg.store.clone(),
        kill_pct,
        kill_after_ms_max: 150,
        gap_ms_max: 5,
    })
}

fn spawn_worker(
    cfg: &RunConfig,
    gate_store: &str,
    proxy_listen: Option<&str>,
    spawn: u64,
    rng: &mut StdRng,
    all: &mut BTreeSet<Delivery>,
) -> std::io::Result<Child> {
    let deliveries = deliveries_for(cfg, spawn, rng);
    all.extend(deliveries.iter().cloned());
    let mut p = plan(cfg, format!("w{spawn}"), rng.gen(), deliveries);
    let mut cron_path = None;
    if cfg.face == Face::Cron {
        let c = cron_plan(cfg, cfg.kill_gate_pct).map_err(std::io::Error::other)?;
        let path = cfg.run_dir.join(format!("cron-plan-w{spawn}.json"));
        std::fs::write(
            &path,
            serde_json::to_vec(&c).map_err(std::io::Error::other)?,
        )?;
        cron_path = Some(path);
        p.pause_pct = 0;
    }
    if let (Face::Proxy, Some(listen)) = (cfg.face, proxy_listen) {
        let path = cfg.run_dir.join(format!("proxy-plan-w{spawn}.json"));
        std::fs::write(
            &path,
            serde_json::to_vec(&proxy_plan(listen)).map_err(std::io::Error::other)?,
        )?;
        cron_path = Some(path);
        p.pause_pct = 0;
    }
    let face_flag = if cfg.face == Face::Proxy {
        "--proxy"
    } else {
        "--cron"
    };
    let plan_path = cfg.run_dir.join(format!("plan-w{spawn}.json"));
    std::fs::write(
        &plan_path,
        serde_json::to_vec(&p).map_err(std::io::Error::other)?,
    )?;
    let log = std::fs::File::create(cfg.run_dir.join(format!("w{spawn}.log")))?;
    Command::new(&cfg.exe)
        .arg("worker")
        .arg("--store")
        .arg(gate_store)
        .arg("--dir")
        .arg(&cfg.run_dir)
        .arg("--plan")
        .arg(&plan_path)
        .args(
            cron_path
                .iter()
                .flat_map(|c| [std::ffi::OsStr::new(face_flag), c.as_os_str()]),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
}

/// Runs one torture run to the end and checks it.
pub async fn run(mut cfg: RunConfig) -> Result<RunReport, RunError> {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.run_dir)?;
    // Dropped (and so SIGKILLed) at the end of the run.
    let mut redis = None;
    if cfg.owned_redis {
        let server = dedupgate_redis::testkit::RedisServer::start_in(
            &cfg.run_dir,
            dedupgate_redis::testkit::free_port(),
            &["--appendonly", "yes", "--appendfsync", "always"],
        )?;
        cfg.store = server.url();
        redis = Some(server);
    }
    let mut postgres = None;
    if cfg.owned_postgres {
        let server = tokio::task::block_in_place(OwnedPg::start)?;
        cfg.store = server.url();
        postgres = Some(server);
    }
    let mut tcp = None;
    if cfg.tcp_faults.is_some() {
        let (upstream, _) = route_through(&cfg.store, 0)?;
        // Faults start once the run's own store is open (see below).
        let proxy = TcpFaultProxy::start(upstream, TcpFaultPlan::off(), cfg.seed).await?;
        cfg.store = route_through(&cfg.store, proxy.port())?.1;
        tcp = Some(proxy);
    }
    let durable = !(cfg.store.starts_with("memory")) || cfg.allow_volatile_gate_kills;
    if matches!(cfg.face, Face::Library | Face::Cron)
        && !(cfg.store.starts_with("redis")
            || cfg.store.starts_with("postgres")
            || cfg.store.starts_with("tiered:"))
    {
        return Err(RunError::Config(
            "the library face needs a store several processes can share (redis://, postgres://)"
                .into(),
        ));
    }
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut faults = FaultCounts::default();
    let mut gate_n = 0u64;
    // The proxy face's upstream, kept by this process; its executions go to the ledger.
    let upstream = match cfg.face {
        Face::Proxy => Some(crate::proxyface::Upstream::start(&cfg.run_dir).await?),
        _ => None,
    };
    let upstream_url = upstream.as_ref().map(|u| u.url()).unwrap_or_default();
    let mut gate = match cfg.face {
        Face::Http => {
            let listen = format!("127.0.0.1:{}", free_port()?);
            let child = spawn_gate(&cfg, &listen, gate_n)?;
            wait_healthy(&format!("http://{listen}")).await?;
            Some(Gate { child, listen })
        }
        Face::Proxy => {
            let listen = format!("127.0.0.1:{}", free_port()?);
            let child = spawn_proxy(&cfg, &upstream_url, &listen, gate_n)?;
            wait_listening(&listen).await?;
            Some(Gate { child, listen })
        }
        Face::Library | Face::Cron => None,
    };
    if cfg.face == Face::Proxy {
        cfg.lin = false;
    }
    let proxy_listen = match (cfg.face, &gate) {
        (Face::Proxy, Some(g)) => Some(g.listen.clone()),
        _ => None,
    };
    if cfg.face == Face::Cron {
        // Checked before any process starts.
        cron_plan(&cfg, 0)?;
        cfg.lin = false;
    }
    let worker_store = match &gate {
        // Proxy-face workers talk HTTP to the proxy; their store goes unused.
        Some(_) if cfg.face == Face::Proxy => "memory:".to_owned(),
        Some(g) => format!("http://{}", g.listen),
        None => cfg.store.clone(),
    };

    let store: Arc<dyn Store> = faces::open(&worker_store).await?;
    if let (Some(proxy), Some(plan)) = (tcp.as_ref(), cfg.tcp_faults.clone()) {
        proxy.set_plan(plan);
    }
    let mut ctx = PauseCtx {
        cfg: &cfg,
        store: store.clone(),
    };
    let mut all = BTreeSet::new();
    let mut spawn = 0u64;
    let mut new_slot = |rng: &mut StdRng,
                        all: &mut BTreeSet<Delivery>,
                        faults: &mut FaultCounts|
     -> std::io::Result<Slot> {
        let child = spawn_worker(
            &cfg,
            &worker_store,
            proxy_listen.as_deref(),
            spawn,
            rng,
            all,
        )?;
        let slot = Slot {
            child,
            name: Some(format!("w{spawn}")),
            stopped_until: None,
            quiet_until: None,
            rescue: None,
        };
        spawn += 1;
        faults.worker_spawns += 1;
        Ok(slot)
    };
    let mut slots = Vec::new();
    for _ in 0..cfg.workers {
        slots.push(new_slot(&mut rng, &mut all, &mut faults)?);
    }
    let gap = |rng: &mut StdRng| {
        Duration::from_millis(rng.gen_range(cfg.cycle_gap_ms.0..=cfg.cycle_gap_ms.1))
    };
    let mut next_fault = Instant::now() + gap(&mut rng);
    let pause_for = |rng: &mut StdRng| {
        Duration::from_millis((cfg.lease_ms as f64 * rng.gen_range(1.5..3.0)) as u64)
    };

    // Faults phase.
    while faults.cycles < cfg.cycles {
        tokio::time::sleep(Duration::from_millis(3)).await;
        for slot in slots.iter_mut() {
            if slot.child.try_wait()?.is_some() {
                faults.worker_exits += 1;
                *slot = new_slot(&mut rng, &mut all, &mut faults)?;
                continue;
            }
            watch_pause(slot, &mut faults, &mut rng, &pause_for, &mut ctx);
        }
        if Instant::now() < next_fault {
            continue;
        }
        next_fault = Instant::now() + gap(&mut rng);
        // Each configured server fault fires at least twice and a cut-all at least once a run
        // (forced in the last cycles if chance has not done it), so a run always proves them.
        let left = cfg.cycles - faults.cycles;
        let force_store = cfg.kill_store_pct > 0 && faults.store_sigkills < 2 && left <= 4;
        let force_cut =
            !force_store && cfg.tcp_cut_all_pct > 0 && faults.tcp_cut_all == 0 && left <= 1;
        let force_gate = cfg.kill_gate_pct > 0
            && matches!(cfg.face, Face::Http | Face::Proxy)
            && faults.gate_sigkills == 0
            && left <= 2
            && !force_store
            && !force_cut;
        // And a worker is killed at least once: a run whose draws all went to the servers
        // (seen once in CI: 10 store SIGKILLs of 10 cycles) proved nothing about workers.
        let force_worker =
            faults.worker_sigkills == 0 && left <= 1 && !force_store && !force_cut && !force_gate;
        if let Some(server) = redis.as_mut() {
            if force_store
                || (!force_gate && !force_worker && rng.gen_range(0..100) < cfg.kill_store_pct)
            {
                // SIGKILL: no shutdown, no final fsync; what was acknowledged must be in the AOF.
                server.restart()?;
                faults.store_sigkills += 1;
                faults.cycles += 1;
                continue;
            }
        }
        if let Some(server) = postgres.as_ref() {
            if force_store
                || (!force_gate && !force_worker && rng.gen_range(0..100) < cfg.kill_store_pct)
            {
                // kill -9 of the postmaster: what was committed must come back from the WAL.
                tokio::task::block_in_place(|| server.kill9_and_restart())?;
                faults.store_sigkills += 1;
                faults.cycles += 1;
                continue;
            }
        }
        if let Some(proxy) = tcp.as_ref() {
            if force_cut
                || (!force_gate && !force_worker && rng.gen_range(0..100) < cfg.tcp_cut_all_pct)
            {
                proxy.cut_all();
                faults.tcp_cut_all += 1;
                faults.cycles += 1;
                continue;
            }
        }
        let kill_gate = gate.is_some()
            && matches!(cfg.face, Face::Http | Face::Proxy)
            && durable
            && !force_worker
            && (force_gate || rng.gen_range(0..100) < cfg.kill_gate_pct);
        if kill_gate {
            let g = gate.as_mut().expect("checked above");
            g.child.kill()?;
            g.child.wait()?;
            faults.gate_sigkills += 1;
            gate_n += 1;
            if cfg.face == Face::Proxy {
                g.child = start_proxy(
                    &cfg,
                    &upstream_url,
                    &g.listen,
                    gate_n,
                    &mut faults.gate_start_retries,
                )
                .await?;
            } else {
                g.child = spawn_gate(&cfg, &g.listen, gate_n)?;
                wait_healthy(&worker_store).await?;
            }
        } else {
            // A paused holder is left to its SIGCONT: its late write is the point of the pause.
            let running: Vec<usize> = (0..slots.len())
                .filter(|i| slots[*i].stopped_until.is_none())
                .collect();
            let Some(&i) = running.choose(&mut rng) else {
                continue;
            };
            slots[i].child.kill()?;
            slots[i].child.wait()?;
            faults.worker_sigkills += 1;
            slots[i] = new_slot(&mut rng, &mut all, &mut faults)?;
        }
        faults.cycles += 1;
    }

    // Faults stop: let every worker finish its list (resuming paused ones).
    if let Some(proxy) = tcp.as_ref() {
        proxy.set_plan(TcpFaultPlan::off());
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut running = 0;
        for slot in slots.iter_mut() {
            if slot.child.try_wait()?.is_none() {
                running += 1;
                watch_pause(slot, &mut faults, &mut rng, &pause_for, &mut ctx);
            }
        }
        if running == 0 {
            break;
        }
        if Instant::now() > deadline {
            for slot in slots.iter_mut() {
                let _ = slot.child.kill();
                let _ = slot.child.wait();
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    faults.worker_exits += slots.len() as u64;

    // Leases run out, then the drain processes every retriable event once more, without faults,
    // and reads every event back.
    tokio::time::sleep(Duration::from_millis(cfg.lease_ms * 2 + 100)).await;
    let retriable: Vec<Delivery> = all
        .iter()
        // Every proxied request is retriable (claim, forward, complete).
        .filter(|d| d.mode == DeliveryMode::Retriable || cfg.face == Face::Proxy)
        .cloned()
        .collect();
    let mut drain_plan = plan(&cfg, "drain".into(), cfg.seed, retriable);
    drain_plan.pause_pct = 0;
    drain_plan.effect_gap_ms_max = 0;
    drain_plan.tries_max = 10;
    let mut drain = Worker::new(store, &cfg.run_dir, drain_plan)?;
    if cfg.face == Face::Cron {
        drain = drain.with_cron(cron_plan(&cfg, 0)?)?;
    }
    if let Some(listen) = &proxy_listen {
        drain = drain.with_proxy(proxy_plan(listen))?;
    }
    drain.run().await?;
    if let Some(listen) = &proxy_listen {
        // The final requests, one per event: each must be a replay of what was stored.
        let mut p = plan(
            &cfg,
            "final".into(),
            cfg.seed,
            all.iter().cloned().collect(),
        );
        p.pause_pct = 0;
        let mut fin =
            Worker::new(drain_store(), &cfg.run_dir, p)?.with_proxy(proxy_plan(listen))?;
        fin.run().await?;
    } else {
        for d in &all {
            drain.read(&d.namespace, &d.key).await?;
        }
    }
    drop(drain);
    if let Some(mut g) = gate.take() {
        g.child.kill()?;
        g.child.wait()?;
    }
    drop(upstream);
    drop(redis);
    drop(postgres);
    if let Some(proxy) = tcp.take() {
        faults.tcp = Some(proxy.counts());
    }

    // Check.
    let effects = read_ledger(&cfg.run_dir)?;
    let events = read_answer_logs(&cfg.run_dir)?;
    let mut cron_wrong = vec![];
    let oracle = if cfg.face == Face::Cron {
        let lines = crate::cron::read_cron_logs(&cfg.run_dir)?;
        let (report, counts) = crate::cron::check(&effects, &lines, &events, &all, cfg.lease_ms);
        faults.gate_sigkills = counts.run_sigkills;
        cron_wrong = counts.wrong_exits.clone();
        faults.cron = Some(counts);
        report
    } else if cfg.face == Face::Proxy {
        let lines = crate::proxyface::read_px_logs(&cfg.run_dir)?;
        let (report, counts) =
            crate::proxyface::check(&effects, &lines, &all, cfg.lease_ms, "final");
        cron_wrong = counts.wrong.clone();
        faults.proxy = Some(counts);
        report
    } else {
        oracle::check(&effects, &events, &all)
    };
    let (lin_keys, lin_ops, lin_violations, lin_inconclusive) = if cfg.lin {
        let report = lin::check(
            &events,
            &LinConfig {
                skew_ms: cfg.lin_skew_ms,
                steps_max: 200_000,
                monotonic_clock: true,
                clock_slack_ms: clock_slack_ms(&cfg.store),
            },
        );
        let violations = report
            .violations()
            .iter()
            .map(|k| match &k.verdict {
                lin::Verdict::Violation { detail } => {
                    format!("{}/{}: {detail}", k.namespace, k.key)
                }
                _ => String::new(),
            })
            .collect();
        (
            report.keys.len(),
            report.ops(),
            violations,
            report.inconclusive(),
        )
    } else {
        (0, 0, vec![], 0)
    };
    let mut wrong_errors = wrong_errors(&events);
    wrong_errors.extend(cron_wrong);
    Ok(RunReport {
        config: cfg,
        faults,
        oracle,
        lin_keys,
        lin_ops,
        lin_violations,
        lin_inconclusive,
        wrong_errors,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

fn drain_store() -> Arc<dyn Store> {
    Arc::new(dedupgate_core::MemoryStore::new())
}

/// Answers no fault may produce (see [`RunReport::wrong_errors`]).
pub fn wrong_errors(events: &[crate::history::Event]) -> Vec<String> {
    use crate::history::HAnswer;
    events
        .iter()
        .filter_map(|e| {
            let bad = match &e.answer {
                HAnswer::Unknown { why } => {
                    why.contains("corrupt")
                        || why.contains("misconfigured")
                        // The HTTP face: an answer API.md does not define, or a problem other
                        // than 503 `unavailable` (the client renders those "STATUS CODE: …").
                        || why.contains("protocol:")
                        || why.split("store unavailable: ").skip(1).any(|rest| {
                            rest.len() > 4
                                && rest.as_bytes()[..3].iter().all(u8::is_ascii_digit)
                                && rest.as_bytes()[3] == b' '
                        })
                }
                HAnswer::Refused { code } => code != "lease_lost",
                _ => false,
            };
            bad.then(|| format!("{}/{} {:?}: {:?}", e.namespace, e.key, e.op, e.answer))
        })
        .collect()
}

/// Starts a takeover of a paused holder's event once its lease has ended: a worker of the
/// orchestrator's own (`rescueN`, logged like any other) delivers the event again.
fn takeover(
    note: PauseNote,
    store: Arc<dyn Store>,
    cfg: &RunConfig,
    n: u64,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let mut p = plan(cfg, format!("rescue{n}"), n, vec![note.delivery]);
    p.pause_pct = 0;
    p.effect_gap_ms_max = 0;
    let run_dir = cfg.run_dir.clone();
    let wait_ms = note
        .lease_expires_at_ms
        .saturating_sub(crate::history::wall_ns() / 1_000_000)
        + 20;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let mut w = Worker::new(store, &run_dir, p)?;
        w.run().await
    })
}

struct PauseCtx<'a> {
    cfg: &'a RunConfig,
    store: Arc<dyn Store>,
}

fn watch_pause(
    slot: &mut Slot,
    faults: &mut FaultCounts,
    rng: &mut StdRng,
    pause_for: &dyn Fn(&mut StdRng) -> Duration,
    ctx: &mut PauseCtx<'_>,
) {
    match slot.stopped_until {
        None => {
            if slot.quiet_until.is_some_and(|q| Instant::now() < q) {
                return;
            }
            if is_stopped(slot.child.id()) {
                faults.sigstops += 1;
                slot.stopped_until = Some(Instant::now() + pause_for(rng));
                let note = slot.name.as_ref().and_then(|w| {
                    let path = ctx.cfg.run_dir.join(format!("paused-{w}.json"));
                    let note = std::fs::read(&path)
                        .ok()
                        .and_then(|b| serde_json::from_slice::<PauseNote>(&b).ok());
                    let _ = std::fs::remove_file(&path);
                    note
                });
                if let Some(note) = note {
                    faults.takeovers += 1;
                    slot.rescue =
                        Some(takeover(note, ctx.store.clone(), ctx.cfg, faults.takeovers));
                }
            }
        }
        Some(until)
            if Instant::now() >= until && slot.rescue.as_ref().is_none_or(|r| r.is_finished()) =>
        {
            slot.rescue = None;
            signal(&slot.child, rustix::process::Signal::CONT);
            faults.sigconts += 1;
            slot.stopped_until = None;
            slot.quiet_until = Some(Instant::now() + Duration::from_millis(50));
        }
        Some(_) => {}
    }
}

/// The clock slack the linearizability check allows a store (see
/// [`LinConfig::clock_slack_ms`]): 50 ms for PostgreSQL, whose plain reads do not wait for a
/// writer's commit, 0 for the others.
pub fn clock_slack_ms(store: &str) -> u64 {
    if store.starts_with("postgres") || store.contains(",postgres") {
        PG_CLOCK_SLACK_MS
    } else {
        0
    }
}

/// See [`clock_slack_ms`]: longer than a commit on a busy machine, far shorter than the lock
/// waits the store once decided across (fixed at 6a2fe9b).
pub const PG_CLOCK_SLACK_MS: u64 = 50;

/// The `dedupgate-torture` binary next to the running test or tool (`target/<profile>/`).
pub fn sibling_exe(name: &str) -> Option<PathBuf> {
    let me = std::env::current_exe().ok()?;
    let mut dir: Option<&Path> = me.parent();
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Some(candidate);
        }
        dir = d.parent();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Event, HAnswer, HOp};

    fn unknown(why: &str) -> Event {
        Event {
            client: "w".into(),
            namespace: "ns".into(),
            key: "k".into(),
            op: HOp::Get,
            call_ns: 1,
            return_ns: None,
            answer: HAnswer::Unknown { why: why.into() },
        }
    }

    #[test]
    fn only_unavailable_and_timeouts_are_answers_a_fault_may_produce() {
        let ok = [
            "store error: store unavailable: broken pipe",
            "store error: store unavailable: client timeout",
            "store error: store unavailable: transport: error sending request",
            "no answer logged: the process was killed",
        ];
        let bad = [
            "store error: store data is corrupt: bad record",
            "store error: store misconfigured: no schema",
            "store error: store unavailable: 500 internal: boom",
            "store error: store unavailable: protocol: not JSON",
        ];
        let events: Vec<Event> = ok.iter().chain(&bad).map(|w| unknown(w)).collect();
        let wrong = wrong_errors(&events);
        assert_eq!(wrong.len(), bad.len(), "{wrong:#?}");
    }
}
