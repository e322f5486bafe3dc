//! `dedupgate relay` under SIGKILL (issue #21 item 5), counted at the sink. A tansu broker of
//! the test's own (`dedupgate-consumers/tests/common/kafka.rs`; skipped, saying so, only when
//! its binary is not installed) carries M = 2,000 records, 30% of them copies (single copies of
//! a key at new offsets, and a replay of a whole range: `common/workload.rs`), produced at a
//! steady pace while the real binary relays them in retriable mode over an embedded store in a
//! directory that outlives each process. The relay is killed with SIGKILL at random moments
//! (seeded: the seed is printed, `DEDUPGATE_KILL_SEED` replays it) and restarted each time;
//! once the group's committed offsets reach every partition's end, the sink is read back.
//!
//! Why a kill can duplicate and never lose: the relay forwards a record and waits for the
//! sink's confirmation before it completes the key, and commits a record's offset only after
//! that. A kill before the commit leaves the record to be consumed again: a completed key is
//! then a duplicate, and a key claimed but not completed (forwarded, or about to be) waits for
//! its lease (30 s) and is forwarded again. So each kill can forward again at most the records
//! the relay had in hand, `dedupgate_relay::IN_FLIGHT`.

#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/kafka.rs"]
mod kafka;
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/names.rs"]
mod names;
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/workload.rs"]
mod workload;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use dedupgate_consumers::kafka::rdkafka::message::Message as _;
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};
use names::unique;
use rand::{Rng, SeedableRng};
use workload::{assert_nothing_lost, seed, KilledOnDrop};

/// Records produced, and the percentage of them that are copies.
const M: usize = 2_000;
const D_PERCENT: usize = 30;
const PARTITIONS: i32 = 4;
/// The pace of production: 2,000 records in about 8 s, so the first run joins (after about
/// 6 s) a stream still being produced, with a backlog to forward when it is killed.
const PER_TICK: usize = 25;
const TICK: Duration = Duration::from_millis(100);
/// Kills per test: each restart waits out the dead member's session (10 s) before the group
/// gives it partitions, so a kill costs about 20 s here; three keep a test near a minute.
const KILLS: usize = 3;
/// How long a relay run may take to take its first record (joining the group, after a kill
/// also waiting out the dead member's session), and the whole stream to be committed.
const JOIN_DEADLINE: Duration = Duration::from_secs(40);
const END_DEADLINE: Duration = Duration::from_secs(120);
/// What the relay logs when the group gave it partitions.
const ASSIGNED: &str = "partitions assigned";

/// A relay process, killed on drop; its stderr goes to a log the test prints when it fails.
struct Relay {
    child: KilledOnDrop,
    metrics_port: u16,
}

