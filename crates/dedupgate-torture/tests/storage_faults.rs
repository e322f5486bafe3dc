//! CI tier of the storage faults under the embedded store (`src/storage_faults.rs`): failed
//! writes and fsyncs injected by libfiu (Debian fiu-utils), and loss of never-synced writes
//! (the shim in `shim/unsynced.c`, built here with `cc`). Each run prints its seed; replay one
//! with `DEDUPGATE_TORTURE_SEED=…`. Each asserts that its faults fired, not only that nothing
//! broke.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::exe;
use dedupgate_torture::storage_faults::{
    self, build_shim, simulate_power_loss, snapshot, StorageFaultConfig,
};

fn cfg(dir: &std::path::Path, what: &str, episodes: u64) -> StorageFaultConfig {
    let seed = dedupgate_torture::seed(what);
    StorageFaultConfig::ci(dir.join("data"), dir.join("run"), exe(), seed, episodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_writes_and_fsyncs_fail_closed_and_lose_nothing_acknowledged() {
    let dir = common::run_dir();
    let r = storage_faults::failed_io(cfg(dir.path(), "failed-io", 6))
        .await
        .expect("the run could be carried out");
    eprintln!("{}", r.summary());
    let seed = r.config.seed;
    assert!(r.ok(), "seed {seed}: {:#?}", r.checked.violations());
    let f = &r.faults;
    assert_eq!(f.phases, 6, "seed {seed}");
    assert!(f.injected_total > 0, "seed {seed}: fiu injected nothing");
    assert!(
        f.fail_closed_seen > 0,
        "seed {seed}: the gate never reported its store unavailable"
    );
    assert!(
        r.checked.unavailable_answers > 0,
        "seed {seed}: no worker was answered unavailable"
    );
    assert_eq!(
        f.recovered_without_restart, f.phases,
        "seed {seed}: the store did not come back by itself"
    );
}

/// Regression: after a failed fsync the store reopened fjall and went on appending to the same
/// journal. Linux may drop the pages that fsync failed to write while later fsyncs succeed
/// (fsyncgate); a power loss then left a hole in the journal whose replay stopped there, and
/// every commit acknowledged after the failure was lost (629 acknowledged keys in one run).
/// Then, a journal created while a directory fsync failed was never made durable, and one whose
/// header was written before a failed fsync stayed the active one. Fixed in
/// `dedupgate-embedded` (`Engine::checkpoint_after_failure`: a new journal, everything before
/// flushed and synced, every directory synced, before the store answers again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_failed_fsync_did_not_write_takes_nothing_acknowledged_with_it() {
    let dir = common::run_dir();
    let mut c = cfg(dir.path(), "failed-io then power loss", 3);
    c.power_loss_at_end = true;
    let r = storage_faults::failed_io(c)
        .await
        .expect("the run could be carried out");
    eprintln!("{}", r.summary());
    let seed = r.config.seed;
    assert!(r.ok(), "seed {seed}: {:#?}", r.checked.violations());
    assert!(r.faults.final_power_loss.is_some());
    let syncs_failed = r.faults.injected.get("fsync").copied().unwrap_or(0)
        + r.faults.injected.get("fdatasync").copied().unwrap_or(0);
    assert!(syncs_failed > 0, "seed {seed}: no sync failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_losses_drop_unsynced_writes_and_nothing_acknowledged() {
    let dir = common::run_dir();
    let r = storage_faults::power_loss(cfg(dir.path(), "power-loss", 8))
        .await
        .expect("the run could be carried out");
    eprintln!("{}", r.summary());
    let seed = r.config.seed;
    assert!(r.ok(), "seed {seed}: {:#?}", r.checked.violations());
    // 8 under load, one more after everything was acknowledged.
    assert_eq!(r.faults.power_losses, 9, "seed {seed}");
    assert!(
        r.faults.losses_that_dropped_data > 0,
        "seed {seed}: no loss dropped anything: the model was not exercised"
    );
    assert!(r.checked.oracle.answers_read > 0);
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

fn healthy(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

/// Regression: creating a store fsync'd the format file and the parent directory after the
/// rename, but not the staging directory holding the format file's entry, so a power loss right
/// after the first open left `engine/FORMAT` missing and the store refused to open ("not a
/// dedupgate store"). Fixed in `dedupgate-embedded` (store.rs, fsync of the staging directory).
#[test]
fn a_store_just_created_survives_a_power_loss() {
    let dir = common::run_dir();
    let lib = build_shim(&dir.path().join("shim")).unwrap();
    let data = std::fs::canonicalize(dir.path()).unwrap().join("data");
    let log = dir.path().join("shim.log");
    let addr = free_addr();
    let start = |log_env: &std::path::Path| {
        Command::new(exe())
            .args(["gate", "--store"])
            .arg(format!("embedded:{}", data.display()))
            .args(["--listen", &addr])
            .env("LD_PRELOAD", &lib)
            .env("DEDUPGATE_SHIM_ROOT", &data)
            .env("DEDUPGATE_SHIM_LOG", log_env)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let wait = |child: &mut std::process::Child| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if healthy(&addr) {
                return true;
            }
            if child.try_wait().unwrap().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    };
    let mut gate = start(&log);
    assert!(wait(&mut gate), "the first gate did not come up");
    gate.kill().unwrap();
    gate.wait().unwrap();
    let baseline = std::collections::BTreeMap::new();
    let dropped = simulate_power_loss(&log, &baseline).unwrap();
    assert!(dropped.syncs_logged > 0, "{dropped:?}");
    let _ = snapshot(&data).unwrap();
    let mut again = start(&dir.path().join("shim-1.log"));
    let up = wait(&mut again);
    let _ = again.kill();
    let _ = again.wait();
    assert!(
        up,
        "the store did not open after a power loss right after its creation"
    );
}
