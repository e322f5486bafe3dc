//! The store's clock is read after the row lock is held. Found by the torture harness's
//! linearizability checker (`dedupgate-torture lin --store postgres://…`): the functions used to
//! read `clock_timestamp()` once at their start, before `INSERT … ON CONFLICT` (or `SELECT … FOR
//! UPDATE`) waited for a row lock, so an operation was decided on an instant long past when it
//! took effect. A claim that waited behind a lock while the record expired answered "duplicate"
//! with an expired record (against API.md: "A record is never returned or counted as a duplicate
//! after expires_at_ms"), and a claim granted after a wait got a lease that started in the past.
//!
//! Each test holds a row lock (or an uncommitted insert) in a session of its own for longer than
//! the record lives, lets an operation wait behind it, and checks the answer against the store's
//! clock as the lock holder read it just before letting go.

mod common;

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::{Claim, GateError, Mark, Op, Outcome, RecordId, Token};
use dedupgate_postgres::PgStore;

/// How long a lock is held: well past `TTL_MS`, so the record expires while an op waits.
const HOLD_MS: u64 = 500;
/// The life of the records the waiting ops find.
const TTL_MS: u64 = 150;

fn claim(ttl_ms: u64, lease_ms: u64) -> Op {
    Op::Claim {
        ttl_ms,
        lease_ms,
        fingerprint: None,
        owner: None,
    }
}

fn mark(ttl_ms: u64) -> Op {
    Op::Mark {
        ttl_ms,
        fingerprint: None,
        result: None,
    }
}

/// A session holding the row of `id` locked (`SELECT … FOR UPDATE` in an open transaction).
async fn lock_row(url: &str, schema: &str, id: &RecordId) -> tokio_postgres::Client {
    let client = common::connect(url).await;
    client.batch_execute("BEGIN").await.unwrap();
    let n = client
        .execute(
            &format!(
                "SELECT 1 FROM \"{schema}\".dedupgate_records \
                 WHERE namespace = $1 AND key = $2 FOR UPDATE"
            ),
            &[
                &id.namespace.as_str().as_bytes(),
                &id.key.as_str().as_bytes(),
            ],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "the row to hold exists");
    client
}

/// A session that has marked `id` (for `TTL_MS`) in an open transaction: it inserted the key, or
/// took over its dead row, and holds it. A claim or mark of `id` from another session cannot
/// answer from its lock-free read (which sees no live record) and waits for this one.
async fn write_row(store: &PgStore, url: &str, id: &RecordId) -> tokio_postgres::Client {
    let client = common::connect(url).await;
    client.batch_execute("BEGIN").await.unwrap();
    match store
        .apply_in(&client, id.clone(), valid(mark(TTL_MS)))
        .await
    {
        Ok(Outcome::Marked(Mark::New { .. })) => {}
        other => panic!("uncommitted mark of {id:?}: {other:?}"),
    }
    client
}

/// The store's clock as `client` reads it.
async fn clock_ms<C: tokio_postgres::GenericClient + Sync>(client: &C, schema: &str) -> u64 {
    let ms: i64 = client
        .query_one(&format!("SELECT \"{schema}\".dedupgate_now_ms()"), &[])
        .await
        .unwrap()
        .get(0);
    ms as u64
}

/// Runs `op` on `id` while `holder` keeps its row for `HOLD_MS`; returns the answer and the
/// store's clock read by the holder just before it committed.
async fn apply_behind(
    store: Arc<PgStore>,
    holder: tokio_postgres::Client,
    schema: &str,
    id: RecordId,
    op: Op,
) -> (Result<Outcome, GateError>, u64) {
    let waiting = tokio::spawn(async move { store.apply_op(id, op).await });
    tokio::time::sleep(Duration::from_millis(HOLD_MS)).await;
    let released_at_ms = clock_ms(&holder, schema).await;
    holder.batch_execute("COMMIT").await.unwrap();
    (waiting.await.unwrap(), released_at_ms)
}

fn id(ns: &str, key: &str) -> RecordId {
    RecordId::new(ns, key).unwrap()
}

