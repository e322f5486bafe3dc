//! The PostgreSQL upsert sink against the machine's PostgreSQL (`DEDUPGATE_TEST_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`), a fresh table per test: rows applied, a
//! lower version after a higher one refused as stale (and acked), the gate's fence as the
//! version (a takeover's write wins over the stale holder's late one), the counters on
//! `/metrics`, names refused before anything connects; and a route from the machine's NATS
//! JetStream (`DEDUPGATE_TEST_NATS_URL`) with duplicates, one row per key.

mod common;

use std::sync::Arc;

use dedupgate_core::{Claim, ClaimOptions, Gate, ManualClock, MemoryStore};
use dedupgate_relay::metrics::{Metrics, RouteMetrics};
use dedupgate_relay::{Outgoing, RouteConfig, Sink, SinkError, SinkSpec};

fn pg_url() -> String {
    std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

async fn client() -> tokio_postgres::Client {
    let url = pg_url();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("this test needs PostgreSQL at {url}: {e}"));
    tokio::spawn(connection);
    client
}

/// A fresh table with the given columns' names; returns its name.
async fn table(db: &tokio_postgres::Client, prefix: &str, columns: [&str; 3]) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let name = format!("{prefix}_{}_{nanos}", std::process::id());
    let [k, p, v] = columns;
    db.batch_execute(&format!(
        "CREATE TABLE {name} ({k} text PRIMARY KEY, {p} jsonb NOT NULL, {v} bigint NOT NULL)"
    ))
    .await
    .expect("create table");
    name
}

/// The sink at `query`, counting into a route `pg` of `metrics`.
async fn sink(metrics: &mut Metrics, query: &str) -> (Arc<dyn Sink>, Arc<RouteMetrics>) {
    let spec: SinkSpec = format!("{}?{query}", pg_url()).parse().expect("a sink URL");
    let route = metrics.add("pg");
    let sink = dedupgate_relay::sink::open(&spec, &route)
        .await
        .expect("open");
    (sink, route)
}

fn out<'a>(key: &'a str, payload: &'a [u8], fence: Option<u64>) -> Outgoing<'a> {
    Outgoing {
        key,
        payload,
        headers: &[],
        fence,
    }
}

