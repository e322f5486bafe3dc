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
    let want: Vec<Option<i64>> = ends.iter().map(|e| Some(*e)).collect();
    let started = Instant::now();
    loop {
        let committed = broker::committed(bootstrap, group, topic, ends.len() as i32);
        if committed == want {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "committed {committed:?}, want {want:?}; runs: {:?}",
            runs.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
