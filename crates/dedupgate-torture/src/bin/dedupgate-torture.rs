//! `dedupgate-torture`: the harness's command line.
//!
//! - `run`: a whole torture run (gate and worker processes, faults, drain, oracles); prints the
//!   report and exits 1 when an invariant broke.
//! - `lin`: a concurrent history on any STORE, checked for linearizability.
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
        /// Do not require the store's clock to be non-decreasing in the linearization (for a
        /// store that reads its clock before waiting for a lock: PostgreSQL).
        #[arg(long)]
        clock_may_lag: bool,
        /// Seed (default: random, printed).
        #[arg(long)]
        seed: Option<u64>,
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
            eprintln!("dedupgate-torture: {e}");
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
            lease_ms,
            dir,
            seed,
            no_lin,
            json,
        } => {
            let seed = pick_seed(seed, "torture run");
            let dir = dir.unwrap_or_else(|| {
                std::env::temp_dir()
                    .join(format!("dedupgate-torture-{}-{seed}", std::process::id()))
            });
            let face = match face {
                FaceArg::Library => Face::Library,
                FaceArg::Http => Face::Http,
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
            cfg.lease_ms = lease_ms;
            cfg.lin = !no_lin;
            eprintln!("torture run: files in {}", dir.display());
            let report = runner::run(cfg).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
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
            seed,
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
            Ok(if bad == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Worker { store, dir, plan } => {
            let plan: WorkerPlan = serde_json::from_slice(&std::fs::read(&plan)?)?;
            let opened = faces::open(&store).await?;
            let mut worker = Worker::new(opened, &dir, plan)?;
            worker.run().await?;
            eprintln!("{}", serde_json::to_string(&worker.stats)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Gate { store, listen } => {
            let opened = faces::open(&store).await?;
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
