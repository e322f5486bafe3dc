//! `errors = "stripe"`: the proxy's own errors as Stripe's error object with Stripe's statuses,
//! per route, in the proxy and in the tower layer; problem JSON stays the default. Stripe's SDKs
//! could not read problem JSON ("Invalid response object from API").

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{start, start_with, Reply};
use dedupgate_core::Store;
use dedupgate_proxy::{
    ConfigFile, ErrorFormat, IdempotencyConfig, IdempotencyLayer, ProxyConfig, ProxyServer,
    UpstreamConfig,
};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::RedisStore;
use http::{Method, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Stripe's routes under /v1 (the key required there), problem JSON elsewhere.
const CONFIG: &str = r#"
[[route]]
methods = ["POST"]
path = "/v1/**"
key = "required"
errors = "stripe"

[[route]]
methods = ["POST"]
path = "/**"
"#;

fn config() -> IdempotencyConfig {
    ConfigFile::parse(CONFIG)
        .unwrap()
        .apply(IdempotencyConfig::default())
        .unwrap()
}

/// The Stripe error object of a reply: (type, code).
fn stripe_error(r: &Reply) -> (String, Option<String>) {
    assert_eq!(
        r.headers["content-type"], "application/json",
        "{:?}",
        r.body
    );
    let j = r.json();
    let e = &j["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
    (
        e["type"].as_str().unwrap_or_default().to_owned(),
        e["code"].as_str().map(str::to_owned),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_routes_answer_stripe_errors_and_others_problem_json() {
    let h = start(config()).await;

    let first = h.post("/v1/charges", "k1", "amount=1000").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = h.post("/v1/charges", "k1", "amount=1000").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);

    // Another payload under a used key: 400 idempotency_error, as Stripe answers.
    let other = h.post("/v1/charges", "k1", "amount=2000").await;
    assert_eq!(other.status, StatusCode::BAD_REQUEST);
    assert_eq!(stripe_error(&other), ("idempotency_error".into(), None));

    // A key still in flight: 409 idempotency_error (idempotency_key_in_use), Retry-After kept.
    let slow = "/v1/charges?delay_ms=1500";
    let running = {
        let client = h.client.clone();
        let addr = h.proxy;
        tokio::spawn(async move {
            common::send(
                &client,
                addr,
                Method::POST,
                slow,
                &[("idempotency-key", "k2")],
                "amount=1",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = h.post(slow, "k2", "amount=1").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        stripe_error(&busy),
        (
            "idempotency_error".into(),
            Some("idempotency_key_in_use".into())
        )
    );
    assert_eq!(busy.headers["retry-after"], "1");
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);

    // A key too long, or none where one is required: 400 invalid_request_error.
    let long = "k".repeat(256);
    let too_long = h.post("/v1/charges", &long, "amount=1").await;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
    assert_eq!(stripe_error(&too_long).0, "invalid_request_error");
    let missing = h
        .send(Method::POST, "/v1/charges", &[], "amount=1".to_owned())
        .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        stripe_error(&missing),
        (
            "invalid_request_error".into(),
            Some("invalid_request".into())
        )
    );

    // Outside /v1: problem JSON, API.md's statuses.
    h.post("/orders", "k1", "a").await;
    let problem = h.post("/orders", "k1", "b").await;
    assert_eq!(problem.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem.headers["content-type"], "application/problem+json");
    assert_eq!(problem.code(), "fingerprint_mismatch");
    h.shutdown().await;
}

/// The forwarder's own errors (an upstream that cannot be reached) follow the route too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_a_stripe_api_error_on_a_stripe_route() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let h = start_with(config(), |pc| pc.upstream = UpstreamConfig::new(url)).await;
    let r = h.post("/v1/charges", "k1", "amount=1").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        stripe_error(&r),
        ("api_error".into(), Some("bad_gateway".into()))
    );
    let p = h.post("/orders", "k1", "a").await;
    assert_eq!(p.status, StatusCode::BAD_GATEWAY);
    assert_eq!(p.code(), "bad_gateway");
    h.shutdown().await;
}

/// A store that cannot answer: 503 api_error, which Stripe's SDKs retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_store_is_a_stripe_api_error() {
    let mut server = RedisServer::start(&[]).expect("redis-server starts");
    let store = RedisStore::open(&server.url())
        .await
        .expect("the store opens");
    server.kill();
    let api = dedupgate_proxy::sample::SampleApi::spawn(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .unwrap();
    let mut pc = ProxyConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        UpstreamConfig::new(api.url()),
    );
    pc.idempotency = config();
    pc.idempotency.errors = ErrorFormat::Stripe;
    let server = ProxyServer::bind(pc, Arc::new(store) as Arc<dyn Store>)
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(server.run(std::future::pending()));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for path in ["/v1/charges", "/orders"] {
        let r = common::send(
            &client,
            addr,
            Method::POST,
            path,
            &[("idempotency-key", "k1")],
            "amount=1",
        )
        .await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        let (kind, code) = stripe_error(&r);
        assert_eq!(kind, "api_error", "{path}");
        assert_eq!(code.as_deref(), Some("unavailable"), "{path}");
    }
    assert_eq!(api.counts.total(), 0, "nothing reached the upstream");
}

/// The tower layer honours the same setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_stripe_errors_too() {
    let layer =
        IdempotencyLayer::new(Arc::new(dedupgate_core::MemoryStore::new()), config()).unwrap();
    let runs = Arc::new(AtomicU64::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/v1/charges",
            post(move || {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    (StatusCode::OK, "{\"id\":\"ch_1\"}")
                }
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let post = |key: &'static str, body: &'static str| {
        let client = client.clone();
        async move {
            common::send(
                &client,
                addr,
                Method::POST,
                "/v1/charges",
                &[("idempotency-key", key)],
                body,
            )
            .await
        }
    };
    let first = tokio::spawn(post("k1", "amount=1"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let busy = post("k1", "amount=1").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        stripe_error(&busy),
        (
            "idempotency_error".into(),
            Some("idempotency_key_in_use".into())
        )
    );
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    let other = post("k1", "amount=2").await;
    assert_eq!(other.status, StatusCode::BAD_REQUEST);
    assert_eq!(stripe_error(&other), ("idempotency_error".into(), None));
    let again = post("k1", "amount=1").await;
    assert!(again.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