/// Makes the record of `id` dead (expired), so a lock-free read finds nothing live.
async fn dead_record(store: &PgStore, id: &RecordId) {
    store.apply_op(id.clone(), mark(1)).await.expect("mark");
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// The defect as the harness found it: the claim waits for another session's write of the key,
/// and the record that write made expires during the wait. Two shapes: the other session took
/// over a dead row (the claim waits for the row lock), or inserted the key (the claim's insert
/// waits in the unique index, then conflicts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_that_waited_for_a_lock_never_sees_an_expired_record() {
    let url = common::url();
    let schema = common::fresh_schema("clock_claim");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let store = Arc::new(common::open(&u, &s, 4).await);
        let lease_ms = 5_000;
        let taken_over = id("clock", "taken-over");
        dead_record(&store, &taken_over).await;
        let inserted = id("clock", "inserted");
        let waits = [taken_over, inserted].map(|k| {
            let (store, u, s) = (store.clone(), u.clone(), s.clone());
            async move {
                let holder = write_row(&store, &u, &k).await;
                let key = k.key.as_str().to_owned();
                (
                    key,
                    apply_behind(store, holder, &s, k, claim(60_000, lease_ms)).await,
                )
            }
        });
        for (key, (answer, released_at_ms)) in futures::future::join_all(waits).await {
            match answer {
                Ok(Outcome::Claimed(Claim::New(lease))) => assert!(
                    lease.lease_expires_at_ms >= released_at_ms + lease_ms,
                    "{key}: the lease starts after the wait: {lease:?}, released at \
                     {released_at_ms}"
                ),
                other => panic!(
                    "{key}: the record expired while the claim waited, yet it answered {other:?}"
                ),
            }
        }
    })
    .await;
}

/// Every other op that waits for a row lock judges the record after the wait, when it has
/// expired. (`get` takes no lock, so it never waits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_that_waited_for_a_lock_judge_the_record_after_the_wait() {
    let url = common::url();
    let schema = common::fresh_schema("clock_ops");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let store = Arc::new(common::open(&u, &s, 8).await);
        // A claim that expires soon, for each op that needs its token.
        let mut tokens: Vec<(RecordId, Token)> = Vec::new();
        for key in ["complete", "extend", "release"] {
            let k = id("clock", key);
            match store.apply_op(k.clone(), claim(TTL_MS, TTL_MS)).await {
                Ok(Outcome::Claimed(Claim::New(lease))) => tokens.push((k, lease.token)),
                other => panic!("setup claim of {key}: {other:?}"),
            }
        }
        store
            .apply_op(id("clock", "forget"), mark(TTL_MS))
            .await
            .unwrap();
        dead_record(&store, &id("clock", "mark-taken-over")).await;
        let token = |key: &str| {
            tokens
                .iter()
                .find(|(k, _)| k.key.as_str() == key)
                .map(|(_, t)| t.clone())
                .unwrap()
        };
        let ops = vec![
            (
                "complete",
                Op::Complete {
                    token: token("complete"),
                    result: None,
                    ttl_ms: None,
                },
            ),
            (
                "extend",
                Op::Extend {
                    token: token("extend"),
                    lease_ms: 60_000,
                },
            ),
            (
                "release",
                Op::Release {
                    token: token("release"),
                },
            ),
            ("forget", Op::Forget),
            ("mark-taken-over", mark(60_000)),
            ("mark-inserted", mark(60_000)),
        ];
        let waits = ops.into_iter().map(|(key, op)| {
            let (store, u, s) = (store.clone(), u.clone(), s.clone());
            async move {
                let k = id("clock", key);
                let holder = if key.starts_with("mark") {
                    write_row(&store, &u, &k).await
                } else {
                    lock_row(&u, &s, &k).await
                };
                (key, apply_behind(store, holder, &s, k, op).await)
            }
        });
        for (key, (answer, released_at_ms)) in futures::future::join_all(waits).await {
            match (key, answer) {
                ("complete" | "extend" | "release", Err(GateError::LeaseLost)) => {}
                ("forget", Ok(Outcome::Forgotten(false))) => {}
                (_, Ok(Outcome::Marked(Mark::New { record }))) => assert!(
                    record.created_at_ms >= released_at_ms,
                    "{key}: stamped after its wait: {record:?}, released at {released_at_ms}"
                ),
                (key, other) => panic!("{key} waited past the record's expiry, got {other:?}"),
            }
        }
    })
    .await;
}

