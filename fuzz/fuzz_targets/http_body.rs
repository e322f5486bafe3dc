//! Arbitrary bytes as the body (or query) of every `/v1` route of the HTTP API, in process over
//! the memory store. The server must answer (never panic), never with a 5xx (the memory store
//! cannot fail), and a 4xx must change nothing stored.
#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Method, Request};
use dedupgate_core::{MemoryStore, Store};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

struct World {
    rt: tokio::runtime::Runtime,
    store: Arc<MemoryStore>,
    router: axum::Router,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let store = Arc::new(MemoryStore::new());
        let state = dedupgate_server::AppState::new(
            store.clone() as Arc<dyn Store>,
            dedupgate_server::ServerConfig::default(),
        );
        World {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            store,
            router: dedupgate_server::router(state),
        }
    })
}

const POSTS: [&str; 6] = [
    "/v1/claim",
    "/v1/complete",
    "/v1/release",
    "/v1/extend",
    "/v1/mark",
    "/v1/batch",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let w = world();
    let request = match selector % 8 {
        i @ 0..=5 => Request::builder()
            .method(Method::POST)
            .uri(POSTS[i as usize])
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec())),
        other => {
            // The query string from the bytes, percent-encoded as a client would.
            let q: String = body
                .iter()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'=' | b'&' | b'.' | b'_' | b'-' => {
                        (*b as char).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect();
            let method = if other == 6 {
                Method::GET
            } else {
                Method::DELETE
            };
            Request::builder()
                .method(method)
                .uri(format!("/v1/record?{q}"))
                .body(Body::empty())
        }
    };
    let Ok(request) = request else { return };
    let held = |w: &World| w.rt.block_on(w.store.stats()).unwrap().records_held;
    let before = held(w);
    let response =
        w.rt.block_on(w.router.clone().oneshot(request))
            .expect("the router is infallible");
    let status = response.status();
    assert!(!status.is_server_error(), "{status} for {body:?}");
    if status.is_client_error() {
        assert_eq!(before, held(w), "a {status} changed what is stored");
    }
});
