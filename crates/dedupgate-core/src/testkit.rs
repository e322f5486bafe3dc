//! The conformance suite: every rule of API.md, checked against any [`Store`].
//!
//! A store's test crate implements [`Harness`] and calls [`run_all`]. Each case works in a
//! namespace of its own, so remote stores can share one server between runs. Time moves through
//! [`Harness::advance`]: a [`crate::ManualClock`] for in-process stores, a real sleep for stores
//! judged on a server's clock, so durations here are short but not tiny. [`ClockedHarness`] and
//! [`RealTimeHarness`] are those two harnesses; [`check_stored_shapes`] is the check a
//! remote store runs on the records its own engine writes.

mod harnesses;
mod shapes;

pub use harnesses::{ClockedHarness, RealTimeHarness};
pub use shapes::{check_stored_shapes, StoredShapes};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::{
    Claim, GateError, Lease, Mark, Op, Outcome, Record, RecordId, State, Store, Token, ValidOp,
    COMPLETE_GRACE_MS,
};

/// Lease used by the suite: long enough that a claim and its check land inside it on a busy machine.
pub const LEASE_MS: u64 = 1_500;
/// Retention used by the suite.
pub const TTL_MS: u64 = 4_000;

/// What a store's tests give the suite.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store under test (the same one for every call).
    fn store(&self) -> Arc<dyn Store>;
    /// Lets `ms` of the store's clock pass.
    async fn advance(&self, ms: u64);
}

/// Ops written out in full ([`Op`], as tests and replayed histories hold them) applied to a
/// store the way a face applies them: each is made a [`ValidOp`] first, and one that fails is
/// answered [`GateError::Invalid`] without reaching the store.
#[async_trait]
pub trait ApplyOp {
    /// [`Store::apply`] of `op` once it is validated.
    async fn apply_op(&self, id: RecordId, op: Op) -> Result<Outcome, GateError>;

    /// [`Store::apply_batch`] of the ops that pass validation; the others are answered
    /// [`GateError::Invalid`] in their place, so the answers keep the ops' order.
    async fn apply_ops(&self, ops: Vec<(RecordId, Op)>) -> Vec<Result<Outcome, GateError>>;
}

#[async_trait]
impl<S: Store + ?Sized> ApplyOp for S {
    async fn apply_op(&self, id: RecordId, op: Op) -> Result<Outcome, GateError> {
        self.apply(id, ValidOp::try_from(op)?).await
    }

    async fn apply_ops(&self, ops: Vec<(RecordId, Op)>) -> Vec<Result<Outcome, GateError>> {
        let mut refused = Vec::new();
        let mut valid = Vec::with_capacity(ops.len());
        for (at, (id, op)) in ops.into_iter().enumerate() {
            match ValidOp::try_from(op) {
                Ok(op) => valid.push((id, op)),
                Err(e) => refused.push((at, GateError::from(e))),
            }
        }
        let mut decided = self.apply_batch(valid).await.into_iter();
        let mut refused = refused.into_iter().peekable();
        let mut out = Vec::with_capacity(decided.len() + refused.len());
        loop {
            if refused.peek().is_some_and(|(at, _)| *at == out.len()) {
                let (_, e) = refused.next().expect("peeked");
                out.push(Err(e));
            } else if let Some(answer) = decided.next() {
                out.push(answer);
            } else {
                out.extend(refused.map(|(_, e)| Err(e)));
                return out;
            }
        }
    }
}

/// One case of the suite.
pub type Case = for<'a> fn(&'a dyn Harness) -> futures::future::BoxFuture<'a, ()>;

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        /// Every case, by name.
        pub fn cases() -> Vec<(&'static str, Case)> {
            vec![$((stringify!($name), |h| Box::pin($name(h)))),*]
        }
    };
}

cases!(
    claim_then_duplicate_in_progress,
    complete_replays_result_to_duplicates,
    token_never_leaks,
    release_frees_key_with_higher_fence,
    takeover_after_lease_refuses_stale_token,
    complete_after_lease_passed_without_takeover,
    same_owner_reclaims_its_own_claim,
    fingerprint_mismatch_changes_nothing,
    mark_new_then_duplicate,
    expired_record_is_never_a_duplicate,
    extend_keeps_the_key,
    retried_complete_is_answered_and_a_second_release_refused,
    complete_with_ttl_moves_expiry,
    same_owner_reclaim_never_shortens_its_lease,
    completed_record_is_kept_for_the_claims_ttl_not_its_lease,
    retried_complete_after_the_ttl_is_answered_for_the_grace,
    get_and_forget,
    invalid_ops_change_nothing,
    keys_are_stored_exactly,
    fences_strictly_increase,
    batch_in_order_with_item_errors,
    sweep_removes_expired_entries,
    concurrent_claims_one_new_per_key,
    concurrent_marks_one_new_per_key,
    concurrent_overlapping_batches_one_new_per_key,
);

/// Runs every case, printing each name; panics on the first failure with the case named.
pub async fn run_all(h: &dyn Harness) {
    for (name, case) in cases() {
        eprintln!("conformance: {name}");
        case(h).await;
    }
}

/// A namespace no other case or run uses.
pub fn fresh_namespace(case: &str) -> String {
    let n: u64 = rand::thread_rng().gen();
    let mut ns = format!("conf.{case}.{n:x}");
    ns.truncate(crate::model::NAMESPACE_BYTES_MAX);
    ns
}

