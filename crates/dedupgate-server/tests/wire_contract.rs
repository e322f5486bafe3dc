//! Request bodies as clients in other languages send them, through the real router over a
//! memory store on a manual clock: durations spelled as floats (`60000.0`, `6e4`), `null` for an
//! optional duration, bodies that are not objects, and error details that must read as JSON,
//! never as Rust.

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use dedupgate_core::{Defaults, ManualClock, MemoryStore};
use dedupgate_server::{router, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

const NOW: u64 = 1_764_000_000_000;

fn app() -> Router {
    let store = MemoryStore::with_clock(Arc::new(ManualClock::new(NOW)));
    router(AppState::new(Arc::new(store), ServerConfig::default()))
}

async fn call(app: &Router, method: &str, uri: &str, body: &str) -> (u16, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{method} {uri} {body}: not JSON ({e}): {bytes:?}"));
    (status, value)
}

async fn post(app: &Router, path: &str, body: &str) -> (u16, Value) {
    call(app, "POST", path, body).await
}

async fn record(app: &Router, key: &str) -> Option<Value> {
    let (status, value) = call(
        app,
        "GET",
        &format!("/v1/record?namespace=ns&key={key}"),
        "",
    )
    .await;
    (status == 200).then_some(value)
}

#[tokio::test]
async fn durations_may_be_integral_floats_in_every_field() {
    let app = app();
    // ttl 120 s and lease 60 s however they are spelled.
    for (i, (ttl, lease)) in [
        ("120000", "60000"),
        ("120000.0", "6e4"),
        ("1.2e5", "6E+4"),
        ("1200000e-1", "60000.000"),
        ("120000.0e0", "0.6e5"),
    ]
    .into_iter()
    .enumerate()
    {
        let body =
            format!(r#"{{"namespace":"ns","key":"f{i}","ttl_ms":{ttl},"lease_ms":{lease}}}"#);
        let (status, claim) = post(&app, "/v1/claim", &body).await;
        assert_eq!(status, 200, "{body}: {claim}");
        assert_eq!(claim["outcome"], "new", "{claim}");
        assert_eq!(claim["expires_at_ms"], NOW + 120_000, "{body}");
        assert_eq!(claim["lease_expires_at_ms"], NOW + 60_000, "{body}");
        let token = claim["token"].as_str().unwrap();
        let body =
            format!(r#"{{"namespace":"ns","key":"f{i}","token":"{token}","lease_ms":{lease}}}"#);
        let (status, extended) = post(&app, "/v1/extend", &body).await;
        assert_eq!(status, 200, "{body}: {extended}");
        assert_eq!(extended["lease_expires_at_ms"], NOW + 60_000);
        let body = format!(r#"{{"namespace":"ns","key":"f{i}","token":"{token}","ttl_ms":{ttl}}}"#);
        let (status, done) = post(&app, "/v1/complete", &body).await;
        assert_eq!(status, 200, "{body}: {done}");
        assert_eq!(done["record"]["expires_at_ms"], NOW + 120_000);
        let body = format!(r#"{{"namespace":"ns","key":"m{i}","ttl_ms":{ttl}}}"#);
        let (status, mark) = post(&app, "/v1/mark", &body).await;
        assert_eq!(status, 200, "{body}: {mark}");
        assert_eq!(mark["record"]["expires_at_ms"], NOW + 120_000);
        // The same in batch items (the slow path, as the fast scanner takes integers only).
        let body = format!(
            r#"{{"ops":[{{"op":"claim","namespace":"ns","key":"b{i}","ttl_ms":{ttl},"lease_ms":{lease}}},
                {{"op":"mark","namespace":"ns","key":"bm{i}","ttl_ms":{ttl}}}]}}"#
        );
        let (status, batch) = post(&app, "/v1/batch", &body).await;
        assert_eq!(status, 200, "{body}: {batch}");
        let claim = &batch["results"][0];
        assert_eq!(claim["expires_at_ms"], NOW + 120_000, "{batch}");
        assert_eq!(claim["lease_expires_at_ms"], NOW + 60_000, "{batch}");
        let token = claim["token"].as_str().unwrap();
        assert_eq!(
            batch["results"][1]["record"]["expires_at_ms"],
            NOW + 120_000
        );
        let body = format!(
            r#"{{"ops":[{{"op":"extend","namespace":"ns","key":"b{i}","token":"{token}","lease_ms":{lease}}},
                {{"op":"complete","namespace":"ns","key":"b{i}","token":"{token}","ttl_ms":{ttl}}}]}}"#
        );
        let (status, batch) = post(&app, "/v1/batch", &body).await;
        assert_eq!(status, 200, "{body}: {batch}");
        assert_eq!(batch["results"][0]["lease_expires_at_ms"], NOW + 60_000);
        assert_eq!(
            batch["results"][1]["record"]["expires_at_ms"],
            NOW + 120_000
        );
    }
}

