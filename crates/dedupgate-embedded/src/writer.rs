//! The group-commit writer: one thread that owns the engine.
//!
//! Loop: block for one request, drain more without waiting (up to `batch_ops_max` ops), read
//! each op's current entry, [`decide`](fn@dedupgate_core::decide) the ops in order over an
//! overlay (so a later op on the same id sees an earlier one), write every changed entry and its
//! expiry-index key in one transaction, commit (one fsync), and only then answer every waiter (a
//! commit with many waiters hands its answers to an answer thread, see [`delivery`]). A failed
//! transaction or commit answers the whole batch "unavailable", drops the engine and reopens it
//! from disk; until that succeeds every request is answered "unavailable" and nothing is
//! acknowledged.
//!
//! Beside the loop: [`shared`] (what callers send the writer and read beside it), [`delivery`]
//! (answering a commit's waiters), [`batch`] (deciding a batch in a transaction), [`sweep`]
//! (removing expired entries) and [`meta`] (format version, clock floor, entries held).

mod batch;
mod delivery;
mod meta;
mod shared;
mod sweep;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Clock, GateError, StoreError, StoreStats};
use tokio::sync::mpsc;

use crate::codec::encode_id;
use crate::engine::{Engine, EngineError, EngineOpener, Txn};
use crate::keyset::{self, KeySetCall};

use batch::{decide_all, preload, Scratch};
use delivery::Reply;
pub(crate) use meta::{check_format, FormatProblem};
use meta::{raise_clock_floor, META_HELD};
use shared::{Answer, PendingIds};
pub(crate) use shared::{Request, Shared};

/// Longest the writer waits to gather the callers its last commit answered.
const GATHER_WAIT_MAX: Duration = Duration::from_micros(300);

/// Longest wait between reopen attempts after a failure.
const REOPEN_BACKOFF_MS_MAX: u64 = 2_000;

fn engine_store_error(e: &EngineError) -> StoreError {
    match e {
        EngineError::Corrupt(s) => StoreError::Corrupt(s.clone()),
        other => StoreError::Unavailable(format!("embedded store write failed: {other}")),
    }
}

pub(crate) struct Writer {
    pub scratch: Scratch,
    pub rx: mpsc::Receiver<Request>,
    pub opener: EngineOpener,
    pub engine: Option<Box<dyn Engine>>,
    pub clock: Arc<dyn Clock>,
    pub shared: Arc<Shared>,
    pub batch_ops_max: usize,
    /// Sequence number of the last expiry-index record written.
    pub index_seq: u64,
    /// The key set's live ids, once a key-set call loaded them (see [`keyset::apply`]);
    /// dropped by a failed write.
    pub keyset_members: Option<keyset::Members>,
    /// Most key-set ids held in memory (see [`crate::EmbeddedOptions::key_set_memory_ids`]).
    pub keyset_memory_ids: usize,
}