struct Ctx {
    store: Arc<dyn Store>,
    ns: String,
}

impl Ctx {
    fn new(h: &dyn Harness, case: &str) -> Self {
        Self {
            store: h.store(),
            ns: fresh_namespace(case),
        }
    }

    fn id(&self, key: &str) -> RecordId {
        RecordId::new(self.ns.clone(), key).expect("suite keys are valid")
    }

    async fn op(&self, key: &str, op: Op) -> Result<Outcome, GateError> {
        self.store.apply_op(self.id(key), op).await
    }

    async fn claim_with(&self, key: &str, fp: Option<&str>, owner: Option<&str>) -> Claim {
        match self.op(key, claim_op(fp, owner)).await {
            Ok(Outcome::Claimed(c)) => c,
            other => panic!("claim {key}: unexpected {other:?}"),
        }
    }

    async fn claim(&self, key: &str) -> Claim {
        self.claim_with(key, None, None).await
    }

    async fn claim_new(&self, key: &str) -> Lease {
        match self.claim(key).await {
            Claim::New(l) => l,
            other => panic!("claim {key}: expected new, got {other:?}"),
        }
    }

    async fn claim_dup(&self, key: &str) -> Record {
        match self.claim(key).await {
            Claim::Duplicate { record } => record,
            other => panic!("claim {key}: expected duplicate, got {other:?}"),
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: &Token,
        result: serde_json::Value,
    ) -> Result<Outcome, GateError> {
        self.op(
            key,
            Op::Complete {
                token: token.clone(),
                result: Some(result),
                ttl_ms: None,
            },
        )
        .await
    }

    async fn release(&self, key: &str, token: &Token) -> Result<Outcome, GateError> {
        self.op(
            key,
            Op::Release {
                token: token.clone(),
            },
        )
        .await
    }

    async fn get(&self, key: &str) -> Option<Record> {
        match self.op(key, Op::Get).await {
            Ok(Outcome::Found(r)) => r,
            other => panic!("get {key}: unexpected {other:?}"),
        }
    }

    async fn mark(
        &self,
        key: &str,
        fp: Option<&str>,
        result: Option<serde_json::Value>,
    ) -> Result<Outcome, GateError> {
        self.op(
            key,
            Op::Mark {
                ttl_ms: TTL_MS,
                fingerprint: fp.map(str::to_owned),
                result,
            },
        )
        .await
    }
}

fn claim_op(fp: Option<&str>, owner: Option<&str>) -> Op {
    Op::Claim {
        ttl_ms: TTL_MS,
        lease_ms: LEASE_MS,
        fingerprint: fp.map(str::to_owned),
        owner: owner.map(str::to_owned),
    }
}

fn assert_lease_lost(r: Result<Outcome, GateError>, what: &str) {
    assert!(
        matches!(r, Err(GateError::LeaseLost)),
        "{what}: expected lease_lost, got {r:?}"
    );
}

async fn claim_then_duplicate_in_progress(h: &dyn Harness) {
    let c = Ctx::new(h, "dup_in_progress");
    let lease = c.claim_new("evt").await;
    assert!(lease.fence > 0);
    assert!(lease.lease_expires_at_ms < lease.expires_at_ms);
    let dup = c.claim_dup("evt").await;
    assert_eq!(dup.state, State::InProgress);
    assert_eq!(dup.fence, lease.fence);
    assert_eq!(dup.lease_expires_at_ms, Some(lease.lease_expires_at_ms));
    assert_eq!(dup.expires_at_ms, lease.expires_at_ms);
    assert_eq!(dup.result, None);
    assert_eq!(dup.namespace.as_str(), c.ns);
    assert_eq!(dup.key.as_str(), "evt");
    // Other keys and namespaces are independent.
    c.claim_new("evt2").await;
    let other = Ctx::new(h, "dup_in_progress_other");
    other.claim_new("evt").await;
}

async fn complete_replays_result_to_duplicates(h: &dyn Harness) {
    let c = Ctx::new(h, "complete_replay");
    let lease = c.claim_new("evt").await;
    let result = json!({"charge": "ch_1", "amount": 1250, "nested": [1, 2.5, null, "ü"]});
    let done = match c.complete("evt", &lease.token, result.clone()).await {
        Ok(Outcome::Completed(r)) => r,
        other => panic!("complete: {other:?}"),
    };
    assert_eq!(done.state, State::Completed);
    assert_eq!(done.fence, lease.fence);
    assert_eq!(done.result, Some(result.clone()));
    assert_eq!(done.lease_expires_at_ms, None);
    assert!(done.completed_at_ms.is_some());
    let dup = c.claim_dup("evt").await;
    assert_eq!(
        dup, done,
        "a duplicate carries the stored record and result"
    );
    let mark_dup = c.mark("evt", None, Some(json!("other"))).await;
    assert!(
        matches!(&mark_dup, Ok(Outcome::Marked(Mark::Duplicate { record })) if record.result == Some(result.clone())),
        "mark on completed key: {mark_dup:?}"
    );
    assert_eq!(c.get("evt").await, Some(done));
}

async fn token_never_leaks(h: &dyn Harness) {
    let c = Ctx::new(h, "token_secret");
    let lease = c.claim_with("evt", None, Some("w1")).await;
    let Claim::New(lease) = lease else {
        panic!("fresh key not new")
    };
    let secret = lease.token.as_str().to_owned();
    let dup = serde_json::to_string(&c.claim_dup("evt").await).unwrap();
    let got = serde_json::to_string(&c.get("evt").await).unwrap();
    let marked = format!("{:?}", c.mark("evt", None, None).await);
    for text in [dup, got, marked] {
        assert!(!text.contains(&secret), "token leaked in {text}");
    }
    c.complete("evt", &lease.token, json!(1)).await.unwrap();
    let after = serde_json::to_string(&c.get("evt").await).unwrap();
    assert!(
        !after.contains(&secret),
        "token leaked after completion: {after}"
    );
}

async fn release_frees_key_with_higher_fence(h: &dyn Harness) {
    let c = Ctx::new(h, "release");
    let first = c.claim_new("evt").await;
    assert!(matches!(
        c.release("evt", &first.token).await,
        Ok(Outcome::Released)
    ));
    assert_eq!(c.get("evt").await, None, "a released key is free");
    let second = c.claim_new("evt").await;
    assert!(
        second.fence > first.fence,
        "fence must increase across release"
    );
    assert_ne!(second.token, first.token);
    assert_lease_lost(
        c.complete("evt", &first.token, json!(0)).await,
        "complete with released token",
    );
    assert_lease_lost(
        c.op(
            "evt",
            Op::Extend {
                token: first.token.clone(),
                lease_ms: LEASE_MS,
            },
        )
        .await,
        "extend with released token",
    );
    // The new holder is untouched by the stale calls.
    let held = c.get("evt").await.expect("held");
    assert_eq!(held.fence, second.fence);
    assert_eq!(held.state, State::InProgress);
}

async fn takeover_after_lease_refuses_stale_token(h: &dyn Harness) {
    let c = Ctx::new(h, "takeover");
    let first = c.claim_new("evt").await;
    c.claim_dup("evt").await;
    h.advance(LEASE_MS + 200).await;
    let second = c.claim_new("evt").await;
    assert!(second.fence > first.fence);
    assert_ne!(second.token, first.token);
    assert_lease_lost(
        c.complete("evt", &first.token, json!("stale")).await,
        "stale complete",
    );
    assert_lease_lost(c.release("evt", &first.token).await, "stale release");
    assert_lease_lost(
        c.op(
            "evt",
            Op::Extend {
                token: first.token.clone(),
                lease_ms: LEASE_MS,
            },
        )
        .await,
        "stale extend",
    );
    let held = c.get("evt").await.expect("held by the second worker");
    assert_eq!(held.fence, second.fence);
    assert_eq!(held.result, None, "a stale completion changed nothing");
    assert!(matches!(
        c.complete("evt", &second.token, json!("fresh")).await,
        Ok(Outcome::Completed(_))
    ));
    assert_eq!(c.get("evt").await.unwrap().result, Some(json!("fresh")));
    // A token that was never issued is refused too.
    assert_lease_lost(
        c.complete("evt", &Token::new("never-issued"), json!(1))
            .await,
        "unknown token",
    );
}

async fn complete_after_lease_passed_without_takeover(h: &dyn Harness) {
    let c = Ctx::new(h, "late_complete");
    let lease = c.claim_new("evt").await;
    h.advance(LEASE_MS + 200).await;
    let r = c.complete("evt", &lease.token, json!({"late": true})).await;
    assert!(
        matches!(r, Ok(Outcome::Completed(_))),
        "late complete with no takeover: {r:?}"
    );
    assert_eq!(c.claim_dup("evt").await.state, State::Completed);
}

async fn same_owner_reclaims_its_own_claim(h: &dyn Harness) {
    let c = Ctx::new(h, "owner");
    let Claim::New(first) = c.claim_with("evt", None, Some("worker-7")).await else {
        panic!("fresh key not new")
    };
    h.advance(100).await;
    let Claim::New(again) = c.claim_with("evt", None, Some("worker-7")).await else {
        panic!("same owner must get its claim back")
    };
    assert_eq!(again.token, first.token);
    assert_eq!(again.fence, first.fence);
    assert!(
        again.lease_expires_at_ms > first.lease_expires_at_ms,
        "lease renewed"
    );
    let other = c.claim_with("evt", None, Some("worker-8")).await;
    assert!(
        matches!(other, Claim::Duplicate { .. }),
        "another owner: {other:?}"
    );
    assert!(
        matches!(c.claim("evt").await, Claim::Duplicate { .. }),
        "no owner is a duplicate"
    );
    let rec = c.get("evt").await.unwrap();
    assert_eq!(rec.owner.as_deref(), Some("worker-7"));
    // After completion the same owner gets a duplicate, not a new claim.
    c.complete("evt", &first.token, json!(1)).await.unwrap();
    assert!(matches!(
        c.claim_with("evt", None, Some("worker-7")).await,
        Claim::Duplicate { .. }
    ));
}

async fn fingerprint_mismatch_changes_nothing(h: &dyn Harness) {
    let c = Ctx::new(h, "fingerprint");
    let Claim::New(lease) = c.claim_with("evt", Some("fp-a"), None).await else {
        panic!("fresh key not new")
    };
    let before = c.get("evt").await;
    let r = c.op("evt", claim_op(Some("fp-b"), None)).await;
    assert!(
        matches!(r, Err(GateError::FingerprintMismatch)),
        "claim with other payload: {r:?}"
    );
    let r = c.mark("evt", Some("fp-b"), None).await;
    assert!(
        matches!(r, Err(GateError::FingerprintMismatch)),
        "mark with other payload: {r:?}"
    );
    assert_eq!(c.get("evt").await, before, "a mismatch changes nothing");
    // Same fingerprint, or none on either side, is a plain duplicate.
    assert!(matches!(
        c.claim_with("evt", Some("fp-a"), None).await,
        Claim::Duplicate { .. }
    ));
    assert!(matches!(
        c.claim_with("evt", None, None).await,
        Claim::Duplicate { .. }
    ));
    c.complete("evt", &lease.token, json!(1)).await.unwrap();
    let r = c.op("evt", claim_op(Some("fp-b"), None)).await;
    assert!(
        matches!(r, Err(GateError::FingerprintMismatch)),
        "mismatch on completed: {r:?}"
    );
    // A record stored without a fingerprint matches anything.
    let Outcome::Marked(Mark::New { .. }) = c.mark("plain", None, None).await.unwrap() else {
        panic!("fresh mark not new")
    };
    let r = c.mark("plain", Some("fp-z"), None).await;
    assert!(
        matches!(r, Ok(Outcome::Marked(Mark::Duplicate { .. }))),
        "{r:?}"
    );
}

async fn mark_new_then_duplicate(h: &dyn Harness) {
    let c = Ctx::new(h, "mark");
    let r = c.mark("evt", Some("fp"), Some(json!({"sent": true}))).await;
    let Ok(Outcome::Marked(Mark::New { record })) = r else {
        panic!("fresh mark: {r:?}")
    };
    assert_eq!(record.state, State::Completed);
    assert_eq!(record.result, Some(json!({"sent": true})));
    assert_eq!(record.fingerprint.as_deref(), Some("fp"));
    let r = c.mark("evt", Some("fp"), None).await;
    assert!(
        matches!(&r, Ok(Outcome::Marked(Mark::Duplicate { record: d })) if *d == record),
        "{r:?}"
    );
    assert_eq!(c.claim_dup("evt").await, record);
    // Mark on a key held in progress is a duplicate.
    c.claim_new("held").await;
    let r = c.mark("held", None, None).await;
    assert!(
        matches!(&r, Ok(Outcome::Marked(Mark::Duplicate { record })) if record.state == State::InProgress),
        "{r:?}"
    );
}

async fn expired_record_is_never_a_duplicate(h: &dyn Harness) {
    let c = Ctx::new(h, "expiry");
    let first = c.claim_new("evt").await;
    c.complete("evt", &first.token, json!(1)).await.unwrap();
    c.mark("marked", None, None).await.unwrap();
    h.advance(TTL_MS + 300).await;
    assert_eq!(
        c.get("evt").await,
        None,
        "expired record must not be returned"
    );
    assert_eq!(c.get("marked").await, None);
    let second = c.claim_new("evt").await;
    assert!(second.fence > first.fence, "fence increases across expiry");
    assert!(matches!(
        c.mark("marked", None, None).await,
        Ok(Outcome::Marked(Mark::New { .. }))
    ));
}

async fn extend_keeps_the_key(h: &dyn Harness) {
    let c = Ctx::new(h, "extend");
    let lease = c.claim_new("evt").await;
    h.advance(LEASE_MS / 2).await;
    let r = c
        .op(
            "evt",
            Op::Extend {
                token: lease.token.clone(),
                lease_ms: LEASE_MS * 2,
            },
        )
        .await;
    let Ok(Outcome::Extended {
        lease_expires_at_ms,
    }) = r
    else {
        panic!("extend: {r:?}")
    };
    assert!(lease_expires_at_ms > lease.lease_expires_at_ms);
    h.advance(LEASE_MS / 2 + 300).await; // past the original lease, inside the extended one
    let dup = c.claim_dup("evt").await;
    assert_eq!(dup.lease_expires_at_ms, Some(lease_expires_at_ms));
    assert!(
        dup.expires_at_ms >= lease_expires_at_ms,
        "a lease never outlives its record"
    );
}

async fn retried_complete_is_answered_and_a_second_release_refused(h: &dyn Harness) {
    let c = Ctx::new(h, "retry_answers");
    let lease = c.claim_new("evt").await;
    let first = c.complete("evt", &lease.token, json!("r1")).await.unwrap();
    let again = c.complete("evt", &lease.token, json!("r2")).await.unwrap();
    assert_eq!(
        first, again,
        "a retried complete answers the stored record unchanged"
    );
    assert_lease_lost(
        c.release("evt", &lease.token).await,
        "release after complete",
    );
    let l2 = c.claim_new("rel").await;
    assert!(matches!(
        c.release("rel", &l2.token).await,
        Ok(Outcome::Released)
    ));
    assert_lease_lost(
        c.release("rel", &l2.token).await,
        "release again: a released token is not the holder's (API.md)",
    );
    assert_lease_lost(
        c.complete("rel", &l2.token, json!(1)).await,
        "complete after release",
    );
}

async fn complete_with_ttl_moves_expiry(h: &dyn Harness) {
    let c = Ctx::new(h, "complete_ttl");
    let lease = c.claim_new("evt").await;
    let r = c
        .op(
            "evt",
            Op::Complete {
                token: lease.token,
                result: None,
                ttl_ms: Some(TTL_MS * 3),
            },
        )
        .await;
    let Ok(Outcome::Completed(rec)) = r else {
        panic!("{r:?}")
    };
    assert!(rec.expires_at_ms > lease.expires_at_ms);
    h.advance(TTL_MS + 300).await;
    assert!(
        c.get("evt").await.is_some(),
        "kept for the ttl given at completion"
    );
}

/// A same-owner re-claim naming a shorter lease (or none, so the default) renews the claim it
/// repeats without cutting its lease, alone or in a batch of claims.
async fn same_owner_reclaim_never_shortens_its_lease(h: &dyn Harness) {
    let c = Ctx::new(h, "reclaim_lease");
    let claim = |lease_ms| Op::Claim {
        ttl_ms: TTL_MS,
        lease_ms,
        fingerprint: None,
        owner: Some("worker-7".to_owned()),
    };
    let keys = ["evt", "b1", "b2"];
    let mut first = Vec::new();
    for key in keys {
        match c.op(key, claim(LEASE_MS * 4)).await {
            Ok(Outcome::Claimed(Claim::New(l))) => first.push(l),
            other => panic!("claim {key}: {other:?}"),
        }
    }
    h.advance(100).await;
    let single = c.op("evt", claim(LEASE_MS)).await;
    let batch = c
        .store
        .apply_ops(vec![
            (c.id("b1"), claim(LEASE_MS)),
            (c.id("b2"), claim(LEASE_MS)),
        ])
        .await;
    for ((key, lease), again) in keys
        .iter()
        .zip(&first)
        .zip([single].into_iter().chain(batch))
    {
        let Ok(Outcome::Claimed(Claim::New(again))) = again else {
            panic!("re-claim {key}: {again:?}")
        };
        assert_eq!(
            (&again.token, again.fence),
            (&lease.token, lease.fence),
            "{key}"
        );
        assert_eq!(
            again.lease_expires_at_ms, lease.lease_expires_at_ms,
            "{key}: a re-claim with a shorter lease keeps the longer one"
        );
        assert!(again.expires_at_ms >= again.lease_expires_at_ms, "{key}");
    }
    h.advance(LEASE_MS + 300).await; // past the shorter lease, inside the first one
    for key in keys {
        let rec = c.claim_dup(key).await;
        assert_eq!(rec.state, State::InProgress, "{key}");
        assert_eq!(rec.owner.as_deref(), Some("worker-7"), "{key}");
    }
}

/// A claim whose ttl is shorter than its lease: the lease holds its record while it runs, but
/// once completed (with no ttl of its own) the record is kept for the claim's ttl from the
/// claim, never until the lease end; a completion after the ttl is answered, then kept for
/// `min(ttl, COMPLETE_GRACE_MS)` from the completion.
async fn completed_record_is_kept_for_the_claims_ttl_not_its_lease(h: &dyn Harness) {
    const SHORT_TTL_MS: u64 = 1_000;
    let c = Ctx::new(h, "claim_ttl");
    let claim = Op::Claim {
        ttl_ms: SHORT_TTL_MS,
        lease_ms: LEASE_MS * 4,
        fingerprint: None,
        owner: None,
    };
    let mut leases = Vec::new();
    for key in ["fast", "slow"] {
        match c.op(key, claim.clone()).await {
            Ok(Outcome::Claimed(Claim::New(l))) => leases.push(l),
            other => panic!("claim {key}: {other:?}"),
        }
    }
    assert!(
        leases[0].expires_at_ms >= leases[0].lease_expires_at_ms,
        "a lease never outlives its record"
    );
    let Ok(Outcome::Completed(fast)) = c.complete("fast", &leases[0].token, json!(1)).await else {
        panic!("complete fast")
    };
    let kept = |r: &Record| {
        (r.created_at_ms + SHORT_TTL_MS)
            .max(r.completed_at_ms.expect("completed") + SHORT_TTL_MS.min(COMPLETE_GRACE_MS))
    };
    assert_eq!(
        fast.expires_at_ms,
        kept(&fast),
        "the claim's ttl from the claim"
    );
    assert!(fast.expires_at_ms < leases[0].lease_expires_at_ms);
    assert_eq!(
        c.claim_dup("fast").await,
        fast,
        "a duplicate within the ttl"
    );

    h.advance(SHORT_TTL_MS + 300).await; // past the ttl, inside the lease
    let Ok(Outcome::Completed(slow)) = c.complete("slow", &leases[1].token, json!(2)).await else {
        panic!("a completion after the ttl, inside the lease, is answered")
    };
    assert_eq!(slow.state, State::Completed);
    assert_eq!(
        slow.expires_at_ms,
        kept(&slow),
        "the grace from its completion"
    );
    assert_eq!(c.get("fast").await, None, "kept for the ttl, not the lease");
    h.advance(SHORT_TTL_MS.min(COMPLETE_GRACE_MS) + 50).await;
    assert_eq!(c.get("slow").await, None);
    for (key, lease) in ["fast", "slow"].into_iter().zip(&leases) {
        let again = c.claim_new(key).await;
        assert!(again.fence > lease.fence, "{key}");
    }
}

/// Work that outlasted its claim's ttl (inside its lease): the complete is answered, and a
/// retried complete whose first answer was lost is answered again with the same record (not
/// `lease_lost`) until `min(ttl, COMPLETE_GRACE_MS)` after the completion; then the record goes.
async fn retried_complete_after_the_ttl_is_answered_for_the_grace(h: &dyn Harness) {
    const SHORT_TTL_MS: u64 = 1_000;
    let grace = SHORT_TTL_MS.min(COMPLETE_GRACE_MS);
    let c = Ctx::new(h, "complete_grace");
    let claim = Op::Claim {
        ttl_ms: SHORT_TTL_MS,
        lease_ms: LEASE_MS * 4,
        fingerprint: None,
        owner: None,
    };
    let lease = match c.op("evt", claim).await {
        Ok(Outcome::Claimed(Claim::New(l))) => l,
        other => panic!("claim: {other:?}"),
    };
    h.advance(SHORT_TTL_MS + 300).await; // past the ttl, inside the lease
    let Ok(Outcome::Completed(first)) = c.complete("evt", &lease.token, json!(1)).await else {
        panic!("a completion after the ttl, inside the lease, is answered")
    };
    assert_eq!(
        first.expires_at_ms,
        first.completed_at_ms.expect("completed") + grace,
        "kept for the grace from the completion"
    );
    h.advance(grace / 2).await; // the first answer was lost; the caller retries
    match c.complete("evt", &lease.token, json!(2)).await {
        Ok(Outcome::Completed(again)) => assert_eq!(again, first, "answered again, unchanged"),
        other => panic!("a retried complete within the grace: {other:?}"),
    }
    assert_eq!(c.get("evt").await.as_ref(), Some(&first));
    h.advance(grace / 2 + 100).await;
    assert_eq!(c.get("evt").await, None, "gone once the grace ends");
    assert_lease_lost(
        c.complete("evt", &lease.token, json!(3)).await,
        "complete after the grace",
    );
}

async fn get_and_forget(h: &dyn Harness) {
    let c = Ctx::new(h, "forget");
    assert_eq!(c.get("evt").await, None);
    assert!(matches!(
        c.op("evt", Op::Forget).await,
        Ok(Outcome::Forgotten(false))
    ));
    c.mark("evt", None, None).await.unwrap();
    assert!(c.get("evt").await.is_some());
    assert!(matches!(
        c.op("evt", Op::Forget).await,
        Ok(Outcome::Forgotten(true))
    ));
    assert_eq!(c.get("evt").await, None);
    assert!(matches!(
        c.mark("evt", None, None).await,
        Ok(Outcome::Marked(Mark::New { .. }))
    ));
}

async fn invalid_ops_change_nothing(h: &dyn Harness) {
    let c = Ctx::new(h, "invalid");
    let bad = [
        Op::Claim {
            ttl_ms: 0,
            lease_ms: LEASE_MS,
            fingerprint: None,
            owner: None,
        },
        Op::Claim {
            ttl_ms: TTL_MS,
            lease_ms: 0,
            fingerprint: None,
            owner: None,
        },
        Op::Claim {
            ttl_ms: u64::MAX,
            lease_ms: LEASE_MS,
            fingerprint: None,
            owner: None,
        },
        Op::Claim {
            ttl_ms: TTL_MS,
            lease_ms: LEASE_MS,
            fingerprint: Some(String::new()),
            owner: None,
        },
        Op::Claim {
            ttl_ms: TTL_MS,
            lease_ms: LEASE_MS,
            fingerprint: None,
            owner: Some("o".repeat(300)),
        },
        Op::Mark {
            ttl_ms: 0,
            fingerprint: None,
            result: None,
        },
        Op::Extend {
            token: Token::new(""),
            lease_ms: 10,
        },
    ];
    for op in bad {
        let r = c.op("evt", op.clone()).await;
        assert!(
            matches!(r, Err(GateError::Invalid(_))),
            "{op:?} answered {r:?}"
        );
    }
    assert_eq!(c.get("evt").await, None, "invalid ops stored nothing");
    let lease = c.claim_new("evt").await;
    let r = c
        .op(
            "evt",
            Op::Extend {
                token: lease.token,
                lease_ms: 0,
            },
        )
        .await;
    assert!(
        matches!(r, Err(GateError::Invalid(_))),
        "zero extend: {r:?}"
    );
    assert_eq!(
        c.get("evt").await.unwrap().lease_expires_at_ms,
        Some(lease.lease_expires_at_ms)
    );
    // Bad identities cannot even be built.
    assert!(RecordId::new("", "k").is_err());
    assert!(RecordId::new("has space", "k").is_err());
    assert!(RecordId::new("n".repeat(129), "k").is_err());
    assert!(RecordId::new("ns", "").is_err());
    assert!(RecordId::new("ns", "k".repeat(1025)).is_err());
}

async fn keys_are_stored_exactly(h: &dyn Harness) {
    let c = Ctx::new(h, "exact_keys");
    let keys = [
        "a\0b".to_owned(),
        "a\0c".to_owned(),
        "a".to_owned(),
        "Ä".to_owned(),
        "A\u{308}".to_owned(), // the same letter, decomposed: a different key
        "🦀 crab {tag}".to_owned(),
        "k".repeat(1024),
        "é".repeat(512), // 1024 bytes
        "line\nbreak\ttab'quote\"\\".to_owned(),
        "%00%zz*?[]".to_owned(),
    ];
    for k in &keys {
        c.claim_new(k).await;
    }
    for k in &keys {
        let rec = c.claim_dup(k).await;
        assert_eq!(rec.key.as_str(), k.as_str(), "key comes back exactly");
    }
    let ns_max = "n".repeat(crate::model::NAMESPACE_BYTES_MAX - 20);
    let ns = format!("{ns_max}{:x}", rand::thread_rng().gen::<u64>());
    let id = RecordId::new(ns, "x").unwrap();
    assert!(matches!(
        c.store.apply_op(id, claim_op(None, None)).await,
        Ok(Outcome::Claimed(Claim::New(_)))
    ));
}

async fn fences_strictly_increase(h: &dyn Harness) {
    let c = Ctx::new(h, "fences");
    let mut last = 0;
    for i in 0..30 {
        let lease = c.claim_new("evt").await;
        assert!(
            lease.fence > last,
            "cycle {i}: fence {} not above {last}",
            lease.fence
        );
        last = lease.fence;
        if i % 3 == 2 {
            c.op("evt", Op::Forget).await.unwrap();
        } else {
            c.release("evt", &lease.token).await.unwrap();
        }
    }
}

async fn batch_in_order_with_item_errors(h: &dyn Harness) {
    let c = Ctx::new(h, "batch");
    let ops = vec![
        (c.id("a"), claim_op(None, None)),
        (c.id("a"), claim_op(None, None)),
        (
            c.id("b"),
            Op::Mark {
                ttl_ms: TTL_MS,
                fingerprint: None,
                result: Some(json!(7)),
            },
        ),
        (
            c.id("c"),
            Op::Claim {
                ttl_ms: 0,
                lease_ms: 1,
                fingerprint: None,
                owner: None,
            },
        ),
        (
            c.id("b"),
            Op::Release {
                token: Token::new("nope"),
            },
        ),
        (c.id("b"), Op::Get),
    ];
    let out = c.store.apply_ops(ops).await;
    assert_eq!(out.len(), 6);
    assert!(
        matches!(out[0], Ok(Outcome::Claimed(Claim::New(_)))),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Ok(Outcome::Claimed(Claim::Duplicate { .. }))),
        "later op sees earlier: {:?}",
        out[1]
    );
    assert!(
        matches!(out[2], Ok(Outcome::Marked(Mark::New { .. }))),
        "{:?}",
        out[2]
    );
    assert!(matches!(out[3], Err(GateError::Invalid(_))), "{:?}", out[3]);
    assert!(matches!(out[4], Err(GateError::LeaseLost)), "{:?}", out[4]);
    assert!(
        matches!(&out[5], Ok(Outcome::Found(Some(r))) if r.result == Some(json!(7))),
        "{:?}",
        out[5]
    );
    assert_eq!(c.get("c").await, None);
    let big: Vec<_> = (0..2_000)
        .map(|i| (c.id(&format!("bulk-{i}")), claim_op(None, None)))
        .collect();
    let out = c.store.apply_ops(big).await;
    assert!(out
        .iter()
        .all(|r| matches!(r, Ok(Outcome::Claimed(Claim::New(_))))));
}

