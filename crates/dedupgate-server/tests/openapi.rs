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

fn openapi() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

async fn post(app: &axum::Router, path: &str, body: &serde_json::Value) -> (u16, String) {
    let request = Request::post(path)
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// For every duration field of every request schema, the document and the server agree on
/// `null` (accepted exactly where the schema's type includes "null") and on absence (accepted
/// exactly where the field is not required).
#[tokio::test]
async fn duration_fields_take_null_and_absence_as_documented() {
    use serde_json::json;
    let doc = openapi();
    let app = router(AppState::new(
        Arc::new(MemoryStore::new()),
        ServerConfig::default(),
    ));
    let mut checked = 0;
    for (schema, path) in [
        ("ClaimRequest", "/v1/claim"),
        ("CompleteRequest", "/v1/complete"),
        ("ExtendRequest", "/v1/extend"),
        ("MarkRequest", "/v1/mark"),
    ] {
        let schema = &doc["components"]["schemas"][schema];
        let required: Vec<&str> = schema["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        for field in ["ttl_ms", "lease_ms"] {
            let property = &schema["properties"][field];
            if property.is_null() {
                continue;
            }
            let types = property["type"].clone();
            let nullable =
                types == "null" || types.as_array().is_some_and(|t| t.contains(&json!("null")));
            for (value, documented) in [
                (Some(json!(null)), nullable),
                (None, !required.contains(&field)),
            ] {
                // A fresh claim for each request, so its token is the holder's.
                let key = format!("k{checked}");
                let (status, claim) =
                    post(&app, "/v1/claim", &json!({"namespace": "ns", "key": key})).await;
                assert_eq!(status, 200, "{claim}");
                let token: serde_json::Value = serde_json::from_str(&claim).unwrap();
                let mut body = json!({"namespace": "ns", "key": key, "token": token["token"]});
                if let Some(value) = &value {
                    body[field] = value.clone();
                }
                let (status, answer) = post(&app, path, &body).await;
                assert_eq!(
                    status == 200,
                    documented,
                    "{path} {body}: {status} {answer}; the document says {field} {} \
                     (type {types}, required {required:?})",
                    if value.is_some() { "null" } else { "absent" }
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 10);
}
