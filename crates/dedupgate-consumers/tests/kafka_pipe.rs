//! The transactional pipe (Kafka to Kafka, exactly once) against a real Kafka-protocol broker
//! each test starts (tansu, see `common/kafka.rs`; skipped, saying so, only when its binary is
//! not installed): M records with D% duplicate keys come out once per key and the group's
//! offsets reach the end; a transaction aborted mid-batch releases its claims, its records are
//! consumed again, and each key comes out of a committed transaction once; a rebalance with a
//! transaction open aborts it on the revoke; shutdown interrupts a record being retried. On
//! librdkafka's mock cluster (errors injected): a commit the coordinator refuses aborts the
//! batch, which runs again; a fenced producer stops the pipe with an error, its claims
//! released; a commit slower than the lease keeps its claims renewed; a commit whose outcome
//! stays unknown stops the pipe with its claims held.
//!
//! What tansu cannot show: it does not filter aborted records from a `read_committed` reader.
//! So the tests tell committed outputs from aborted ones by the gate's own log (every handler
//! run stamps its outputs; a run whose claim was completed is one whose transaction committed,
//! a run whose claim was released is one whose transaction aborted) and check that split
//! against Kafka's side: the committed runs' outputs are each key exactly once, and every
//! record's offset is committed. That an aborted transaction's records are invisible is
//! Kafka's guarantee, not checked here.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::kafka::{self as broker, Broker};
use common::unique;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use dedupgate_consumers::kafka::rdkafka::message::{Headers, Message as _};
use dedupgate_consumers::kafka::rdkafka::mocking::MockCluster;
use dedupgate_consumers::kafka::rdkafka::producer::{DefaultProducerContext, FutureProducer};
use dedupgate_consumers::kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};
use dedupgate_consumers::kafka::{
    Input, KafkaConfig, KafkaError, Output, PipeConfig, PipeStats, TransactionalPipe,
    DEDUP_KEY_HEADER,
};
use dedupgate_consumers::ConsumerGate;
use dedupgate_core::{
    Claim, Gate, GateError, MemoryStore, Outcome, RecordId, Store, StoreError, StoreStats, ValidOp,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

const DEADLINE: Duration = Duration::from_secs(120);
/// The header each output carries with the number of the handler run that made it.
const RUN_HEADER: &str = "test-run";

/// The memory store, logging every claim that was granted and every release and completion
/// that succeeded, in order: the gate's side of each transaction.
#[derive(Default)]
struct LoggedStore {
    inner: MemoryStore,
    log: Arc<Mutex<Vec<(String, &'static str)>>>,
}

#[async_trait]
impl Store for LoggedStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        let key = id.key.as_str().to_owned();
        let outcome = self.inner.apply(id, op).await?;
        let event = match &outcome {
            Outcome::Claimed(Claim::New(_)) => Some("claimed"),
            Outcome::Released => Some("released"),
            Outcome::Completed(_) => Some("completed"),
            _ => None,
        };
        if let Some(event) = event {
            self.log.lock().unwrap().push((key, event));
        }
        Ok(outcome)
    }
    async fn health(&self) -> Result<(), StoreError> {
        self.inner.health().await
    }
    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        self.inner.sweep_expired(batch_max).await
    }
    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.inner.stats().await
    }
    fn describe(&self) -> String {
        "memory, logged".into()
    }
}