async fn sweep_removes_expired_entries(h: &dyn Harness) {
    let c = Ctx::new(h, "sweep");
    for i in 0..20 {
        c.mark(&format!("k{i}"), None, None).await.unwrap();
    }
    h.advance(TTL_MS + 300).await;
    // Sweep in bounded batches until nothing more goes (other cases' entries may expire too).
    let mut rounds = 0;
    while c.store.sweep_expired(7).await.expect("sweep") > 0 {
        rounds += 1;
        assert!(rounds < 100_000, "sweep never finished");
    }
    for i in 0..20 {
        assert_eq!(c.get(&format!("k{i}")).await, None);
    }
    assert!(matches!(
        c.mark("k0", None, None).await,
        Ok(Outcome::Marked(Mark::New { .. }))
    ));
}

async fn concurrent_claims_one_new_per_key(h: &dyn Harness) {
    let c = Ctx::new(h, "concurrent_claims");
    let keys = 40;
    let tasks = 64;
    let results = join_all((0..tasks).map(|t| {
        let store = c.store.clone();
        let ns = c.ns.clone();
        tokio::spawn(async move {
            let mut news = Vec::new();
            for k in 0..keys {
                // Each task walks the keys from a different start to overlap differently.
                let key = format!("k{}", (k + t * 7) % keys);
                let id = RecordId::new(ns.clone(), key.clone()).unwrap();
                // A long lease: on a loaded machine 2,560 claims may outlast a short one, and a
                // takeover after the lease is a legitimate second "new".
                let op = Op::Claim {
                    ttl_ms: 600_000,
                    lease_ms: 600_000,
                    fingerprint: None,
                    owner: None,
                };
                match store.apply_op(id, op).await {
                    Ok(Outcome::Claimed(Claim::New(l))) => news.push((key, l.fence)),
                    Ok(Outcome::Claimed(Claim::Duplicate { .. })) => {}
                    other => panic!("concurrent claim: {other:?}"),
                }
            }
            news
        })
    }))
    .await;
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for r in results {
        for (key, _) in r.expect("task panicked") {
            *per_key.entry(key).or_default() += 1;
        }
    }
    assert_eq!(per_key.len(), keys, "every key was claimed once");
    assert!(
        per_key.values().all(|&n| n == 1),
        "exactly one new per key: {per_key:?}"
    );
}

