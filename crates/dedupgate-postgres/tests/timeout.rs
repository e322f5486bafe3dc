//! An op that outlasts `op_timeout` (here: waiting for a row another transaction holds) answers
//! `unavailable`, and its statement does not go on holding the pooled connection and the rows
//! it took: the next op on that connection is decided at once.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, GateError, Op, Outcome, RecordId, StoreError};
use dedupgate_postgres::PgStore;

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: 60_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_batch_frees_its_connection() {
    let url = common::url();
    let schema = common::fresh_schema("timeout");
    let (config, mut options) = dedupgate_postgres::parse_url(&url).unwrap();
    options.schema = schema.clone();
    // One connection: the op after the timed-out one gets the same connection.
    options.pool_size = 1;
    options.op_timeout_ms = 500;
    let store = PgStore::connect(config, options).await.unwrap();
    let u = url.clone();
    common::with_schema_dropped(&url, &schema, async move {
        let held = RecordId::new("timeout", "held").unwrap();
        let mut client = common::connect(&u).await;
        let tx = client.transaction().await.unwrap();
        let claim = store
            .claim_in(&tx, held.clone(), claim_op().try_into().unwrap())
            .await
            .unwrap();
        assert!(matches!(claim, Claim::New(_)), "{claim:?}");

        // Waits for the row the open transaction holds, past the timeout.
        let other = RecordId::new("timeout", "other").unwrap();
        let ops = vec![(other.clone(), claim_op()), (held.clone(), claim_op())];
        for answer in store.apply_ops(ops).await {
            assert!(
                matches!(answer, Err(GateError::Store(StoreError::Unavailable(_)))),
                "{answer:?}"
            );
        }

        // The next batch on the one connection is decided at once, and the timed-out batch
        // took nothing: its other key is still free.
        let started = Instant::now();
        let free = RecordId::new("timeout", "free").unwrap();
        let ops = vec![(free, claim_op()), (other, claim_op())];
        for answer in store.apply_ops(ops).await {
            assert!(
                matches!(answer, Ok(Outcome::Claimed(Claim::New(_)))),
                "after a timeout: {answer:?}"
            );
        }
        assert!(started.elapsed() < Duration::from_millis(500));
        tx.rollback().await.unwrap();
    })
    .await;
}
