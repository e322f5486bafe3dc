//! Failure behaviour with a PostgreSQL the test owns: kill -9 the postmaster during a load of
//! claims; while it is down every answer is `unavailable` (never a wrong new or duplicate); after
//! a restart the same store recovers by itself and every acknowledged claim is decided the same way.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, GateError, Op, Outcome, RecordId, Store, StoreError};
use dedupgate_postgres::testkit::OwnedPg;
use dedupgate_postgres::{PgOptions, PgStore};

const UP: u8 = 0;
/// The kill was sent; backends may still finish in-flight work.
const DYING: u8 = 1;
/// Nothing accepts connections: every answer must be unavailable.
const DOWN: u8 = 2;
const RESTARTED: u8 = 3;

fn claim(owner: &str) -> Op {
    Op::Claim {
        ttl_ms: 600_000,
        lease_ms: 300_000,
        fingerprint: None,
        owner: Some(owner.to_owned()),
    }
}

#[derive(Default)]
struct Log {
    /// key -> fence of its acknowledged claim.
    acked: HashMap<String, u64>,
    /// Answers given while DOWN, by label.
    down_answers: HashMap<&'static str, usize>,
    wrong: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_minus_nine_during_load_then_recover() {
    let seed: u64 = rand::random();
    eprintln!("failure test seed {seed} (keys are unique per worker; the seed names the run)");
    let pg = Arc::new(
        tokio::task::spawn_blocking(OwnedPg::start)
            .await
            .unwrap()
            .expect("start an owned postgres"),
    );
    eprintln!("owned postgres in {}", pg.dir().display());
    let (config, _) = dedupgate_postgres::parse_url(&pg.url()).unwrap();
    let options = PgOptions {
        pool_size: 8,
        op_timeout_ms: 2_000,
        connect_timeout_ms: 1_000,
        ..PgOptions::default()
    };
    let store = Arc::new(PgStore::connect(config, options).await.expect("open"));
    let phase = Arc::new(AtomicU8::new(UP));
    let log = Arc::new(Mutex::new(Log::default()));

    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (store, phase, log) = (store.clone(), phase.clone(), log.clone());
            tokio::spawn(async move {
                let owner = format!("worker-{w}");
                let mut i = 0u64;
                while phase.load(Ordering::SeqCst) != RESTARTED {
                    let key = format!("w{w}-{seed:x}-{i}");
                    i += 1;
                    let id = RecordId::new("failure", key.clone()).unwrap();
                    // Retry the same key with the same owner until it is decided: an unknown
                    // outcome followed by a re-claim must still answer new (same owner).
                    loop {
                        let seen = phase.load(Ordering::SeqCst);
                        let answer = store.apply_op(id.clone(), claim(&owner)).await;
                        let after = phase.load(Ordering::SeqCst);
                        let down = seen == DOWN && after == DOWN;
                        let retry = {
                            let mut log = log.lock().unwrap();
                            match answer {
                                Ok(Outcome::Claimed(Claim::New(lease))) => {
                                    if down {
                                        log.wrong.push(format!("{key}: new while down"));
                                    }
                                    if let Some(f) = log.acked.insert(key.clone(), lease.fence) {
                                        if f != lease.fence {
                                            log.wrong.push(format!(
                                                "{key}: fence {f} then {}",
                                                lease.fence
                                            ));
                                        }
                                    }
                                    false
                                }
                                Err(GateError::Store(StoreError::Unavailable(_))) => {
                                    if down {
                                        *log.down_answers.entry("unavailable").or_default() += 1;
                                    }
                                    after != RESTARTED
                                }
                                other => {
                                    log.wrong
                                        .push(format!("{key}: {other:?} (phase {seen}->{after})"));
                                    false
                                }
                            }
                        };
                        if !retry {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    // Now and then, check an acknowledged key from another owner: a duplicate.
                    if i % 5 == 0 {
                        let check = log
                            .lock()
                            .unwrap()
                            .acked
                            .iter()
                            .next()
                            .map(|(k, f)| (k.clone(), *f));
                        if let Some((k, fence)) = check {
                            let id = RecordId::new("failure", k.clone()).unwrap();
                            let seen = phase.load(Ordering::SeqCst);
                            let answer = store.apply_op(id, claim("checker")).await;
                            let down = seen == DOWN && phase.load(Ordering::SeqCst) == DOWN;
                            let mut log = log.lock().unwrap();
                            match answer {
                                Ok(Outcome::Claimed(Claim::Duplicate { record }))
                                    if record.fence == fence =>
                                {
                                    if down {
                                        log.wrong.push(format!("{k}: duplicate while down"));
                                    }
                                }
                                Err(GateError::Store(StoreError::Unavailable(_))) => {}
                                other => log.wrong.push(format!("check {k}: {other:?}")),
                            }
                        }
                    }
                }
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before_kill = log.lock().unwrap().acked.len();
    assert!(
        before_kill > 0,
        "no claim was acknowledged before the fault"
    );
    phase.store(DYING, Ordering::SeqCst);
    pg.kill9().expect("kill -9 the postmaster");
    // Down once nothing accepts connections and the backends the dead postmaster left behind
    // (which may still finish and commit a statement in flight) have exited on their own.
    let deadline = Instant::now() + Duration::from_secs(30);
    while pg.accepting() || pg.any_process_alive() {
        assert!(
            Instant::now() < deadline,
            "postgres still alive after kill -9"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    phase.store(DOWN, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert!(
        store.health().await.is_err(),
        "health must fail while postgres is down"
    );
    phase.store(DYING, Ordering::SeqCst); // leaving DOWN: answers may succeed again
    {
        let pg = pg.clone();
        tokio::task::spawn_blocking(move || pg.restart())
            .await
            .unwrap()
            .expect("restart the owned postgres");
    }
    // The same store, not a new one: its pool must reconnect by itself.
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.health().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "store did not recover after restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await; // load runs on the recovered server
    phase.store(RESTARTED, Ordering::SeqCst);
    for w in workers {
        w.await.expect("worker panicked");
    }

    let log = Arc::try_unwrap(log).ok().unwrap().into_inner().unwrap();
    assert!(log.wrong.is_empty(), "wrong answers: {:#?}", log.wrong);
    assert!(
        log.down_answers.get("unavailable").copied().unwrap_or(0) > 0,
        "no request was made while postgres was down"
    );
    eprintln!(
        "acknowledged {} claims ({before_kill} before the kill), {} unavailable answers while down",
        log.acked.len(),
        log.down_answers["unavailable"]
    );
    // Every acknowledged claim is decided the same way after the restart.
    for (key, fence) in &log.acked {
        let id = RecordId::new("failure", key.clone()).unwrap();
        match store.apply_op(id, claim("after-restart")).await {
            Ok(Outcome::Claimed(Claim::Duplicate { record })) => {
                assert_eq!(
                    record.fence, *fence,
                    "{key}: fence changed across the crash"
                )
            }
            other => panic!("{key}: acknowledged before the fault, now {other:?}"),
        }
    }
}
