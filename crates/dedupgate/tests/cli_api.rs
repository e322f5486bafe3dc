//! End-to-end tests of the API subcommands' exit codes (`claim`, `mark`, …) against a store
//! opened directly; their calls through `--server` are tested in http_ops.rs.

use std::process::{Command, Output};

fn dg(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args(args)
        .output()
        .unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn outcome(o: &Output) -> String {
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)));
    v["outcome"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn claim_and_mark_with_exit_status_exit_4_for_a_duplicate_and_0_for_new() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("data").display());
    let at = |verb: &'static str, key: &'static str| {
        let store = store.clone();
        move |extra: &[&str]| {
            let mut args = vec![verb, "--store", &store, "-n", "ns", "-k", key];
            args.extend_from_slice(extra);
            dg(&args)
        }
    };
    let claim = at("claim", "c");
    let first = claim(&["-e"]);
    assert_eq!((code(&first), outcome(&first)), (0, "new".into()));
    let again = claim(&["--exit-status"]);
    assert_eq!((code(&again), outcome(&again)), (4, "duplicate".into()));
    // Without the flag a duplicate is an answer like any other: scripts that read the JSON
    // under `set -e` keep working.
    let plain = claim(&[]);
    assert_eq!((code(&plain), outcome(&plain)), (0, "duplicate".into()));

    let mark = at("mark", "m");
    let first = mark(&["-e"]);
    assert_eq!((code(&first), outcome(&first)), (0, "new".into()));
    let again = mark(&["-e"]);
    assert_eq!((code(&again), outcome(&again)), (4, "duplicate".into()));
    assert_eq!(code(&mark(&[])), 0);

    // A refusal is still 1, not the duplicate code.
    let fp = at("claim", "f");
    assert_eq!(code(&fp(&["-e", "--fingerprint", "a"])), 0);
    let mismatch = fp(&["-e", "--fingerprint", "b"]);
    assert_eq!(
        code(&mismatch),
        1,
        "{}",
        String::from_utf8_lossy(&mismatch.stderr)
    );
}
