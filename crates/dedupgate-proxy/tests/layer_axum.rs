//! IdempotencyLayer inside an axum service (no proxy): the same behaviour as the proxy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use dedupgate_core::MemoryStore;
use dedupgate_proxy::{ConfigFile, IdempotencyConfig, IdempotencyLayer};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

async fn charge(
    State(n): State<Arc<AtomicU64>>,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let run = n.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(100)).await;
    if body.as_ref() == b"fail" {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("x-run", "fail")],
            "boom".into(),
        );
    }
    (
        StatusCode::CREATED,
        [("x-run", "ok")],
        format!("charge {run} of {} bytes", body.len()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_service_with_the_layer() {
    let config = ConfigFile::parse(
        "[[route]]\nmethods = [\"POST\"]\npath = \"/charges\"\nkey = \"required\"\n",
    )
    .unwrap()
    .apply(IdempotencyConfig::default())
    .unwrap();
    let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()), config).unwrap();
    let runs = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/charges", post(charge))
        .route("/free", post(charge))
        .with_state(runs.clone())
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let send = |path: &'static str, key: Option<&'static str>, body: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let mut req = http::Request::post(format!("{base}{path}"));
            if let Some(k) = key {
                req = req.header("idempotency-key", k);
            }
            let res = client
                .request(req.body(Full::new(Bytes::from(body))).unwrap())
                .await
                .unwrap();
            let replayed = res.headers().contains_key("idempotent-replayed");
            let status = res.status();
            (
                status,
                replayed,
                res.into_body().collect().await.unwrap().to_bytes(),
            )
        }
    };

    let burst: Vec<_> = (0..10)
        .map(|_| tokio::spawn(send("/charges", Some("k1"), "100")))
        .collect();
    let mut statuses = Vec::new();
    for t in burst {
        statuses.push(t.await.unwrap().0);
    }
    assert!(statuses.contains(&StatusCode::CREATED));
    assert!(statuses
        .iter()
        .all(|s| *s == StatusCode::CREATED || *s == StatusCode::CONFLICT));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran once under a burst");
    let (s, replayed, body) = send("/charges", Some("k1"), "100").await;
    assert_eq!((s, replayed), (StatusCode::CREATED, true));
    assert_eq!(body, Bytes::from("charge 1 of 3 bytes"));

    assert_eq!(
        send("/charges", None, "100").await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        send("/charges", Some("k1"), "200").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // 5xx releases: the retry runs again.
    assert_eq!(
        send("/charges", Some("k2"), "fail").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        send("/charges", Some("k2"), "fail").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Routes no rule names are not gated.
    send("/free", Some("k3"), "x").await;
    send("/free", Some("k3"), "x").await;
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}
