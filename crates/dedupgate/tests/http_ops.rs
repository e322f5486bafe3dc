//! The service around the API, black-box over real HTTP: concurrency, auth, limits and
//! backpressure, configuration precedence, refusing to serve remote without auth, and the CLI's
//! API subcommands (with the client's retries).

mod http_support;

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

#[cfg(feature = "redis")]
use http_support::{eventually, read_response};
use http_support::{request, serve, serve_env, try_serve, Server, TempDir};
use serde_json::{json, Value};

const KEYS: usize = 40;
const CLIENTS: usize = 64;

#[test]
fn sixty_four_clients_on_overlapping_keys_get_one_new_per_key() {
    let s = serve(&["--store", "memory:"]);
    let seed: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("concurrency seed={seed}");
    let addr = s.addr;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            std::thread::spawn(move || {
                // Each client walks the keys in its own order; odd clients use the batch route.
                let mut order: Vec<usize> = (0..KEYS).collect();
                let mut x = seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for i in (1..order.len()).rev() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    order.swap(i, (x % (i as u64 + 1)) as usize);
                }
                let owner = format!("client-{c}");
                let mut outcomes = Vec::new();
                if c % 2 == 1 {
                    let ops: Vec<Value> = order
                        .iter()
                        .map(|k| json!({"op": "claim", "namespace": "race", "key": format!("k{k}"), "owner": owner}))
                        .collect();
                    let r = request(addr, "POST", "/v1/batch", &[], json!({ "ops": ops }).to_string().as_bytes());
                    assert_eq!(r.status, 200, "{}", r.text());
                    let v = r.json();
                    for (k, item) in order.iter().zip(v["results"].as_array().unwrap()) {
                        outcomes.push((*k, item["outcome"].as_str().unwrap().to_owned(), item["token"].clone()));
                    }
                } else {
                    for k in order {
                        let body = json!({"namespace": "race", "key": format!("k{k}"), "owner": owner});
                        let r = request(addr, "POST", "/v1/claim", &[], body.to_string().as_bytes());
                        assert_eq!(r.status, 200, "{}", r.text());
                        let v = r.json();
                        outcomes.push((k, v["outcome"].as_str().unwrap().to_owned(), v["token"].clone()));
                    }
                }
                outcomes
            })
        })
        .collect();
    let mut news: HashMap<usize, Vec<Value>> = HashMap::new();
    let mut answers = 0;
    for t in threads {
        for (k, outcome, token) in t.join().expect("client thread") {
            answers += 1;
            if outcome == "new" {
                news.entry(k).or_default().push(token);
            } else {
                assert_eq!(outcome, "duplicate");
            }
        }
    }
    assert_eq!(answers, KEYS * CLIENTS);
    for k in 0..KEYS {
        let tokens = news.get(&k).map_or(0, Vec::len);
        assert_eq!(tokens, 1, "key k{k} got {tokens} new answers (seed {seed})");
    }
}

/// A gate over a redis-server of its own, whose requests can be made to wait in the store: the
/// server is paused (SIGSTOP) and resumed. A request's in-flight slot is taken once its body has
/// arrived (a slow body holds none), so a request waiting on its store is what holds one.
#[cfg(feature = "redis")]
struct PausableGate {
    redis: OwnRedis,
    server: Server,
}

#[cfg(feature = "redis")]
impl PausableGate {
    fn start(args: &[&str]) -> Self {
        let redis = OwnRedis::start(free_port());
        // The store waits for the paused server longer than any test pauses it.
        let store = format!("redis://127.0.0.1:{}?response_timeout_ms=60000", redis.port);
        let mut all = vec!["--store", store.as_str()];
        all.extend_from_slice(args);
        let server = serve(&all);
        // One answered claim first, so the store's connection is up before any pause.
        assert_eq!(
            server
                .post_json("/v1/claim", &json!({"namespace": "warm", "key": "k"}))
                .status,
            200
        );
        Self { redis, server }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.redis.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} redis-server");
    }

    /// Sends a whole claim of `key` and returns its connection, the answer still to be read.
    fn send_claim(&self, key: &str) -> TcpStream {
        let body = json!({"namespace": "held", "key": key}).to_string();
        let mut tcp = TcpStream::connect(self.server.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            tcp,
            "POST /v1/claim HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        tcp
    }
}