#[tokio::test]
async fn fractions_negatives_zeros_and_overflows_are_refused_naming_the_field() {
    let app = app();
    for (value, words) in [
        ("1.5", "whole number"),
        ("60000.5", "whole number"),
        ("6.00001e4", "whole number"),
        ("1e-3", "whole number"),
        ("-1", "positive"),
        ("-1.0", "positive"),
        ("-6e4", "positive"),
        ("0", "1..="),
        ("0.0", "1..="),
        ("-0.0", "1..="),
        ("0e5", "1..="),
        ("315360000001", "1..="),
        ("1e20", "at most"),
        ("18446744073709551616", "at most"),
        ("1e400", "at most"),
        ("1e99999999999999999999999", "at most"),
        ("\"60000\"", "whole number"),
        ("true", "whole number"),
        ("{}", "whole number"),
        ("[60000]", "whole number"),
    ] {
        for field in ["ttl_ms", "lease_ms"] {
            let body = format!(r#"{{"namespace":"ns","key":"bad","{field}":{value}}}"#);
            let (status, problem) = post(&app, "/v1/claim", &body).await;
            assert_eq!(status, 400, "{body}: {problem}");
            let detail = problem["detail"].as_str().unwrap();
            assert!(
                detail.contains(field) && detail.contains(words),
                "{body}: {detail}"
            );
            let body = format!(
                r#"{{"ops":[{{"op":"claim","namespace":"ns","key":"bad","{field}":{value}}}]}}"#
            );
            let (status, batch) = post(&app, "/v1/batch", &body).await;
            assert_eq!(status, 200, "{body}: {batch}");
            let detail = batch["results"][0]["error"]["detail"].as_str().unwrap();
            assert!(
                detail.contains(field) && detail.contains(words),
                "{body}: {detail}"
            );
        }
        let body = format!(r#"{{"namespace":"ns","key":"bad","ttl_ms":{value}}}"#);
        assert_eq!(post(&app, "/v1/mark", &body).await.0, 400, "{body}");
    }
    // NaN and Infinity are not JSON: malformed.
    for value in ["NaN", "Infinity", "-Infinity", "1.", ".5", "01", "+1"] {
        let body = format!(r#"{{"namespace":"ns","key":"bad","ttl_ms":{value}}}"#);
        assert_eq!(post(&app, "/v1/claim", &body).await.0, 400, "{body}");
    }
    assert_eq!(
        record(&app, "bad").await,
        None,
        "a refused claim stored a record"
    );
}

/// `null` for an optional duration is the same as leaving it out (the server's default, or for
/// complete the claim's expiry), as with Python's `None` and JSON Merge Patch; for extend's
/// required `lease_ms` it is refused like a missing field.
#[tokio::test]
async fn null_durations_mean_absent() {
    let app = app();
    let d = Defaults::default();
    let (status, claim) = post(
        &app,
        "/v1/claim",
        r#"{"namespace":"ns","key":"n","ttl_ms":null,"lease_ms":null}"#,
    )
    .await;
    assert_eq!(status, 200, "{claim}");
    assert_eq!(claim["expires_at_ms"], NOW + d.ttl_ms);
    assert_eq!(claim["lease_expires_at_ms"], NOW + d.lease_ms);
    let token = claim["token"].as_str().unwrap().to_owned();
    let (status, problem) = post(
        &app,
        "/v1/extend",
        &json!({"namespace":"ns","key":"n","token":token,"lease_ms":null}).to_string(),
    )
    .await;
    assert_eq!(status, 400, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("lease_ms"),
        "{problem}"
    );
    let (status, done) = post(
        &app,
        "/v1/complete",
        &json!({"namespace":"ns","key":"n","token":token,"ttl_ms":null}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["record"]["expires_at_ms"], NOW + d.ttl_ms);
    let (status, mark) = post(
        &app,
        "/v1/mark",
        r#"{"namespace":"ns","key":"m","ttl_ms":null,"fingerprint":null,"result":null}"#,
    )
    .await;
    assert_eq!(status, 200, "{mark}");
    assert_eq!(mark["record"]["expires_at_ms"], NOW + d.ttl_ms);
    let (status, batch) = post(
        &app,
        "/v1/batch",
        r#"{"ops":[{"op":"claim","namespace":"ns","key":"b","ttl_ms":null,"lease_ms":null},
                   {"op":"extend","namespace":"ns","key":"b","token":"t","lease_ms":null}]}"#,
    )
    .await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["results"][0]["expires_at_ms"], NOW + d.ttl_ms);
    assert_eq!(batch["results"][0]["lease_expires_at_ms"], NOW + d.lease_ms);
    assert_eq!(batch["results"][1]["error"]["code"], "invalid_request");
}

/// serde reads a struct from a JSON array too: `["ns","k",60000,60000,null,null]` was a claim.
#[tokio::test]
async fn bodies_and_batch_items_must_be_objects() {
    let app = app();
    for path in [
        "/v1/claim",
        "/v1/complete",
        "/v1/release",
        "/v1/extend",
        "/v1/mark",
    ] {
        for body in [
            r#"["ns","arr",60000,60000,null,null]"#,
            r#"["ns","arr","t",null,60000]"#,
            r#"["ns","arr","t",60000]"#,
            r#" ["ns","arr",60000,null,null]"#,
        ] {
            let (status, problem) = post(&app, path, body).await;
            assert_eq!(status, 400, "{path} {body}: {problem}");
            assert_eq!(problem["code"], "invalid_request");
            assert!(
                problem["detail"].as_str().unwrap().contains("object"),
                "{problem}"
            );
        }
    }
    for body in [
        r#"[{"ops":[]}]"#,
        r#"[[{"op":"claim","namespace":"ns","key":"arr"}]]"#,
    ] {
        let (status, problem) = post(&app, "/v1/batch", body).await;
        assert_eq!(status, 400, "{body}: {problem}");
    }
    let (status, batch) = post(
        &app,
        "/v1/batch",
        r#"{"ops":[["claim","ns","arr"],{"op":"claim","namespace":"ns","key":"ok"}]}"#,
    )
    .await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["results"][0]["error"]["code"], "invalid_request");
    assert_eq!(batch["results"][1]["outcome"], "new");
    assert_eq!(record(&app, "arr").await, None, "an array made a record");
}

