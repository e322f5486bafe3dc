//! The two-tier store: the conformance suite over memory+memory (one manual clock), Redis+Redis
//! and Redis+PostgreSQL, and a load during which the fast store is flushed and then killed.

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dedupgate_core::testkit::{run_all, ClockedHarness, RealTimeHarness};
use dedupgate_core::{Claim, Clock, ManualClock, MemoryStore, Op, Outcome, RecordId};
use dedupgate_postgres::{tokio_postgres, PgStore};
use dedupgate_redis::testkit::{shared_redis_url, RedisServer};
use dedupgate_redis::RedisStore;
use dedupgate_tiered::TieredStore;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_memory_over_memory() {
    let clock = ManualClock::new(1_764_000_000_000);
    let shared: Arc<dyn Clock> = Arc::new(clock.clone());
    let tier = Arc::new(TieredStore::with_clock(
        Arc::new(MemoryStore::with_clock(shared.clone())),
        Arc::new(MemoryStore::with_clock(shared.clone())),
        shared,
    ));
    run_all(&ClockedHarness {
        store: tier.clone(),
        clock,
    })
    .await;
    let c = tier.counters();
    assert!(
        c.hits.load(Ordering::Relaxed) > 0,
        "the fast tier answered nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_redis_over_redis() {
    let url = shared_redis_url();
    let fast = RedisStore::open(&format!("{url}?key_prefix=dgtier-fast"))
        .await
        .unwrap();
    let durable = RedisStore::open(&format!("{url}?key_prefix=dgtier-durable"))
        .await
        .unwrap();
    // A generous fast-store timeout: on a loaded machine the default 100 ms could turn every
    // lookup into a miss, and this test wants to see hits.
    let tier =
        Arc::new(TieredStore::new(Arc::new(fast), Arc::new(durable)).with_fast_timeout_ms(2_000));
    run_all(&RealTimeHarness(tier.clone())).await;
    assert!(tier.counters().hits.load(Ordering::Relaxed) > 0);
}

/// The tier `serve --store tiered:redis://…,postgres://…` opens: Redis in front of PostgreSQL
/// (a schema of its own, dropped after), held to the whole suite, its concurrent batches over
/// overlapping keys included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_redis_over_postgres() {
    let pg_url = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("dgtest_tiered_{:016x}", rand::thread_rng().gen::<u64>());
    let fast = RedisStore::open(&format!("{}?key_prefix=dgtier-pg", shared_redis_url()))
        .await
        .unwrap();
    let durable = PgStore::open(&format!("{pg_url}?dedupgate_schema={schema}"))
        .await
        .unwrap();
    // A generous fast-store timeout, as above: this test wants to see hits on a loaded machine.
    let tier =
        Arc::new(TieredStore::new(Arc::new(fast), Arc::new(durable)).with_fast_timeout_ms(2_000));
    let outcome = tokio::spawn({
        let tier = tier.clone();
        async move { run_all(&RealTimeHarness(tier)).await }
    })
    .await;
    let (client, conn) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
    assert!(tier.counters().hits.load(Ordering::Relaxed) > 0);
}

