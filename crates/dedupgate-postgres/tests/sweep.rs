//! The bounded sweeper: it removes at most its batch, only expired rows, through the index.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::time::Duration;

use dedupgate_core::{Claim, Op, Outcome, RecordId, Store};

fn mark(ttl_ms: u64) -> Op {
    Op::Mark {
        ttl_ms,
        fingerprint: None,
        result: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_is_bounded_and_keeps_live_rows() {
    let url = common::url();
    let schema = common::fresh_schema("sweep");
    let store = common::open(&url, &schema, 2).await;
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let id = |k: String| RecordId::new("sweep", k).unwrap();
        let short: Vec<_> = (0..25).map(|i| (id(format!("short-{i}")), mark(200))).collect();
        let long: Vec<_> = (0..5).map(|i| (id(format!("long-{i}")), mark(600_000))).collect();
        assert!(store.apply_ops(short).await.iter().all(|r| r.is_ok()));
        assert!(store.apply_ops(long).await.iter().all(|r| r.is_ok()));
        // A claim whose fence must survive the sweep of its expired predecessor's row.
        let Ok(Outcome::Claimed(Claim::New(first))) = store
            .apply_op(
                id("fenced".into()),
                Op::Claim {
                    ttl_ms: 200,
                    lease_ms: 100,
                    fingerprint: None,
                    owner: None,
                },
            )
            .await
        else {
            panic!("fresh claim")
        };
        tokio::time::sleep(Duration::from_millis(400)).await;

        assert_eq!(store.sweep_expired(10).await.unwrap(), 10, "bounded by the batch");
        assert_eq!(store.sweep_expired(10).await.unwrap(), 10);
        assert_eq!(store.sweep_expired(10).await.unwrap(), 6, "25 marks + 1 claim expired");
        assert_eq!(store.sweep_expired(10).await.unwrap(), 0);
        assert_eq!(store.stats().await.unwrap().swept_total, Some(26));

        let client = common::connect(&u).await;
        let left: i64 = client
            .query_one(&format!("SELECT count(*) FROM \"{s}\".dedupgate_records"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(left, 5, "live rows are never swept");
        // The sweep finds expired rows through the expires_at_ms index, not a table scan.
        client
            .batch_execute("SET enable_seqscan = off")
            .await
            .unwrap();
        let plan: Vec<String> = client
            .query(
                &format!(
                    "EXPLAIN SELECT ctid FROM \"{s}\".dedupgate_records WHERE expires_at_ms <= 0 LIMIT 10"
                ),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            plan.iter().any(|l| l.contains("dedupgate_records_expires_at_ms")),
            "{plan:#?}"
        );
        // After its row is gone, the clock term still gives the next claim a higher fence.
        let Ok(Outcome::Claimed(Claim::New(second))) = store
            .apply_op(
                id("fenced".into()),
                Op::Claim {
                    ttl_ms: 1_000,
                    lease_ms: 500,
                    fingerprint: None,
                    owner: None,
                },
            )
            .await
        else {
            panic!("claim after sweep")
        };
        assert!(second.fence > first.fence);
    })
    .await;
}
