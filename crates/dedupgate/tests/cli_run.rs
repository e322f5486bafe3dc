//! End-to-end tests of `dedupgate run` (the cron gate), driving the real binary against a real
//! store: the embedded store in a temporary directory (override with
//! `DEDUPGATE_TEST_CLI_STORE=postgres://…` to run them against another store), and a real
//! `dedupgate serve` for `--server`.
//!
//! CMD counts its own runs by appending a line to a file, so "ran exactly once" is read from
//! the file, not from anything `run` says about itself.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct Env {
    dir: tempfile::TempDir,
    store: String,
    namespace: String,
}

impl Env {
    fn new(test: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = std::env::var("DEDUPGATE_TEST_CLI_STORE")
            .unwrap_or_else(|_| format!("embedded:{}", dir.path().join("data").display()));
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        Self {
            dir,
            store,
            namespace: format!("t-{test}-{}-{nanos}", std::process::id()),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `dedupgate run --store … --namespace … ARGS -- sh -c SCRIPT`.
    fn run_cmd(&self, args: &[&str], script: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
        c.env("RUST_LOG", "warn")
            .arg("run")
            .args(["--store", &self.store, "--namespace", &self.namespace])
            .args(args)
            .args(["--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, args: &[&str], script: &str) -> Output {
        self.run_cmd(args, script).output().unwrap()
    }

    fn spawn(&self, args: &[&str], script: &str) -> Child {
        self.run_cmd(args, script).spawn().unwrap()
    }

    fn count_lines(&self, name: &str) -> usize {
        fs::read_to_string(self.path(name))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends signal `name` (TERM, HUP, …) to `child` with kill(1).
fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name}");
}

fn append(file: &Path) -> String {
    format!("echo ran >> '{}'", file.display())
}

#[test]
fn runs_once_then_skips_with_the_reason_and_the_chosen_exit_code() {
    let env = Env::new("once");
    let script = format!(
        "{}; echo out-line; echo err-line >&2",
        append(&env.path("count"))
    );
    let first = env.run(&["--key", "nightly"], &script);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    assert_eq!(String::from_utf8_lossy(&first.stdout), "out-line\n");
    assert!(stderr(&first).contains("err-line"));
    let second = env.run(&["--key", "nightly"], &script);
    assert_eq!(code(&second), 0);
    assert!(
        stderr(&second).contains("already ran") && stderr(&second).contains("exit 0"),
        "{}",
        stderr(&second)
    );
    let third = env.run(&["--key", "nightly", "--skip-exit-code", "7"], &script);
    assert_eq!(code(&third), 7);
    assert_eq!(env.count_lines("count"), 1);

    // The output tail and exit status are the stored result.
    let get = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args([
            "get",
            "--store",
            &env.store,
            "--namespace",
            &env.namespace,
            "--key",
            "nightly",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&get.stdout);
    assert!(get.status.success(), "{text} {}", stderr(&get));
    assert!(
        text.contains("out-line") && text.contains("err-line"),
        "{text}"
    );
    assert!(text.contains("\"exit_code\""), "{text}");
}

#[test]
fn a_failed_cmd_passes_its_code_and_is_retried_by_the_next_trigger() {
    let env = Env::new("retry");
    let fail = format!("{}; exit 3", append(&env.path("count")));
    assert_eq!(code(&env.run(&["--key", "k"], &fail)), 3);
    let ok = append(&env.path("count"));
    let again = env.run(&["--key", "k"], &ok);
    assert_eq!(code(&again), 0, "{}", stderr(&again));
    assert_eq!(env.count_lines("count"), 2);
    assert_eq!(code(&env.run(&["--key", "k"], &ok)), 0);
    assert_eq!(
        env.count_lines("count"),
        2,
        "completed: not run a third time"
    );
}

#[test]
fn idempotent_mode_never_runs_twice_even_after_a_failure() {
    let env = Env::new("idem");
    let fail = format!("{}; exit 4", append(&env.path("count")));
    assert_eq!(
        code(&env.run(&["--key", "k", "--mode", "idempotent"], &fail)),
        4
    );
    let again = env.run(&["--key", "k", "--mode", "idempotent"], &fail);
    assert_eq!(code(&again), 0);
    assert!(stderr(&again).contains("already ran"), "{}", stderr(&again));
    assert_eq!(env.count_lines("count"), 1);
}

#[test]
fn concurrent_runs_of_one_key_run_cmd_exactly_once() {
    let env = Env::new("concurrent");
    for round in 0..3 {
        let key = format!("overlap-{round}");
        let script = format!("{}; sleep 0.5", append(&env.path(&key)));
        let children: Vec<Child> = (0..4)
            .map(|_| env.spawn(&["--key", &key], &script))
            .collect();
        let outputs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        assert_eq!(
            env.count_lines(&key),
            1,
            "round {round}: CMD ran exactly once"
        );
        for o in &outputs {
            assert_eq!(code(o), 0, "{}", stderr(o));
        }
        let skipped = outputs
            .iter()
            .filter(|o| {
                let e = stderr(o);
                e.contains("is running now") || e.contains("already ran")
            })
            .count();
        assert_eq!(
            skipped, 3,
            "round {round}: the other three said why they skipped"
        );
        assert!(
            outputs.iter().any(|o| stderr(o).contains("held by")),
            "an overlapping trigger names the holder"
        );
    }
}

#[test]
fn the_lease_is_kept_alive_while_cmd_runs_past_its_length() {
    let env = Env::new("keepalive");
    let script = format!("{}; sleep 4", append(&env.path("count")));
    let first = env.spawn(&["--key", "long", "--lease", "1s"], &script);
    wait_for("the first CMD", Duration::from_secs(10), || {
        env.count_lines("count") == 1
    });
    std::thread::sleep(Duration::from_millis(2500)); // two and a half lease lengths
    let second = env.run(&["--key", "long", "--lease", "1s"], &script);
    assert!(
        stderr(&second).contains("is running now"),
        "{}",
        stderr(&second)
    );
    let first = first.wait_with_output().unwrap();
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    assert_eq!(env.count_lines("count"), 1);
}

#[test]
fn a_run_killed_with_sigkill_is_taken_over_after_its_lease() {
    let env = Env::new("sigkill");
    let pids = env.path("pids");
    let script = format!("echo $$ >> '{}'; sleep 8", pids.display());
    let mut first = env.spawn(&["--key", "k", "--lease", "3s"], &script);
    wait_for("the first CMD", Duration::from_secs(10), || {
        env.count_lines("pids") == 1
    });
    first.kill().unwrap(); // SIGKILL: no release, no completion
    first.wait().unwrap();
    let blocked = env.run(&["--key", "k", "--lease", "3s"], &script);
    assert!(
        stderr(&blocked).contains("is running now"),
        "within the lease the key is still held: {}",
        stderr(&blocked)
    );
    std::thread::sleep(Duration::from_millis(3300));
    let quick = format!("echo $$ >> '{}'", pids.display());
    let retried = env.run(&["--key", "k", "--lease", "3s"], &quick);
    assert_eq!(code(&retried), 0, "{}", stderr(&retried));
    assert_eq!(
        env.count_lines("pids"),
        2,
        "a later trigger took over and ran CMD"
    );
    // The orphaned CMD of the killed run: stop it.
    for pid in fs::read_to_string(&pids).unwrap().lines() {
        let _ = Command::new("kill").arg(pid).stderr(Stdio::null()).status();
    }
}

#[test]
fn signals_to_run_reach_cmd_and_a_killed_cmd_releases_the_key() {
    let env = Env::new("signals");
    let log = env.path("log");
    let script = format!(
        "trap 'echo got-term >> \"{0}\"; exit 42' TERM; echo ready >> '{0}'; while :; do sleep 0.05; done",
        log.display()
    );
    let child = env.spawn(&["--key", "sig"], &script);
    wait_for("CMD to be ready", Duration::from_secs(10), || {
        env.count_lines("log") == 1
    });
    signal(&child, "TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(code(&out), 42, "{}", stderr(&out));
    assert!(fs::read_to_string(&log).unwrap().contains("got-term"));
    // CMD failed: the key was released, the next trigger runs.
    let next = env.run(&["--key", "sig"], &append(&env.path("count")));
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert_eq!(env.count_lines("count"), 1);
}

/// Found by review: `run` caught HUP even when it was started with HUP ignored (`nohup`), then
/// passed it on, and CMD (whose disposition was reset at exec) died of it. A signal ignored at
/// start stays ignored, for `run` and for CMD.
#[test]
fn a_signal_ignored_at_start_stays_ignored_for_run_and_cmd() {
    let env = Env::new("sigign");
    let log = env.path("log");
    let script = format!(
        "echo ready >> '{0}'; i=0; while [ $i -lt 20 ]; do sleep 0.05; i=$((i+1)); done; echo done >> '{0}'",
        log.display()
    );
    let child = Command::new("sh")
        .args(["-c", "trap '' HUP; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_dedupgate"))
        .arg("run")
        .args([
            "--store",
            &env.store,
            "--namespace",
            &env.namespace,
            "--key",
            "ign",
        ])
        .args(["--", "sh", "-c", &script])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("CMD to be ready", Duration::from_secs(10), || {
        env.count_lines("log") == 1
    });
    signal(&child, "HUP");
    let out = child.wait_with_output().unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(fs::read_to_string(&log).unwrap(), "ready\ndone\n");
}

/// `run` catches signals from its start now (a TERM between taking the key and starting CMD
/// used to end it by the default action, leaving the key held). While it only waits for
/// another holder (`--wait`), holding nothing, a signal must still end it at once.
#[test]
fn a_signal_while_waiting_ends_run_and_runs_nothing() {
    let env = Env::new("sigwait");
    let mut holder = env.spawn(
        &["--key", "s"],
        &format!("{}; sleep 5", append(&env.path("count"))),
    );
    wait_for("the holder", Duration::from_secs(10), || {
        env.count_lines("count") == 1
    });
    let waiter = env.spawn(&["--key", "s", "--wait"], &append(&env.path("count")));
    std::thread::sleep(Duration::from_millis(700));
    signal(&waiter, "TERM");
    let out = waiter.wait_with_output().unwrap();
    assert_eq!(code(&out), 143, "{}", stderr(&out));
    assert!(
        holder.try_wait().unwrap().is_none(),
        "the waiter ended before the holder"
    );
    assert_eq!(env.count_lines("count"), 1, "the waiter ran nothing");
    let _ = holder.kill();
    let _ = holder.wait();
}

/// A signal that reaches `run` after it took the key and before CMD started: CMD never starts
/// and the key is given back (released, or the idempotent mark removed), so the next trigger
/// runs. The signal is sent while `run` waits for a store directory a server holds, and the
/// server then stops, so `run` takes the key with the signal already caught.
#[test]
fn a_signal_before_cmd_starts_gives_the_key_back() {
    for mode in ["retriable", "idempotent"] {
        let env = Env::new("sigstart");
        let store = format!("embedded:{}", env.path("held").display());
        let server = serve_on(&store);
        let run = |lock_wait: &str| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
            c.env("RUST_LOG", "warn")
                .args(["run", "--store", &store, "--namespace", &env.namespace])
                .args(["--mode", mode, "--key", "k", "--lock-wait", lock_wait])
                .args(["--", "sh", "-c", &append(&env.path("count"))])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        };
        let blocked = run("60s").spawn().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        signal(&blocked, "TERM");
        drop(server);
        let out = blocked.wait_with_output().unwrap();
        assert_eq!(code(&out), 143, "{mode}: {}", stderr(&out));
        assert_eq!(env.count_lines("count"), 0, "{mode}: CMD never started");
        let next = run("10s").output().unwrap();
        assert_eq!(code(&next), 0, "{mode}: {}", stderr(&next));
        assert_eq!(env.count_lines("count"), 1, "{mode}: the next trigger ran");
    }
}

/// Found by an adversarial run: in idempotent mode a CMD that could not start (a typo in a
/// cron line: 127) kept its mark, so every trigger for the ttl skipped it as "already ran".
/// The mark is removed when CMD never started.
#[test]
fn an_idempotent_cmd_that_never_started_leaves_the_key_free() {
    let env = Env::new("nostart");
    let missing = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args(["run", "--store", &env.store, "--namespace", &env.namespace])
        .args([
            "--mode",
            "idempotent",
            "--key",
            "typo",
            "--",
            "/nonexistent/cmd",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&missing), 127, "{}", stderr(&missing));
    let next = env.run(
        &["--mode", "idempotent", "--key", "typo"],
        &append(&env.path("count")),
    );
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert_eq!(env.count_lines("count"), 1, "{}", stderr(&next));
}

/// Found by an adversarial run: the stored 2 KiB tail of an output of multi-byte characters
/// began inside one (two U+FFFD). It starts at the next whole character now.
#[test]
fn output_tails_start_on_a_whole_character() {
    let env = Env::new("tail");
    // 2,000 euro signs (3 bytes each): a 2,048-byte tail cut from the end starts 2 bytes into one.
    let out = env.run(
        &["--key", "euros"],
        r"i=0; while [ $i -lt 2000 ]; do printf '\342\202\254' >&2; i=$((i+1)); done",
    );
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let get = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args(["get", "--store", &env.store, "--namespace", &env.namespace])
        .args(["--key", "euros"])
        .output()
        .unwrap();
    assert!(get.status.success(), "{}", stderr(&get));
    let record: serde_json::Value = serde_json::from_slice(&get.stdout).unwrap();
    let tail = record["result"]["stderr_tail"].as_str().unwrap();
    assert!(!tail.contains('\u{FFFD}'), "{tail:?}");
    assert_eq!(tail.chars().count(), 682, "whole characters only");
}

#[test]
fn wait_runs_after_a_failed_holder_and_skips_after_a_completed_one() {
    let env = Env::new("wait");
    let holder = env.spawn(
        &["--key", "w"],
        &format!("{}; sleep 0.7; exit 1", append(&env.path("count"))),
    );
    wait_for("the holder", Duration::from_secs(10), || {
        env.count_lines("count") == 1
    });
    let waited = env.run(&["--key", "w", "--wait"], &append(&env.path("count")));
    assert_eq!(code(&waited), 0, "{}", stderr(&waited));
    assert_eq!(
        env.count_lines("count"),
        2,
        "the waiter ran once the holder failed"
    );
    assert_eq!(code(&holder.wait_with_output().unwrap()), 1);

    let holder = env.spawn(
        &["--key", "w2"],
        &format!("{}; sleep 0.7", append(&env.path("c2"))),
    );
    wait_for("the holder", Duration::from_secs(10), || {
        env.count_lines("c2") == 1
    });
    let waited = env.run(&["--key", "w2", "--wait"], &append(&env.path("c2")));
    assert_eq!(code(&waited), 0);
    assert!(
        stderr(&waited).contains("already ran"),
        "{}",
        stderr(&waited)
    );
    assert_eq!(env.count_lines("c2"), 1);
    holder.wait_with_output().unwrap();

    let holder = env.spawn(
        &["--key", "w3"],
        &format!("{}; sleep 3", append(&env.path("c3"))),
    );
    wait_for("the holder", Duration::from_secs(10), || {
        env.count_lines("c3") == 1
    });
    let gave_up = env.run(
        &[
            "--key",
            "w3",
            "--wait",
            "--wait-timeout",
            "300ms",
            "--skip-exit-code",
            "5",
        ],
        "true",
    );
    assert_eq!(code(&gave_up), 5, "{}", stderr(&gave_up));
    assert!(
        stderr(&gave_up).contains("--wait-timeout ran out")
            && !stderr(&gave_up).contains("give --wait"),
        "{}",
        stderr(&gave_up)
    );
    let mut holder = holder;
    let _ = holder.kill();
    let _ = holder.wait();
}

#[test]
fn window_keys_run_once_per_window() {
    let env = Env::new("window");
    let script = append(&env.path("count"));
    let first = env.run(&["--key", "backup_{now|window:1d}"], &script);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    let second = env.run(&["--key", "backup_{now|window:1d}"], &script);
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let day = dedupgate_core::keys::format_rfc3339_ms(now_ms - now_ms % 86_400_000, false).unwrap();
    let e = stderr(&second);
    assert!(
        e.contains("already ran") && e.contains(&format!("backup_{day}")),
        "{e}"
    );
    // A different window is a different key: the key holds the window's start, so in the first
    // hour of a UTC day the hour's key is the day's (found by CI, run at 00:10 UTC).
    let hourly = env.run(&["--key", "backup_{now|window:1h}"], &script);
    assert_eq!(code(&hourly), 0, "{}", stderr(&hourly));
    let hour = dedupgate_core::keys::format_rfc3339_ms(now_ms - now_ms % 3_600_000, false).unwrap();
    if hour == day {
        assert!(
            stderr(&hourly).contains("already ran"),
            "{}",
            stderr(&hourly)
        );
        assert_eq!(env.count_lines("count"), 1);
    } else {
        assert_eq!(env.count_lines("count"), 2);
    }
}

#[test]
fn gate_failures_and_bad_commands_have_their_own_exit_codes() {
    let env = Env::new("codes");
    let missing = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args([
            "run",
            "--store",
            &env.store,
            "--namespace",
            &env.namespace,
            "--key",
            "nf",
            "--",
            "/no/such/program",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&missing), 127, "{}", stderr(&missing));
    // A lease of a millisecond ran out between renewals and let a second trigger run CMD
    // beside the first (found by an adversarial run): refused, nothing run.
    let short = env.run(
        &["--key", "short", "--lease", "1ms"],
        &append(&env.path("short")),
    );
    assert_eq!(code(&short), 125, "{}", stderr(&short));
    assert!(
        stderr(&short).contains("at least 100ms"),
        "{}",
        stderr(&short)
    );
    assert_eq!(env.count_lines("short"), 0);
    let noexec = env.path("noexec.sh");
    fs::write(&noexec, "#!/bin/sh\n").unwrap();
    let cannot = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args([
            "run",
            "--store",
            &env.store,
            "--namespace",
            &env.namespace,
            "--key",
            "ne",
            "--",
        ])
        .arg(&noexec)
        .output()
        .unwrap();
    assert_eq!(code(&cannot), 126, "{}", stderr(&cannot));
    let bad_store = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args([
            "run",
            "--store",
            "ftp://nowhere",
            "--key",
            "k",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&bad_store), 125, "{}", stderr(&bad_store));
    let event_key = env.run(&["--key", "{user}"], "true");
    assert_eq!(code(&event_key), 125);
    assert!(
        stderr(&event_key).contains("only {now}"),
        "{}",
        stderr(&event_key)
    );
    let usage = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args(["run", "--key", "k"])
        .output()
        .unwrap();
    assert_eq!(code(&usage), 2, "no CMD is a usage error");
}

/// A `dedupgate serve` child on a free port, killed on drop.
struct Server {
    child: Child,
    /// Read by the `--server` tests, which need the `http-client` feature.
    #[cfg_attr(not(feature = "http-client"), allow(dead_code))]
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(feature = "http-client")]
fn serve() -> Server {
    serve_on("memory:")
}

fn serve_on(store: &str) -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--store",
            store,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    wait_for("the server", Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    server
}

/// The first thing a new user meets: `dedupgate serve` holds the default directory, so a `run`
/// on the same store fails as a gate failure (125) and says how to go through the server.
#[test]
fn a_store_held_by_a_server_is_refused_with_the_way_through_it() {
    let env = Env::new("held");
    let dir = env.path("data");
    let store = format!("embedded:{}", dir.display());
    let _server = serve_on(&store);
    let script = append(&env.path("count"));
    let run_held = |lock_wait: &str| {
        Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .env("RUST_LOG", "warn")
            .args([
                "run",
                "--store",
                &store,
                "--lock-wait",
                lock_wait,
                "--key",
                "held",
            ])
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let held = run_held("100ms");
    assert_eq!(code(&held), 125, "{}", stderr(&held));
    let hints = [
        "in use",
        "dedupgate serve",
        "--server URL",
        "another store directory",
    ];
    for hint in hints {
        assert!(stderr(&held).contains(hint), "{hint}: {}", stderr(&held));
    }
    assert!(
        !stderr(&held).contains("waiting up to"),
        "a short wait passes unsaid: {}",
        stderr(&held)
    );
    assert_eq!(env.count_lines("count"), 0, "CMD must not run");
    // A wait longer than a second says what it waits for while it waits.
    let waited = run_held("1500ms");
    assert_eq!(code(&waited), 125, "{}", stderr(&waited));
    assert!(
        stderr(&waited)
            .contains("is in use by another process (a `dedupgate serve`?); waiting up to"),
        "{}",
        stderr(&waited)
    );
    assert_eq!(env.count_lines("count"), 0, "CMD must not run");
    // The API subcommands on the store directly say the same, after their own --lock-wait,
    // and exit 3: the gate could not be asked.
    let claim = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args(["claim", "--store", &store, "-n", "run", "-k", "held"])
        .args(["--lock-wait", "200ms"])
        .output()
        .unwrap();
    assert_eq!(code(&claim), 3, "{}", stderr(&claim));
    for hint in hints {
        assert!(stderr(&claim).contains(hint), "{hint}: {}", stderr(&claim));
    }
}

/// Found by review: a signal that came while `run` waited for the store (here its directory
/// lock, held by a server) was only looked at once the call returned, and then the call's
/// failure decided the exit code (125). It stops `run` with `128 + N`, as documented.
#[test]
fn a_signal_while_run_waits_for_the_store_exits_128_plus_n() {
    let env = Env::new("sigstore");
    let dir = env.path("data");
    let store = format!("embedded:{}", dir.display());
    let _server = serve_on(&store);
    let log = env.path("stderr.log");
    let child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .env("RUST_LOG", "warn")
        .args(["run", "--store", &store, "--lock-wait", "3s", "--key", "k"])
        .args(["--", "sh", "-c", &append(&env.path("count"))])
        .stdin(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_for("the lock wait", Duration::from_secs(20), || {
        fs::read_to_string(&log).is_ok_and(|t| t.contains("waiting up to"))
    });
    signal(&child, "TERM");
    let out = child.wait_with_output().unwrap();
    let said = fs::read_to_string(&log).unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{said}");
    assert!(said.contains("stopped by signal 15"), "{said}");
    assert_eq!(env.count_lines("count"), 0, "CMD must not run");
}

/// Found by review: with `tiered:FAST,DIR`, `run` held the embedded directory open (and
/// locked) while CMD ran, so a second trigger waited out `--lock-wait` and failed (125)
/// instead of saying the key is held and skipping. Like a plain embedded store, the tiered one
/// is opened around each call only.
#[cfg(feature = "tiered")]
#[test]
fn a_tiered_store_with_an_embedded_tier_is_not_held_while_cmd_runs() {
    let env = Env::new("tiered");
    let store = format!("tiered:memory:,embedded:{}", env.path("data").display());
    let run = |lock_wait: &str, script: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
        c.env("RUST_LOG", "warn")
            .args(["run", "--store", &store, "--lock-wait", lock_wait])
            .args(["--namespace", &env.namespace, "--key", "t"])
            .args(["--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let log = env.path("log");
    let first = run(
        "5s",
        &format!(
            "echo ready >> '{0}'; sleep 2; echo done >> '{0}'",
            log.display()
        ),
    )
    .spawn()
    .unwrap();
    wait_for("CMD to be ready", Duration::from_secs(20), || {
        env.count_lines("log") == 1
    });
    let second = run("500ms", &append(&env.path("count"))).output().unwrap();
    assert_eq!(code(&second), 0, "{}", stderr(&second));
    assert!(stderr(&second).contains("held"), "{}", stderr(&second));
    assert_eq!(env.count_lines("count"), 0, "CMD must not run twice");
    let first = first.wait_with_output().unwrap();
    assert_eq!(code(&first), 0, "{}", stderr(&first));
}

#[cfg(feature = "http-client")]
#[test]
fn run_against_a_server() {
    let env = Env::new("server");
    let server = serve();
    let script = append(&env.path("count"));
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .env("RUST_LOG", "warn")
            .args(["run", "--server", &server.url, "--key", "srv"])
            .args(extra)
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let first = run(&[]);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    let second = run(&[]);
    assert!(
        stderr(&second).contains("already ran"),
        "{}",
        stderr(&second)
    );
    assert_eq!(env.count_lines("count"), 1);
}

/// CMD sees its claim's namespace, key and fence, and a retry after a failure runs under a
/// higher fence, so a downstream system can refuse the earlier, stale run.
#[test]
fn cmd_gets_its_fence_and_a_retry_gets_a_higher_one() {
    let env = Env::new("fence");
    let log = env.path("fences");
    let script = format!(
        "echo \"$DEDUPGATE_NAMESPACE $DEDUPGATE_KEY $DEDUPGATE_FENCE\" >> {}; exit 3",
        log.display()
    );
    let first = env.run(&["--key", "nightly"], &script);
    assert_eq!(code(&first), 3, "CMD's own code: {}", stderr(&first));
    let ok = format!(
        "echo \"$DEDUPGATE_NAMESPACE $DEDUPGATE_KEY $DEDUPGATE_FENCE\" >> {}",
        log.display()
    );
    let second = env.run(&["--key", "nightly"], &ok);
    assert_eq!(code(&second), 0, "{}", stderr(&second));
    let idem = env.run(&["--key", "once", "--mode", "idempotent"], &ok);
    assert_eq!(code(&idem), 0, "{}", stderr(&idem));

    let lines: Vec<Vec<String>> = fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| l.split(' ').map(str::to_owned).collect())
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (line, key) in lines.iter().zip(["nightly", "nightly", "once"]) {
        assert_eq!(line[0], env.namespace);
        assert_eq!(line[1], key);
    }
    let fence = |i: usize| -> u64 { lines[i][2].parse().expect("a numeric fence") };
    assert!(fence(0) > 0 && fence(2) > 0);
    assert!(
        fence(1) > fence(0),
        "the retry runs under a higher fence: {lines:?}"
    );
}

/// A completed run blocks its key for `--ttl` from its claim, also when the ttl is shorter than
/// the lease (the completed record kept the lease's 30 s expiry). The completed record may live
/// up to min(ttl, COMPLETE_GRACE_MS) past the completion, so the wait counts from when the first
/// run returned, not from when it started: a slow start on a busy machine must not fail this.
#[test]
fn a_ttl_shorter_than_the_lease_frees_the_key_when_it_ends() {
    let env = Env::new("short_ttl");
    let script = append(&env.path("count"));
    let args = ["--key", "k", "--ttl", "3s", "--lease", "30s"];
    let first = env.run(&args, &script);
    let completed = Instant::now();
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    let second = env.run(&args, &script);
    assert!(
        stderr(&second).contains("already ran"),
        "{}",
        stderr(&second)
    );
    assert_eq!(env.count_lines("count"), 1, "skipped within the ttl");
    std::thread::sleep(Duration::from_millis(3_500).saturating_sub(completed.elapsed()));
    let third = env.run(&args, &script);
    assert_eq!(code(&third), 0, "{}", stderr(&third));
    assert_eq!(env.count_lines("count"), 2, "ran again once the ttl ended");
}
