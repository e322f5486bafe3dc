//! What the relay's integration tests share: the workload's shape (M messages, D of them
//! copies of earlier keys), unique names, a relay started in the test's runtime, a JetStream
//! source stream, and reading the relay's `/metrics`.

#![allow(dead_code)] // each test binary uses part of it

/// Messages published per test, and how many of them copy an earlier key (25%).
pub const M: usize = 200;
pub const D: usize = 50;

/// The key of message `i`: the first M − D are distinct, the rest repeat earlier ones.
pub fn key_of(i: usize) -> String {
    let distinct = M - D;
    format!("k-{}", if i < distinct { i } else { (i * 7) % distinct })
}

/// A name no other run shares: `prefix-<pid>-<nanoseconds>`.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// A free local port for `/metrics`.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` on the relay's metrics port; empty while nothing listens there yet.
pub async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    text
}

/// A route's counter in a scrape (`None` when absent).
pub fn counter(text: &str, noun: &str, route: &str) -> Option<u64> {
    let prefix = format!("dedupgate_relay_{noun}_total{{route=\"{route}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}

/// A relay running in the test's runtime over a memory store, and the way to stop it.
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<dedupgate_relay::Metrics, dedupgate_relay::RelayError>>,
}

/// Starts one route (checked here) over a fresh memory store.
pub fn start(route: dedupgate_relay::RouteConfig, metrics_listen: Option<String>) -> Running {
    let route = route.check(0).expect("route");
    let gate = dedupgate_core::Gate::new(dedupgate_core::MemoryStore::new());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        dedupgate_relay::run(vec![(route, gate)], metrics_listen.as_deref(), async {
            let _ = stopped.await;
        })
        .await
    });
    Running { stop, task }
}

impl Running {
    /// Stops the relay and returns its counters.
    pub async fn stop(self) -> dedupgate_relay::Metrics {
        let _ = self.stop.send(());
        self.task.await.expect("relay task").expect("relay")
    }
}

/// The test NATS server's URL (`DEDUPGATE_TEST_NATS_URL`, else the machine's).
pub fn nats_url() -> String {
    std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A new JetStream stream `name` (subjects `name.>`) holding `payloads`, published to
/// `name.in` and acknowledged; returns the server's URL, for a route's `from`.
#[cfg(feature = "nats")]
pub async fn jetstream_source(name: &str, payloads: impl IntoIterator<Item = String>) -> String {
    use async_nats::jetstream;
    let url = nats_url();
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("this test needs NATS JetStream at {url}: {e}"));
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        max_age: std::time::Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .expect("stream");
    for payload in payloads {
        js.publish(format!("{name}.in"), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    url
}
