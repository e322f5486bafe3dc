//! A proxy in process in front of the sample API, on real sockets, and small clients.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedupgate_core::{MemoryStore, Store};
use dedupgate_proxy::sample::SampleApi;
use dedupgate_proxy::{IdempotencyConfig, ProxyConfig, ProxyServer, UpstreamConfig};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct Harness {
    pub api: SampleApi,
    pub proxy: SocketAddr,
    pub store: Arc<MemoryStore>,
    pub client: Client<HttpConnector, Full<Bytes>>,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<Result<(), dedupgate_proxy::ServeError>>,
}

pub async fn start(config: IdempotencyConfig) -> Harness {
    start_with(config, |_| {}).await
}

pub async fn start_with(
    config: IdempotencyConfig,
    tweak: impl FnOnce(&mut ProxyConfig),
) -> Harness {
    let api = SampleApi::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let store = Arc::new(MemoryStore::new());
    let mut pc = ProxyConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        UpstreamConfig::new(api.url()),
    );
    pc.idempotency = config;
    tweak(&mut pc);
    let server = ProxyServer::bind(pc, store.clone() as Arc<dyn Store>)
        .await
        .unwrap();
    let proxy = server.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Harness {
        api,
        proxy,
        store,
        client: Client::builder(TokioExecutor::new()).build_http(),
        stop: tx,
        run,
    }
}

#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
}

impl Harness {
    /// Asks the proxy to shut down and waits until `run` returns.
    pub async fn shutdown(self) -> Arc<MemoryStore> {
        let _ = self.stop.send(());
        self.run.await.unwrap().unwrap();
        self.store
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        send(&self.client, self.proxy, method, path, headers, body).await
    }

    pub async fn post(&self, path: &str, key: &str, body: &str) -> Reply {
        self.send(
            Method::POST,
            path,
            &[("idempotency-key", key)],
            body.to_owned(),
        )
        .await
    }
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let res = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("the proxy answers within 20 s")
        .expect("the proxy answers");
    let status = res.status();
    let headers = res.headers().clone();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

/// Writes `bytes` on a fresh connection and reads until the server closes it (or 10 s pass).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Polls `f` until it is true or `secs` pass.
pub async fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}
