//! The effect oracle: reads the effect ledger and the log of every gate answer and checks the
//! promises of issue 7. An unknown answer is never read as a failure: it proves nothing either
//! way, so each check only relies on answers that were actually received.
//!
//! - **I1** at most one effect per event inside its window. Idempotent events: at most one
//!   accepted effect, ever (the whole run is one window). Retriable events: a second accepted
//!   effect is allowed by the retriable ordering only as a *re-execution*: the earlier attempt's
//!   completion was never acknowledged (it was killed between effect and completion, or paused
//!   past its lease and refused) and the later claim was granted after the earlier lease ended.
//!   Anything else (an effect after an acknowledged completion, two effects with one fence, a
//!   takeover inside a live lease) is a duplicate.
//! - **I2** after faults stop and leases run out (the drain pass), every delivered retriable event
//!   has an accepted effect and a completed record.
//! - **I3** fences strictly increase per key in the order the claims were granted, and no
//!   completion is acknowledged for a token after a later claim of the key was acknowledged.
//! - **I4** every acknowledged completion or mark is still there at the end, with the result of
//!   the attempt that was acknowledged.
//! - **I5** every duplicate of a completed key replays the stored result unchanged.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use dedupgate_core::{Claim, Mark, State};
use serde::Serialize;

use crate::delivery::{Delivery, DeliveryMode};
use crate::history::{Event, HAnswer, HOp};
use crate::ledger::Effect;

/// What the oracle found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OracleReport {
    /// Events (keys) checked.
    pub events_checked: u64,
    /// Gate answers read.
    pub answers_read: u64,
    /// Of which unknown.
    pub answers_unknown: u64,
    /// Effects the sink accepted.
    pub effects_accepted: u64,
    /// Late writes the fence-checking sink refused.
    pub late_writes_rejected: u64,
    /// Retriable re-executions the ordering allows (see I1), all kinds.
    pub reexecutions: u64,
    /// Attempts whose effect landed but whose completion never got an answer (killed between
    /// effect and completion, or its answer was lost).
    pub effects_without_completion_answer: u64,
    /// Completions refused as lease_lost (stale holders).
    pub stale_completions_refused: u64,
    /// I1 violations.
    pub duplicates: Vec<String>,
    /// I2 and I4 violations.
    pub lost: Vec<String>,
    /// I3 violations.
    pub fence_violations: Vec<String>,
    /// I5 violations.
    pub replay_mismatches: Vec<String>,
}

impl OracleReport {
    /// True when no invariant was broken.
    pub fn ok(&self) -> bool {
        self.duplicates.is_empty()
            && self.lost.is_empty()
            && self.fence_violations.is_empty()
            && self.replay_mismatches.is_empty()
    }
}

#[derive(Default, Debug)]
struct Attempt {
    fence: Option<u64>,
    /// (store time of the grant, lease end) of each New answer it got.
    grants: Vec<(u64, u64)>,
    token: Option<String>,
    completed_ack: bool,
    completion_answered: bool,
    marked_ack: bool,
}

fn attempt_of_result(v: &Option<serde_json::Value>) -> Option<String> {
    v.as_ref()?.get("attempt")?.as_str().map(str::to_owned)
}

/// An event: (namespace, key).
pub(crate) type EventId = (String, String);

