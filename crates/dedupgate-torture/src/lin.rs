//! A per-key linearizability checker in the style of Knossos and Porcupine (Wing & Gong's
//! search with Lowe's memoization), whose model is the gate's own decision function:
//! [`dedupgate_core::decide`], the function the memory store applies under its lock.
//!
//! A history is linearizable when its operations on one key can be put in one order that
//! (1) respects real time: if `a` returned before `b` was called, `a` comes first;
//! (2) gives every operation with a known answer exactly that answer when `decide` is replayed
//! in that order from an empty key, at a store time inside the operation's window; and
//! (3) leaves out or includes, anywhere after its call, each operation whose answer is unknown
//! (a timeout, an unavailable store, a crash): it may or may not have taken effect.
//!
//! Keys are independent in the gate (every operation touches one key), so a history is checked
//! key by key; that is what keeps the search small.
//!
//! # Tokens: compared by role
//! A claim's token is random, so the model cannot produce the store's token. The model issues
//! its own (`⟨model:i⟩` for the claim at index `i`) and the search carries a one-to-one
//! *binding* from the tokens the history saw to the model's: a new claim answered with history
//! token `H` binds `H` to the token the model issued, and must agree with an existing binding
//! (so a same-owner re-claim must get the same token back, as in the model). A token a client
//! presents (complete, release, extend) is replaced by its binding; a token never bound (made up,
//! or issued by a claim whose answer was lost) is presented to the model as it is, so the model
//! refuses it exactly as the store should.
//!
//! # Time: the model's clock inside each window
//! The store decides on its own clock. The checker only knows that the store read its clock
//! during the call, so the model's clock for an operation must be a `now_ms` in
//! `[call_ms - skew_ms, return_ms + skew_ms]` (`call_ms = call_ns / 10^6`, floored like the
//! store's clock), and, since the store's clock never goes back, no earlier than the time chosen
//! for the operation before it in the order. Within that window `decide` depends on `now_ms`
//! only through (a) which side of the stored entry's `expires_at_ms` and `lease_expires_at_ms`
//! it falls, and (b) values it writes (`lease_expires_at_ms = now + lease_ms`, `created_at_ms`,
//! `completed_at_ms`, the fence `max(prev + 1, now * 1000)`). The answer reveals (b) whenever it
//! happens, so the candidate times for an operation with a known answer are: the window's lower
//! bound, each threshold of (a) inside the window, and each instant the answer reveals (the
//! *hints*: `lease_expires_at_ms - lease_ms`, `created_at_ms`, `completed_at_ms`). These cover
//! every region of the window in which the answer could differ, so trying them is exhaustive.
//! Among the candidates that reproduce the answer the earliest is taken: they all leave the same
//! entry (the written values are pinned by the answer) and an earlier clock constrains later
//! operations less.
//!
//! An operation with an unknown answer has no upper bound and reveals nothing itself; the
//! instants that matter are those later answers reveal about it (a duplicate shows the
//! `created_at_ms` of the claim that made it, a lease end shows when it was claimed or
//! extended). Its candidates are the lower bound, the thresholds, and the hints of the whole
//! key's history (every revealed instant, `fence / 1000`, and every lease or retention end
//! minus every duration the history uses). This is the one place where the search is not
//! proven exhaustive: a history whose only explanation places an unknown operation at an instant
//! nothing reveals could be reported as a violation. An accepted history is always backed by a
//! witness (order and times), which [`Verdict::Linearizable`] returns.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use dedupgate_core::{
    decide, Change, Claim, Decision, Entry, GateError, Mark, Outcome, RecordId, Token, ValidOp,
};

use crate::history::{Event, HAnswer, HOp};

/// How the checker works.
#[derive(Clone, Debug)]
pub struct LinConfig {
    /// Allowance between the recorder's clock and the store's, in ms (0 when both read this
    /// host's system clock, as the memory, embedded and local Redis/PostgreSQL stores do).
    pub skew_ms: u64,
    /// Search steps per key before giving up with [`Verdict::Inconclusive`].
    pub steps_max: u64,
    /// Require the store's clock to be non-decreasing along the linearization (true for a store
    /// that reads its clock inside its atomic section: memory, embedded, Redis). A store that
    /// reads its clock *before* waiting for a lock (PostgreSQL reads `clock_timestamp()` at the
    /// start of its function) can decide an operation at an instant earlier than the one
    /// ordered before it; with `false` each operation's instant is only bound to its own window.
    pub monotonic_clock: bool,
    /// How far the store's clock may go back along the linearization when `monotonic_clock` is
    /// set, in ms. A store whose plain reads do not wait for writers (PostgreSQL's MVCC) lets a
    /// read that starts after a writer read its clock linearize before that writer's commit, so
    /// its clock appears to step back by up to the writer's commit time.
    pub clock_slack_ms: u64,
}

