//! A batch of claims (or marks) of distinct new keys answers each key from the row it inserted,
//! without reading the row again (`dedupgate_claim_distinct` / `dedupgate_mark_distinct` in
//! `src/functions.sql`); rows whose clock moved during the insert are stamped again and read
//! back. Whichever way a key went, its answer must be exactly the row that was committed.
//! Thousands of keys per batch, so that some rows are stamped again (a millisecond passes
//! during the insert) and most are not.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashSet;
use std::time::Duration;

use dedupgate_core::{Claim, GateError, Mark, Op, Outcome, RecordId, State};

const KEYS: usize = 5_000;

fn claim(fingerprint: Option<&str>, ttl_ms: u64, lease_ms: u64) -> Op {
    Op::Claim {
        ttl_ms,
        lease_ms,
        fingerprint: fingerprint.map(str::to_owned),
        owner: None,
    }
}

fn mark(fingerprint: Option<&str>) -> Op {
    Op::Mark {
        ttl_ms: 3_600_000,
        fingerprint: fingerprint.map(str::to_owned),
        result: None,
    }
}

#[tokio::test]
async fn a_batch_of_new_keys_answers_each_with_the_row_it_committed() {
    let url = common::url();
    let schema = common::fresh_schema("batch_answers");
    let body_schema = schema.clone();
    common::with_schema_dropped(&url.clone(), &schema, async move {
        let store = common::open(&url, &body_schema, 2).await;
        let id = |what: &str, i: usize| RecordId::new("batch", format!("{what}-{i}")).unwrap();

        let claims: Vec<_> = (0..KEYS)
            .map(|i| {
                let op = Op::Claim {
                    ttl_ms: 3_600_000,
                    lease_ms: 60_000,
                    fingerprint: Some(format!("fp-{i}")),
                    owner: Some(format!("worker-{}", i % 7)),
                };
                (id("claim", i), op)
            })
            .collect();
        let answers = store.apply_ops(claims).await;
        let mut tokens = HashSet::new();
        for (i, answer) in answers.into_iter().enumerate() {
            let lease = match answer {
                Ok(Outcome::Claimed(Claim::New(lease))) => lease,
                other => panic!("claim {i}: {other:?}"),
            };
            assert!(
                tokens.insert(lease.token.clone()),
                "claim {i}: token repeated"
            );
            let row = match store.apply_op(id("claim", i), Op::Get).await {
                Ok(Outcome::Found(Some(row))) => row,
                other => panic!("get claim {i}: {other:?}"),
            };
            assert_eq!(row.state, State::InProgress, "claim {i}");
            assert_eq!(row.fence, lease.fence, "claim {i}: fence");
            assert_eq!(row.expires_at_ms, lease.expires_at_ms, "claim {i}: expiry");
            assert_eq!(
                row.lease_expires_at_ms,
                Some(lease.lease_expires_at_ms),
                "claim {i}: lease"
            );
            assert_eq!(row.fingerprint.as_deref(), Some(&*format!("fp-{i}")));
            assert_eq!(row.owner.as_deref(), Some(&*format!("worker-{}", i % 7)));
            // The token it answered is the one the row holds: it completes the claim.
            let done = store
                .apply_op(
                    id("claim", i),
                    Op::Complete {
                        token: lease.token,
                        result: None,
                        ttl_ms: None,
                    },
                )
                .await;
            assert!(
                matches!(done, Ok(Outcome::Completed(_))),
                "complete {i}: {done:?}"
            );
        }

        let marks: Vec<_> = (0..KEYS)
            .map(|i| {
                let op = Op::Mark {
                    ttl_ms: 3_600_000,
                    fingerprint: None,
                    result: Some(serde_json::json!({ "n": i })),
                };
                (id("mark", i), op)
            })
            .collect();
        let answers = store.apply_ops(marks).await;
        for (i, answer) in answers.into_iter().enumerate() {
            let record = match answer {
                Ok(Outcome::Marked(Mark::New { record })) => record,
                other => panic!("mark {i}: {other:?}"),
            };
            match store.apply_op(id("mark", i), Op::Get).await {
                Ok(Outcome::Found(Some(row))) => assert_eq!(row, record, "mark {i}"),
                other => panic!("get mark {i}: {other:?}"),
            }
        }
    })
    .await;
}

/// One batch of claims in which every path of `dedupgate_claim_distinct` answers at once: keys
/// answered from the lock-free read (duplicates, mismatches), keys taken over under a lock (their
/// records expired) and read back, and new keys answered as inserted. Each answer is its key's
/// row, in the batch's order.
#[tokio::test]
async fn a_mixed_batch_answers_each_key_from_the_path_it_took() {
    let url = common::url();
    let schema = common::fresh_schema("batch_mixed");
    let body_schema = schema.clone();
    common::with_schema_dropped(&url.clone(), &schema, async move {
        let store = common::open(&url, &body_schema, 2).await;
        let id = |what: &str, i: usize| RecordId::new("mixed", format!("{what}-{i}")).unwrap();
        const EACH: usize = 300;
        let mut before = Vec::new();
        for i in 0..EACH {
            before.push((id("dup", i), mark(None)));
            before.push((id("mm", i), mark(Some("a"))));
            before.push((id("exp", i), claim(None, 1, 1)));
        }
        for (i, r) in store.apply_ops(before).await.into_iter().enumerate() {
            assert!(r.is_ok(), "setup {i}: {r:?}");
        }
        // The claims of "exp" live 1 ms: let them expire on the database's clock.
        tokio::time::sleep(Duration::from_millis(50)).await;

        let kinds = ["new", "dup", "exp", "mm"];
        let ops: Vec<_> = (0..EACH)
            .flat_map(|i| kinds.map(|k| (k, i)))
            .map(|(k, i)| {
                let fp = (k == "mm").then_some("b");
                (id(k, i), claim(fp, 3_600_000, 60_000))
            })
            .collect();
        let keys: Vec<_> = ops.iter().map(|(id, _)| id.clone()).collect();
        let answers = store.apply_ops(ops).await;
        assert_eq!(answers.len(), keys.len());
        for (n, (key, answer)) in keys.into_iter().zip(answers).enumerate() {
            let kind = kinds[n % kinds.len()];
            let row = match store.apply_op(key.clone(), Op::Get).await {
                Ok(Outcome::Found(Some(row))) => row,
                other => panic!("get {key:?}: {other:?}"),
            };
            match (kind, answer) {
                ("new" | "exp", Ok(Outcome::Claimed(Claim::New(lease)))) => {
                    assert_eq!(row.state, State::InProgress, "{key:?}");
                    assert_eq!(row.fence, lease.fence, "{key:?}: fence");
                    assert_eq!(row.expires_at_ms, lease.expires_at_ms, "{key:?}");
                    assert_eq!(
                        row.lease_expires_at_ms,
                        Some(lease.lease_expires_at_ms),
                        "{key:?}"
                    );
                }
                ("dup", Ok(Outcome::Claimed(Claim::Duplicate { record }))) => {
                    assert_eq!(record, row, "{key:?}");
                }
                ("mm", Err(GateError::FingerprintMismatch)) => {
                    assert_eq!(row.fingerprint.as_deref(), Some("a"), "{key:?} unchanged");
                }
                (kind, other) => panic!("{kind} {key:?}: {other:?}"),
            }
        }
    })
    .await;
}
