//! The records the Redis store keeps are the entries `dedupgate_core::decide` produces. A
//! sequence of ops (a new claim, a duplicate, a same-owner re-claim, extend, complete with and
//! without a ttl, release, a mark and its duplicate, forget, and a batch of new claims and marks
//! that takes the native fast path) runs against the local Redis; after each op the stored
//! value, read with `GET` and decoded by the crate's own decoder, must equal the entry `decide`
//! keeps for the same ops, and the store's answer `decide`'s answer.
//!
//! Compared: every field of the entry (state, fence, token, fingerprint, owner, created,
//! expiry, lease end, completion, result, ttl_ms), exactly, at one instant of Redis's clock:
//! `decide` is run at each millisecond between a `TIME` read before the op and one after it,
//! and one of those instants must give both the stored entry and the answer. So a time, fence
//! or ttl rule that differs from `decide`'s fails the test, while the unknown instant of the
//! script's own `TIME` does not. A new claim's token is the one the store answered (`decide`
//! takes the token it is given). One field is Redis's own: a mark's record keeps its call's
//! nonce in the token slot where `decide` keeps none; there the stored token must be 32 hex
//! digits and is then compared as none.

use std::collections::HashMap;

use dedupgate_core::testkit::ApplyOp;
use dedupgate_core::{
    decide, Change, Claim, Entry, GateError, Op, Outcome, RecordId, Token, ValidOp,
};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::record::decode_record;
use dedupgate_redis::testkit::shared_redis_url;
use dedupgate_redis::RedisStore;
use redis::aio::MultiplexedConnection;
use serde_json::json;

/// The store, a plain connection to read what it stored, and `decide`'s entries so far.
struct Shapes {
    store: RedisStore,
    conn: MultiplexedConnection,
    ns: String,
    model: HashMap<RecordId, Entry>,
}

impl Shapes {
    async fn open() -> Self {
        let url = shared_redis_url();
        let store = RedisStore::open(&url)
            .await
            .expect("the local Redis (DEDUPGATE_TEST_REDIS_URL) must be reachable");
        let conn = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Self {
            store,
            conn,
            ns: format!("shapes.{}.{nanos}", std::process::id()),
            model: HashMap::new(),
        }
    }

    fn id(&self, key: &str) -> RecordId {
        RecordId::new(self.ns.as_str(), key).unwrap()
    }

    /// Redis's clock in ms.
    async fn now_ms(&mut self) -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME")
            .query_async(&mut self.conn)
            .await
            .unwrap();
        s * 1000 + us / 1000
    }

    /// The stored record of `id`, decoded, or `None` when its key does not exist.
    async fn stored(&mut self, id: &RecordId) -> Option<Entry> {
        let raw: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&record_keys("dg", id).record[..])
            .query_async(&mut self.conn)
            .await
            .unwrap();
        raw.map(|r| decode_record(&r).unwrap_or_else(|e| panic!("{id:?}: {e}")))
    }

    /// Applies `op` and checks the stored record and the answer against `decide`.
    async fn step(&mut self, key: &str, op: Op) -> Result<Outcome, GateError> {
        let id = self.id(key);
        let t0 = self.now_ms().await;
        let answer = self.store.apply_op(id.clone(), op.clone()).await;
        let t1 = self.now_ms().await;
        self.check(&id, op, &answer, t0, t1).await;
        answer
    }

    /// Applies `ops` (distinct keys) as one batch and checks each as [`Shapes::step`] does.
    async fn batch(&mut self, ops: Vec<(String, Op)>) {
        let ops: Vec<(RecordId, Op)> = ops.into_iter().map(|(k, op)| (self.id(&k), op)).collect();
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
            if same_answer(&d.answer, answer) && stored_equals(stored.as_ref(), next.as_ref()) {
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

    /// Removes this run's keys.
    async fn clean(&mut self) {
        let ids: Vec<RecordId> = self.model.keys().cloned().collect();
        for id in ids {
            let _: i64 = redis::cmd("DEL")
                .arg(&record_keys("dg", &id).record[..])
                .query_async(&mut self.conn)
                .await
                .unwrap();
        }
    }
}

fn same_answer(a: &Result<Outcome, GateError>, b: &Result<Outcome, GateError>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => a.code() == b.code(),
        _ => false,
    }
}

/// Whether the stored record is `decide`'s entry, a mark's nonce aside (see the file's header).
fn stored_equals(stored: Option<&Entry>, decided: Option<&Entry>) -> bool {
    match (stored, decided) {
        (None, None) => true,
        (Some(s), Some(d)) => {
            let mut s = s.clone();
            let mark_nonce = d.state == dedupgate_core::EntryState::Completed && d.token.is_none();
            if mark_nonce {
                let nonce_shape = s.token.as_ref().is_some_and(|t| {
                    t.as_str().len() == 32 && t.as_str().bytes().all(|b| b.is_ascii_hexdigit())
                });
                if !nonce_shape {
                    return false;
                }
                s.token = None;
            }
            &s == d
        }
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

fn token_of(answer: Result<Outcome, GateError>) -> Token {
    match answer {
        Ok(Outcome::Claimed(Claim::New(lease))) => lease.token,
        other => panic!("expected a new claim, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_records_are_the_entries_decide_produces() {
    let mut s = Shapes::open().await;

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
    let mark = |fp: &str| Op::Mark {
        ttl_ms: 60_000,
        fingerprint: Some(fp.to_owned()),
        result: Some(json!("sent")),
    };
    s.step("marked", mark("fp-m")).await.unwrap();
    s.step("marked", mark("fp-m")).await.unwrap();
    assert!(s.step("marked", mark("fp-other")).await.is_err());
    s.step("marked", Op::Forget).await.unwrap();
    s.step("marked", Op::Get).await.unwrap();

    // Forget of a claim.
    token_of(s.step("forgotten", claim(None, 30_000)).await);
    s.step("forgotten", Op::Forget).await.unwrap();

    // New keys in a batch large enough for the native fast path, claims and marks.
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

    s.clean().await;
}
