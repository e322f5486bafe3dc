//! The group-commit writer: one thread that owns the engine.
//!
//! Loop: block for one request, drain more without waiting (up to `batch_ops_max` ops), read
//! each op's current entry, [`decide`] the ops in order over an overlay (so a later op on the
//! same id sees an earlier one), write every changed entry and its expiry-index key in one
//! transaction, commit (one fsync), and only then answer every waiter (a commit with many
//! waiters hands its answers to an answer thread, see [`Delivery`]). A failed transaction or
//! commit answers the whole batch "unavailable", drops the engine and reopens it from disk; until
//! that succeeds every request is answered "unavailable" and nothing is acknowledged.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupgate_core::{
    decide, Change, Clock, Entry, GateError, Op, Outcome, RecordId, StoreError, StoreStats, Token,
};
use tokio::sync::{mpsc, oneshot};

use crate::codec::{
    self, decode_entry, encode_entry, encode_id, expiry_bucket, expiry_key, push_expiry_id,
    EXPIRY_RECORD_IDS_MAX,
};
use crate::engine::{DurableView, Engine, EngineError, EngineOpener, Txn};
use crate::keyset::{self, KeySetCall};

/// Meta key of the latest instant any commit decided on (unix ms).
pub(crate) const META_CLOCK_MS: &str = "clock_high_water_ms";
/// Meta key of the number of entries stored (kept by the writer: engines count slowly).
pub(crate) const META_HELD: &str = "entries_held";
/// Meta key of the store's format version.
pub(crate) const META_FORMAT: &str = "format_version";

/// Longest the writer waits to gather the callers its last commit answered.
const GATHER_WAIT_MAX: Duration = Duration::from_micros(300);

/// Longest wait between reopen attempts after a failure.
const REOPEN_BACKOFF_MS_MAX: u64 = 2_000;

type Answer = Result<Outcome, GateError>;

/// What callers send the writer.
pub(crate) enum Request {
    One {
        id: RecordId,
        op: Op,
        reply: oneshot::Sender<Answer>,
    },
    Many {
        ops: Vec<(RecordId, Op)>,
        reply: oneshot::Sender<Vec<Answer>>,
    },
    Sweep {
        batch_max: usize,
        /// How many entries went, and whether expired records remain.
        reply: oneshot::Sender<Result<(u64, bool), StoreError>>,
    },
    Stats {
        reply: oneshot::Sender<Result<StoreStats, StoreError>>,
    },
    KeySet {
        call: KeySetCall,
        /// One bool per key checked: true when it was new.
        reply: oneshot::Sender<Result<Vec<bool>, GateError>>,
    },
}

/// State the writer shares with the store's callers.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// False from a failed write until the engine has reopened cleanly.
    pub available: AtomicBool,
    /// Why the store is unavailable, for health answers.
    pub last_error: Mutex<String>,
    pub swept_total: AtomicU64,
    pub commits_total: AtomicU64,
    /// The last durable commit's view; `None` while the store is failed closed.
    pub view: ViewSlot,
    /// The ids the commit in flight may change, for callers answering from the view.
    pub pending: PendingIds,
}

/// Which ids the commit in flight may change, as bits of their hash, and an epoch that is odd
/// while a commit is in flight. A caller answers from the view only for an id no commit in flight
/// touches, and only if no commit began or ended meanwhile: otherwise the writer decides the id
/// at an instant earlier than the caller's, and the store's clock would appear to step back along
/// the order of operations on that key.
#[derive(Debug)]
pub(crate) struct PendingIds {
    epoch: AtomicU64,
    bits: Box<[AtomicU64]>,
}

/// Bits in [`PendingIds`]; a collision only sends an op to the writer.
const PENDING_BITS: usize = 1 << 16;

