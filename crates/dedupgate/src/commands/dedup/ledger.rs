//! The ledger side of `dedup`: a bounded window of keys this run has seen, and batches of
//! ledger writes kept in flight while the next batch is built.
//!
//! Per batch of at most `batch_records` records whose key the window had not seen: one ledger
//! call (one group commit on the embedded store). While calls are in flight the caller keys
//! and collects the next batch; when that one is full and [`sink_depth`] calls are in
//! flight, the oldest call's answers are waited for, its new records written (in input order)
//! and the output flushed, and only then the next call goes out. A key that two calls in
//! flight could both find new (neither has recorded it yet) is kept out of the later one by the
//! window, which holds every key of the batches in flight and the one being built.
//!
//! Two kinds of ledger:
//! - **An embedded store held by this run** keeps the keys in its key set (the core's
//!   [`KeySet`], which the embedded store keeps natively): one put per new key. No other process can use the
//!   directory meanwhile (its lock), so nothing needs claiming: in the retriable mode a call
//!   only looks the batch's keys up, and the keys of the records it let through (written and
//!   flushed by then) are recorded by the next call; a run that dies in between recorded
//!   nothing of them, and the next run emits them again. In the at-most-once mode a call
//!   records the new keys before they are written.
//! - **Any other store, or a server**, which other runs may share, keeps gate records: in the
//!   retriable mode each call first completes the claims of the records the previous call let
//!   through, then claims the new batch's keys (one commit per batch for both); a run that dies
//!   leaves claims that expire after [`LEDGER_LEASE_MS`]. In the at-most-once mode a call marks.

use std::collections::{HashSet, VecDeque};
use std::io::Write;

use std::sync::Arc;

use anyhow::anyhow;
use dedupgate_core::{KeyId, KeySet, KeySetCall, Namespace, Token};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::commands::pipeline::backend::{Backend, Fresh, LedgerAnswers, LedgerWrite};
use crate::commands::pipeline::keyspec::{key_set_member, Prehashed};
use crate::commands::pipeline::now_ms;

use super::{Counts, LedgerMode};

/// Records per ledger call unless `--ledger-batch` says otherwise. With the completions of the
/// previous batch a call carries at most twice this, under the API's 10,000 ops per batch.
pub const LEDGER_BATCH_RECORDS: usize = 4096;
/// Most records per ledger call (`--ledger-batch`).
pub const LEDGER_BATCH_RECORDS_MAX: usize = 5000;
/// Most output bytes held per batch.
pub const LEDGER_BATCH_BYTES: usize = 8 << 20;
/// Keys the window of a gate ledger (a server, or a store other than embedded) remembers unless
/// `--ledger-window` says otherwise (about 36 MB).
pub const LEDGER_WINDOW_KEYS: usize = 1 << 20;
/// Most keys `--ledger-window` takes.
pub const LEDGER_WINDOW_KEYS_MAX: usize = 1 << 30;
/// Lease of a ledger claim: how long a crashed run's records stay held before the next run
/// may emit them.
pub const LEDGER_LEASE_MS: u64 = 10 * 60 * 1000;
/// How often a run asks again about keys another run holds.
const HELD_POLL: std::time::Duration = std::time::Duration::from_millis(500);
/// Longest a run waits for keys another run holds: twice a ledger claim's lease, which one
/// `dedup` run holding a key (nothing renews its claims) cannot reach.
const HELD_WAIT_MAX: std::time::Duration = std::time::Duration::from_millis(2 * LEDGER_LEASE_MS);
/// How often a run waiting for keys another run holds says so on stderr.
const HELD_NOTE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// The keys (128-bit digest prefixes) this run let through to the ledger most recently, in two
/// generations of `generation` keys each: a key stays for at least `generation` first
/// sightings after its own, and memory is bounded whatever the input size. Only first
/// sightings fill a generation (a repeat is not moved forward): the guarantee is counted in
/// keys sent to the ledger, which is what keeps a key of a batch in flight out of the next.
pub struct Window {
    current: HashSet<u128, Prehashed>,
    previous: HashSet<u128, Prehashed>,
    generation: usize,
}

