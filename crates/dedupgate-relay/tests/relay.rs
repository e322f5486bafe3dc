//! The relay against real brokers: tansu (a Kafka-protocol broker) started on a free port per
//! test by the consumers crate's harness, and the machine's RabbitMQ
//! (`DEDUPGATE_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`) and NATS
//! JetStream (`DEDUPGATE_TEST_NATS_URL`, default `nats://127.0.0.1:4222`). Each test publishes
//! M messages of which D are copies of earlier keys, relays them, and counts at the sink:
//! every distinct key exactly once, the source settled (Kafka: committed to the end), and a
//! message without a usable key dead-lettered with the reason.

mod common;
// The consumers crate's RabbitMQ helpers, shared rather than copied; this file uses part of it.
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/amqp.rs"]
mod amqp;
// The consumers crate's tansu harness, shared rather than copied; this file uses part of it.
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/kafka.rs"]
mod kafka;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{counter, free_port, key_of, scrape, start, unique, D, M};
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use dedupgate_consumers::kafka::rdkafka::message::{Headers, Message as _};
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};
use dedupgate_relay::RouteConfig;

/// How long a Kafka test waits for the source's offsets to be committed to the end (they are
/// committed every 500 ms once settled; a guard against a hang).
const COMMIT_DEADLINE: Duration = Duration::from_secs(30);

/// The file sink's lines, by key: how many times each key came.
fn file_keys(path: &Path) -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut keys = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        *keys
            .entry(v["key"].as_str().expect("key").to_owned())
            .or_insert(0) += 1;
    }
    keys
}