async fn concurrent_marks_one_new_per_key(h: &dyn Harness) {
    let c = Ctx::new(h, "concurrent_marks");
    let results = join_all((0..32).map(|_| {
        let store = c.store.clone();
        let ns = c.ns.clone();
        tokio::spawn(async move {
            let ops = (0..25)
                .map(|k| {
                    let id = RecordId::new(ns.clone(), format!("m{k}")).unwrap();
                    (
                        id,
                        Op::Mark {
                            ttl_ms: TTL_MS,
                            fingerprint: None,
                            result: None,
                        },
                    )
                })
                .collect();
            store
                .apply_ops(ops)
                .await
                .into_iter()
                .filter(|r| matches!(r, Ok(Outcome::Marked(Mark::New { .. }))))
                .count()
        })
    }))
    .await;
    let news: usize = results.into_iter().map(|r| r.expect("task panicked")).sum();
    assert_eq!(news, 25, "exactly one new mark per key");
}

/// Rounds of [`concurrent_overlapping_batches_one_new_per_key`]: at least the first, more while
/// the time allows, so a race shows up over many rounds while CI stays fast.
const OVERLAP_ROUNDS_MIN: usize = 3;
const OVERLAP_ROUNDS_MAX: usize = 40;
const OVERLAP_BUDGET: Duration = Duration::from_secs(3);

