//! The HTTP load generator behind `dedupgate bench`: N keep-alive HTTP/1.1 connections, each
//! sending claims (one per request, or `ops_per_request` per batch) back to back for a fixed
//! time, with random keys `key:N` over a key space (as `redis-benchmark -r` does). It uses
//! hyper's connection API directly so the generator costs little CPU beside the server.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

/// Most latency samples kept per connection; later requests still count, unsampled.
const SAMPLES_PER_CONNECTION_MAX: usize = 2_000_000;

/// What to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// `POST /v1/claim`, one claim per request.
    Single,
    /// `POST /v1/batch` with this many claims per request.
    Batch {
        /// Claims per request.
        ops_per_request: usize,
    },
}

/// A load run.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// `http://host:port` of the server.
    pub server: String,
    /// Concurrent keep-alive connections, each with one request outstanding.
    pub connections: usize,
    /// How long to send.
    pub duration: Duration,
    /// Single claims or batches.
    pub mode: LoadMode,
    /// Namespace of the claims.
    pub namespace: String,
    /// Keys are `key:N` with N uniform in 0..keyspace.
    pub keyspace: u64,
    /// Bearer token, if the server wants one.
    pub bearer: Option<String>,
}

/// What a run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadReport {
    /// Requests answered 200.
    pub requests_ok: u64,
    /// Requests answered otherwise, or lost.
    pub requests_failed: u64,
    /// Claims decided (requests_ok × ops per request).
    pub ops: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Median request latency.
    pub p50: Duration,
    /// 99th percentile request latency.
    pub p99: Duration,
    /// Slowest request.
    pub max: Duration,
}

impl LoadReport {
    /// Claims per second.
    pub fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Requests per second.
    pub fn requests_per_s(&self) -> f64 {
        self.requests_ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The server URL is not `http://host:port`.
    #[error("bench needs an http://host:port server URL, got {0:?}")]
    Url(String),
    /// A connection could not be made.
    #[error("cannot connect to {addr}: {cause}")]
    Connect {
        /// The address.
        addr: String,
        /// Why (in the message, so not also the error's source).
        cause: std::io::Error,
    },
    /// The HTTP handshake failed.
    #[error("HTTP handshake failed: {0}")]
    Handshake(hyper::Error),
}

// By hand rather than `#[from]`: the message already holds the cause, so it is not also the
// error's source (a report walking the sources would say it twice).
impl From<hyper::Error> for LoadError {
    fn from(e: hyper::Error) -> Self {
        LoadError::Handshake(e)
    }
}

struct ConnStats {
    ok: u64,
    failed: u64,
    samples_us: Vec<u32>,
}

/// splitmix64: a fast, good-enough generator for picking keys.
struct KeyRng(u64);

impl KeyRng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn host_port(server: &str) -> Result<String, LoadError> {
    let rest = server
        .strip_prefix("http://")
        .ok_or_else(|| LoadError::Url(server.to_owned()))?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Err(LoadError::Url(server.to_owned()));
    }
    Ok(if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    })
}