/// Waits until `done` holds, for up to `within`.
async fn wait_for(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every distinct key exactly once.
fn assert_each_key_once(keys: &BTreeMap<String, usize>) {
    let expected: std::collections::BTreeSet<String> = (0..M).map(key_of).collect();
    assert_eq!(expected.len(), M - D);
    let got: std::collections::BTreeSet<String> = keys.keys().cloned().collect();
    assert_eq!(got, expected, "keys at the sink");
    let twice: Vec<_> = keys.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys forwarded more than once: {twice:?}");
}

/// Produces the M records (and one with no key header) over `partitions`; returns the ends.
async fn produce_kafka(broker: &kafka::Broker, topic: &str, partitions: i32) -> Vec<i64> {
    let producer = broker.producer();
    let keys: Vec<String> = (0..M).map(key_of).collect();
    let payloads: Vec<String> = keys
        .iter()
        .map(|k| format!(r#"{{"id":"{k}","amount":1}}"#))
        .collect();
    let mut records: Vec<(i32, Option<&str>, &[u8])> = keys
        .iter()
        .zip(&payloads)
        .enumerate()
        .map(|(i, (k, p))| ((i as i32) % partitions, Some(k.as_str()), p.as_bytes()))
        .collect();
    records.push((0, None, b"{\"no\":\"key\"}"));
    let mut ends = Vec::new();
    kafka::produce(&producer, topic, partitions, &records, &mut ends).await;
    ends
}

/// A record read back: its `idempotency-key` header, its Kafka key, and all its headers.
type Read = (String, String, Vec<(String, String)>);

/// Reads every record of `topic` from the start (no group): (key header, Kafka key, headers).
fn read_topic(bootstrap: &str, topic: &str, partitions: i32, expected: usize) -> Vec<Read> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Reads on for 2 s after the expected count, so a surplus shows.
    let mut quiet_until: Option<Instant> = None;
    while Instant::now() < deadline {
        if out.len() >= expected {
            let until = *quiet_until.get_or_insert_with(|| Instant::now() + Duration::from_secs(2));
            if Instant::now() >= until {
                break;
            }
        }
        let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let headers: Vec<(String, String)> = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let header = headers
            .iter()
            .find(|(n, _)| n == "idempotency-key")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        out.push((header, key, headers));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_to_file_forwards_each_key_once_commits_the_source_and_dead_letters_a_keyless_record()
{
    let Some(broker) = kafka::start() else { return };
    let (topic, dlq) = ("orders", "orders.dlq");
    broker.create_topic(topic, 2).await;
    broker.create_topic(dlq, 1).await;
    let ends = produce_kafka(&broker, topic, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let group = unique("relay");
    let relay = start(
        RouteConfig {
            name: Some("orders".into()),
            from: format!("kafka://{}/{topic}?group={group}", broker.bootstrap),
            to: format!("file:{}", out.display()),
            dead_letter: Some(format!("kafka://{}/{dlq}", broker.bootstrap)),
            ..Default::default()
        },
        None,
    );
    wait_for(
        Duration::from_secs(90),
        "every distinct key at the file sink",
        || file_keys(&out).len() >= M - D,
    )
    .await;
    // Offsets are committed every 500 ms once settled: wait for them to reach the ends.
    let committed =
        kafka::wait_committed(&broker.bootstrap, &group, topic, &ends, COMMIT_DEADLINE).await;
    let metrics = relay.stop().await;
    assert_each_key_once(&file_keys(&out));
    if let Err(e) = committed {
        panic!("source offsets committed to the end: {e}");
    }
    let m = metrics.route("orders").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forwarded), (M - D) as u64);
    assert_eq!(get(&m.duplicates), D as u64);
    assert_eq!(get(&m.dead_lettered), 1);
    assert_eq!(get(&m.records_in), (M + 1) as u64);
    // Read after the final commit: nothing is left past the group's offsets.
    assert_eq!(m.kafka_lag(), Some(0), "the group's lag");
    let dead = tokio::task::spawn_blocking({
        let bootstrap = broker.bootstrap.clone();
        move || read_topic(&bootstrap, dlq, 1, 1)
    })
    .await
    .unwrap();
    assert_eq!(dead.len(), 1, "one dead letter");
    let reason = dead[0]
        .2
        .iter()
        .find(|(n, _)| n == dedupgate_relay::REASON_HEADER)
        .map(|(_, v)| v.clone())
        .expect("a reason header");
    assert!(reason.contains("idempotency-key"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_to_kafka_forwards_each_key_once_keyed_and_headed_by_the_gate_key() {
    let Some(broker) = kafka::start() else { return };
    let (topic, sink) = ("events", "events.out");
    broker.create_topic(topic, 2).await;
    broker.create_topic(sink, 2).await;
    let ends = produce_kafka(&broker, topic, 2).await;
    let group = unique("relay");
    let relay = start(
        RouteConfig {
            name: Some("events".into()),
            from: format!("kafka://{}/{topic}?group={group}", broker.bootstrap),
            to: format!("kafka://{}/{sink}", broker.bootstrap),
            // Keyed by a template over the payload this time.
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let read = tokio::task::spawn_blocking({
        let bootstrap = broker.bootstrap.clone();
        move || read_topic(&bootstrap, sink, 2, M - D)
    })
    .await
    .unwrap();
    let committed =
        kafka::wait_committed(&broker.bootstrap, &group, topic, &ends, COMMIT_DEADLINE).await;
    let metrics = relay.stop().await;
    let mut keys = BTreeMap::new();
    for (header, key, _) in &read {
        assert_eq!(
            header, key,
            "the Kafka key and the idempotency-key header are the gate key"
        );
        *keys.entry(header.clone()).or_insert(0) += 1;
    }
    assert_each_key_once(&keys);
    if let Err(e) = committed {
        panic!("{e}");
    }
    // The keyless record has no "id" field: the template cannot render, and with no
    // dead-letter topic it is logged and counted, not forwarded.
    let m = metrics.route("events").unwrap();
    assert_eq!(m.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_to_file_forwards_each_key_once_acks_all_and_dead_letters_keyless_and_mismatched_messages_to_a_file(
) {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    let url = amqp::url();
    let conn = amqp::connect().await;
    let channel = amqp::confirming_channel(&conn).await;
    let queue = unique("dedupgate-relay");
    channel
        .queue_declare(
            queue.as_str(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // M messages, then one with no message id and one reusing k-0's id for another payload.
    for i in 0..M + 2 {
        let (id, payload) = if i < M {
            let k = key_of(i);
            let payload = format!(r#"{{"id":"{k}"}}"#);
            (Some(k), payload)
        } else if i == M {
            (None, "no key".to_owned())
        } else {
            (
                Some("k-0".to_owned()),
                r#"{"id":"k-0","amount":"changed"}"#.to_owned(),
            )
        };
        amqp::publish(&channel, &queue, id.as_deref(), payload.as_bytes()).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let dead = dir.path().join("dead.jsonl");
    let port = free_port();
    let relay = start(
        RouteConfig {
            name: Some("amqp".into()),
            from: format!("{url}?queue={queue}"),
            to: format!("file:{}", out.display()),
            dead_letter: Some(format!("file:{}", dead.display())),
            ..Default::default()
        },
        Some(format!("127.0.0.1:{port}")),
    );
    // Every delivery settles: forwarded, a duplicate of a completed key, or dead-lettered.
    // (Copies that found their key in progress were requeued and come back as duplicates.)
    let deadline = Instant::now() + Duration::from_secs(30);
    let scrape = loop {
        let text = scrape(port).await;
        let settled: u64 = ["forwarded", "duplicates", "dead_lettered"]
            .iter()
            .map(|noun| counter(&text, noun, "amqp").unwrap_or(0))
            .sum();
        if settled >= (M + 2) as u64 {
            break text;
        }
        assert!(Instant::now() < deadline, "timed out; metrics:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let metrics = relay.stop().await;
    // Every delivery was acked: nothing is left, ready or requeued when the relay let go.
    let left = amqp::message_count(&channel, &queue)
        .await
        .expect("the source queue");
    assert_eq!(
        left, 0,
        "messages left in the queue after the relay stopped"
    );
    channel
        .queue_delete(queue.as_str(), QueueDeleteOptions::default())
        .await
        .unwrap();
    assert_each_key_once(&file_keys(&out));
    let dead_lines: Vec<serde_json::Value> = std::fs::read_to_string(&dead)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(dead_lines.len(), 2, "{dead_lines:?}");
    let reason_of = |payload: serde_json::Value| {
        let line = dead_lines
            .iter()
            .find(|l| l["payload"] == payload)
            .unwrap_or_else(|| panic!("no dead letter of {payload}: {dead_lines:?}"));
        line["headers"][dedupgate_relay::REASON_HEADER]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let no_key = reason_of("no key".into());
    assert!(no_key.contains("message_id"), "{no_key}");
    let mismatch = reason_of(serde_json::json!({"id": "k-0", "amount": "changed"}));
    assert!(mismatch.contains("payload"), "{mismatch}");
    let m = metrics.route("amqp").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forwarded), (M - D) as u64);
    assert_eq!(get(&m.duplicates), D as u64);
    assert_eq!(get(&m.dead_lettered), 2);
    assert!(scrape.starts_with("HTTP/1.1 200"), "{scrape}");
    assert!(
        scrape.contains(&format!(
            "dedupgate_relay_forwarded_total{{route=\"amqp\"}} {}",
            M - D
        )),
        "{scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_to_jetstream_forwards_each_key_once_with_the_key_as_msg_id() {
    use async_nats::jetstream::{self, stream};
    use futures::StreamExt;

    let url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {url}: {e}"));
    let js = jetstream::new(client.clone());
    let (source, sink) = (unique("relay-src"), unique("relay-dst"));
    for name in [&source, &sink] {
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            // Short, so the sink stream's own window does not hide a second forward of a key
            // made more than 100 ms after the first; the relay's metrics count every forward.
            duplicate_window: Duration::from_millis(100),
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("stream");
    }
    // No Nats-Msg-Id at the source: the route keys by a template over the payload, so the
    // copies reach the relay instead of being dropped by the source stream's window.
    for i in 0..M {
        let k = key_of(i);
        js.publish(format!("{source}.in"), format!(r#"{{"id":"{k}"}}"#).into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    // A plain subscriber on the sink's subject sees every publish, also those the sink stream
    // drops as duplicates within its window: it counts what the relay sent.
    let mut sent = client.subscribe(format!("{sink}.out")).await.unwrap();
    client.flush().await.unwrap();
    let relay = start(
        RouteConfig {
            name: Some("nats".into()),
            from: format!("{url}/{source}?consumer=relay"),
            to: format!("{url}/{sink}.out"),
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let mut sink_stream = js.get_stream(&sink).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sink_stream.info().await.unwrap().state.messages < (M - D) as u64 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the sink stream"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let metrics = relay.stop().await;
    // Read the sink back: one message per key, each with Nats-Msg-Id = its key.
    let reader = sink_stream
        .create_consumer(jetstream::consumer::pull::Config::default())
        .await
        .unwrap();
    let mut messages = reader
        .fetch()
        .max_messages(M)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .unwrap();
    let mut keys = BTreeMap::new();
    while let Some(Ok(m)) = messages.next().await {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_owned());
        assert_eq!(id.as_deref(), v["id"].as_str(), "Nats-Msg-Id is the key");
        *keys
            .entry(v["id"].as_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    for name in [&source, &sink] {
        let _ = js.delete_stream(name).await;
    }
    assert_each_key_once(&keys);
    let mut published = BTreeMap::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(500), sent.next()).await {
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        *published
            .entry(v["id"].as_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    assert_each_key_once(&published);
    let m = metrics.route("nats").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forwarded), (M - D) as u64);
    assert_eq!(get(&m.duplicates), D as u64);
}

/// A forward that keeps failing (the sink is `/dev/full`: every write is ENOSPC) is retried
/// until its `max_attempts`-th delivery, then dead-lettered with the error; in idempotent mode
/// the first failure is dead-lettered (marked first: never retried). Nothing is left unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_forwards_are_dead_lettered_after_max_attempts_or_at_once_when_idempotent() {
    use async_nats::jetstream::{self, stream};

    let url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {url}: {e}"));
    let js = jetstream::new(client);
    let dir = tempfile::tempdir().unwrap();
    for (mode, max_attempts, deliveries) in [("retriable", Some(2), 2u64), ("idempotent", None, 1)]
    {
        let source = unique("relay-fail");
        js.create_stream(stream::Config {
            name: source.clone(),
            subjects: vec![format!("{source}.>")],
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("stream");
        let n = 5;
        for i in 0..n {
            js.publish(
                format!("{source}.in"),
                format!(r#"{{"id":"f-{i}"}}"#).into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        let dead = dir.path().join(format!("{mode}.dead.jsonl"));
        let relay = start(
            RouteConfig {
                name: Some(mode.into()),
                from: format!("{url}/{source}?consumer=relay"),
                to: "file:/dev/full".into(),
                key: Some("{id}".into()),
                mode: Some(mode.into()),
                dead_letter: Some(format!("file:{}", dead.display())),
                max_attempts,
                ..Default::default()
            },
            None,
        );
        wait_for(
            Duration::from_secs(30),
            "every message dead-lettered",
            || file_keys(&dead).len() == n,
        )
        .await;
        let metrics = relay.stop().await;
        let _ = js.delete_stream(&source).await;
        let text = std::fs::read_to_string(&dead).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let reason = v["headers"][dedupgate_relay::REASON_HEADER]
                .as_str()
                .unwrap();
            assert!(reason.contains("No space left"), "{mode}: {reason}");
            assert_eq!(
                v["headers"][dedupgate_relay::DEAD_LETTER_KEY_HEADER],
                v["key"],
                "{mode}: {line}"
            );
        }
        assert_each_line_once(&file_keys(&dead), n, mode);
        let m = metrics.route(mode).unwrap();
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(get(&m.forwarded), 0, "{mode}");
        assert_eq!(get(&m.dead_lettered), n as u64, "{mode}");
        assert_eq!(
            get(&m.forward_failures),
            n as u64 * deliveries,
            "{mode}: forwards tried per message"
        );
    }
}

fn assert_each_line_once(keys: &BTreeMap<String, usize>, n: usize, what: &str) {
    assert_eq!(keys.len(), n, "{what}: {keys:?}");
    assert!(keys.values().all(|c| *c == 1), "{what}: {keys:?}");
}

/// JetStream to RabbitMQ: each key published once to the queue, with publisher confirms and
/// the key as `message_id`; a sink whose routing key reaches no queue fails at the first
/// forward (mandatory publish), so nothing is acked into the void.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_to_rabbitmq_publishes_each_key_once_with_the_key_as_message_id() {
    use async_nats::jetstream::{self, stream};
    use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    let nats_url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let amqp_url = amqp::url();
    let client = async_nats::connect(&nats_url)
        .await
        .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {nats_url}: {e}"));
    let js = jetstream::new(client);
    let conn = amqp::connect().await;
    let channel = conn.create_channel().await.unwrap();
    let queue = unique("dedupgate-relay-sink");
    channel
        .queue_declare(
            queue.as_str(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let source = unique("relay-to-amqp");
    js.create_stream(stream::Config {
        name: source.clone(),
        subjects: vec![format!("{source}.>")],
        max_age: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .expect("stream");
    for i in 0..M {
        js.publish(
            format!("{source}.in"),
            format!(r#"{{"id":"{}"}}"#, key_of(i)).into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let relay = start(
        RouteConfig {
            name: Some("to-amqp".into()),
            from: format!("{nats_url}/{source}?consumer=relay"),
            to: format!("{amqp_url}?routing_key={queue}"),
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = amqp::message_count(&channel, &queue)
            .await
            .expect("the sink queue");
        if n as usize >= M - D {
            break;
        }
        assert!(Instant::now() < deadline, "{n} messages in the sink queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let metrics = relay.stop().await;
    let mut keys = BTreeMap::new();
    while let Some(m) = channel
        .basic_get(queue.as_str(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let v: serde_json::Value = serde_json::from_slice(&m.delivery.data).unwrap();
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned());
        assert_eq!(id.as_deref(), v["id"].as_str(), "message_id is the key");
        *keys
            .entry(v["id"].as_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    let _ = channel
        .queue_delete(queue.as_str(), QueueDeleteOptions::default())
        .await;
    assert_each_key_once(&keys);
    let m = metrics.route("to-amqp").unwrap();
    assert_eq!(
        m.forwarded.load(std::sync::atomic::Ordering::Relaxed),
        (M - D) as u64
    );

    // The same source to a routing key no queue is bound to: every forward fails.
    let relay = start(
        RouteConfig {
            name: Some("nowhere".into()),
            from: format!("{nats_url}/{source}?consumer=relay2"),
            to: format!("{amqp_url}?routing_key={queue}-unbound"),
            key: Some("{id}".into()),
            namespace: Some("relay.nowhere".into()),
            ..Default::default()
        },
        None,
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let metrics = relay.stop().await;
    let _ = js.delete_stream(&source).await;
    let m = metrics.route("nowhere").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forwarded), 0);
    assert!(get(&m.forward_failures) > 0);
}

fn nats_url() -> String {
    std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

async fn jetstream() -> (async_nats::Client, async_nats::jetstream::Context) {
    let url = nats_url();
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {url}: {e}"));
    let js = async_nats::jetstream::new(client.clone());
    (client, js)
}

/// A JetStream stream named `name` over `name.>`.
async fn nats_stream(js: &async_nats::jetstream::Context, name: &str) {
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        max_age: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .expect("stream");
}

/// Polls the relay's `/metrics` until `done` holds for the scrape, for up to 30 s.
async fn wait_for_metrics(port: u16, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(port).await;
        if done(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; metrics:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Idempotent mode marks a key before forwarding. A forward that fails is dead-lettered; when
/// that dead letter fails too (here: its RabbitMQ queue does not exist yet, so the mandatory
/// publish comes back unroutable), the redelivery finds the key marked, and must send the dead
/// letter again rather than ack it as a duplicate. For both sources that settle per delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idempotent_reject_whose_dead_letter_failed_once_is_dead_lettered_on_redelivery_not_acked()
{
    use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    let (_client, js) = jetstream().await;
    let conn = amqp::connect().await;
    let channel = amqp::confirming_channel(&conn).await;
    for source_kind in ["nats", "amqp"] {
        let dlq = unique("relay-dlq");
        let from = if source_kind == "nats" {
            let source = unique("relay-idem");
            nats_stream(&js, &source).await;
            js.publish(format!("{source}.in"), r#"{"id":"idem-1"}"#.into())
                .await
                .unwrap()
                .await
                .unwrap();
            format!("{}/{source}?consumer=relay", nats_url())
        } else {
            let queue = unique("relay-idem");
            channel
                .queue_declare(
                    queue.as_str(),
                    QueueDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            amqp::publish(&channel, &queue, None, br#"{"id":"idem-1"}"#).await;
            format!("{}?queue={queue}", amqp::url())
        };
        let port = free_port();
        let relay = start(
            RouteConfig {
                name: Some("idem".into()),
                from,
                to: "file:/dev/full".into(),
                key: Some("{id}".into()),
                mode: Some("idempotent".into()),
                dead_letter: Some(format!("{}?routing_key={dlq}", amqp::url())),
                ..Default::default()
            },
            Some(format!("127.0.0.1:{port}")),
        );
        // The forward failed, then its dead letter: the delivery is put back.
        wait_for_metrics(port, "a failed dead letter", |t| {
            counter(t, "forward_failures", "idem") == Some(1)
                && counter(t, "retries", "idem") >= Some(1)
        })
        .await;
        channel
            .queue_declare(
                dlq.as_str(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while amqp::message_count(&channel, &dlq).await.unwrap_or(0) < 1 {
            assert!(
                Instant::now() < deadline,
                "{source_kind}: the dead letter never came; metrics:\n{}",
                scrape(port).await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let metrics = relay.stop().await;
        let dead = channel
            .basic_get(dlq.as_str(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("a dead letter");
        let _ = channel
            .queue_delete(dlq.as_str(), QueueDeleteOptions::default())
            .await;
        let reason = dead
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(dedupgate_relay::REASON_HEADER).cloned())
            .and_then(|v| match v {
                lapin::types::AMQPValue::LongString(s) => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                _ => None,
            })
            .unwrap_or_default();
        assert!(reason.contains("No space left"), "{source_kind}: {reason}");
        let m = metrics.route("idem").unwrap();
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(get(&m.forwarded), 0, "{source_kind}");
        assert_eq!(get(&m.dead_lettered), 1, "{source_kind}");
        assert_eq!(get(&m.duplicates), 0, "{source_kind}: acked as a duplicate");
        assert_eq!(
            get(&m.forward_failures),
            1,
            "{source_kind}: marked, never forwarded again"
        );
    }
}

/// A gate key may be up to 1024 bytes, an AMQP `message_id` at most 255: a 1,000-byte key
/// reaches the RabbitMQ sink with its SHA-256 as `message_id` and whole in `idempotency-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_1000_byte_key_reaches_a_rabbitmq_sink_hashed_in_message_id_and_whole_in_a_header() {
    use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::{AMQPValue, FieldTable};

    let (_client, js) = jetstream().await;
    let conn = amqp::connect().await;
    let channel = conn.create_channel().await.unwrap();
    let queue = unique("relay-long-key");
    channel
        .queue_declare(
            queue.as_str(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let source = unique("relay-long");
    nats_stream(&js, &source).await;
    let key = format!("long-{}", "x".repeat(995));
    assert_eq!(key.len(), 1000);
    js.publish(
        format!("{source}.in"),
        format!(r#"{{"id":"{key}"}}"#).into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let relay = start(
        RouteConfig {
            name: Some("long".into()),
            from: format!("{}/{source}?consumer=relay", nats_url()),
            to: format!("{}?routing_key={queue}", amqp::url()),
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while amqp::message_count(&channel, &queue).await.unwrap_or(0) < 1 {
        assert!(Instant::now() < deadline, "nothing reached the sink queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = relay.stop().await;
    let _ = js.delete_stream(&source).await;
    let got = channel
        .basic_get(queue.as_str(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the message");
    let _ = channel
        .queue_delete(queue.as_str(), QueueDeleteOptions::default())
        .await;
    let id = got.delivery.properties.message_id().clone().unwrap();
    assert!(id.as_str().starts_with("sha256:"), "{}", id.as_str());
    assert_eq!(id.as_str().len(), 71);
    let header = got
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("idempotency-key").cloned());
    match header {
        Some(AMQPValue::LongString(s)) => assert_eq!(s.as_bytes(), key.as_bytes()),
        other => panic!("idempotency-key header: {other:?}"),
    }
    let v: serde_json::Value = serde_json::from_slice(&got.delivery.data).unwrap();
    assert_eq!(v["id"].as_str(), Some(key.as_str()));
    let m = metrics.route("long").unwrap();
    assert_eq!(m.forwarded.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A key with CR/LF cannot be a NATS header (`Nats-Msg-Id`): written as it is, it would end
/// the header and inject another. The record is dead-lettered at once with the reason, and the
/// dead letter (to NATS too) carries the key and reason escaped, on one header line each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_with_a_line_break_is_dead_lettered_not_injected_into_nats_headers() {
    use async_nats::jetstream;
    use futures::StreamExt;

    let (_client, js) = jetstream().await;
    let (source, sink, dlq) = (
        unique("relay-crlf-src"),
        unique("relay-crlf-dst"),
        unique("relay-crlf-dlq"),
    );
    for name in [&source, &sink, &dlq] {
        nats_stream(&js, name).await;
    }
    for id in ["fine-1", "bad\r\nInjected: yes"] {
        let payload = serde_json::json!({ "id": id }).to_string();
        js.publish(format!("{source}.in"), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let port = free_port();
    let relay = start(
        RouteConfig {
            name: Some("crlf".into()),
            from: format!("{}/{source}?consumer=relay", nats_url()),
            to: format!("{}/{sink}.out", nats_url()),
            key: Some("{id}".into()),
            dead_letter: Some(format!("{}/{dlq}.dead", nats_url())),
            ..Default::default()
        },
        Some(format!("127.0.0.1:{port}")),
    );
    wait_for_metrics(port, "one forwarded, one dead-lettered", |t| {
        counter(t, "forwarded", "crlf") == Some(1) && counter(t, "dead_lettered", "crlf") == Some(1)
    })
    .await;
    let metrics = relay.stop().await;
    let read = |stream: String| {
        let js = js.clone();
        async move {
            let consumer = js
                .get_stream(&stream)
                .await
                .unwrap()
                .create_consumer(jetstream::consumer::pull::Config::default())
                .await
                .unwrap();
            let mut messages = consumer
                .fetch()
                .max_messages(10)
                .expires(Duration::from_secs(1))
                .messages()
                .await
                .unwrap();
            let mut out = Vec::new();
            while let Some(Ok(m)) = messages.next().await {
                out.push(m);
            }
            out
        }
    };
    let forwarded = read(sink.clone()).await;
    let dead = read(dlq.clone()).await;
    for name in [&source, &sink, &dlq] {
        let _ = js.delete_stream(name).await;
    }
    assert_eq!(forwarded.len(), 1, "only the fine message reaches the sink");
    assert_eq!(dead.len(), 1, "the bad one is dead-lettered");
    let headers = dead[0].headers.clone().expect("dead-letter headers");
    assert!(
        headers.get("Injected").is_none(),
        "an injected header: {headers:?}"
    );
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default()
    };
    assert_eq!(
        header(dedupgate_relay::DEAD_LETTER_KEY_HEADER),
        "bad\\r\\nInjected: yes"
    );
    let reason = header(dedupgate_relay::REASON_HEADER);
    assert!(reason.contains("line break"), "{reason}");
    assert!(!reason.contains(['\r', '\n']), "{reason:?}");
    let m = metrics.route("crlf").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forward_failures), 1, "refused once, not retried");
}

/// The same key with a line break, from a Kafka source: the NATS sink refuses it, and a
/// refusal would come back alike on every try, so the Kafka consumer rejects the record at
/// once: dead-lettered to the route's dead-letter topic once, never retried, and the source
/// committed past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_with_a_line_break_from_kafka_is_dead_lettered_once_not_retried() {
    let Some(broker) = kafka::start() else { return };
    let (topic, dlq) = ("crlf-in", "crlf-dead");
    broker.create_topic(topic, 1).await;
    broker.create_topic(dlq, 1).await;
    let (_client, js) = jetstream().await;
    let sink = unique("relay-kafka-crlf-dst");
    nats_stream(&js, &sink).await;
    let payloads: Vec<String> = ["fine-1", "bad\r\nInjected: yes"]
        .iter()
        .map(|id| serde_json::json!({ "id": id }).to_string())
        .collect();
    let records: Vec<(i32, Option<&str>, &[u8])> =
        payloads.iter().map(|p| (0, None, p.as_bytes())).collect();
    let mut ends = Vec::new();
    kafka::produce(&broker.producer(), topic, 1, &records, &mut ends).await;
    let group = unique("relay");
    let port = free_port();
    let relay = start(
        RouteConfig {
            name: Some("kcrlf".into()),
            from: format!("kafka://{}/{topic}?group={group}", broker.bootstrap),
            to: format!("{}/{sink}.out", nats_url()),
            key: Some("{id}".into()),
            dead_letter: Some(format!("kafka://{}/{dlq}", broker.bootstrap)),
            ..Default::default()
        },
        Some(format!("127.0.0.1:{port}")),
    );
    let committed =
        kafka::wait_committed(&broker.bootstrap, &group, topic, &ends, COMMIT_DEADLINE).await;
    let metrics = relay.stop().await;
    let dead = tokio::task::spawn_blocking({
        let bootstrap = broker.bootstrap.clone();
        move || read_topic(&bootstrap, dlq, 1, 1)
    })
    .await
    .unwrap();
    let held = js
        .get_stream(&sink)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    let _ = js.delete_stream(&sink).await;
    if let Err(e) = committed {
        panic!("the source committed past both records: {e}");
    }
    assert_eq!(held, 1, "only the fine record reaches the sink");
    assert_eq!(dead.len(), 1, "the bad one is dead-lettered once");
    let reason = dead[0]
        .2
        .iter()
        .find(|(n, _)| n == dedupgate_relay::REASON_HEADER)
        .map(|(_, v)| v.clone())
        .expect("a reason header");
    assert!(reason.contains("line break"), "{reason}");
    let m = metrics.route("kcrlf").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forward_failures), 1, "refused once, not retried");
    assert_eq!(get(&m.retries), 0, "not retried");
    assert_eq!(get(&m.dead_lettered), 1);
}

/// A sink slower than the JetStream consumer's ack wait: the relay tells the server the
/// message is in progress (every third of the ack wait), so it is not delivered again while
/// the first copy is being forwarded. The sink here is a JetStream publish that the test itself
/// answers, 3 s late, with a PubAck (ack wait: 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_sink_does_not_let_jetstream_redeliver_the_message_in_flight() {
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    use futures::StreamExt;

    let (client, js) = jetstream().await;
    let source = unique("relay-slow");
    nats_stream(&js, &source).await;
    js.get_stream(&source)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("relay".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .unwrap();
    js.publish(format!("{source}.in"), r#"{"id":"slow-1"}"#.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // The "stream" of the sink subject: answers each publish with a PubAck after 3 s.
    let subject = unique("relay-slow-sink");
    let mut sink = client.subscribe(subject.clone()).await.unwrap();
    client.flush().await.unwrap();
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let responder = {
        let client = client.clone();
        tokio::spawn(async move {
            while let Some(m) = sink.next().await {
                let _ = seen_tx.send(());
                let client = client.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    if let Some(reply) = m.reply {
                        let ack = r#"{"stream":"slow-sink","seq":1}"#;
                        client.publish(reply, ack.into()).await.unwrap();
                    }
                });
            }
        })
    };
    let port = free_port();
    let relay = start(
        RouteConfig {
            name: Some("slow".into()),
            from: format!("{}/{source}?consumer=relay", nats_url()),
            to: format!("{}/{subject}", nats_url()),
            key: Some("{id}".into()),
            ..Default::default()
        },
        Some(format!("127.0.0.1:{port}")),
    );
    wait_for_metrics(port, "the slow forward confirmed", |t| {
        counter(t, "forwarded", "slow") == Some(1)
    })
    .await;
    let metrics = relay.stop().await;
    responder.abort();
    let _ = js.delete_stream(&source).await;
    let mut publishes = 0;
    while seen.try_recv().is_ok() {
        publishes += 1;
    }
    let m = metrics.route("slow").unwrap();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        get(&m.records_in),
        1,
        "deliveries of the message (a redelivery while in flight counts again)"
    );
    assert_eq!(publishes, 1, "publishes to the sink");
}
