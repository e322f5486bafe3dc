//! A batch of claims (or marks) of distinct new keys answers each key from the row it inserted,
//! without reading the row again (`dedupgate_claim_distinct` / `dedupgate_mark_distinct` in
//! `src/functions.sql`); rows whose clock moved during the insert are stamped again and read
//! back. Whichever way a key went, its answer must be exactly the row that was committed.
//! Thousands of keys per batch, so that some rows are stamped again (a millisecond passes
//! during the insert) and most are not.

mod common;

use std::collections::HashSet;

use dedupgate_core::{Claim, Mark, Op, Outcome, RecordId, State, Store};

const KEYS: usize = 5_000;

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
        let answers = store.apply_batch(claims).await;
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
            let row = match store.apply(id("claim", i), Op::Get).await {
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
                .apply(
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
        let answers = store.apply_batch(marks).await;
        for (i, answer) in answers.into_iter().enumerate() {
            let record = match answer {
                Ok(Outcome::Marked(Mark::New { record })) => record,
                other => panic!("mark {i}: {other:?}"),
            };
            match store.apply(id("mark", i), Op::Get).await {
                Ok(Outcome::Found(Some(row))) => assert_eq!(row, record, "mark {i}"),
                other => panic!("get mark {i}: {other:?}"),
            }
        }
    })
    .await;
}
