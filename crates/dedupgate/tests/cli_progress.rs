//! End-to-end tests of the progress and summary convention `dedup`, `id` and `audit` share: a
//! bar on stderr when it is a terminal, fitting its width; a summary line on stderr at the end,
//! whose counts add up to what was read, stopped or not (SIGINT included); `-q` for neither.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn dg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
    c.env("RUST_LOG", "warn");
    c
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `n` JSON lines, ids repeating every `distinct`.
fn events(dir: &Path, name: &str, n: u32, distinct: u32) -> PathBuf {
    let mut text = String::new();
    for i in 0..n {
        text.push_str(&format!("{{\"id\":{},\"v\":\"payload\"}}\n", i % distinct));
    }
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

/// The summary line of `command` in `stderr`, and its counts: the number read, then the
/// others, which must add up to it.
fn summary(command: &str, stderr: &str) -> (String, u64, Vec<u64>) {
    let prefix = format!("dedupgate {command}: ");
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&prefix) && l.contains("read "))
        .unwrap_or_else(|| panic!("no summary line in: {stderr}"))
        .to_owned();
    // The elapsed time, in the last parentheses, is no count.
    let counts = &line[..line.rfind(" (").unwrap()];
    let numbers: Vec<u64> = counts
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    (line, numbers[0], numbers[1..].to_vec())
}

fn assert_adds_up(command: &str, stderr: &str) -> String {
    let (line, read, parts) = summary(command, stderr);
    assert_eq!(parts.iter().sum::<u64>(), read, "{line}");
    line
}

#[test]
fn a_stopped_ledger_run_says_where_every_record_read_went() {
    let dir = tempfile::tempdir().unwrap();
    // 30,000 good lines (10,000 keys), a bad one, more good ones: the bad one stops the run
    // while batches are in flight.
    let mut text = fs::read_to_string(events(dir.path(), "a.jsonl", 30_000, 10_000)).unwrap();
    text.push_str("not json\n");
    text.push_str(&fs::read_to_string(events(dir.path(), "b.jsonl", 5_000, 10_000)).unwrap());
    let input = dir.path().join("in.jsonl");
    fs::write(&input, text).unwrap();
    let ledger = format!("embedded:{}", dir.path().join("ledger").display());
    let o = dg()
        .args(["dedup", "--key-fields", "id", "--ledger", &ledger])
        .arg(&input)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    let line = assert_adds_up("dedup", &err(&o));
    assert!(line.contains("stopped: "), "{line}");
    assert!(line.contains("in flight, not emitted"), "{line}");
    // A finished run adds up with nothing in flight.
    let o = dg()
        .args(["dedup", "--key-fields", "id"])
        .arg(dir.path().join("a.jsonl"))
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let line = assert_adds_up("dedup", &err(&o));
    assert!(!line.contains("in flight"), "{line}");
}

