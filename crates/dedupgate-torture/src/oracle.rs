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

use crate::history::{Event, HAnswer, HOp};
use crate::ledger::Effect;
use crate::worker::{Delivery, DeliveryMode};

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
    let mut by_event: BTreeMap<Id, Vec<&Effect>> = BTreeMap::new();
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
    for (id, mut fx) in by_event.clone() {
        fx.sort_by_key(|f| (f.fence, f.effect_ns));
        let m = mode.get(&id).copied();
        for f in &fx {
            let a = attempts.get(&f.attempt);
            if m == Some(DeliveryMode::Retriable) && !a.is_some_and(|a| a.completion_answered) {
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
            let why = if a.fence == b.fence {
                Some("two effects with one fence".to_owned())
            } else if attempts.get(&a.attempt).is_some_and(|x| x.completed_ack) {
                Some(format!(
                    "effect by {} after {}'s completion was acknowledged",
                    b.attempt, a.attempt
                ))
            } else {
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
            };
            match why {
                Some(w) => r.duplicates.push(format!("{}/{}: {w}", id.0, id.1)),
                None => r.reexecutions += 1,
            }
        }
    }

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