type Log = Arc<Mutex<Vec<(String, &'static str)>>>;

fn gate() -> (ConsumerGate, Log) {
    let store = LoggedStore::default();
    let log = store.log.clone();
    let gate = ConsumerGate::new(Gate::new(store), "pipe-test")
        .unwrap()
        .in_progress_retry(Duration::from_millis(50))
        .unwrap()
        .unavailable_retry(Duration::from_millis(200))
        .unwrap()
        .failure_retry(Duration::from_millis(20), Duration::from_millis(60))
        .unwrap();
    (gate, log)
}

fn source(broker: &Broker, group: &str, topic: &str) -> KafkaConfig {
    KafkaConfig::new(&broker.bootstrap, group, &[topic])
        .unwrap()
        .set("session.timeout.ms", "6000")
        .unwrap()
        .set("heartbeat.interval.ms", "500")
        .unwrap()
}

/// Which handler run made which key's outputs, by run number.
#[derive(Default)]
struct Runs {
    next: AtomicU64,
    keys: Mutex<BTreeMap<u64, String>>,
}

impl Runs {
    fn start(&self, key: &str) -> u64 {
        let run = self.next.fetch_add(1, Ordering::SeqCst);
        self.keys.lock().unwrap().insert(run, key.to_owned());
        run
    }
}

/// The runs whose claim was completed (their transaction committed) and those whose claim was
/// released (aborted), from the store's log: a key's n-th run held its n-th claim.
fn committed_and_aborted(runs: &Runs, log: &Log) -> (Vec<u64>, Vec<u64>) {
    let mut ends: BTreeMap<String, Vec<&'static str>> = BTreeMap::new();
    for (key, event) in log.lock().unwrap().iter() {
        if *event != "claimed" {
            ends.entry(key.clone()).or_default().push(event);
        }
    }
    let mut nth: BTreeMap<String, usize> = BTreeMap::new();
    let (mut committed, mut aborted) = (Vec::new(), Vec::new());
    for (run, key) in runs.keys.lock().unwrap().iter() {
        let n = nth.entry(key.clone()).or_default();
        match ends.get(key).and_then(|e| e.get(*n)) {
            Some(&"completed") => committed.push(*run),
            Some(_) => aborted.push(*run),
            None => {}
        }
        *n += 1;
    }
    (committed, aborted)
}

/// Every record of `topic` as a `read_committed` reader sees it: (dedup key, run), read until
/// `min` are in and nothing more came for 3 s.
async fn read_outputs(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    min: usize,
) -> Vec<(String, u64)> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let started = Instant::now();
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(3), consumer.recv()).await {
            Ok(Ok(m)) => {
                let header = |name: &str| {
                    m.headers()
                        .and_then(|h| h.iter().find(|h| h.key == name))
                        .and_then(|h| h.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                };
                let key = header(DEDUP_KEY_HEADER).expect("the pipe sets the key header");
                let run = header(RUN_HEADER)
                    .and_then(|r| r.parse().ok())
                    .expect("run header");
                out.push((key, run));
            }
            Ok(Err(e)) => panic!("reading {topic}: {e}"),
            Err(_) if out.len() >= min => return out,
            Err(_) => assert!(started.elapsed() < DEADLINE, "read {} of {min}", out.len()),
        }
    }
}

/// The pipe's handler for the tests: one output per record, stamped with its run; on the run
/// numbered `oversize_run` (once), an output too large to produce, which aborts the batch.
fn handler(
    runs: Arc<Runs>,
    out_topic: String,
    oversize_run: Option<u64>,
) -> impl Fn(Input) -> std::future::Ready<Result<Vec<Output>, String>> {
    move |input: Input| {
        let run = runs.start(&input.key);
        let payload = if Some(run) == oversize_run {
            // Over librdkafka's message.max.bytes (1 MB): refused when enqueued.
            vec![b'x'; 2 << 20]
        } else {
            input.record.payload.clone()
        };
        std::future::ready(Ok(vec![
            Output::new(&out_topic, payload).header(RUN_HEADER, run.to_string())
        ]))
    }
}

/// Runs `pipe` in a task until the returned sender says stop (or is dropped).
fn spawn<H, Fut>(
    pipe: TransactionalPipe,
    handler: H,
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<Result<PipeStats, KafkaError>>,
)
where
    H: Fn(Input) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Vec<Output>, String>> + Send + 'static,
{
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        pipe.run(handler, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await
    });
    (stop, task)
}

/// `distinct` keys and `total` records over them, shuffled, spread over `partitions`.
fn records(distinct: usize, total: usize, partitions: i32) -> Vec<(i32, String)> {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut keys: Vec<String> = (0..distinct).map(|i| format!("order-{i:04}")).collect();
    for _ in distinct..total {
        keys.push(format!("order-{:04}", rng.gen_range(0..distinct)));
    }
    keys.shuffle(&mut rng);
    keys.into_iter()
        .map(|k| (rng.gen_range(0..partitions), k))
        .collect()
}

async fn produce(
    broker: &Broker,
    topic: &str,
    partitions: i32,
    records: &[(i32, String)],
) -> Vec<i64> {
    let payloads: Vec<String> = records
        .iter()
        .map(|(_, k)| format!("{{\"order\":\"{k}\"}}"))
        .collect();
    let batch: Vec<(i32, Option<&str>, &[u8])> = records
        .iter()
        .zip(&payloads)
        .map(|((p, k), v)| (*p, Some(k.as_str()), v.as_bytes()))
        .collect();
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), topic, partitions, &batch, &mut ends).await;
    ends
}

