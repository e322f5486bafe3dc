//! The stream of the kill tests (issue #21 item 5), shared by `kafka_kill.rs` here and the
//! binary crate's `relay_sigkill.rs`: M records, D% of them copies of an earlier key, made of a
//! seeded mix of single copies (a producer retry: the same key and payload at a new offset) and
//! a replay of a whole contiguous range at the end, produced at a steady pace so that kills land
//! mid-stream. Each key's records go to one partition (as a keyed producer puts them) and carry
//! the key as Kafka key and `idempotency-key` header; the payload is a function of the key, so
//! a copy matches its key's fingerprint.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::time::Duration;

use dedupgate_consumers::kafka::rdkafka::message::{Header, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use rand::{Rng, SeedableRng};

/// The seed: `DEDUPGATE_KILL_SEED` to replay a run, else a fresh one; printed either way,
/// after `test`'s name.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("DEDUPGATE_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {seed} (DEDUPGATE_KILL_SEED={seed} replays it)");
    seed
}

/// Every distinct key at the sink (`counts`: each key's copies there), and nothing else;
/// `log` gives what the processes logged, for the message.
pub fn assert_nothing_lost(
    counts: &BTreeMap<String, usize>,
    distinct: &BTreeSet<String>,
    log: impl Fn() -> String,
) {
    let lost: Vec<&String> = distinct
        .iter()
        .filter(|k| !counts.contains_key(*k))
        .collect();
    assert!(
        lost.is_empty(),
        "{} keys lost, such as {:?}; the log:\n{}",
        lost.len(),
        &lost[..lost.len().min(5)],
        log()
    );
    let foreign: Vec<&String> = counts.keys().filter(|k| !distinct.contains(*k)).collect();
    assert!(
        foreign.is_empty(),
        "keys at the sink that were never produced: {foreign:?}"
    );
}

/// A child process the test stops: killed (SIGKILL) on drop, so a failing test leaves none
/// behind; [`Self::terminate`] stops it the graceful way instead.
pub struct KilledOnDrop(pub Child);

impl KilledOnDrop {
    /// SIGTERM, and its exit code (0: it settled what was in hand and committed).
    pub fn terminate(mut self) -> Option<i32> {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        self.0.wait().expect("wait for the process").code()
    }
}

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One record to produce.
#[derive(Clone, Debug)]
pub struct Produced {
    pub partition: i32,
    pub key: String,
}

/// The records in production order and the distinct keys among them.
pub struct Workload {
    pub records: Vec<Produced>,
    pub distinct: BTreeSet<String>,
}

/// The payload of `key`'s records: JSON, the same for every copy.
pub fn payload(key: &str) -> String {
    format!(r#"{{"key":"{key}"}}"#)
}

/// `total` records, `dup_percent` of them copies: half single copies of a random earlier key
/// put at a random later place, half a replay of the contiguous range of originals that
/// precedes the end, appended as is.
pub fn build(seed: u64, total: usize, dup_percent: usize, partitions: i32) -> Workload {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let copies = total * dup_percent / 100;
    let replayed = copies / 2;
    let singles = copies - replayed;
    let originals = total - copies;
    assert!(
        replayed <= originals,
        "the replayed range fits the originals"
    );
    let keys: Vec<String> = (0..originals)
        .map(|i| format!("k-{seed:x}-{i:05}"))
        .collect();
    let mut order: Vec<usize> = (0..originals).collect();
    for _ in 0..singles {
        let of = rng.gen_range(0..originals);
        // Somewhere after its original.
        let first = order
            .iter()
            .position(|&k| k == of)
            .expect("the original is there");
        let at = rng.gen_range(first + 1..=order.len());
        order.insert(at, of);
    }
    let start = rng.gen_range(0..=originals - replayed);
    order.extend(start..start + replayed);
    let records = order
        .into_iter()
        .map(|i| Produced {
            partition: (i as i32) % partitions,
            key: keys[i].clone(),
        })
        .collect::<Vec<_>>();
    assert_eq!(records.len(), total);
    Workload {
        records,
        distinct: keys.into_iter().collect(),
    }
}

/// Produces `records` in order, `per_tick` of them at a time every `tick`, and returns each
/// partition's end (one past its last record's offset) as the broker acknowledged them.
pub async fn produce_paced(
    producer: &FutureProducer,
    topic: &str,
    partitions: i32,
    records: &[Produced],
    per_tick: usize,
    tick: Duration,
) -> Vec<i64> {
    let mut ends = vec![0i64; partitions as usize];
    let mut every = tokio::time::interval(tick);
    for chunk in records.chunks(per_tick) {
        every.tick().await;
        let sends = chunk.iter().map(|r| {
            let payload = payload(&r.key);
            let headers = OwnedHeaders::new().insert(Header {
                key: "idempotency-key",
                value: Some(r.key.as_str()),
            });
            async move {
                producer
                    .send(
                        FutureRecord::to(topic)
                            .partition(r.partition)
                            .key(r.key.as_str())
                            .payload(payload.as_str())
                            .headers(headers),
                        Duration::from_secs(10),
                    )
                    .await
                    .unwrap_or_else(|(e, _)| panic!("produce to {topic}/{}: {e}", r.partition))
            }
        });
        for delivery in futures::future::join_all(sends).await {
            let end = &mut ends[delivery.partition as usize];
            *end = (*end).max(delivery.offset + 1);
        }
    }
    ends
}
