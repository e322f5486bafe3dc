//! The CI tier of the torture harness: crash cycles with real processes (workers SIGKILLed at
//! random, lease holders SIGSTOPped past their lease, the embedded gate SIGKILLed and
//! restarted), then the effect oracle and the linearizability checker over everything logged.
//! Each run prints its seed; replay one with `DEDUPGATE_TORTURE_SEED=…`.
//!
//! A run proves its faults fired: the assertions below require kills, pauses, takeovers, late
//! writes refused by the sink and stale completions refused by the gate, not just zero
//! violations.

mod common;

use common::{assert_all_cycles_ran, assert_linearizable, assert_oracle_ok, pg_url, redis_url};
use dedupgate_torture::runner::{Face, RunConfig, RunReport};

/// Lease holders are paused on 8% of cycles unless a test's `tweak` says otherwise.
async fn torture(
    store: &str,
    face: Face,
    cycles: u64,
    tweak: impl FnOnce(&mut RunConfig),
) -> RunReport {
    common::torture("torture", store, face, cycles, |c| {
        c.pause_pct = 8;
        tweak(c);
    })
    .await
}

fn assert_clean(r: &RunReport) {
    let seed = r.config.seed;
    assert_oracle_ok(r);
    assert_linearizable(r);
    // The faults fired and were seen doing what they are for.
    assert_all_cycles_ran(r);
    assert!(
        r.faults.worker_sigkills > 0,
        "seed {seed}: no worker was killed"
    );
    assert!(
        r.faults.sigstops > 0,
        "seed {seed}: no lease holder was paused"
    );
    assert_eq!(
        r.faults.sigstops, r.faults.sigconts,
        "seed {seed}: a paused worker was not resumed"
    );
    assert!(
        r.faults.takeovers > 0,
        "seed {seed}: no paused holder's event was taken over"
    );
    assert!(
        r.oracle.late_writes_rejected > 0,
        "seed {seed}: the sink refused no late write"
    );
    assert!(
        r.oracle.stale_completions_refused > 0,
        "seed {seed}: the gate refused no stale completion"
    );
    assert!(r.lin_ops > 0 && r.lin_keys > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_face_over_memory_20_crash_cycles() {
    let r = torture("memory:", Face::Http, 20, |_| {}).await;
    assert_clean(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_face_over_embedded_with_gate_sigkills_20_crash_cycles() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("data").display());
    let r = torture(&store, Face::Http, 20, |c| c.kill_gate_pct = 30).await;
    assert_clean(&r);
    assert!(
        r.faults.gate_sigkills > 0,
        "seed {}: the gate was never killed",
        r.config.seed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_face_over_redis_10_crash_cycles() {
    let r = torture(&redis_url(), Face::Library, 10, |_| {}).await;
    assert_clean(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_face_over_postgres_10_crash_cycles() {
    let r = torture(&pg_url(), Face::Library, 10, |_| {}).await;
    assert_clean(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_face_over_an_owned_redis_that_is_sigkilled_10_crash_cycles() {
    // appendfsync always: whatever Redis acknowledged is in its AOF when SIGKILL lands.
    let r = torture("redis (owned)", Face::Library, 10, |c| {
        c.owned_redis = true;
        c.kill_store_pct = 40;
    })
    .await;
    assert_clean(&r);
    assert!(
        r.faults.store_sigkills > 0,
        "seed {}: Redis was never killed",
        r.config.seed
    );
}

/// The oracles have teeth: a gate over the memory store forgets every acknowledged answer when
/// it is killed, and the run must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oracles_see_what_a_forgetful_gate_loses() {
    let r = torture("memory:", Face::Http, 12, |c| {
        c.kill_gate_pct = 50;
        c.allow_volatile_gate_kills = true;
        c.pause_pct = 0;
    })
    .await;
    assert!(r.faults.gate_sigkills > 0, "seed {}", r.config.seed);
    let found = r.oracle.duplicates.len() + r.oracle.lost.len() + r.lin_violations.len();
    assert!(
        found > 0,
        "seed {}: a forgetful gate went unnoticed",
        r.config.seed
    );
}

/// With `wait_replicas=1` the gate answers only what the replica has: a promoted replica has
/// every acknowledged mark even when it was stalled before its primary was SIGKILLed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_failover_with_wait_replicas_loses_nothing_acknowledged() {
    let r = dedupgate_torture::failover::measure(1, 8, 1500, 700)
        .await
        .expect("the failover could be measured");
    eprintln!("{r:?}");
    assert!(r.acknowledged > 0, "{r:?}");
    assert_eq!(r.lost, 0, "{r:?}");
}
