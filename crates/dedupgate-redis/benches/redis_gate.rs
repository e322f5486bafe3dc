//! The gate's claims on Redis beside raw `SET NX EX` from `redis-benchmark`, in one run, on a
//! `redis-server` of the benchmark's own (no persistence, so both sides pay the same).
//!
//! `cargo bench -p dedupgate-redis` prints a markdown table. Figures, not assertions: the
//! targets (per-op time at most 1.5x raw, batch rate at least 5x raw) are reported as ratios
//! against the mean of two raw `-P 1` runs at the same concurrency (one first, one last).
//! `DG_BENCH_OPS` sets the keys every row claims or sets (default 600000). Batch rows of fresh
//! keys take the store's native fast path (`SET … NX GET` per key, no script); the single-op row
//! takes the script. Every row starts from an empty keyspace (`FLUSHALL`), after one run of the
//! gate has grown the server's memory, and inserts as many fresh keys: the same work for Redis
//! in every row.

use dedupgate_core::testkit::ApplyOp;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Op, Outcome, RecordId, Store};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::RedisStore;

const CONCURRENCY: usize = 50;
/// Batch rows: ops per `apply_batch` call.
const BATCHES: [usize; 2] = [100, 1000];
/// Pipeline depth of the raw "no round trips" row, shown for scale only.
const RAW_PIPELINE: usize = 100;

struct Row {
    path: String,
    keys: usize,
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

fn raw_set_nx(port: u16, requests: usize, pipeline: usize) -> Row {
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-c", &CONCURRENCY.to_string()])
        .args(["-P", &pipeline.to_string()])
        .args(["-n", &requests.to_string(), "-r", "100000000", "--csv"])
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
        path: format!(
            "raw `SET key 1 NX EX 86400` (redis-benchmark -c {CONCURRENCY} -P {pipeline})"
        ),
        keys: requests,
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
                        vec![store.apply_op(id, op).await]
                    } else {
                        store.apply_ops(items).await
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
        keys: ops,
        ops_per_s: ops as f64 / secs,
        p50_ms: Some(percentile(&lat, 0.5)),
        p99_ms: Some(percentile(&lat, 0.99)),
    }
}

/// CPU seconds this process (all its threads) used so far: utime + stime from /proc/self/stat,
/// in the kernel's USER_HZ ticks (100 per second on Linux).
fn own_cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of the stat line; `after_comm` starts at field 3.
    (ticks(11) + ticks(12)) / 100.0
}

/// A field of `INFO` (e.g. `used_cpu_user`), as a number.
fn info_field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn redis_cpu_s(server: &RedisServer) -> f64 {
    let info = server.cli(&["INFO", "cpu"]).unwrap_or_default();
    info_field(&info, "used_cpu_user") + info_field(&info, "used_cpu_sys")
}

/// Calls and microseconds of one command in `INFO commandstats`.
fn command_stats(server: &RedisServer, cmd: &str) -> (f64, f64) {
    let stats = server.cli(&["INFO", "commandstats"]).unwrap_or_default();
    let line = stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
        .unwrap_or("");
    let field = |name: &str| {
        line.split(&format!("{name}="))
            .nth(1)
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("calls"), field("usec"))
}