/// The set-based batch paths (claims or marks only, distinct keys) read their clock after their
/// waits too: behind another session's takeover of a dead row, and behind its insert of a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_that_waited_for_a_lock_judge_the_record_after_the_wait() {
    let url = common::url();
    let schema = common::fresh_schema("clock_batch");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let store = Arc::new(common::open(&u, &s, 4).await);
        let lease_ms = 5_000;
        let mut waits = Vec::new();
        for (kind, op) in [("claims", claim(60_000, lease_ms)), ("marks", mark(60_000))] {
            let held = id(kind, "held");
            dead_record(&store, &held).await;
            let inserted = id(kind, "inserted");
            let holders = vec![
                write_row(&store, &u, &held).await,
                write_row(&store, &u, &inserted).await,
            ];
            let batch = vec![
                (id(kind, "fresh"), op.clone()),
                (held, op.clone()),
                (inserted, op),
            ];
            let store = store.clone();
            let waiting = tokio::spawn(async move { store.apply_ops(batch).await });
            waits.push((kind, holders, waiting));
        }
        tokio::time::sleep(Duration::from_millis(HOLD_MS)).await;
        for (kind, holders, waiting) in waits {
            // Each answer is compared with the release of the row it waited for.
            let mut released = Vec::new();
            for holder in &holders {
                released.push(clock_ms(holder, &s).await);
                holder.batch_execute("COMMIT").await.unwrap();
            }
            let answers = waiting.await.unwrap();
            assert_eq!(answers.len(), 3);
            for (i, answer) in answers.into_iter().enumerate().skip(1) {
                let released_at_ms = released[i - 1];
                match answer {
                    Ok(Outcome::Claimed(Claim::New(lease))) => assert!(
                        lease.lease_expires_at_ms >= released_at_ms + lease_ms,
                        "{kind} #{i}: the lease starts after the wait: {lease:?}, released at \
                         {released_at_ms}"
                    ),
                    Ok(Outcome::Marked(Mark::New { record })) => assert!(
                        record.created_at_ms >= released_at_ms,
                        "{kind} #{i}: stamped after the wait: {record:?}, released at \
                         {released_at_ms}"
                    ),
                    other => {
                        panic!("{kind} #{i}: the record expired during the wait, got {other:?}")
                    }
                }
            }
        }
    })
    .await;
}

/// A key with no row cannot be locked: a claim waits in the unique index for another
/// transaction's uncommitted insert. When that transaction rolls back, the claim's insert goes
/// in; its lease must still start after the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_granted_after_a_rolled_back_insert_get_a_lease_from_after_the_wait() {
    let url = common::url();
    let schema = common::fresh_schema("clock_insert");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let store = Arc::new(common::open(&u, &s, 4).await);
        let lease_ms = 5_000;
        let single = id("insert", "single");
        let batched = id("insert", "batched");
        // One session inserts both keys through the transactional API and does not commit.
        let mut holder = common::connect(&u).await;
        let tx = holder.transaction().await.unwrap();
        for k in [&single, &batched] {
            match store
                .apply_in(&tx, k.clone(), valid(claim(60_000, lease_ms)))
                .await
            {
                Ok(Outcome::Claimed(Claim::New(_))) => {}
                other => panic!("uncommitted claim: {other:?}"),
            }
        }
        let s1 = store.clone();
        let one = tokio::spawn(async move { s1.apply_op(single, claim(60_000, lease_ms)).await });
        let s2 = store.clone();
        let many = tokio::spawn(async move {
            s2.apply_ops(vec![
                (id("insert", "other"), claim(60_000, lease_ms)),
                (batched, claim(60_000, lease_ms)),
            ])
            .await
        });
        tokio::time::sleep(Duration::from_millis(HOLD_MS)).await;
        let rolled_back_at_ms = clock_ms(&tx, &s).await;
        tx.rollback().await.unwrap();
        let answers = [
            one.await.unwrap(),
            many.await.unwrap().into_iter().nth(1).unwrap(),
        ];
        for answer in answers {
            match answer {
                Ok(Outcome::Claimed(Claim::New(lease))) => assert!(
                    lease.lease_expires_at_ms >= rolled_back_at_ms + lease_ms,
                    "the lease starts after the wait: {lease:?}, rolled back at {rolled_back_at_ms}"
                ),
                other => panic!("the other insert rolled back, so the claim is new: {other:?}"),
            }
        }
    })
    .await;
}

/// The test's op as the core builds it (the transactional API takes only a validated op).
fn valid(op: Op) -> dedupgate_core::ValidOp {
    op.try_into().expect("the test's ops are valid")
}