/// The stored (payload, version) of `key`.
async fn row(db: &tokio_postgres::Client, sql: &str, key: &str) -> (String, i64) {
    let r = db.query_one(sql, &[&key]).await.expect("the row");
    (r.get(0), r.get(1))
}

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test]
async fn a_lower_version_after_a_higher_one_is_refused_as_stale_and_acked() {
    let db = client().await;
    let t = table(&db, "relay_pg_field", ["id", "doc", "seq"]).await;
    let mut metrics = Metrics::default();
    let (sink, m) = sink(
        &mut metrics,
        &format!("table={t}&key_column=id&payload_column=doc&version_column=seq&version=seq"),
    )
    .await;
    let read = format!("SELECT doc::text, seq FROM {t} WHERE id = $1");

    sink.send(out("acct-1", br#"{"seq":2,"balance":20}"#, Some(1)))
        .await
        .expect("applied");
    sink.send(out("acct-1", br#"{"seq":1,"balance":10}"#, Some(2)))
        .await
        .expect("a stale row is confirmed all the same");
    sink.send(out("acct-1", br#"{"seq":2,"balance":99}"#, Some(3)))
        .await
        .expect("an equal version is stale too");
    assert_eq!(
        row(&db, &read, "acct-1").await,
        (r#"{"seq": 2, "balance": 20}"#.to_owned(), 2)
    );
    sink.send(out("acct-1", br#"{"seq":3,"balance":30}"#, Some(4)))
        .await
        .expect("applied");
    assert_eq!(row(&db, &read, "acct-1").await.1, 3);
    sink.send(out("acct-2", br#"{"seq":1}"#, None))
        .await
        .expect("a new key is applied");
    assert_eq!(
        (count(&m.sink_rows_applied), count(&m.sink_rows_stale)),
        (3, 2)
    );
    let text = metrics.render();
    assert!(
        text.contains("dedupgate_relay_sink_rows_total{route=\"pg\",outcome=\"applied\"} 3\n"),
        "{text}"
    );
    assert!(text.contains("dedupgate_relay_sink_rows_total{route=\"pg\",outcome=\"stale\"} 2\n"));

    // What cannot be a row is refused (dead-lettered), never retried.
    for (payload, why) in [
        (&b"not json"[..], "not JSON"),
        (&br#"{"balance":1}"#[..], "no integer field \"seq\""),
        (&br#"{"seq":"7"}"#[..], "no integer field \"seq\""),
    ] {
        match sink.send(out("acct-3", payload, Some(1))).await {
            Err(SinkError::Refused { reason, .. }) => assert!(reason.contains(why), "{reason}"),
            other => panic!("refused: {other:?}"),
        }
    }
    db.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
}

#[tokio::test]
async fn with_the_fence_as_version_a_takeover_wins_over_the_stale_holders_late_write() {
    let db = client().await;
    let t = table(&db, "relay_pg_fence", ["key", "payload", "version"]).await;
    let mut metrics = Metrics::default();
    let (sink, m) = sink(&mut metrics, &format!("table={t}")).await;
    let read = format!("SELECT payload::text, version FROM {t} WHERE key = $1");

    // Holder A claims, stalls past its lease; B takes the key over with a higher fence.
    let clock = ManualClock::new(1_000_000);
    let gate = Gate::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let opts = || ClaimOptions {
        lease_ms: Some(1_000),
        ..Default::default()
    };
    let Claim::New(a) = gate.claim("orders", "o-1", opts()).await.unwrap() else {
        panic!("A claims")
    };
    clock.advance(2_000);
    let Claim::New(b) = gate.claim("orders", "o-1", opts()).await.unwrap() else {
        panic!("B takes over after A's lease")
    };
    assert!(b.fence > a.fence);

    sink.send(out("o-1", br#"{"by":"B"}"#, Some(b.fence)))
        .await
        .expect("B's write");
    sink.send(out("o-1", br#"{"by":"A"}"#, Some(a.fence)))
        .await
        .expect("A's late write is confirmed, not applied");
    assert_eq!(
        row(&db, &read, "o-1").await,
        (r#"{"by": "B"}"#.to_owned(), b.fence as i64)
    );
    assert_eq!(
        (count(&m.sink_rows_applied), count(&m.sink_rows_stale)),
        (1, 1)
    );

    // A dead letter has no fence to write.
    let letter = sink.send(out("o-2", b"{}", None)).await;
    assert!(
        matches!(letter, Err(SinkError::Refused { .. })),
        "{letter:?}"
    );
    db.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
}

#[tokio::test]
async fn bad_names_are_refused_when_the_route_is_checked_and_a_missing_table_when_it_opens() {
    let route = |to: String| RouteConfig {
        from: "nats://127.0.0.1:4222/S?consumer=c".into(),
        to,
        ..Default::default()
    };
    let err = route(format!("{}?table=orders;drop", pg_url()))
        .check(0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("table=") && err.contains("not a plain identifier"),
        "{err}"
    );
    let err = route(format!("{}?table=t&version_column=v%20x", pg_url()))
        .check(0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("version_column="), "{err}");
    let mut dead = route("stdout:".into());
    dead.dead_letter = Some(format!("{}?table=t", pg_url()));
    let err = dead.check(0).unwrap_err().to_string();
    assert!(err.contains("dead_letter"), "{err}");

    let spec: SinkSpec = format!("{}?table=relay_pg_no_such_table", pg_url())
        .parse()
        .unwrap();
    let opened = dedupgate_relay::sink::open(&spec, &Arc::new(RouteMetrics::default())).await;
    match opened {
        Err(SinkError::Open { reason, .. }) => {
            assert!(reason.contains("relay_pg_no_such_table"), "{reason}")
        }
        Err(other) => panic!("an open error: {other}"),
        Ok(_) => panic!("a missing table fails the open"),
    }
}

/// A JetStream source with copies of earlier keys, relayed to the upsert sink: one row per key,
/// each written once (applied, none stale: a copy is a duplicate at the gate, never forwarded),
/// with its claim's fence as the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nats_route_writes_each_key_once_with_its_fence() {
    const M: usize = 40;
    const DISTINCT: usize = 30;
    let db = client().await;
    let t = table(&db, "relay_pg_route", ["key", "payload", "version"]).await;
    let stream = t.replace('_', "-");
    let payloads = (0..M).map(|i| format!(r#"{{"id":"k-{}","n":{i}}}"#, i % DISTINCT));
    let nats = common::jetstream_source(&stream, payloads).await;
    let relay = common::start(
        RouteConfig {
            name: Some("pg".into()),
            from: format!("{nats}/{stream}?consumer=relay"),
            to: format!("{}?table={t}", pg_url()),
            key: Some("{id}".into()),
            ..Default::default()
        },
        None,
    );
    let rows = format!("SELECT count(*) FROM {t}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while db.query_one(&rows, &[]).await.unwrap().get::<_, i64>(0) < DISTINCT as i64 {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for the rows"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let metrics = relay.stop().await;
    let m = metrics.route("pg").expect("route metrics");
    assert_eq!(
        (count(&m.sink_rows_applied), count(&m.sink_rows_stale)),
        (DISTINCT as u64, 0)
    );
    assert_eq!(count(&m.forwarded), DISTINCT as u64);
    // Each row holds one of its key's messages (whichever copy claimed first), with a fence as
    // its version.
    let stored = db
        .query(
            &format!("SELECT key, (payload->>'n')::int, version FROM {t}"),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(stored.len(), DISTINCT);
    for r in stored {
        let (key, n, version): (String, i32, i64) = (r.get(0), r.get(1), r.get(2));
        assert_eq!(
            format!("k-{}", n as usize % DISTINCT),
            key,
            "a message of its key"
        );
        assert!(version > 0, "{key}: version {version}");
    }
    db.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
}