impl Default for LinConfig {
    fn default() -> Self {
        Self {
            skew_ms: 0,
            steps_max: 2_000_000,
            monotonic_clock: true,
            clock_slack_ms: 0,
        }
    }
}

/// One operation placed in a linearization: its index in the key's events and the store time
/// the model used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Index into the events of the key, in the order given to [`check_key`].
    pub index: usize,
    /// The model's `now_ms` for it.
    pub now_ms: u64,
}

/// The checker's finding for one key.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// A witness order exists (operations with unknown answers that are left out do not appear).
    Linearizable {
        /// The witness.
        order: Vec<Placed>,
    },
    /// No order explains the answers.
    Violation {
        /// The longest prefix the search could place, and the operations it could not place next.
        detail: String,
    },
    /// The search ran out of steps.
    Inconclusive {
        /// Steps taken.
        steps: u64,
    },
}

/// Findings for every key of a history.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// (namespace, key, operations, unknown answers, verdict).
    pub keys: Vec<KeyReport>,
}

/// The finding for one key.
#[derive(Clone, Debug)]
pub struct KeyReport {
    /// Namespace.
    pub namespace: String,
    /// Key.
    pub key: String,
    /// Operations in the key's history.
    pub ops: usize,
    /// Of which with unknown answers.
    pub unknown: usize,
    /// Search steps taken.
    pub steps: u64,
    /// The verdict.
    pub verdict: Verdict,
}

impl Report {
    /// Keys with a violation.
    pub fn violations(&self) -> Vec<&KeyReport> {
        self.keys
            .iter()
            .filter(|k| matches!(k.verdict, Verdict::Violation { .. }))
            .collect()
    }

    /// Keys the search gave up on.
    pub fn inconclusive(&self) -> usize {
        self.keys
            .iter()
            .filter(|k| matches!(k.verdict, Verdict::Inconclusive { .. }))
            .count()
    }

    /// Operations checked in all keys.
    pub fn ops(&self) -> usize {
        self.keys.iter().map(|k| k.ops).sum()
    }

    /// Operations with unknown answers in all keys.
    pub fn unknown(&self) -> usize {
        self.keys.iter().map(|k| k.unknown).sum()
    }

    /// A one-line summary, then one line per violation.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "linearizability: {} keys, {} ops ({} unknown), {} violations, {} inconclusive",
            self.keys.len(),
            self.ops(),
            self.unknown(),
            self.violations().len(),
            self.inconclusive()
        );
        for k in self.violations() {
            if let Verdict::Violation { detail } = &k.verdict {
                s.push_str(&format!("\n  {}/{}: {detail}", k.namespace, k.key));
            }
        }
        s
    }
}

/// Checks every key of `events` (in any order; they are grouped by key here).
pub fn check(events: &[Event], cfg: &LinConfig) -> Report {
    let mut by_key: BTreeMap<(String, String), Vec<Event>> = BTreeMap::new();
    for e in events {
        by_key.entry(e.key_id()).or_default().push(e.clone());
    }
    let keys = by_key
        .into_iter()
        .map(|((namespace, key), evs)| {
            let (verdict, steps) = check_key_counted(&evs, cfg);
            KeyReport {
                ops: evs.len(),
                unknown: evs.iter().filter(|e| e.answer.is_unknown()).count(),
                namespace,
                key,
                steps,
                verdict,
            }
        })
        .collect();
    Report { keys }
}

/// Checks the events of one key (all must share namespace and key).
pub fn check_key(events: &[Event], cfg: &LinConfig) -> Verdict {
    check_key_counted(events, cfg).0
}

