//! Many processes on one Redis: this binary re-executes itself as four worker processes, each
//! with many concurrent workers claiming overlapping keys and logging every answer. The parent
//! checks from the logs that every key got exactly one "new".
//!
//! `harness = false`: `main` is the parent unless `DG_MP_CHILD` is set.

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;
use std::io::Write;
use std::process::Command;
use std::sync::Arc;

use dedupgate_core::{Claim, Op, Outcome, RecordId, Store};
use dedupgate_redis::testkit::shared_redis_url;
use dedupgate_redis::RedisStore;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const PROCESSES: usize = 4;
const WORKERS_PER_PROCESS: usize = 16;
const KEYS: usize = 300;

fn main() {
    match std::env::var("DG_MP_CHILD") {
        Ok(child) => run_child(child.parse().expect("child number")),
        Err(_) => run_parent(),
    }
}

fn run_parent() {
    let seed: u64 = std::env::var("DG_MP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    let ns = format!("mp.{seed:x}.{}", std::process::id());
    eprintln!("many_processes: seed {seed} (replay with DG_MP_SEED={seed}), namespace {ns}");
    let dir = tempfile::tempdir().expect("temp dir");
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..PROCESSES)
        .map(|p| {
            Command::new(&exe)
                .env("DG_MP_CHILD", p.to_string())
                .env("DG_MP_SEED", seed.to_string())
                .env("DG_MP_NS", &ns)
                .env("DG_MP_LOG", dir.path().join(format!("answers-{p}.log")))
                .spawn()
                .expect("spawn a worker process")
        })
        .collect();
    for mut c in children {
        let status = c.wait().expect("wait for worker process");
        assert!(status.success(), "a worker process failed: {status}");
    }
    let mut news: HashMap<String, Vec<String>> = HashMap::new();
    let mut answers = 0usize;
    for p in 0..PROCESSES {
        let log = std::fs::read_to_string(dir.path().join(format!("answers-{p}.log"))).unwrap();
        for line in log.lines() {
            answers += 1;
            let mut parts = line.split(' ');
            let (who, key, outcome) = (
                parts.next().unwrap(),
                parts.next().unwrap(),
                parts.next().unwrap(),
            );
            match outcome {
                "new" => news.entry(key.to_owned()).or_default().push(who.to_owned()),
                "duplicate" => {}
                other => panic!("{who} {key}: unexpected answer {other}"),
            }
        }
    }
    assert_eq!(
        answers,
        PROCESSES * WORKERS_PER_PROCESS * KEYS,
        "every answer logged"
    );
    let doubled: Vec<_> = news.iter().filter(|(_, w)| w.len() != 1).collect();
    assert!(
        doubled.is_empty(),
        "keys with more than one new: {doubled:?}"
    );
    assert_eq!(news.len(), KEYS, "every key got its one new");
    eprintln!("many_processes: {answers} answers from {PROCESSES} processes, one new per key: ok");
}

fn run_child(child: usize) {
    let seed: u64 = std::env::var("DG_MP_SEED").unwrap().parse().unwrap();
    let ns = std::env::var("DG_MP_NS").unwrap();
    let log_path = std::env::var("DG_MP_LOG").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store: Arc<dyn Store> = Arc::new(
            RedisStore::open(&shared_redis_url())
                .await
                .expect("open Redis"),
        );
        let tasks: Vec<_> = (0..WORKERS_PER_PROCESS)
            .map(|w| {
                let (store, ns) = (store.clone(), ns.clone());
                tokio::spawn(async move {
                    let mut rng =
                        rand::rngs::StdRng::seed_from_u64(seed ^ ((child * 1000 + w) as u64));
                    let mut keys: Vec<usize> = (0..KEYS).collect();
                    keys.shuffle(&mut rng);
                    let mut lines = Vec::with_capacity(KEYS);
                    for k in keys {
                        let key = format!("k{k}");
                        let id = RecordId::new(ns.clone(), key.clone()).unwrap();
                        let op = Op::Claim {
                            ttl_ms: 600_000,
                            lease_ms: 600_000,
                            fingerprint: None,
                            owner: None,
                        };
                        let outcome = match store.apply_op(id.clone(), op).await {
                            Ok(Outcome::Claimed(Claim::New(lease))) => {
                                // Half the winners complete, so duplicates see both states.
                                if k % 2 == 0 {
                                    let done = Op::Complete {
                                        token: lease.token,
                                        result: None,
                                        ttl_ms: None,
                                    };
                                    store.apply_op(id, done).await.expect("complete own claim");
                                }
                                "new"
                            }
                            Ok(Outcome::Claimed(Claim::Duplicate { .. })) => "duplicate",
                            Ok(other) => panic!("claim answered {other:?}"),
                            Err(e) => panic!("claim failed: {e}"),
                        };
                        lines.push(format!("p{child}w{w} {key} {outcome}\n"));
                    }
                    lines
                })
            })
            .collect();
        let mut log = std::fs::File::create(&log_path).expect("create log");
        for t in tasks {
            for line in t.await.expect("worker") {
                log.write_all(line.as_bytes()).unwrap();
            }
        }
        log.sync_all().unwrap();
    });
}
