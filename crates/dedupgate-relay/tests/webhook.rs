//! The HTTP webhook sink against a real HTTP server this test runs (axum, on a free port),
//! which records every request and answers by path: `/ok` 200, `/flaky` 500 twice then 200,
//! `/bad` 400, `/down` always 503, `/limited` 429 with `Retry-After: 1` once then 200,
//! `/route` 500 to the first request of every fifth key, else 200. And one route through
//! `dedupgate_relay::run`: a JetStream source (the machine's NATS, `DEDUPGATE_TEST_NATS_URL`)
//! with duplicates to the webhook, each key accepted exactly once.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use dedupgate_relay::metrics::RouteMetrics;
use dedupgate_relay::{Outgoing, RouteConfig, Sink, SinkError, SinkSpec};

/// One request as the server saw it.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    headers: HeaderMap,
    body: Vec<u8>,
    status: u16,
}

#[derive(Default)]
struct Server {
    seen: Mutex<Vec<Seen>>,
}

impl Server {
    fn seen(&self, path: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|s| s.path == path).cloned().collect()
    }
}

async fn hook(
    State(server): State<Arc<Server>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let mut seen = server.seen.lock().unwrap();
    let before = seen.iter().filter(|s| s.path == path).count();
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let before_of_key = seen
        .iter()
        .filter(|s| {
            s.path == path
                && s.headers
                    .get("idempotency-key")
                    .is_some_and(|v| v == key.as_str())
        })
        .count();
    let (status, extra): (u16, Option<(&str, &str)>) = match path.as_str() {
        "/flaky" if before < 2 => (500, None),
        "/bad" => (400, None),
        "/down" => (503, None),
        "/limited" if before == 0 => (429, Some(("retry-after", "1"))),
        "/route" if before_of_key == 0 && key_number(&key) % 5 == 0 => (500, None),
        _ => (200, None),
    };
    seen.push(Seen {
        path,
        headers,
        body: body.to_vec(),
        status,
    });
    let status = StatusCode::from_u16(status).unwrap();
    let body = if status == StatusCode::BAD_REQUEST {
        "amount must be positive"
    } else {
        ""
    };
    match extra {
        Some(header) => (status, [header], body).into_response(),
        None => (status, body).into_response(),
    }
}

/// `k-17` → 17.
fn key_number(key: &str) -> usize {
    key.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Starts the server on a free port; returns its base URL.
async fn serve() -> (String, Arc<Server>) {
    let server = Arc::new(Server::default());
    let app = axum::Router::new()
        .fallback(hook)
        .with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), server)
}

async fn sink(url: &str) -> Arc<dyn Sink> {
    let spec: SinkSpec = url.parse().expect("a webhook URL");
    dedupgate_relay::sink::open(&spec, &Arc::new(RouteMetrics::default()))
        .await
        .expect("open")
}

fn forward<'a>(key: &'a str, payload: &'a [u8], fence: u64) -> Outgoing<'a> {
    Outgoing {
        key,
        payload,
        headers: &[],
        fence: Some(fence),
    }
}