/// I1 from the effect ledger, shared by [`check`] and `cron::check`: counts accepted
/// and rejected effects into `r`, groups the accepted ones by event (sorted by fence, then
/// effect time) and judges each consecutive pair. An idempotent event with two effects is a
/// duplicate; for a retriable one, two effects with one fence are a duplicate, and otherwise
/// `why(earlier, later)` names what makes the later one a duplicate (`None`: a re-execution the
/// ordering allows). `answered` tells whether an effect's attempt got its completion answered
/// (counted in `effects_without_completion_answer` when not, for retriable events). Returns the
/// accepted effects by event.
pub(crate) fn effect_pairs<'a>(
    effects: &'a [Effect],
    mode: &HashMap<EventId, DeliveryMode>,
    r: &mut OracleReport,
    answered: impl Fn(&Effect) -> bool,
    why: impl Fn(&Effect, &Effect) -> Option<String>,
) -> BTreeMap<EventId, Vec<&'a Effect>> {
    let mut by_event: BTreeMap<EventId, Vec<&Effect>> = BTreeMap::new();
    for f in effects {
        if f.accepted {
            r.effects_accepted += 1;
            by_event
                .entry((f.namespace.clone(), f.key.clone()))
                .or_default()
                .push(f);
        } else {
            r.late_writes_rejected += 1;
        }
    }
    for (id, fx) in by_event.iter_mut() {
        fx.sort_by_key(|f| (f.fence, f.effect_ns));
        let m = mode.get(id).copied();
        for f in fx.iter() {
            if m == Some(DeliveryMode::Retriable) && !answered(f) {
                r.effects_without_completion_answer += 1;
            }
        }
        if fx.len() < 2 {
            continue;
        }
        if m != Some(DeliveryMode::Retriable) {
            r.duplicates.push(format!(
                "{}/{}: {} effects in the idempotent ordering (attempts {:?})",
                id.0,
                id.1,
                fx.len(),
                fx.iter().map(|f| &f.attempt).collect::<Vec<_>>()
            ));
            continue;
        }
        for pair in fx.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let w = if a.fence == b.fence {
                Some("two effects with one fence".to_owned())
            } else {
                why(a, b)
            };
            match w {
                Some(w) => r.duplicates.push(format!("{}/{}: {w}", id.0, id.1)),
                None => r.reexecutions += 1,
            }
        }
    }
    by_event
}

