//! `cargo bench -p dedupgate-postgres`: the gate's claims on PostgreSQL beside pgbench running
//! the same `INSERT … ON CONFLICT DO NOTHING` with the same number of clients, in one run, printed
//! as a markdown table (copied into docs/benchmarks-postgres.md).
//!
//! Environment: DEDUPGATE_BENCH_POSTGRES_URL (else DEDUPGATE_TEST_POSTGRES_URL, else
//! postgres://postgres@127.0.0.1:5432/test), DEDUPGATE_BENCH_SECS (default 4),
//! DEDUPGATE_BENCH_CLIENTS (default "16,50"), PGBENCH (default `pgbench`).

use dedupgate_core::testkit::ApplyOp;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Op, Outcome, RecordId};
use dedupgate_postgres::{PgOptions, PgStore};
use tokio_postgres::config::Host;

const BATCH_OPS: usize = 1_000;
/// Rounds per figure; the table shows the median round.
const ROUNDS: usize = 3;

fn claim() -> Op {
    Op::Claim {
        ttl_ms: 3_600_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

fn key(rng: &mut u64) -> RecordId {
    // xorshift: cheap, and random enough that keys rarely collide.
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    RecordId::new("bench", format!("key-{}", *rng % 2_000_000_000)).unwrap()
}

struct Figure {
    ops_per_s: f64,
    mean_ms: f64,
}

fn median(mut figures: Vec<Figure>) -> Figure {
    figures.sort_by(|a, b| a.ops_per_s.total_cmp(&b.ops_per_s));
    figures.swap_remove(figures.len() / 2)
}

/// `clients` tasks each send one claim at a time (or one batch) until `secs` pass.
async fn run_gate(store: Arc<PgStore>, clients: usize, batch: usize, secs: u64) -> Figure {
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let busy_ns = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, stop, ops, calls, busy_ns) = (
                store.clone(),
                stop.clone(),
                ops.clone(),
                calls.clone(),
                busy_ns.clone(),
            );
            tokio::spawn(async move {
                let mut rng =
                    0x9E37_79B9_7F4A_7C15u64 ^ ((c as u64 + 1) << 20) ^ rand::random::<u64>();
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    if batch == 1 {
                        match store.apply_op(key(&mut rng), claim()).await {
                            Ok(Outcome::Claimed(Claim::New(_) | Claim::Duplicate { .. })) => {}
                            other => panic!("claim: {other:?}"),
                        }
                    } else {
                        let batch_ops = (0..batch).map(|_| (key(&mut rng), claim())).collect();
                        for a in store.apply_ops(batch_ops).await {
                            assert!(a.is_ok(), "batch item: {a:?}");
                        }
                    }
                    busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    calls.fetch_add(1, Ordering::Relaxed);
                    ops.fetch_add(batch as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("bench task");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let calls = calls.load(Ordering::Relaxed).max(1) as f64;
    Figure {
        ops_per_s: ops.load(Ordering::Relaxed) as f64 / elapsed,
        mean_ms: busy_ns.load(Ordering::Relaxed) as f64 / calls / 1e6,
    }
}

/// pgbench with `clients` clients running the one-statement-per-key insert for `secs`.
fn run_pgbench(
    config: &tokio_postgres::Config,
    script: &std::path::Path,
    clients: usize,
    secs: u64,
) -> Figure {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let pgbench = std::env::var("PGBENCH").unwrap_or_else(|_| "pgbench".to_owned());
    let out = Command::new(pgbench)
        .args([
            "-n",
            "-M",
            "prepared",
            "-c",
            &clients.to_string(),
            "-j",
            "2",
            "-T",
            &secs.to_string(),
            "-f",
            script.to_str().unwrap(),
            "-h",
            &host,
            "-p",
            &port.to_string(),
            "-U",
            config.get_user().unwrap_or("postgres"),
            config.get_dbname().unwrap_or("postgres"),
        ])
        .output()
        .expect("run pgbench (install postgresql-client or set PGBENCH)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "pgbench failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |prefix: &str| -> f64 {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("pgbench output lacks {prefix:?}: {text}"))
    };
    Figure {
        ops_per_s: field("tps = "),
        mean_ms: field("latency average = "),
    }
}

fn main() {
    let url = std::env::var("DEDUPGATE_BENCH_POSTGRES_URL")
        .or_else(|_| std::env::var("DEDUPGATE_TEST_POSTGRES_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let secs: u64 = std::env::var("DEDUPGATE_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let client_counts: Vec<usize> = std::env::var("DEDUPGATE_BENCH_CLIENTS")
        .unwrap_or_else(|_| "16,50".to_owned())
        .split(',')
        .map(|s| s.trim().parse().expect("DEDUPGATE_BENCH_CLIENTS: counts"))
        .collect();
    let schema = format!("dgbench_{:08x}", rand::random::<u32>());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (config, _) = dedupgate_postgres::parse_url(&url).expect("bench URL");

    let rows = rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        let server: String = client
            .query_one("SELECT current_setting('server_version') || ', synchronous_commit=' || current_setting('synchronous_commit')", &[])
            .await
            .unwrap()
            .get(0);
        eprintln!("postgres {server}; schema {schema}; {secs}s per figure");
        // The raw table has the same shape as the gate's, so both write the same row size.
        let store_for_schema = PgStore::connect(
            config.clone(),
            PgOptions {
                schema: schema.clone(),
                pool_size: 1,
                ..PgOptions::default()
            },
        )
        .await
        .expect("open store");
        drop(store_for_schema);
        client
            .batch_execute(&format!(
                "CREATE TABLE \"{schema}\".raw_claims (LIKE \"{schema}\".dedupgate_records INCLUDING ALL)"
            ))
            .await
            .unwrap();
        let script = std::env::temp_dir().join(format!("{schema}.pgbench.sql"));
        std::fs::write(
            &script,
            format!(
                "\\set k random(1, 2000000000)\n\
                 INSERT INTO \"{schema}\".raw_claims (namespace, key, state, fence, token, created_at_ms, expires_at_ms, lease_expires_at_ms) \
                 VALUES ('\\x62656e6368'::bytea, convert_to('key-' || :k, 'UTF8'), 0, :k, '\\x00'::bytea, 0, 3600000, 30000) \
                 ON CONFLICT DO NOTHING;\n"
            ),
        )
        .unwrap();

        let mut rows = Vec::new();
        for &clients in &client_counts {
            // Interleaved rounds, medians reported: the machine is shared, and load that drifts
            // during a run then falls on both sides instead of one. The gate's pool is closed
            // while pgbench runs, so both never hold connections at once.
            let (mut raw, mut single, mut batch) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..ROUNDS {
                raw.push(tokio::task::block_in_place(|| {
                    run_pgbench(&config, &script, clients, secs)
                }));
                let store = Arc::new(
                    PgStore::connect(
                        config.clone(),
                        PgOptions {
                            schema: schema.clone(),
                            pool_size: clients,
                            ..PgOptions::default()
                        },
                    )
                    .await
                    .expect("open store"),
                );
                single.push(run_gate(store.clone(), clients, 1, secs).await);
                batch.push(run_gate(store.clone(), clients.min(16), BATCH_OPS, secs).await);
                store.close();
                drop(store);
                tokio::time::sleep(Duration::from_millis(500)).await;
                eprintln!(
                    "clients {clients} round {round}: raw {:.0}/s, gate {:.0}/s, batch {:.0}/s",
                    raw[round].ops_per_s, single[round].ops_per_s, batch[round].ops_per_s
                );
            }
            rows.push((clients, median(raw), median(single), median(batch)));
        }
        let _ = std::fs::remove_file(&script);
        client
            .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await
            .unwrap();
        rows
    });

    println!("Median of {ROUNDS} interleaved rounds of {secs} s each.\n");
    println!("| clients | pgbench `INSERT … ON CONFLICT DO NOTHING` (ops/s, mean ms) | gate claim, one per call (ops/s, mean ms) | overhead raw/gate (target ≤ 1.5) | gate batch of {BATCH_OPS} (ops/s, mean ms per batch, clients) | batch/raw (target ≥ 5) |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (clients, raw, single, batch) in rows {
        println!(
            "| {clients} | {:.0} ({:.2} ms) | {:.0} ({:.2} ms) | {:.2}x | {:.0} ({:.1} ms, {}) | {:.1}x |",
            raw.ops_per_s,
            raw.mean_ms,
            single.ops_per_s,
            single.mean_ms,
            raw.ops_per_s / single.ops_per_s,
            batch.ops_per_s,
            batch.mean_ms,
            clients.min(16),
            batch.ops_per_s / raw.ops_per_s,
        );
    }
}
