//! Kafka consumers as separate processes (issue #21 item 5), counted at the sink: each process is
//! this test binary run again as a [`KafkaConsumer`] in retriable mode over one PostgreSQL
//! store (`DEDUPGATE_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`; a
//! fresh schema and namespace per run), whose handler appends `key\n` to a sink file and
//! fsyncs it before returning. The stream is `common/workload.rs`'s: M = 2,000 records, 30%
//! copies (single copies at new offsets and a replay of a whole range), produced at a steady
//! pace on a tansu broker of the test's own (skipped, saying so, only when its binary is not
//! installed). Seeded: the seed is printed, `DEDUPGATE_KILL_SEED` replays it.
//!
//! - `a_rebalance_between_two_processes_adds_no_duplicate`: A consumes; B joins mid-stream (a
//!   rebalance), then leaves with SIGTERM (another); every key is in the sink exactly once.
//! - `a_process_killed_mid_stream_loses_nothing_and_duplicates_at_most_its_records_in_hand`:
//!   A consumes; B joins; A is killed with SIGKILL mid-stream and restarted; every key
//!   is in the sink, and the extra lines are at most the killed process's in-flight bound (a
//!   record whose handler wrote its line but whose key was not completed runs again on the
//!   next holder once the dead holder's lease ran out).
//!
//! `harness = false`: with `DEDUPGATE_KAFKA_KILL_CHILD` set the binary is a consumer process,
//! otherwise it runs the two tests (it lists them, and honours a name filter, for cargo).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::kafka::{self as broker, Broker};
use common::workload::{self, assert_nothing_lost, seed, KilledOnDrop};
use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer};
use dedupgate_consumers::{ConsumerGate, Message};
use dedupgate_core::{Gate, Mode};
use rand::{Rng, SeedableRng};

const M: usize = 2_000;
const D_PERCENT: usize = 30;
const PARTITIONS: i32 = 4;
/// 2,000 records in about 16 s, so that joins (about 3 s each), leaves and kills land
/// mid-stream.
const PER_TICK: usize = 25;
const TICK: Duration = Duration::from_millis(200);
/// Records in hand per consumer process: the bound on what one kill can run again.
const IN_FLIGHT: usize = 16;
/// The claims' lease: a killed process's claims are taken over this long after its last
/// renewal (the handler takes about 40 ms; the gate renews the lease while it runs).
const LEASE: Duration = Duration::from_secs(2);
const DEADLINE: Duration = Duration::from_secs(90);
/// How long each handler works before it writes its line.
const HANDLER_WORK: Duration = Duration::from_millis(40);

const TESTS: [&str; 2] = [
    "a_rebalance_between_two_processes_adds_no_duplicate",
    "a_process_killed_mid_stream_loses_nothing_and_duplicates_at_most_its_records_in_hand",
];

fn main() {
    if std::env::var_os("DEDUPGATE_KAFKA_KILL_CHILD").is_some() {
        return child();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        for name in TESTS {
            println!("{name}: test");
        }
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let selected = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(*f));
    for (name, test) in TESTS
        .into_iter()
        .zip([rebalance_only as fn(), kill_mid_stream])
    {
        if selected(name) {
            eprintln!("test {name} ...");
            test();
            eprintln!("test {name} ... ok");
        }
    }
}

// ---- the consumer process ----

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// One consumer process: consumes until SIGTERM, then settles, commits and exits 0. Prints
/// `assigned` on stdout once the group gave it partitions.
fn child() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (pg, mut options) =
            dedupgate_postgres::parse_url(&env("KILL_PG_URL")).expect("the test's URL parses");
        options.schema = env("KILL_PG_SCHEMA");
        options.pool_size = 4;
        let store = dedupgate_postgres::PgStore::connect(pg, options)
            .await
            .expect("the PostgreSQL store");
        let gate = ConsumerGate::new(Gate::new(store), &env("KILL_NAMESPACE"))
            .unwrap()
            .mode(Mode::Retriable)
            .lease(LEASE)
            .unwrap()
            .in_progress_retry(Duration::from_millis(200))
            .unwrap();
        let config = KafkaConfig::new(
            &env("KILL_BOOTSTRAP"),
            &env("KILL_GROUP"),
            &[&env("KILL_TOPIC")],
        )
        .unwrap()
        .set("session.timeout.ms", "6000")
        .unwrap()
        .set("heartbeat.interval.ms", "500")
        .unwrap()
        .commit_every(Duration::from_millis(50))
        .unwrap()
        .in_flight(IN_FLIGHT)
        .unwrap();
        let consumer = Arc::new(KafkaConsumer::new(gate, config).expect("the consumer"));
        let sink = Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(env("KILL_SINK"))
                .expect("the sink file"),
        ));
        let watching = consumer.clone();
        tokio::spawn(async move {
            while watching.stats().partitions_assigned == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("assigned");
        });
        let handler = move |msg: Message| {
            let sink = sink.clone();
            async move {
                // The handler's work before its effect: records stay in hand long enough
                // (IN_FLIGHT of them at the pace of the stream) for a kill to find some.
                tokio::time::sleep(HANDLER_WORK).await;
                tokio::task::spawn_blocking(move || {
                    let mut file = sink.lock().unwrap();
                    // One write per line: O_APPEND keeps the two processes' lines whole.
                    file.write_all(format!("{}\n", msg.key).as_bytes())?;
                    file.sync_data()
                })
                .await
                .expect("the sink write task")
            }
        };
        let stats = consumer
            .run(handler, async {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                term.recv().await;
            })
            .await
            .expect("the consumer ran");
        eprintln!("{stats:?}");
    });
}