/// Checks I1-I5. `events` is every logged call (workers, drain and the final reads, which must
/// be the last `Get` of each key); `deliveries` every delivery handed out.
pub fn check(
    effects: &[Effect],
    events: &[Event],
    deliveries: &BTreeSet<Delivery>,
) -> OracleReport {
    let mut r = OracleReport {
        answers_read: events.len() as u64,
        answers_unknown: events.iter().filter(|e| e.answer.is_unknown()).count() as u64,
        ..Default::default()
    };
    type Id = (String, String);
    let mut mode: HashMap<Id, DeliveryMode> = HashMap::new();
    for d in deliveries {
        mode.insert((d.namespace.clone(), d.key.clone()), d.mode);
    }
    r.events_checked = mode.len() as u64;

    // Attempts, from the answers.
    let mut attempts: BTreeMap<String, Attempt> = BTreeMap::new();
    let mut token_attempt: HashMap<String, String> = HashMap::new();
    let mut events_sorted: Vec<&Event> = events.iter().collect();
    events_sorted.sort_by_key(|e| e.call_ns);
    for e in &events_sorted {
        match (&e.op, &e.answer) {
            (
                HOp::Claim {
                    owner: Some(owner),
                    lease_ms,
                    ..
                },
                HAnswer::Claimed {
                    claim: Claim::New(l),
                },
            ) => {
                let a = attempts.entry(owner.clone()).or_default();
                a.fence = Some(l.fence);
                a.grants.push((
                    l.lease_expires_at_ms.saturating_sub(*lease_ms),
                    l.lease_expires_at_ms,
                ));
                a.token = Some(l.token.as_str().to_owned());
                token_attempt.insert(l.token.as_str().to_owned(), owner.clone());
            }
            (
                HOp::Mark { result, .. },
                HAnswer::Marked {
                    mark: Mark::New { record },
                },
            ) => {
                if let Some(att) = attempt_of_result(result) {
                    let a = attempts.entry(att).or_default();
                    a.fence = Some(record.fence);
                    a.marked_ack = true;
                }
            }
            _ => {}
        }
    }
    for e in &events_sorted {
        if let HOp::Complete { token, .. } = &e.op {
            let Some(att) = token_attempt.get(token) else {
                continue;
            };
            let a = attempts.entry(att.clone()).or_default();
            match &e.answer {
                HAnswer::Completed { .. } => {
                    a.completed_ack = true;
                    a.completion_answered = true;
                }
                HAnswer::Refused { code } if code == "lease_lost" => {
                    a.completion_answered = true;
                    r.stale_completions_refused += 1;
                }
                HAnswer::Unknown { .. } => {}
                _ => a.completion_answered = true,
            }
        }
    }

    // I1 from the ledger.
    let by_event = effect_pairs(
        effects,
        &mode,
        &mut r,
        |f| {
            attempts
                .get(&f.attempt)
                .is_some_and(|a| a.completion_answered)
        },
        |a, b| {
            if attempts.get(&a.attempt).is_some_and(|x| x.completed_ack) {
                return Some(format!(
                    "effect by {} after {}'s completion was acknowledged",
                    b.attempt, a.attempt
                ));
            }
            let a_end = attempts
                .get(&a.attempt)
                .and_then(|x| x.grants.iter().map(|g| g.1).max());
            let b_start = attempts
                .get(&b.attempt)
                .and_then(|x| x.grants.iter().map(|g| g.0).min());
            match (a_end, b_start) {
                (Some(end), Some(start)) if start < end => Some(format!(
                    "{} was granted at {start} ms inside {}'s lease (ends {end} ms)",
                    b.attempt, a.attempt
                )),
                _ => None,
            }
        },
    );

    // I3: fences in grant order, stale completions.
    let mut grants_by_key: BTreeMap<Id, Vec<(u64, u64, String)>> = BTreeMap::new();
    for e in &events_sorted {
        if let (
            HOp::Claim { lease_ms, .. },
            HAnswer::Claimed {
                claim: Claim::New(l),
            },
        ) = (&e.op, &e.answer)
        {
            grants_by_key.entry(e.key_id()).or_default().push((
                l.lease_expires_at_ms.saturating_sub(*lease_ms),
                l.fence,
                l.token.as_str().to_owned(),
            ));
        }
    }
    for (id, mut g) in grants_by_key {
        g.sort();
        let mut fence_of: BTreeMap<String, u64> = BTreeMap::new();
        let mut last: Option<(u64, String)> = None;
        for (_, fence, token) in &g {
            if let Some(f) = fence_of.get(token) {
                if f != fence {
                    r.fence_violations
                        .push(format!("{}/{}: one token, two fences", id.0, id.1));
                }
                continue;
            }
            if let Some((lf, lt)) = &last {
                if fence <= lf && lt != token {
                    r.fence_violations.push(format!(
                        "{}/{}: fence {fence} granted after fence {lf}",
                        id.0, id.1
                    ));
                }
            }
            fence_of.insert(token.clone(), *fence);
            last = Some((*fence, token.clone()));
        }
    }
    // A completion acknowledged for a token whose key had a later grant acknowledged before the
    // completion was sent.
    let mut later_grant_returned: HashMap<Id, Vec<(u64, u64)>> = HashMap::new(); // (return_ns, fence)
    for e in &events_sorted {
        if let HAnswer::Claimed {
            claim: Claim::New(l),
        } = &e.answer
        {
            if let Some(ret) = e.return_ns {
                later_grant_returned
                    .entry(e.key_id())
                    .or_default()
                    .push((ret, l.fence));
            }
        }
    }
    for e in &events_sorted {
        if let (HOp::Complete { token, .. }, HAnswer::Completed { .. }) = (&e.op, &e.answer) {
            let Some(fence) = token_attempt
                .get(token)
                .and_then(|a| attempts.get(a))
                .and_then(|a| a.fence)
            else {
                continue;
            };
            if let Some(gs) = later_grant_returned.get(&e.key_id()) {
                if gs.iter().any(|(ret, f)| *f > fence && *ret < e.call_ns) {
                    r.fence_violations.push(format!(
                        "{}/{}: completion with stale fence {fence} acknowledged",
                        e.namespace, e.key
                    ));
                }
            }
        }
    }

    // I2, I4, I5 against the final reads (the last Get of each key).
    let mut final_read: HashMap<Id, &Event> = HashMap::new();
    for e in &events_sorted {
        if matches!(e.op, HOp::Get) && !e.answer.is_unknown() {
            final_read.insert(e.key_id(), e);
        }
    }
    let mut attempt_key: HashMap<String, Id> = HashMap::new();
    for e in &events_sorted {
        let att = match &e.op {
            HOp::Claim { owner: Some(o), .. } => Some(o.clone()),
            HOp::Mark { result, .. } => attempt_of_result(result),
            _ => None,
        };
        if let Some(att) = att {
            attempt_key.insert(att, e.key_id());
        }
    }
    let mut acked_by_key: HashMap<Id, Vec<&String>> = HashMap::new();
    for (att, a) in &attempts {
        if a.completed_ack || a.marked_ack {
            if let Some(id) = attempt_key.get(att) {
                acked_by_key.entry(id.clone()).or_default().push(att);
            }
        }
    }
    for (id, m) in &mode {
        let label = format!("{}/{}", id.0, id.1);
        let record = match final_read.get(id).map(|e| &e.answer) {
            Some(HAnswer::Found { record }) => record.clone(),
            _ => {
                r.lost.push(format!("{label}: no final read"));
                continue;
            }
        };
        let acked: Vec<&String> = acked_by_key.get(id).cloned().unwrap_or_default();
        match (&record, m) {
            (None, _) if !acked.is_empty() => {
                r.lost.push(format!(
                    "{label}: acknowledged by {acked:?}, gone at the end"
                ));
            }
            (None, DeliveryMode::Retriable) => {
                r.lost
                    .push(format!("{label}: no completed record after the drain"));
            }
            (Some(rec), _) => {
                let stored = attempt_of_result(&rec.result);
                if rec.state != State::Completed && *m == DeliveryMode::Retriable {
                    r.lost
                        .push(format!("{label}: still in progress after the drain"));
                }
                if !acked.is_empty() && (acked.len() > 1 || stored.as_ref() != Some(acked[0])) {
                    r.lost.push(format!(
                        "{label}: acknowledged {acked:?}, stored result is {stored:?}"
                    ));
                }
                if *m == DeliveryMode::Retriable && !by_event.contains_key(id) {
                    r.lost.push(format!("{label}: completed but no effect ran"));
                }
                // I5: every duplicate of the completed key replays the stored result.
                for e in events_sorted.iter().filter(|e| &e.key_id() == id) {
                    let shown = match &e.answer {
                        HAnswer::Claimed {
                            claim: Claim::Duplicate { record },
                        }
                        | HAnswer::Marked {
                            mark: Mark::Duplicate { record },
                        } => record,
                        _ => continue,
                    };
                    if shown.state == State::Completed && shown.result != rec.result {
                        r.replay_mismatches.push(format!(
                            "{label}: a duplicate replayed {:?}, stored {:?}",
                            shown.result, rec.result
                        ));
                    }
                }
            }
            (None, DeliveryMode::Idempotent) => {}
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::{Key, Lease, Namespace, Record, Token};
    use serde_json::json;

    const NS: &str = "ns";

    fn delivery(mode: DeliveryMode) -> BTreeSet<Delivery> {
        [Delivery {
            mode,
            namespace: NS.into(),
            key: "k".into(),
        }]
        .into()
    }

    fn effect(attempt: &str, fence: u64, at_ms: u64, lease_end: Option<u64>) -> Effect {
        Effect {
            namespace: NS.into(),
            key: "k".into(),
            fence,
            attempt: attempt.into(),
            worker: "w".into(),
            effect_ns: at_ms * 1_000_000,
            lease_expires_at_ms: lease_end,
            accepted: true,
            fence_before: 0,
        }
    }

    fn ev(op: HOp, at_ms: u64, answer: HAnswer) -> Event {
        Event {
            client: "w".into(),
            namespace: NS.into(),
            key: "k".into(),
            op,
            call_ns: at_ms * 1_000_000,
            return_ns: (!answer.is_unknown()).then_some(at_ms * 1_000_000 + 1),
            answer,
        }
    }

    fn claim(attempt: &str, at_ms: u64, fence: u64) -> Event {
        ev(
            HOp::Claim {
                ttl_ms: 100_000,
                lease_ms: 100,
                fingerprint: None,
                owner: Some(attempt.into()),
            },
            at_ms,
            HAnswer::Claimed {
                claim: Claim::New(Lease {
                    token: Token::new(format!("tok-{attempt}")),
                    fence,
                    lease_expires_at_ms: at_ms + 100,
                    expires_at_ms: at_ms + 100_000,
                }),
            },
        )
    }

    fn completed(attempt: &str, fence: u64) -> Record {
        Record {
            namespace: Namespace::new(NS).unwrap(),
            key: Key::new("k").unwrap(),
            state: State::Completed,
            fence,
            fingerprint: None,
            owner: Some(attempt.into()),
            created_at_ms: 0,
            expires_at_ms: 100_000,
            lease_expires_at_ms: None,
            completed_at_ms: Some(1),
            result: Some(json!({ "attempt": attempt })),
        }
    }

    fn complete(attempt: &str, at_ms: u64, answer: HAnswer) -> Event {
        ev(
            HOp::Complete {
                token: format!("tok-{attempt}"),
                result: Some(json!({ "attempt": attempt })),
                ttl_ms: None,
            },
            at_ms,
            answer,
        )
    }

    fn final_read(record: Option<Record>) -> Event {
        ev(HOp::Get, 10_000, HAnswer::Found { record })
    }

    #[test]
    fn a_re_execution_after_a_crash_is_allowed_but_counted() {
        // a claims and runs its effect, then dies before completing; b takes over after a's
        // lease and completes.
        let events = vec![
            claim("a", 0, 1000),
            claim("b", 200, 200_000),
            complete(
                "b",
                210,
                HAnswer::Completed {
                    record: completed("b", 200_000),
                },
            ),
            final_read(Some(completed("b", 200_000))),
        ];
        let effects = vec![
            effect("a", 1000, 5, Some(100)),
            effect("b", 200_000, 205, Some(300)),
        ];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.reexecutions, 1);
        assert_eq!(r.effects_without_completion_answer, 1);
    }

    #[test]
    fn an_effect_after_an_acknowledged_completion_is_a_duplicate() {
        let events = vec![
            claim("a", 0, 1000),
            complete(
                "a",
                10,
                HAnswer::Completed {
                    record: completed("a", 1000),
                },
            ),
            claim("b", 200, 200_000),
            final_read(Some(completed("a", 1000))),
        ];
        let effects = vec![
            effect("a", 1000, 5, Some(100)),
            effect("b", 200_000, 205, Some(300)),
        ];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
    }

    #[test]
    fn a_takeover_inside_a_live_lease_is_a_duplicate() {
        let events = vec![
            claim("a", 0, 1000),
            claim("b", 50, 50_000),
            complete(
                "b",
                60,
                HAnswer::Completed {
                    record: completed("b", 50_000),
                },
            ),
            final_read(Some(completed("b", 50_000))),
        ];
        let effects = vec![
            effect("a", 1000, 5, Some(100)),
            effect("b", 50_000, 55, Some(150)),
        ];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
    }

    #[test]
    fn two_effects_in_the_idempotent_ordering_are_duplicates() {
        let effects = vec![effect("a", 1000, 5, None), effect("b", 2000, 6, None)];
        let r = check(
            &effects,
            &[final_read(None)],
            &delivery(DeliveryMode::Idempotent),
        );
        assert_eq!(r.duplicates.len(), 1, "{r:?}");
    }

    #[test]
    fn an_acknowledged_completion_that_vanished_is_lost() {
        let events = vec![
            claim("a", 0, 1000),
            complete(
                "a",
                10,
                HAnswer::Completed {
                    record: completed("a", 1000),
                },
            ),
            final_read(None),
        ];
        let effects = vec![effect("a", 1000, 5, Some(100))];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert_eq!(r.lost.len(), 1, "{r:?}");
    }

    #[test]
    fn a_replay_with_another_result_is_caught() {
        let mut shown = completed("a", 1000);
        shown.result = Some(json!({ "attempt": "someone else" }));
        let events = vec![
            claim("a", 0, 1000),
            complete(
                "a",
                10,
                HAnswer::Completed {
                    record: completed("a", 1000),
                },
            ),
            ev(
                HOp::Claim {
                    ttl_ms: 100_000,
                    lease_ms: 100,
                    fingerprint: None,
                    owner: Some("c".into()),
                },
                20,
                HAnswer::Claimed {
                    claim: Claim::Duplicate { record: shown },
                },
            ),
            final_read(Some(completed("a", 1000))),
        ];
        let effects = vec![effect("a", 1000, 5, Some(100))];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert_eq!(r.replay_mismatches.len(), 1, "{r:?}");
    }

    #[test]
    fn a_stale_completion_that_was_accepted_is_a_fence_violation() {
        let events = vec![
            claim("a", 0, 1000),
            claim("b", 200, 200_000),
            complete(
                "a",
                300,
                HAnswer::Completed {
                    record: completed("a", 1000),
                },
            ),
            final_read(Some(completed("a", 1000))),
        ];
        let effects = vec![effect("a", 1000, 5, Some(100))];
        let r = check(&effects, &events, &delivery(DeliveryMode::Retriable));
        assert_eq!(r.fence_violations.len(), 1, "{r:?}");
    }
}
