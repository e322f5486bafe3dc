//! Black-box tests of API.md over real HTTP against the real binary (`dedupgate serve` on the
//! memory store): every row of the table and every rule.

mod http_support;

use std::time::Duration;

use http_support::{request, serve, Resp, Server};
use serde_json::{json, Value};

fn claim(s: &Server, ns: &str, key: &str, extra: Value) -> Resp {
    let mut body = json!({"namespace": ns, "key": key});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            body[k] = v;
        }
    }
    s.post_json("/v1/claim", &body)
}

fn ok(r: Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    r.json()
}

#[test]
fn claim_duplicate_complete_replay() {
    let s = serve(&["--store", "memory:"]);
    let new = ok(claim(&s, "payments", "evt_1", json!({"fingerprint": "f1"})));
    assert_eq!(new["outcome"], "new");
    let token = new["token"].as_str().unwrap().to_owned();
    let fence = new["fence"].as_u64().unwrap();
    assert!(new["lease_expires_at_ms"].as_u64().unwrap() < new["expires_at_ms"].as_u64().unwrap());

    // Another claim of an in_progress key: duplicate with the stored record, never the token.
    let dup = claim(&s, "payments", "evt_1", json!({}));
    assert!(!dup.text().contains(&token));
    let dup = ok(dup);
    assert_eq!(dup["outcome"], "duplicate");
    assert_eq!(dup["record"]["state"], "in_progress");
    assert_eq!(dup["record"]["fence"], fence);
    assert_eq!(dup["record"]["fingerprint"], "f1");

    // A different fingerprint is a mismatch, not a duplicate, and changes nothing.
    claim(&s, "payments", "evt_1", json!({"fingerprint": "f2"}))
        .assert_problem(422, "fingerprint_mismatch");

    // complete with the holder's token: the record, completed, with its result.
    let done = ok(s.post_json(
        "/v1/complete",
        &json!({"namespace": "payments", "key": "evt_1", "token": token, "result": {"charge": "ch_1"}}),
    ));
    assert_eq!(done["record"]["state"], "completed");
    assert_eq!(done["record"]["result"], json!({"charge": "ch_1"}));
    assert!(done["record"]["completed_at_ms"].is_u64());
    assert!(done["record"]["lease_expires_at_ms"].is_null());

    // Replay: the duplicate carries the stored result.
    let replay = ok(claim(&s, "payments", "evt_1", json!({})));
    assert_eq!(replay["outcome"], "duplicate");
    assert_eq!(replay["record"]["state"], "completed");
    assert_eq!(replay["record"]["result"], json!({"charge": "ch_1"}));

    // A retried complete with the same token is answered again, unchanged.
    let again = ok(s.post_json(
        "/v1/complete",
        &json!({"namespace": "payments", "key": "evt_1", "token": token, "result": {"other": 1}}),
    ));
    assert_eq!(again["record"]["result"], json!({"charge": "ch_1"}));

    // GET shows the record, never a token.
    let got = s.get("/v1/record?namespace=payments&key=evt_1");
    assert!(!got.text().contains(&token));
    assert_eq!(ok(got)["state"], "completed");
}

#[test]
fn same_owner_gets_its_claim_back() {
    let s = serve(&["--store", "memory:"]);
    let first = ok(claim(&s, "jobs", "k", json!({"owner": "worker-7"})));
    let again = ok(claim(
        &s,
        "jobs",
        "k",
        json!({"owner": "worker-7", "lease_ms": 60000}),
    ));
    assert_eq!(again["outcome"], "new");
    assert_eq!(again["token"], first["token"]);
    assert_eq!(again["fence"], first["fence"]);
    assert!(again["lease_expires_at_ms"].as_u64() >= first["lease_expires_at_ms"].as_u64());
    let other = ok(claim(&s, "jobs", "k", json!({"owner": "worker-8"})));
    assert_eq!(other["outcome"], "duplicate");
    assert_eq!(other["record"]["owner"], "worker-7");
}

