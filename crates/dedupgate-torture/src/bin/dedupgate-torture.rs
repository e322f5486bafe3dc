//! `dedupgate-torture`: the harness's command line.
//!
//! - `run`: a whole torture run (gate and worker processes, faults, drain, oracles); prints the
//!   report and exits 1 when an invariant broke.
//! - `lin`: a concurrent history on any STORE, checked for linearizability.
//! - `storage-faults` and `clock-jumps`: failed I/O, power loss and clock jumps under an HTTP
//!   gate (see `storage_faults` and `clock_jumps`).
//! - `worker` and `gate`: the processes `run` starts.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use dedupgate_torture::faces;
use dedupgate_torture::lin::{self, LinConfig};
use dedupgate_torture::linrun::{self, LinRunConfig};
use dedupgate_torture::runner::{self, Face, RunConfig};
use dedupgate_torture::worker::{Worker, WorkerPlan};

#[derive(Parser, Debug)]
#[command(
    name = "dedupgate-torture",
    about = "Tries hard to break dedupgate, and checks"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum FaceArg {
    Library,
    Http,
    /// `dedupgate run`, the cron gate (needs the dedupgate binary).
    Cron,
    /// `dedupgate proxy`, the Idempotency-Key proxy (needs the dedupgate binary).
    Proxy,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// A torture run: worker processes, faults, drain, oracles.
    Run {
        /// STORE of the gate (http face) or the workers (library face).
        #[arg(long, default_value = "memory:")]
        store: String,
        /// Face the workers use.
        #[arg(long, value_enum, default_value = "http")]
        face: FaceArg,
        /// Crash cycles.
        #[arg(long, default_value_t = 20)]
        cycles: u64,
        /// Worker processes at a time.
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// Percent of cycles that SIGKILL the gate (http face over a durable store).
        #[arg(long, default_value_t = 0)]
        kill_gate_pct: u32,
        /// Percent of held leases whose holder SIGSTOPs itself before its effect.
        #[arg(long, default_value_t = 5)]
        pause_pct: u32,
        /// Run a Redis server of the run's own (AOF, appendfsync always) as the store, and
        /// SIGKILL and restart it in this percent of the cycles (library face).
        #[arg(long)]
        kill_owned_redis_pct: Option<u32>,
        /// Run a PostgreSQL server of the run's own (fsync on) as the store, and kill -9 and
        /// restart it in this percent of the cycles.
        #[arg(long)]
        kill_owned_postgres_pct: Option<u32>,
        /// Route the store's connections through a TCP fault proxy that delays, cuts and
        /// truncates them at random (redis:// or postgres:// stores).
        #[arg(long)]
        tcp_faults: bool,
        /// Percent of cycles that cut every connection through the TCP fault proxy.
        #[arg(long, default_value_t = 0)]
        tcp_cut_all_pct: u32,
        /// Lease of every claim, ms.
        #[arg(long, default_value_t = 300)]
        lease_ms: u64,
        /// Directory of the run's files (default: a fresh one under the temp dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Seed (default: random, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Skip the linearizability check of the answer logs.
        #[arg(long)]
        no_lin: bool,
        /// Print the whole report as JSON.
        #[arg(long)]
        json: bool,
        /// Append the report (one JSON line) to this file, for `summarize`.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Delete the run directory afterwards when every check passed.
        #[arg(long)]
        clean: bool,
    },
    /// Sums the reports appended by `run --report FILE` and `lin --report FILE`, per store and
    /// face.
    Summarize {
        /// The report file.
        file: PathBuf,
    },
    /// A concurrent history on STORE, checked for linearizability.
    Lin {
        /// STORE to record on (memory:, embedded:PATH, redis://, postgres://, http://).
        #[arg(long, default_value = "memory:")]
        store: String,
        /// Histories to record and check.
        #[arg(long, default_value_t = 10)]
        histories: u64,
        /// Clients per history.
        #[arg(long, default_value_t = 4)]
        clients: usize,
        /// Operations per client.
        #[arg(long, default_value_t = 50)]
        ops: usize,
        /// Clock allowance, ms.
        #[arg(long, default_value_t = 1)]
        skew_ms: u64,
        /// Do not require the store's clock to be non-decreasing in the linearization at all.
        #[arg(long)]
        clock_may_lag: bool,
        /// How far the store's clock may step back along the linearization, ms (default: 50
        /// for postgres://, whose reads do not wait for a writer's commit; 0 otherwise).
        #[arg(long)]
        clock_slack_ms: Option<u64>,
        /// Seed (default: random, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Append a summary (one JSON line) to this file, for `summarize`.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Measures the loss of a Redis failover: a primary acknowledging marks under load is
    /// SIGKILLed and its replica promoted; acknowledged marks missing there are lost.
    Failover {
        /// Measurements.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// `wait_replicas` of the gate (0: asynchronous replication, 1: WAIT for the replica).
        #[arg(long, default_value_t = 0)]
        wait_replicas: u32,
        /// Concurrent writers.
        #[arg(long, default_value_t = 8)]
        clients: usize,
        /// Load before the kill, ms.
        #[arg(long, default_value_t = 1000)]
        load_ms: u64,
        /// SIGSTOP the replica for the last this-many ms before the kill (a lagging replica).
        #[arg(long, default_value_t = 0)]
        replica_stall_ms: u64,
        /// Append each measurement (one JSON line) to this file.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Storage faults under the embedded store over HTTP: failed writes and fsyncs (libfiu),
    /// or loss of never-synced writes (SIGKILL, unsynced data dropped, restart).
    StorageFaults(dedupgate_torture::fault_cli::StorageFaultsArgs),
    /// Clock jumps of the gate process (libfaketime) while workers use it.
    ClockJumps(dedupgate_torture::fault_cli::ClockJumpsArgs),
    /// The CMD of a cron-face delivery (run by `dedupgate run`): performs the effect with the
    /// fence in DEDUPGATE_FENCE.
    Effect {
        /// Run directory.
        #[arg(long)]
        dir: PathBuf,
        /// Attempt id.
        #[arg(long)]
        attempt: String,
        /// Worker name.
        #[arg(long)]
        worker: String,
        /// Lease the run asked for, ms.
        #[arg(long)]
        lease_ms: u64,
        /// Longest sleep after the effect, ms.
        #[arg(long, default_value_t = 0)]
        gap_ms_max: u64,
        /// Idempotent ordering (no lease).
        #[arg(long)]
        idempotent: bool,
    },
    /// One worker process (started by `run`).
    Worker {
        /// STORE it talks to.
        #[arg(long)]
        store: String,
        /// Run directory.
        #[arg(long)]
        dir: PathBuf,
        /// Its plan (JSON).
        #[arg(long)]
        plan: PathBuf,
        /// Deliver through `dedupgate run` with this cron plan (JSON).
        #[arg(long)]
        cron: Option<PathBuf>,
        /// Deliver through `dedupgate proxy` with this plan (JSON).
        #[arg(long)]
        proxy: Option<PathBuf>,
    },
    /// The gate process (started by `run`): the HTTP API over STORE.
    Gate {
        /// STORE it serves.
        #[arg(long)]
        store: String,
        /// Address to listen on.
        #[arg(long)]
        listen: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dedupgate-torture: no runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(real_main(cli)) {
        Ok(code) => code,
        Err(e) => {
            // With its causes: a gate that cannot open its store must say why in its log (the
            // harness shows that log's tail when the gate does not come up).
            eprintln!(
                "dedupgate-torture: {}",
                dedupgate_core::error::chain_text(e.as_ref())
            );
            ExitCode::from(2)
        }
    }
}

fn pick_seed(seed: Option<u64>, what: &str) -> u64 {
    match seed {
        Some(s) => {
            eprintln!("{what}: seed {s}");
            s
        }
        None => dedupgate_torture::seed(what),
    }
}

async fn real_main(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error>> {
    match cli.command {
        Cmd::Run {
            store,
            face,
            cycles,
            workers,
            kill_gate_pct,
            pause_pct,
            kill_owned_redis_pct,
            kill_owned_postgres_pct,
            tcp_faults,
            tcp_cut_all_pct,
            lease_ms,
            dir,
            seed,
            no_lin,
            json,
            report: report_file,
            clean,
        } => {
            let seed = pick_seed(seed, "torture run");
            let dir = dir.unwrap_or_else(|| {
                std::env::temp_dir()
                    .join(format!("dedupgate-torture-{}-{seed}", std::process::id()))
            });
            let face = match face {
                FaceArg::Library => Face::Library,
                FaceArg::Http => Face::Http,
                FaceArg::Cron => Face::Cron,
                FaceArg::Proxy => Face::Proxy,
            };
            let mut cfg = RunConfig::ci(
                &store,
                face,
                cycles,
                dir.clone(),
                std::env::current_exe()?,
                seed,
            );
            cfg.workers = workers;
            cfg.kill_gate_pct = kill_gate_pct;
            cfg.pause_pct = pause_pct;
            if let Some(pct) = kill_owned_redis_pct {
                cfg.owned_redis = true;
                cfg.kill_store_pct = pct;
            }
            if let Some(pct) = kill_owned_postgres_pct {
                cfg.owned_postgres = true;
                cfg.kill_store_pct = pct;
            }
            if tcp_faults || tcp_cut_all_pct > 0 {
                cfg.tcp_faults = Some(if tcp_faults {
                    dedupgate_torture::tcpfault::TcpFaultPlan::ci()
                } else {
                    dedupgate_torture::tcpfault::TcpFaultPlan::off()
                });
                cfg.tcp_cut_all_pct = tcp_cut_all_pct;
            }
            cfg.lease_ms = lease_ms;
            cfg.lin = !no_lin;
            eprintln!("torture run: files in {}", dir.display());
            let report = runner::run(cfg).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            }
            if let Some(f) = report_file {
                append_line(&f, &serde_json::json!({"kind": "run", "report": report}))?;
            }
            if clean && report.ok() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            println!("{}", report.summary());
            for v in report
                .oracle
                .duplicates
                .iter()
                .chain(&report.oracle.lost)
                .chain(&report.oracle.fence_violations)
                .chain(&report.oracle.replay_mismatches)
                .chain(&report.lin_violations)
                .chain(&report.wrong_errors)
            {
                println!("VIOLATION {v}");
            }
            Ok(if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Lin {
            store,
            histories,
            clients,
            ops,
            skew_ms,
            clock_may_lag,
            clock_slack_ms,
            seed,
            report: report_file,
        } => {
            let seed = pick_seed(seed, "lin");
            let opened = faces::open(&store).await?;
            let mut bad = 0;
            let (mut keys, mut all_ops, mut unknown, mut inconclusive) = (0, 0, 0, 0);
            for h in 0..histories {
                let mut cfg = LinRunConfig::small(format!("lin.{seed}.{h}"));
                cfg.clients = clients;
                cfg.ops_per_client = ops;
                let events = linrun::run(Arc::clone(&opened), &cfg, seed.wrapping_add(h)).await;
                let report = lin::check(
                    &events,
                    &LinConfig {
                        skew_ms,
                        monotonic_clock: !clock_may_lag,
                        clock_slack_ms: clock_slack_ms
                            .unwrap_or_else(|| runner::clock_slack_ms(&store)),
                        ..LinConfig::default()
                    },
                );
                keys += report.keys.len();
                all_ops += report.ops();
                unknown += report.unknown();
                inconclusive += report.inconclusive();
                if !report.violations().is_empty() {
                    bad += 1;
                    println!("history {h}: {}", report.summary());
                }
            }
            println!(
                "lin {store}: seed {seed}: {histories} histories, {keys} keys, {all_ops} ops ({unknown} unknown), {bad} histories with violations, {inconclusive} keys inconclusive"
            );
            if let Some(f) = report_file {
                append_line(
                    &f,
                    &serde_json::json!({"kind": "lin", "store": store, "seed": seed,
                        "histories": histories, "keys": keys, "ops": all_ops, "unknown": unknown,
                        "violating_histories": bad, "inconclusive_keys": inconclusive}),
                )?;
            }
            Ok(if bad == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Failover {
            rounds,
            wait_replicas,
            clients,
            load_ms,
            replica_stall_ms,
            report: report_file,
        } => {
            let (mut acked, mut lost) = (0, 0);
            for _ in 0..rounds {
                let r = dedupgate_torture::failover::measure(
                    wait_replicas,
                    clients,
                    load_ms,
                    replica_stall_ms,
                )
                .await?;
                println!(
                    "failover wait_replicas={} replica_stall_ms={}: {} acknowledged, {} lost, {} unavailable",
                    r.wait_replicas, r.replica_stall_ms, r.acknowledged, r.lost, r.unavailable
                );
                acked += r.acknowledged;
                lost += r.lost;
                if let Some(f) = &report_file {
                    append_line(f, &serde_json::json!({"kind": "failover", "report": r}))?;
                }
            }
            println!("failover wait_replicas={wait_replicas} replica_stall_ms={replica_stall_ms}: {rounds} rounds, {acked} acknowledged, {lost} lost");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::StorageFaults(a) => Ok(dedupgate_torture::fault_cli::storage_faults_main(a).await?),
        Cmd::ClockJumps(a) => Ok(dedupgate_torture::fault_cli::clock_jumps_main(a).await?),
        Cmd::Summarize { file } => {
            let text = std::fs::read_to_string(file)?;
            println!("{}", summarize(&text));
            print!("{}", dedupgate_torture::fault_cli::summarize(&text));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Effect {
            dir,
            attempt,
            worker,
            lease_ms,
            gap_ms_max,
            idempotent,
        } => {
            let code = dedupgate_torture::cron::effect_main(
                &dir, &attempt, &worker, lease_ms, gap_ms_max, idempotent,
            )?;
            Ok(ExitCode::from(code as u8))
        }
        Cmd::Worker {
            store,
            dir,
            plan,
            cron,
            proxy,
        } => {
            let plan: WorkerPlan = serde_json::from_slice(&std::fs::read(&plan)?)?;
            let opened = faces::open_retrying(&store, 100).await?;
            let mut worker = Worker::new(opened, &dir, plan)?;
            if let Some(c) = cron {
                worker = worker.with_cron(serde_json::from_slice(&std::fs::read(c)?)?)?;
            }
            if let Some(p) = proxy {
                worker = worker.with_proxy(serde_json::from_slice(&std::fs::read(p)?)?)?;
            }
            worker.run().await?;
            eprintln!("{}", serde_json::to_string(&worker.stats)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Gate { store, listen } => {
            let opened = faces::open_retrying(&store, 100).await?;
            let listener = tokio::net::TcpListener::bind(&listen).await?;
            eprintln!("gate: {} on {listen}", opened.describe());
            faces::serve_gate(opened, listener, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn append_line(path: &std::path::Path, v: &serde_json::Value) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(f, "{v}")
}

/// Sums run and lin reports per (store kind, face).
fn summarize(text: &str) -> String {
    use std::collections::BTreeMap;
    let kind_of = |store: &str| store.split([':', '/']).next().unwrap_or(store).to_owned();
    let mut runs: BTreeMap<String, BTreeMap<&'static str, u64>> = BTreeMap::new();
    let mut lins: BTreeMap<String, BTreeMap<&'static str, u64>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let n = |p: &str| v.pointer(p).and_then(|x| x.as_u64()).unwrap_or(0);
        let len = |p: &str| {
            v.pointer(p)
                .and_then(|x| x.as_array())
                .map_or(0, |a| a.len() as u64)
        };
        match v.get("kind").and_then(|k| k.as_str()) {
            Some("run") => {
                let store = v
                    .pointer("/report/config/store")
                    .and_then(|s| s.as_str())
                    .unwrap_or("?");
                let face = v
                    .pointer("/report/config/face")
                    .and_then(|s| s.as_str())
                    .unwrap_or("?");
                let mut extra = String::new();
                if v.pointer("/report/config/tcp_faults")
                    .is_some_and(|t| !t.is_null())
                    || n("/report/config/tcp_cut_all_pct") > 0
                {
                    extra.push_str(" + TCP faults");
                }
                if n("/report/config/kill_store_pct") > 0 {
                    extra.push_str(" + store restarts");
                }
                let e = runs
                    .entry(format!("{} over {face}{extra}", kind_of(store)))
                    .or_default();
                for (name, value) in [
                    ("runs", 1),
                    ("cycles", n("/report/faults/cycles")),
                    ("worker_sigkills", n("/report/faults/worker_sigkills")),
                    ("gate_sigkills", n("/report/faults/gate_sigkills")),
                    ("store_sigkills", n("/report/faults/store_sigkills")),
                    ("tcp_cut_all", n("/report/faults/tcp_cut_all")),
                    ("run_invocations", n("/report/faults/cron/invocations")),
                    ("run_sigkills", n("/report/faults/cron/run_sigkills")),
                    ("run_ran", n("/report/faults/cron/ran")),
                    ("run_skipped", n("/report/faults/cron/skipped")),
                    ("run_gate_failed", n("/report/faults/cron/gate_failed")),
                    ("run_unknown", n("/report/faults/cron/unknown")),
                    ("proxy_requests", n("/report/faults/proxy/requests")),
                    ("proxy_fresh", n("/report/faults/proxy/fresh")),
                    ("proxy_replayed", n("/report/faults/proxy/replayed")),
                    ("proxy_in_flight", n("/report/faults/proxy/in_flight")),
                    ("proxy_5xx", n("/report/faults/proxy/server_errors")),
                    ("proxy_unknown", n("/report/faults/proxy/unknown")),
                    ("gate_start_retries", n("/report/faults/gate_start_retries")),
                    ("tcp_connections", n("/report/faults/tcp/connections")),
                    ("tcp_delays", n("/report/faults/tcp/delays")),
                    ("tcp_cuts", n("/report/faults/tcp/cuts")),
                    ("tcp_commanded_cuts", n("/report/faults/tcp/commanded_cuts")),
                    ("tcp_truncations", n("/report/faults/tcp/truncations")),
                    ("wrong_errors", len("/report/wrong_errors")),
                    ("sigstops", n("/report/faults/sigstops")),
                    ("sigconts", n("/report/faults/sigconts")),
                    ("takeovers", n("/report/faults/takeovers")),
                    ("events", n("/report/oracle/events_checked")),
                    ("answers", n("/report/oracle/answers_read")),
                    ("unknown_answers", n("/report/oracle/answers_unknown")),
                    ("effects", n("/report/oracle/effects_accepted")),
                    (
                        "late_writes_rejected",
                        n("/report/oracle/late_writes_rejected"),
                    ),
                    (
                        "stale_completions_refused",
                        n("/report/oracle/stale_completions_refused"),
                    ),
                    ("reexecutions", n("/report/oracle/reexecutions")),
                    (
                        "effects_without_completion_answer",
                        n("/report/oracle/effects_without_completion_answer"),
                    ),
                    ("duplicates", len("/report/oracle/duplicates")),
                    ("lost", len("/report/oracle/lost")),
                    ("fence_violations", len("/report/oracle/fence_violations")),
                    ("replay_mismatches", len("/report/oracle/replay_mismatches")),
                    ("lin_keys", n("/report/lin_keys")),
                    ("lin_ops", n("/report/lin_ops")),
                    ("lin_violations", len("/report/lin_violations")),
                    ("lin_inconclusive", n("/report/lin_inconclusive")),
                ] {
                    *e.entry(name).or_default() += value;
                }
            }
            Some("lin") => {
                let store = v.get("store").and_then(|s| s.as_str()).unwrap_or("?");
                let e = lins.entry(kind_of(store)).or_default();
                for name in [
                    "histories",
                    "keys",
                    "ops",
                    "unknown",
                    "violating_histories",
                    "inconclusive_keys",
                ] {
                    *e.entry(name).or_default() += n(&format!("/{name}"));
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    for (k, m) in runs.iter().chain(lins.iter()) {
        out.push_str(&format!("{k}:"));
        for (name, value) in m {
            out.push_str(&format!(" {name}={value}"));
        }
        out.push('\n');
    }
    out
}