impl Default for PendingIds {
    fn default() -> Self {
        Self {
            epoch: AtomicU64::new(0),
            bits: (0..PENDING_BITS / 64).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl PendingIds {
    pub(crate) fn slot(id_bytes: &[u8]) -> (usize, u64) {
        // The storage key starts with a 32-bit hash of the id.
        let mut h = [0u8; 4];
        let n = id_bytes.len().min(4);
        h[..n].copy_from_slice(&id_bytes[..n]);
        let bit = u32::from_be_bytes(h) as usize % PENDING_BITS;
        (bit / 64, 1u64 << (bit % 64))
    }

    /// The current epoch (odd: a commit is in flight).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether the commit in flight may change the id stored under `id_bytes`.
    pub(crate) fn may_change(&self, id_bytes: &[u8]) -> bool {
        let (word, mask) = Self::slot(id_bytes);
        self.bits[word].load(Ordering::Acquire) & mask != 0
    }

    /// Marks the slots of a commit's ids, then makes the epoch odd: before it decides anything.
    fn begin(&self, slots: &[(usize, u64)]) {
        for &(word, mask) in slots {
            self.bits[word].fetch_or(mask, Ordering::Relaxed);
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes the epoch even, then clears the commit's slots: once its view is published.
    fn end(&self, slots: &[(usize, u64)]) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        for &(word, mask) in slots {
            self.bits[word].fetch_and(!mask, Ordering::Relaxed);
        }
    }
}

/// Where the writer publishes its [`DurableView`] for callers.
#[derive(Default)]
pub(crate) struct ViewSlot(std::sync::RwLock<Option<Arc<dyn DurableView>>>);

impl ViewSlot {
    pub(crate) fn get(&self) -> Option<Arc<dyn DurableView>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, view: Option<Arc<dyn DurableView>>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = view;
    }
}

impl std::fmt::Debug for ViewSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ViewSlot")
    }
}

impl Shared {
    pub(crate) fn unavailable(&self) -> StoreError {
        let why = self
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        StoreError::Unavailable(format!(
            "the embedded store failed closed and is reopening: {why}"
        ))
    }
}

fn engine_store_error(e: &EngineError) -> StoreError {
    match e {
        EngineError::Corrupt(s) => StoreError::Corrupt(s.clone()),
        other => StoreError::Unavailable(format!("embedded store write failed: {other}")),
    }
}

enum Reply {
    One(oneshot::Sender<Answer>),
    Many(oneshot::Sender<Vec<Answer>>),
}

/// One id's state within a batch.
struct Slot {
    /// The entry as the batch left it so far (`None`: absent).
    current: Option<Entry>,
    /// Expiry of the entry as stored before the batch, to move its index key.
    stored_expires_at_ms: Option<u64>,
    /// Set when the stored bytes could not be decoded: every op on this id answers corrupt.
    corrupt: Option<String>,
    dirty: bool,
}

/// Buffers the writer keeps from one batch to the next: allocating and freeing them per batch
/// (hundreds of KiB for a large batch) made the allocator grow, trim and consolidate its heap on
/// every commit. Emptied after each batch, so no entry outlives the batch that read it.
#[derive(Default)]
pub(crate) struct Scratch {
    ops: Vec<(RecordId, Op)>,
    /// Every op's storage key, encoded once per batch, back to back; `key_ends[i]` ends op i's.
    keys: Vec<u8>,
    key_ends: Vec<usize>,
    slots: HashMap<Vec<u8>, Slot>,
    decided: Vec<(Answer, bool)>,
    settled: Vec<bool>,
    pending: Vec<(usize, u64)>,
    /// The thread that sends a durable commit's answers (see [`Delivery`]).
    delivery: Delivery,
}

/// A commit's replies (each with how many ops it answers; `None` once answered early) and its
/// answers, in op order.
type Answers = (Vec<(usize, Option<Reply>)>, Vec<Option<Answer>>);

/// Commits whose replies reach this many callers have them sent by a thread of their own.
/// Waking a waiting task costs the waker a few microseconds (on 2 cores, the woken runtime
/// threads also preempt it): sending 64 answers held the writer for ~180 µs per commit, during
/// which the callers it had already woken queued their next ops and waited. Handed over, the
/// writer gathers and decides those ops while the rest are woken: 1.7-1.9x the claims/s at 64
/// callers when the sync is not the bound (measured with the sync off), within noise when it
/// is. Smaller commits (one caller) answer directly: a thread hop would only add latency.
const DELIVERY_REPLIES_MIN: usize = 8;

/// The answer thread: started with the first commit that needs it, ended (after sending
/// everything handed to it) when the writer stops. Answers are handed over only after their
/// commit is durable and its view is published, exactly when the writer would have sent them;
/// a later send is still correct (an acknowledgement may arrive late, never early).
#[derive(Default)]
struct Delivery {
    thread: Option<(
        std::sync::mpsc::Sender<Answers>,
        std::thread::JoinHandle<()>,
    )>,
    /// Set when the thread could not be started: the writer sends answers itself.
    unavailable: bool,
}

impl Delivery {
    /// Sends `answers` now, or hands them to the answer thread when they reach enough callers.
    fn send(&mut self, answers: Answers) {
        if answers.0.len() < DELIVERY_REPLIES_MIN || self.unavailable {
            return send_answers(answers);
        }
        if self.thread.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Answers>();
            let spawned = std::thread::Builder::new()
                .name("dedupgate-answers".into())
                .spawn(move || {
                    while let Ok(answers) = rx.recv() {
                        send_answers(answers);
                    }
                });
            match spawned {
                Ok(handle) => self.thread = Some((tx, handle)),
                Err(e) => {
                    tracing::warn!(error = %e, "no answer thread; the writer sends answers itself");
                    self.unavailable = true;
                    return send_answers(answers);
                }
            }
        }
        let (tx, _) = self.thread.as_ref().expect("started above");
        if let Err(std::sync::mpsc::SendError(answers)) = tx.send(answers) {
            // The thread is gone (it panicked): send them here, and from now on.
            self.thread = None;
            self.unavailable = true;
            send_answers(answers);
        }
    }