#[test]
fn release_frees_the_key_and_old_tokens_are_refused() {
    let s = serve(&["--store", "memory:"]);
    let first = ok(claim(&s, "q", "k", json!({})));
    let t1 = first["token"].as_str().unwrap();
    let rel = ok(s.post_json(
        "/v1/release",
        &json!({"namespace": "q", "key": "k", "token": t1}),
    ));
    assert_eq!(rel, json!({"released": true}));
    assert!(s.record("q", "k").is_none(), "a released key is free");
    let second = ok(claim(&s, "q", "k", json!({})));
    assert_eq!(second["outcome"], "new");
    assert!(
        second["fence"].as_u64() > first["fence"].as_u64(),
        "fences increase after release"
    );
    // The released token is not the holder's any more: 409 for every token op, nothing changes.
    for (path, body) in [
        (
            "/v1/complete",
            json!({"namespace": "q", "key": "k", "token": t1}),
        ),
        (
            "/v1/release",
            json!({"namespace": "q", "key": "k", "token": t1}),
        ),
        (
            "/v1/extend",
            json!({"namespace": "q", "key": "k", "token": t1, "lease_ms": 1000}),
        ),
        (
            "/v1/complete",
            json!({"namespace": "q", "key": "k", "token": "never-issued"}),
        ),
    ] {
        s.post_json(path, &body).assert_problem(409, "lease_lost");
    }
    let rec = s.record("q", "k").unwrap();
    assert_eq!(rec["state"], "in_progress");
    assert_eq!(rec["fence"], second["fence"]);
    // Token ops on a key that never existed are lease_lost too.
    s.post_json(
        "/v1/release",
        &json!({"namespace": "q", "key": "nothing", "token": "x"}),
    )
    .assert_problem(409, "lease_lost");
}

#[test]
fn extend_renews_the_lease() {
    let s = serve(&["--store", "memory:"]);
    let c = ok(claim(&s, "q", "k", json!({"lease_ms": 1000})));
    let t = c["token"].as_str().unwrap();
    let e = ok(s.post_json(
        "/v1/extend",
        &json!({"namespace": "q", "key": "k", "token": t, "lease_ms": 120000}),
    ));
    assert!(
        e["lease_expires_at_ms"].as_u64().unwrap() > c["lease_expires_at_ms"].as_u64().unwrap()
    );
    assert_eq!(e.as_object().unwrap().len(), 1, "{e}");
    let rec = s.record("q", "k").unwrap();
    assert_eq!(rec["lease_expires_at_ms"], e["lease_expires_at_ms"]);
}

#[test]
fn lease_takeover_and_expiry() {
    let s = serve(&["--store", "memory:"]);
    // A crashed worker's lease runs out; the next claim takes over with a higher fence.
    let a = ok(claim(&s, "q", "lease", json!({"lease_ms": 150})));
    std::thread::sleep(Duration::from_millis(300));
    let b = ok(claim(&s, "q", "lease", json!({})));
    assert_eq!(b["outcome"], "new");
    assert!(b["fence"].as_u64() > a["fence"].as_u64());
    s.post_json(
        "/v1/complete",
        &json!({"namespace": "q", "key": "lease", "token": a["token"]}),
    )
    .assert_problem(409, "lease_lost");

    // complete with the current token succeeds after the lease time if nobody took over.
    let c = ok(claim(&s, "q", "late", json!({"lease_ms": 100})));
    std::thread::sleep(Duration::from_millis(250));
    let done = ok(s.post_json(
        "/v1/complete",
        &json!({"namespace": "q", "key": "late", "token": c["token"]}),
    ));
    assert_eq!(done["record"]["state"], "completed");

    // A record is never returned or a duplicate after expires_at_ms.
    ok(s.post_json(
        "/v1/mark",
        &json!({"namespace": "q", "key": "short", "ttl_ms": 150}),
    ));
    assert!(s.record("q", "short").is_some());
    std::thread::sleep(Duration::from_millis(300));
    assert!(s.record("q", "short").is_none());
    assert_eq!(ok(claim(&s, "q", "short", json!({})))["outcome"], "new");
}

