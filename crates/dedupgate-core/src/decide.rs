//! The one decision: given the stored entry (if any), an operation and the store's clock, what is
//! the answer and what should be stored next. No I/O. In-process stores call [`decide`] inside
//! their atomic section; remote stores re-express it in the engine (a Lua script, one SQL
//! statement) and the conformance suite keeps them equal to it.
//!
//! Invariants kept here:
//! - An entry at or past `expires_at_ms` is absent: never a duplicate, never a holder.
//! - A fingerprint mismatch (both non-null and different) on a live record is an error and
//!   changes nothing.
//! - Fences strictly increase per (namespace, key): a new claim takes
//!   `max(previous + 1, now_ms * FENCE_PER_MS)`. The previous fence is read from whatever entry is
//!   still stored (live, expired or a release tombstone); once an entry is gone the clock term
//!   still exceeds every earlier fence unless one key saw more than [`FENCE_PER_MS`] successful
//!   claims in one millisecond.
//! - Only the current token completes, releases or extends; a retried complete with the token
//!   that did it is answered again without a change, so a lost answer is safe to retry. A
//!   released token is no longer the holder's: releasing again answers `lease_lost` (API.md),
//!   which tells a caller that retried after a lost answer what it needs, that it holds nothing.

use crate::error::GateError;
use crate::model::{Entry, EntryState, RecordId, Token};
use crate::op::{Claim, Lease, Mark, Op, Outcome};
use crate::valid::ValidOp;

/// Fence units per millisecond of the store's clock: the headroom of claims per ms per key.
pub const FENCE_PER_MS: u64 = 1000;

/// How long, at least, a completed record outlives its completion when the complete names no
/// ttl and the work outlasted its claim's ttl (capped by that ttl): a retried complete whose
/// first answer was lost is answered again for that long, not refused as `lease_lost`. Short
/// enough that a job run every 5 min with `--ttl 4m` is not pushed past its next trigger unless
/// it ends within 10 s of it. `decide.lua` and `functions.sql` restate it.
pub const COMPLETE_GRACE_MS: u64 = 10_000;

/// What the store must do after a decision.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Nothing to write.
    Keep,
    /// Store this entry under the id (replacing any). Entries are only ever removed by the
    /// sweeper, once expired, so a fence is never forgotten early.
    Put(Entry),
}

/// The answer and the change, which the store applies atomically together.
#[derive(Debug)]
pub struct Decision {
    /// What the caller is told.
    pub answer: Result<Outcome, GateError>,
    /// What the store writes before telling it.
    pub change: Change,
}

impl Decision {
    fn keep(answer: Result<Outcome, GateError>) -> Self {
        Self {
            answer,
            change: Change::Keep,
        }
    }
}

/// The fence for a new claim after `previous` (any stored entry's fence) at `now_ms`.
pub fn next_fence(previous: Option<u64>, now_ms: u64) -> u64 {
    let from_clock = now_ms.saturating_mul(FENCE_PER_MS);
    previous.map_or(from_clock, |f| from_clock.max(f.saturating_add(1)))
}

fn mismatch(stored: &Option<String>, given: &Option<String>) -> bool {
    matches!((stored, given), (Some(a), Some(b)) if a != b)
}

/// When a claim completed at `now_ms` is forgotten: `ttl_ms` from now when the complete names
/// one; else the claim's own ttl from the claim, not the lease end that may have held the
/// claim's expiry later; but never before `now_ms + min(ttl, COMPLETE_GRACE_MS)`, so when the
/// work outlasted its ttl a retried complete is still answered for the grace.
fn completed_expiry(claimed: &Entry, ttl_ms: Option<u64>, now_ms: u64) -> u64 {
    match (ttl_ms, claimed.ttl_ms) {
        (Some(ttl_ms), _) => now_ms + ttl_ms,
        (None, Some(claim_ttl_ms)) => {
            (claimed.created_at_ms + claim_ttl_ms).max(now_ms + claim_ttl_ms.min(COMPLETE_GRACE_MS))
        }
        (None, None) => claimed.expires_at_ms,
    }
}