/// Workers claim overlapping keys (completing what they win) over a fast Redis this test owns
/// and a durable Redis; midway the fast store is flushed, later killed. Every key must still get
/// exactly one "new", and every answer must be a claim answer (a fast failure is never an error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushing_or_losing_the_fast_store_lets_no_duplicate_through() {
    let seed: u64 = std::env::var("DG_TIER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    eprintln!("tiered flush test: seed {seed} (replay with DG_TIER_SEED={seed})");
    let mut fast_server = tokio::task::spawn_blocking(|| RedisServer::start(&[]))
        .await
        .unwrap()
        .expect("start the fast redis-server");
    let fast = RedisStore::open(&fast_server.url()).await.unwrap();
    let durable = RedisStore::open(&format!("{}?key_prefix=dgtier-flush", shared_redis_url()))
        .await
        .unwrap();
    let tier =
        Arc::new(TieredStore::new(Arc::new(fast), Arc::new(durable)).with_fast_timeout_ms(2_000));
    let ns = format!("tierflush.{seed:x}");
    let keys = 150usize;
    let passes = 6usize;

    let (tx, mut rx) = tokio::sync::mpsc::channel::<usize>(64);
    let workers: Vec<_> = (0..12)
        .map(|w| {
            let (tier, ns, tx) = (tier.clone(), ns.clone(), tx.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ w);
                let mut log = Vec::new();
                for pass in 0..passes {
                    let mut order: Vec<usize> = (0..keys).collect();
                    order.shuffle(&mut rng);
                    for k in order {
                        let id = RecordId::new(ns.clone(), format!("k{k}")).unwrap();
                        let claim = Op::Claim {
                            ttl_ms: 600_000,
                            lease_ms: 600_000,
                            fingerprint: None,
                            owner: None,
                        };
                        match tier.apply_op(id.clone(), claim).await {
                            Ok(Outcome::Claimed(Claim::New(lease))) => {
                                let done = Op::Complete {
                                    token: lease.token,
                                    result: Some(serde_json::json!({"by": w})),
                                    ttl_ms: None,
                                };
                                tier.apply_op(id, done).await.expect("complete own claim");
                                log.push((k, true));
                            }
                            Ok(Outcome::Claimed(Claim::Duplicate { .. })) => log.push((k, false)),
                            other => panic!("worker {w} key {k}: {other:?}"),
                        }
                    }
                    let _ = tx.send(pass).await;
                }
                log
            })
        })
        .collect();
    drop(tx);
    let mut finished_passes = 0;
    let mut flushed = false;
    let mut killed = false;
    let mut hits_before_flush = 0;
    while rx.recv().await.is_some() {
        finished_passes += 1;
        if !flushed && finished_passes >= 12 * 2 {
            hits_before_flush = tier.counters().hits.load(Ordering::Relaxed);
            fast_server.cli(&["FLUSHDB"]).expect("flush the fast store");
            flushed = true;
        }
        if !killed && finished_passes >= 12 * 4 {
            fast_server.kill();
            killed = true;
        }
    }
    assert!(flushed && killed);
    let mut news: HashMap<usize, usize> = HashMap::new();
    let mut answers = 0;
    for w in workers {
        for (k, new) in w.await.expect("worker") {
            answers += 1;
            if new {
                *news.entry(k).or_default() += 1;
            }
        }
    }
    let c = tier.counters();
    eprintln!(
        "{answers} answers; hits {} (before flush {hits_before_flush}), misses {}, fast errors {}",
        c.hits.load(Ordering::Relaxed),
        c.misses.load(Ordering::Relaxed),
        c.fast_errors.load(Ordering::Relaxed)
    );
    assert_eq!(answers, 12 * keys * passes);
    assert_eq!(news.len(), keys, "every key got a new");
    let doubled: Vec<_> = news.iter().filter(|(_, n)| **n != 1).collect();
    assert!(doubled.is_empty(), "duplicates let through: {doubled:?}");
    assert!(
        hits_before_flush > 0,
        "the fast store answered nothing before the flush"
    );
    assert!(
        c.fast_errors.load(Ordering::Relaxed) > 0,
        "the kill was never seen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_answer_equals_the_durable_answer() {
    let clock = ManualClock::new(1_764_000_000_000);
    let shared: Arc<dyn Clock> = Arc::new(clock.clone());
    let fast = Arc::new(MemoryStore::with_clock(shared.clone()));
    let durable = Arc::new(MemoryStore::with_clock(shared.clone()));
    let tier = TieredStore::with_clock(fast.clone(), durable.clone(), shared);
    let id = RecordId::new("ns", "evt").unwrap();
    let mark = Op::Mark {
        ttl_ms: 60_000,
        fingerprint: Some("fp".into()),
        result: Some(serde_json::json!({"n": 1.5})),
    };
    tier.apply_op(id.clone(), mark.clone()).await.unwrap();
    let from_durable = durable.apply_op(id.clone(), mark.clone()).await.unwrap();
    let before = tier.counters().hits.load(Ordering::Relaxed);
    let from_tier = tier.apply_op(id.clone(), mark.clone()).await.unwrap();
    assert_eq!(tier.counters().hits.load(Ordering::Relaxed), before + 1);
    assert_eq!(from_tier, from_durable);
    // A different fingerprint is never answered from the cache.
    let other = Op::Mark {
        ttl_ms: 60_000,
        fingerprint: Some("other".into()),
        result: None,
    };
    assert!(matches!(
        tier.apply_op(id.clone(), other).await,
        Err(dedupgate_core::GateError::FingerprintMismatch)
    ));
    // Forget clears the cache too; then the key is new again.
    assert!(matches!(
        tier.apply_op(id.clone(), Op::Forget).await,
        Ok(Outcome::Forgotten(true))
    ));
    assert!(matches!(
        tier.apply_op(id.clone(), Op::Get).await,
        Ok(Outcome::Found(None))
    ));
    assert!(matches!(
        tier.apply_op(id, mark).await,
        Ok(Outcome::Marked(dedupgate_core::Mark::New { .. }))
    ));
}

/// A fast store that stops answering (SIGSTOP) is skipped: every answer still comes, from the
/// durable store, and is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_fast_store_is_skipped() {
    let fast_server = tokio::task::spawn_blocking(|| RedisServer::start(&[]))
        .await
        .unwrap()
        .expect("start the fast redis-server");
    let fast = RedisStore::open(&fast_server.url()).await.unwrap();
    let durable = Arc::new(MemoryStore::new());
    let tier = TieredStore::new(Arc::new(fast), durable).with_fast_timeout_ms(50);
    let id = |k: &str| RecordId::new("stall", k).unwrap();
    let mark = Op::Mark {
        ttl_ms: 600_000,
        fingerprint: None,
        result: Some(serde_json::json!("done")),
    };
    tier.apply_op(id("a"), mark.clone()).await.unwrap();
    let pid = fast_server.pid().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(status.success());
    let dup = tier.apply_op(id("a"), mark.clone()).await;
    let fresh = tier.apply_op(id("b"), mark.clone()).await;
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    assert!(
        matches!(&dup, Ok(Outcome::Marked(dedupgate_core::Mark::Duplicate { record })) if record.result == Some(serde_json::json!("done"))),
        "{dup:?}"
    );
    assert!(
        matches!(fresh, Ok(Outcome::Marked(dedupgate_core::Mark::New { .. }))),
        "{fresh:?}"
    );
    assert!(tier.counters().fast_errors.load(Ordering::Relaxed) > 0);
}