/// Where every run of one test writes: the store, the relay's log.
struct Scene {
    store: PathBuf,
    log: PathBuf,
    from: String,
    to: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Scene {
    fn start(&self) -> Relay {
        let metrics_port = free_port();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("relay log");
        let child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .arg("relay")
            .args(["--name", "kill", "--from", &self.from, "--to", &self.to])
            .arg("--store")
            .arg(&self.store)
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start dedupgate relay");
        Relay {
            child: KilledOnDrop(child),
            metrics_port,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the relay logged a group assignment beyond the `before` logged so far (a
    /// run that finds the stream committed takes no record, but it does get partitions).
    fn wait_assigned(&self, before: usize) {
        let deadline = Instant::now() + JOIN_DEADLINE;
        while self.log().matches(ASSIGNED).count() == before {
            assert!(
                Instant::now() < deadline,
                "the relay got no partitions within {JOIN_DEADLINE:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Relay {
    /// A counter of this process's `/metrics`, 0 while it cannot be read.
    fn counter(&self, noun: &str) -> u64 {
        let Ok(mut conn) = TcpStream::connect(("127.0.0.1", self.metrics_port)) else {
            return 0;
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        if conn
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: relay\r\n\r\n")
            .is_err()
        {
            return 0;
        }
        let mut text = String::new();
        let _ = conn.read_to_string(&mut text);
        let name = format!("dedupgate_relay_{noun}_total{{route=\"kill\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until this process's counter `noun` reached `n`.
    fn wait_for(&mut self, scene: &Scene, noun: &str, n: u64) {
        let deadline = Instant::now() + JOIN_DEADLINE;
        while self.counter(noun) < n {
            if let Ok(Some(status)) = self.child.0.try_wait() {
                panic!("the relay exited ({status}):\n{}", scene.log());
            }
            assert!(
                Instant::now() < deadline,
                "the relay's {noun} stayed below {n} for {JOIN_DEADLINE:?}:\n{}",
                scene.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, and its exit code (0: it settled what was in hand and committed).
    fn terminate(self) -> Option<i32> {
        self.child.terminate()
    }
}

/// What a run did: how many kills, and the workload's distinct keys.
struct Run {
    kills: usize,
    distinct: BTreeSet<String>,
}

/// Produces the workload at its pace while the relay runs and kills the relay with SIGKILL
/// [`KILLS`] times: the first run once it forwarded a random number of records (so that kill
/// finds records in hand, forwarded or being forwarded, not yet completed), each later run at
/// a random moment up to 1.5 s after it got its partitions (while it takes the records left
/// uncommitted by the previous kill: duplicates being settled, keys still held by the dead
/// run's claims until their lease ends, or new ones). Then lets a last run commit the whole stream and stops it
/// with SIGTERM (exit 0).
fn relay_under_kills(broker: &kafka::Broker, scene: &Scene, source: &str, group: &str) -> Run {
    let seed = seed("relay_sigkill");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let work = workload::build(seed, M, D_PERCENT, PARTITIONS);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(broker.create_topic(source, PARTITIONS));
    let producer = broker.producer();
    let records = work.records.clone();
    let topic = source.to_owned();
    let producing = runtime.spawn(async move {
        workload::produce_paced(&producer, &topic, PARTITIONS, &records, PER_TICK, TICK).await
    });
    let started = Instant::now();
    for kill in 1..=KILLS {
        let assigned_before = scene.log().matches(ASSIGNED).count();
        let mut relay = scene.start();
        let when = if kill == 1 {
            let forwarded = rng.gen_range(1..=200);
            relay.wait_for(scene, "forwarded", forwarded);
            format!("after it forwarded {forwarded} records")
        } else {
            scene.wait_assigned(assigned_before);
            let after = Duration::from_millis(rng.gen_range(0..=1_500));
            std::thread::sleep(after);
            format!("{after:?} after it got its partitions")
        };
        eprintln!(
            "relay_sigkill: kill {kill}/{KILLS} at {:?}, {when}",
            started.elapsed()
        );
        // Child::kill is SIGKILL.
        drop(relay);
    }
    let assigned_before = scene.log().matches(ASSIGNED).count();
    let relay = scene.start();
    let ends = runtime
        .block_on(producing)
        .expect("the producer task finished");
    runtime
        .block_on(kafka::wait_committed(
            &broker.bootstrap,
            group,
            source,
            &ends,
            END_DEADLINE,
        ))
        .unwrap_or_else(|e| panic!("{e}:\n{}", scene.log()));
    eprintln!(
        "relay_sigkill: the stream was committed at {:?}",
        started.elapsed()
    );
    // The last run may find everything committed already: it is stopped once it holds the
    // partitions, so SIGTERM finds it running.
    scene.wait_assigned(assigned_before);
    assert_eq!(relay.terminate(), Some(0), "{}", scene.log());
    Run {
        kills: KILLS,
        distinct: work.distinct,
    }
}

/// The keys seen `n` times, for the messages.
fn seen(counts: &BTreeMap<String, usize>, n: impl Fn(usize) -> bool) -> Vec<&String> {
    counts
        .iter()
        .filter(|(_, c)| n(**c))
        .map(|(k, _)| k)
        .collect()
}

fn scene(dir: &Path, broker: &kafka::Broker, source: &str, group: &str, to: String) -> Scene {
    Scene {
        store: dir.join("store"),
        log: dir.join("relay.log"),
        from: format!("kafka://{}/{source}?group={group}", broker.bootstrap),
        to,
    }
}

/// Sink JetStream: `Nats-Msg-Id` is the key, and the stream's duplicate window (2 min, longer
/// than the relay's 30 s lease plus the restarts) drops the second forward of a key that was
/// in flight at a kill. So the stream holds every distinct key exactly once. A plain subscriber
/// on the subject sees every publish, also those the window dropped: at most the records in
/// hand at each kill are published twice.
#[test]
fn relay_killed_at_random_kafka_to_jetstream_holds_each_key_exactly_once() {
    use async_nats::jetstream::{self, consumer, stream};
    use futures::StreamExt;

    let Some(broker) = kafka::start() else { return };
    let url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let name = unique("relay-kill");
    let subject = format!("{name}.out");
    // The subscriber is dropped at the end, which needs the runtime.
    let _inside = runtime.enter();
    let (_client, js, mut published) = runtime.block_on(async {
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {url}: {e}"));
        let js = jetstream::new(client.clone());
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("sink stream");
        let published = client.subscribe(subject.clone()).await.unwrap();
        client.flush().await.unwrap();
        (client, js, published)
    });
    let dir = tempfile::tempdir().unwrap();
    let (source, group) = (unique("kill-src"), unique("relay"));
    let scene = scene(
        dir.path(),
        &broker,
        &source,
        &group,
        format!("{url}/{subject}"),
    );
    let run = relay_under_kills(&broker, &scene, &source, &group);
    let stored = runtime.block_on(async {
        let mut sink = js.get_stream(&name).await.unwrap();
        let held = sink.info().await.unwrap().state.messages as usize;
        let reader = sink
            .create_consumer(consumer::pull::Config {
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut read = 0;
        while read < held {
            let mut batch = reader
                .fetch()
                .max_messages(500)
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .unwrap();
            let before = read;
            while let Some(m) = batch.next().await {
                let m = m.expect("a sink message");
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                    .map(|v| v.as_str().to_owned())
                    .expect("Nats-Msg-Id");
                *counts.entry(id).or_default() += 1;
                read += 1;
            }
            assert!(read > before, "the sink stream stopped at {read} of {held}");
        }
        let _ = js.delete_stream(&name).await;
        counts
    });
    // Every publish the subscriber saw (it buffers them), counted per key; the relay is gone.
    let publishes = runtime.block_on(async {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        while let Ok(Some(m)) =
            tokio::time::timeout(Duration::from_millis(500), published.next()).await
        {
            let v: serde_json::Value = serde_json::from_slice(&m.payload).expect("JSON payload");
            let key = v["key"].as_str().expect("a key field").to_owned();
            *counts.entry(key).or_default() += 1;
        }
        counts
    });

    assert_nothing_lost(&stored, &run.distinct, || scene.log());
    let twice = seen(&stored, |c| c > 1);
    assert!(twice.is_empty(), "keys stored twice: {twice:?}");
    assert_nothing_lost(&publishes, &run.distinct, || scene.log());
    let again: usize = publishes.values().map(|c| c - 1).sum();
    let bound = run.kills * usize::from(dedupgate_relay::IN_FLIGHT);
    eprintln!(
        "relay_sigkill: {} keys, {} kills, {again} published again (bound {bound})",
        run.distinct.len(),
        run.kills
    );
    assert!(
        again <= bound,
        "{again} keys published again, more than {} kills × {} in flight",
        run.kills,
        dedupgate_relay::IN_FLIGHT
    );
}

/// Reads every record of `topic` from the start up to its high watermarks: each Kafka key's
/// count.
fn read_topic(bootstrap: &str, topic: &str, partitions: i32) -> BTreeMap<String, usize> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    for p in 0..partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .expect("watermarks");
        ends.push(high);
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).expect("assign");
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut next = vec![0i64; partitions as usize];
    let deadline = Instant::now() + Duration::from_secs(30);
    // Reads on until nothing came for 2 s past the high watermarks: tansu's watermarks were
    // seen to lag its last records.
    let mut quiet_since: Option<Instant> = None;
    loop {
        let reached = next.iter().zip(&ends).all(|(n, e)| n >= e);
        if reached && quiet_since.is_some_and(|t| t.elapsed() >= Duration::from_secs(2)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "read {next:?} of the sink's {ends:?}"
        );
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            quiet_since.get_or_insert_with(Instant::now);
            continue;
        };
        quiet_since = None;
        let m = m.expect("a sink record");
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        *counts.entry(key).or_default() += 1;
        next[m.partition() as usize] = m.offset() + 1;
    }
    eprintln!(
        "relay_sigkill: read {} records of the sink, up to {next:?} (high watermarks {ends:?})",
        counts.values().sum::<usize>()
    );
    counts
}

/// Sink Kafka, the idempotent (not transactional) producer: every distinct key at least once,
/// nothing lost, and a key twice only when it was in hand at a kill (forwarded, or being
/// forwarded, and not yet completed), so at most kills × `IN_FLIGHT` extra records. Exactly
/// once needs more than this sink gives: the idempotent producer dedups only its own retries
/// within one producer session, and a restarted relay is a new session; the record forwarded
/// before the kill is already in the topic when the key is forwarded again after its lease. A
/// transactional sink (the forward and the source offset committed together, the consumers
/// crate's `TransactionalPipe`) or a deduplicating one (JetStream's window, a consumer that
/// gates on the `idempotency-key` header) closes that window.
#[test]
fn relay_killed_at_random_kafka_to_kafka_loses_nothing_and_duplicates_only_what_was_in_hand() {
    let Some(broker) = kafka::start() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let sink = unique("kill-dst");
    runtime.block_on(broker.create_topic(&sink, PARTITIONS));
    let dir = tempfile::tempdir().unwrap();
    let (source, group) = (unique("kill-src"), unique("relay"));
    let scene = scene(
        dir.path(),
        &broker,
        &source,
        &group,
        format!("kafka://{}/{sink}", broker.bootstrap),
    );
    let run = relay_under_kills(&broker, &scene, &source, &group);
    let counts = read_topic(&broker.bootstrap, &sink, PARTITIONS);

    assert_nothing_lost(&counts, &run.distinct, || scene.log());
    let again: usize = counts.values().map(|c| c - 1).sum();
    let bound = run.kills * usize::from(dedupgate_relay::IN_FLIGHT);
    eprintln!(
        "relay_sigkill: {} keys, {} kills, {again} forwarded again (bound {bound})",
        run.distinct.len(),
        run.kills
    );
    assert!(
        again <= bound,
        "{again} keys forwarded again, more than {} kills × {} in flight",
        run.kills,
        dedupgate_relay::IN_FLIGHT
    );
}
