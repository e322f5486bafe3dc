//! CI tier of the gate's clock jumps (libfaketime, `src/clock_jumps.rs`): over Redis and
//! PostgreSQL the gate's clock jumps both ways and nothing may change; over the embedded store it
//! jumps only backward and the store's clock must never go back. Each run prints its seed;
//! replay one with `DEDUPGATE_TORTURE_SEED=…`.

mod common;

use common::{exe, pg_url, redis_url};
use dedupgate_torture::clock_jumps::{self, ClockJumpConfig, ClockJumpReport};

async fn jump(store: &str, dir: &std::path::Path) -> ClockJumpReport {
    let seed = dedupgate_torture::seed(&format!("clock jumps over {store}"));
    let cfg = ClockJumpConfig::ci(store, dir.join("run"), exe(), seed, 12);
    let r = clock_jumps::run(cfg)
        .await
        .expect("the run could be carried out");
    eprintln!("{}", r.summary());
    let seed = r.config.seed;
    assert!(
        r.ok(),
        "seed {seed}: {:#?} {:#?}",
        r.checked.violations(),
        r.regressions
    );
    assert!(
        r.faults.backward > 0,
        "seed {seed}: the clock never jumped back"
    );
    assert!(
        r.faults.faketime_loaded,
        "seed {seed}: libfaketime was not loaded in the gate"
    );
    assert!(r.checked.oracle.answers_read > 0);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_clock_jumps_change_nothing_over_redis() {
    let dir = tempfile::tempdir().unwrap();
    let r = jump(&redis_url(), dir.path()).await;
    assert!(r.faults.forward > 0, "seed {}", r.config.seed);
    assert!(
        r.faults.seen_in_gate > 0,
        "seed {}: the gate never showed a jumped clock",
        r.config.seed
    );
    assert!(r.checked.lin_ops > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_clock_jumps_change_nothing_over_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let r = jump(&pg_url(), dir.path()).await;
    assert!(r.faults.forward > 0, "seed {}", r.config.seed);
    assert!(
        r.faults.seen_in_gate > 0,
        "seed {}: the gate never showed a jumped clock",
        r.config.seed
    );
    assert!(r.checked.lin_ops > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backward_clock_jumps_never_take_the_embedded_store_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("data").display());
    let r = jump(&store, dir.path()).await;
    assert_eq!(r.faults.forward, 0);
    assert!(
        r.faults.held_decisions > 0,
        "seed {}: no decision was taken on the held clock: the jumps did not reach the store",
        r.config.seed
    );
}