impl Window {
    /// A window of about `keys` keys.
    pub fn new(keys: usize) -> Self {
        let generation = (keys / 2).max(1);
        // Sized up front for the default window (no rehash while it fills); a larger one grows.
        let initial = generation.min(LEDGER_WINDOW_KEYS / 2);
        Self {
            current: HashSet::with_capacity_and_hasher(initial, Prehashed::default()),
            previous: HashSet::with_capacity_and_hasher(initial, Prehashed::default()),
            generation,
        }
    }

    /// True when `key` is not in the window (a first sighting as far as it knows); it is in
    /// the current generation afterwards.
    pub fn first_sighting(&mut self, key: u128) -> bool {
        if self.current.contains(&key) || self.previous.contains(&key) {
            return false;
        }
        if self.current.len() >= self.generation {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
        }
        self.current.insert(key);
        true
    }
}

/// Records waiting for one ledger call, back to back.
#[derive(Default)]
struct Batch {
    /// Each record's gate key (the ledger key of a gate ledger; for a key set, only when it
    /// consults gate records)...
    keys: Vec<String>,
    /// ...and, for a key set, its id.
    ids: Vec<KeyId>,
    bytes: Vec<u8>,
    /// End of each record in `bytes`.
    ends: Vec<usize>,
}

impl Batch {
    fn clear(&mut self) {
        self.keys.clear();
        self.ids.clear();
        self.bytes.clear();
        self.ends.clear();
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn record(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }
}

/// What a call carried, handed back with its answers.
struct Sent {
    batch: Batch,
    completes: Vec<(String, Token)>,
    /// Key-set ids the call recorded.
    recorded: usize,
}

/// Where the ledger keeps its keys.
enum Sink {
    /// Gate records in any store or a server.
    Gate {
        backend: Backend,
        write: LedgerWrite,
    },
    /// The key set of an embedded store this run holds; with `gate_keys`, each key's gate
    /// record is consulted too (the store holds gate records, which only this run could add
    /// or remove while it holds the directory, and it adds none).
    KeySet {
        store: Arc<dyn KeySet>,
        gate_keys: bool,
    },
}

type CallResult = (Sent, anyhow::Result<LedgerAnswers>);

/// Calls kept in flight at once: two for a key set, whose calls are short enough that waiting
/// for each before sending the next left the store's writer idle between them (a first
/// 10M-line run: 10.0–10.5 s with one, 7.8–9.6 s with two); one for gate records, whose failure
/// handling releases the claims of the one call it stopped.
fn sink_depth(sink: &Sink) -> usize {
    match sink {
        Sink::KeySet { .. } => 2,
        Sink::Gate { .. } => 1,
    }
}

/// The ledger of one run.
pub struct Ledger<'a> {
    sink: Sink,
    /// For messages.
    describe: String,
    namespace: String,
    ttl_ms: u64,
    mode: LedgerMode,
    rt: &'a Runtime,
    batch_records: usize,
    window: Window,
    batch: Batch,
    spare: Batch,
    /// Calls sent and not yet settled, oldest first: at most [`sink_depth`].
    in_flight: VecDeque<JoinHandle<CallResult>>,
    /// Claims of written and flushed records, completed by the next call (gate ledger).
    to_complete: Vec<(String, Token)>,
    /// Ids of written and flushed records, recorded by the next call (key-set ledger).
    to_record: Vec<KeyId>,
}