fn header<'a>(seen: &'a Seen, name: &str) -> Option<&'a str> {
    seen.headers.get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_post_carries_the_key_the_fence_and_the_payload_with_its_content_type() {
    let (base, server) = serve().await;
    let hook = sink(&format!("{base}/ok")).await;
    hook.send(forward("order-1", br#"{"amount":5}"#, 7))
        .await
        .expect("confirmed");
    hook.send(forward("order-2", b"not json", 8))
        .await
        .expect("confirmed");
    let seen = server.seen("/ok");
    assert_eq!(seen.len(), 2);
    assert_eq!(header(&seen[0], "idempotency-key"), Some("order-1"));
    assert_eq!(header(&seen[0], "dedupgate-fence"), Some("7"));
    assert_eq!(header(&seen[0], "content-type"), Some("application/json"));
    assert_eq!(seen[0].body, br#"{"amount":5}"#);
    assert_eq!(
        header(&seen[1], "content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(header(&seen[1], "dedupgate-fence"), Some("8"));

    // A dead letter: no fence, the relay's headers on one line each.
    let headers = vec![("dedupgate-reason".to_owned(), b"bad\nInjected: 1".to_vec())];
    hook.send(Outgoing {
        key: "order-3",
        payload: b"{}",
        headers: &headers,
        fence: None,
    })
    .await
    .expect("confirmed");
    let letter = &server.seen("/ok")[2];
    assert_eq!(header(letter, "dedupgate-fence"), None);
    assert_eq!(
        header(letter, "dedupgate-reason"),
        Some("bad\\nInjected: 1")
    );
    assert_eq!(header(letter, "injected"), None);

    // A key an HTTP header cannot carry is refused, never sent.
    let refused = hook.send(forward("a\r\nInjected: 1", b"{}", 9)).await;
    assert!(
        matches!(refused, Err(SinkError::Refused { .. })),
        "{refused:?}"
    );
    assert_eq!(server.seen("/ok").len(), 3);
}

#[tokio::test]
async fn five_hundreds_are_asked_again_until_a_2xx_and_a_400_is_refused_at_once() {
    let (base, server) = serve().await;
    let flaky = sink(&format!("{base}/flaky")).await;
    flaky
        .send(forward("k", b"{}", 1))
        .await
        .expect("confirmed on the third attempt");
    let statuses: Vec<u16> = server.seen("/flaky").iter().map(|s| s.status).collect();
    assert_eq!(statuses, [500, 500, 200]);
    for s in server.seen("/flaky") {
        assert_eq!(
            header(&s, "idempotency-key"),
            Some("k"),
            "every attempt keyed"
        );
    }

    let bad = sink(&format!("{base}/bad")).await;
    let refused = bad.send(forward("k", b"{}", 1)).await;
    match refused {
        Err(SinkError::Refused { reason, .. }) => {
            assert!(reason.contains("400"), "{reason}");
            assert!(reason.contains("amount must be positive"), "{reason}");
        }
        other => panic!("a 400 is refused: {other:?}"),
    }
    assert_eq!(server.seen("/bad").len(), 1, "a 400 is not asked again");
}

#[tokio::test]
async fn a_receiver_that_stays_down_is_a_send_error_after_a_bounded_number_of_attempts() {
    let (base, server) = serve().await;
    let down = sink(&format!("{base}/down")).await;
    let started = Instant::now();
    let failed = down.send(forward("k", b"{}", 1)).await;
    assert!(
        matches!(&failed, Err(SinkError::Send { reason, .. }) if reason.contains("503")),
        "{failed:?}"
    );
    assert_eq!(server.seen("/down").len(), 4);
    assert!(started.elapsed() < Duration::from_secs(5));

    // Nobody listening: a transport error, asked again, then a send error too.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = sink(&format!("http://127.0.0.1:{port}/x")).await;
    let failed = nobody.send(forward("k", b"{}", 1)).await;
    assert!(matches!(failed, Err(SinkError::Send { .. })), "{failed:?}");
}

#[tokio::test]
async fn retry_after_is_waited_before_asking_again() {
    let (base, server) = serve().await;
    let limited = sink(&format!("{base}/limited")).await;
    let started = Instant::now();
    limited
        .send(forward("k", b"{}", 1))
        .await
        .expect("confirmed after the wait");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let statuses: Vec<u16> = server.seen("/limited").iter().map(|s| s.status).collect();
    assert_eq!(statuses, [429, 200]);
}

/// Messages published, and how many copy an earlier key.
const M: usize = 100;
const D: usize = 25;

fn key_of(i: usize) -> String {
    let distinct = M - D;
    format!("k-{}", if i < distinct { i } else { (i * 7) % distinct })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_to_webhook_delivers_each_key_once_with_its_fence() {
    let (base, server) = serve().await;
    let stream = common::unique("webhook-src");
    let payloads = (0..M).map(|i| format!(r#"{{"id":"{}"}}"#, key_of(i)));
    let url = common::jetstream_source(&stream, payloads).await;
    let relay = common::start(
        RouteConfig {
            name: Some("webhook".into()),
            from: format!("{url}/{stream}?consumer=relay"),
            to: format!("{base}/route"),
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let accepted = || {
        let mut keys = BTreeMap::<String, Vec<u64>>::new();
        for s in server.seen("/route").iter().filter(|s| s.status == 200) {
            let key = header(s, "idempotency-key").expect("keyed").to_owned();
            let fence = header(s, "dedupgate-fence")
                .expect("fenced")
                .parse()
                .expect("a number");
            keys.entry(key).or_default().push(fence);
        }
        keys
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while accepted().len() < M - D {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the webhook"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Time for a wrong second forward of a duplicate to arrive, were there one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let metrics = relay.stop().await;
    let keys = accepted();
    let expected: std::collections::BTreeSet<String> = (0..M).map(key_of).collect();
    assert_eq!(
        keys.keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        expected
    );
    let twice: Vec<_> = keys.iter().filter(|(_, f)| f.len() != 1).collect();
    assert!(twice.is_empty(), "keys accepted more than once: {twice:?}");
    // Every fifth key's first request was answered 500: asked again inside the sink, with the
    // same fence (one claim), and counted once as forwarded.
    let retried = server
        .seen("/route")
        .iter()
        .filter(|s| s.status == 500)
        .count();
    assert_eq!(retried, (M - D).div_ceil(5));
    let m = metrics.route("webhook").expect("route metrics");
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(&m.forwarded), (M - D) as u64);
    // A copy that came while its key was in hand is put back, so not all may be acked yet.
    assert!(get(&m.duplicates) <= D as u64);
}