// ---- the test side ----

/// A consumer process, killed on drop; `assigned` says when it first got partitions.
struct Process {
    child: KilledOnDrop,
    assigned: mpsc::Receiver<()>,
}

impl Process {
    /// SIGTERM, and its exit code (0: it settled what was in hand and committed).
    fn terminate(self) -> Option<i32> {
        self.child.terminate()
    }

    fn wait_assigned(&self, scene: &Scene) {
        self.assigned
            .recv_timeout(Duration::from_secs(40))
            .unwrap_or_else(|_| panic!("a consumer got no partitions:\n{}", scene.log()));
    }
}

/// One test's broker, topic, group, store and sink.
struct Scene {
    broker: Broker,
    topic: String,
    group: String,
    pg_url: String,
    schema: String,
    namespace: String,
    sink: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Scene {
    fn new(broker: Broker) -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self {
            broker,
            topic: common::unique("kill"),
            group: common::unique("kill-group"),
            pg_url: std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
            schema: format!("dgtest_kafka_kill_{:016x}", rand::random::<u64>()),
            namespace: common::unique("kill"),
            sink: dir.path().join("sink.txt"),
            log: dir.path().join("consumers.log"),
            _dir: dir,
        }
    }

    fn start(&self, name: &str) -> Process {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("consumers' log");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("DEDUPGATE_KAFKA_KILL_CHILD", name)
            .env("KILL_PG_URL", &self.pg_url)
            .env("KILL_PG_SCHEMA", &self.schema)
            .env("KILL_NAMESPACE", &self.namespace)
            .env("KILL_BOOTSTRAP", &self.broker.bootstrap)
            .env("KILL_GROUP", &self.group)
            .env("KILL_TOPIC", &self.topic)
            .env("KILL_SINK", &self.sink)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start a consumer process");
        let stdout = child.stdout.take().unwrap();
        let (tx, assigned) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "assigned" {
                    let _ = tx.send(());
                }
            }
        });
        Process {
            child: KilledOnDrop(child),
            assigned,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn sink_lines(&self) -> usize {
        std::fs::read(&self.sink)
            .map(|b| b.iter().filter(|c| **c == b'\n').count())
            .unwrap_or(0)
    }

    /// Waits until the sink has at least `n` lines.
    fn wait_lines(&self, n: usize) {
        let deadline = Instant::now() + DEADLINE;
        while self.sink_lines() < n {
            assert!(
                Instant::now() < deadline,
                "the sink stayed below {n} lines:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the group's committed offsets reach `ends`.
    fn wait_committed(&self, runtime: &tokio::runtime::Runtime, ends: &[i64]) {
        runtime
            .block_on(broker::wait_committed(
                &self.broker.bootstrap,
                &self.group,
                &self.topic,
                ends,
                DEADLINE,
            ))
            .unwrap_or_else(|e| panic!("{e}:\n{}", self.log()));
    }

    /// Each key's lines in the sink.
    fn counts(&self) -> BTreeMap<String, usize> {
        let text = std::fs::read_to_string(&self.sink).unwrap_or_default();
        let mut counts = BTreeMap::new();
        for line in text.lines() {
            *counts.entry(line.to_owned()).or_default() += 1;
        }
        counts
    }

    fn drop_schema(&self, runtime: &tokio::runtime::Runtime) {
        runtime.block_on(async {
            let (client, conn) = tokio_postgres::connect(&self.pg_url, tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("connect {}: {e}", self.pg_url));
            tokio::spawn(conn);
            let _ = client
                .batch_execute(&format!(
                    "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                    self.schema
                ))
                .await;
        });
    }
}

/// Starts the broker, the topic, and the paced production of the workload; the production's
/// task answers each partition's end.
fn begin(
    runtime: &tokio::runtime::Runtime,
    seed: u64,
) -> Option<(Scene, BTreeSet<String>, tokio::task::JoinHandle<Vec<i64>>)> {
    let broker = broker::start()?;
    let scene = Scene::new(broker);
    runtime.block_on(scene.broker.create_topic(&scene.topic, PARTITIONS));
    // The schema is made once here, so the processes never race to create it.
    runtime.block_on(async {
        let (pg, mut options) = dedupgate_postgres::parse_url(&scene.pg_url).unwrap();
        options.schema = scene.schema.clone();
        options.pool_size = 1;
        dedupgate_postgres::PgStore::connect(pg, options)
            .await
            .unwrap_or_else(|e| panic!("this test needs PostgreSQL at {}: {e}", scene.pg_url));
    });
    let work = workload::build(seed, M, D_PERCENT, PARTITIONS);
    let producer = scene.broker.producer();
    let topic = scene.topic.clone();
    let records = work.records;
    let producing = runtime.spawn(async move {
        workload::produce_paced(&producer, &topic, PARTITIONS, &records, PER_TICK, TICK).await
    });
    Some((scene, work.distinct, producing))
}

/// A then B in one group, B leaving with SIGTERM: two rebalances, no kill. Each revoke leaves
/// the records in hand to the next holder, which finds their keys completed or waits for them
/// (the gate renews a running handler's lease): every key runs exactly once.
fn rebalance_only() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let seed = seed("kafka_kill");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let Some((scene, distinct, producing)) = begin(&runtime, seed) else {
        return;
    };
    let a = scene.start("a");
    a.wait_assigned(&scene);
    scene.wait_lines(rng.gen_range(100..=400));
    let b = scene.start("b");
    b.wait_assigned(&scene);
    let lines = scene.sink_lines();
    scene.wait_lines(lines + rng.gen_range(50..=200));
    eprintln!("kafka_kill: B leaves at {} lines", scene.sink_lines());
    assert_eq!(b.terminate(), Some(0), "B's exit:\n{}", scene.log());
    let ends = runtime.block_on(producing).unwrap();
    scene.wait_committed(&runtime, &ends);
    assert_eq!(a.terminate(), Some(0), "A's exit:\n{}", scene.log());
    let counts = scene.counts();
    scene.drop_schema(&runtime);
    assert_nothing_lost(&counts, &distinct, || scene.log());
    let twice: Vec<(&String, &usize)> = counts.iter().filter(|(_, c)| **c > 1).collect();
    assert!(
        twice.is_empty(),
        "a rebalance ran keys twice: {twice:?}\n{}",
        scene.log()
    );
}

/// A then B in one group; once B got its partitions, A is killed with SIGKILL after a random
/// number of further lines (while it handles its share) and restarted. Nothing is lost: A's records in
/// hand were not committed, so the group delivers them again. A key whose handler ran on A but
/// was not completed runs again (once A's lease ran out), so the sink has at most
/// `IN_FLIGHT` extra lines for the one kill.
fn kill_mid_stream() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let seed = seed("kafka_kill");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let Some((scene, distinct, producing)) = begin(&runtime, seed) else {
        return;
    };
    let a = scene.start("a");
    a.wait_assigned(&scene);
    scene.wait_lines(rng.gen_range(100..=400));
    let b = scene.start("b");
    b.wait_assigned(&scene);
    // Both hold partitions again: A is killed while it handles its share of the stream.
    let lines = scene.sink_lines();
    scene.wait_lines(lines + rng.gen_range(1..=100));
    eprintln!(
        "kafka_kill: SIGKILL A at {} lines, after B joined at {lines}",
        scene.sink_lines()
    );
    // Child::kill is SIGKILL.
    drop(a);
    let a = scene.start("a2");
    let ends = runtime.block_on(producing).unwrap();
    scene.wait_committed(&runtime, &ends);
    assert_eq!(a.terminate(), Some(0), "A's exit:\n{}", scene.log());
    assert_eq!(b.terminate(), Some(0), "B's exit:\n{}", scene.log());
    let counts = scene.counts();
    scene.drop_schema(&runtime);
    assert_nothing_lost(&counts, &distinct, || scene.log());
    let again: usize = counts.values().map(|c| c - 1).sum();
    eprintln!(
        "kafka_kill: {} keys, {again} ran again after the kill (bound {IN_FLIGHT})",
        distinct.len()
    );
    assert!(
        again <= IN_FLIGHT,
        "{again} keys ran again after one kill of a process with {IN_FLIGHT} in flight:\n{}",
        scene.log()
    );
}
