//! Start-up time and batch throughput of the embedded store.
//!
//! For each record count in `DG_OPEN_RECORDS` (default `100000,1000000`): fills a new store with
//! that many unique claims through `apply_batch` (batches of `DG_OPEN_BATCH`, default 1,000; the
//! fill rate is the store's batch-claim throughput), closes it cleanly (timed: the close flushes
//! every memtable, waiting at most 5 s), and times `EmbeddedStore::open` three times (each
//! followed by a clean close). Then the same after a crash: a child process (this binary again)
//! fills a new store and exits without closing it, so the next open must replay the journal.
//! Prints a markdown table. Files go under `DG_BENCH_DIR` (default the system temp dir) and are
//! removed afterwards.

use dedupgate_core::testkit::ApplyOp;
use std::time::Instant;

use dedupgate_core::{Op, RecordId, Store};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: 86_400_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

/// Fills a new store at `dir` with `n` unique claims in batches of `batch`; returns claims/s.
fn fill(rt: &tokio::runtime::Runtime, store: &EmbeddedStore, n: usize, batch: usize) -> f64 {
    let started = Instant::now();
    rt.block_on(async {
        let mut i = 0usize;
        while i < n {
            let m = batch.min(n - i);
            let ops: Vec<(RecordId, Op)> = (i..i + m)
                .map(|k| {
                    (
                        RecordId::new("bench", format!("key-{k:09}")).unwrap(),
                        claim_op(),
                    )
                })
                .collect();
            for r in store.apply_ops(ops).await {
                r.unwrap();
            }
            i += m;
        }
    });
    n as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    if let Ok(spec) = std::env::var("DG_OPEN_CHILD_FILL") {
        // The child: fill, then exit without closing the store (no destructor runs), as a crash
        // would leave it. Every batch was acknowledged, so it is in the fdatasync'd journal.
        let (n, dir) = spec.split_once(':').expect("N:DIR");
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = EmbeddedStore::open(dir, EmbeddedOptions::default()).unwrap();
        fill(&rt, &store, n.parse().unwrap(), 1_000);
        std::process::exit(0);
    }
    let counts: Vec<usize> = std::env::var("DG_OPEN_RECORDS")
        .unwrap_or_else(|_| "100000,1000000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("DG_OPEN_RECORDS: comma-separated counts")
        })
        .collect();
    let batch: usize = std::env::var("DG_OPEN_BATCH")
        .ok()
        .map(|s| s.parse().expect("DG_OPEN_BATCH: a number"))
        .unwrap_or(1_000);
    let base = std::env::var_os("DG_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!("| records | fill (batch claims/s, batches of {batch}) | close after the fill, ms | open after clean close, ms (3 runs) | open after a crash, ms | disk MiB |");
    println!("|---:|---:|---:|---|---:|---:|");
    for n in counts {
        let dir = base.join(format!("dg-open-bench-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = EmbeddedStore::open(&dir, EmbeddedOptions::default()).unwrap();
        let fill_rate = fill(&rt, &store, n, batch);
        let closing = Instant::now();
        drop(store);
        let close_ms = closing.elapsed().as_secs_f64() * 1e3;
        let mut opens = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let store = EmbeddedStore::open(&dir, EmbeddedOptions::default()).unwrap();
            opens.push(started.elapsed().as_secs_f64() * 1e3);
            let held = rt.block_on(store.stats()).unwrap().records_held;
            assert_eq!(held, Some(n as u64));
            drop(store);
        }
        let bytes: u64 = walk_size(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .env("DG_OPEN_CHILD_FILL", format!("{n}:{}", dir.display()))
            .status()
            .unwrap();
        assert!(status.success(), "the filling child failed: {status}");
        let started = Instant::now();
        let store = EmbeddedStore::open(&dir, EmbeddedOptions::default()).unwrap();
        let crash_open_ms = started.elapsed().as_secs_f64() * 1e3;
        let held = rt.block_on(store.stats()).unwrap().records_held;
        assert_eq!(held, Some(n as u64));
        drop(store);
        println!(
            "| {n} | {fill_rate:.0} | {close_ms:.0} | {} | {crash_open_ms:.0} | {:.1} |",
            opens
                .iter()
                .map(|ms| format!("{ms:.0}"))
                .collect::<Vec<_>>()
                .join(" / "),
            bytes as f64 / (1 << 20) as f64
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn walk_size(p: &std::path::Path) -> u64 {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => std::fs::read_dir(p)
            .map(|rd| rd.flatten().map(|e| walk_size(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}
