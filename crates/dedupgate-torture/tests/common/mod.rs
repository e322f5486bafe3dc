//! Helpers shared by the torture CI test binaries. Each binary compiles its own copy and uses
//! only some of them, hence the item-level `#[allow(dead_code)]`.

use std::path::PathBuf;

use dedupgate_torture::runner::{self, Face, RunConfig, RunReport};

/// The harness binary the runs spawn as workers and gates.
#[allow(dead_code)]
pub fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dedupgate-torture"))
}

#[allow(dead_code)]
pub fn redis_url() -> String {
    std::env::var("DEDUPGATE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

#[allow(dead_code)]
pub fn pg_url() -> String {
    std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A scratch directory for one run, removed afterwards unless `DEDUPGATE_TORTURE_KEEP` is set
/// (then its path is printed and it stays, to read a failed run's data and logs).
#[allow(dead_code)]
pub fn run_dir() -> tempfile::TempDir {
    let mut dir = tempfile::tempdir().expect("temp dir");
    if std::env::var_os("DEDUPGATE_TORTURE_KEEP").is_some() {
        dir.disable_cleanup(true);
        eprintln!("run directory kept: {}", dir.path().display());
    }
    dir
}

/// One CI-sized crash-cycle run. The seed is derived from `"{label} {store} {face:?}"`: keep
/// each file's label unchanged so the seeds printed by earlier runs still replay.
#[allow(dead_code)]
pub async fn torture(
    label: &str,
    store: &str,
    face: Face,
    cycles: u64,
    tweak: impl FnOnce(&mut RunConfig),
) -> RunReport {
    let seed = dedupgate_torture::seed(&format!("{label} {store} {face:?}"));
    let dir = run_dir();
    let mut cfg = RunConfig::ci(store, face, cycles, dir.path().join("run"), exe(), seed);
    tweak(&mut cfg);
    // The cron and proxy faces spawn the `dedupgate` binary, which this package does not build.
    let what = match face {
        Face::Cron | Face::Proxy => "the run could be carried out (is the dedupgate binary built?)",
        Face::Library | Face::Http => "the run could be carried out",
    };
    let report = runner::run(cfg).await.expect(what);
    eprintln!("{}", report.summary());
    report
}

/// Effect oracle: no duplicate, no lost effect, no fence violation, no replay mismatch.
#[allow(dead_code)]
pub fn assert_oracle_ok(r: &RunReport) {
    let seed = r.config.seed;
    assert!(
        r.oracle.ok(),
        "seed {seed}: duplicates {:#?} lost {:#?} fences {:#?} replays {:#?}",
        r.oracle.duplicates,
        r.oracle.lost,
        r.oracle.fence_violations,
        r.oracle.replay_mismatches
    );
}

#[allow(dead_code)]
pub fn assert_linearizable(r: &RunReport) {
    let seed = r.config.seed;
    assert!(
        r.lin_violations.is_empty(),
        "seed {seed}: {:#?}",
        r.lin_violations
    );
}

#[allow(dead_code)]
pub fn assert_no_wrong_errors(r: &RunReport) {
    let seed = r.config.seed;
    assert!(
        r.wrong_errors.is_empty(),
        "seed {seed}: answers no fault may produce: {:#?}",
        r.wrong_errors
    );
}

#[allow(dead_code)]
pub fn assert_all_cycles_ran(r: &RunReport) {
    let seed = r.config.seed;
    assert_eq!(r.faults.cycles, r.config.cycles, "seed {seed}");
}
