//! Helpers of the black-box HTTP tests: spawn the real `dedupgate serve` on a free port and talk
//! to it over real TCP with a deliberately tiny HTTP/1.1 client (so malformed requests, partial
//! bodies and raw headers can be sent exactly as written).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running `dedupgate serve`, killed (SIGKILL) on drop.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    /// Everything the server wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

/// Starts `dedupgate serve --listen 127.0.0.1:0 ARGS…` and waits for its start-up line.
pub fn serve(args: &[&str]) -> Server {
    serve_env(args, &[])
}

/// Like [`serve`], with extra environment variables.
pub fn serve_env(args: &[&str], env: &[(&str, &str)]) -> Server {
    try_serve(args, env).unwrap_or_else(|e| panic!("server did not start: {e}"))
}

/// Starts a server; Err with its log when it exits or never says where it listens.
pub fn try_serve(args: &[&str], env: &[(&str, &str)]) -> Result<Server, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
    cmd.arg("serve");
    if !args.contains(&"--listen") {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("DEDUPGATE_STORE")
        .env_remove("DEDUPGATE_LISTEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let stderr = child.stderr.take().expect("piped stderr");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                {
                    // Logged before the address is announced, so the start line is in the log.
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
                if !sent {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        if let Ok(addr) = rest.split_whitespace().next().unwrap_or("").parse() {
                            let _ = tx.send(addr);
                            sent = true;
                        }
                    }
                }
            }
        });
    }
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(addr) => Ok(Server { child, addr, log }),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            std::thread::sleep(Duration::from_millis(100));
            let log = log.lock().unwrap().clone();
            Err(format!("no start-up line; log:\n{log}"))
        }
    }
}

impl Server {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sends SIGTERM and waits (at most 30 s) for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        self.wait_exit()
    }

    /// Waits (at most 30 s) for the process to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, no goodbye.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn post(&self, path: &str, body: &str) -> Resp {
        request(self.addr, "POST", path, &[], body.as_bytes())
    }

    pub fn post_json(&self, path: &str, body: &Value) -> Resp {
        self.post(path, &body.to_string())
    }

    pub fn get(&self, path: &str) -> Resp {
        request(self.addr, "GET", path, &[], b"")
    }

    pub fn delete(&self, path: &str) -> Resp {
        request(self.addr, "DELETE", path, &[], b"")
    }

    /// The record of (namespace, key) as GET /v1/record shows it, or None on 404.
    pub fn record(&self, namespace: &str, key: &str) -> Option<Value> {
        let r = self.get(&format!(
            "/v1/record?namespace={}&key={}",
            enc(namespace),
            enc(key)
        ));
        match r.status {
            200 => Some(r.json()),
            404 => None,
            s => panic!("GET record answered {s}: {}", r.text()),
        }
    }

    /// The value of a metric line that starts with `prefix` (labels included), summed.
    pub fn metric(&self, prefix: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An answer.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("answer is not JSON ({e}): {}", self.text()))
    }

    /// Asserts a problem JSON answer with this status and code.
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "body: {}",
            self.text()
        );
        let v = self.json();
        assert_eq!(v["code"], code, "{v}");
        assert_eq!(v["status"], status, "{v}");
        assert!(v["title"].is_string() && v["detail"].is_string(), "{v}");
    }
}

/// One request on a fresh connection (`Connection: close`), the answer read to the end.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    try_request(addr, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Like [`request`], but a connection that fails or closes early is an error, not a panic.
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    // The server may answer (413) and close before it has read a huge body: ignore write errors.
    let _ = s.write_all(body);
    try_read_response(&mut s)
}

/// Reads one HTTP/1.1 answer (Content-Length or read-to-close).
pub fn read_response(s: &mut TcpStream) -> Resp {
    try_read_response(s).unwrap_or_else(|e| panic!("reading the answer: {e}"))
}

fn closed(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what.to_owned())
}

/// Reads one answer; an early close is an error.
pub fn try_read_response(s: &mut TcpStream) -> std::io::Result<Resp> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let header_end = loop {
        if let Some(i) = find(&raw, b"\r\n\r\n") {
            break i;
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(closed("connection closed before an answer"));
        }
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..header_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| closed("no status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[header_end + 4..].to_vec();
    let len = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok());
    match len {
        Some(len) => {
            while body.len() < len {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    return Err(closed("connection closed mid-body"));
                }
                body.extend_from_slice(&buf[..n]);
            }
            body.truncate(len);
        }
        None => {
            s.read_to_end(&mut body)?;
        }
    }
    Ok(Resp {
        status,
        headers,
        body,
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Polls `f` until it is true (at most `secs` seconds); panics with `what` otherwise.
pub fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh directory under the target dir, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let dir = base.join(format!(
            "{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