impl<'a> Ledger<'a> {
    /// A ledger writing to `backend` (to its key set when it is an embedded store); `rt` must
    /// run spawned tasks on its own threads (a multi-thread runtime), so calls go on while the
    /// caller builds the next batch.
    pub fn new(
        backend: &Backend,
        namespace: &str,
        ttl_ms: u64,
        mode: LedgerMode,
        rt: &'a Runtime,
        batch_records: usize,
        window_keys: Option<usize>,
    ) -> Self {
        let batch_records = batch_records.clamp(1, LEDGER_BATCH_RECORDS_MAX);
        let sink = match backend.key_set() {
            Some(store) => Sink::KeySet {
                store: store.clone(),
                // Unknown (stats failed): consult them, to be safe.
                gate_keys: rt
                    .block_on(store.stats())
                    .map_or(true, |s| s.records_held != Some(0)),
            },
            None => Sink::Gate {
                backend: backend.clone(),
                write: match mode {
                    LedgerMode::Retriable => LedgerWrite::Claim {
                        lease_ms: LEDGER_LEASE_MS,
                        // Claims of this run name this owner, so a retried call gets its own
                        // claims back.
                        owner: format!("dedup-{}", Token::generate().as_str()),
                    },
                    LedgerMode::AtMostOnce => LedgerWrite::Mark,
                },
            },
        };
        let window_keys = window_keys.unwrap_or(match sink {
            Sink::KeySet { .. } => 0,
            Sink::Gate { .. } => LEDGER_WINDOW_KEYS,
        });
        let depth = sink_depth(&sink);
        Self {
            sink,
            describe: backend.describe(),
            namespace: namespace.to_owned(),
            ttl_ms,
            mode,
            rt,
            batch_records,
            // Keys of the batches in flight and the one being built must be distinct (a second
            // claim by the same owner would be answered "new" again; a key set records a key
            // only `depth` calls after the one that found it new), so the window, which keeps a
            // key for at least `window / 2` later first sightings, holds twice that many
            // batches. An embedded key set answers from memory, so a larger window only costs
            // this thread cache misses (a 1M-key window made a 10M-line run 30% slower).
            window: Window::new(window_keys.max(2 * (depth + 1) * batch_records)),
            batch: Batch::default(),
            spare: Batch::default(),
            in_flight: VecDeque::new(),
            to_complete: Vec::new(),
            to_record: Vec::new(),
        }
    }

    /// False when this run already had the key within the window: a duplicate the ledger need
    /// not be asked about.
    pub fn first_sighting(&mut self, digest: &[u8; 32]) -> bool {
        self.window
            .first_sighting(crate::commands::pipeline::keyspec::short(digest))
    }

    /// Adds a record whose key has digest `digest` and ledger key `key()` (asked only by a
    /// gate ledger): `encode` appends its output bytes. Sends the batch when it is full.
    pub fn push(
        &mut self,
        digest: &[u8; 32],
        key: impl FnOnce() -> String,
        encode: impl FnOnce(&mut Vec<u8>) -> anyhow::Result<()>,
        counts: &mut Counts,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        encode(&mut self.batch.bytes)?;
        match self.sink {
            Sink::Gate { .. } => self.batch.keys.push(key()),
            Sink::KeySet { gate_keys, .. } => {
                self.batch.ids.push(key_set_member(digest));
                // A ledger kept as gate records still counts.
                if gate_keys {
                    self.batch.keys.push(key());
                }
            }
        }
        self.batch.ends.push(self.batch.bytes.len());
        if self.batch.len() >= self.batch_records || self.batch.bytes.len() >= LEDGER_BATCH_BYTES {
            self.send(counts, out)?;
        }
        Ok(())
    }

    /// Settles the oldest call while [`sink_depth`] are in flight, then sends the current
    /// batch with the completions due.
    fn send(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        while self.in_flight.len() >= sink_depth(&self.sink) {
            self.settle_oldest(counts, out)?;
        }
        if self.batch.len() == 0 && self.to_complete.is_empty() && self.to_record.is_empty() {
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.spare);
        batch.clear();
        std::mem::swap(&mut batch, &mut self.batch);
        let (ns, ttl_ms) = (self.namespace.clone(), self.ttl_ms);
        // Calls reach the store in the order they were sent (one runtime worker takes spawned
        // tasks first in, first out, and the store's queue is first come, first served);
        // correctness does not rest on it: the window keeps every key of the unsettled
        // batches out of the others.
        self.in_flight.push_back(match &self.sink {
            Sink::Gate { backend, write } => {
                let sent = Sent {
                    batch,
                    completes: std::mem::take(&mut self.to_complete),
                    recorded: 0,
                };
                let (backend, write) = (backend.clone(), write.clone());
                self.rt.spawn(async move {
                    let answers = backend
                        .ledger_call(&ns, &sent.completes, &sent.batch.keys, ttl_ms, &write)
                        .await;
                    (sent, answers)
                })
            }
            Sink::KeySet { store, .. } => {
                let record = std::mem::take(&mut self.to_record);
                let sent = Sent {
                    batch,
                    completes: Vec::new(),
                    recorded: record.len(),
                };
                let record_new = self.mode == LedgerMode::AtMostOnce;
                let store = store.clone();
                self.rt.spawn(async move {
                    let answers = key_set_call(
                        store.as_ref(),
                        ns,
                        record,
                        (&sent.batch.ids, &sent.batch.keys),
                        ttl_ms,
                        record_new,
                    )
                    .await;
                    (sent, answers)
                })
            }
        });
        Ok(())
    }

