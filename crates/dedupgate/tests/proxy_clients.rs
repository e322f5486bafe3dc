//! `dedupgate proxy` with real clients: curl, and Python `requests` with urllib3 retries.

mod proxy_support;

use std::net::SocketAddr;
use std::process::Command;

use dedupgate_proxy::sample::SampleApi;
use proxy_support::{free_port, sample_api, start_proxy, Proc, Scratch};

struct Setup {
    _rt: tokio::runtime::Runtime,
    api: SampleApi,
    addr: SocketAddr,
    _proxy: Proc,
    _dir: Scratch,
}

fn setup(tag: &str, extra: &[&str]) -> Setup {
    let (rt, api) = sample_api();
    let dir = Scratch::new(tag);
    let port = free_port();
    let url = api.url();
    let mut args = vec!["--upstream", url.as_str(), "--store", "memory:"];
    args.extend_from_slice(extra);
    let proxy = start_proxy(port, &args, &dir.0.join("proxy.log"));
    Setup {
        _rt: rt,
        api,
        addr: ([127, 0, 0, 1], port).into(),
        _proxy: proxy,
        _dir: dir,
    }
}

fn curl(args: &[&str]) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .output()
        .expect("curl runs");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Splits `curl -i` output into (head, body).
fn split(out: &str) -> (&str, &str) {
    out.split_once("\r\n\r\n").expect("a response head")
}

