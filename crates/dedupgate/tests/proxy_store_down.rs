//! `dedupgate proxy` started while its store's server (a Redis this test owns) is down: it
//! starts anyway, says so in its start-up line, answers requests with an Idempotency-Key 503
//! `unavailable` problem JSON without running them, passes other requests through, and once the
//! server is started (after the proxy) it serves and replays gated requests without a restart.

mod proxy_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use dedupgate_redis::testkit::RedisServer;
use proxy_support::{free_port, http, post_order, sample_api, start_proxy, Reply, Scratch};

fn post(addr: SocketAddr, key: &str) -> Option<Reply> {
    post_order(addr, "/orders", key)
}

#[test]
fn proxy_starts_with_its_store_down_answers_503_then_serves_once_it_is_up() {
    let (_rt, api) = sample_api();
    let dir = Scratch::new("proxy-store-down");
    let redis_port = dedupgate_redis::testkit::free_port();
    let store = format!("redis://127.0.0.1:{redis_port}");
    let log = dir.0.join("proxy.log");
    let port = free_port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let url = api.url();
    let _proxy = start_proxy(
        port,
        &["--upstream", url.as_str(), "--store", store.as_str()],
        &log,
    );
    // The start-up line (written right after the listener is bound) says the store is not open.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("listening on") {
            assert!(
                text.contains("not open yet") && text.contains("503"),
                "the start-up line says the store is not open: {text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no start-up line: {text}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Down: gated requests get 503 `unavailable` and never reach the upstream; others pass.
    for i in 0..3 {
        let r = post(addr, &format!("down-{i}")).expect("an answer while the store is down");
        assert_eq!(r.status, 503, "{:?}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert_eq!(r.json()["code"], "unavailable", "{:?}", r.json());
    }
    assert_eq!(api.counts.total(), 0);
    let get = http(addr, "GET", "/orders/1", &[], b"").expect("a GET passes through");
    assert_eq!(get.status, 200);
    assert_eq!(api.counts.total(), 1);

    // The server comes up after the proxy: the same proxy process starts serving.
    let _redis = RedisServer::start_in(&dir.0, redis_port, &[]).expect("start redis-server");
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        let r = post(addr, "after-up").expect("an answer");
        if r.status != 503 {
            break r;
        }
        assert_eq!(r.json()["code"], "unavailable", "{:?}", r.json());
        assert!(
            Instant::now() < deadline,
            "the proxy never opened the store: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        first.status,
        201,
        "{:?}",
        String::from_utf8_lossy(&first.body)
    );
    assert!(!first.replayed());
    let executions = api.counts.total();
    let again = post(addr, "after-up").expect("a replay");
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, first.body);
    assert_eq!(api.counts.total(), executions);
    // A key answered 503 while the store was down was never run: it runs now, once.
    let late = post(addr, "down-0").expect("an answer");
    assert_eq!(late.status, 201);
    assert!(!late.replayed());
}
