//! An axum service that gives its own routes Idempotency-Key semantics with
//! [`IdempotencyLayer`]: the same behaviour as `dedupgate proxy`, inside the service.
//!
//! `cargo run -p dedupgate-proxy --features sample --example axum` starts the service, sends
//! the same charge twice with one key, prints both answers and how often the handler ran, and
//! exits. Pass `--serve` to keep serving on 127.0.0.1:3001 instead.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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

/// The handler whose side effect must happen once per key.
async fn charge(State(charges): State<Arc<AtomicU64>>, body: Bytes) -> (StatusCode, String) {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!(
            "{{\"charge\":\"ch_{n}\",\"amount_bytes\":{}}}\n",
            body.len()
        ),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Any dedupgate store works; use the embedded or Redis one where a duplicate costs money.
    let store = Arc::new(MemoryStore::new());
    // Routes from TOML: the key is required on /charges, optional elsewhere.
    let config = ConfigFile::parse(
        r#"
        [[route]]
        methods = ["POST"]
        path = "/charges"
        key = "required"
        "#,
    )?
    .apply(IdempotencyConfig::default())?;
    let layer = IdempotencyLayer::new(store, config)?;

    let charges = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(charges.clone())
        .layer(layer);

    let serve = std::env::args().any(|a| a == "--serve");
    let addr = if serve {
        "127.0.0.1:3001"
    } else {
        "127.0.0.1:0"
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let url = format!("http://{}/charges", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    if serve {
        eprintln!("listening on {url}");
        server.await??;
        return Ok(());
    }

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for attempt in 1..=2 {
        let req = http::Request::post(&url)
            .header("idempotency-key", "order-42")
            .body(Full::new(Bytes::from_static(b"{\"amount\":1000}")))?;
        let res = client.request(req).await?;
        let replayed = res.headers().contains_key("idempotent-replayed");
        let status = res.status();
        let body = res.into_body().collect().await?.to_bytes();
        println!(
            "attempt {attempt}: {status} replayed={replayed} {}",
            String::from_utf8_lossy(&body).trim()
        );
    }
    println!("the handler ran {} time(s)", charges.load(Ordering::SeqCst));
    Ok(())
}
