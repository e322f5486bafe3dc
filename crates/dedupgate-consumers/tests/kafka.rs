//! Against a real Kafka-protocol broker each test starts for itself (tansu, see
//! `common/kafka.rs`; skipped, saying so, only when its binary is not installed): M records
//! with D% duplicates (the same key header on a new offset) run the handler once per distinct
//! key over an embedded store, and the group's committed offsets reach each partition's end; a
//! handler that fails N times is retried in process until it succeeds, and a record without a
//! key goes to the dead-letter topic with the reason; two consumers in one group, the second
//! joining mid-stream (a rebalance), still run each key exactly once; position keys catch a
//! replay of the same records but run a copy produced again; a handler that outlives its lease
//! keeps the key, because the gate renews it; a record in hand when its partition is revoked
//! is left uncommitted to the next holder, which finds its key completed; a record failing
//! every attempt is dead-lettered on attempt `max_attempts`, its headers kept and the reason added;
//! a key template over a header and payload fields merges a window's events into one run. Faults (refused commits, the
//! broker down) are in `kafka_faults.rs`, on librdkafka's mock cluster.

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kafka::{self as broker, Broker};
use common::unique;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use dedupgate_consumers::kafka::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::FutureRecord;
use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer, Stats, REASON_HEADER};
use dedupgate_consumers::Message;
use dedupgate_core::keys::KeyTemplate;
use dedupgate_core::Mode;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

/// How long a test waits for the committed offsets to reach the end (a guard against a hang).
const DEADLINE: Duration = Duration::from_secs(120);

/// A consumer's settings for the tests: a short session so joins and rebalances are quick
/// (tansu answers a new member's join only after a delay that grows with it), frequent commits.
fn config(broker: &Broker, group: &str, topic: &str) -> KafkaConfig {
    KafkaConfig::new(&broker.bootstrap, group, &[topic])
        .unwrap()
        .set("session.timeout.ms", "6000")
        .unwrap()
        .set("heartbeat.interval.ms", "500")
        .unwrap()
        .commit_every(Duration::from_millis(50))
        .unwrap()
        .in_flight(16)
        .unwrap()
}

/// Handler runs per key.
#[derive(Default)]
struct Runs(Mutex<BTreeMap<String, u32>>);

impl Runs {
    fn count(&self, key: &str) {
        *self.0.lock().unwrap().entry(key.to_owned()).or_default() += 1;
    }
    fn snapshot(&self) -> BTreeMap<String, u32> {
        self.0.lock().unwrap().clone()
    }
}

/// A consumer running in its own task until the returned sender says stop.
fn spawn(
    consumer: KafkaConsumer,
    handler: impl Fn(Message) -> std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        + Send
        + Sync
        + 'static,
) -> (watch::Sender<bool>, tokio::task::JoinHandle<Stats>) {
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        consumer
            .run(handler, async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
            .expect("consumer run")
    });
    (stop, task)
}

/// Waits until the group's committed offsets are each partition's end.
async fn wait_committed(broker: &Broker, group: &str, topic: &str, ends: &[i64], runs: &Runs) {
    broker::wait_committed(&broker.bootstrap, group, topic, ends, DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("{e}; runs: {:?}", runs.snapshot()));
}

/// `distinct` keys, and `total` records over them: each key once, then duplicates of random
/// keys (new offsets), shuffled, spread over `partitions` at random. Prints the seed.
fn records_with_duplicates(
    distinct: usize,
    total: usize,
    partitions: i32,
) -> Vec<(i32, String, String)> {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut keys: Vec<String> = (0..distinct).map(|i| format!("order-{i:04}")).collect();
    for _ in distinct..total {
        keys.push(format!("order-{:04}", rng.gen_range(0..distinct)));
    }
    keys.shuffle(&mut rng);
    keys.into_iter()
        .map(|k| {
            let payload = format!("{{\"order\":\"{k}\"}}");
            (rng.gen_range(0..partitions), k, payload)
        })
        .collect()
}

async fn produce_all(
    broker: &Broker,
    topic: &str,
    partitions: i32,
    records: &[(i32, String, String)],
    ends: &mut Vec<i64>,
) {
    let producer = broker.producer();
    let batch: Vec<(i32, Option<&str>, &[u8])> = records
        .iter()
        .map(|(p, k, v)| (*p, Some(k.as_str()), v.as_bytes()))
        .collect();
    broker::produce(&producer, topic, partitions, &batch, ends).await;
}