#[test]
fn mark_get_forget() {
    let s = serve(&["--store", "memory:"]);
    let m = ok(s.post_json(
        "/v1/mark",
        &json!({"namespace": "trades", "key": "ETH", "result": [1, 2], "fingerprint": "h"}),
    ));
    assert_eq!(m["outcome"], "new");
    assert_eq!(m["record"]["state"], "completed");
    assert_eq!(m["record"]["result"], json!([1, 2]));
    let d = ok(s.post_json("/v1/mark", &json!({"namespace": "trades", "key": "ETH"})));
    assert_eq!(d["outcome"], "duplicate");
    assert_eq!(d["record"]["result"], json!([1, 2]));
    s.post_json(
        "/v1/mark",
        &json!({"namespace": "trades", "key": "ETH", "fingerprint": "other"}),
    )
    .assert_problem(422, "fingerprint_mismatch");
    // A claim of a completed key is a duplicate too.
    assert_eq!(
        ok(claim(&s, "trades", "ETH", json!({})))["outcome"],
        "duplicate"
    );

    let got = ok(s.get("/v1/record?namespace=trades&key=ETH"));
    assert_eq!(got["namespace"], "trades");
    assert_eq!(got["key"], "ETH");
    for field in ["fence", "created_at_ms", "expires_at_ms", "completed_at_ms"] {
        assert!(got[field].is_u64(), "{field} in {got}");
    }
    s.get("/v1/record?namespace=trades&key=nope")
        .assert_problem(404, "not_found");
    assert_eq!(
        ok(s.delete("/v1/record?namespace=trades&key=ETH")),
        json!({"deleted": true})
    );
    assert_eq!(
        ok(s.delete("/v1/record?namespace=trades&key=ETH")),
        json!({"deleted": false})
    );
    assert!(s.record("trades", "ETH").is_none());
    // Keys are any UTF-8, query-encoded.
    ok(s.post_json("/v1/mark", &json!({"namespace": "u", "key": "clé/?&= ü"})));
    assert!(s.record("u", "clé/?&= ü").is_some());
}

