//! Many processes on one PostgreSQL: four gate processes (this test binary re-run as workers),
//! each with many concurrent workers claiming overlapping keys, singly and in batches. Every
//! answer is logged; each key must get exactly one "new" across all processes.
//!
//! `harness = false`: with DEDUPGATE_PG_CHILD set the binary is a worker process, otherwise it is
//! the test that starts four of them and checks their logs.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use dedupgate_core::{Claim, Op, Outcome, RecordId, Store};
use rand::{Rng, SeedableRng};

const PROCESSES: usize = 4;
const WORKERS_PER_PROCESS: usize = 12;
const KEYS: usize = 400;
/// Each worker attempts this many claims (keys drawn from the shared set).
const ATTEMPTS_PER_WORKER: usize = 150;
const BATCH_OPS: usize = 10;

fn claim() -> Op {
    Op::Claim {
        ttl_ms: 600_000,
        lease_ms: 300_000,
        fingerprint: None,
        owner: None,
    }
}

fn main() {
    if std::env::var_os("DEDUPGATE_PG_CHILD").is_some() {
        return child();
    }
    // Behave like a test harness towards cargo: list, and honour a name filter.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("many_processes_one_new_per_key: test");
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty()
        && !filters
            .iter()
            .any(|f| "many_processes_one_new_per_key".contains(f.as_str()))
    {
        return;
    }
    parent();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One gate process: prints `ANSWER <key> <new|dup> <fence>` or `ERROR <key> <why>` per claim.
fn child() {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let url = env("DEDUPGATE_PG_URL");
    let schema = env("DEDUPGATE_PG_SCHEMA");
    let ns = env("DEDUPGATE_PG_NS");
    let seed: u64 = env("DEDUPGATE_PG_SEED").parse().unwrap();
    let process: u64 = env("DEDUPGATE_PG_CHILD").parse().unwrap();
    runtime().block_on(async move {
        let store: Arc<dyn Store> = Arc::new(common::open(&url, &schema, 4).await);
        let tasks = (0..WORKERS_PER_PROCESS).map(|w| {
            let (store, ns) = (store.clone(), ns.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (process << 32) ^ w as u64);
                let mut lines = Vec::new();
                let batched = w % 2 == 1;
                let mut done = 0;
                let mut sent = 0;
                while done < ATTEMPTS_PER_WORKER {
                    let n = if batched { BATCH_OPS } else { 1 };
                    let mut keys: Vec<usize> = (0..n).map(|_| rng.gen_range(0..KEYS)).collect();
                    // Batches lock their rows in op order; a consistent order avoids deadlocks
                    // between concurrent batches (docs/postgres.md).
                    keys.sort_unstable();
                    keys.dedup();
                    let ops: Vec<_> = keys
                        .iter()
                        .map(|k| (RecordId::new(ns.clone(), format!("k{k}")).unwrap(), claim()))
                        .collect();
                    let answers = if batched {
                        store.apply_ops(ops).await
                    } else {
                        let (id, op) = ops.into_iter().next().unwrap();
                        vec![store.apply_op(id, op).await]
                    };
                    for (k, a) in keys.iter().zip(answers) {
                        lines.push(match a {
                            Ok(Outcome::Claimed(Claim::New(l))) => {
                                format!("ANSWER k{k} new {}", l.fence)
                            }
                            Ok(Outcome::Claimed(Claim::Duplicate { record })) => {
                                format!("ANSWER k{k} dup {}", record.fence)
                            }
                            other => format!("ERROR k{k} {other:?}"),
                        });
                    }
                    done += n;
                    sent += keys.len();
                }
                lines.push(format!("SENT {sent}"));
                lines
            })
        });
        let mut out = std::io::stdout().lock();
        for t in futures::future::join_all(tasks).await {
            for line in t.expect("worker panicked") {
                writeln!(out, "{line}").unwrap();
            }
        }
    });
}

fn parent() {
    let seed: u64 = std::env::var("DEDUPGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("many_processes: seed {seed} (replay with DEDUPGATE_TEST_SEED={seed})");
    let url = common::url();
    let schema = common::fresh_schema("procs");
    let ns = format!("procs.{seed:x}");
    let rt = runtime();
    // Migrate once up front so the children start on a ready schema.
    drop(rt.block_on(common::open(&url, &schema, 1)));
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|p| {
            Command::new(&exe)
                .env("DEDUPGATE_PG_CHILD", p.to_string())
                .env("DEDUPGATE_PG_URL", &url)
                .env("DEDUPGATE_PG_SCHEMA", &schema)
                .env("DEDUPGATE_PG_NS", &ns)
                .env("DEDUPGATE_PG_SEED", seed.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start a gate process")
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for a gate process"))
        .collect();
    rt.block_on(common::drop_schema(&url, &schema));

    let mut news: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut fences: HashMap<String, u64> = HashMap::new();
    let (mut answers, mut sent, mut errors) = (0usize, 0usize, Vec::new());
    for (p, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "gate process {p} failed: {:?}",
            out.status
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["ANSWER", key, kind, fence] => {
                    answers += 1;
                    let fence: u64 = fence.parse().unwrap();
                    if *kind == "new" {
                        news.entry(key.to_string()).or_default().push(fence);
                    }
                    // No takeover can happen (long lease): every answer names the one fence.
                    if let Some(f) = fences.insert(key.to_string(), fence) {
                        assert_eq!(f, fence, "{key}: two fences seen ({line})");
                    }
                }
                ["SENT", n] => sent += n.parse::<usize>().unwrap(),
                _ if line.starts_with("ERROR") => errors.push(line.to_owned()),
                _ => {}
            }
        }
    }
    println!(
        "many_processes: {answers} answers from {PROCESSES} processes, {} keys",
        fences.len()
    );
    assert!(errors.is_empty(), "errors: {errors:#?}");
    assert_eq!(answers, sent, "every claim sent was answered");
    assert!(
        fences.len() > KEYS / 2,
        "too few keys were claimed to test anything"
    );
    for (key, f) in &fences {
        let n = news.get(key).map_or(0, Vec::len);
        assert_eq!(n, 1, "{key} (fence {f}) got {n} \"new\" answers");
    }
    println!("many_processes: ok, exactly one new per key");
}