fn check_key_counted(events: &[Event], cfg: &LinConfig) -> (Verdict, u64) {
    let Some(first) = events.first() else {
        return (Verdict::Linearizable { order: vec![] }, 0);
    };
    let id = match RecordId::new(first.namespace.clone(), first.key.clone()) {
        Ok(id) => id,
        // Every call on an invalid id is refused before deciding; nothing to order.
        Err(_) => {
            let ok = events
                .iter()
                .all(|e| e.answer.is_unknown() || e.answer == refused("invalid_request"));
            return if ok {
                (Verdict::Linearizable { order: vec![] }, 0)
            } else {
                (
                    Verdict::Violation {
                        detail: "an operation on an invalid id was not refused".into(),
                    },
                    0,
                )
            };
        }
    };
    let mut search = Search::new(id, events, cfg);
    let start = State {
        entry: None,
        last_now_ms: 0,
        bindings: BTreeMap::new(),
        done: vec![false; events.len()],
        known_left: search.ops.iter().filter(|o| o.return_ns.is_some()).count(),
    };
    let mut path = Vec::new();
    let verdict = match search.dfs(&start, &mut path) {
        Ok(true) => Verdict::Linearizable { order: path },
        Ok(false) => Verdict::Violation {
            detail: search.explain(),
        },
        Err(Budget) => Verdict::Inconclusive {
            steps: search.steps,
        },
    };
    (verdict, search.steps)
}

fn refused(code: &str) -> HAnswer {
    HAnswer::Refused {
        code: code.to_owned(),
    }
}

struct Budget;

struct Prepared<'a> {
    event: &'a Event,
    call_ns: u64,
    /// `None` for an unknown answer: it never returned.
    return_ns: Option<u64>,
    lo_ms: u64,
    hi_ms: u64,
    hints_ms: Vec<u64>,
}

#[derive(Clone)]
struct State {
    entry: Option<Entry>,
    last_now_ms: u64,
    /// History token -> model token.
    bindings: BTreeMap<String, String>,
    done: Vec<bool>,
    known_left: usize,
}

impl State {
    fn memo_key(&self) -> (Vec<u64>, String, u64, Vec<(String, String)>) {
        let mut bits = vec![0u64; self.done.len().div_ceil(64)];
        for (i, d) in self.done.iter().enumerate() {
            if *d {
                bits[i / 64] |= 1 << (i % 64);
            }
        }
        (
            bits,
            serde_json::to_string(&self.entry).unwrap_or_default(),
            self.last_now_ms,
            self.bindings
                .iter()
                .map(|(a, b)| (a.clone(), b.clone()))
                .collect(),
        )
    }
}

type MemoKey = (Vec<u64>, String, u64, Vec<(String, String)>);

struct Search<'a> {
    id: RecordId,
    ops: Vec<Prepared<'a>>,
    global_hints_ms: Vec<u64>,
    steps: u64,
    steps_max: u64,
    monotonic: bool,
    slack_ms: u64,
    memo: HashSet<MemoKey>,
    deepest: Vec<Placed>,
    deepest_state: Option<State>,
}

fn model_token(index: usize) -> String {
    format!("⟨model:{index}⟩")
}

/// Instants an answer reveals about the store's clock, given the durations in use.
fn answer_hints(answer: &HAnswer, durations_ms: &BTreeSet<u64>, out: &mut BTreeSet<u64>) {
    let mut ends = Vec::new();
    for r in answer.records() {
        out.insert(r.created_at_ms);
        out.insert(r.fence / dedupgate_core::decide::FENCE_PER_MS);
        if let Some(c) = r.completed_at_ms {
            out.insert(c);
        }
        ends.extend(r.lease_expires_at_ms);
        ends.push(r.expires_at_ms);
    }
    match answer {
        HAnswer::Claimed {
            claim: Claim::New(l),
        } => {
            out.insert(l.fence / dedupgate_core::decide::FENCE_PER_MS);
            ends.push(l.lease_expires_at_ms);
            ends.push(l.expires_at_ms);
        }
        HAnswer::Extended {
            lease_expires_at_ms,
        } => ends.push(*lease_expires_at_ms),
        _ => {}
    }
    for end in ends {
        for d in durations_ms {
            if let Some(t) = end.checked_sub(*d) {
                out.insert(t);
            }
        }
    }
}

