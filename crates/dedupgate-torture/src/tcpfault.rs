//! A TCP fault proxy the tests own: it listens on a free loopback port, forwards every
//! connection to one upstream (Redis, PostgreSQL, a gate) and, at random with a seed or on
//! command, delays traffic, cuts connections (RST on both sides) and truncates them (forwards
//! part of a buffer, then closes both sides). Every fault it fires is counted in
//! [`TcpFaultCounts`], so a run proves that its faults happened.
//!
//! Point a store at it with [`route_through`], which rewrites the host and port of a
//! `redis://` or `postgres://` URL.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to each buffer it forwards, at random (per mille, so rare faults can be
/// set finely). The choices are drawn from a generator seeded per connection from the proxy's
/// seed; the operating system's buffering is not replayed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpFaultPlan {
    /// Per mille of buffers held back before they are forwarded.
    pub delay_permille: u32,
    /// How long a delayed buffer is held, ms (uniform in the range).
    pub delay_ms: (u64, u64),
    /// Per mille of buffers after which the connection is cut (RST both sides, nothing sent).
    pub cut_permille: u32,
    /// Per mille of buffers of which only a part is forwarded, then both sides closed.
    pub truncate_permille: u32,
}

impl TcpFaultPlan {
    /// No faults: a plain forwarder.
    pub fn off() -> Self {
        Self::default()
    }

    /// A plan that fires every kind often enough for a short run to see each many times.
    pub fn ci() -> Self {
        Self {
            delay_permille: 60,
            delay_ms: (1, 60),
            cut_permille: 8,
            truncate_permille: 8,
        }
    }

    fn is_off(&self) -> bool {
        self.delay_permille == 0 && self.cut_permille == 0 && self.truncate_permille == 0
    }
}

/// Faults fired and traffic seen, by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpFaultCounts {
    /// Client connections accepted.
    pub connections: u64,
    /// Connections refused because the upstream did not accept (it was down).
    pub upstream_refused: u64,
    /// Buffers forwarded (either way).
    pub buffers: u64,
    /// Buffers delayed.
    pub delays: u64,
    /// Connections cut at random (RST both sides).
    pub cuts: u64,
    /// Connections cut on command ([`TcpFaultProxy::cut_all`]).
    pub commanded_cuts: u64,
    /// Connections truncated (part of a buffer forwarded, then closed).
    pub truncations: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    upstream_refused: AtomicU64,
    buffers: AtomicU64,
    delays: AtomicU64,
    cuts: AtomicU64,
    commanded_cuts: AtomicU64,
    truncations: AtomicU64,
}

struct Inner {
    upstream: SocketAddr,
    plan: Mutex<TcpFaultPlan>,
    counters: Counters,
    seed: u64,
    /// Bumped by every `cut_all`; each connection watches it.
    cut_gen: watch::Sender<u64>,
    stopped: AtomicBool,
}

/// The proxy: runs on the current tokio runtime until dropped.
pub struct TcpFaultProxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    accept: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for TcpFaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.inner.upstream)
            .finish()
    }
}

/// What a direction's read or a command produced.
enum Step {
    Data(usize, bool),
    Closed,
    Cut,
}

