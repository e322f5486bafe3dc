//! The stored-shape check every remote store runs: what the store keeps after each op is the
//! entry [`decide`] produces for the same ops, and its answer is `decide`'s answer.
//!
//! A remote store restates the rules in its own engine (Lua, SQL), so its conformance answers
//! alone could hide a record that differs in a field no answer shows (a fence, a ttl, a lease
//! end). A store's test implements [`StoredShapes`] (its clock and a plain read of one stored
//! record) and calls [`check_stored_shapes`], which runs one fixed history: a claim, a duplicate
//! by another owner, the same owner again, extend, complete with and without a ttl, a retried
//! complete, release and a second release, a mark, its duplicate and a mismatch, forget, get,
//! and a batch of 24 new claims and marks.
//!
//! Compared: every field of the entry, exactly, at one instant of the store's clock: `decide`
//! is run at each millisecond between a clock read before the op and one after it, and one of
//! those instants must give both the stored entry and the answer. So a time, fence or ttl rule
//! that differs from `decide`'s fails, while the unknown instant the engine read does not. A new
//! claim's token is the one the store answered (`decide` takes the token it is given).

use std::collections::HashMap;

use async_trait::async_trait;
use serde_json::json;

use super::ApplyOp;
use crate::{
    decide, Change, Claim, Entry, GateError, Op, Outcome, RecordId, Store, Token, ValidOp,
};

/// What a remote store's stored-shape test gives [`check_stored_shapes`].
#[async_trait]
pub trait StoredShapes: Send {
    /// The store under test.
    fn store(&self) -> &dyn Store;
    /// The namespace this run's keys live in.
    fn namespace(&self) -> &str;
    /// The clock the store's engine decides by, in unix ms.
    async fn now_ms(&mut self) -> u64;
    /// The stored entry of `id`, read without the store's own code paths; `None` when absent.
    async fn stored(&mut self, id: &RecordId) -> Option<Entry>;
    /// Whether `stored` is `decide`'s entry `decided`. Exact equality unless the engine keeps a
    /// documented extra (Redis keeps a mark's nonce in the token slot).
    fn stored_equals(&self, stored: Option<&Entry>, decided: Option<&Entry>) -> bool {
        stored == decided
    }
}

/// Runs the fixed history against `s`, panicking with the op, the answer and the stored entry
/// at the first difference from `decide`. Returns the ids it wrote, for a test that cleans up.
pub async fn check_stored_shapes(s: &mut dyn StoredShapes) -> Vec<RecordId> {
    let mut run = Run {
        s,
        model: HashMap::new(),
    };
    run.history().await;
    run.model.into_keys().collect()
}

/// The check's state: the store and `decide`'s entries so far.
struct Run<'a> {
    s: &'a mut dyn StoredShapes,
    model: HashMap<RecordId, Entry>,
}

impl Run<'_> {
    fn id(&self, key: &str) -> RecordId {
        RecordId::new(self.s.namespace(), key).expect("the check's keys are valid")
    }

    async fn history(&mut self) {
        // A claim, a duplicate by another owner, the same owner again, extend, complete (no ttl).
        let token = token_of(self.step("held", claim(Some("w1"), 30_000)).await);
        self.step("held", claim(Some("w2"), 30_000)).await.unwrap();
        assert_eq!(
            token_of(self.step("held", claim(Some("w1"), 40_000)).await),
            token
        );
        let extend = Op::Extend {
            token: token.clone(),
            lease_ms: 50_000,
        };
        self.step("held", extend).await.unwrap();
        let complete = Op::Complete {
            token: token.clone(),
            result: Some(json!({"charge": "ch_1", "cents": 1250})),
            ttl_ms: None,
        };
        self.step("held", complete.clone()).await.unwrap();
        // A retried complete is answered unchanged; a duplicate claim shows the result.
        self.step("held", complete).await.unwrap();
        self.step("held", claim(None, 30_000)).await.unwrap();

        // Complete with a ttl.
        let token = token_of(self.step("ttl", claim(None, 30_000)).await);
        let complete = Op::Complete {
            token,
            result: None,
            ttl_ms: Some(5_000),
        };
        self.step("ttl", complete).await.unwrap();

        // Release leaves a tombstone; a second release is refused; the next claim gets a
        // higher fence.
        let token = token_of(self.step("released", claim(None, 30_000)).await);
        let release = Op::Release { token };
        self.step("released", release.clone()).await.unwrap();
        assert!(self.step("released", release).await.is_err());
        self.step("released", claim(Some("w3"), 30_000))
            .await
            .unwrap();

        // A mark, its duplicate, a mismatch, then forget.
        self.step("marked", mark("fp-m")).await.unwrap();
        self.step("marked", mark("fp-m")).await.unwrap();
        assert!(self.step("marked", mark("fp-other")).await.is_err());
        self.step("marked", Op::Forget).await.unwrap();
        self.step("marked", Op::Get).await.unwrap();

        // Forget of a claim.
        token_of(self.step("forgotten", claim(None, 30_000)).await);
        self.step("forgotten", Op::Forget).await.unwrap();

        // New keys in one batch, claims and marks (large enough for Redis's native fast path).
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
        self.batch(ops).await;
    }

    /// Applies `op` and checks the stored entry and the answer against `decide`.
    async fn step(&mut self, key: &str, op: Op) -> Result<Outcome, GateError> {
        let id = self.id(key);
        let t0 = self.s.now_ms().await;
        let answer = self.s.store().apply_op(id.clone(), op.clone()).await;
        let t1 = self.s.now_ms().await;
        self.check(&id, op, &answer, t0, t1).await;
        answer
    }

    /// Applies `ops` (distinct keys) as one batch and checks each as [`Run::step`] does.
    async fn batch(&mut self, ops: Vec<(String, Op)>) {
        let ops: Vec<(RecordId, Op)> = ops.into_iter().map(|(k, op)| (self.id(&k), op)).collect();
        let t0 = self.s.now_ms().await;
        let answers = self.s.store().apply_ops(ops.clone()).await;
        let t1 = self.s.now_ms().await;
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
        let stored = self.s.stored(id).await;
        let fresh = match answer {
            Ok(Outcome::Claimed(Claim::New(lease))) => Some(lease.token.clone()),
            _ => None,
        };
        let current = self.model.get(id).cloned();
        let mut last = None;
        for t in t0..=t1 {
            let valid = ValidOp::try_from(op.clone()).expect("the check's ops are valid");
            let d = decide(id, valid, current.as_ref(), t, || {
                fresh.clone().unwrap_or_else(Token::generate)
            });
            let next = match d.change {
                Change::Keep => current.clone(),
                Change::Put(e) => Some(e),
            };
            if same_answer(&d.answer, answer)
                && self.s.stored_equals(stored.as_ref(), next.as_ref())
            {
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

/// Equal answers, or refusals with the same wire code.
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