    /// Settles every call in flight, oldest first.
    fn settle(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        while !self.in_flight.is_empty() {
            self.settle_oldest(counts, out)?;
        }
        Ok(())
    }

    /// Settles the oldest call; after a failure, waits for the later ones too (they wrote
    /// nothing) and says how many of their records a later run will not emit (at most once).
    fn settle_oldest(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        let Err(e) = self.settle_one(counts, out) else {
            return Ok(());
        };
        let (mut recorded_unwritten, mut written_unrecorded) = (0u64, 0u64);
        while let Some(handle) = self.in_flight.pop_front() {
            match self.rt.block_on(handle) {
                Ok((_, Ok(answers))) => {
                    let new = answers.fresh.iter();
                    recorded_unwritten +=
                        new.filter(|a| matches!(a, Ok(Fresh::New(_)))).count() as u64;
                }
                // A written batch this call was to record goes unrecorded too.
                Ok((sent, Err(_))) => written_unrecorded += sent.recorded as u64,
                Err(_) => {}
            }
        }
        if self.mode == LedgerMode::AtMostOnce && recorded_unwritten > 0 {
            return Err(e.context(format!(
                "at-most-once ledger: {recorded_unwritten} more records of the calls sent after \
                 it were recorded and not written"
            )));
        }
        if written_unrecorded > 0 {
            return Err(e.context(format!(
                "{written_unrecorded} more written records were not recorded by the calls sent \
                 after it; the next run will emit them again"
            )));
        }
        Err(e)
    }

    /// Gives back at once the claims a call answered "new" for `keys`, when none of their
    /// records will be written.
    fn release_new(&self, fresh: &[Result<Fresh, String>], keys: &[String]) {
        self.release_at(fresh, keys, 0..fresh.len());
    }

    /// [`Self::release_new`] for the answers at `at` only.
    fn release_at(
        &self,
        fresh: &[Result<Fresh, String>],
        keys: &[String],
        at: impl IntoIterator<Item = usize>,
    ) {
        let claimed: Vec<(String, Token)> = at
            .into_iter()
            .filter_map(|i| match &fresh[i] {
                Ok(Fresh::New(Some(t))) => Some((keys[i].clone(), t.clone())),
                _ => None,
            })
            .collect();
        if let Sink::Gate { backend, .. } = &self.sink {
            self.rt
                .block_on(backend.release_batch(&self.namespace, &claimed));
        }
    }