/// Per key, how many outputs of `runs` came out.
fn per_key(outputs: &[(String, u64)], runs: &[u64]) -> BTreeMap<String, u32> {
    let mut counts = BTreeMap::new();
    for (key, run) in outputs {
        if runs.contains(run) {
            *counts.entry(key.clone()).or_default() += 1;
        }
    }
    counts
}

/// M records with D% duplicates (the same key on new offsets, over two partitions): each
/// distinct key comes out once, from one committed run; no run was aborted; the input group's
/// committed offsets reach each partition's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_come_out_once_and_the_offsets_commit_with_the_outputs() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (input, output, group) = (unique("orders"), unique("enriched"), unique("pipe"));
    broker.create_topic(&input, 2).await;
    broker.create_topic(&output, 2).await;
    let (distinct, total) = (120, 200);
    let ends = produce(&broker, &input, 2, &records(distinct, total, 2)).await;

    let (gate, log) = gate();
    let config = PipeConfig::new(source(&broker, &group, &input), &unique("tx"))
        .unwrap()
        .batch(25, Duration::from_millis(50))
        .unwrap();
    let pipe = TransactionalPipe::new(gate, config).unwrap();
    let runs = Arc::new(Runs::default());
    let (stop, task) = spawn(pipe, handler(runs.clone(), output.clone(), None));
    broker::wait_committed(&broker.bootstrap, &group, &input, &ends, DEADLINE)
        .await
        .unwrap();
    stop.send(true).unwrap();
    let stats = task.await.unwrap().expect("pipe run");
    println!("{stats:?}");

    let outputs = read_outputs(&broker.bootstrap, &output, 2, distinct).await;
    let (committed, aborted) = committed_and_aborted(&runs, &log);
    assert_eq!(aborted, Vec::<u64>::new());
    let all: Vec<u64> = runs.keys.lock().unwrap().keys().copied().collect();
    let counts = per_key(&outputs, &all);
    assert_eq!(counts.len(), distinct, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    assert_eq!(committed.len(), distinct);
    assert_eq!(stats.ran as usize, distinct);
    assert_eq!(stats.duplicates as usize, total - distinct);
    assert_eq!(stats.transactions_aborted, 0);
    assert!(
        stats.transactions_committed >= (total / 25) as u64,
        "{stats:?}"
    );
}

/// A produce failing mid-batch (an output too large, on one run, after earlier records of the
/// batch produced theirs into the open transaction) aborts the transaction: every claim of
/// the batch is released, the batch's records are consumed again, and each key comes out of a
/// committed run exactly once; the offsets still reach the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_aborted_mid_batch_releases_its_claims_and_runs_again() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (input, output, group) = (unique("orders"), unique("enriched"), unique("pipe"));
    broker.create_topic(&input, 1).await;
    broker.create_topic(&output, 1).await;
    let distinct = 60;
    let keys: Vec<(i32, String)> = (0..distinct)
        .map(|i| (0, format!("order-{i:04}")))
        .collect();
    let ends = produce(&broker, &input, 1, &keys).await;

    let (gate, log) = gate();
    // Batches of 20 by count (the time bound is far): records 20..39 are one batch, and the
    // run of record 30 (the 31st run) fails to produce.
    let config = PipeConfig::new(source(&broker, &group, &input), &unique("tx"))
        .unwrap()
        .batch(20, Duration::from_secs(5))
        .unwrap();
    let pipe = TransactionalPipe::new(gate.clone(), config).unwrap();
    let runs = Arc::new(Runs::default());
    let (stop, task) = spawn(pipe, handler(runs.clone(), output.clone(), Some(30)));
    broker::wait_committed(&broker.bootstrap, &group, &input, &ends, DEADLINE)
        .await
        .unwrap();
    stop.send(true).unwrap();
    let stats = task.await.unwrap().expect("pipe run");
    println!("{stats:?}");
    assert_eq!(stats.transactions_aborted, 1, "{stats:?}");

    // The aborted batch's claims: records 20..=30, each claimed, released, claimed again and
    // completed; nothing else was released.
    let (committed, aborted) = committed_and_aborted(&runs, &log);
    let keys_of = |runs_: &[u64]| -> Vec<String> {
        let k = runs.keys.lock().unwrap();
        runs_.iter().map(|r| k[r].clone()).collect()
    };
    let want: Vec<String> = (20..=30).map(|i| format!("order-{i:04}")).collect();
    assert_eq!(keys_of(&aborted), want);
    for key in &want {
        let events: Vec<&str> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, e)| *e)
            .collect();
        assert_eq!(
            events,
            ["claimed", "released", "claimed", "completed"],
            "{key}"
        );
    }
    // Every key ends completed in the store.
    for (_, key) in &keys {
        let record = gate.gate().get("pipe-test", key).await.unwrap().expect(key);
        assert_eq!(record.state, dedupgate_core::State::Completed, "{key}");
    }

    // What committed runs produced: each key once. (The aborted runs' outputs are left to
    // Kafka's read_committed filtering, which tansu does not do.)
    let outputs = read_outputs(&broker.bootstrap, &output, 1, distinct).await;
    let counts = per_key(&outputs, &committed);
    assert_eq!(counts.len(), distinct, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let stray: Vec<_> = outputs
        .iter()
        .filter(|(_, run)| !committed.contains(run) && !aborted.contains(run))
        .collect();
    assert!(stray.is_empty(), "outputs of no known run: {stray:?}");
}