#[test]
fn sigint_stops_dedup_with_a_stopped_summary_and_status_130() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = format!("embedded:{}", dir.path().join("ledger").display());
    for ledger_args in [vec![], vec!["--ledger", ledger.as_str()]] {
        let mut child = dg()
            .args(["dedup", "--key-fields", "id"])
            .args(&ledger_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // A producer that never ends: dedup is stopped by the signal, not by the input.
        let mut stdin = child.stdin.take().unwrap();
        let feeder = std::thread::spawn(move || {
            let mut i = 0u64;
            loop {
                let line = format!("{{\"id\":{}}}\n", i % 50_000);
                if stdin.write_all(line.as_bytes()).is_err() {
                    break;
                }
                i += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(1500));
        let status = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let o = child.wait_with_output().unwrap();
        feeder.join().unwrap();
        assert_eq!(o.status.code(), Some(130), "{ledger_args:?}: {}", err(&o));
        let line = assert_adds_up("dedup", &err(&o));
        assert!(line.contains("stopped: "), "{line}");
        assert!(err(&o).contains("interrupted"), "{}", err(&o));
    }
}

#[test]
fn id_and_audit_end_with_a_summary_and_quiet_drops_it() {
    let dir = tempfile::tempdir().unwrap();
    let input = events(dir.path(), "in.jsonl", 100, 40);
    let bad = dir.path().join("bad.jsonl");
    fs::write(&bad, "{\"id\":1}\n{\"x\":2}\n{\"id\":3}\n").unwrap();
    let run = |args: &[&str], file: &Path| {
        dg().args(args)
            .arg(file)
            .stdout(Stdio::null())
            .output()
            .unwrap()
    };
    let id = run(&["id", "--key-fields", "id"], &input);
    let line = assert_adds_up("id", &err(&id));
    assert!(line.contains("read 100, written 100, rejected 0"), "{line}");
    let stopped = run(&["id", "--key-fields", "id"], &bad);
    assert_eq!(stopped.status.code(), Some(1));
    let line = assert_adds_up("id", &err(&stopped));
    assert!(line.contains("stopped: read 2, written 1"), "{line}");
    let audit = run(&["audit", "--key-fields", "id"], &input);
    assert_eq!(audit.status.code(), Some(1));
    let line = assert_adds_up("audit", &err(&audit));
    assert!(line.contains("read 100, counted 100"), "{line}");
    for (args, file) in [
        (["id", "--key-fields", "id", "-q"], &input),
        (["audit", "--key-fields", "id", "-q"], &input),
        (["dedup", "--key-fields", "id", "-q"], &input),
    ] {
        let o = run(&args, file);
        assert!(err(&o).is_empty(), "{args:?}: {}", err(&o));
    }
}

/// Runs `dedupgate ARGS` on a pseudo-terminal `cols` columns wide (util-linux `script`), and
/// gives what it drew there.
fn on_a_terminal(cols: usize, args: &[&str]) -> Option<String> {
    let bin = env!("CARGO_BIN_EXE_dedupgate");
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let cmd = format!("stty cols {cols} rows 24; '{bin}' {}", quoted.join(" "));
    let o = Command::new("script")
        .args(["-qefc", &cmd, "/dev/null"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// 80 columns, and 60: a bar of fixed width plus its figures fitted 80 only while the figures
/// were short (it wrapped on larger files), so a narrower terminal shows the same fault.
#[test]
fn progress_bars_fit_the_terminal_width() {
    let dir = tempfile::tempdir().unwrap();
    let input = events(dir.path(), "in.jsonl", 300_000, 100_000);
    let input = input.to_str().unwrap();
    let out = dir.path().join("out.jsonl");
    let out = out.to_str().unwrap();
    let commands = [
        vec!["dedup", "--key-fields", "id", input, "-o", out],
        vec!["id", "--key-fields", "id", input, "-o", out],
        vec!["audit", "--key-fields", "id", "--top", "0", input],
    ];
    for (cols, args) in [80, 60]
        .into_iter()
        .flat_map(|cols| commands.iter().map(move |a| (cols, a)))
    {
        let Some(drawn) = on_a_terminal(cols, args) else {
            eprintln!("skipped: util-linux `script` is not installed");
            return;
        };
        // Strip colours and cursor moves, then every line the bar drew (ended by \r or \n).
        let mut plain = String::new();
        let mut chars = drawn.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' && chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        let bars: Vec<&str> = plain
            .split(['\r', '\n'])
            .filter(|l| l.contains("MiB") || l.contains("KiB"))
            .collect();
        assert!(!bars.is_empty(), "{args:?} drew no bar: {plain:?}");
        for bar in bars {
            assert!(
                bar.chars().count() <= cols,
                "{cols} columns, {args:?}: {bar:?}"
            );
        }
    }
}

#[test]
fn a_second_sigint_stops_a_run_blocked_on_stdin() {
    let mut child = dg()
        .args(["dedup", "--key-fields", "id"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // stdin stays open and empty: the run waits for its first record.
    let _stdin = child.stdin.take().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..2 {
        let status = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        std::thread::sleep(Duration::from_millis(300));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running after two SIGINTs"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
}
