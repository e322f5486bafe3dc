//! The Idempotency-Key proxy (`dedupgate proxy --upstream URL`) as a torture workload. The
//! harness owns the upstream ([`Upstream`]): every request that reaches it is an execution,
//! appended to the effect ledger (fsync'd) before it answers `201` with a body naming the
//! attempt. Workers send `POST /effect/NS/KEY` with `Idempotency-Key: KEY` through the proxy,
//! and log every request and response (`px-<worker>.jsonl`); the orchestrator SIGKILLs the
//! proxy and workers at random. [`check`] judges, per event:
//!
//! - **I1**: a second execution is a duplicate when an earlier attempt was answered a fresh
//!   (not replayed) 2xx, or when it started before the earlier attempt's lease could have
//!   ended (the earlier request was sent at `start`, so its claim's lease ran to at least
//!   `start + lease`); otherwise it is a re-execution the ordering allows (the proxy was killed
//!   between the upstream's answer and storing it), counted.
//! - **I2**: after faults stop and leases run out, every event has an execution and the final
//!   request is answered with a replayed 2xx.
//! - **I4**: the final replay is the fresh answer an attempt acknowledged, if any.
//! - **I5**: every replayed 2xx is the final stored answer, byte for byte.
//!
//! A request without a response (killed, timed out, connection cut) is unknown.
//!
//! The proxy does not pass a fence upstream, so the upstream cannot refuse a late write: these
//! checks rest on times and answers only.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::delivery::Delivery;
use crate::history::wall_ns;
use crate::ledger::{Effect, JsonlLog, Sink};
use crate::oracle::OracleReport;

/// The upstream the harness owns: an HTTP/1.1 server on a loopback port whose every request is
/// one execution recorded in the effect ledger. Stops when dropped.
pub struct Upstream {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    /// Starts it, writing executions to `run_dir`'s ledger.
    pub async fn start(run_dir: &Path) -> io::Result<Self> {
        let sink = Arc::new(Sink::open(run_dir)?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let sink = sink.clone();
                tokio::spawn(async move {
                    let _ = serve_conn(s, sink).await;
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Reads one request head (up to the blank line); None at a clean end of the connection.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Option<Vec<u8>>> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = buf[..i + 4].to_vec();
            buf.drain(..i + 4);
            return Ok(Some(head));
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            return Err(io::Error::other("request head too large"));
        }
    }
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

async fn serve_conn(mut s: TcpStream, sink: Arc<Sink>) -> io::Result<()> {
    let mut buf = Vec::new();
    while let Some(head) = read_head(&mut s, &mut buf).await? {
        let head = String::from_utf8_lossy(&head).into_owned();
        let len: usize = header(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < len {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        buf.drain(..len);
        let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let attempt = header(&head, "x-torture-attempt").unwrap_or("?").to_owned();
        let worker = header(&head, "x-torture-worker").unwrap_or("?").to_owned();
        let (status, body) = match path
            .strip_prefix("/effect/")
            .and_then(|r| r.split_once('/'))
        {
            Some((ns, key)) => {
                let (ns, key, sink) = (ns.to_owned(), key.to_owned(), sink.clone());
                let att = attempt.clone();
                // The execution is on disk before the upstream answers.
                tokio::task::spawn_blocking(move || sink.write(&ns, &key, 0, &att, &worker, None))
                    .await
                    .map_err(io::Error::other)??;
                // A little work after the effect: a proxy kill can land before it stores the answer.
                tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u8>() % 6)))
                    .await;
                (
                    "201 Created",
                    serde_json::json!({"attempt": attempt, "executed_at_ns": wall_ns()})
                        .to_string(),
                )
            }
            None => ("404 Not Found", "{}".to_owned()),
        };
        let resp = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).await?;
        if header(&head, "connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) {
            break;
        }
    }
    Ok(())
}

/// How a worker reaches the proxy (part of its process arguments).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProxyPlan {
    /// `http://127.0.0.1:PORT` of `dedupgate proxy`.
    pub url: String,
    /// A request without a response after this long is unknown.
    pub timeout_ms: u64,
}

/// One line of a proxy-face log.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum PxLine {
    /// About to send.
    Start {
        /// Attempt id (sent as `x-torture-attempt`).
        attempt: String,
        /// The delivery.
        delivery: Delivery,
        /// Wall-clock ns.
        at_ns: u64,
    },
    /// The response.
    End {
        /// Attempt id.
        attempt: String,
        /// Status; None when no response came (unknown).
        status: Option<u16>,
        /// `Idempotent-Replayed: true`.
        replayed: bool,
        /// Body.
        body: String,
        /// Wall-clock ns.
        at_ns: u64,
    },
}

