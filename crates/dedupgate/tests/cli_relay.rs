//! `dedupgate relay` as a user runs it: bad URLs are refused at start with a message that
//! names the URL and what is wrong (exit 1; a missing flag is a usage error, exit 2), and a
//! RabbitMQ queue of 40 messages, 10 of them copies, relayed to stdout comes out one line per
//! key, every message acked, and SIGTERM stops it with exit 0 (against the machine's RabbitMQ,
//! `DEDUPGATE_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`).
//!
//! `--to kafka://HOST:PORT/TOPIC?transactional=ID`: the route is refused at start (exit 1, a
//! message naming the route's field and why, no Rust type names) when the source is not Kafka
//! (no Kafka transaction can cover a RabbitMQ or JetStream ack), when the sink is on another
//! cluster than the source, in idempotent mode (an aborted transaction must release its
//! claims; a mark cannot be released), or when the id is empty; the same from a TOML
//! `[[route]]`. Nothing is contacted: the checks run before any connection.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

// The consumers crate's RabbitMQ helpers, shared rather than copied; this file uses part of it.
#[allow(dead_code)]
#[path = "../../dedupgate-consumers/tests/common/amqp.rs"]
mod amqp;

fn relay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .arg("relay")
        .args(args)
        .output()
        .expect("run dedupgate")
}

/// Refused at start: exit 1, `dedupgate: ` and the `expected` reason on stderr, and no Rust
/// type names or debug output.
fn assert_refused(out: &std::process::Output, expected: &str, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
    assert!(stderr.contains(expected), "{what}: {stderr}");
    assert!(stderr.starts_with("dedupgate: "), "{what}: {stderr}");
    for noise in ["Error {", "::", "Some(", "Field {", "Url {"] {
        assert!(!stderr.contains(noise), "{what}: {stderr}");
    }
}

#[test]
fn bad_urls_exit_1_with_a_message_naming_the_url_and_the_problem() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["--from", "http://h/x", "--to", "stdout:"],
            "unknown source scheme \"http\"",
        ),
        (
            &["--from", "kafka://127.0.0.1:9/t", "--to", "stdout:"],
            "group= is required",
        ),
        (
            &["--from", "amqp://h/%2f", "--to", "stdout:"],
            "queue= is required",
        ),
        (
            &["--from", "nats://h:4222/S?consumer=c", "--to", "s3://b/k"],
            "unknown sink scheme \"s3\"",
        ),
        (
            &["--from", "nats://h:4222/S?consumer=c", "--to", "file:"],
            "no path",
        ),
        (
            &[
                "--from",
                "kafka://a:1/t?group=g",
                "--to",
                "stdout:",
                "--dead-letter",
                "file:/tmp/x",
            ],
            "its own cluster",
        ),
    ];
    for (args, expected) in cases {
        let mut all = args.to_vec();
        all.extend(["--store", "memory:"]);
        assert_refused(&relay(&all), expected, &format!("{args:?}"));
    }
    // A missing --to is a usage error, and so are route flags beside --config.
    let out = relay(&["--from", "kafka://h:1/t?group=g"]);
    assert_eq!(out.status.code(), Some(2));
    let out = relay(&["--config", "relay.toml", "--from", "kafka://h:1/t?group=g"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_config_file_with_a_bad_route_or_field_exits_1_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[[route]]\nname = \"orders\"\nfrom = \"kafka://h:1/t?group=g\"\nto = \"stdout:\"\nmode = \"twice\"\n",
            "route \"orders\": mode",
        ),
        (
            "[[route]]\nfrom = \"kafka://h:1/t?group=g\"\nto = \"stdout:\"\nsink = \"x\"\n",
            // The file, line and column of the TOML error, then its message.
            "relay-1.toml:4:1: unknown field `sink`",
        ),
        ("metrics_listen = \"127.0.0.1:0\"\n", "no route"),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("relay-{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = relay(&["--config", path.to_str().unwrap(), "--store", "memory:"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{text}: {stderr}");
        assert!(stderr.contains(expected), "{text}: {stderr}");
    }
}