impl TcpFaultProxy {
    /// Starts a proxy to `upstream` on a free loopback port, with `plan` and `seed`.
    pub async fn start(
        upstream: SocketAddr,
        plan: TcpFaultPlan,
        seed: u64,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            upstream,
            plan: Mutex::new(plan),
            counters: Counters::default(),
            seed,
            cut_gen: watch::channel(0).0,
            stopped: AtomicBool::new(false),
        });
        let accept = tokio::spawn(accept_loop(listener, inner.clone()));
        Ok(Self {
            addr,
            inner,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Replaces the random plan (for instance [`TcpFaultPlan::off`] once the faults stop).
    pub fn set_plan(&self, plan: TcpFaultPlan) {
        *self.inner.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
    }

    /// Cuts every open connection now (RST both sides); counted per connection cut.
    pub fn cut_all(&self) {
        self.inner.cut_gen.send_modify(|g| *g += 1);
    }

    /// Faults fired so far.
    pub fn counts(&self) -> TcpFaultCounts {
        let c = &self.inner.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TcpFaultCounts {
            connections: n(&c.connections),
            upstream_refused: n(&c.upstream_refused),
            buffers: n(&c.buffers),
            delays: n(&c.delays),
            cuts: n(&c.cuts),
            commanded_cuts: n(&c.commanded_cuts),
            truncations: n(&c.truncations),
        }
    }
}

impl Drop for TcpFaultProxy {
    fn drop(&mut self) {
        self.inner.stopped.store(true, Ordering::Relaxed);
        self.accept.abort();
        // Open connections end too.
        self.cut_all();
    }
}

async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    let mut conn_no = 0u64;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        conn_no += 1;
        inner.counters.connections.fetch_add(1, Ordering::Relaxed);
        let inner = inner.clone();
        let rng = StdRng::seed_from_u64(inner.seed ^ conn_no.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        tokio::spawn(async move {
            let upstream = match TcpStream::connect(inner.upstream).await {
                Ok(s) => s,
                Err(_) => {
                    inner
                        .counters
                        .upstream_refused
                        .fetch_add(1, Ordering::Relaxed);
                    rst(&client);
                    return;
                }
            };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            pump(client, upstream, inner, rng).await;
        });
    }
}

/// Sets SO_LINGER 0 so the close that follows sends RST instead of FIN.
fn rst(s: &TcpStream) {
    let _ = s.set_zero_linger();
}