    /// Asks again about the keys another run holds (claimed, not completed) until each is new
    /// or completed. Such a key is not yet a duplicate: its holder may still fail and release
    /// it, or have died (a run restarted within the lease of the one it replaces), and then
    /// only this run would emit its record. So the run waits for the holder, at most until
    /// its lease ends, saying so on stderr.
    ///
    /// While it waits, the run holds none of the batch's keys: it gives back the claims the
    /// batch got and claims them again with the held ones. Two runs whose batches each hold a
    /// key the other waits for would otherwise wait for each other until a lease ran out, and
    /// then both write the key the other took over. Only the held keys are asked about while
    /// the run waits; the ones it gave back are claimed again once none is held. After
    /// [`HELD_WAIT_MAX`] the run stops with an error, holding nothing of the batch.
    ///
    /// Marks (the at-most-once mode) are recorded when they are answered "new" and cannot be
    /// given back, so that mode takes a held key as a duplicate, as it may lose records anyway.
    fn settle_held(
        &self,
        fresh: &mut [Result<Fresh, String>],
        keys: &[String],
    ) -> anyhow::Result<()> {
        let Sink::Gate {
            backend,
            write: write @ LedgerWrite::Claim { .. },
        } = &self.sink
        else {
            for answer in fresh.iter_mut() {
                if matches!(answer, Ok(Fresh::Held { .. })) {
                    *answer = Ok(Fresh::Duplicate);
                }
            }
            return Ok(());
        };
        let started = std::time::Instant::now();
        let mut noted: Option<std::time::Instant> = None;
        // Which keys of the batch were given back while waiting, to claim again once none is held.
        let mut released = vec![false; fresh.len()];
        loop {
            let held: Vec<usize> = (0..fresh.len())
                .filter(|&i| matches!(fresh[i], Ok(Fresh::Held { .. })))
                .collect();
            let ask = if let Some(&first) = held.first() {
                // Hold nothing of the batch while waiting (see above).
                let give_back: Vec<usize> = (0..fresh.len())
                    .filter(|&i| !released[i] && matches!(fresh[i], Ok(Fresh::New(_))))
                    .collect();
                self.release_at(fresh, keys, give_back.iter().copied());
                for i in give_back {
                    released[i] = true;
                }
                let Ok(Fresh::Held {
                    owner,
                    lease_expires_at_ms,
                }) = &fresh[first]
                else {
                    unreachable!("the first held key")
                };
                let holder = owner.as_deref().unwrap_or("an unnamed owner");
                if started.elapsed() >= HELD_WAIT_MAX {
                    anyhow::bail!(
                        "{} keys are still held after {} minutes (first: {:?}, held by \
                         {holder}): a claim that is renewed (is the ledger namespace shared \
                         with something other than dedup?), or runs that keep taking the \
                         keys in turn; nothing of this batch was written or is held",
                        held.len(),
                        HELD_WAIT_MAX.as_secs() / 60,
                        keys[first],
                    );
                }
                if noted.is_none_or(|at| at.elapsed() >= HELD_NOTE_EVERY) {
                    let ends = lease_expires_at_ms.map_or("unknown".to_owned(), |t| {
                        let left_ms = i64::try_from(t).unwrap_or(i64::MAX) - now_ms();
                        format!("in {} s", left_ms.max(0).unsigned_abs().div_ceil(1000))
                    });
                    eprintln!(
                        "dedupgate dedup: waiting for {} keys another run holds and has not \
                         completed (first: {:?}, held by {holder}, its lease ends {ends})",
                        held.len(),
                        keys[first],
                    );
                    noted = Some(std::time::Instant::now());
                }
                // Up to half a poll more at random, so that two runs waiting on each other's
                // keys do not keep meeting at the same instants.
                let jitter = std::hash::BuildHasher::hash_one(
                    &std::collections::hash_map::RandomState::new(),
                    started.elapsed(),
                ) % (HELD_POLL.as_millis() as u64 / 2 + 1);
                std::thread::sleep(HELD_POLL + std::time::Duration::from_millis(jitter));
                held
            } else {
                // Nothing held any more: claim again what was given back (some may now be held
                // by another run, and the wait goes on).
                let again: Vec<usize> = (0..fresh.len()).filter(|&i| released[i]).collect();
                if again.is_empty() {
                    return Ok(());
                }
                released.fill(false);
                again
            };
            let again: Vec<String> = ask.iter().map(|&i| keys[i].clone()).collect();
            let answers = self.rt.block_on(backend.ledger_call(
                &self.namespace,
                &[],
                &again,
                self.ttl_ms,
                write,
            ))?;
            if answers.fresh.len() != ask.len() {
                anyhow::bail!(
                    "the ledger answered {} of {} keys asked again",
                    answers.fresh.len(),
                    ask.len()
                );
            }
            for (i, answer) in ask.into_iter().zip(answers.fresh) {
                fresh[i] = answer;
            }
        }
    }

