//! Shared by the `proxy_*` tests: the real `dedupgate proxy` process (killed on drop), the
//! sample API in process, and a plain HTTP/1.1 client over TCP.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dedupgate_proxy::sample::SampleApi;

/// A child process killed (SIGKILL) and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sample API on a free port, served by its own two-thread runtime (kept alive by the
/// returned runtime).
pub fn sample_api() -> (tokio::runtime::Runtime, SampleApi) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(async {
        SampleApi::spawn(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap()
    });
    (rt, api)
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `dedupgate proxy ARGS --listen 127.0.0.1:PORT` and waits until it accepts connections.
/// Its stderr goes to `log`.
pub fn start_proxy(port: u16, args: &[&str], log: &Path) -> Proc {
    try_start_proxy(port, args, log).unwrap_or_else(|e| panic!("{e}"))
}

/// Like [`start_proxy`], but an early exit is an `Err` carrying the log.
pub fn try_start_proxy(port: u16, args: &[&str], log: &Path) -> Result<Proc, String> {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .arg("proxy")
        .args(args)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn,dedupgate=info,dedupgate_proxy=info")
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("the dedupgate binary starts");
    let mut proc = Proc(child);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(proc);
        }
        if let Ok(Some(status)) = proc.0.try_wait() {
            return Err(format!(
                "dedupgate proxy exited with {status}: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        if Instant::now() > end {
            return Err(format!(
                "dedupgate proxy did not start: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A response as read off the wire.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// One request on its own connection (`Connection: close`). `None` when the connection fails or
/// closes before a whole response arrives.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<Reply> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    parse(&raw)
}

/// `POST path` with `Idempotency-Key: key` and the JSON body `{"order":"key"}`.
pub fn post_order(addr: SocketAddr, path: &str, key: &str) -> Option<Reply> {
    let body = format!("{{\"order\":\"{key}\"}}");
    http(
        addr,
        "POST",
        path,
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body.as_bytes(),
    )
}

fn parse(raw: &[u8]) -> Option<Reply> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = raw[end + 4..].to_vec();
    let len = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok());
    if len.is_some_and(|l| l != body.len()) {
        return None;
    }
    Some(Reply {
        status,
        headers,
        body,
    })
}

/// A fresh scratch directory under the system temp dir, removed on drop.
pub struct Scratch(pub std::path::PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let p =
            std::env::temp_dir().join(format!("dedupgate-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