impl Writer {
    /// Runs until every sender is gone.
    pub fn run(mut self) {
        self.publish_view();
        let mut pending: Vec<Request> = Vec::new();
        let mut held: Option<Request> = None;
        let mut last_answered = 0usize;
        let mut last_commit = Duration::ZERO;
        loop {
            let first = match held.take() {
                Some(r) => r,
                None => match self.rx.blocking_recv() {
                    Some(r) => r,
                    None => {
                        self.close();
                        return;
                    }
                },
            };
            if self.engine.is_none() {
                self.answer_unavailable(first);
                self.recover();
                continue;
            }
            match first {
                Request::Sweep { batch_max, reply } => {
                    let r = self.sweep(batch_max);
                    let _ = reply.send(r);
                    continue;
                }
                Request::Stats { reply } => {
                    let r = self.stats();
                    let _ = reply.send(r);
                    continue;
                }
                Request::KeySet { call, reply } => {
                    let r = self.key_set(&call);
                    let _ = reply.send(r);
                    continue;
                }
                op_request => pending.push(op_request),
            }
            let mut ops = request_ops(&pending[0]);
            // Gather: take everything queued during the last commit, then, if fewer ops came back
            // than that commit answered, wait a little for the rest (bounded by a fraction of the
            // last commit's duration). Without this, closed-loop callers split into two halves
            // that alternate between commits, and every fsync carries only half of them.
            let expected_ops = last_answered.min(self.batch_ops_max);
            let gather_until = Instant::now() + (last_commit / 4).min(GATHER_WAIT_MAX);
            'gather: while ops < self.batch_ops_max {
                match self.rx.try_recv() {
                    Ok(r @ (Request::One { .. } | Request::Many { .. })) => {
                        ops += request_ops(&r);
                        pending.push(r);
                    }
                    Ok(other) => {
                        held = Some(other);
                        break 'gather;
                    }
                    Err(mpsc::error::TryRecvError::Empty)
                        if ops < expected_ops && Instant::now() < gather_until =>
                    {
                        std::thread::yield_now();
                    }
                    Err(_) => break 'gather,
                }
            }
            let started = Instant::now();
            self.commit_batch(&mut pending);
            last_commit = started.elapsed();
            last_answered = ops;
            if self.engine.is_none() {
                self.recover();
            }
        }
    }

    fn commit_batch(&mut self, pending: &mut Vec<Request>) {
        let scratch = &mut self.scratch;
        let ops = &mut scratch.ops;
        ops.clear();
        // Each reply with how many ops it answers; `None` once answered early.
        let mut replies: Vec<(usize, Option<Reply>)> = Vec::with_capacity(pending.len());
        for r in pending.drain(..) {
            match r {
                Request::One { id, op, reply } => {
                    ops.push((id, op));
                    replies.push((1, Some(Reply::One(reply))));
                }
                Request::Many { ops: many, reply } => {
                    replies.push((many.len(), Some(Reply::Many(reply))));
                    ops.extend(many);
                }
                Request::Sweep { .. } | Request::Stats { .. } | Request::KeySet { .. } => {
                    unreachable!("only op requests are batched")
                }
            }
        }
        let n_ops = ops.len();
        let (pending, keys, key_ends) = (
            &mut scratch.pending,
            &mut scratch.keys,
            &mut scratch.key_ends,
        );
        pending.clear();
        keys.clear();
        key_ends.clear();
        let mut id_buf = Vec::with_capacity(64);
        for (id, _) in ops.iter() {
            encode_id(id, &mut id_buf);
            pending.push(PendingIds::slot(&id_buf));
            keys.extend_from_slice(&id_buf);
            key_ends.push(keys.len());
        }
        // Before the decisions' instant is read: see `PendingIds`.
        self.shared.pending.begin(pending);
        let now_ms = self.clock.now_ms();
        let mut answers: Vec<Option<Answer>> = Vec::with_capacity(n_ops);
        let engine = self.engine.as_mut().expect("checked by the caller");
        let (slots, decided, settled) = (
            &mut scratch.slots,
            &mut scratch.decided,
            &mut scratch.settled,
        );
        let (keys, key_ends) = (&scratch.keys, &scratch.key_ends);
        let index_seq = &mut self.index_seq;
        let result = engine.write(&mut |txn: &mut dyn Txn| {
            decided.clear();
            slots.clear();
            preload(txn, ops, keys, key_ends, slots)?;
            let ops_keys = ops.drain(..).zip(key_ends.iter().scan(0, |start, &end| {
                let key = &keys[*start..end];
                *start = end;
                Some(key)
            }));
            let commit = decide_all(txn, ops_keys, now_ms, slots, decided, index_seq);
            slots.clear();
            let commit = commit?;
            answers.clear();
            settled.clear();
            for (answer, s) in decided.drain(..) {
                answers.push(Some(answer));
                settled.push(s);
            }
            let mut at = 0;
            for (n, reply) in replies.iter_mut() {
                // An answer that read only state an earlier commit made durable (a duplicate, a
                // refusal, a get) and changed nothing needs no sync: send it now, so duplicates
                // batched with new claims do not wait for the new claims' fdatasync.
                if settled[at] && matches!(reply, Some(Reply::One(_))) {
                    if let (Some(Reply::One(tx)), Some(answer)) = (reply.take(), answers[at].take())
                    {
                        let _ = tx.send(answer);
                    }
                }
                at += *n;
            }
            Ok(commit)
        });
        match result {
            Ok(()) => {
                // Before any answer: a caller that has its answer must find it in the view.
                self.publish_view();
                self.shared.pending.end(&self.scratch.pending);
                self.shared.commits_total.fetch_add(1, Ordering::Relaxed);
                debug_assert_eq!(answers.len(), n_ops);
                self.scratch.delivery.send((replies, answers));
            }
            Err(e) => {
                self.fail(&e);
                self.shared.pending.end(&self.scratch.pending);
                let err = || Err(GateError::Store(engine_store_error(&e)));
                for (n, reply) in replies {
                    match reply {
                        Some(Reply::One(tx)) => {
                            let _ = tx.send(err());
                        }
                        Some(Reply::Many(tx)) => {
                            let _ = tx.send((0..n).map(|_| err()).collect());
                        }
                        None => {}
                    }
                }
            }
        }
    }

    /// Runs one key-set call in its own transaction: one fsync when it wrote anything, before
    /// the answer.
    fn key_set(&mut self, call: &KeySetCall) -> Result<Vec<bool>, GateError> {
        let now_ms = self.clock.now_ms();
        let mut answers = Vec::with_capacity(call.check.len());
        let mut unreadable = None;
        let engine = self.engine.as_mut().expect("checked by the caller");
        let members = &mut self.keyset_members;
        let memory_ids = self.keyset_memory_ids;
        let result = engine.write(&mut |txn: &mut dyn Txn| match keyset::apply(
            txn,
            (members, memory_ids),
            call,
            now_ms,
            &mut answers,
        )? {
            Ok(true) => {
                raise_clock_floor(txn, now_ms)?;
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                unreadable = Some(e);
                Ok(false)
            }
        });
        match (result, unreadable) {
            (Ok(()), None) => {
                self.shared.commits_total.fetch_add(1, Ordering::Relaxed);
                Ok(answers)
            }
            (Ok(()), Some(e)) => Err(StoreError::Corrupt(e.0).into()),
            (Err(e), _) => {
                self.fail(&e);
                Err(engine_store_error(&e).into())
            }
        }
    }

    fn stats(&mut self) -> Result<StoreStats, StoreError> {
        let mut held = 0;
        let engine = self.engine.as_mut().expect("checked by the caller");
        let result = engine.write(&mut |txn: &mut dyn Txn| {
            held = txn.meta_get(META_HELD)?.unwrap_or(0);
            Ok(false)
        });
        match result {
            Ok(()) => Ok(StoreStats {
                records_held: Some(held),
                swept_total: Some(self.shared.swept_total.load(Ordering::Relaxed)),
            }),
            Err(e) => {
                self.fail(&e);
                Err(engine_store_error(&e))
            }
        }
    }

    /// Clean shutdown: lets a healthy engine tidy its files for a fast reopen. A failure here
    /// loses nothing acknowledged (it is all durable already); it only makes the next open slower.
    fn close(&mut self) {
        self.scratch.delivery.stop();
        self.shared.view.set(None);
        if let Some(engine) = self.engine.as_mut() {
            let started = Instant::now();
            match engine.close() {
                Ok(()) => tracing::debug!(
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "embedded store closed cleanly"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "embedded store close could not tidy the engine")
                }
            }
        }
        self.engine = None;
    }

    /// Publishes the engine's view of the last durable commit (none without an engine).
    fn publish_view(&self) {
        self.shared
            .view
            .set(self.engine.as_ref().and_then(|e| e.durable_view()));
    }

    /// Fails closed: drops the engine so nothing more is written through it.
    fn fail(&mut self, e: &EngineError) {
        // First, so no caller answers from the view of an engine that failed.
        self.shared.view.set(None);
        tracing::error!(error = %e, "embedded store write failed; failing closed and reopening");
        *self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = e.to_string();
        self.shared.available.store(false, Ordering::Release);
        self.engine = None;
        self.keyset_members = None;
    }

    fn answer_unavailable(&self, r: Request) {
        let err = || self.shared.unavailable();
        match r {
            Request::One { reply, .. } => {
                let _ = reply.send(Err(err().into()));
            }
            Request::Many { ops, reply } => {
                let _ = reply.send(ops.iter().map(|_| Err(err().into())).collect());
            }
            Request::Sweep { reply, .. } => {
                let _ = reply.send(Err(err()));
            }
            Request::Stats { reply } => {
                let _ = reply.send(Err(err()));
            }
            Request::KeySet { reply, .. } => {
                let _ = reply.send(Err(err().into()));
            }
        }
    }

    /// Reopens the engine from disk, answering "unavailable" to everything meanwhile. Returns
    /// when the engine is back, or when every sender is gone.
    fn recover(&mut self) {
        let mut backoff_ms = 20;
        loop {
            let reopened = (self.opener)().and_then(|mut e| match check_format(e.as_mut())? {
                Ok(_) => {
                    // Nothing rests on the journal written before the failure (fsyncgate).
                    e.checkpoint_after_failure()?;
                    Ok(e)
                }
                Err(problem) => Err(EngineError::Other(problem.to_string())),
            });
            match reopened {
                Ok(engine) => {
                    tracing::warn!(engine = %engine.describe(), "embedded store reopened; resuming");
                    self.engine = Some(engine);
                    self.publish_view();
                    self.shared.available.store(true, Ordering::Release);
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, "embedded store reopen failed; retrying");
                    *self
                        .shared
                        .last_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = format!("reopen failed: {e}");
                }
            }
            let until = Instant::now() + Duration::from_millis(backoff_ms);
            while Instant::now() < until {
                match self.rx.try_recv() {
                    Ok(r) => self.answer_unavailable(r),
                    Err(mpsc::error::TryRecvError::Empty) => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            backoff_ms = (backoff_ms * 2).min(REOPEN_BACKOFF_MS_MAX);
        }
    }
}

fn request_ops(r: &Request) -> usize {
    match r {
        Request::Many { ops, .. } => ops.len(),
        _ => 1,
    }
}
