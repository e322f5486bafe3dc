//! End-to-end tests of how the subcommands treat their stdout: a reader that goes away
//! (`dedupgate dedup … | head -1`) ends each of them quietly, as jq and ripgrep do, with the
//! status it would have had (0 for `dedup`, `id`, `run`, `bench`; the verdict for `audit` and
//! the API subcommands).

use std::fs;
use std::path::{Path, PathBuf};
#[cfg(feature = "http-client")]
use std::process::Child;
use std::process::{Command, Output, Stdio};
#[cfg(feature = "http-client")]
use std::time::{Duration, Instant};

fn dg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
    c.env("RUST_LOG", "warn");
    c
}

/// Runs `dedupgate ARGS` with a stdout whose reader has already gone: every write to it fails
/// with EPIPE, whatever the timing.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = nix::unistd::pipe().unwrap();
    drop(reader);
    dg().args(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

/// 30,000 JSON lines (more than a pipe buffer of output), ids 0..20,000 and then repeats.
fn events(dir: &Path, name: &str) -> PathBuf {
    let mut text = String::new();
    for i in 0..30_000u32 {
        text.push_str(&format!("{{\"id\":{},\"v\":\"payload\"}}\n", i % 20_000));
    }
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

fn csv_events(dir: &Path) -> PathBuf {
    let mut text = String::from("id,v\n");
    for i in 0..30_000u32 {
        text.push_str(&format!("{},payload\n", i % 20_000));
    }
    let p = dir.join("events.csv");
    fs::write(&p, text).unwrap();
    p
}

fn assert_quiet(what: &str, o: &Output, code: i32) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.stderr.is_empty(),
        "{what} printed on stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_closed_stdout_ends_dedup_id_and_audit_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = events(dir.path(), "events.jsonl");
    let csv = csv_events(dir.path());
    let (jsonl, csv) = (jsonl.to_str().unwrap(), csv.to_str().unwrap());
    let ledger = format!("embedded:{}", dir.path().join("ledger").display());
    let gate_ledger = "memory:";
    let cases: Vec<(&str, Vec<&str>, i32)> = vec![
        ("dedup", vec!["dedup", "--key-fields", "id", jsonl], 0),
        ("dedup csv", vec!["dedup", "--key-fields", "id", csv], 0),
        (
            "dedup --keep last",
            vec!["dedup", "--key-fields", "id", "--keep", "last", jsonl],
            0,
        ),
        (
            "dedup --ledger embedded",
            vec!["dedup", "--key-fields", "id", "--ledger", &ledger, jsonl],
            0,
        ),
        (
            "dedup --ledger memory: (gate records), csv",
            vec!["dedup", "--key-fields", "id", "--ledger", gate_ledger, csv],
            0,
        ),
        ("id", vec!["id", "--key-fields", "id", jsonl], 0),
        (
            "id --print",
            vec!["id", "--key-fields", "id", "--print", csv],
            0,
        ),
        // audit's status is its verdict (1: duplicates), closed stdout or not.
        (
            "audit",
            vec!["audit", "--key-fields", "id", "--top", "20000", jsonl],
            1,
        ),
        (
            "audit --json",
            vec![
                "audit",
                "--key-fields",
                "id",
                "--top",
                "20000",
                "--json",
                csv,
            ],
            1,
        ),
    ];
    for (what, args, code) in cases {
        let o = with_closed_stdout(&args);
        assert_quiet(what, &o, code);
    }
}

#[test]
fn a_closed_stdout_ends_the_api_subcommands_and_run_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("data").display());
    let claim = with_closed_stdout(&["claim", "--store", &store, "-n", "ns", "-k", "k"]);
    assert_quiet("claim", &claim, 0);
    let get = with_closed_stdout(&["get", "--store", &store, "-n", "ns", "-k", "k"]);
    assert_quiet("get", &get, 0);
    let run = with_closed_stdout(&[
        "run", "--store", &store, "--key", "r", "--", "seq", "1", "100000",
    ]);
    assert_quiet("run", &run, 0);
}

/// A `dedupgate serve` child on a free port, killed on drop.
#[cfg(feature = "http-client")]
struct Server(Child);

#[cfg(feature = "http-client")]
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(feature = "http-client")]
#[test]
fn a_closed_stdout_ends_bench_quietly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let _server = Server(
        dg().args(["serve", "--listen", &listen, "--store", "memory:"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let url = format!("http://{listen}");
    let o = with_closed_stdout(&[
        "bench",
        "--server",
        &url,
        "-c",
        "2",
        "--duration",
        "300ms",
        "--batch-size",
        "10",
    ]);
    assert_quiet("bench", &o, 0);
}