impl<'a> Search<'a> {
    fn new(id: RecordId, events: &'a [Event], cfg: &LinConfig) -> Self {
        let durations: BTreeSet<u64> = events.iter().flat_map(|e| e.op.durations_ms()).collect();
        let mut global = BTreeSet::new();
        let ops: Vec<Prepared<'a>> = events
            .iter()
            .map(|e| {
                let mut own = BTreeSet::new();
                answer_hints(&e.answer, &durations, &mut own);
                global.extend(own.iter().copied());
                let call_ms = e.call_ns / 1_000_000;
                global.insert(call_ms);
                let return_ns = if e.answer.is_unknown() {
                    None
                } else {
                    Some(e.return_ns.unwrap_or(u64::MAX))
                };
                Prepared {
                    event: e,
                    call_ns: e.call_ns,
                    return_ns,
                    lo_ms: call_ms.saturating_sub(cfg.skew_ms),
                    hi_ms: return_ns
                        .map_or(u64::MAX, |r| (r / 1_000_000).saturating_add(cfg.skew_ms)),
                    hints_ms: own.into_iter().collect(),
                }
            })
            .collect();
        Self {
            id,
            ops,
            global_hints_ms: global.into_iter().collect(),
            steps: 0,
            steps_max: cfg.steps_max,
            monotonic: cfg.monotonic_clock,
            slack_ms: cfg.clock_slack_ms,
            memo: HashSet::new(),
            deepest: Vec::new(),
            deepest_state: None,
        }
    }

    fn candidates(&self, i: usize, state: &State) -> Vec<u64> {
        let op = &self.ops[i];
        let lo = if self.monotonic {
            op.lo_ms
                .max(state.last_now_ms.saturating_sub(self.slack_ms))
        } else {
            op.lo_ms
        };
        let hi = op.hi_ms;
        if lo > hi {
            return vec![];
        }
        let mut c = BTreeSet::new();
        c.insert(lo);
        let mut add = |t: u64| {
            if t > lo && t <= hi {
                c.insert(t);
            }
        };
        if let Some(e) = &state.entry {
            add(e.expires_at_ms);
            if let Some(l) = e.lease_expires_at_ms {
                add(l);
            }
        }
        let hints = if op.return_ns.is_some() {
            &op.hints_ms
        } else {
            &self.global_hints_ms
        };
        for h in hints {
            add(*h);
        }
        c.into_iter().collect()
    }

    /// Replays op `i` at `now_ms`; `Some(next state)` when its answer matches the history's
    /// (always, for an unknown answer).
    fn apply(&self, i: usize, state: &State, now_ms: u64) -> Option<State> {
        let op = &self.ops[i];
        let core_op = op.event.op.to_op(|h| {
            Token::new(
                state
                    .bindings
                    .get(h)
                    .cloned()
                    .unwrap_or_else(|| h.to_owned()),
            )
        });
        // An op the core refuses to build is refused before any store, changing nothing.
        let decision = match ValidOp::try_from(core_op) {
            Ok(core_op) => decide(&self.id, core_op, state.entry.as_ref(), now_ms, || {
                Token::new(model_token(i))
            }),
            Err(e) => Decision {
                answer: Err(e.into()),
                change: Change::Keep,
            },
        };
        let mut next = state.clone();
        if op.return_ns.is_some()
            && !answers_match(&decision.answer, &op.event.answer, &mut next.bindings)
        {
            return None;
        }
        if let Change::Put(e) = decision.change {
            next.entry = Some(e);
        }
        next.last_now_ms = state.last_now_ms.max(now_ms);
        next.done[i] = true;
        if op.return_ns.is_some() {
            next.known_left -= 1;
        }
        Some(next)
    }

