//! The rows the PostgreSQL store keeps are the entries `dedupgate_core::decide` produces. A
//! sequence of ops (a new claim, a duplicate, a same-owner re-claim, extend, complete with and
//! without a ttl, release, a mark and its duplicate, forget, and a batch of new claims and
//! marks, which takes the functions for distinct keys) runs against the local PostgreSQL in a
//! schema of its own; after each op the row, read with a plain `SELECT`, must equal the entry
//! `decide` keeps for the same ops, and the store's answer `decide`'s answer.
//!
//! Compared: every column of the row against every field of the entry (state, fence, token,
//! fingerprint, owner, created, expiry, lease end, completion, result, ttl_ms), exactly, at one
//! instant of the server's clock: `decide` is run at each millisecond between a read of
//! `dedupgate_now_ms()` before the op and one after it, and one of those instants must give both
//! the row and the answer. So a time, fence or ttl rule that differs from `decide`'s fails the
//! test, while the unknown instant the function read does not. A new claim's token is the one
//! the store answered (`decide` takes the token it is given).

mod common;

use std::collections::HashMap;

use dedupgate_core::testkit::ApplyOp;
use dedupgate_core::{
    decide, Change, Claim, Entry, EntryState, GateError, Op, Outcome, RecordId, Token, ValidOp,
};
use dedupgate_postgres::PgStore;
use serde_json::json;

/// The store, a plain connection to read its rows, and `decide`'s entries so far.
struct Shapes {
    store: PgStore,
    client: tokio_postgres::Client,
    schema: String,
    model: HashMap<RecordId, Entry>,
}

impl Shapes {
    fn id(key: &str) -> RecordId {
        RecordId::new("shapes", key).unwrap()
    }

    /// The server's clock as the store's functions read it.
    async fn now_ms(&self) -> u64 {
        let sql = format!("SELECT \"{}\".dedupgate_now_ms()", self.schema);
        let now: i64 = self.client.query_one(&sql, &[]).await.unwrap().get(0);
        u64::try_from(now).unwrap()
    }

    /// The row of `id` as an entry, or `None` when there is none.
    async fn stored(&self, id: &RecordId) -> Option<Entry> {
        let sql = format!(
            "SELECT state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms, \
             lease_expires_at_ms, completed_at_ms, result, ttl_ms \
             FROM \"{}\".dedupgate_records WHERE namespace = $1 AND key = $2",
            self.schema
        );
        let ns = id.namespace.as_str().as_bytes();
        let key = id.key.as_str().as_bytes();
        let row = self.client.query_opt(&sql, &[&ns, &key]).await.unwrap()?;
        let text = |i: usize| {
            row.get::<_, Option<Vec<u8>>>(i)
                .map(|b| String::from_utf8(b).expect("UTF-8 column"))
        };
        let ms = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap();
        let opt_ms = |i: usize| {
            row.get::<_, Option<i64>>(i)
                .map(|v| u64::try_from(v).unwrap())
        };
        Some(Entry {
            state: match row.get::<_, i16>(0) {
                0 => EntryState::InProgress,
                1 => EntryState::Completed,
                2 => EntryState::Released,
                other => panic!("state {other}"),
            },
            fence: ms(1),
            token: text(2).map(Token::new),
            fingerprint: text(3),
            owner: text(4),
            created_at_ms: ms(5),
            expires_at_ms: ms(6),
            lease_expires_at_ms: opt_ms(7),
            completed_at_ms: opt_ms(8),
            result: row
                .get::<_, Option<Vec<u8>>>(9)
                .map(|b| serde_json::from_slice(&b).expect("a JSON result")),
            ttl_ms: opt_ms(10),
        })
    }

    /// Applies `op` and checks the row and the answer against `decide`.
    async fn step(&mut self, key: &str, op: Op) -> Result<Outcome, GateError> {
        let id = Self::id(key);
        let t0 = self.now_ms().await;
        let answer = self.store.apply_op(id.clone(), op.clone()).await;
        let t1 = self.now_ms().await;
        self.check(&id, op, &answer, t0, t1).await;
        answer
    }

    /// Applies `ops` (distinct keys) as one batch and checks each as [`Shapes::step`] does.
    async fn batch(&mut self, ops: Vec<(String, Op)>) {
        let ops: Vec<(RecordId, Op)> = ops.into_iter().map(|(k, op)| (Self::id(&k), op)).collect();
        let t0 = self.now_ms().await;
        let answers = self.store.apply_ops(ops.clone()).await;
        let t1 = self.now_ms().await;
        for ((id, op), answer) in ops.into_iter().zip(&answers) {
            self.check(&id, op, answer, t0, t1).await;
        }
    }