#[test]
fn rabbitmq_to_stdout_prints_each_key_once_and_stops_cleanly_on_sigterm() {
    let url = amqp::url();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let queue = format!("dedupgate-cli-relay-{}", std::process::id());
    let (total, distinct) = (40usize, 30usize);
    let channel = runtime.block_on(async {
        let conn = amqp::connect().await;
        let channel = amqp::confirming_channel(&conn).await;
        channel
            .queue_declare(
                queue.as_str(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        for i in 0..total {
            let key = format!("order-{}", i % distinct);
            let body = format!(r#"{{"order":"{key}"}}"#);
            amqp::publish(&channel, &queue, Some(&key), body.as_bytes()).await;
        }
        std::mem::forget(conn);
        channel
    });
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args([
            "relay",
            "--from",
            &format!("{url}?queue={queue}"),
            "--to",
            "stdout:",
        ])
        .args(["--store", "memory:"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut keys = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Until every key came, then 1 s more so a second copy would show.
    let mut quiet_until = None;
    loop {
        if keys.len() == distinct {
            let until = *quiet_until.get_or_insert_with(|| Instant::now() + Duration::from_secs(1));
            if Instant::now() >= until {
                break;
            }
        }
        assert!(Instant::now() < deadline, "timed out: {keys:?}");
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
            assert_eq!(v["payload"]["order"], v["key"], "{line}");
            *keys
                .entry(v["key"].as_str().unwrap().to_owned())
                .or_insert(0) += 1;
        }
    }
    // Copies that met their key in progress are requeued for a moment: let them settle.
    std::thread::sleep(Duration::from_secs(2));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let left = runtime.block_on(async {
        let left = amqp::message_count(&channel, &queue)
            .await
            .expect("the queue");
        let _ = channel
            .queue_delete(queue.as_str(), QueueDeleteOptions::default())
            .await;
        left
    });
    assert_eq!(status.code(), Some(0), "exit after SIGTERM");
    assert_eq!(keys.len(), distinct);
    assert!(
        keys.values().all(|n| *n == 1),
        "a key printed twice: {keys:?}"
    );
    assert_eq!(left, 0, "every message acked");
}

/// Publishes `ids` (as message ids and payloads) to `queue`, declared if missing, confirmed.
async fn publish(channel: &lapin::Channel, queue: &str, ids: &[String]) {
    channel
        .queue_declare(queue, QueueDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap();
    for id in ids {
        let body = format!(r#"{{"id":"{id}"}}"#);
        amqp::publish(channel, queue, Some(id), body.as_bytes()).await;
    }
}

fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Two routes of one `--config` file, sharing one embedded store, each forward their queue's
/// keys once; after a restart, the same messages published again are all duplicates (the
/// store is durable), so the files do not grow.
#[test]
fn a_config_of_two_routes_over_one_embedded_store_remembers_keys_across_a_restart() {
    let url = amqp::url();
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    let queues = [
        format!("dedupgate-cli-a-{pid}"),
        format!("dedupgate-cli-b-{pid}"),
    ];
    let outs = [dir.path().join("a.jsonl"), dir.path().join("b.jsonl")];
    let config = dir.path().join("relay.toml");
    let mut text = format!(
        "[[route]]\nname = \"a\"\nfrom = \"{url}?queue={}\"\nto = \"file:{}\"\nstore = \"{}\"\n",
        queues[0],
        outs[0].display(),
        dir.path().join("gate").display()
    );
    text += &format!(
        "[[route]]\nname = \"b\"\nfrom = \"{url}?queue={}\"\nto = \"file:{}\"\nstore = \"{}\"\n",
        queues[1],
        outs[1].display(),
        dir.path().join("gate").display()
    );
    std::fs::write(&config, text).unwrap();
    // 12 messages per queue, 8 distinct ids; the two routes' namespaces differ, so the same
    // ids in both queues are forwarded by each.
    let ids: Vec<String> = (0..12).map(|i| format!("id-{}", i % 8)).collect();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (conn, channel) = runtime.block_on(async {
        let conn = amqp::connect().await;
        let channel = amqp::confirming_channel(&conn).await;
        (conn, channel)
    });
    for round in 0..2 {
        runtime.block_on(async {
            for q in &queues {
                publish(&channel, q, &ids).await;
            }
        });
        let mut child = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
            .args(["relay", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Until both queues are drained (ready and unacked: the consumer count is ours alone).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready: u32 = runtime.block_on(async {
                let mut n = 0;
                for q in &queues {
                    n += amqp::message_count(&channel, q).await.expect("the queue");
                }
                n
            });
            let forwarded = outs.iter().all(|o| lines(o).len() >= 8);
            if ready == 0 && forwarded {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: {ready} ready, files {:?}",
                outs.iter().map(|o| lines(o).len()).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Requeued copies (their key was in progress) come back within a second or so.
        std::thread::sleep(Duration::from_secs(2));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(0), "round {round}");
        for out in &outs {
            let mut keys: Vec<String> = lines(out)
                .iter()
                .map(|l| {
                    serde_json::from_str::<serde_json::Value>(l).unwrap()["key"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
                .collect();
            keys.sort();
            let expected: Vec<String> = (0..8).map(|i| format!("id-{i}")).collect();
            assert_eq!(keys, expected, "round {round}: {}", out.display());
        }
    }
    runtime.block_on(async {
        for q in &queues {
            let left = amqp::message_count(&channel, q).await.expect("the queue");
            assert_eq!(left, 0, "{q}");
            let _ = channel
                .queue_delete(q.as_str(), QueueDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "done").await;
    });
}

#[test]
fn a_transactional_sink_is_refused_from_rabbitmq_nats_another_cluster_or_idempotent_mode() {
    let tx = "kafka://127.0.0.1:9/out?transactional=relay-0";
    let cases: [(&[&str], &str); 5] = [
        (
            &["--from", "amqp://guest:guest@127.0.0.1:9/%2f?queue=q", "--to", tx],
            "route \"route-1\": to: transactional= needs a Kafka source: no Kafka transaction can cover a RabbitMQ ack",
        ),
        (
            &["--from", "nats://127.0.0.1:9/S?consumer=c", "--to", tx],
            "no Kafka transaction can cover a JetStream ack",
        ),
        (
            &["--from", "kafka://10.0.0.1:9092/in?group=g", "--to", tx],
            "to: transactional= needs the sink on the source's cluster (kafka://10.0.0.1:9092/TOPIC)",
        ),
        (
            &[
                "--from",
                "kafka://127.0.0.1:9/in?group=g",
                "--to",
                tx,
                "--mode",
                "idempotent",
            ],
            "mode: idempotent cannot run with a transactional= sink: a transaction that aborts must release its claims, and a mark cannot be released",
        ),
        (
            &[
                "--from",
                "kafka://127.0.0.1:9/in?group=g",
                "--to",
                "kafka://127.0.0.1:9/out?transactional=",
            ],
            "transactional= needs an id",
        ),
    ];
    for (args, expected) in cases {
        let mut all = args.to_vec();
        all.extend(["--store", "memory:"]);
        assert_refused(&relay(&all), expected, &format!("{args:?}"));
    }
}

#[test]
fn a_toml_route_with_a_transactional_sink_is_checked_alike() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        "[[route]]\nname = \"orders\"\nfrom = \"amqp://guest:guest@127.0.0.1:9/%2f?queue=q\"\nto = \"kafka://127.0.0.1:9/out?transactional=relay-0\"\n",
    )
    .unwrap();
    let out = relay(&["--config", path.to_str().unwrap(), "--store", "memory:"]);
    assert_refused(
        &out,
        "route \"orders\": to: transactional= needs a Kafka source",
        "toml",
    );
}
