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

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn store_strings_that_only_look_like_paths_are_refused_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let in_dir = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .env("RUST_LOG", "warn")
            .current_dir(dir.path())
            .args(args)
            .output()
            .unwrap()
    };
    for (store, says) in [
        ("memory:foo", "memory: takes no argument"),
        ("redis:/host", "did you mean redis://host?"),
        (
            "postgres:db.example/gate",
            "did you mean postgres://db.example/gate?",
        ),
    ] {
        let o = in_dir(&["get", "--store", store, "-n", "ns", "-k", "k"]);
        assert_eq!(code(&o), 2, "{store}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{store}: {}", stderr(&o));
        let o = in_dir(&["dedup", "--key-fields", "id", "--ledger", store]);
        assert_eq!(code(&o), 2, "{store}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{store}: {}", stderr(&o));
    }
    let created: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(created.is_empty(), "{created:?}");
}

#[cfg(feature = "postgres")]
#[test]
fn a_store_that_cannot_be_reached_is_named_once_with_only_a_real_password_masked() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port(); // nothing listens there once the listener is dropped
    let host = format!("127.0.0.1:{port}");
    for url in [
        format!("postgres://gate@{host}/db"),
        format!("postgres://gate:s3cret@{host}/db"),
    ] {
        let o = dg(&["get", "--store", &url, "-n", "ns", "-k", "k"]);
        let said = stderr(&o);
        assert_eq!(code(&o), 3, "{said}");
        assert_eq!(said.matches(&host).count(), 1, "{said}");
        assert!(!said.contains("s3cret"), "{said}");
        if !url.contains("s3cret") {
            assert!(!said.contains("***"), "no password was given: {said}");
        }
    }
}

#[test]
fn a_refusal_says_its_code_once() {
    let o = dg(&["get", "--store", "memory:", "-n", "", "-k", "k"]);
    assert_eq!(code(&o), 1);
    assert_eq!(
        stderr(&o).trim(),
        "dedupgate: invalid_request: namespace: must be 1..=128 bytes, got 0"
    );
}

/// A `dedupgate serve` child, killed on drop.
#[cfg(all(feature = "proxy", feature = "http-client"))]
struct Server(std::process::Child);

#[cfg(all(feature = "proxy", feature = "http-client"))]
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(all(feature = "proxy", feature = "http-client"))]
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[cfg(all(feature = "proxy", feature = "http-client"))]
#[test]
fn a_store_in_use_hints_what_fits_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    let port = free_port();
    let server = Server(
        Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .env("RUST_LOG", "warn")
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--store",
                data,
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "serve did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let listen = format!("127.0.0.1:{}", free_port());
    let second = dg(&["serve", "--listen", &listen, "--store", data]);
    let said = stderr(&second);
    assert_eq!(code(&second), 1, "{said}");
    assert!(said.contains("give this serve a store directory of its own with --store"));
    assert!(!said.contains("--server"), "serve has no --server: {said}");
    let proxy = dg(&[
        "proxy",
        "--listen",
        &listen,
        "--store",
        data,
        "--upstream",
        "http://127.0.0.1:9",
    ]);
    let said = stderr(&proxy);
    assert_eq!(code(&proxy), 1, "{said}");
    assert!(said.contains("give this proxy a store directory of its own with --store"));
    assert!(!said.contains("--server"), "proxy has no --server: {said}");
    let get = dg(&[
        "get",
        "--store",
        data,
        "-n",
        "ns",
        "-k",
        "k",
        "--lock-wait",
        "100ms",
    ]);
    let said = stderr(&get);
    assert_eq!(code(&get), 3, "{said}");
    assert!(said.contains("go through it with --server URL"), "{said}");
    assert_eq!(
        said.matches("in use by another process").count(),
        1,
        "{said}"
    );
    // Through the server, the refusal's code is said once too.
    let url = format!("http://127.0.0.1:{port}");
    let o = dg(&["get", "--server", &url, "-n", "", "-k", "k"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim(),
        "dedupgate: invalid_request: namespace: must be 1..=128 bytes, got 0"
    );
    drop(server);
}