fn counting_handler(
    runs: Arc<Runs>,
) -> impl Fn(Message) -> std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
       + Send
       + Sync
       + 'static {
    move |msg: Message| {
        let runs = runs.clone();
        Box::pin(async move {
            // Long enough that copies of a key on other partitions overlap it.
            tokio::time::sleep(Duration::from_millis(5)).await;
            runs.count(&msg.key);
            Ok(format!("done:{}", msg.key))
        })
    }
}

fn assert_once_each(runs: &Runs, records: &[(i32, String, String)]) {
    let distinct: BTreeMap<String, u32> = records.iter().map(|(_, k, _)| (k.clone(), 1)).collect();
    assert_eq!(runs.snapshot(), distinct, "every distinct key exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_distinct_key_runs_once_and_the_commits_reach_the_end() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group, partitions) = (unique("orders"), unique("billing"), 3);
    broker.create_topic(&topic, partitions).await;
    // M = 400 records, D = 30% duplicates.
    let records = records_with_duplicates(280, 400, partitions);
    let mut ends = Vec::new();
    produce_all(&broker, &topic, partitions, &records, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs = Arc::new(Runs::default());
    let consumer = KafkaConsumer::new(gate, config(&broker, &group, &topic)).unwrap();
    let (stop, task) = spawn(consumer, counting_handler(runs.clone()));
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    assert_once_each(&runs, &records);
    assert_eq!(stats.records, 400);
    assert_eq!(stats.ran, 280);
    assert_eq!(stats.duplicates, 120);
    assert_eq!((stats.dead_lettered, stats.dropped), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_handler_is_retried_in_process_and_a_keyless_record_is_dead_lettered() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group, dlq) = (unique("orders"), unique("billing"), unique("orders-dlq"));
    broker.create_topic(&topic, 1).await;
    broker.create_topic(&dlq, 1).await;
    // One partition: the failing record holds back the commits of all the records after it.
    let mut batch: Vec<(i32, Option<&str>, &[u8])> = vec![(0, Some("flaky"), b"{}")];
    let keys: Vec<String> = (0..20).map(|i| format!("k-{i:02}")).collect();
    batch.extend(keys.iter().map(|k| (0, Some(k.as_str()), &b"{}"[..])));
    batch.push((0, None, b"no key here"));
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), &topic, 1, &batch, &mut ends).await;

    const FAILURES: usize = 3;
    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs = Arc::new(Runs::default());
    let calls = Arc::new(AtomicUsize::new(0));
    // The last attempt of "flaky" waits for this, so the test can look at the commits while
    // the first record of the partition is still in hand.
    let (release, released) = watch::channel(false);
    let handler = {
        let (runs, calls) = (runs.clone(), calls.clone());
        move |msg: Message| {
            let (runs, calls, mut released) = (runs.clone(), calls.clone(), released.clone());
            Box::pin(async move {
                if msg.key == "flaky" {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    assert_eq!(
                        msg.attempt,
                        Some(n as u32),
                        "in-process attempts are counted"
                    );
                    if n <= FAILURES {
                        return Err(format!("injected failure {n}"));
                    }
                    let _ = released.wait_for(|r| *r).await;
                }
                runs.count(&msg.key);
                Ok(msg.key)
            }) as std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        }
    };
    let consumer = KafkaConsumer::new(
        gate,
        config(&broker, &group, &topic)
            .dead_letter_topic(&dlq)
            .unwrap(),
    )
    .unwrap();
    let (stop, task) = spawn(consumer, handler);
    // Every other record runs meanwhile, but nothing is committed past the one in hand.
    let started = Instant::now();
    while runs.snapshot().len() < keys.len() || calls.load(Ordering::SeqCst) <= FAILURES {
        assert!(started.elapsed() < DEADLINE, "runs: {:?}", runs.snapshot());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // ten commit periods
    let committed = broker.committed(&group, &topic, 1);
    assert!(
        matches!(committed[..], [None | Some(0)]),
        "committed {committed:?} past the record still in hand at offset 0"
    );
    release.send(true).unwrap();
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    assert_eq!(calls.load(Ordering::SeqCst), FAILURES + 1);
    let mut want: BTreeMap<String, u32> = keys.iter().map(|k| (k.clone(), 1)).collect();
    want.insert("flaky".into(), 1);
    assert_eq!(runs.snapshot(), want);
    assert_eq!(stats.retries, FAILURES as u64);
    assert_eq!(stats.dead_lettered, 1);

    // The keyless record is on the dead-letter topic, its payload kept, the reason in a header.
    let reader: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &broker.bootstrap)
        .set("group.id", unique("dlq-reader"))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    reader.subscribe(&[&dlq]).unwrap();
    let dead = tokio::time::timeout(DEADLINE, reader.recv())
        .await
        .expect("a dead letter within the deadline")
        .expect("receive");
    assert_eq!(dead.payload(), Some(&b"no key here"[..]));
    let reason = dead
        .headers()
        .and_then(|h| h.iter().find(|h| h.key == REASON_HEADER))
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("a reason header");
    assert!(reason.contains("idempotency-key"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_in_one_group_run_each_key_once_across_a_rebalance() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group, partitions) = (unique("orders"), unique("billing"), 4);
    broker.create_topic(&topic, partitions).await;
    let records = records_with_duplicates(300, 450, partitions);
    let (first_half, second_half) = records.split_at(records.len() / 2);
    let mut ends = Vec::new();
    produce_all(&broker, &topic, partitions, first_half, &mut ends).await;

    // One store shared by both consumers, as two processes would share one.
    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs = Arc::new(Runs::default());
    // Slow enough that the second consumer joins while the first still has records in hand.
    let slow = {
        let runs = runs.clone();
        move |msg: Message| {
            let runs = runs.clone();
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(40)).await;
                runs.count(&msg.key);
                Ok(msg.key)
            }) as std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        }
    };
    let a = KafkaConsumer::new(gate.clone(), config(&broker, &group, &topic)).unwrap();
    let (stop_a, task_a) = spawn(a, slow.clone());
    // Once the first has run some, the second joins: the group rebalances mid-stream.
    let started = Instant::now();
    while runs.snapshot().len() < 20 {
        assert!(
            started.elapsed() < DEADLINE,
            "the first consumer ran nothing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = KafkaConsumer::new(gate.clone(), config(&broker, &group, &topic)).unwrap();
    let (stop_b, task_b) = spawn(b, slow);
    produce_all(&broker, &topic, partitions, second_half, &mut ends).await;
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop_a.send(true).unwrap();
    stop_b.send(true).unwrap();
    let (stats_a, stats_b) = (task_a.await.unwrap(), task_b.await.unwrap());
    println!("a: {stats_a:?}\nb: {stats_b:?}");
    assert_once_each(&runs, &records);
    assert!(
        stats_b.records > 0 && stats_a.partitions_revoked > 0,
        "no rebalance took partitions from the first consumer to the second"
    );
    assert_eq!(stats_a.ran + stats_b.ran, 300);
}

/// Position keys (`topic/partition/offset`) catch a redelivery of the same record (here: the
/// topic read again by a second group over the same store) but not a copy produced again:
/// it has a new offset, so it runs again. That is why they are only an explicit choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn position_keys_catch_redeliveries_but_not_records_produced_again() {
    let Some(broker) = broker::start() else {
        return;
    };
    let topic = unique("orders");
    broker.create_topic(&topic, 1).await;
    let batch: Vec<(i32, Option<&str>, &[u8])> =
        vec![(0, Some("order-1"), b"{}"), (0, Some("order-1"), b"{}")];
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), &topic, 1, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs = Arc::new(Runs::default());
    let mut stats = Vec::new();
    for group in [unique("billing"), unique("replay")] {
        let config = config(&broker, &group, &topic).key_from_position();
        let consumer = KafkaConsumer::new(gate.clone(), config).unwrap();
        let (stop, task) = spawn(consumer, counting_handler(runs.clone()));
        wait_committed(&broker, &group, &topic, &ends, &runs).await;
        stop.send(true).unwrap();
        stats.push(task.await.unwrap());
    }
    println!("{stats:?}");
    let keys: Vec<String> = runs.snapshot().into_keys().collect();
    assert_eq!(keys, [format!("{topic}/0/0"), format!("{topic}/0/1")]);
    assert!(
        runs.snapshot().values().all(|n| *n == 1),
        "{:?}",
        runs.snapshot()
    );
    assert_eq!(
        (stats[0].ran, stats[0].duplicates),
        (2, 0),
        "the copy ran again"
    );
    assert_eq!(
        (stats[1].ran, stats[1].duplicates),
        (0, 2),
        "the replay ran nothing"
    );
}

