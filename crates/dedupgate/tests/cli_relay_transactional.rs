//! `dedupgate relay --to kafka://HOST:PORT/TOPIC?transactional=ID` as a user runs it: the route
//! is refused at start (exit 1, a message naming the route's field and why, no Rust type names)
//! when the source is not Kafka (no Kafka transaction can cover a RabbitMQ or JetStream ack),
//! when the sink is on another cluster than the source, in idempotent mode (an aborted
//! transaction must release its claims; a mark cannot be released), or when the id is empty;
//! the same from a TOML `[[route]]`. Nothing is contacted: the checks run before any connection.

use std::process::Command;

fn relay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .arg("relay")
        .args(args)
        .output()
        .expect("run dedupgate")
}

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
