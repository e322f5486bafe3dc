//! The relay's transactional route (`--to kafka://HOST:PORT/TOPIC?transactional=ID`) against a
//! real Kafka-protocol broker the test starts (tansu, the consumers crate's harness; skipped,
//! saying so, only when its binary is not installed): M records with D duplicate keys and one
//! record whose key cannot be built come out once per key on the sink topic, keyed and headed by
//! the gate key; the keyless record goes to the dead-letter topic with the reason; the group's
//! offsets reach each partition's end (committed by the same transactions); and the route's
//! counters say so, on `/metrics` too.
//!
//! What tansu cannot show: it does not filter aborted records from a `read_committed` reader
//! (see crates/dedupgate-consumers/tests/kafka_pipe.rs). No transaction aborts here, and the
//! test checks that it did not (`transactions_aborted` is 0), so every record read is one a
//! committed transaction produced.

mod common;
// The consumers crate's tansu harness, shared rather than copied; this file uses part of it.
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/kafka.rs"]
mod kafka;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{counter, free_port, key_of, scrape, unique, D, M};
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use dedupgate_consumers::kafka::rdkafka::message::{Headers, Message as _};
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};
use dedupgate_core::{Gate, MemoryStore};
use dedupgate_relay::{Metrics, RelayError, RouteConfig};
use tokio::sync::oneshot;

const DEADLINE: Duration = Duration::from_secs(90);

/// A record read back: its headers, and its Kafka key.
struct Read {
    headers: Vec<(String, String)>,
    key: String,
}

impl Read {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every record of `topic` as a `read_committed` reader sees it, read until `min` are in and
/// nothing more came for 3 s (so a surplus shows).
async fn read_topic(bootstrap: &str, topic: &str, partitions: i32, min: usize) -> Vec<Read> {
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
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                let value = h.value.unwrap_or_default();
                                (h.key.to_owned(), String::from_utf8_lossy(value).into())
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
                out.push(Read { headers, key });
            }
            Ok(Err(e)) => panic!("reading {topic}: {e}"),
            Err(_) if out.len() >= min => return out,
            Err(_) => assert!(started.elapsed() < DEADLINE, "read {} of {min}", out.len()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_to_kafka_in_one_transaction_forwards_each_key_once_commits_the_offsets_and_dead_letters_in_it(
) {
    let Some(broker) = kafka::start() else { return };
    let (topic, sink, dlq) = (unique("orders"), unique("orders.out"), unique("orders.dlq"));
    broker.create_topic(&topic, 2).await;
    broker.create_topic(&sink, 2).await;
    broker.create_topic(&dlq, 1).await;
    // M records keyed by their "id" field, and one with no "id": its key cannot be built.
    let payloads: Vec<String> = (0..M)
        .map(|i| format!(r#"{{"id":"{}","amount":1}}"#, key_of(i)))
        .collect();
    let mut records: Vec<(i32, Option<&str>, &[u8])> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| ((i as i32) % 2, None, p.as_bytes()))
        .collect();
    records.push((0, None, br#"{"no":"id"}"#));
    let mut ends = Vec::new();
    kafka::produce(&broker.producer(), &topic, 2, &records, &mut ends).await;

    let group = unique("relay");
    let port = free_port();
    let route = RouteConfig {
        name: Some("tx".into()),
        from: format!("kafka://{}/{topic}?group={group}", broker.bootstrap),
        to: format!(
            "kafka://{}/{sink}?transactional={}",
            broker.bootstrap,
            unique("relay-tx")
        ),
        key: Some("{id}".into()),
        dead_letter: Some(format!("kafka://{}/{dlq}", broker.bootstrap)),
        ..Default::default()
    }
    .check(0)
    .expect("route");
    let (stop, stopped) = oneshot::channel::<()>();
    let metrics_listen = format!("127.0.0.1:{port}");
    let relay = tokio::spawn(async move {
        dedupgate_relay::run(
            vec![(route, Gate::new(MemoryStore::new()))],
            Some(&metrics_listen),
            async {
                let _ = stopped.await;
            },
        )
        .await
    });

    // The transactions commit the consumed offsets: wait for them to reach the ends.
    let want: Vec<Option<i64>> = ends.iter().map(|e| Some(*e)).collect();
    let started = Instant::now();
    loop {
        let bootstrap = broker.bootstrap.clone();
        let (group, topic) = (group.clone(), topic.clone());
        let committed =
            tokio::task::spawn_blocking(move || kafka::committed(&bootstrap, &group, &topic, 2))
                .await
                .unwrap();
        if committed == want {
            break;
        }
        assert!(!relay.is_finished(), "the relay stopped: {:?}", relay.await);
        assert!(
            started.elapsed() < DEADLINE,
            "committed {committed:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The counters reach /metrics within their copy period.
    let scraped = loop {
        let text = scrape(port).await;
        if counter(&text, "records_in", "tx") == Some((M + 1) as u64) {
            break text;
        }
        assert!(started.elapsed() < DEADLINE, "metrics:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop.send(());
    let metrics: Metrics = relay
        .await
        .expect("relay task")
        .map_err(|e: RelayError| e.to_string())
        .expect("relay");

    let m = metrics.route("tx").unwrap();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    assert_eq!(
        get(&m.transactions_aborted),
        0,
        "no transaction aborted, so every record read was committed"
    );
    assert!(get(&m.transactions_committed) > 0);
    assert_eq!(get(&m.records_in), (M + 1) as u64);
    assert_eq!(get(&m.forwarded), (M - D) as u64);
    assert_eq!(get(&m.duplicates), D as u64);
    assert_eq!(get(&m.dead_lettered), 1);
    assert_eq!(get(&m.rejected), 0);
    // Read after the final commit: nothing is left past the group's offsets.
    assert_eq!(m.kafka_lag(), Some(0), "the group's lag");
    for (noun, value) in [
        ("records_in", M + 1),
        ("forwarded", M - D),
        ("duplicates", D),
        ("dead_lettered", 1),
        ("transactions_aborted", 0),
    ] {
        assert_eq!(
            counter(&scraped, noun, "tx"),
            Some(value as u64),
            "{noun} on /metrics:\n{scraped}"
        );
    }

    let out = read_topic(&broker.bootstrap, &sink, 2, M - D).await;
    let mut keys: BTreeMap<String, usize> = BTreeMap::new();
    for r in &out {
        let header = r
            .header("idempotency-key")
            .expect("an idempotency-key header");
        assert_eq!(
            header, r.key,
            "the Kafka key and the header are the gate key"
        );
        assert_eq!(r.header("dedupgate-key"), Some(header));
        *keys.entry(r.key.clone()).or_default() += 1;
    }
    let expected: std::collections::BTreeSet<String> = (0..M).map(key_of).collect();
    assert_eq!(expected.len(), M - D);
    assert_eq!(
        keys.keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        expected
    );
    let twice: Vec<_> = keys.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys forwarded more than once: {twice:?}");

    let dead = read_topic(&broker.bootstrap, &dlq, 1, 1).await;
    assert_eq!(dead.len(), 1, "one dead letter");
    let reason = dead[0]
        .header(dedupgate_relay::REASON_HEADER)
        .expect("a reason header");
    assert!(reason.contains("id"), "{reason}");
    assert_eq!(
        dead[0]
            .header("dedupgate-source")
            .map(|s| s.starts_with(&topic)),
        Some(true)
    );
}