/// A handler that runs five times longer than the claim's lease keeps the key: the gate renews
/// the lease while it runs, so the copy on the other partition waits (in progress), then finds
/// the key completed, and the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lease_is_renewed_while_a_long_handler_runs() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group) = (unique("orders"), unique("billing"));
    broker.create_topic(&topic, 2).await;
    let batch: Vec<(i32, Option<&str>, &[u8])> =
        vec![(0, Some("slow-1"), b"{}"), (1, Some("slow-1"), b"{}")];
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), &topic, 2, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.lease(Duration::from_millis(200)).unwrap();
    let runs = Arc::new(Runs::default());
    let slow = {
        let runs = runs.clone();
        move |msg: Message| {
            let runs = runs.clone();
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(1_000)).await;
                runs.count(&msg.key);
                Ok(msg.key)
            }) as std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        }
    };
    let consumer = KafkaConsumer::new(gate, config(&broker, &group, &topic)).unwrap();
    let (stop, task) = spawn(consumer, slow);
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    assert_eq!(runs.snapshot(), BTreeMap::from([("slow-1".to_owned(), 1)]));
    assert_eq!((stats.ran, stats.duplicates), (1, 1));
    assert!(
        stats.retries > 0,
        "the copy never found the key in progress"
    );
}

/// A record in hand when its partition is revoked: its run finishes but is not committed here
/// (abandoned), and the partition's next holder receives it again and finds its key completed.
/// Nothing is lost, nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_in_hand_at_a_revoke_is_left_to_the_next_holder_and_runs_once() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group) = (unique("orders"), unique("billing"));
    broker.create_topic(&topic, 2).await;
    let keys: Vec<String> = (0..10).map(|i| format!("k-{i:02}")).collect();
    let mut batch: Vec<(i32, Option<&str>, &[u8])> = vec![(0, Some("held"), b"{}")];
    batch.extend(keys.iter().map(|k| (1, Some(k.as_str()), &b"{}"[..])));
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), &topic, 2, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs = Arc::new(Runs::default());
    let (release, released) = watch::channel(false);
    let handler = {
        let runs = runs.clone();
        move |msg: Message| {
            let (runs, mut released) = (runs.clone(), released.clone());
            Box::pin(async move {
                if msg.key == "held" {
                    let _ = released.wait_for(|r| *r).await;
                }
                runs.count(&msg.key);
                Ok(msg.key)
            }) as std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        }
    };
    let a = Arc::new(KafkaConsumer::new(gate.clone(), config(&broker, &group, &topic)).unwrap());
    let (stop, mut stopped) = watch::channel(false);
    let task_a = tokio::spawn({
        let (a, handler, mut stopped) = (a.clone(), handler.clone(), stopped.clone());
        async move {
            a.run(handler, async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
            .expect("consumer a")
        }
    });
    let started = Instant::now();
    while runs.snapshot().len() < keys.len() {
        assert!(started.elapsed() < DEADLINE, "runs: {:?}", runs.snapshot());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // "held" is in hand on the first consumer; the second joins, and the (eager) rebalance
    // revokes every partition of the first, "held"'s included.
    let b = KafkaConsumer::new(gate, config(&broker, &group, &topic)).unwrap();
    let task_b = tokio::spawn(async move {
        b.run(handler, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await
        .expect("consumer b")
    });
    while a.stats().partitions_revoked == 0 {
        assert!(
            started.elapsed() < DEADLINE,
            "no rebalance: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    release.send(true).unwrap();
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let (stats_a, stats_b) = (task_a.await.unwrap(), task_b.await.unwrap());
    println!("a: {stats_a:?}\nb: {stats_b:?}");
    let mut want: BTreeMap<String, u32> = keys.iter().map(|k| (k.clone(), 1)).collect();
    want.insert("held".into(), 1);
    assert_eq!(runs.snapshot(), want);
    assert!(stats_a.abandoned >= 1, "{stats_a:?}");
    assert_eq!(
        stats_a.duplicates + stats_b.duplicates,
        1,
        "the abandoned record came again as a duplicate"
    );
}

/// A record that fails on every attempt is given up on attempt `max_attempts` (counted in
/// process): its claim released, it goes to the dead-letter topic with the reason, and the
/// commits move past it. Nothing is dropped silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_record_is_dead_lettered_on_its_last_attempt() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group, dlq) = (unique("orders"), unique("billing"), unique("orders-dlq"));
    broker.create_topic(&topic, 1).await;
    broker.create_topic(&dlq, 1).await;
    let batch: Vec<(i32, Option<&str>, &[u8])> =
        vec![(0, Some("poison"), b"{\"n\":1}"), (0, Some("fine"), b"{}")];
    let mut ends = Vec::new();
    broker::produce(&broker.producer(), &topic, 1, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(3).unwrap();
    let runs = Arc::new(Runs::default());
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (runs, calls) = (runs.clone(), calls.clone());
        move |msg: Message| {
            let (runs, calls) = (runs.clone(), calls.clone());
            Box::pin(async move {
                if msg.key == "poison" {
                    calls.fetch_add(1, Ordering::SeqCst);
                    return Err("always fails".to_owned());
                }
                runs.count(&msg.key);
                Ok(msg.key)
            }) as std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        }
    };
    let config = config(&broker, &group, &topic)
        .dead_letter_topic(&dlq)
        .unwrap();
    let consumer = KafkaConsumer::new(gate, config).unwrap();
    let (stop, task) = spawn(consumer, handler);
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "three attempts, then given up"
    );
    assert_eq!(runs.snapshot(), BTreeMap::from([("fine".to_owned(), 1)]));
    assert_eq!((stats.retries, stats.dead_lettered), (2, 1));

    let reader: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &broker.bootstrap)
        .set("group.id", unique("dlq-reader"))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    reader.subscribe(&[&dlq]).unwrap();
    let dead = tokio::time::timeout(DEADLINE, reader.recv())
        .await
        .expect("a dead letter within the deadline")
        .expect("receive");
    assert_eq!(dead.payload(), Some(&b"{\"n\":1}"[..]));
    let header = |name: &str| {
        dead.headers()
            .and_then(|h| h.iter().find(|h| h.key == name))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let reason = header(REASON_HEADER).expect("a reason header");
    assert!(reason.contains("max_attempts reached"), "{reason}");
    assert!(reason.contains("always fails"), "{reason}");
    assert_eq!(header("dedupgate-key").as_deref(), Some("poison"));
    assert_eq!(
        header("idempotency-key").as_deref(),
        Some("poison"),
        "headers kept"
    );
}

/// A key template over the record: a header and payload fields, with a 5-minute window. Two
/// records of one window are one event (the second is a duplicate, though its payload differs);
/// the next window's record runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_over_headers_and_payload_keys_windowed_events() {
    let Some(broker) = broker::start() else {
        return;
    };
    let (topic, group) = (unique("signals"), unique("traders"));
    broker.create_topic(&topic, 1).await;
    let payloads = [
        r#"{"asset":"BTC","ts":"2026-11-22T10:01:00Z"}"#,
        r#"{"asset":"BTC","ts":"2026-11-22T10:03:30Z"}"#,
        r#"{"asset":"BTC","ts":"2026-11-22T10:05:00Z"}"#,
    ];
    let producer = broker.producer();
    let mut ends = vec![0];
    for payload in payloads {
        let delivery = producer
            .send(
                FutureRecord::<(), str>::to(&topic)
                    .partition(0)
                    .payload(payload)
                    .headers(OwnedHeaders::new().insert(Header {
                        key: "tenant",
                        value: Some("acme"),
                    })),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
        ends[0] = delivery.offset + 1;
    }

    let (gate, _dir) = common::gate(Mode::Retriable);
    let template = KeyTemplate::parse("{headers.tenant}:{asset}_{ts|window:5m}").unwrap();
    let gate = gate.key_template(template);
    let runs = Arc::new(Runs::default());
    let consumer = KafkaConsumer::new(gate, config(&broker, &group, &topic)).unwrap();
    let (stop, task) = spawn(consumer, counting_handler(runs.clone()));
    wait_committed(&broker, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    assert_eq!(
        runs.snapshot(),
        BTreeMap::from([
            ("acme:BTC_2026-11-22T10:00:00Z".to_owned(), 1),
            ("acme:BTC_2026-11-22T10:05:00Z".to_owned(), 1),
        ])
    );
    assert_eq!((stats.ran, stats.duplicates), (2, 1));
}