    /// Waits until everything handed over has been sent.
    fn stop(&mut self) {
        if let Some((tx, handle)) = self.thread.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

/// Sends each reply its answers.
fn send_answers((replies, mut answers): Answers) {
    let mut at = 0;
    for (n, reply) in replies {
        let mine = &mut answers[at..at + n];
        at += n;
        match reply {
            Some(Reply::One(tx)) => {
                let _ = tx.send(mine[0].take().expect("one answer per op"));
            }
            Some(Reply::Many(tx)) => {
                let _ = tx.send(
                    mine.iter_mut()
                        .map(|a| a.take().expect("one answer per op"))
                        .collect(),
                );
            }
            None => {}
        }
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

    /// Sweeps one bounded batch of records, then expired key-set chunks with what is left of the
    /// budget: how many went, and whether more may be waiting.
    fn sweep(&mut self, batch_max: usize) -> Result<(u64, bool), StoreError> {
        let now_ms = self.clock.now_ms();
        let mut removed = 0u64;
        let mut more = false;
        let mut set_removed = 0u64;
        let mut set_more = false;
        let engine = self.engine.as_mut().expect("checked by the caller");
        let members = &mut self.keyset_members;
        let result = engine.write(&mut |txn: &mut dyn Txn| {
            removed = 0;
            set_removed = 0;
            let wrote = sweep_in(txn, now_ms, batch_max, &mut removed, &mut more)?;
            // What is left of this sweep's budget (the trait's "up to batch_max"), in key-set
            // ids (whole chunks: at least one).
            let budget = batch_max.saturating_sub(usize::try_from(removed).unwrap_or(usize::MAX));
            let mut chunks = 0;
            if budget > 0 {
                let swept = keyset::sweep_step(txn, members.as_mut(), now_ms, budget)?;
                (set_removed, chunks, set_more) = (swept.ids, swept.chunks, swept.more);
            }
            if removed > 0 || chunks > 0 {
                // What was swept had expired by now: a key swept here must not be new again
                // where it was still live.
                raise_clock_floor(txn, now_ms)?;
            }
            Ok(wrote || chunks > 0)
        });
        let more = more || set_more;
        let removed = removed + set_removed;
        match result {
            Ok(()) => {
                if removed > 0 {
                    self.publish_view();
                }
                self.shared
                    .swept_total
                    .fetch_add(removed, Ordering::Relaxed);
                Ok((removed, more))
            }
            Err(e) => {
                self.fail(&e);
                Err(engine_store_error(&e))
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

/// Reads the stored entry of `id` (storage key `key`) into a new slot.
fn read_slot(
    txn: &mut dyn Txn,
    id: &RecordId,
    key: &[u8],
    val_buf: &mut Vec<u8>,
) -> Result<Slot, EngineError> {
    if !txn.get(key, val_buf)? {
        return Ok(Slot {
            current: None,
            stored_expires_at_ms: None,
            corrupt: None,
            dirty: false,
        });
    }
    Ok(match decode_entry(val_buf) {
        Ok(e) => Slot {
            stored_expires_at_ms: Some(e.expires_at_ms),
            current: Some(e),
            corrupt: None,
            dirty: false,
        },
        Err(e) => Slot {
            current: None,
            stored_expires_at_ms: None,
            corrupt: Some(format!(
                "{} / {:?}: {e}",
                id.namespace.as_str(),
                id.key.as_str()
            )),
            dirty: false,
        },
    })
}

/// Reads every id of the batch into `slots` before anything is decided, in storage-key order:
/// consecutive lookups then share most of their path down the engine's memtable (a skip list)
/// and its segment indexes, which random order missed at almost every step (the writer's
/// lookups cost ~13% less in a `dedup --ledger` load). Reads see the state before the
/// transaction only, so their order changes no answer.
fn preload(
    txn: &mut dyn Txn,
    ops: &[(RecordId, Op)],
    keys: &[u8],
    key_ends: &[usize],
    slots: &mut HashMap<Vec<u8>, Slot>,
) -> Result<(), EngineError> {
    let key = |i: usize| &keys[if i == 0 { 0 } else { key_ends[i - 1] }..key_ends[i]];
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_unstable_by(|&a, &b| key(a).cmp(key(b)));
    let mut val_buf = Vec::with_capacity(256);
    for i in order {
        let k = key(i);
        if !slots.contains_key(k) {
            let slot = read_slot(txn, &ops[i].0, k, &mut val_buf)?;
            slots.insert(k.to_vec(), slot);
        }
    }
    Ok(())
}

/// Decides `ops` (each with its storage key) in order inside `txn` and stages every change. Each
/// answer comes with whether it is settled (needs no sync). Returns whether to commit.
fn decide_all<'k>(
    txn: &mut dyn Txn,
    ops: impl Iterator<Item = ((RecordId, Op), &'k [u8])>,
    now_ms: u64,
    slots: &mut HashMap<Vec<u8>, Slot>,
    answers: &mut Vec<(Answer, bool)>,
    index_seq: &mut u64,
) -> Result<bool, EngineError> {
    let mut val_buf = Vec::with_capacity(256);
    for ((id, op), key) in ops {
        let slot = match slots.get_mut(key) {
            Some(s) => s,
            None => {
                let slot = read_slot(txn, &id, key, &mut val_buf)?;
                slots.entry(key.to_vec()).or_insert(slot)
            }
        };
        if let Some(why) = &slot.corrupt {
            // Never "absent": a corrupt entry might hold a claim; an operator must look.
            answers.push((Err(StoreError::Corrupt(why.clone()).into()), true));
            continue;
        }
        let decision = decide(&id, op, slot.current.as_ref(), now_ms, Token::generate);
        // Settled: the answer rests only on durable state (nothing in this batch touched the id)
        // and changes nothing, so it may be sent before this batch's sync.
        let mut settled = !slot.dirty;
        if let Change::Put(entry) = decision.change {
            slot.current = Some(entry);
            slot.dirty = true;
            settled = false;
        }
        answers.push((decision.answer, settled));
    }
    let mut any = false;
    let mut added = 0u64;
    // Expiry-index records first, entries second: a crash between the two (an engine that cannot
    // make the batch one atomic unit) leaves at worst an index record naming ids that are absent
    // or live (the sweeper re-checks each), never an entry no record names (never swept). An
    // entry whose bucket did not change is still named by the record that put it there: that
    // record is swept only once its bucket has passed, and by then the entry has expired.
    let mut records: Vec<(u64, usize, Vec<u8>)> = Vec::new();
    for (id, slot) in slots.iter() {
        if !slot.dirty {
            continue;
        }
        let entry = slot.current.as_ref().expect("a dirty slot holds an entry");
        let bucket = expiry_bucket(entry.expires_at_ms);
        if slot.stored_expires_at_ms.map(expiry_bucket) == Some(bucket) {
            continue;
        }
        let open = records
            .iter()
            .rposition(|(b, n, _)| *b == bucket && *n < EXPIRY_RECORD_IDS_MAX);
        let i = match open {
            Some(i) => i,
            None => {
                records.push((bucket, 0, Vec::with_capacity(64 * 32)));
                records.len() - 1
            }
        };
        records[i].1 += 1;
        push_expiry_id(&mut records[i].2, id);
    }
    // Sequence numbers only need to differ between records of one bucket; starting each batch
    // at (now_ms << 16) or above keeps them distinct across restarts too, as the store's clock
    // never goes back.
    *index_seq = (*index_seq + 1).max(now_ms.saturating_mul(1 << 16));
    for (bucket, _, record) in &records {
        *index_seq += 1;
        txn.index_put(&expiry_key(*bucket, *index_seq), record)?;
    }
    for (id, slot) in slots.iter() {
        if !slot.dirty {
            continue;
        }
        if slot.stored_expires_at_ms.is_none() {
            added += 1;
        }
        let entry = slot.current.as_ref().expect("a dirty slot holds an entry");
        encode_entry(entry, &mut val_buf);
        txn.put(id, &val_buf)?;
        any = true;
    }
    if any {
        raise_clock_floor(txn, now_ms)?;
        if added > 0 {
            let held = txn.meta_get(META_HELD)?.unwrap_or(0);
            txn.meta_put(META_HELD, held + added)?;
        }
    }
    Ok(any)
}

/// Removes up to `batch_max` expired entries, walking the expiry index from the oldest record
/// whose bucket has passed, examining at most about `batch_max` ids. Sets `more` when passed
/// records remain. Returns whether anything was written.
fn sweep_in(
    txn: &mut dyn Txn,
    now_ms: u64,
    batch_max: usize,
    removed: &mut u64,
    more: &mut bool,
) -> Result<bool, EngineError> {
    // Records whose bucket is at or before now sort before (now + 1, sequence 0).
    let bound = expiry_key(now_ms.saturating_add(1), 0);
    let mut records = Vec::new();
    let mut val_buf = Vec::new();
    let mut examined = 0usize;
    let mut wrote = false;
    *more = false;
    'fetch: loop {
        records.clear();
        // A record names at most EXPIRY_RECORD_IDS_MAX ids: a fetch is a bounded amount.
        txn.index_before(&bound, 64, &mut records)?;
        if records.is_empty() {
            break;
        }
        for (key, record) in &records {
            if examined >= batch_max {
                *more = true;
                break 'fetch;
            }
            let ids = codec::expiry_ids(record).map_err(|e| EngineError::Corrupt(e.0))?;
            for id in ids {
                examined += 1;
                if txn.get(id, &mut val_buf)? {
                    match decode_entry(&val_buf) {
                        Ok(e) if !e.is_live(now_ms) => {
                            txn.remove(id)?;
                            *removed += 1;
                        }
                        // Renewed since this record was written: a newer record names it.
                        Ok(_) => {}
                        // Left for an operator; sweeping it would turn "corrupt" into "absent".
                        Err(e) => tracing::error!(error = %e, "sweeper left an undecodable entry"),
                    }
                }
            }
            txn.index_remove(key)?;
            wrote = true;
        }
    }
    if *removed > 0 {
        let held = txn.meta_get(META_HELD)?.unwrap_or(0);
        txn.meta_put(META_HELD, held.saturating_sub(*removed))?;
    }
    Ok(wrote)
}

/// Persists `now_ms` as the latest instant decided on (or swept at) unless a later one is, so a
/// restart's clock never starts before it.
fn raise_clock_floor(txn: &mut dyn Txn, now_ms: u64) -> Result<(), EngineError> {
    if txn.meta_get(META_CLOCK_MS)?.unwrap_or(0) < now_ms {
        txn.meta_put(META_CLOCK_MS, now_ms)?;
    }
    Ok(())
}

/// Why a store's format cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FormatProblem {
    /// Written by a build with another format.
    Unknown(u64),
    /// Entries but no version: not a store this build wrote.
    Missing,
    /// An older format holding something its migration cannot read.
    Unmigratable(String),
}

impl std::fmt::Display for FormatProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatProblem::Unknown(v) => write!(
                f,
                "the store has format version {v}; this build reads version {} (and migrates {:?})",
                crate::FORMAT_VERSION,
                crate::FORMATS_MIGRATED
            ),
            FormatProblem::Unmigratable(why) => {
                write!(f, "the store's format cannot be migrated: {why}")
            }
            FormatProblem::Missing => {
                f.write_str("entries exist but the store has no format version")
            }
        }
    }
}

/// Checks (or, on a new store, writes) the format version, migrating each of
/// [`crate::FORMATS_MIGRATED`] in the same transaction as the new version: 2 had no key set (the
/// engine already opened its partition: only the version changes), 3 kept one entry per key
/// (rewritten as chunks, [`keyset::migrate_members`]). Returns the persisted clock floor.
pub(crate) fn check_format(
    engine: &mut dyn Engine,
) -> Result<Result<u64, FormatProblem>, EngineError> {
    let mut outcome = Ok(0);
    engine.write(&mut |txn: &mut dyn Txn| match txn.meta_get(META_FORMAT)? {
        None if !txn.is_empty()? => {
            outcome = Err(FormatProblem::Missing);
            Ok(false)
        }
        None => {
            txn.meta_put(META_FORMAT, crate::FORMAT_VERSION)?;
            outcome = Ok(0);
            Ok(true)
        }
        Some(v) if v == crate::FORMAT_VERSION => {
            outcome = Ok(txn.meta_get(META_CLOCK_MS)?.unwrap_or(0));
            Ok(false)
        }
        Some(v) if crate::FORMATS_MIGRATED.contains(&v) => {
            if v == 3 {
                if let Err(e) = keyset::migrate_members(txn)? {
                    outcome = Err(FormatProblem::Unmigratable(e.0));
                    return Ok(false);
                }
            }
            txn.meta_put(META_FORMAT, crate::FORMAT_VERSION)?;
            outcome = Ok(txn.meta_get(META_CLOCK_MS)?.unwrap_or(0));
            Ok(true)
        }
        Some(v) => {
            outcome = Err(FormatProblem::Unknown(v));
            Ok(false)
        }
    })?;
    Ok(outcome)
}