    fn dfs(&mut self, state: &State, path: &mut Vec<Placed>) -> Result<bool, Budget> {
        if state.known_left == 0 {
            return Ok(true);
        }
        self.steps += 1;
        if self.steps > self.steps_max {
            return Err(Budget);
        }
        if self.deepest_state.is_none() || path.len() > self.deepest.len() {
            self.deepest = path.clone();
            self.deepest_state = Some(state.clone());
        }
        if !self.memo.insert(state.memo_key()) {
            return Ok(false);
        }
        // An operation whose window closed before the model's clock can never be placed.
        let pending_known = || {
            self.ops
                .iter()
                .enumerate()
                .filter(|(i, o)| !state.done[*i] && o.return_ns.is_some())
        };
        let floor_ms = state.last_now_ms.saturating_sub(self.slack_ms);
        if self.monotonic && pending_known().any(|(_, o)| o.hi_ms < floor_ms) {
            return Ok(false);
        }
        let min_return_ns = pending_known()
            .filter_map(|(_, o)| o.return_ns)
            .min()
            .unwrap_or(u64::MAX);
        for i in 0..self.ops.len() {
            if state.done[i] || self.ops[i].call_ns > min_return_ns {
                continue;
            }
            let known = self.ops[i].return_ns.is_some();
            let mut seen_entries: HashSet<String> = HashSet::new();
            for now_ms in self.candidates(i, state) {
                let Some(next) = self.apply(i, state, now_ms) else {
                    continue;
                };
                if !known {
                    // Different times that leave the same entry: the earliest dominates.
                    let k = serde_json::to_string(&next.entry).unwrap_or_default();
                    if !seen_entries.insert(k) {
                        continue;
                    }
                }
                path.push(Placed { index: i, now_ms });
                if self.dfs(&next, path)? {
                    return Ok(true);
                }
                path.pop();
                if known {
                    // The earliest matching time dominates the later ones (see the module doc).
                    break;
                }
            }
        }
        Ok(false)
    }

    fn explain(&self) -> String {
        let mut s = String::from("placed in order:");
        for p in &self.deepest {
            let e = self.ops[p.index].event;
            s.push_str(&format!(
                "\n    #{} {} {} @{}ms -> {}",
                p.index,
                e.client,
                op_text(&e.op),
                p.now_ms,
                answer_text(&e.answer)
            ));
        }
        s.push_str("\n  then none of these fits:");
        if let Some(state) = &self.deepest_state {
            s.push_str(&format!(
                "\n    (model entry: {}; clock ≥ {}ms)",
                serde_json::to_string(&state.entry).unwrap_or_default(),
                state.last_now_ms
            ));
            for (i, o) in self.ops.iter().enumerate() {
                if state.done[i] || o.return_ns.is_none() {
                    continue;
                }
                s.push_str(&format!(
                    "\n    #{i} {} {} window [{}, {}]ms -> {}",
                    o.event.client,
                    op_text(&o.event.op),
                    o.lo_ms,
                    o.hi_ms,
                    answer_text(&o.event.answer)
                ));
            }
        }
        s
    }
}

fn op_text(op: &HOp) -> String {
    serde_json::to_string(op).unwrap_or_default()
}

fn answer_text(a: &HAnswer) -> String {
    serde_json::to_string(a).unwrap_or_default()
}

/// True when the model's answer is the history's, binding a new claim's token by role.
fn answers_match(
    model: &Result<Outcome, GateError>,
    seen: &HAnswer,
    bindings: &mut BTreeMap<String, String>,
) -> bool {
    match (model, seen) {
        (
            Ok(Outcome::Claimed(Claim::New(m))),
            HAnswer::Claimed {
                claim: Claim::New(h),
            },
        ) => {
            m.fence == h.fence
                && m.lease_expires_at_ms == h.lease_expires_at_ms
                && m.expires_at_ms == h.expires_at_ms
                && bind(bindings, h.token.as_str(), m.token.as_str())
        }
        (
            Ok(Outcome::Claimed(Claim::Duplicate { record: a })),
            HAnswer::Claimed {
                claim: Claim::Duplicate { record: b },
            },
        ) => a == b,
        (Ok(Outcome::Completed(a)), HAnswer::Completed { record: b }) => a == b,
        (Ok(Outcome::Released), HAnswer::Released) => true,
        (
            Ok(Outcome::Extended {
                lease_expires_at_ms: a,
            }),
            HAnswer::Extended {
                lease_expires_at_ms: b,
            },
        ) => a == b,
        (Ok(Outcome::Marked(a)), HAnswer::Marked { mark: b }) => mark_eq(a, b),
        (Ok(Outcome::Found(a)), HAnswer::Found { record: b }) => a == b,
        (Ok(Outcome::Forgotten(a)), HAnswer::Forgotten { deleted: b }) => a == b,
        (Err(e), HAnswer::Refused { code }) => e.code() == code,
        _ => false,
    }
}

fn mark_eq(a: &Mark, b: &Mark) -> bool {
    a == b
}

fn bind(bindings: &mut BTreeMap<String, String>, seen: &str, model: &str) -> bool {
    if let Some(bound) = bindings.get(seen) {
        return bound == model;
    }
    if bindings.values().any(|v| v == model) {
        return false;
    }
    bindings.insert(seen.to_owned(), model.to_owned());
    true
}