/// Decides `op` on `id` whose stored entry is `current`, at `now_ms` on the store's clock.
/// `fresh_token` is called only when a new claim needs a token. The op is a [`ValidOp`], so
/// its durations are in range (`now_ms + ttl_ms` cannot overflow) without a check here.
pub fn decide(
    id: &RecordId,
    op: ValidOp,
    current: Option<&Entry>,
    now_ms: u64,
    fresh_token: impl FnOnce() -> Token,
) -> Decision {
    // The entry that counts: live and not a tombstone. Expired entries are absent.
    let live = current.filter(|e| e.is_live(now_ms) && e.state != EntryState::Released);
    let previous_fence = current.map(|e| e.fence);
    let record = |e: &Entry| {
        e.to_record(id, now_ms)
            .expect("a live entry that is not a tombstone has a public record")
    };

    match op.into_op() {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => {
            let lease_expires_at_ms = now_ms + lease_ms;
            let take = |fingerprint, owner| {
                let token = fresh_token();
                let fence = next_fence(previous_fence, now_ms);
                let expires_at_ms = (now_ms + ttl_ms).max(lease_expires_at_ms);
                let entry = Entry {
                    state: EntryState::InProgress,
                    fence,
                    token: Some(token.clone()),
                    fingerprint,
                    owner,
                    created_at_ms: now_ms,
                    expires_at_ms,
                    lease_expires_at_ms: Some(lease_expires_at_ms),
                    completed_at_ms: None,
                    result: None,
                    ttl_ms: Some(ttl_ms),
                };
                let lease = Lease {
                    token,
                    fence,
                    lease_expires_at_ms,
                    expires_at_ms,
                };
                Decision {
                    answer: Ok(Outcome::Claimed(Claim::New(lease))),
                    change: Change::Put(entry),
                }
            };
            let Some(e) = live else {
                return take(fingerprint, owner);
            };
            if mismatch(&e.fingerprint, &fingerprint) {
                return Decision::keep(Err(GateError::FingerprintMismatch));
            }
            match e.state {
                EntryState::InProgress if owner.is_some() && e.owner == owner => {
                    // The same worker again (its first answer was lost): same token and fence.
                    // The renewal never shortens the lease it renews (a retry may name a
                    // shorter lease than the claim it repeats, or none at all).
                    let lease_expires_at_ms = e
                        .lease_expires_at_ms
                        .map_or(lease_expires_at_ms, |l| l.max(lease_expires_at_ms));
                    let mut renewed = e.clone();
                    renewed.lease_expires_at_ms = Some(lease_expires_at_ms);
                    renewed.expires_at_ms = e.expires_at_ms.max(lease_expires_at_ms);
                    let lease = Lease {
                        token: e
                            .token
                            .clone()
                            .expect("an in_progress entry holds its token"),
                        fence: e.fence,
                        lease_expires_at_ms,
                        expires_at_ms: renewed.expires_at_ms,
                    };
                    Decision {
                        answer: Ok(Outcome::Claimed(Claim::New(lease))),
                        change: Change::Put(renewed),
                    }
                }
                EntryState::InProgress if e.lease_passed(now_ms) => take(fingerprint, owner),
                _ => Decision::keep(Ok(Outcome::Claimed(Claim::Duplicate { record: record(e) }))),
            }
        }

        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => {
            let set = |fingerprint, result| {
                let entry = Entry {
                    state: EntryState::Completed,
                    fence: next_fence(previous_fence, now_ms),
                    token: None,
                    fingerprint,
                    owner: None,
                    created_at_ms: now_ms,
                    expires_at_ms: now_ms + ttl_ms,
                    lease_expires_at_ms: None,
                    completed_at_ms: Some(now_ms),
                    result,
                    ttl_ms: None,
                };
                let record = record(&entry);
                Decision {
                    answer: Ok(Outcome::Marked(Mark::New { record })),
                    change: Change::Put(entry),
                }
            };
            let Some(e) = live else {
                return set(fingerprint, result);
            };
            if mismatch(&e.fingerprint, &fingerprint) {
                return Decision::keep(Err(GateError::FingerprintMismatch));
            }
            if e.state == EntryState::InProgress && e.lease_passed(now_ms) {
                return set(fingerprint, result);
            }
            Decision::keep(Ok(Outcome::Marked(Mark::Duplicate { record: record(e) })))
        }

        Op::Complete {
            token,
            result,
            ttl_ms,
        } => match live {
            Some(e) if e.token.as_ref() == Some(&token) => match e.state {
                EntryState::InProgress => {
                    let mut done = e.clone();
                    done.state = EntryState::Completed;
                    done.lease_expires_at_ms = None;
                    done.completed_at_ms = Some(now_ms);
                    done.result = result;
                    done.ttl_ms = None;
                    done.expires_at_ms = completed_expiry(e, ttl_ms, now_ms);
                    Decision {
                        answer: Ok(Outcome::Completed(record(&done))),
                        change: Change::Put(done),
                    }
                }
                // A retried complete whose first answer was lost: answer it, change nothing.
                _ => Decision::keep(Ok(Outcome::Completed(record(e)))),
            },
            _ => Decision::keep(Err(GateError::LeaseLost)),
        },

        Op::Release { token } => match current.filter(|e| e.is_live(now_ms)) {
            Some(e) if e.token.as_ref() == Some(&token) => match e.state {
                EntryState::InProgress => {
                    let mut tombstone = e.clone();
                    tombstone.state = EntryState::Released;
                    tombstone.lease_expires_at_ms = None;
                    tombstone.result = None;
                    // in_progress only, so an older build reads the tombstone.
                    tombstone.ttl_ms = None;
                    Decision {
                        answer: Ok(Outcome::Released),
                        change: Change::Put(tombstone),
                    }
                }
                // A released token is no longer the holder's (API.md), so a second release
                // is refused like any other stale token; the caller holds nothing either way.
                EntryState::Released | EntryState::Completed => {
                    Decision::keep(Err(GateError::LeaseLost))
                }
            },
            _ => Decision::keep(Err(GateError::LeaseLost)),
        },

        Op::Extend { token, lease_ms } => match live {
            Some(e) if e.state == EntryState::InProgress && e.token.as_ref() == Some(&token) => {
                let lease_expires_at_ms = now_ms + lease_ms;
                let mut extended = e.clone();
                extended.lease_expires_at_ms = Some(lease_expires_at_ms);
                extended.expires_at_ms = e.expires_at_ms.max(lease_expires_at_ms);
                Decision {
                    answer: Ok(Outcome::Extended {
                        lease_expires_at_ms,
                    }),
                    change: Change::Put(extended),
                }
            }
            _ => Decision::keep(Err(GateError::LeaseLost)),
        },

        Op::Get => Decision::keep(Ok(Outcome::Found(live.map(record)))),

        // Forgetting leaves a fence-keeping tombstone (like a release) so that a claim in the
        // same millisecond still gets a higher fence; the tombstone goes at the old expiry.
        Op::Forget => match live {
            Some(e) => {
                let mut tombstone = e.clone();
                tombstone.state = EntryState::Released;
                tombstone.token = None;
                tombstone.lease_expires_at_ms = None;
                tombstone.result = None;
                tombstone.ttl_ms = None;
                Decision {
                    answer: Ok(Outcome::Forgotten(true)),
                    change: Change::Put(tombstone),
                }
            }
            None => Decision::keep(Ok(Outcome::Forgotten(false))),
        },
    }
}

