//! docs/openapi.json and the router agree: every route the router serves is documented, every
//! documented operation is served, and each one reaches its handler (not the 404/405 fallback).

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use dedupgate_core::MemoryStore;
use dedupgate_server::{router, AppState, ServerConfig, ROUTES};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn documented() -> BTreeSet<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let text = std::fs::read_to_string(path).expect("docs/openapi.json is in the repo");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("docs/openapi.json is JSON");
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "post", "put", "patch", "delete", "head", "options"]
                .contains(&method.as_str())
            {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

#[test]
fn every_route_is_documented_and_vice_versa() {
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|r| (r.method.to_owned(), r.path.to_owned()))
        .collect();
    let documented = documented();
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from docs/openapi.json: {undocumented:?}"
    );
    assert!(
        unserved.is_empty(),
        "documented but not served: {unserved:?}"
    );
}

#[tokio::test]
async fn every_route_reaches_its_handler() {
    let state = AppState::new(Arc::new(MemoryStore::new()), ServerConfig::default());
    let app = router(state);
    for route in ROUTES {
        let uri = if route.path == "/v1/record" {
            "/v1/record?namespace=n&key=k".to_owned()
        } else {
            route.path.to_owned()
        };
        let request = Request::builder()
            .method(route.method)
            .uri(&uri)
            .body(Body::from("{}"))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert!(
            !text.contains("no such route") && status != 405,
            "{} {} fell through to the fallback: {status} {text}",
            route.method,
            route.path
        );
    }
    // And the fallback does answer for what is not in ROUTES.
    let response = app
        .oneshot(Request::get("/v1/unknown").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
}