    /// Waits for the oldest call in flight, writes the records it let through and flushes.
    fn settle_one(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        let Some(handle) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let (sent, answers) = self
            .rt
            .block_on(handle)
            .map_err(|e| anyhow!("ledger call failed: {e}"))?;
        let describe = || format!("ledger {}", self.describe);
        let unrecorded = || match self.sink {
            Sink::Gate { .. } => format!(
                "{}: {} records were written but not recorded; they will be emitted again by \
                 a run after the {}s lease",
                describe(),
                sent.completes.len(),
                LEDGER_LEASE_MS / 1000
            ),
            Sink::KeySet { .. } => format!(
                "{}: {} records were written but not recorded; the next run will emit them again",
                describe(),
                sent.recorded
            ),
        };
        let mut answers = match answers {
            Ok(a) => a,
            Err(e) if sent.completes.is_empty() && sent.recorded == 0 => {
                return Err(e.context(describe()))
            }
            Err(e) => return Err(e.context(unrecorded())),
        };
        if let Some(reason) = answers.completed.iter().find_map(|a| a.as_ref().err()) {
            let failed = answers.completed.iter().filter(|a| a.is_err()).count();
            let e = anyhow!(
                "{failed} of {} ledger completions failed (first: {reason})",
                sent.completes.len()
            );
            self.release_new(&answers.fresh, &sent.batch.keys);
            return Err(e.context(unrecorded()));
        }
        if let Err(e) = self.settle_held(&mut answers.fresh, &sent.batch.keys) {
            self.release_new(&answers.fresh, &sent.batch.keys);
            return Err(e.context(describe()));
        }
        let mut failure: Option<anyhow::Error> = None;
        let mut new = 0u64;
        let mut unwritten = 0u64;
        for (i, answer) in answers.fresh.iter().enumerate() {
            match answer {
                Ok(Fresh::New(token)) => {
                    if failure.is_none() {
                        match out.write_all(sent.batch.record(i)) {
                            Ok(()) => new += 1,
                            Err(e) => {
                                failure = Some(anyhow::Error::new(e).context("writing the output"))
                            }
                        }
                    }
                    if failure.is_some() {
                        unwritten += 1;
                    }
                    if let Some(token) = token {
                        self.to_complete
                            .push((sent.batch.keys[i].clone(), token.clone()));
                    } else if matches!(self.sink, Sink::KeySet { .. })
                        && self.mode == LedgerMode::Retriable
                    {
                        self.to_record.push(sent.batch.ids[i]);
                    }
                }
                Ok(_) => counts.duplicates += 1,
                Err(reason) => {
                    failure.get_or_insert_with(|| match sent.batch.keys.get(i) {
                        Some(key) => anyhow!("ledger refused key {key:?}: {reason}"),
                        None => anyhow!("ledger refused a key: {reason}"),
                    });
                }
            }
        }
        if failure.is_none() {
            if let Err(e) = out.flush() {
                failure = Some(anyhow::Error::new(e).context("writing the output"));
                unwritten = new;
            }
        }
        let mut batch = sent.batch;
        batch.clear();
        self.spare = batch;
        let Some(e) = failure else {
            counts.emitted += new;
            return Ok(());
        };
        match self.mode {
            LedgerMode::Retriable => {
                // Nothing of this batch counts as emitted: give its keys back at once (a key
                // set has recorded none of them yet).
                self.to_record.clear();
                let claimed = std::mem::take(&mut self.to_complete);
                if let Sink::Gate { backend, .. } = &self.sink {
                    self.rt
                        .block_on(backend.release_batch(&self.namespace, &claimed));
                }
                Err(e)
            }
            LedgerMode::AtMostOnce => Err(e.context(format!(
                "at-most-once ledger: {unwritten} recorded records were not written and will \
                 not be emitted by a later run within the ttl (the default retriable mode \
                 records only what was written)"
            ))),
        }
    }

    /// Sends what is left, settles it and completes the last claims.
    pub fn finish(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        self.send(counts, out)?;
        self.settle(counts, out)?;
        if !self.to_complete.is_empty() || !self.to_record.is_empty() {
            self.send(counts, out)?;
            self.settle(counts, out)?;
        }
        Ok(())
    }

    /// After a failure elsewhere: settles the call in flight (its records are written and its
    /// claims completed, as in a clean run) and drops the batch not yet sent.
    pub fn abandon(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        self.batch.clear();
        self.finish(counts, out)
    }
}

/// One key-set call, answered like a gate ledger call (no completions: recording is a put).
async fn key_set_call(
    store: &dyn KeySet,
    namespace: String,
    record: Vec<KeyId>,
    (check, gate_keys): (&[KeyId], &[String]),
    ttl_ms: u64,
    record_new: bool,
) -> anyhow::Result<LedgerAnswers> {
    let call = KeySetCall {
        namespace: Namespace::new(namespace)?,
        record,
        check: check.to_vec(),
        record_new,
        gate_keys: gate_keys.to_vec(),
        ttl_ms,
        forget: Vec::new(),
    };
    let fresh = store
        .key_set(call)
        .await?
        .into_iter()
        .map(|new| {
            Ok(if new {
                Fresh::New(None)
            } else {
                Fresh::Duplicate
            })
        })
        .collect();
    Ok(LedgerAnswers {
        completed: Vec::new(),
        fresh,
    })
}
