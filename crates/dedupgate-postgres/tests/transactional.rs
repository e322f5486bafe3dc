//! The transactional API: a business write and its dedup record commit or roll back together.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::time::Duration;

use dedupgate_core::{Claim, Mark, Op, Outcome, RecordId, State};
use dedupgate_postgres::PgStore;
use serde_json::json;

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: 60_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

async fn get(store: &PgStore, id: &RecordId) -> Option<dedupgate_core::Record> {
    match store.apply_op(id.clone(), Op::Get).await {
        Ok(Outcome::Found(r)) => r,
        other => panic!("get: {other:?}"),
    }
}

async fn orders(client: &tokio_postgres::Client, table: &str, id: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE id = $1"),
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_leaves_nothing_and_commit_leaves_both() {
    let url = common::url();
    let schema = common::fresh_schema("tx");
    let store = common::open(&url, &schema, 4).await;
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let table = format!("\"{s}\".orders");
        let mut client = common::connect(&u).await;
        client
            .batch_execute(&format!(
                "CREATE TABLE {table} (id text PRIMARY KEY, amount int)"
            ))
            .await
            .unwrap();
        let id = RecordId::new("payments", "evt_\0_1").unwrap();

        // Rolled back: neither the order nor the claim exists afterwards.
        let tx = client.transaction().await.unwrap();
        let claim = store
            .claim_in(&tx, id.clone(), valid(claim_op()))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::New(_)), "{claim:?}");
        tx.execute(&format!("INSERT INTO {table} VALUES ('o1', 100)"), &[])
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        assert_eq!(
            get(&store, &id).await,
            None,
            "a rolled-back claim left a record"
        );
        assert_eq!(orders(&client, &table, "o1").await, 0);

        // Committed: the order and the completed record both exist; a redelivery is a duplicate.
        let tx = client.transaction().await.unwrap();
        let Claim::New(lease) = store
            .claim_in(&tx, id.clone(), valid(claim_op()))
            .await
            .unwrap()
        else {
            panic!("the key is free again after the rollback")
        };
        tx.execute(&format!("INSERT INTO {table} VALUES ('o1', 100)"), &[])
            .await
            .unwrap();
        let done = store
            .apply_in(
                &tx,
                id.clone(),
                valid(Op::Complete {
                    token: lease.token.clone(),
                    result: Some(json!({"order": "o1", "amount": 100})),
                    ttl_ms: None,
                }),
            )
            .await
            .unwrap();
        assert!(matches!(done, Outcome::Completed(_)), "{done:?}");
        tx.commit().await.unwrap();
        assert_eq!(orders(&client, &table, "o1").await, 1);
        let rec = get(&store, &id).await.expect("committed record");
        assert_eq!(rec.state, State::Completed);
        assert_eq!(rec.result, Some(json!({"order": "o1", "amount": 100})));
        assert!(matches!(
            store.apply_op(id.clone(), claim_op()).await,
            Ok(Outcome::Claimed(Claim::Duplicate { .. }))
        ));

        // mark_in follows the same rule.
        let mid = RecordId::new("payments", "evt_mark").unwrap();
        let tx = client.transaction().await.unwrap();
        let m = store
            .mark_in(&tx, mid.clone(), 60_000, None, Some(json!(1)))
            .await
            .unwrap();
        assert!(matches!(m, Mark::New { .. }), "{m:?}");
        tx.rollback().await.unwrap();
        assert_eq!(get(&store, &mid).await, None);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_an_open_transaction_then_sees_its_outcome() {
    let url = common::url();
    let schema = common::fresh_schema("txwait");
    let store = std::sync::Arc::new(common::open(&url, &schema, 4).await);
    let u = url.clone();
    common::with_schema_dropped(&url, &schema, async move {
        let mut client = common::connect(&u).await;
        for commit in [true, false] {
            let id = RecordId::new("ns", format!("k-{commit}")).unwrap();
            let tx = client.transaction().await.unwrap();
            let first = store
                .claim_in(&tx, id.clone(), valid(claim_op()))
                .await
                .unwrap();
            assert!(matches!(first, Claim::New(_)));
            // Another gate claims the same key while the transaction is open.
            let other = {
                let (store, id) = (store.clone(), id.clone());
                tokio::spawn(async move { store.apply_op(id, claim_op()).await })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            if commit {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            let answer = other.await.unwrap();
            if commit {
                assert!(
                    matches!(answer, Ok(Outcome::Claimed(Claim::Duplicate { .. }))),
                    "after commit: {answer:?}"
                );
            } else {
                assert!(
                    matches!(answer, Ok(Outcome::Claimed(Claim::New(_)))),
                    "after rollback: {answer:?}"
                );
            }
        }
    })
    .await;
}

/// The test's op as the core builds it (the transactional API takes only a validated op).
fn valid(op: Op) -> dedupgate_core::ValidOp {
    op.try_into().expect("the test's ops are valid")
}