fn main() {
    let ops: usize = std::env::var("DG_BENCH_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600_000);
    let server = RedisServer::start(&["--appendonly", "no"]).expect("start redis-server");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // 50 tasks with batches of 1000 queue 50000 claims on one connection: a call may wait
    // longer than the default 2 s answer timeout on a loaded machine, and this measures rate.
    let store: Arc<dyn Store> = Arc::new(
        rt.block_on(RedisStore::open(&format!(
            "{}?response_timeout_ms=60000",
            server.url()
        )))
        .expect("open store"),
    );

    // Warm both paths (connections, script cache), then measure raw, gate, batches, raw again.
    raw_set_nx(server.port(), 10_000, 1);
    rt.block_on(gate(store.clone(), 10_000, 1, "warm-up"));
    let mut costs = Vec::new();
    // Every row starts from the same state (an empty keyspace, in a server whose allocator has
    // already grown to hold a row) and inserts as many keys. Otherwise each row inherits the
    // keys of the rows before it, and whichever row happens to grow Redis's hash tables through
    // a doubling pays for the rehashing and the fresh pages; the figures then depend on the
    // order of the rows. (The gate's records are the larger, so the gate grows it.)
    rt.block_on(gate(store.clone(), ops, 1000, "grow"));
    let mut phase = |run: &mut dyn FnMut() -> Row| {
        server.cli(&["FLUSHALL", "SYNC"]).expect("FLUSHALL");
        let _ = server.cli(&["CONFIG", "RESETSTAT"]);
        let (redis0, own0) = (redis_cpu_s(&server), own_cpu_s());
        let row = run();
        let (redis1, own1) = (redis_cpu_s(&server), own_cpu_s());
        // Commands a script runs are counted inside its EVALSHA time (and again under their
        // own names), so a gate phase that ran the script is its EVALSHA time; a gate phase
        // that never did (the batch fast path on fresh keys: native SETs and one TIME per
        // batch) is its SET and TIME time, and a raw phase its SET time.
        let raw = row.path.starts_with("raw");
        let (calls, usec) = if raw {
            command_stats(&server, "set")
        } else {
            match command_stats(&server, "evalsha") {
                (0.0, _) => {
                    let (sets, set_usec) = command_stats(&server, "set");
                    let (_, time_usec) = command_stats(&server, "time");
                    (sets, set_usec + time_usec)
                }
                script => script,
            }
        };
        let keys = row.keys as f64;
        let own = if raw {
            "–".to_owned() // redis-benchmark is another process
        } else {
            format!("{:.1}", (own1 - own0) * 1e6 / keys)
        };
        costs.push(format!(
            "| {} | {:.1} | {:.1} | {:.1} | {own} |",
            row.path,
            (redis1 - redis0) * 1e6 / keys,
            usec / keys,
            keys / calls.max(1.0),
        ));
        row
    };
    let raw1 = phase(&mut || raw_set_nx(server.port(), ops, 1));
    let single = phase(&mut || {
        rt.block_on(gate(
            store.clone(),
            ops,
            1,
            &format!("gate claim, one op per call ({CONCURRENCY} tasks)"),
        ))
    });
    let batched: Vec<Row> = BATCHES
        .iter()
        .map(|&size| {
            phase(&mut || {
                rt.block_on(gate(
                    store.clone(),
                    ops,
                    size,
                    &format!("gate claim, batches of {size} ({CONCURRENCY} tasks)"),
                ))
            })
        })
        .collect();
    let pipelined = phase(&mut || raw_set_nx(server.port(), ops, RAW_PIPELINE));
    let raw2 = phase(&mut || raw_set_nx(server.port(), ops, 1));
    let raw_rate = (raw1.ops_per_s + raw2.ops_per_s) / 2.0;

    println!(
        "\nRedis {} on 127.0.0.1, {} fresh keys per row, each row from an empty keyspace, \
         concurrency {CONCURRENCY}\n",
        version(),
        ops,
    );
    println!("| path | keys/s | p50 ms (per call) | p99 ms (per call) | vs raw -P 1 |");
    println!("|---|---:|---:|---:|---:|");
    let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.3}"));
    let mut rows = vec![(&raw1, None), (&single, Some(single.ops_per_s / raw_rate))];
    rows.extend(batched.iter().map(|b| (b, Some(b.ops_per_s / raw_rate))));
    rows.push((&pipelined, Some(pipelined.ops_per_s / raw_rate)));
    rows.push((&raw2, None));
    for (row, ratio) in rows {
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
        "\nPer-op time, gate one op per call / raw -P 1: {:.2}x (target ≤ 1.5x).",
        raw_rate / single.ops_per_s
    );
    for b in &batched {
        println!(
            "Batch rate / raw -P 1 rate, {}: {:.2}x (target ≥ 5x).",
            b.path,
            b.ops_per_s / raw_rate
        );
    }
    println!("\nCost per key:\n");
    println!(
        "| path | Redis CPU µs (INFO cpu) | Redis command µs (commandstats) | keys per command | \
         bench process CPU µs |"
    );
    println!("|---|---:|---:|---:|---:|");
    for line in costs {
        println!("{line}");
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