fn body(mode: LoadMode, namespace: &str, keyspace: u64, rng: &mut KeyRng, buf: &mut String) {
    use std::fmt::Write;
    buf.clear();
    let keyspace = keyspace.max(1);
    match mode {
        LoadMode::Single => {
            let _ = write!(
                buf,
                r#"{{"namespace":"{namespace}","key":"key:{}","ttl_ms":86400000}}"#,
                rng.next() % keyspace
            );
        }
        LoadMode::Batch { ops_per_request } => {
            buf.push_str(r#"{"ops":["#);
            for i in 0..ops_per_request {
                if i > 0 {
                    buf.push(',');
                }
                let _ = write!(
                    buf,
                    r#"{{"op":"claim","namespace":"{namespace}","key":"key:{}","ttl_ms":86400000}}"#,
                    rng.next() % keyspace
                );
            }
            buf.push_str("]}");
        }
    }
}

async fn one_connection(
    config: LoadConfig,
    addr: String,
    seed: u64,
    deadline: Instant,
) -> Result<ConnStats, LoadError> {
    let stream = tokio::net::TcpStream::connect(&addr)
        .await
        .map_err(|cause| LoadError::Connect {
            addr: addr.clone(),
            cause,
        })?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let path = match config.mode {
        LoadMode::Single => "/v1/claim",
        LoadMode::Batch { .. } => "/v1/batch",
    };
    let auth = config.bearer.as_ref().map(|t| format!("Bearer {t}"));
    let mut rng = KeyRng(seed);
    let mut buf = String::with_capacity(128);
    let mut stats = ConnStats {
        ok: 0,
        failed: 0,
        samples_us: Vec::with_capacity(64 * 1024),
    };
    while Instant::now() < deadline {
        body(
            config.mode,
            &config.namespace,
            config.keyspace,
            &mut rng,
            &mut buf,
        );
        let mut request = Request::post(path)
            .header(hyper::header::HOST, addr.as_str())
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(a) = &auth {
            request = request.header(hyper::header::AUTHORIZATION, a.as_str());
        }
        let request = request
            .body(Full::new(Bytes::from(buf.clone())))
            .expect("a well-formed request");
        let started = Instant::now();
        if sender.ready().await.is_err() {
            stats.failed += 1;
            break;
        }
        match sender.send_request(request).await {
            Ok(response) => {
                let ok = response.status().is_success();
                let read = response.into_body().collect().await.is_ok();
                if ok && read {
                    stats.ok += 1;
                    if stats.samples_us.len() < SAMPLES_PER_CONNECTION_MAX {
                        let us = started.elapsed().as_micros().min(u32::MAX as u128) as u32;
                        stats.samples_us.push(us);
                    }
                } else {
                    stats.failed += 1;
                }
            }
            Err(_) => {
                stats.failed += 1;
                break;
            }
        }
    }
    Ok(stats)
}

fn percentile(sorted_us: &[u32], q: f64) -> Duration {
    if sorted_us.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted_us.len() as f64 - 1.0) * q).round() as usize;
    Duration::from_micros(u64::from(sorted_us[i.min(sorted_us.len() - 1)]))
}

/// Runs the load and reports claims/s and latencies.
pub async fn run(config: LoadConfig) -> Result<LoadReport, LoadError> {
    let addr = host_port(&config.server)?;
    let started = Instant::now();
    let deadline = started + config.duration;
    let seed_base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut tasks = Vec::with_capacity(config.connections);
    for i in 0..config.connections.max(1) {
        let seed = seed_base ^ ((i as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F));
        tasks.push(tokio::spawn(one_connection(
            config.clone(),
            addr.clone(),
            seed,
            deadline,
        )));
    }
    let mut ok = 0;
    let mut failed = 0;
    let mut samples = Vec::new();
    for task in tasks {
        match task.await {
            Ok(Ok(s)) => {
                ok += s.ok;
                failed += s.failed;
                samples.extend_from_slice(&s.samples_us);
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => failed += 1,
        }
    }
    let elapsed = started.elapsed();
    samples.sort_unstable();
    let per_request = match config.mode {
        LoadMode::Single => 1,
        LoadMode::Batch { ops_per_request } => ops_per_request as u64,
    };
    Ok(LoadReport {
        requests_ok: ok,
        requests_failed: failed,
        ops: ok * per_request,
        elapsed,
        p50: percentile(&samples, 0.50),
        p99: percentile(&samples, 0.99),
        max: samples
            .last()
            .map_or(Duration::ZERO, |&us| Duration::from_micros(u64::from(us))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_bodies() {
        assert_eq!(
            host_port("http://127.0.0.1:7878/").unwrap(),
            "127.0.0.1:7878"
        );
        assert_eq!(host_port("http://gate").unwrap(), "gate:80");
        assert!(host_port("https://gate").is_err());
        let mut buf = String::new();
        let mut rng = KeyRng(1);
        body(
            LoadMode::Batch { ops_per_request: 3 },
            "b",
            10,
            &mut rng,
            &mut buf,
        );
        let v: serde_json::Value = serde_json::from_str(&buf).unwrap();
        assert_eq!(v["ops"].as_array().unwrap().len(), 3);
        body(LoadMode::Single, "b", 10, &mut rng, &mut buf);
        let v: serde_json::Value = serde_json::from_str(&buf).unwrap();
        assert!(v["key"].as_str().unwrap().starts_with("key:"));
    }

    #[test]
    fn percentiles() {
        let s: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&s, 0.5), Duration::from_micros(51));
        assert_eq!(percentile(&s, 0.99), Duration::from_micros(99));
        assert_eq!(percentile(&[], 0.99), Duration::ZERO);
    }
}
