//! Faults a real broker cannot be made to show on cue, injected with librdkafka's mock cluster
//! (in process; no broker binary needed): the broker refusing offset commits, and the broker
//! going down while records are in hand. Either way no record is lost, none runs twice, and
//! the committed offsets still reach the end.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kafka as broker;
use common::unique;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::mocking::MockCluster;
use dedupgate_consumers::kafka::rdkafka::producer::FutureProducer;
use dedupgate_consumers::kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer};
use dedupgate_consumers::Message;
use dedupgate_core::Mode;
use tokio::sync::watch;

const DEADLINE: Duration = Duration::from_secs(120);

type Runs = Arc<Mutex<BTreeMap<String, u32>>>;

fn config(bootstrap: &str, group: &str, topic: &str) -> KafkaConfig {
    KafkaConfig::new(bootstrap, group, &[topic])
        .unwrap()
        .commit_every(Duration::from_millis(50))
        .unwrap()
}

async fn wait_committed(bootstrap: &str, group: &str, topic: &str, ends: &[i64], runs: &Runs) {
    broker::wait_committed(bootstrap, group, topic, ends, DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("{e}; runs: {:?}", runs.lock().unwrap()));
}

/// The last record's handler waits for `released`, so the test can inject the fault just
/// before the final position becomes committable.
fn handler(
    runs: Runs,
    last: String,
    released: watch::Receiver<bool>,
) -> impl Fn(
    Message,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
       + Send
       + Sync
       + 'static {
    move |msg: Message| {
        let (runs, last, mut released) = (runs.clone(), last.clone(), released.clone());
        Box::pin(async move {
            if msg.key == last {
                let _ = released.wait_for(|r| *r).await;
            }
            *runs.lock().unwrap().entry(msg.key).or_default() += 1;
            Ok(())
        })
    }
}