#[test]
fn curl_replays_refuses_smuggling_and_keeps_connections_alive() {
    if Command::new("curl").arg("--version").output().is_err() {
        eprintln!("SKIP: curl is not installed");
        return;
    }
    let s = setup("proxy-curl", &[]);
    let url = format!("http://{}/v1/charges", s.addr);
    let post = |key: &str, data: &str| {
        curl(&[
            "-i",
            "-X",
            "POST",
            &url,
            "-H",
            &format!("Idempotency-Key: {key}"),
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            data,
        ])
        .0
    };
    let first = post("curl-1", r#"{"amount":1000}"#);
    let again = post("curl-1", r#"{"amount":1000}"#);
    let (h1, b1) = split(&first);
    let (h2, b2) = split(&again);
    assert!(h1.starts_with("HTTP/1.1 201"), "{first}");
    assert!(
        !h1.to_lowercase().contains("idempotent-replayed"),
        "{first}"
    );
    assert!(h2.starts_with("HTTP/1.1 201"), "{again}");
    assert!(
        h2.to_lowercase().contains("idempotent-replayed: true"),
        "{again}"
    );
    assert_eq!(b1, b2, "the replay is byte-identical");
    assert_eq!(s.api.counts.of("curl-1"), 1);

    let other = post("curl-1", r#"{"amount":2000}"#);
    assert!(other.starts_with("HTTP/1.1 422"), "{other}");
    assert!(other.contains("fingerprint_mismatch"), "{other}");

    // curl sends both headers when told to: the proxy refuses the ambiguous framing.
    let (smuggle, _) = curl(&[
        "-i",
        "-X",
        "POST",
        &url,
        "-H",
        "Idempotency-Key: curl-2",
        "-H",
        "Content-Length: 5",
        "-H",
        "Transfer-Encoding: chunked",
        "--data-binary",
        "hello",
    ]);
    assert!(smuggle.starts_with("HTTP/1.1 400"), "{smuggle}");
    assert!(smuggle.contains("ambiguous"), "{smuggle}");
    assert_eq!(s.api.counts.of("curl-2"), 0);

    // Chunked upload of a 2 MB file, then two requests over one kept-alive connection.
    let file = s._dir.0.join("big.bin");
    std::fs::write(&file, vec![b'z'; 2_000_000]).unwrap();
    let (big, _) = curl(&[
        "-X",
        "POST",
        &url,
        "-H",
        "Idempotency-Key: curl-3",
        "-H",
        "Transfer-Encoding: chunked",
        "--data-binary",
        &format!("@{}", file.display()),
    ]);
    assert!(big.contains("\"body_bytes\":2000000"), "{big}");
    let (_, verbose) = curl(&["-v", "-o", "/dev/null", &url, "-o", "/dev/null", &url]);
    assert!(
        verbose.contains("Re-using existing connection") || verbose.contains("Reusing existing"),
        "{verbose}"
    );
}

const PY_CLIENT: &str = r#"
import json, sys
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

base = sys.argv[1]
retry = Retry(total=20, connect=5, read=5, status=15, backoff_factor=0.05, backoff_max=0.5,
              status_forcelist=[409, 502, 503, 504], allowed_methods=None,
              raise_on_status=False, respect_retry_after_header=False)
s = requests.Session()
s.mount("http://", HTTPAdapter(max_retries=retry))
out = {}
# 1. The upstream fails the first attempt (503): the proxy releases, urllib3 retries the POST
#    with the same Idempotency-Key, and it runs again, successfully.
r = s.post(base + "/v1/charges?fail_first=1", headers={"Idempotency-Key": "py-1"}, json={"amount": 5})
out["fail_then_ok"] = [r.status_code, r.headers.get("Idempotent-Replayed"), r.json()["count"]]
# 2. The client gives up on a slow answer (read timeout) and retries: the retries meet 409
#    while the first attempt is in flight, then the stored response.
r = s.post(base + "/v1/charges?delay_ms=1200", headers={"Idempotency-Key": "py-2"},
           json={"amount": 7}, timeout=(5, 0.4))
out["timeout_then_replay"] = [r.status_code, r.headers.get("Idempotent-Replayed"), r.json()["count"]]
# 3. A plain repeat is replayed.
r = s.post(base + "/v1/charges?fail_first=1", headers={"Idempotency-Key": "py-1"}, json={"amount": 5})
out["repeat"] = [r.status_code, r.headers.get("Idempotent-Replayed")]
print(json.dumps(out))
"#;

fn python_with_requests() -> Option<&'static str> {
    let has = |py: &str| {
        Command::new(py)
            .args(["-c", "import requests, urllib3"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if Command::new("python3").arg("--version").output().is_err() {
        return None;
    }
    if has("python3") {
        return Some("python3");
    }
    eprintln!("python3 lacks requests; trying pip install --user requests");
    let pip = [
        "-m",
        "pip",
        "install",
        "--quiet",
        "--user",
        "--timeout",
        "10",
        "--retries",
        "1",
    ];
    let _ = Command::new("python3").args(pip).arg("requests").status();
    if !has("python3") {
        // Debian's python3 refuses --user installs unless told (PEP 668).
        let _ = Command::new("python3")
            .args(pip)
            .args(["--break-system-packages", "requests"])
            .status();
    }
    has("python3").then_some("python3")
}

#[test]
fn python_requests_with_retries_runs_each_request_once() {
    let Some(py) = python_with_requests() else {
        eprintln!("SKIP: neither python3 with the requests package nor a way to install it");
        return;
    };
    let s = setup("proxy-python", &[]);
    let out = Command::new(py)
        .args(["-c", PY_CLIENT, &format!("http://{}", s.addr)])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["fail_then_ok"], serde_json::json!([201, null, 2]), "{v}");
    assert_eq!(
        v["timeout_then_replay"],
        serde_json::json!([201, "true", 1]),
        "{v}"
    );
    assert_eq!(v["repeat"], serde_json::json!([201, "true"]), "{v}");
    assert_eq!(
        s.api.counts.of("py-1"),
        2,
        "one failed attempt, one success, no more"
    );
    assert_eq!(
        s.api.counts.of("py-2"),
        1,
        "timed-out retries never ran it again"
    );
}

/// `--connections-max 0` was taken as 1 (one connection served at a time, silently): refused
/// with a message naming the flag, before anything starts.
#[test]
fn a_connection_limit_of_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("s").display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--store",
            &store,
        ])
        .args(["--listen", "127.0.0.1:0", "--connections-max", "0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A proxy that accepted the flag would serve until stopped.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the proxy started with --connections-max 0");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--connections-max"), "{err}");
    assert!(!dir.path().join("s").exists(), "nothing created");
}

/// A busy listen address is named in the error (it said only "Address already in use").
#[test]
fn a_busy_port_is_named() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--store",
            "memory:",
        ])
        .args(["--listen", &addr])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("{addr} is in use")), "{err}");
    assert!(err.contains("--listen"), "{err}");
}
