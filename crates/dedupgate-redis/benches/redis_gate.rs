//! The gate's claims on Redis beside raw `SET NX EX` from `redis-benchmark`, in one run, on a
//! `redis-server` of the benchmark's own (no persistence, so both sides pay the same).
//!
//! `cargo bench -p dedupgate-redis` prints a markdown table. Figures, not assertions: the
//! targets (per-op time at most 1.5x raw, batch rate at least 5x raw) are reported as ratios.
//! `DG_BENCH_OPS` sets the operations per row (default 200000).

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Op, Outcome, RecordId, Store};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::RedisStore;

const CONCURRENCY: usize = 50;
const BATCH_OPS: usize = 100;

struct Row {
    path: String,
    ops_per_s: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
}

fn claim() -> Op {
    Op::Claim {
        ttl_ms: 86_400_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn raw_set_nx(port: u16, requests: usize) -> Row {
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &port.to_string(),
            "-c",
            &CONCURRENCY.to_string(),
            "-P",
            "1",
        ])
        .args(["-n", &requests.to_string(), "-r", "1000000", "--csv"])
        .args(["SET", "key:__rand_int__", "1", "NX", "EX", "86400"])
        .output()
        .expect("run redis-benchmark");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("\"SET"))
        .unwrap_or_else(|| panic!("redis-benchmark printed no result: {text}"));
    let fields: Vec<f64> = line
        .split("\",\"")
        .skip(1)
        .map(|f| f.trim_matches('"').parse().unwrap_or(0.0))
        .collect();
    Row {
        path: "raw `SET key NX EX 86400` (redis-benchmark -c 50 -P 1)".into(),
        ops_per_s: fields[0],
        p50_ms: fields.get(3).copied(),
        p99_ms: fields.get(5).copied(),
    }
}

async fn gate(store: Arc<dyn Store>, ops: usize, batch: usize, label: &str) -> Row {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let ns = format!("bench.{}.{run}", std::process::id());
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (store, ns, next) = (store.clone(), ns.clone(), next.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let first = next.fetch_add(batch as u64, Ordering::Relaxed);
                    if first >= ops as u64 {
                        break lat;
                    }
                    let items: Vec<_> = (first..first + batch as u64)
                        .map(|i| (RecordId::new(ns.clone(), format!("k{i}")).unwrap(), claim()))
                        .collect();
                    let t = Instant::now();
                    let out = if batch == 1 {
                        let (id, op) = items.into_iter().next().expect("one op");
                        vec![store.apply(id, op).await]
                    } else {
                        store.apply_batch(items).await
                    };
                    lat.push(t.elapsed());
                    for r in out {
                        assert!(
                            matches!(r, Ok(Outcome::Claimed(Claim::New(_)))),
                            "fresh key not new: {r:?}"
                        );
                    }
                }
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("bench task"));
    }
    let secs = started.elapsed().as_secs_f64();
    lat.sort();
    Row {
        path: label.to_owned(),
        ops_per_s: ops as f64 / secs,
        p50_ms: Some(percentile(&lat, 0.5)),
        p99_ms: Some(percentile(&lat, 0.99)),
    }
}

fn main() {
    let ops: usize = std::env::var("DG_BENCH_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    let server = RedisServer::start(&["--appendonly", "no"]).expect("start redis-server");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(
        rt.block_on(RedisStore::open(&server.url()))
            .expect("open store"),
    );

    // Warm both paths (connections, script cache), then measure raw, gate, batch, raw again.
    raw_set_nx(server.port(), 10_000);
    rt.block_on(gate(store.clone(), 10_000, 1, "warm-up"));
    let mut server_us = Vec::new();
    let mut phase = |name: &str, run: &mut dyn FnMut() -> Row| {
        let _ = server.cli(&["CONFIG", "RESETSTAT"]);
        let row = run();
        let stats = server.cli(&["INFO", "commandstats"]).unwrap_or_default();
        let cost = |cmd: &str| {
            stats
                .lines()
                .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
                .and_then(|l| l.split(",usec=").nth(1))
                .and_then(|v| v.split(',').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // Commands a script runs are counted inside its EVALSHA time (and again under their
        // own names), so a gate phase is its EVALSHA time and a raw phase its SET time.
        let busy_us = if name.starts_with("raw") {
            cost("set")
        } else {
            cost("evalsha")
        };
        let calls = stats
            .lines()
            .find(|l| {
                l.starts_with(if name.starts_with("raw") {
                    "cmdstat_set:"
                } else {
                    "cmdstat_evalsha:"
                })
            })
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        server_us.push(format!(
            "{name}: {:.1} µs of Redis command time per key, {:.1} keys per call",
            busy_us / ops_of(&row, ops) as f64,
            ops_of(&row, ops) as f64 / calls.max(1.0)
        ));
        row
    };
    fn ops_of(row: &Row, ops: usize) -> usize {
        if row.path.contains("batches") {
            ops * 2
        } else {
            ops
        }
    }
    let raw1 = phase("raw SET NX EX", &mut || raw_set_nx(server.port(), ops));
    let single = phase("gate, one op per call", &mut || {
        rt.block_on(gate(
            store.clone(),
            ops,
            1,
            "gate claim, one op per call (50 tasks)",
        ))
    });
    let batched = phase("gate, batches of 100", &mut || {
        rt.block_on(gate(
            store.clone(),
            ops * 2,
            BATCH_OPS,
            "gate claim, batches of 100 (50 tasks)",
        ))
    });
    let raw2 = phase("raw SET NX EX (again)", &mut || {
        raw_set_nx(server.port(), ops)
    });
    let raw_rate = (raw1.ops_per_s + raw2.ops_per_s) / 2.0;

    println!(
        "\nRedis {} on 127.0.0.1, {} ops per row, concurrency {CONCURRENCY}\n",
        version(),
        ops
    );
    println!("| path | ops/s | p50 ms (per call) | p99 ms (per call) | vs raw |");
    println!("|---|---:|---:|---:|---:|");
    let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.3}"));
    for (row, ratio) in [
        (&raw1, None),
        (&single, Some(single.ops_per_s / raw_rate)),
        (&batched, Some(batched.ops_per_s / raw_rate)),
        (&raw2, None),
    ] {
        println!(
            "| {} | {:.0} | {} | {} | {} |",
            row.path,
            row.ops_per_s,
            fmt(row.p50_ms),
            fmt(row.p99_ms),
            ratio.map_or("1.00x (reference)".to_owned(), |r| format!("{r:.2}x")),
        );
    }
    println!(
        "\nPer-op time, gate / raw: {:.2}x (target ≤ 1.5x). Batch rate / raw rate: {:.2}x (target ≥ 5x).",
        raw_rate / single.ops_per_s,
        batched.ops_per_s / raw_rate
    );
    println!("\nServer-side cost (INFO commandstats, EVALSHA including the commands it runs):");
    for line in server_us {
        println!("    {line}");
    }
}

fn version() -> String {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find_map(|w| w.strip_prefix("v=").map(str::to_owned))
        })
        .unwrap_or_else(|| "?".into())
}
