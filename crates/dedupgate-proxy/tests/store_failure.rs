//! A request the upstream processed whose response cannot be stored is not answered as if it had
//! been (API.md: a final response is stored, then returned). Found by dedupgate-torture's proxy
//! face over Redis behind its TCP fault proxy: the response went to the caller unstored, the
//! claim's lease ran out, and the harness's retry ran the request a second time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use dedupgate_proxy::{ConfigFile, IdempotencyConfig, IdempotencyLayer};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::RedisStore;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The upstream: processes the charge, and its store dies before the proxy can store the answer.
async fn charge(
    State((runs, redis)): State<(Arc<AtomicU64>, Arc<Mutex<RedisServer>>)>,
) -> (StatusCode, String) {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    redis.lock().unwrap().kill();
    (StatusCode::CREATED, format!("charge {run}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processed_request_whose_response_cannot_be_stored_gets_503_not_the_response() {
    let server = RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always"])
        .expect("redis-server starts");
    let store = RedisStore::open(&server.url())
        .await
        .expect("the store opens");
    let redis = Arc::new(Mutex::new(server));
    let config = ConfigFile::parse(
        "[[route]]\nmethods = [\"POST\"]\npath = \"/charges\"\nkey = \"required\"\n",
    )
    .unwrap()
    .apply(IdempotencyConfig {
        // Bounds how long the proxy keeps trying to store the response.
        lease_ms: 1_500,
        ..IdempotencyConfig::default()
    })
    .unwrap();
    let layer = IdempotencyLayer::new(Arc::new(store), config).unwrap();
    let runs = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state((runs.clone(), redis.clone()))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let res = client
        .request(
            http::Request::post(format!("{base}/charges"))
                .header("idempotency-key", "k1")
                .body(Full::new(Bytes::from_static(b"100")))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the upstream ran once");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("could not be stored"), "{body}");
    assert!(
        !body.contains("charge 1"),
        "the unstored response leaked: {body}"
    );
}