/// A fenced producer (the transaction coordinator answers the commit with PRODUCER_FENCED, as
/// it does once another instance initialized the same transactional id; injected on
/// librdkafka's mock cluster, because tansu was not seen to fence) stops the pipe with
/// [`KafkaError::Fenced`], its open batch's claims released and nothing of it completed. A
/// pipe started again with that id takes over: each key is completed once, and comes out of
/// a committed run once. (The mock cluster keeps no offsets sent to a transaction, so the
/// restarted pipe reads from the start: the gate is what keeps the first pipe's committed
/// records from coming out twice here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_pipe_stops_with_an_error_and_releases_its_claims() {
    let distinct = 30;
    let mock = Mock::start(distinct).await;
    let (keys, output) = (&mock.keys, &mock.output);
    let transactional_id = unique("tx");
    let config = || {
        PipeConfig::new(mock.source(), &transactional_id)
            .unwrap()
            .batch(5, Duration::from_secs(5))
            .unwrap()
    };

    let (gate, log) = gate();
    let runs = Arc::new(Runs::default());
    let (release, released) = watch::channel(false);
    let first = TransactionalPipe::new(gate.clone(), config()).unwrap();
    // Never told to stop: the fence stops it.
    let (_first_stop, first_task) = spawn(
        first,
        latched_handler(runs.clone(), output.clone(), "order-0012", released),
    );
    wait_for_run(&runs, "order-0012").await;
    mock.cluster.request_errors(
        RDKafkaApiKey::EndTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_PRODUCER_FENCED],
    );
    release.send(true).unwrap();
    let first_result = tokio::time::timeout(Duration::from_secs(60), first_task)
        .await
        .expect("the fenced pipe stops")
        .unwrap();
    assert!(
        matches!(&first_result, Err(KafkaError::Fenced { transactional_id: t, .. }) if *t == transactional_id),
        "{first_result:?}"
    );
    let events = |key: &str| events_of(&log, key);
    for key in &keys[..10] {
        assert_eq!(events(key), ["claimed", "completed"], "{key}");
    }
    for key in &keys[10..15] {
        assert_eq!(events(key), ["claimed", "released"], "{key}");
    }
    assert!(events(&keys[15]).is_empty());

    // Started again with the same id: it takes over.
    let second = TransactionalPipe::new(gate.clone(), config()).unwrap();
    let (stop, second_task) = spawn(second, handler(runs.clone(), output.clone(), None));
    let started = Instant::now();
    loop {
        let completed = log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, e)| *e == "completed")
            .count();
        if completed >= distinct {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "completed {completed} of {distinct}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    let stats = second_task.await.unwrap().expect("second pipe");
    println!("{stats:?}");
    assert_eq!(stats.duplicates, 10, "{stats:?}");
    for key in keys {
        let completed = events(key).iter().filter(|e| **e == "completed").count();
        assert_eq!(completed, 1, "{key}: {:?}", events(key));
    }
    let (committed, _aborted) = committed_and_aborted(&runs, &log);
    let outputs = read_outputs(&mock.bootstrap, output, 1, distinct).await;
    let counts = per_key(&outputs, &committed);
    assert_eq!(counts.len(), distinct, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
}

/// A rebalance while a transaction is open: the first pipe has taken every record into one
/// open transaction when a second pipe (its own transactional id) joins the group. The revoke
/// aborts that transaction before the partitions go and releases its claims; the two pipes
/// then share the partitions, and each key is completed once and comes out of a committed
/// run once, with the offsets at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoke_aborts_the_open_transaction_and_releases_its_claims() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (input, output, group) = (unique("orders"), unique("enriched"), unique("pipe"));
    broker.create_topic(&input, 2).await;
    broker.create_topic(&output, 2).await;
    let (distinct, total) = (60, 80);
    let ends = produce(&broker, &input, 2, &records(distinct, total, 2)).await;

    let (gate, log) = gate();
    // A long lease allows a batch open for 30 s: the join below comes well within it.
    let gate = gate.lease(Duration::from_secs(90)).unwrap();
    let config = || {
        PipeConfig::new(source(&broker, &group, &input), &unique("tx"))
            .unwrap()
            .batch(1000, Duration::from_secs(30))
            .unwrap()
    };
    let runs = Arc::new(Runs::default());
    let first = TransactionalPipe::new(gate.clone(), config()).unwrap();
    let (stop_first, first_task) = spawn(first, handler(runs.clone(), output.clone(), None));
    let started = Instant::now();
    while runs.keys.lock().unwrap().len() < distinct {
        assert!(
            started.elapsed() < DEADLINE,
            "the first pipe ran {} keys",
            runs.keys.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !log.lock().unwrap().iter().any(|(_, e)| *e == "completed"),
        "nothing is committed yet"
    );
    let second = TransactionalPipe::new(gate.clone(), config()).unwrap();
    let (stop_second, second_task) = spawn(second, handler(runs.clone(), output.clone(), None));
    broker::wait_committed(&broker.bootstrap, &group, &input, &ends, DEADLINE)
        .await
        .unwrap();
    stop_first.send(true).unwrap();
    stop_second.send(true).unwrap();
    let first_stats = first_task.await.unwrap().expect("first pipe");
    let second_stats = second_task.await.unwrap().expect("second pipe");
    println!("{first_stats:?}\n{second_stats:?}");
    assert!(first_stats.transactions_aborted >= 1, "{first_stats:?}");

    let (committed, aborted) = committed_and_aborted(&runs, &log);
    assert!(aborted.len() >= distinct, "aborted runs: {aborted:?}");
    let outputs = read_outputs(&broker.bootstrap, &output, 2, distinct).await;
    let counts = per_key(&outputs, &committed);
    assert_eq!(counts.len(), distinct, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    assert_eq!(committed.len(), distinct);
}

/// A commit the coordinator refuses (an error librdkafka makes abortable, injected on the mock
/// cluster's EndTxn once the batch of records 10..14 is open) aborts that transaction: its
/// five claims are released, its records consumed again and committed by the next
/// transaction, and each key is completed once and comes out of a committed run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_the_broker_refuses_aborts_and_the_batch_runs_again() {
    let distinct = 30;
    let mock = Mock::start(distinct).await;
    let (keys, output) = (&mock.keys, &mock.output);
    let config = PipeConfig::new(mock.source(), &unique("tx"))
        .unwrap()
        .batch(5, Duration::from_secs(5))
        .unwrap();

    let (gate, log) = gate();
    let runs = Arc::new(Runs::default());
    let (release, released) = watch::channel(false);
    let pipe = TransactionalPipe::new(gate.clone(), config).unwrap();
    let (stop, task) = spawn(
        pipe,
        latched_handler(runs.clone(), output.clone(), "order-0012", released),
    );
    wait_for_run(&runs, "order-0012").await;
    mock.cluster.request_errors(
        RDKafkaApiKey::EndTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN],
    );
    release.send(true).unwrap();
    let events = |key: &str| events_of(&log, key);
    let started = Instant::now();
    while keys.iter().any(|k| !events(k).contains(&"completed")) {
        assert!(
            started.elapsed() < DEADLINE,
            "log: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    let stats = task.await.unwrap().expect("pipe run");
    println!("{stats:?}");
    assert_eq!(stats.transactions_aborted, 1, "{stats:?}");
    for key in &keys[10..15] {
        assert_eq!(
            events(key),
            ["claimed", "released", "claimed", "completed"],
            "{key}"
        );
    }
    for key in keys[..10].iter().chain(&keys[15..]) {
        assert_eq!(events(key), ["claimed", "completed"], "{key}");
    }
    let (committed, _aborted) = committed_and_aborted(&runs, &log);
    let outputs = read_outputs(&mock.bootstrap, output, 1, distinct).await;
    let counts = per_key(&outputs, &committed);
    assert_eq!(counts.len(), distinct, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
}

/// One test's librdkafka mock cluster (one broker), its one-partition `input` and `output`
/// topics, the input's consumer group, and the keys of the records on the input.
struct Mock {
    cluster: MockCluster<'static, DefaultProducerContext>,
    bootstrap: String,
    input: String,
    output: String,
    group: String,
    keys: Vec<String>,
}

impl Mock {
    /// The cluster, with `distinct` records `order-0000`… on the input ([`produce_to_mock`]).
    async fn start(distinct: usize) -> Self {
        let cluster = MockCluster::new(1).expect("mock cluster");
        let bootstrap = cluster.bootstrap_servers();
        let (input, output, group) = (unique("orders"), unique("enriched"), unique("pipe"));
        cluster.create_topic(&input, 1, 1).unwrap();
        cluster.create_topic(&output, 1, 1).unwrap();
        let keys = produce_to_mock(&bootstrap, &input, distinct).await;
        Self {
            cluster,
            bootstrap,
            input,
            output,
            group,
            keys,
        }
    }

    /// The pipe's source: the input topic, in the group.
    fn source(&self) -> KafkaConfig {
        KafkaConfig::new(&self.bootstrap, &self.group, &[self.input.as_str()]).unwrap()
    }
}

/// `distinct` records `order-0000`… on partition 0 of `input` on a mock cluster, payload `{}`.
async fn produce_to_mock(bootstrap: &str, input: &str, distinct: usize) -> Vec<String> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let keys: Vec<String> = (0..distinct).map(|i| format!("order-{i:04}")).collect();
    let batch: Vec<(i32, Option<&str>, &[u8])> = keys
        .iter()
        .map(|k| (0, Some(k.as_str()), &b"{}"[..]))
        .collect();
    broker::produce(&producer, input, 1, &batch, &mut Vec::new()).await;
    keys
}

/// What the latched handler returns for one run.
type Outputs =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<Output>, String>> + Send>>;

/// A handler whose run of `latch_key` waits until `release` says go; every run is stamped.
fn latched_handler(
    runs: Arc<Runs>,
    output: String,
    latch_key: &'static str,
    released: watch::Receiver<bool>,
) -> impl Fn(Input) -> Outputs {
    move |input: Input| {
        let run = runs.start(&input.key);
        let (output, mut released) = (output.clone(), released.clone());
        Box::pin(async move {
            if input.key == latch_key {
                let _ = released.wait_for(|r| *r).await;
            }
            Ok(vec![
                Output::new(&output, input.record.payload).header(RUN_HEADER, run.to_string())
            ])
        })
    }
}

/// Waits until the handler has started a run of `key`.
async fn wait_for_run(runs: &Runs, key: &str) {
    let started = Instant::now();
    while !runs.keys.lock().unwrap().values().any(|k| k == key) {
        assert!(started.elapsed() < DEADLINE, "the pipe never reached {key}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn events_of(log: &Log, key: &str) -> Vec<&'static str> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, e)| *e)
        .collect()
}

/// Shutdown while the record in hand is being retried (its handler fails every time, no
/// `max_attempts`): the pipe stops within a bounded time instead of retrying forever, the
/// failing key's claim is released, the records before it are committed and it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_interrupts_a_record_being_retried() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (input, output, group) = (unique("orders"), unique("enriched"), unique("pipe"));
    broker.create_topic(&input, 1).await;
    broker.create_topic(&output, 1).await;
    let keys: Vec<(i32, String)> = (0..3).map(|i| (0, format!("order-{i:04}"))).collect();
    produce(&broker, &input, 1, &keys).await;

    let (gate, log) = gate();
    let config = PipeConfig::new(source(&broker, &group, &input), &unique("tx"))
        .unwrap()
        .batch(10, Duration::from_secs(1))
        .unwrap();
    let pipe = TransactionalPipe::new(gate, config).unwrap();
    let (failed, mut failures) = watch::channel(0u32);
    let out = output.clone();
    let handler = move |input: Input| {
        let fail = input.key == "order-0001";
        if fail {
            failed.send_modify(|n| *n += 1);
        }
        let out = out.clone();
        async move {
            if fail {
                Err("always fails".to_owned())
            } else {
                Ok(vec![Output::new(&out, input.record.payload)])
            }
        }
    };
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        pipe.run(handler, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await
    });
    let _ = tokio::time::timeout(DEADLINE, failures.wait_for(|n| *n >= 3))
        .await
        .expect("the handler failed three times");
    stop.send(true).unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the pipe stops while a record is being retried")
        .unwrap()
        .expect("pipe run");
    println!("{stats:?}");
    assert_eq!(events_of(&log, "order-0000"), ["claimed", "completed"]);
    let failing = events_of(&log, "order-0001");
    assert_eq!(failing.last(), Some(&"released"), "{failing:?}");
    assert!(events_of(&log, "order-0002").is_empty());
    assert_eq!(
        broker::committed(&broker.bootstrap, &group, &input, 1),
        [Some(1)],
        "order-0000 committed, order-0001 not"
    );
}

/// A commit slower than the gate's lease (every request to the mock broker delayed 3 s, the
/// lease 3 s): the batch's claims stay renewed while it commits, so a claim of one of its keys
/// made once a lease has passed meanwhile finds it still held, and every key is completed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_claims_are_renewed_while_a_slow_commit_runs() {
    let mock = Mock::start(6).await;
    let (cluster, keys, output) = (&mock.cluster, &mock.keys, &mock.output);
    let config = PipeConfig::new(mock.source(), &unique("tx"))
        .unwrap()
        .batch(100, Duration::from_secs(1))
        .unwrap();
    let (gate, log) = gate();
    let lease = Duration::from_secs(3);
    let gate = gate.lease(lease).unwrap();
    let pipe = TransactionalPipe::new(gate.clone(), config).unwrap();
    let runs = Arc::new(Runs::default());
    let (release, released) = watch::channel(false);
    let handler = latched_handler(runs.clone(), output.clone(), "order-0003", released);
    let (stop, task) = spawn(pipe, handler);
    // Records 0..=2 are in the open batch; the batch is past its period, so the commit
    // starts as soon as order-0003's handler returns.
    wait_for_run(&runs, "order-0003").await;
    cluster
        .broker_round_trip_time(1, Duration::from_secs(3))
        .unwrap();
    release.send(true).unwrap();
    // More than a lease later, the commit (several requests of 3 s each) is still under way.
    tokio::time::sleep(lease + Duration::from_millis(1500)).await;
    let probe = gate
        .gate()
        .claim(
            "pipe-test",
            "order-0000",
            dedupgate_core::ClaimOptions {
                fingerprint: Some(hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"{}"))),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    match &probe {
        Claim::Duplicate { record } => assert_eq!(
            record.state,
            dedupgate_core::State::InProgress,
            "the probe came after the commit: inconclusive"
        ),
        Claim::New(_) => panic!("a key of the batch being committed was taken over: {probe:?}"),
    }
    cluster
        .broker_round_trip_time(1, Duration::from_millis(0))
        .unwrap();
    let started = Instant::now();
    while keys
        .iter()
        .any(|k| !events_of(&log, k).contains(&"completed"))
    {
        assert!(
            started.elapsed() < DEADLINE,
            "log: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    let stats = task.await.unwrap().expect("pipe run");
    println!("{stats:?}");
    assert_eq!(stats.unrecorded, 0, "{stats:?}");
    for key in keys {
        assert_eq!(events_of(&log, key), ["claimed", "completed"], "{key}");
    }
}

/// A commit whose outcome stays unknown (the coordinator answers every EndTxn with a
/// retriable error, so each `commit_transaction` call fails retriably): the pipe asks again,
/// then stops with `CommitUnknown`, and the batch's claims are not released (the
/// transaction may have committed): they are left to their leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_of_unknown_outcome_keeps_its_claims() {
    let mock = Mock::start(10).await;
    let (cluster, keys, output) = (&mock.cluster, &mock.keys, &mock.output);
    let config = PipeConfig::new(mock.source(), &unique("tx"))
        .unwrap()
        .batch(5, Duration::from_secs(5))
        .unwrap()
        .call_timeout(Duration::from_secs(1))
        .unwrap();
    let (gate, log) = gate();
    let pipe = TransactionalPipe::new(gate.clone(), config).unwrap();
    let runs = Arc::new(Runs::default());
    let (release, released) = watch::channel(false);
    let handler = latched_handler(runs.clone(), output.clone(), "order-0007", released);
    let task = tokio::spawn(async move { pipe.run(handler, std::future::pending()).await });
    wait_for_run(&runs, "order-0007").await;
    cluster.request_errors(
        RDKafkaApiKey::EndTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE; 5000],
    );
    release.send(true).unwrap();
    let result = tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the pipe stops")
        .unwrap();
    assert!(
        matches!(&result, Err(KafkaError::CommitUnknown { .. })),
        "{result:?}"
    );
    for key in &keys[..5] {
        assert_eq!(events_of(&log, key), ["claimed", "completed"], "{key}");
    }
    for key in &keys[5..] {
        assert_eq!(
            events_of(&log, key),
            ["claimed"],
            "{key}: held, not released"
        );
    }
}

/// A commit made while a record is in hand (order-0005's handler failed, so the records before
/// it commit) is refused and aborts: the rewind takes the record in hand back too, so it is
/// consumed again rather than kept and also consumed again, and the next batch's rewind goes
/// back to its lowest offset. A second refused commit then rewinds to order-0000 (not to the
/// in-hand record's offset, which skipped order-0000..0004 before): every key is completed
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abort_while_a_record_is_in_hand_rewinds_to_the_lowest_offset() {
    let mock = Mock::start(10).await;
    let (cluster, keys, output) = (&mock.cluster, &mock.keys, &mock.output);
    let config = PipeConfig::new(mock.source(), &unique("tx"))
        .unwrap()
        .batch(100, Duration::from_secs(1))
        .unwrap();
    let (gate, log) = gate();
    let pipe = TransactionalPipe::new(gate.clone(), config).unwrap();
    let runs = Arc::new(Runs::default());
    let (release_first, first_released) = watch::channel(false);
    let (release_second, second_released) = watch::channel(false);
    let handler = {
        let (runs, output) = (runs.clone(), output.clone());
        move |input: Input| {
            let first_of = |key: &str| !runs.keys.lock().unwrap().values().any(|k| k == key);
            let fail = input.key == "order-0005" && first_of("order-0005");
            let hold = input.key == "order-0009" && first_of("order-0009");
            let run = runs.start(&input.key);
            let output = output.clone();
            let (mut first, mut second) = (first_released.clone(), second_released.clone());
            async move {
                if fail {
                    let _ = first.wait_for(|r| *r).await;
                    return Err("fails once".to_owned());
                }
                if hold {
                    let _ = second.wait_for(|r| *r).await;
                }
                Ok(vec![
                    Output::new(&output, input.record.payload).header(RUN_HEADER, run.to_string())
                ])
            }
        }
    };
    let (stop, task) = spawn(pipe, handler);
    let refuse_next_commit = || {
        cluster.request_errors(
            RDKafkaApiKey::EndTxn,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN],
        )
    };
    wait_for_run(&runs, "order-0005").await;
    refuse_next_commit();
    release_first.send(true).unwrap();
    wait_for_run(&runs, "order-0009").await;
    refuse_next_commit();
    release_second.send(true).unwrap();
    let started = Instant::now();
    while keys
        .iter()
        .any(|k| !events_of(&log, k).contains(&"completed"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "log: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    let stats = task.await.unwrap().expect("pipe run");
    println!("{stats:?}");
    assert_eq!(stats.transactions_aborted, 2, "{stats:?}");
    for key in keys {
        let events = events_of(&log, key);
        let completed = events.iter().filter(|e| **e == "completed").count();
        assert_eq!(completed, 1, "{key}: {events:?}");
    }
    let (committed, _aborted) = committed_and_aborted(&runs, &log);
    let outputs = read_outputs(&mock.bootstrap, output, 1, keys.len()).await;
    let counts = per_key(&outputs, &committed);
    assert_eq!(counts.len(), keys.len(), "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
}