/// Commits the broker refuses (a non-retriable error, which librdkafka does not retry by
/// itself) are offered again until one is acknowledged: the final position is committed
/// although no later record comes to carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_commit_is_offered_again_until_acknowledged() {
    let cluster = MockCluster::new(1).expect("mock cluster");
    let bootstrap = cluster.bootstrap_servers();
    let (topic, group) = (unique("orders"), unique("billing"));
    cluster.create_topic(&topic, 1, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let keys: Vec<String> = (0..30).map(|i| format!("k-{i:02}")).collect();
    let batch: Vec<(i32, Option<&str>, &[u8])> = keys
        .iter()
        .map(|k| (0, Some(k.as_str()), &b"{}"[..]))
        .collect();
    let mut ends = Vec::new();
    broker::produce(&producer, &topic, 1, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs: Runs = Arc::default();
    let (release, released) = watch::channel(false);
    let consumer = KafkaConsumer::new(gate, config(&bootstrap, &group, &topic)).unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn({
        let handler = handler(runs.clone(), keys[29].clone(), released);
        async move {
            consumer
                .run(handler, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
                .unwrap()
        }
    });
    // Everything before the held last record is committed…
    wait_committed(&bootstrap, &group, &topic, &[29], &runs).await;
    // …then the broker refuses the next commits, and the last record settles.
    cluster.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_COMMIT_OFFSET_SIZE; 5],
    );
    release.send(true).unwrap();
    wait_committed(&bootstrap, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    let want: BTreeMap<String, u32> = keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(*runs.lock().unwrap(), want);
}

/// The broker goes down with records in hand and comes back: they settle, are committed, and
/// no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_in_hand_when_the_broker_goes_down_are_settled_once_it_is_back() {
    let cluster = MockCluster::new(1).expect("mock cluster");
    let bootstrap = cluster.bootstrap_servers();
    let (topic, group) = (unique("orders"), unique("billing"));
    cluster.create_topic(&topic, 2, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("k-{i:02}")).collect();
    // Every key twice, the copies on the other partition.
    let batch: Vec<(i32, Option<&str>, &[u8])> = keys
        .iter()
        .flat_map(|k| {
            [
                (0, Some(k.as_str()), &b"{}"[..]),
                (1, Some(k.as_str()), &b"{}"[..]),
            ]
        })
        .collect();
    let mut ends = Vec::new();
    broker::produce(&producer, &topic, 2, &batch, &mut ends).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let runs: Runs = Arc::default();
    let (release, released) = watch::channel(false);
    let consumer = KafkaConsumer::new(gate, config(&bootstrap, &group, &topic)).unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn({
        let handler = handler(runs.clone(), keys[39].clone(), released);
        async move {
            consumer
                .run(handler, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
                .unwrap()
        }
    });
    let started = Instant::now();
    while runs.lock().unwrap().len() < 39 {
        assert!(
            started.elapsed() < DEADLINE,
            "runs: {:?}",
            runs.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.broker_down(1).unwrap();
    release.send(true).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.broker_up(1).unwrap();
    wait_committed(&bootstrap, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    println!("{stats:?}");
    let want: BTreeMap<String, u32> = keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(*runs.lock().unwrap(), want);
}

/// Idempotent mode: a failed handler's dead letter that the broker refuses until the consumer
/// stops leaves the record uncommitted and its key marked. The next group member must
/// dead-letter it, not ack it as a duplicate: before, it reached neither the handler nor the
/// dead-letter topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idempotent_dead_letter_refused_until_a_stop_is_dead_lettered_by_the_next_member() {
    let cluster = MockCluster::new(1).expect("mock cluster");
    let bootstrap = cluster.bootstrap_servers();
    let (topic, dlq, group) = (unique("orders"), unique("orders-dlq"), unique("billing"));
    cluster.create_topic(&topic, 1, 1).unwrap();
    cluster.create_topic(&dlq, 1, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let mut ends = Vec::new();
    broker::produce(
        &producer,
        &topic,
        1,
        &[(0, Some("k-1"), &b"{}"[..])],
        &mut ends,
    )
    .await;
    // From here every produce (the dead letters) is refused, not retried by librdkafka.
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 1000],
    );
    let (gate, _dir) = common::gate(Mode::Idempotent);
    let config = || {
        config(&bootstrap, &group, &topic)
            .dead_letter_topic(&dlq)
            .unwrap()
            .shutdown_grace(Duration::from_millis(500))
            .unwrap()
    };

    // The first member: its handler fails once, then it is stopped while the dead letter is
    // refused.
    let (failed, mut has_failed) = watch::channel(false);
    let first = KafkaConsumer::new(gate.clone(), config()).unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        first
            .run(
                move |_msg: Message| {
                    failed.send(true).ok();
                    async { Err::<(), _>("boom") }
                },
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            )
            .await
            .unwrap()
    });
    tokio::time::timeout(DEADLINE, has_failed.wait_for(|f| *f))
        .await
        .expect("the handler ran")
        .unwrap();
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    assert_eq!((stats.dead_lettered, stats.abandoned), (0, 1), "{stats:?}");
    let committed = broker::committed(&bootstrap, &group, &topic, 1);
    assert!(
        committed[0].unwrap_or(0) < ends[0],
        "committed past: {committed:?}"
    );

    // The dead-letter topic takes records again; the next member gets the record.
    cluster.clear_request_errors(RDKafkaApiKey::Produce);
    let runs: Runs = Arc::default();
    let next = KafkaConsumer::new(gate, config()).unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn({
        let runs = runs.clone();
        async move {
            next.run(
                move |msg: Message| {
                    *runs.lock().unwrap().entry(msg.key).or_default() += 1;
                    async { Ok::<_, String>(()) }
                },
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            )
            .await
            .unwrap()
        }
    });
    wait_committed(&bootstrap, &group, &topic, &ends, &runs).await;
    stop.send(true).unwrap();
    let stats = task.await.unwrap();
    assert!(runs.lock().unwrap().is_empty(), "the marked key ran again");
    assert_eq!(
        (stats.dead_lettered, stats.duplicates),
        (1, 0),
        "acked as a duplicate, not dead-lettered: {stats:?}"
    );
}