/// Words of Rust, not of JSON: a type name, a path, a generic, serde's names for JSON types.
const RUST_WORDS: [&str; 20] = [
    "struct",
    "enum",
    "Req",
    "::",
    "Option",
    "Vec",
    "String",
    "RawValue",
    "BatchItem",
    "u64",
    "i64",
    "u32",
    "usize",
    "f64",
    "map,",
    "a map",
    "sequence",
    "unit",
    "newtype",
    "borrowed",
];

fn malformed_values() -> Vec<&'static str> {
    vec![
        "null",
        "true",
        "7",
        "-7",
        "1.5",
        "1e400",
        "\"text\"",
        "\"\"",
        "[]",
        "[1,2]",
        "{}",
        "{\"a\":1}",
        "[\"ns\",\"k\"]",
    ]
}

fn malformed_bodies() -> Vec<String> {
    let mut bodies: Vec<String> = [
        "",
        " ",
        "{",
        "}",
        "[",
        "nul",
        "NaN",
        "{\"namespace\":}",
        "{\"namespace\":\"ns\",}",
        "{\"namespace\" \"ns\"}",
        "{\"namespace\":\"ns\",\"key\":\"k\"} trailing",
        "{\"namespace\":\"ns\",\"key\":\"k\",\"key\":\"j\"}",
        "\u{0}\u{1}",
        "\u{feff}{}",
        "{\"ops\":[{\"op\":\"claim\",\"namespace\":\"ns\",\"key\":\"k\"},]}",
        "{\"ops\":[]} x",
        "{\"ops\":[],\"ops\":[]}",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    for value in malformed_values() {
        bodies.push(value.to_owned());
        for field in [
            "namespace",
            "key",
            "token",
            "ttl_ms",
            "lease_ms",
            "fingerprint",
            "owner",
            "ops",
            "op",
        ] {
            let mut body =
                json!({"namespace":"ns","key":"k","token":"t","lease_ms":1000,"op":"claim"});
            body[field] = serde_json::from_str(value).unwrap();
            let text = body.to_string();
            bodies.push(text.clone());
            bodies.push(format!("{{\"ops\":[{text}]}}"));
            bodies.push(format!("{{\"ops\":{value}}}"));
        }
    }
    for op in [
        "claim", "complete", "release", "extend", "mark", "get", "forget", "nope",
    ] {
        bodies.push(format!("{{\"ops\":[{{\"op\":\"{op}\"}}]}}"));
        bodies.push(format!("{{\"ops\":[{{\"op\":\"{op}\",\"namespace\":7}}]}}"));
    }
    bodies
}

/// Every problem detail a malformed request can draw, on every route, and in batch items.
#[tokio::test]
async fn no_error_detail_names_a_rust_type() {
    let app = app();
    let routes = [
        "/v1/claim",
        "/v1/complete",
        "/v1/release",
        "/v1/extend",
        "/v1/mark",
        "/v1/batch",
    ];
    let mut details = Vec::new();
    for body in malformed_bodies() {
        for route in routes {
            let (status, answer) = post(&app, route, &body).await;
            if status >= 400 {
                details.push((route, body.clone(), answer["detail"].clone()));
            }
            for item in answer["results"].as_array().into_iter().flatten() {
                if !item["error"].is_null() {
                    details.push((route, body.clone(), item["error"]["detail"].clone()));
                }
            }
        }
    }
    for query in [
        "",
        "?namespace=ns",
        "?key=k",
        "?namespace=n%20s&key=k",
        "?namespace=ns&key=%FF",
        "?namespace=ns&key=a&key=b",
    ] {
        for method in ["GET", "DELETE"] {
            let (status, answer) = call(&app, method, &format!("/v1/record{query}"), "").await;
            assert!(status >= 400, "{method} {query}");
            details.push(("/v1/record", query.to_owned(), answer["detail"].clone()));
        }
    }
    assert!(details.len() > 500, "only {} errors drawn", details.len());
    for (route, body, detail) in &details {
        let detail = detail
            .as_str()
            .unwrap_or_else(|| panic!("{route} {body}: no detail"));
        for word in RUST_WORDS {
            assert!(
                !detail.contains(word),
                "{route} {body:.200}: detail names {word:?}: {detail}"
            );
        }
    }
}
