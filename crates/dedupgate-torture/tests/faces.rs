//! CI tier of the binary's faces as torture workloads (issue 7): `dedupgate run` (the cron gate)
//! delivering events whose CMD performs the effect with `DEDUPGATE_FENCE`, with worker and
//! `run` processes SIGKILLed at random moments (between the effect and the completion among
//! them), over Redis and PostgreSQL, behind the TCP fault proxy and over a Redis that is
//! SIGKILLed and restarted. Each run prints its seed; replay with `DEDUPGATE_TORTURE_SEED=…`.
//!
//! The `dedupgate` binary must sit next to `dedupgate-torture` (`cargo test --workspace` builds
//! it; alone: `cargo build -p dedupgate`).

mod common;

use common::{assert_all_cycles_ran, assert_no_wrong_errors, assert_oracle_ok, pg_url, redis_url};
use dedupgate_torture::runner::{Face, RunConfig, RunReport};
use dedupgate_torture::tcpfault::TcpFaultPlan;

async fn torture(
    store: &str,
    face: Face,
    cycles: u64,
    tweak: impl FnOnce(&mut RunConfig),
) -> RunReport {
    common::torture("faces", store, face, cycles, tweak).await
}

fn assert_clean(r: &RunReport) {
    let seed = r.config.seed;
    assert_oracle_ok(r);
    assert_no_wrong_errors(r);
    assert_all_cycles_ran(r);
    assert!(
        r.faults.worker_sigkills > 0,
        "seed {seed}: no worker killed"
    );
}

fn assert_cron_fired(r: &RunReport) {
    let seed = r.config.seed;
    let c = r.faults.cron.as_ref().expect("a cron run counts its runs");
    assert!(
        c.run_sigkills > 0,
        "seed {seed}: no dedupgate run killed: {c:?}"
    );
    assert!(c.ran > 0 && c.skipped > 0, "seed {seed}: {c:?}");
    assert!(r.oracle.effects_accepted > 0, "seed {seed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_face_over_redis_with_run_and_worker_sigkills() {
    let r = torture(&redis_url(), Face::Cron, 10, |c| c.kill_gate_pct = 30).await;
    assert_clean(&r);
    assert_cron_fired(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_face_over_postgres_through_the_tcp_fault_proxy() {
    let r = torture(&pg_url(), Face::Cron, 10, |c| {
        c.kill_gate_pct = 30;
        c.tcp_faults = Some(TcpFaultPlan::ci());
        c.tcp_cut_all_pct = 20;
    })
    .await;
    assert_clean(&r);
    assert_cron_fired(&r);
    let t = r.faults.tcp.as_ref().expect("a TCP fault proxy");
    assert!(t.cuts + t.commanded_cuts + t.truncations > 0, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_face_over_an_owned_redis_that_is_sigkilled() {
    let r = torture("redis (owned)", Face::Cron, 10, |c| {
        c.owned_redis = true;
        c.kill_store_pct = 30;
        c.kill_gate_pct = 20;
    })
    .await;
    assert_clean(&r);
    assert!(r.faults.store_sigkills >= 2, "seed {}", r.config.seed);
}

fn assert_proxy_fired(r: &RunReport) {
    let seed = r.config.seed;
    let p = r
        .faults
        .proxy
        .as_ref()
        .expect("a proxy run counts its requests");
    assert!(
        r.faults.gate_sigkills > 0,
        "seed {seed}: the proxy was never killed"
    );
    assert!(p.fresh > 0 && p.replayed > 0, "seed {seed}: {p:?}");
    assert!(p.unknown > 0, "seed {seed}: no request was cut off: {p:?}");
}

/// The proxy over the embedded store, SIGKILLed and restarted on the same data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_face_over_embedded_with_proxy_and_worker_sigkills() {
    let data = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", data.path().join("proxy-data").display());
    let r = torture(&store, Face::Proxy, 12, |c| c.kill_gate_pct = 30).await;
    assert_clean(&r);
    assert_proxy_fired(&r);
}

/// The proxy over Redis through the TCP fault proxy, SIGKILLed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_face_over_redis_through_the_tcp_fault_proxy() {
    let r = torture(&redis_url(), Face::Proxy, 12, |c| {
        c.kill_gate_pct = 25;
        c.tcp_faults = Some(TcpFaultPlan::ci());
        c.tcp_cut_all_pct = 20;
    })
    .await;
    assert_clean(&r);
    assert_proxy_fired(&r);
}