/// Clients sending batches at once, each of many claims drawn with repeats from a few shared
/// keys, so batches lock overlapping keys in different orders and a key recurs in one batch
/// (the load of a user's report: 8 clients, 4 batches each, 250 claims over 300 keys). Every
/// item is decided, each key is new exactly once over all batches, only a key's first
/// occurrence in a batch can be the new one, and every duplicate shows the new claim's fence.
async fn concurrent_overlapping_batches_one_new_per_key(h: &dyn Harness) {
    const CLIENTS: usize = 8;
    const BATCHES: usize = 4;
    const OPS: usize = 250;
    const KEYS: usize = 300;
    let c = Ctx::new(h, "overlapping_batches");
    let started = Instant::now();
    let mut round = 0;
    while round < OVERLAP_ROUNDS_MIN
        || (round < OVERLAP_ROUNDS_MAX && started.elapsed() < OVERLAP_BUDGET)
    {
        let seed: u64 = rand::thread_rng().gen();
        let results = join_all((0..CLIENTS).map(|client| {
            let store = c.store.clone();
            let ns = c.ns.clone();
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ client as u64);
                let mut answered = Vec::new();
                for _ in 0..BATCHES {
                    let keys: Vec<String> = (0..OPS)
                        .map(|_| format!("r{round}-k{}", rng.gen_range(0..KEYS)))
                        .collect();
                    let ops = keys
                        .iter()
                        .map(|k| {
                            // A long lease: a takeover after the lease would be a second new.
                            let op = Op::Claim {
                                ttl_ms: 600_000,
                                lease_ms: 600_000,
                                fingerprint: None,
                                owner: None,
                            };
                            (RecordId::new(ns.clone(), k.clone()).unwrap(), op)
                        })
                        .collect();
                    let out = store.apply_ops(ops).await;
                    answered.push((keys, out));
                }
                answered
            })
        }))
        .await;
        let mut fence_of_new: HashMap<String, u64> = HashMap::new();
        let mut dup_fences: Vec<(String, u64)> = Vec::new();
        for (client, batches) in results.into_iter().enumerate() {
            let batches = batches.expect("task panicked");
            for (b, (keys, out)) in batches.into_iter().enumerate() {
                assert_eq!(out.len(), keys.len(), "one answer per op");
                let mut seen = std::collections::HashSet::new();
                for (i, (key, answer)) in keys.into_iter().zip(out).enumerate() {
                    let first = seen.insert(key.clone());
                    let at = format!(
                        "round {round} (seed {seed}), client {client}, batch {b}, item {i} ({key})"
                    );
                    match answer {
                        Ok(Outcome::Claimed(Claim::New(lease))) => {
                            assert!(first, "{at}: new after the same key earlier in the batch");
                            let before = fence_of_new.insert(key, lease.fence);
                            assert!(before.is_none(), "{at}: a second new");
                        }
                        Ok(Outcome::Claimed(Claim::Duplicate { record })) => {
                            assert_eq!(record.state, State::InProgress, "{at}");
                            dup_fences.push((key, record.fence));
                        }
                        other => panic!("{at}: expected new or duplicate, got {other:?}"),
                    }
                }
            }
        }
        for (key, fence) in dup_fences {
            assert_eq!(
                fence_of_new.get(&key),
                Some(&fence),
                "round {round} (seed {seed}): a duplicate of {key} shows another claim's fence"
            );
        }
        round += 1;
    }
    eprintln!("conformance: overlapping batches: {round} rounds");
}