/// Forwards both ways until either side closes, a fault ends the connection, or a command cuts
/// it. One task owns both sockets, so a cut resets both at once.
async fn pump(mut client: TcpStream, mut upstream: TcpStream, inner: Arc<Inner>, mut rng: StdRng) {
    let mut cut_rx = inner.cut_gen.subscribe();
    cut_rx.mark_unchanged();
    let mut a = vec![0u8; 16 * 1024];
    let mut b = vec![0u8; 16 * 1024];
    loop {
        if inner.stopped.load(Ordering::Relaxed) {
            break;
        }
        // `read` on a TcpStream is cancel-safe: a losing branch loses no bytes.
        let step = tokio::select! {
            r = client.read(&mut a) => match r { Ok(0) | Err(_) => Step::Closed, Ok(n) => Step::Data(n, true) },
            r = upstream.read(&mut b) => match r { Ok(0) | Err(_) => Step::Closed, Ok(n) => Step::Data(n, false) },
            c = cut_rx.changed() => match c { Ok(()) => Step::Cut, Err(_) => Step::Closed },
        };
        let (n, to_upstream) = match step {
            Step::Closed => break,
            Step::Cut => {
                inner
                    .counters
                    .commanded_cuts
                    .fetch_add(1, Ordering::Relaxed);
                rst(&client);
                rst(&upstream);
                return;
            }
            Step::Data(n, up) => (n, up),
        };
        inner.counters.buffers.fetch_add(1, Ordering::Relaxed);
        let plan = inner.plan.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (buf, dst) = if to_upstream {
            (&a[..n], &mut upstream)
        } else {
            (&b[..n], &mut client)
        };
        if !plan.is_off() {
            let roll = rng.gen_range(0..1000u32);
            if roll < plan.cut_permille {
                inner.counters.cuts.fetch_add(1, Ordering::Relaxed);
                rst(&client);
                rst(&upstream);
                return;
            }
            if roll < plan.cut_permille + plan.truncate_permille {
                inner.counters.truncations.fetch_add(1, Ordering::Relaxed);
                let part = if n > 1 { rng.gen_range(1..n) } else { 0 };
                let _ = dst.write_all(&buf[..part]).await;
                let _ = dst.flush().await;
                // A plain close (FIN) on both sides after a partial buffer.
                return;
            }
            if roll < plan.cut_permille + plan.truncate_permille + plan.delay_permille {
                inner.counters.delays.fetch_add(1, Ordering::Relaxed);
                let (lo, hi) = plan.delay_ms;
                let ms = rng.gen_range(lo..=hi.max(lo));
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        if dst.write_all(buf).await.is_err() {
            break;
        }
    }
}

/// Why a URL could not be routed through the proxy.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// No `scheme://` in it.
    #[error("not a URL with a host: {0}")]
    NoHost(String),
    /// Host and port did not resolve to a socket address.
    #[error("{0}: host and port must be an IP address and a port (127.0.0.1:6379)")]
    Address(String),
}

/// For a `redis://…` or `postgres://…` URL: the upstream address it names (its default port
/// when it names none) and the same URL pointed at `127.0.0.1:proxy_port` instead.
pub fn route_through(url: &str, proxy_port: u16) -> Result<(SocketAddr, String), RouteError> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| RouteError::NoHost(url.to_owned()))?;
    let default_port = match scheme {
        s if s.starts_with("redis") => 6379,
        s if s.starts_with("postgres") => 5432,
        _ => 80,
    };
    let auth_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:{default_port}")
    };
    let hostport = hostport.replace("localhost", "127.0.0.1");
    let upstream: SocketAddr = hostport
        .parse()
        .map_err(|_| RouteError::Address(url.to_owned()))?;
    let user = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    Ok((
        upstream,
        format!("{scheme}://{user}127.0.0.1:{proxy_port}{tail}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_routed_through_the_proxy() {
        let (up, url) = route_through("postgres://postgres@127.0.0.1:5432/test", 4000).unwrap();
        assert_eq!(up, "127.0.0.1:5432".parse().unwrap());
        assert_eq!(url, "postgres://postgres@127.0.0.1:4000/test");
        let (up, url) = route_through("redis://localhost?wait_replicas=1", 4001).unwrap();
        assert_eq!(up, "127.0.0.1:6379".parse().unwrap());
        assert_eq!(url, "redis://127.0.0.1:4001?wait_replicas=1");
        assert!(route_through("memory:", 1).is_err());
    }

    /// An echo server behind the proxy: bytes pass unchanged with faults off, and each fault kind
    /// fires and is counted when the plan asks for it.
    #[tokio::test]
    async fn the_proxy_forwards_and_fires_each_fault() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = TcpFaultProxy::start(echo_addr, TcpFaultPlan::off(), 7)
            .await
            .unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");

        // A commanded cut: the client sees its connection end.
        proxy.cut_all();
        let mut one = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), c.read(&mut one))
            .await
            .expect("the cut ends the connection");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        assert_eq!(proxy.counts().commanded_cuts, 1);

        // Every buffer cut, then every buffer truncated, then every buffer delayed.
        for (plan, what) in [
            (
                TcpFaultPlan {
                    cut_permille: 1000,
                    ..TcpFaultPlan::off()
                },
                "cut",
            ),
            (
                TcpFaultPlan {
                    truncate_permille: 1000,
                    ..TcpFaultPlan::off()
                },
                "truncate",
            ),
            (
                TcpFaultPlan {
                    delay_permille: 1000,
                    delay_ms: (1, 2),
                    ..TcpFaultPlan::off()
                },
                "delay",
            ),
        ] {
            proxy.set_plan(plan);
            let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
            c.write_all(b"0123456789").await.unwrap();
            let mut got = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                let mut buf = [0u8; 64];
                while let Ok(n) = c.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.len() >= 10 {
                        break;
                    }
                }
            })
            .await;
            match what {
                "cut" => assert!(got.is_empty(), "{got:?}"),
                "truncate" => assert!(got.len() < 10, "{got:?}"),
                _ => assert_eq!(got, b"0123456789"),
            }
        }
        let n = proxy.counts();
        assert_eq!((n.cuts, n.truncations), (1, 1), "{n:?}");
        assert!(n.delays >= 2, "{n:?}");
    }
}