#[cfg(feature = "redis")]
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[cfg(all(feature = "redis", feature = "http-client"))]
#[test]
fn in_flight_cap_answers_503_with_retry_after_and_clients_retry() {
    let g = PausableGate::start(&["--in-flight-max", "1", "--request-timeout", "60s"]);
    let s = &g.server;
    g.signal("-STOP");
    let mut held = g.send_claim("first");
    eventually(20, "the held request to be in flight", || {
        s.metric("dedupgate_requests_in_flight") >= 1.0
    });
    let r = s.post_json("/v1/claim", &json!({"namespace": "cap", "key": "k"}));
    r.assert_problem(503, "unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    // Monitoring stays answerable at the cap (/healthz would ask the paused store).
    assert_eq!(s.get("/metrics").status, 200);

    // The CLI's client retries on 503: it succeeds once the held request is done.
    let cli = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args(["claim", "--server", &s.url(), "-n", "cap", "-k", "retried"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(20, "the CLI's first try to get a 503", || {
        s.metric(r#"dedupgate_errors_total{code="unavailable"}"#) >= 2.0
    });
    g.signal("-CONT");
    assert_eq!(read_response(&mut held).status, 200);
    let out = cli.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["outcome"], "new");
    assert!(s.record("cap", "k").is_none(), "the 503 decided nothing");
}

#[cfg(feature = "redis")]
#[test]
fn slow_decisions_time_out_with_503() {
    let g = PausableGate::start(&["--request-timeout", "300ms"]);
    g.signal("-STOP");
    let mut held = g.send_claim("slow");
    let r = read_response(&mut held);
    r.assert_problem(503, "unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    g.signal("-CONT");
}

const CLIENT_TOKEN: &str = "client-token-0123456789abcdef";
const ADMIN_TOKEN: &str = "admin-token-fedcba9876543210";

fn auth_config(dir: &TempDir) -> String {
    let path = dir.path().join("dedupgate.toml");
    std::fs::write(
        &path,
        format!(
            r#"
store = "memory:"
[[tokens]]
name = "payments workers"
token = "{CLIENT_TOKEN}"
namespaces = ["pay*"]
role = "client"

[[tokens]]
name = "operator"
token = "{ADMIN_TOKEN}"
namespaces = ["*"]
role = "admin"
"#
        ),
    )
    .unwrap();
    path.display().to_string()
}

fn with_token(
    s: &Server,
    token: &str,
    method: &str,
    path: &str,
    body: &Value,
) -> http_support::Resp {
    let auth = format!("Bearer {token}");
    let body = if method == "POST" {
        body.to_string()
    } else {
        String::new()
    };
    request(
        s.addr,
        method,
        path,
        &[("Authorization", &auth)],
        body.as_bytes(),
    )
}

#[test]
fn bearer_tokens_namespaces_and_roles() {
    let dir = TempDir::new("auth");
    let config = auth_config(&dir);
    let s = serve(&["--config", &config]);
    let claim = json!({"namespace": "payments", "key": "k"});
    s.post_json("/v1/claim", &claim)
        .assert_problem(401, "unauthorized");
    with_token(&s, "wrong-token-wrong-token", "POST", "/v1/claim", &claim)
        .assert_problem(401, "unauthorized");
    request(
        s.addr,
        "POST",
        "/v1/claim",
        &[("Authorization", CLIENT_TOKEN)],
        claim.to_string().as_bytes(),
    )
    .assert_problem(401, "unauthorized");
    let r = with_token(&s, CLIENT_TOKEN, "POST", "/v1/claim", &claim);
    assert_eq!(r.status, 200, "{}", r.text());
    with_token(
        &s,
        CLIENT_TOKEN,
        "POST",
        "/v1/claim",
        &json!({"namespace": "orders", "key": "k"}),
    )
    .assert_problem(403, "forbidden");
    assert_eq!(
        with_token(
            &s,
            CLIENT_TOKEN,
            "GET",
            "/v1/record?namespace=payments&key=k",
            &json!(null)
        )
        .status,
        200
    );
    with_token(
        &s,
        CLIENT_TOKEN,
        "DELETE",
        "/v1/record?namespace=payments&key=k",
        &json!(null),
    )
    .assert_problem(403, "forbidden");
    // A batch: the forbidden items get their own 403, the rest are decided.
    let r = with_token(
        &s,
        CLIENT_TOKEN,
        "POST",
        "/v1/batch",
        &json!({"ops": [
            {"op": "claim", "namespace": "payouts", "key": "1"},
            {"op": "claim", "namespace": "orders", "key": "1"},
            {"op": "forget", "namespace": "payments", "key": "k"},
        ]}),
    );
    assert_eq!(r.status, 200);
    let items = r.json()["results"].clone();
    assert_eq!(items[0]["outcome"], "new");
    assert_eq!(items[1]["error"]["code"], "forbidden");
    assert_eq!(items[2]["error"]["code"], "forbidden");
    // The admin may delete anywhere.
    let r = with_token(
        &s,
        ADMIN_TOKEN,
        "DELETE",
        "/v1/record?namespace=payments&key=k",
        &json!(null),
    );
    assert_eq!(r.json(), json!({"deleted": true}));
    // Monitoring needs no token; tokens never reach logs or metrics.
    assert_eq!(s.get("/healthz").status, 200);
    let metrics = s.get("/metrics").text();
    assert!(
        metrics.contains(r#"dedupgate_errors_total{code="unauthorized"} 3"#),
        "{metrics}"
    );
    // Two whole requests and two batch items.
    assert!(
        metrics.contains(r#"dedupgate_errors_total{code="forbidden"} 4"#),
        "{metrics}"
    );
    let log = s.log();
    assert!(log.contains("auth=on (2 tokens)"), "{log}");
    for secret in [CLIENT_TOKEN, ADMIN_TOKEN] {
        assert!(!log.contains(secret) && !metrics.contains(secret));
    }
}

/// Found with Python's `http.client` (which sends its whole body before it reads the answer):
/// a request without a token and with a body larger than the sockets' buffers got a broken pipe
/// instead of the 401, because the server answered and closed with the body unread. The body
/// of a refused request is now read beside the answer and dropped, as for a 413 (at most
/// `body_bytes_max` of it), and the connection closes after the 401.
#[test]
fn a_client_that_sends_its_whole_body_first_gets_the_401() {
    use std::io::Read;
    let dir = TempDir::new("auth-body");
    let config = auth_config(&dir);
    let s = serve(&["--config", &config]);
    let body = format!(
        r#"{{"namespace":"payments","key":"k","pad":"{}"}}"#,
        "x".repeat(8 << 20)
    );
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "POST /v1/claim HTTP/1.1\r\nHost: gate\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    c.write_all(body.as_bytes())
        .unwrap_or_else(|e| panic!("sending the body failed: {e}"));
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("unauthorized"), "{answer}");
    // One refused request per connection: no caller without a token keeps one sending bodies.
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
}

#[test]
fn refuses_non_loopback_without_tokens_unless_told() {
    let err = try_serve(&["--listen", "0.0.0.0:0", "--store", "memory:"], &[])
        .err()
        .expect("must refuse");
    assert!(err.contains("--allow-unauthenticated-remote"), "{err}");
    let s = serve(&[
        "--listen",
        "0.0.0.0:0",
        "--store",
        "memory:",
        "--allow-unauthenticated-remote",
    ]);
    assert!(s.log().contains("auth=off"));
    drop(s);
    let dir = TempDir::new("remote");
    let config = auth_config(&dir);
    let s = serve(&["--listen", "0.0.0.0:0", "--config", &config]);
    assert!(s.log().contains("auth=on"));
}

fn claim_ttl_ms(s: &Server) -> u64 {
    let v = s
        .post_json("/v1/claim", &json!({"namespace": "cfg", "key": "k"}))
        .json();
    let rec = s.record("cfg", "k").unwrap();
    assert_eq!(rec["fence"], v["fence"]);
    rec["expires_at_ms"].as_u64().unwrap() - rec["created_at_ms"].as_u64().unwrap()
}

#[test]
fn flags_beat_environment_beat_config_file() {
    let dir = TempDir::new("precedence");
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "store = \"memory:\"\ndefault_ttl = \"1h\"\n").unwrap();
    let config = path.display().to_string();
    let hour = 3_600_000;
    assert_eq!(claim_ttl_ms(&serve(&["--config", &config])), hour);
    let env = [("DEDUPGATE_DEFAULT_TTL", "2h")];
    assert_eq!(
        claim_ttl_ms(&serve_env(&["--config", &config], &env)),
        2 * hour
    );
    assert_eq!(
        claim_ttl_ms(&serve_env(
            &["--config", &config, "--default-ttl", "3h"],
            &env
        )),
        3 * hour
    );
    // A bad file is a clear start-up error.
    std::fs::write(&path, "default_ttl = \"1h\"\nlisten_typo = 1\n").unwrap();
    let err = try_serve(&["--config", &config, "--store", "memory:"], &[])
        .err()
        .unwrap();
    assert!(err.contains("listen_typo"), "{err}");
}

fn cli(args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args(args)
        .env_remove("DEDUPGATE_SERVER")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        v,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(feature = "http-client")]
#[test]
fn cli_api_subcommands_against_the_server() {
    let s = serve(&["--store", "memory:"]);
    let url = s.url();
    let base = ["--server", url.as_str(), "-n", "shell", "-k", "job-1"];
    let with = |cmd: &str, extra: &[&str]| {
        let mut a = vec![cmd];
        a.extend_from_slice(&base);
        a.extend_from_slice(extra);
        cli(&a)
    };
    let (code, claim, _) = with("claim", &["--lease", "30s", "--owner", "me"]);
    assert_eq!(
        (code, claim["outcome"].as_str()),
        (0, Some("new")),
        "{claim}"
    );
    let token = claim["token"].as_str().unwrap().to_owned();
    let (code, dup, _) = with("claim", &[]);
    assert_eq!((code, dup["outcome"].as_str()), (0, Some("duplicate")));
    let (code, ext, _) = with("extend", &["--token", &token, "--lease", "1m"]);
    assert_eq!(code, 0);
    assert!(ext["lease_expires_at_ms"].is_u64());
    let (code, _, err) = with("complete", &["--token", "not-the-token"]);
    assert_eq!(code, 1);
    assert!(err.contains("lease_lost"), "{err}");
    let (code, done, _) = with(
        "complete",
        &["--token", &token, "--result", r#"{"rows":3}"#],
    );
    assert_eq!(code, 0);
    assert_eq!(done["record"]["result"], json!({"rows": 3}));
    let (code, rec, _) = with("get", &[]);
    assert_eq!((code, rec["state"].as_str()), (0, Some("completed")));
    let (code, del, _) = with("forget", &[]);
    assert_eq!((code, del), (0, json!({"deleted": true})));
    let (code, _, err) = with("get", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("not_found"), "{err}");
    let (code, mark, _) = with("mark", &["--ttl", "1h"]);
    assert_eq!((code, mark["outcome"].as_str()), (0, Some("new")));
    // Usage errors exit 2, like clap's own.
    let (code, _, err) = with("claim", &["--ttl", "0s"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ttl"), "{err}");
    // Directly against a store, through the library's Gate.
    let (code, direct, _) = cli(&["claim", "--store", "memory:", "-n", "shell", "-k", "x"]);
    assert_eq!((code, direct["outcome"].as_str()), (0, Some("new")));
    let (code, _, err) = cli(&["claim", "-n", "shell", "-k", "x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--server"), "{err}");
}

/// Found by an adversarial run: `get` exited 1 both for "no record" and for a server it could
/// not reach, so a script that runs work when `get` fails would run it twice while the server
/// is down. "Could not ask" is exit 3, for every API subcommand.
#[cfg(feature = "http-client")]
#[test]
fn cli_api_subcommands_tell_could_not_ask_from_no_record() {
    // Port 1: nothing listens there (a free port found by binding could be taken meanwhile by
    // a server another test starts).
    let dead = "http://127.0.0.1:1";
    for cmd in ["get", "claim", "mark", "forget"] {
        let (code, _, err) = cli(&[cmd, "--server", dead, "-n", "shell", "-k", "a"]);
        assert_eq!(code, 3, "{cmd}: {err}");
        assert!(!err.contains("not_found"), "{cmd}: {err}");
    }
    let dir = TempDir::new("api-exit");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a store").unwrap();
    let (code, _, err) = cli(&[
        "get",
        "--store",
        file.to_str().unwrap(),
        "-n",
        "s",
        "-k",
        "a",
    ]);
    assert_eq!(code, 3, "{err}");
    // A malformed URL or store spec is a usage error, not "could not ask".
    let (code, _, err) = cli(&["get", "--server", "not-a-url", "-n", "s", "-k", "a"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli(&["get", "--store", "nosuch://x", "-n", "s", "-k", "a"]);
    assert_eq!(code, 2, "{err}");
}

/// A `--server` URL with a path the API is not under (`http://host:port/gate`) got the
/// server's 404 for an unknown path, whose code is `not_found` like a missing record's: `get`
/// said "no live record" (exit 1) for every key. The unknown-path 404 has a type of its own
/// now; the client reports it as "could not ask" (exit 3), for every API subcommand.
#[cfg(feature = "http-client")]
#[test]
fn cli_api_subcommands_tell_a_wrong_base_url_from_no_record() {
    let s = serve(&["--store", "memory:"]);
    let wrong = format!("{}/gate", s.url());
    for cmd in ["get", "claim", "mark", "forget"] {
        let (code, _, err) = cli(&[cmd, "--server", &wrong, "-n", "shell", "-k", "a"]);
        assert_eq!(code, 3, "{cmd}: {err}");
        assert!(err.contains("no such route"), "{cmd}: {err}");
        assert!(!err.contains("no live record"), "{cmd}: {err}");
    }
    // The right URL still tells "no record" apart (exit 1).
    let (code, _, err) = cli(&["get", "--server", &s.url(), "-n", "shell", "-k", "a"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not_found"), "{err}");
}

/// Found by an adversarial run: twenty `mark --store DIR` started at once failed (19 of 20,
/// "the store is in use by another process") although each holds the directory for
/// milliseconds; they wait for the lock now (`--lock-wait`, as `run` does), and every mark
/// is recorded.
#[test]
fn concurrent_api_subcommands_on_one_store_directory_wait_their_turn() {
    let dir = TempDir::new("api-lock");
    let store = dir.path().join("data");
    let store = store.to_str().unwrap();
    // All started before any is waited for.
    let children: Vec<_> = (0..12)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_dedupgate"))
                .args([
                    "mark",
                    "--lock-wait",
                    "5m",
                    "--store",
                    store,
                    "-n",
                    "many",
                    "-k",
                    &format!("k{i}"),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "mark k{i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for i in 0..12 {
        let (code, rec, err) = cli(&[
            "get",
            "--store",
            store,
            "-n",
            "many",
            "-k",
            &format!("k{i}"),
        ]);
        assert_eq!(
            (code, rec["state"].as_str()),
            (0, Some("completed")),
            "k{i}: {err}"
        );
    }
}

/// A redis-server of our own on a free port (killed on drop), so the test can take it away.
#[cfg(feature = "redis")]
struct OwnRedis {
    child: std::process::Child,
    port: u16,
}

#[cfg(feature = "redis")]
impl OwnRedis {
    fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        eventually(20, "redis-server to accept connections", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Self { child, port }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(feature = "redis")]
impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(feature = "redis")]
#[test]
fn unavailable_while_the_store_is_down_and_back_after() {
    let mut redis = OwnRedis::start(free_port());
    let store = format!("redis://127.0.0.1:{}", redis.port);
    let s = serve(&["--store", &store]);
    assert_eq!(s.get("/healthz").status, 200);
    let claim = json!({"namespace": "down", "key": "k"});
    assert_eq!(s.post_json("/v1/claim", &claim).status, 200);

    redis.stop();
    let health = s.get("/healthz");
    health.assert_problem(503, "unavailable");
    assert_eq!(health.header("retry-after"), Some("1"));
    s.post_json("/v1/claim", &json!({"namespace": "down", "key": "other"}))
        .assert_problem(503, "unavailable");
    let batch = s.post_json(
        "/v1/batch",
        &json!({"ops": [{"op": "claim", "namespace": "down", "key": "b"}]}),
    );
    assert_eq!(batch.status, 200, "{}", batch.text());
    assert_eq!(batch.json()["results"][0]["error"]["code"], "unavailable");
    assert!(
        s.log().contains("could not decide"),
        "one log line per store error:\n{}",
        s.log()
    );

    // A fresh Redis on the same port (empty: ours kept nothing): the gate answers again.
    let _redis = OwnRedis::start(redis.port);
    eventually(30, "healthz to recover", || s.get("/healthz").status == 200);
    eventually(30, "claims to be decided again", || {
        s.post_json("/v1/claim", &json!({"namespace": "down", "key": "after"}))
            .status
            == 200
    });
}

/// A loopback relay in front of the real server that passes every connection through, but for
/// the first: that one's request reaches the server and its answer is dropped (the connection
/// is closed once the server has answered), as when a network loses an answer.
#[cfg(feature = "http-client")]
struct AnswerLosingRelay {
    addr: std::net::SocketAddr,
    dropped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[cfg(feature = "http-client")]
impl AnswerLosingRelay {
    fn start(upstream: std::net::SocketAddr) -> Self {
        use std::io::Read;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let dropped = std::sync::Arc::new(AtomicUsize::new(0));
        let count = dropped.clone();
        std::thread::spawn(move || {
            for (n, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(upstream) else {
                    return;
                };
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    })
                };
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                if n == 0 {
                    // Wait for the server's answer, then close both sides without passing it on.
                    let mut server = server;
                    let mut first = [0u8; 1];
                    if server.read(&mut first).unwrap_or(0) > 0 {
                        std::thread::sleep(Duration::from_millis(100));
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    let _ = server.shutdown(std::net::Shutdown::Both);
                } else {
                    pipe(server, client);
                }
            }
        });
        Self { addr, dropped }
    }
}

/// A release whose answer was lost: the client's retry is `lease_lost` (API.md: the token has
/// released), so the client looks the key up and, finding it free, reports the release done;
/// the key is free for the next claim. A release whose key someone else holds stays
/// `lease_lost`.
#[cfg(feature = "http-client")]
#[test]
fn a_release_whose_answer_was_lost_is_reported_done_by_the_retrying_client() {
    use dedupgate_client::Client;
    use dedupgate_core::{GateError, Token};
    let s = serve(&["--store", "memory:"]);
    let claim = |key: &str| {
        let r = s.post_json("/v1/claim", &json!({"namespace": "rel", "key": key}));
        r.json()["token"].as_str().unwrap().to_owned()
    };
    let relay = AnswerLosingRelay::start(s.addr);
    let client = Client::new(&format!("http://{}", relay.addr)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let token = Token::new(claim("lost-answer"));
    rt.block_on(client.release("rel", "lost-answer", &token))
        .expect("released: the retry finds the key free");
    assert_eq!(
        relay.dropped.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the first answer was dropped"
    );
    // The wire contract itself: the same release again is lease_lost.
    let again = s.post_json(
        "/v1/release",
        &json!({"namespace": "rel", "key": "lost-answer", "token": token.as_str()}),
    );
    assert_eq!(again.status, 409);
    assert_eq!(claim("lost-answer").len(), 32, "the key is free again");
    // Someone else's claim: the stale token's release is lease_lost, through the client too.
    let stale = rt.block_on(client.release("rel", "lost-answer", &token));
    assert!(
        matches!(
            stale,
            Err(dedupgate_client::ClientError::Gate(GateError::LeaseLost))
        ),
        "{stale:?}"
    );
}

/// Found trying the gate as a new user: the namespace label was first come, first served, so
/// junk namespaces took every label and a real one arriving later counted as `other` until a
/// restart. Namespaces listed in `metrics_namespaces` always keep their label; globs let names
/// in up to `namespace_labels_max`; everything else is `other`.
#[test]
fn junk_namespaces_cannot_push_a_configured_one_into_other() {
    let dir = TempDir::new("metrics-namespaces");
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        "store = \"memory:\"\nnamespace_labels_max = 2\n\
         metrics_namespaces = [\"payments\", \"orders-*\"]\n",
    )
    .unwrap();
    let s = serve(&["--config", config.to_str().unwrap()]);
    let claim = |ns: &str| {
        let r = s.post_json("/v1/claim", &json!({"namespace": ns, "key": "k"}));
        assert_eq!(r.status, 200, "{}", r.text());
    };
    for i in 0..50 {
        claim(&format!("junk-{i}"));
    }
    for ns in ["orders-eu", "orders-us", "orders-late", "payments"] {
        claim(ns);
    }
    let text = s.get("/metrics").text();
    let new = |ns: &str| format!(r#"dedupgate_decisions_total{{namespace="{ns}",outcome="new"}} "#);
    for (ns, count) in [
        ("payments", 1),
        ("orders-eu", 1),
        ("orders-us", 1),
        ("other", 51),
    ] {
        assert!(
            text.contains(&format!("{}{count}\n", new(ns))),
            "{ns}:\n{text}"
        );
    }
    assert!(
        !text.contains("junk") && !text.contains("orders-late"),
        "{text}"
    );
    // A pattern that can match no namespace stops the start.
    std::fs::write(&config, "metrics_namespaces = [\"payments, orders\"]\n").unwrap();
    let refused = try_serve(&["--config", config.to_str().unwrap()], &[]);
    assert!(
        refused
            .as_ref()
            .is_err_and(|log| log.contains("metrics_namespaces")),
        "{:?}",
        refused.map(|s| s.addr)
    );
}
