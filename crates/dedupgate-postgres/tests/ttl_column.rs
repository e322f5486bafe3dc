//! Schema v2's `ttl_ms` is set on in_progress rows only (v2.sql): every other row, the
//! tombstones that release and forget leave included, has it NULL, so an older build's reading
//! of those rows is not changed by it, nor a completed row's expiry by a claim it took over.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::time::Duration;

use dedupgate_core::{Claim, Mark, Op, Outcome, RecordId};

fn claim(ttl_ms: u64, lease_ms: u64) -> Op {
    Op::Claim {
        ttl_ms,
        lease_ms,
        fingerprint: None,
        owner: None,
    }
}

/// The stored row's state and ttl_ms.
async fn row(client: &tokio_postgres::Client, schema: &str, key: &str) -> (i16, Option<i64>) {
    let r = client
        .query_one(
            &format!("SELECT state, ttl_ms FROM \"{schema}\".dedupgate_records WHERE key = $1"),
            &[&key.as_bytes()],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_forget_tombstones_keep_no_ttl() {
    let url = common::url();
    let schema = common::fresh_schema("tombttl");
    let store = common::open(&url, &schema, 2).await;
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let client = common::connect(&u).await;
        for (key, release) in [("released", true), ("forgotten", false)] {
            let id = RecordId::new("tombttl", key).unwrap();
            let Ok(Outcome::Claimed(Claim::New(lease))) =
                store.apply_op(id.clone(), claim(60_000, 30_000)).await
            else {
                panic!("{key}: claim not new")
            };
            assert_eq!(row(&client, &s, key).await, (0, Some(60_000)), "{key}");
            let op = if release {
                Op::Release { token: lease.token }
            } else {
                Op::Forget
            };
            assert!(store.apply_op(id, op).await.is_ok(), "{key}");
            assert_eq!(
                row(&client, &s, key).await,
                (2, None),
                "{key}: a tombstone keeps no ttl_ms"
            );
        }
    })
    .await;
}

/// A mark that takes over a claim whose lease passed writes a completed row without the taken
/// claim's ttl_ms, alone (dedupgate_mark) and in a batch of distinct keys (mark_distinct).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_taking_over_a_claim_keeps_no_ttl() {
    let url = common::url();
    let schema = common::fresh_schema("markttl");
    let store = common::open(&url, &schema, 2).await;
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let client = common::connect(&u).await;
        let id = |k: &str| RecordId::new("markttl", k).unwrap();
        let keys = ["single", "batch-a", "batch-b"];
        for key in keys {
            let r = store.apply_op(id(key), claim(60_000, 100)).await;
            assert!(
                matches!(r, Ok(Outcome::Claimed(Claim::New(_)))),
                "{key}: {r:?}"
            );
            assert_eq!(row(&client, &s, key).await, (0, Some(60_000)), "{key}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await; // the leases pass
        let mark = || Op::Mark {
            ttl_ms: 30_000,
            fingerprint: None,
            result: None,
        };
        let single = store.apply_op(id("single"), mark()).await;
        let batch = store
            .apply_ops(vec![(id("batch-a"), mark()), (id("batch-b"), mark())])
            .await;
        for (key, r) in keys.into_iter().zip([single].into_iter().chain(batch)) {
            assert!(
                matches!(r, Ok(Outcome::Marked(Mark::New { .. }))),
                "{key}: {r:?}"
            );
            assert_eq!(
                row(&client, &s, key).await,
                (1, None),
                "{key}: the taken claim's ttl_ms is not kept"
            );
        }
    })
    .await;
}
