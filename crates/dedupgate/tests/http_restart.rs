//! Durability through the HTTP face, on the embedded store: the server SIGKILLed under load and
//! restarted keeps every key it acknowledged, and a token from before a restart still completes
//! its claim after it.

mod http_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_support::{serve, try_request, Server, TempDir};
use serde_json::{json, Value};

fn embedded(dir: &TempDir) -> Server {
    let store = format!("embedded:{}", dir.path().join("data").display());
    serve(&["--store", &store])
}

/// What one acknowledged answer promised.
#[derive(Clone, Debug)]
struct Acked {
    key: String,
    fence: u64,
    /// A complete was acknowledged: the record must be completed.
    completed: bool,
    /// A complete was sent but its answer lost: either state is right.
    complete_unknown: bool,
}

const WRITERS: usize = 8;
const ROUNDS: usize = 3;

#[test]
fn sigkill_under_load_keeps_every_acknowledged_key() {
    let dir = TempDir::new("http-sigkill");
    let acked: Arc<Mutex<Vec<Acked>>> = Arc::default();
    // Three rounds: each server is killed while eight writers are mid-request.
    for round in 0..ROUNDS {
        let mut s = embedded(&dir);
        let addr = s.addr;
        let target = acked.lock().unwrap().len() + 1500;
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let acked = acked.clone();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let key = format!("r{round}-w{w}-{i}");
                        // Writers alternate single claims, claim+complete, and 50-op batches. An
                        // error means the server died mid-request: that answer was never
                        // acknowledged.
                        let result = match (w + i as usize) % 3 {
                            0 => claim_one(addr, &key, false),
                            1 => claim_one(addr, &key, true),
                            _ => claim_batch(addr, &key),
                        };
                        match result {
                            Ok(done) => acked.lock().unwrap().extend(done),
                            Err(_) => break,
                        }
                    }
                })
            })
            .collect();
        http_support::eventually(60, "1500 more acknowledged keys", || {
            acked.lock().unwrap().len() >= target
        });
        s.kill9();
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            let _ = w.join();
        }
    }
    let acked = acked.lock().unwrap().clone();
    println!("{} keys acknowledged across {ROUNDS} SIGKILLs", acked.len());

    let s = embedded(&dir);
    for chunk in acked.chunks(1000) {
        let ops: Vec<Value> = chunk
            .iter()
            .map(|a| json!({"op": "get", "namespace": "durable", "key": a.key}))
            .collect();
        let r = s.post_json("/v1/batch", &json!({ "ops": ops }));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        for (a, rec) in chunk.iter().zip(v["results"].as_array().unwrap()) {
            assert!(
                rec.get("error").is_none(),
                "acknowledged key {} lost: {rec}",
                a.key
            );
            assert_eq!(rec["fence"].as_u64(), Some(a.fence), "{}: {rec}", a.key);
            if a.complete_unknown {
                assert!(
                    rec["state"] == "completed" || rec["state"] == "in_progress",
                    "{rec}"
                );
            } else {
                let want = if a.completed {
                    "completed"
                } else {
                    "in_progress"
                };
                assert_eq!(rec["state"], want, "{}: {rec}", a.key);
            }
        }
    }
}

fn post(addr: std::net::SocketAddr, path: &str, body: &Value) -> std::io::Result<Value> {
    let r = try_request(addr, "POST", path, &[], body.to_string().as_bytes())?;
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    Ok(r.json())
}

/// One claim (and its completion when `complete`); the answers that came back are acknowledged.
fn claim_one(addr: std::net::SocketAddr, key: &str, complete: bool) -> std::io::Result<Vec<Acked>> {
    let v = post(
        addr,
        "/v1/claim",
        &json!({"namespace": "durable", "key": key}),
    )?;
    assert_eq!(v["outcome"], "new");
    let mut acked = Acked {
        key: key.to_owned(),
        fence: v["fence"].as_u64().unwrap(),
        completed: false,
        complete_unknown: false,
    };
    if complete {
        let body = json!({"namespace": "durable", "key": key, "token": v["token"], "result": "ok"});
        // If the server dies here the claim is still acknowledged; the complete may or may not be.
        match post(addr, "/v1/complete", &body) {
            Ok(_) => acked.completed = true,
            Err(_) => acked.complete_unknown = true,
        }
    }
    Ok(vec![acked])
}

fn claim_batch(addr: std::net::SocketAddr, prefix: &str) -> std::io::Result<Vec<Acked>> {
    let keys: Vec<String> = (0..50).map(|j| format!("{prefix}-b{j}")).collect();
    let ops: Vec<Value> = keys
        .iter()
        .map(|k| json!({"op": "claim", "namespace": "durable", "key": k}))
        .collect();
    let v = post(addr, "/v1/batch", &json!({ "ops": ops }))?;
    Ok(keys
        .into_iter()
        .zip(v["results"].as_array().unwrap())
        .map(|(key, item)| {
            assert_eq!(item["outcome"], "new", "{item}");
            Acked {
                key,
                fence: item["fence"].as_u64().unwrap(),
                completed: false,
                complete_unknown: false,
            }
        })
        .collect())
}

#[test]
fn a_token_from_before_a_restart_completes_after_it() {
    let dir = TempDir::new("http-token-restart");
    let mut s = embedded(&dir);
    let claim = s.post_json(
        "/v1/claim",
        &json!({"namespace": "r", "key": "job", "lease_ms": 600000}),
    );
    assert_eq!(claim.status, 200, "{}", claim.text());
    let claim = claim.json();
    let token = claim["token"].as_str().unwrap().to_owned();
    let released = s
        .post_json("/v1/claim", &json!({"namespace": "r", "key": "freed"}))
        .json();
    let ok = s.post_json(
        "/v1/release",
        &json!({"namespace": "r", "key": "freed", "token": released["token"]}),
    );
    assert_eq!(ok.status, 200);
    s.kill9();

    let mut s = embedded(&dir);
    // Still held: another claim is a duplicate, the old token completes it.
    let dup = s
        .post_json("/v1/claim", &json!({"namespace": "r", "key": "job"}))
        .json();
    assert_eq!(dup["outcome"], "duplicate");
    let done = s.post_json(
        "/v1/complete",
        &json!({"namespace": "r", "key": "job", "token": token, "result": {"n": 1}}),
    );
    assert_eq!(done.status, 200, "{}", done.text());
    assert_eq!(done.json()["record"]["fence"], claim["fence"]);
    // Fences keep increasing across the restart for a released key.
    let again = s
        .post_json("/v1/claim", &json!({"namespace": "r", "key": "freed"}))
        .json();
    assert_eq!(again["outcome"], "new");
    assert!(again["fence"].as_u64() > released["fence"].as_u64());
    // A graceful stop and a third start: the completed record and its result are still there.
    assert!(s.terminate().success());
    std::thread::sleep(Duration::from_millis(50));
    let s = embedded(&dir);
    let rec = s.record("r", "job").unwrap();
    assert_eq!(rec["state"], "completed");
    assert_eq!(rec["result"], json!({"n": 1}));
}
