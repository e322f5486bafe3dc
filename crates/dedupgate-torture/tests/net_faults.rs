//! CI tier of the network and restart faults (issue 7): torture runs whose store connections go
//! through a TCP fault proxy of the test's own (delayed, cut with RST, truncated, and all cut at
//! once on some cycles), and runs on Redis and PostgreSQL servers of the test's own that are
//! SIGKILLed and restarted several times a run. Worker SIGKILLs and lease-holder pauses go on
//! as in `ci_tier.rs`. Each run prints its seed; replay with `DEDUPGATE_TORTURE_SEED=…`.
//!
//! Every run must prove its faults fired (counts > 0) and that the gate answered them with
//! `unavailable` only: never a wrong error, never a wrong new or duplicate (the oracles I1-I5
//! and linearizability, timed-out calls unknown).

mod common;

use common::{
    assert_all_cycles_ran, assert_linearizable, assert_no_wrong_errors, assert_oracle_ok, pg_url,
    redis_url,
};
use dedupgate_torture::runner::{Face, RunConfig, RunReport};
use dedupgate_torture::tcpfault::TcpFaultPlan;

async fn torture(
    store: &str,
    face: Face,
    cycles: u64,
    tweak: impl FnOnce(&mut RunConfig),
) -> RunReport {
    common::torture("net faults", store, face, cycles, tweak).await
}

fn assert_clean(r: &RunReport) {
    let seed = r.config.seed;
    assert_oracle_ok(r);
    assert_linearizable(r);
    assert_no_wrong_errors(r);
    assert_all_cycles_ran(r);
    assert!(r.lin_ops > 0, "seed {seed}");
}

fn assert_tcp_fired(r: &RunReport) {
    assert_tcp_faults_fired(r);
    // The faults reached the workers: some answers were unknown (unavailable or timed out).
    assert!(
        r.oracle.answers_unknown > 0,
        "seed {}: no call saw the faults",
        r.config.seed
    );
}

/// Every kind of TCP fault fired in the run (not necessarily during a call).
fn assert_tcp_faults_fired(r: &RunReport) {
    let seed = r.config.seed;
    let t = r
        .faults
        .tcp
        .as_ref()
        .expect("the run had a TCP fault proxy");
    assert!(t.delays > 0, "seed {seed}: no delay fired: {t:?}");
    // A cut at random or on command (a cut-all cycle): the plan is off while the run drains
    // and reads back, so a short run can see its few random cuts land there (2026-11-21: 0 of
    // 708 buffers cut at random, 4 cut on command).
    assert!(
        t.cuts + t.commanded_cuts > 0,
        "seed {seed}: no connection was cut: {t:?}"
    );
    assert!(t.truncations > 0, "seed {seed}: no truncation fired: {t:?}");
    assert!(r.faults.tcp_cut_all > 0, "seed {seed}: no cut-all cycle");
}

fn tcp(c: &mut RunConfig) {
    // Rates high enough that a 12-cycle run (about a thousand buffers) fires every kind:
    // each must be seen in every run, not just on average.
    c.tcp_faults = Some(TcpFaultPlan {
        cut_permille: 15,
        truncate_permille: 20,
        ..TcpFaultPlan::ci()
    });
    c.tcp_cut_all_pct = 30;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_face_over_redis_through_the_tcp_fault_proxy() {
    let r = torture(&redis_url(), Face::Library, 12, tcp).await;
    assert_clean(&r);
    assert_tcp_fired(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_face_over_postgres_through_the_tcp_fault_proxy() {
    let r = torture(&pg_url(), Face::Library, 12, tcp).await;
    assert_clean(&r);
    // Not `assert_tcp_fired`: the connection pool drops a cut or truncated connection while it
    // is idle (its recycle check) and opens another, so on a quiet machine a 12-cycle run often
    // has no call in flight when a fault lands (2 runs in 4 had no unknown answer, 2026-11-21).
    // What this run must show is that whatever did reach a call was never a wrong answer.
    assert_tcp_faults_fired(&r);
}

/// The gate process's store connections go through the proxy: the workers must see 503s
/// (unknown), never a wrong answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_face_over_redis_through_the_tcp_fault_proxy() {
    let r = torture(&redis_url(), Face::Http, 12, tcp).await;
    assert_clean(&r);
    assert_tcp_fired(&r);
}

/// Found by the run above with seed 4386361619953761732: a reply cut short while the gate's
/// `ConnectionManager` reconnected left it answering the same parse error to every later request
/// (2,872 of 3,000 answers unknown; every key lost its final read). The Redis store rebuilds its
/// connection after such errors now; this seed replays those faults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_face_over_redis_recovers_from_a_reply_cut_during_reconnection() {
    let r = torture(&redis_url(), Face::Http, 12, |c| {
        tcp(c);
        c.seed = 4_386_361_619_953_761_732;
    })
    .await;
    assert_clean(&r);
}

/// appendonly yes + appendfsync always: whatever Redis acknowledged is on disk when SIGKILL
/// lands; several kills and restarts a run, behind the TCP fault proxy too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_redis_sigkilled_and_restarted_behind_the_tcp_fault_proxy() {
    let r = torture("redis (owned)", Face::Library, 14, |c| {
        c.owned_redis = true;
        c.kill_store_pct = 35;
        tcp(c);
        c.tcp_cut_all_pct = 20;
    })
    .await;
    assert_clean(&r);
    assert!(
        r.faults.store_sigkills >= 2,
        "seed {}: Redis was killed {} times",
        r.config.seed,
        r.faults.store_sigkills
    );
}

/// kill -9 of the postmaster and a restart (crash recovery from the WAL), several times a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_postgres_killed_and_restarted() {
    let r = torture("postgres (owned)", Face::Library, 8, |c| {
        c.owned_postgres = true;
        c.kill_store_pct = 25;
    })
    .await;
    assert_clean(&r);
    assert!(
        r.faults.store_sigkills >= 2,
        "seed {}: PostgreSQL was killed {} times",
        r.config.seed,
        r.faults.store_sigkills
    );
}