#[test]
fn batch_decides_in_order_with_per_item_errors() {
    let s = serve(&["--store", "memory:"]);
    let r = ok(s.post_json(
        "/v1/batch",
        &json!({"ops": [
            {"op": "claim", "namespace": "b", "key": "1"},
            {"op": "claim", "namespace": "b", "key": "1"},
            {"op": "explode", "namespace": "b", "key": "2"},
            {"op": "claim", "namespace": "b", "key": ""},
            {"op": "mark", "namespace": "b", "key": "3", "result": "r"},
            {"op": "get", "namespace": "b", "key": "1"},
            {"op": "get", "namespace": "b", "key": "absent"},
            {"op": "claim", "namespace": "b", "key": "4", "ttl_ms": 0},
            "not an object",
            {"op": "forget", "namespace": "b", "key": "3"},
            {"op": "release", "namespace": "b", "key": "1", "token": "wrong"},
        ]}),
    ));
    let items = r["results"].as_array().unwrap();
    assert_eq!(items.len(), 11);
    assert_eq!(items[0]["outcome"], "new");
    let token = items[0]["token"].as_str().unwrap();
    assert_eq!(
        items[1]["outcome"], "duplicate",
        "later ops see earlier ones"
    );
    for i in [2, 3, 7, 8] {
        assert_eq!(
            items[i]["error"]["code"], "invalid_request",
            "item {i}: {}",
            items[i]
        );
        assert_eq!(items[i]["error"]["status"], 400);
    }
    assert_eq!(items[4]["outcome"], "new");
    assert_eq!(items[5]["state"], "in_progress");
    assert_eq!(items[6]["error"]["code"], "not_found");
    assert_eq!(items[9], json!({"deleted": true}));
    assert_eq!(items[10]["error"]["code"], "lease_lost");
    // The token appears only in the claim's own item.
    assert_eq!(r.to_string().matches(token).count(), 1);
    // Malformed items never reached the store.
    assert!(s.record("b", "2").is_none());
    assert!(s.record("b", "4").is_none());
    // An empty batch is fine.
    assert_eq!(
        ok(s.post("/v1/batch", r#"{"ops":[]}"#)),
        json!({"results": []})
    );
}

#[test]
fn batch_limits_are_whole_request_400s() {
    let s = serve(&["--store", "memory:"]);
    for body in [
        "",
        "[]",
        "{}",
        r#"{"ops":{}}"#,
        r#"{"ops":[1,2"#,
        r#"{"op":"claim"}"#,
    ] {
        s.post("/v1/batch", body)
            .assert_problem(400, "invalid_request");
    }
    let op = json!({"op": "claim", "namespace": "big", "key": "k"});
    let ops: Vec<Value> = (0..10_001).map(|_| op.clone()).collect();
    s.post_json("/v1/batch", &json!({ "ops": ops }))
        .assert_problem(400, "invalid_request");
    assert!(
        s.record("big", "k").is_none(),
        "an oversized batch decides nothing"
    );
    // Exactly 10,000 is fine, and one op per key decides one new.
    let ops: Vec<Value> = (0..10_000)
        .map(|i| json!({"op": "claim", "namespace": "big", "key": format!("k{i}")}))
        .collect();
    let r = ok(s.post_json("/v1/batch", &json!({ "ops": ops })));
    let items = r["results"].as_array().unwrap();
    assert_eq!(items.len(), 10_000);
    assert!(items.iter().all(|i| i["outcome"] == "new"));
}

#[test]
fn health_metrics_and_unknown_routes() {
    let s = serve(&["--store", "memory:"]);
    assert_eq!(ok(s.get("/healthz"))["status"], "ok");
    ok(claim(&s, "metered", "a", json!({})));
    ok(claim(&s, "metered", "a", json!({})));
    ok(s.post_json("/v1/mark", &json!({"namespace": "metered", "key": "m"})));
    ok(s.post_json("/v1/mark", &json!({"namespace": "metered", "key": "m"})));
    claim(&s, "metered", "", json!({})).assert_problem(400, "invalid_request");
    let text = s.get("/metrics").text();
    for needle in [
        r#"dedupgate_decisions_total{namespace="metered",outcome="new"} 2"#,
        r#"dedupgate_decisions_total{namespace="metered",outcome="duplicate_in_progress"} 1"#,
        r#"dedupgate_decisions_total{namespace="metered",outcome="duplicate_completed"} 1"#,
        r#"dedupgate_errors_total{code="invalid_request"} 1"#,
        "dedupgate_request_duration_seconds_bucket",
        "dedupgate_store_duration_seconds_bucket",
        "dedupgate_requests_in_flight",
        "dedupgate_records_held 2",
        "dedupgate_records_swept_total",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    s.get("/v1/nothing").assert_problem(404, "not_found");
    s.get("/v1/claim").assert_problem(405, "invalid_request");
    request(s.addr, "PUT", "/v1/record?namespace=a&key=b", &[], b"")
        .assert_problem(405, "invalid_request");
}

#[test]
fn sweeper_removes_expired_records() {
    let s = serve(&["--store", "memory:", "--sweep-interval", "50ms"]);
    for i in 0..5 {
        ok(s.post_json(
            "/v1/mark",
            &json!({"namespace": "sw", "key": format!("k{i}"), "ttl_ms": 50}),
        ));
    }
    http_support::eventually(20, "the sweeper to remove 5 records", || {
        s.metric("dedupgate_records_swept_total") >= 5.0
    });
    assert_eq!(s.metric("dedupgate_records_held"), 0.0);
}

#[test]
fn serves_h2c_with_prior_knowledge() {
    use std::io::{Read, Write};
    let s = serve(&["--store", "memory:"]);
    let mut tcp = std::net::TcpStream::connect(s.addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Client preface and an empty SETTINGS frame: an HTTP/2 server answers with its SETTINGS.
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    tcp.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap();
    let mut frame = [0u8; 9];
    tcp.read_exact(&mut frame).unwrap();
    assert_eq!(
        frame[3], 4,
        "first frame from the server is SETTINGS: {frame:?}"
    );
}

#[test]
fn graceful_shutdown_finishes_in_flight_requests() {
    use std::io::{Read, Write};
    let mut s = serve(&["--store", "memory:"]);
    // A request whose body is still arriving is in flight when SIGTERM comes. (It holds no
    // in-flight slot yet: `Expect: 100-continue` makes the server say when it starts reading.)
    let body = br#"{"namespace":"g","key":"k"}"#;
    let mut tcp = std::net::TcpStream::connect(s.addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        tcp,
        "POST /v1/claim HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tcp.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );
    tcp.write_all(&body[..5]).unwrap();
    let pid = s.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    tcp.write_all(&body[5..]).unwrap();
    let r = http_support::read_response(&mut tcp);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["outcome"], "new");
    let status = s.wait_exit();
    assert!(status.success(), "exit status {status:?}\n{}", s.log());
    // A fresh connection is refused now.
    assert!(std::net::TcpStream::connect(s.addr).is_err());
}

#[test]
fn logs_one_start_line_with_address_and_store() {
    let s = serve(&["--store", "memory:"]);
    let log = s.log();
    let line = log.lines().find(|l| l.contains("listening on")).unwrap();
    assert!(line.contains(&s.addr.to_string()), "{line}");
    assert!(line.contains("memory:"), "{line}");
    assert!(line.contains("auth=off"), "{line}");
    // No line per successful request by default.
    for _ in 0..5 {
        ok(claim(&s, "quiet", "k", json!({})));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(s.log().lines().count(), log.lines().count(), "{}", s.log());
}