    async fn check(
        &mut self,
        id: &RecordId,
        op: Op,
        answer: &Result<Outcome, GateError>,
        t0: u64,
        t1: u64,
    ) {
        let stored = self.stored(id).await;
        let fresh = match answer {
            Ok(Outcome::Claimed(Claim::New(lease))) => Some(lease.token.clone()),
            _ => None,
        };
        let current = self.model.get(id).cloned();
        let mut last = None;
        for t in t0..=t1 {
            let valid = ValidOp::try_from(op.clone()).expect("the test's ops are valid");
            let d = decide(id, valid, current.as_ref(), t, || {
                fresh.clone().unwrap_or_else(Token::generate)
            });
            let next = match d.change {
                Change::Keep => current.clone(),
                Change::Put(e) => Some(e),
            };
            if same_answer(&d.answer, answer) && stored == next {
                match next {
                    Some(e) => self.model.insert(id.clone(), e),
                    None => self.model.remove(id),
                };
                return;
            }
            last = Some((d.answer, next));
        }
        panic!(
            "{} on {id:?}: the store answered {answer:?} and stored {stored:?}, which decide \
             gives at no instant in {t0}..={t1} (at {t1}: {last:?})",
            op.name()
        );
    }
}

fn same_answer(a: &Result<Outcome, GateError>, b: &Result<Outcome, GateError>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => a.code() == b.code(),
        _ => false,
    }
}

fn claim(owner: Option<&str>, lease_ms: u64) -> Op {
    Op::Claim {
        ttl_ms: 60_000,
        lease_ms,
        fingerprint: Some("fp-1".into()),
        owner: owner.map(str::to_owned),
    }
}

fn mark(fp: &str) -> Op {
    Op::Mark {
        ttl_ms: 60_000,
        fingerprint: Some(fp.to_owned()),
        result: Some(json!("sent")),
    }
}

fn token_of(answer: Result<Outcome, GateError>) -> Token {
    match answer {
        Ok(Outcome::Claimed(Claim::New(lease))) => lease.token,
        other => panic!("expected a new claim, got {other:?}"),
    }
}

async fn run(mut s: Shapes) {
    // A claim, a duplicate by another owner, the same owner again, extend, complete (no ttl).
    let token = token_of(s.step("held", claim(Some("w1"), 30_000)).await);
    s.step("held", claim(Some("w2"), 30_000)).await.unwrap();
    assert_eq!(
        token_of(s.step("held", claim(Some("w1"), 40_000)).await),
        token
    );
    let extend = Op::Extend {
        token: token.clone(),
        lease_ms: 50_000,
    };
    s.step("held", extend).await.unwrap();
    let complete = Op::Complete {
        token: token.clone(),
        result: Some(json!({"charge": "ch_1", "cents": 1250})),
        ttl_ms: None,
    };
    s.step("held", complete.clone()).await.unwrap();
    // A retried complete is answered unchanged; a duplicate claim shows the result.
    s.step("held", complete).await.unwrap();
    s.step("held", claim(None, 30_000)).await.unwrap();

    // Complete with a ttl.
    let token = token_of(s.step("ttl", claim(None, 30_000)).await);
    let complete = Op::Complete {
        token,
        result: None,
        ttl_ms: Some(5_000),
    };
    s.step("ttl", complete).await.unwrap();

    // Release leaves a tombstone; a second release is refused; the next claim gets a higher fence.
    let token = token_of(s.step("released", claim(None, 30_000)).await);
    let release = Op::Release { token };
    s.step("released", release.clone()).await.unwrap();
    assert!(s.step("released", release).await.is_err());
    s.step("released", claim(Some("w3"), 30_000)).await.unwrap();

    // A mark, its duplicate, a mismatch, then forget.
    s.step("marked", mark("fp-m")).await.unwrap();
    s.step("marked", mark("fp-m")).await.unwrap();
    assert!(s.step("marked", mark("fp-other")).await.is_err());
    s.step("marked", Op::Forget).await.unwrap();
    s.step("marked", Op::Get).await.unwrap();

    // Forget of a claim.
    token_of(s.step("forgotten", claim(None, 30_000)).await);
    s.step("forgotten", Op::Forget).await.unwrap();

    // New keys in one batch, claims and marks.
    let ops = (0..24)
        .map(|i| {
            let op = if i % 3 == 0 {
                mark("fp-b")
            } else {
                claim((i % 2 == 0).then_some("w-b"), 30_000)
            };
            (format!("batch-{i}"), op)
        })
        .collect();
    s.batch(ops).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_rows_are_the_entries_decide_produces() {
    let url = common::url();
    let schema = common::fresh_schema("shapes");
    let store = common::open(&url, &schema, 2).await;
    let (u, sch) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let shapes = Shapes {
            store,
            client: common::connect(&u).await,
            schema: sch,
            model: HashMap::new(),
        };
        run(shapes).await;
    })
    .await;
}