/// A proxy-face log, one line per `write(2)`.
#[derive(Debug)]
pub struct PxLog {
    file: JsonlLog,
}

impl PxLog {
    /// Creates `px-<worker>.jsonl` in `run_dir`.
    pub fn create(run_dir: &Path, worker: &str) -> io::Result<Self> {
        Ok(Self {
            file: JsonlLog::create(run_dir, "px", worker)?,
        })
    }

    fn line(&mut self, l: &PxLine) -> io::Result<()> {
        self.file.line(l)
    }
}

/// A parsed response.
struct Resp {
    status: u16,
    replayed: bool,
    body: String,
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&b[..i])
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        )
        .unwrap_or(0);
        b = &b[i + 2..];
        if size == 0 || b.len() < size {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or(&[]);
    }
    out
}

async fn request(
    url: &str,
    path: &str,
    key: &str,
    attempt: &str,
    worker: &str,
) -> io::Result<Resp> {
    let authority = url.trim_start_matches("http://").trim_end_matches('/');
    let mut s = TcpStream::connect(authority).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: {authority}\r\nidempotency-key: {key}\r\nx-torture-attempt: {attempt}\r\nx-torture-worker: {worker}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let i = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| io::Error::other("no complete response head"))?;
    let head = String::from_utf8_lossy(&raw[..i]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other("no status"))?;
    let mut body = raw[i + 4..].to_vec();
    if header(&head, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        body = dechunk(&body);
    } else if let Some(len) = header(&head, "content-length").and_then(|v| v.parse::<usize>().ok())
    {
        if body.len() < len {
            return Err(io::Error::other("response body cut short"));
        }
        body.truncate(len);
    }
    Ok(Resp {
        status,
        replayed: header(&head, "idempotent-replayed").is_some_and(|v| v == "true"),
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Sends one delivery through the proxy; returns true when the event was in flight elsewhere
/// (409: worth another delivery later).
pub async fn deliver(
    plan: &ProxyPlan,
    log: &mut PxLog,
    worker: &str,
    attempt: &str,
    d: &Delivery,
) -> io::Result<bool> {
    log.line(&PxLine::Start {
        attempt: attempt.to_owned(),
        delivery: d.clone(),
        at_ns: wall_ns(),
    })?;
    let path = format!("/effect/{}/{}", d.namespace, d.key);
    let r = tokio::time::timeout(
        Duration::from_millis(plan.timeout_ms),
        request(&plan.url, &path, &d.key, attempt, worker),
    )
    .await;
    let (status, replayed, body) = match r {
        Ok(Ok(r)) => (Some(r.status), r.replayed, r.body),
        Ok(Err(e)) => (None, false, e.to_string()),
        Err(_) => (None, false, "timed out".into()),
    };
    log.line(&PxLine::End {
        attempt: attempt.to_owned(),
        status,
        replayed,
        body,
        at_ns: wall_ns(),
    })?;
    Ok(status == Some(409))
}

/// Every line of every proxy-face log of a run, with the writer's name.
pub fn read_px_logs(run_dir: &Path) -> io::Result<Vec<(String, PxLine)>> {
    let mut out = Vec::new();
    let names = JsonlLog::list(run_dir, "px")?;
    for p in names {
        let who = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("")
            .trim_start_matches("px-")
            .to_owned();
        let text = std::fs::read_to_string(&p)?;
        out.extend(
            text.lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .map(|l| (who.clone(), l)),
        );
    }
    Ok(out)
}

#[derive(Debug, Default, Clone)]
struct Req {
    delivery: Option<Delivery>,
    who: String,
    start_ns: u64,
    end_ns: u64,
    status: Option<u16>,
    replayed: bool,
    body: String,
}

impl Req {
    fn fresh_ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s)) && !self.replayed
    }
    fn replay_ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s)) && self.replayed
    }
}

/// Requests and their answers in a proxy run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProxyCounts {
    /// Requests sent.
    pub requests: u64,
    /// Answered with a fresh 2xx (executed and stored).
    pub fresh: u64,
    /// Answered with a replayed 2xx.
    pub replayed: u64,
    /// Answered 409 (in flight elsewhere).
    pub in_flight: u64,
    /// Answered 5xx (503: store unavailable).
    pub server_errors: u64,
    /// No answer (killed, cut, timed out).
    pub unknown: u64,
    /// Other statuses (none expected).
    pub wrong: Vec<String>,
}