/// The answer [`decide`] gives `op` on `current` at `now_ms` when that decision changes nothing
/// (a duplicate, a refusal, a get), or `None` when it would write. For answers given beside the
/// store's atomic section (the embedded store's durable view, the tiered store's cache): a
/// decision that changes nothing needs no lock, and taking it from [`decide`] keeps those
/// answers from restating its rules. A decision that would write is left to the caller's
/// writer, so no token is drawn here.
pub fn decide_read_only(
    id: &RecordId,
    op: &ValidOp,
    current: Option<&Entry>,
    now_ms: u64,
) -> Option<Result<Outcome, GateError>> {
    // Only a decision that creates a claim asks for a token, and that one is dropped.
    let decision = decide(
        id,
        op.clone(),
        current,
        now_ms,
        || Token::new(String::new()),
    );
    match decision.change {
        Change::Keep => Some(decision.answer),
        Change::Put(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> RecordId {
        RecordId::new("ns", "k").unwrap()
    }

    /// [`super::decide`] on an op the tests write out in full (valid by construction here;
    /// that an invalid one cannot be built is tested in `valid.rs`).
    fn decide(
        id: &RecordId,
        op: Op,
        current: Option<&Entry>,
        now_ms: u64,
        fresh_token: impl FnOnce() -> Token,
    ) -> Decision {
        let op = ValidOp::try_from(op).expect("the tests' ops are valid");
        super::decide(id, op, current, now_ms, fresh_token)
    }

    /// [`super::decide_read_only`] on an op written out in full.
    fn decide_read_only(
        id: &RecordId,
        op: &Op,
        current: Option<&Entry>,
        now_ms: u64,
    ) -> Option<Result<Outcome, GateError>> {
        let op = ValidOp::try_from(op.clone()).expect("the tests' ops are valid");
        super::decide_read_only(id, &op, current, now_ms)
    }

    fn claim(owner: Option<&str>) -> Op {
        Op::Claim {
            ttl_ms: 10_000,
            lease_ms: 1_000,
            fingerprint: None,
            owner: owner.map(str::to_owned),
        }
    }

    fn put(d: Decision) -> Entry {
        match d.change {
            Change::Put(e) => e,
            other => panic!("expected a put, got {other:?}"),
        }
    }

    #[test]
    fn fence_never_goes_back_even_when_the_clock_lags() {
        assert_eq!(next_fence(None, 5), 5 * FENCE_PER_MS);
        assert_eq!(next_fence(Some(10_000), 5), 10_001);
        assert_eq!(next_fence(Some(1), 5), 5_000);
    }

    #[test]
    fn takeover_after_lease_gets_higher_fence_and_new_token() {
        let first = put(decide(&id(), claim(None), None, 100, Token::generate));
        let d = decide(&id(), claim(None), Some(&first), 1_100, Token::generate);
        let second = put(d);
        assert!(second.fence > first.fence);
        assert_ne!(second.token, first.token);
    }

    fn complete_at(claimed: &Entry, ttl_ms: Option<u64>, now_ms: u64) -> Entry {
        let op = Op::Complete {
            token: claimed.token.clone().unwrap(),
            result: None,
            ttl_ms,
        };
        put(decide(&id(), op, Some(claimed), now_ms, Token::generate))
    }

    #[test]
    fn a_completed_record_is_kept_for_its_claims_ttl_not_its_lease() {
        let op = Op::Claim {
            ttl_ms: 2_000,
            lease_ms: 30_000,
            fingerprint: None,
            owner: None,
        };
        let held = put(decide(&id(), op, None, 100, Token::generate));
        assert_eq!(
            held.expires_at_ms, 30_100,
            "the lease holds the claim's record"
        );
        assert_eq!(complete_at(&held, None, 100).expires_at_ms, 2_100);
        // The grace (here the whole 2 s ttl) past the completion is the floor.
        assert_eq!(complete_at(&held, None, 500).expires_at_ms, 2_500);
        // Work that outlasted its ttl: the completed record is kept min(ttl, grace) from then,
        // so a retried complete is answered again.
        assert_eq!(complete_at(&held, None, 9_000).expires_at_ms, 11_000);
        // A 60 s ttl under a 120 s lease.
        let long = Entry {
            ttl_ms: Some(60_000),
            expires_at_ms: 120_100,
            lease_expires_at_ms: Some(120_100),
            ..held.clone()
        };
        assert_eq!(complete_at(&long, None, 20_000).expires_at_ms, 60_100);
        assert_eq!(
            complete_at(&long, None, 70_000).expires_at_ms,
            70_000 + COMPLETE_GRACE_MS
        );
        // A ttl named at completion counts from then.
        assert_eq!(complete_at(&held, Some(50), 500).expires_at_ms, 550);
        // An entry stored before claims kept their ttl keeps its expiry.
        let old = Entry {
            ttl_ms: None,
            ..held
        };
        assert_eq!(complete_at(&old, None, 500).expires_at_ms, 30_100);
    }

    #[test]
    fn release_leaves_a_tombstone_that_keeps_the_fence() {
        let held = put(decide(&id(), claim(None), None, 100, Token::generate));
        let token = held.token.clone().unwrap();
        let tomb = put(decide(
            &id(),
            Op::Release { token },
            Some(&held),
            101,
            Token::generate,
        ));
        assert_eq!(tomb.state, EntryState::Released);
        assert_eq!(tomb.ttl_ms, None, "ttl_ms is for in_progress entries only");
        let again = put(decide(
            &id(),
            claim(None),
            Some(&tomb),
            100,
            Token::generate,
        ));
        assert_eq!(again.fence, held.fence + 1);
    }

    #[test]
    fn forget_leaves_a_tombstone_without_the_claims_ttl() {
        let held = put(decide(&id(), claim(None), None, 100, Token::generate));
        assert_eq!(held.ttl_ms, Some(10_000));
        let tomb = put(decide(&id(), Op::Forget, Some(&held), 101, Token::generate));
        assert_eq!(tomb.state, EntryState::Released);
        assert_eq!(tomb.ttl_ms, None, "ttl_ms is for in_progress entries only");
    }

    fn completed(fingerprint: Option<&str>) -> Entry {
        let op = Op::Mark {
            ttl_ms: 10_000,
            fingerprint: fingerprint.map(str::to_owned),
            result: Some(serde_json::json!({"ok": true})),
        };
        put(decide(&id(), op, None, 100, Token::generate))
    }

    #[test]
    fn a_read_only_decision_answers_what_changes_nothing() {
        let done = completed(Some("fp"));
        let Some(Ok(Outcome::Claimed(Claim::Duplicate { record }))) =
            decide_read_only(&id(), &claim(None), Some(&done), 200)
        else {
            panic!("a claim of a completed key is a duplicate");
        };
        assert_eq!(record, done.to_record(&id(), 200).unwrap());
        let mark = Op::Mark {
            ttl_ms: 5,
            fingerprint: Some("other".into()),
            result: None,
        };
        assert!(matches!(
            decide_read_only(&id(), &mark, Some(&done), 200),
            Some(Err(GateError::FingerprintMismatch))
        ));
        assert!(matches!(
            decide_read_only(&id(), &Op::Get, Some(&done), 200),
            Some(Ok(Outcome::Found(Some(_))))
        ));
        assert!(matches!(
            decide_read_only(&id(), &Op::Get, None, 200),
            Some(Ok(Outcome::Found(None)))
        ));
    }

    #[test]
    fn a_read_only_decision_leaves_every_write_to_the_writer() {
        assert!(decide_read_only(&id(), &claim(None), None, 100).is_none());
        let held = put(decide(&id(), claim(Some("w")), None, 100, Token::generate));
        // The same owner again renews its lease: a write.
        assert!(decide_read_only(&id(), &claim(Some("w")), Some(&held), 200).is_none());
        // Another claimer while the lease holds: a duplicate, no write.
        assert!(matches!(
            decide_read_only(&id(), &claim(Some("v")), Some(&held), 200),
            Some(Ok(Outcome::Claimed(Claim::Duplicate { .. })))
        ));
        // After the lease passed the key is taken over: a write.
        assert!(decide_read_only(&id(), &claim(Some("v")), Some(&held), 1_100).is_none());
        // Past its expiry a completed record is absent: a mark creates a new one.
        let done = completed(None);
        let mark = Op::Mark {
            ttl_ms: 5,
            fingerprint: None,
            result: None,
        };
        assert!(decide_read_only(&id(), &mark, Some(&done), 10_100).is_none());
    }
}