/// Checks I1, I2, I4, I5 of a proxy run (see the module doc). `final_who` names the log of the
/// final requests (sent after the drain, one per event).
pub fn check(
    effects: &[Effect],
    lines: &[(String, PxLine)],
    deliveries: &BTreeSet<Delivery>,
    lease_ms: u64,
    final_who: &str,
) -> (OracleReport, ProxyCounts) {
    let mut reqs: BTreeMap<String, Req> = BTreeMap::new();
    for (who, l) in lines {
        match l {
            PxLine::Start {
                attempt,
                delivery,
                at_ns,
            } => {
                let r = reqs.entry(attempt.clone()).or_default();
                r.delivery = Some(delivery.clone());
                r.who = who.clone();
                r.start_ns = *at_ns;
            }
            PxLine::End {
                attempt,
                status,
                replayed,
                body,
                at_ns,
            } => {
                let r = reqs.entry(attempt.clone()).or_default();
                r.status = *status;
                r.replayed = *replayed;
                r.body = body.clone();
                r.end_ns = *at_ns;
            }
        }
    }
    let mut c = ProxyCounts::default();
    let mut o = OracleReport::default();
    type Id = (String, String);
    let mut by_key: HashMap<Id, Vec<(&String, &Req)>> = HashMap::new();
    for (att, r) in &reqs {
        let Some(d) = &r.delivery else { continue };
        c.requests += 1;
        o.answers_read += 1;
        match r.status {
            None => {
                c.unknown += 1;
                o.answers_unknown += 1;
            }
            Some(_) if r.fresh_ok() => c.fresh += 1,
            Some(_) if r.replay_ok() => c.replayed += 1,
            Some(409) => c.in_flight += 1,
            Some(s) if s >= 500 => {
                c.server_errors += 1;
                o.answers_unknown += 1;
            }
            Some(s) => c.wrong.push(format!(
                "{}/{} {att}: status {s}: {}",
                d.namespace, d.key, r.body
            )),
        }
        by_key
            .entry((d.namespace.clone(), d.key.clone()))
            .or_default()
            .push((att, r));
    }
    let ids: BTreeSet<Id> = deliveries
        .iter()
        .map(|d| (d.namespace.clone(), d.key.clone()))
        .collect();
    o.events_checked = ids.len() as u64;
    let mut fx_by_key: BTreeMap<Id, Vec<&Effect>> = BTreeMap::new();
    for f in effects {
        o.effects_accepted += 1;
        fx_by_key
            .entry((f.namespace.clone(), f.key.clone()))
            .or_default()
            .push(f);
    }
    let lease_ns = lease_ms * 1_000_000;
    for id in &ids {
        let label = format!("{}/{}", id.0, id.1);
        let mut fx = fx_by_key.get(id).cloned().unwrap_or_default();
        fx.sort_by_key(|f| f.effect_ns);
        let rs = by_key.get(id).cloned().unwrap_or_default();
        let fresh: Vec<&(&String, &Req)> = rs.iter().filter(|(_, r)| r.fresh_ok()).collect();
        for f in &fx {
            if reqs.get(&f.attempt).is_none_or(|r| r.status.is_none()) {
                o.effects_without_completion_answer += 1;
            }
        }
        // I1.
        for pair in fx.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let a_req = reqs.get(&a.attempt);
            let why = if a.attempt == b.attempt {
                Some(format!("{} executed twice", a.attempt))
            } else if a_req.is_some_and(Req::fresh_ok) {
                Some(format!(
                    "{} executed after {}'s fresh 2xx",
                    b.attempt, a.attempt
                ))
            } else if a_req.is_some_and(|r| b.effect_ns < r.start_ns + lease_ns) {
                Some(format!(
                    "{} executed {} ms after {} was sent, inside its lease ({lease_ms} ms)",
                    b.attempt,
                    (b.effect_ns - a_req.map_or(0, |r| r.start_ns)) / 1_000_000,
                    a.attempt
                ))
            } else {
                None
            };
            match why {
                Some(w) => o.duplicates.push(format!("{label}: {w}")),
                None => o.reexecutions += 1,
            }
        }
        if fresh.len() > 1 {
            o.fence_violations.push(format!(
                "{label}: {} fresh 2xx answers ({:?})",
                fresh.len(),
                fresh.iter().map(|(a, _)| a).collect::<Vec<_>>()
            ));
        }
        // I2 and I4: the final request is a replay of what was acknowledged.
        let last = rs
            .iter()
            .filter(|(_, r)| r.who == final_who)
            .max_by_key(|(_, r)| r.start_ns);
        let Some((_, last)) = last else {
            o.lost.push(format!("{label}: no final request"));
            continue;
        };
        if fx.is_empty() {
            o.lost.push(format!("{label}: never executed"));
        }
        if !last.replay_ok() {
            o.lost.push(format!(
                "{label}: the final request got {:?} (replayed {}): {}",
                last.status, last.replayed, last.body
            ));
            continue;
        }
        if let Some((att, r)) = fresh.first() {
            if r.body != last.body {
                o.lost.push(format!(
                    "{label}: {att} was answered {:?}, the final replay is {:?}",
                    r.body, last.body
                ));
            }
        }
        // I5.
        for (att, r) in &rs {
            if r.replay_ok() && r.body != last.body {
                o.replay_mismatches.push(format!(
                    "{label}: {att} was replayed {:?}, stored {:?}",
                    r.body, last.body
                ));
            }
        }
    }
    (o, c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::DeliveryMode;

    fn d() -> Delivery {
        Delivery {
            mode: DeliveryMode::Retriable,
            namespace: "ns".into(),
            key: "k".into(),
        }
    }

    fn req(
        who: &str,
        att: &str,
        start_ms: u64,
        status: Option<u16>,
        replayed: bool,
        body: &str,
    ) -> Vec<(String, PxLine)> {
        vec![
            (
                who.into(),
                PxLine::Start {
                    attempt: att.into(),
                    delivery: d(),
                    at_ns: start_ms * 1_000_000,
                },
            ),
            (
                who.into(),
                PxLine::End {
                    attempt: att.into(),
                    status,
                    replayed,
                    body: body.into(),
                    at_ns: start_ms * 1_000_000 + 1,
                },
            ),
        ]
    }

    fn fx(att: &str, at_ms: u64) -> Effect {
        Effect {
            namespace: "ns".into(),
            key: "k".into(),
            fence: 0,
            attempt: att.into(),
            worker: "w".into(),
            effect_ns: at_ms * 1_000_000,
            lease_expires_at_ms: None,
            accepted: true,
            fence_before: 0,
        }
    }

    fn run(lines: Vec<(String, PxLine)>, effects: &[Effect]) -> OracleReport {
        check(effects, &lines, &[d()].into(), 300, "final").0
    }

    #[test]
    fn the_upstream_records_each_execution_and_a_request_parses_its_answer() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let up = Upstream::start(dir.path()).await.unwrap();
            let r = request(&up.url(), "/effect/ns/k", "k", "a#1", "w")
                .await
                .unwrap();
            assert_eq!(r.status, 201);
            assert!(r.body.contains("\"attempt\":\"a#1\""), "{}", r.body);
        });
        let ledger = crate::ledger::read_ledger(dir.path()).unwrap();
        assert_eq!(ledger.len(), 1);
        assert_eq!(
            (ledger[0].key.as_str(), ledger[0].attempt.as_str()),
            ("k", "a#1")
        );
    }

    #[test]
    fn a_clean_history_passes_and_a_re_execution_after_the_lease_is_counted() {
        let mut l = req("w1", "a", 0, None, false, "");
        l.extend(req("w2", "b", 1000, Some(201), false, "B"));
        l.extend(req("final", "f", 5000, Some(201), true, "B"));
        let r = run(l, &[fx("a", 5), fx("b", 1005)]);
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.reexecutions, 1);
    }

    #[test]
    fn executions_after_a_fresh_answer_or_inside_a_lease_are_duplicates() {
        let mut l = req("w1", "a", 0, Some(201), false, "A");
        l.extend(req("w2", "b", 1000, Some(201), false, "B"));
        l.extend(req("final", "f", 5000, Some(201), true, "B"));
        let r = run(l, &[fx("a", 5), fx("b", 1005)]);
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
        // a's fresh answer is not the stored one.
        assert_eq!(r.lost.len(), 1, "{r:?}");

        let mut l = req("w1", "a", 0, None, false, "");
        l.extend(req("w2", "b", 100, Some(201), false, "B"));
        l.extend(req("final", "f", 5000, Some(201), true, "B"));
        let r = run(l, &[fx("a", 5), fx("b", 105)]);
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
    }

    #[test]
    fn a_replay_that_differs_from_the_stored_answer_is_caught() {
        let mut l = req("w1", "a", 0, Some(201), false, "A");
        l.extend(req("w2", "b", 100, Some(201), true, "X"));
        l.extend(req("final", "f", 5000, Some(201), true, "A"));
        let r = run(l, &[fx("a", 5)]);
        assert_eq!(r.replay_mismatches.len(), 1, "{r:?}");
    }
}
