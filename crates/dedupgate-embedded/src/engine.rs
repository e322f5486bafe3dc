//! The seam between the group-commit writer and the storage engine.
//!
//! The writer needs very little from an engine: one write transaction at a time in which it can
//! read and write entries by id, keep an ordered expiry index, keep a few named numbers, and
//! commit durably (fsync'd) or abort. [`Engine`] and [`Txn`] say exactly that, so the engine
//! comparison in `benches/claims.rs` runs redb, SQLite and fjall under the very same writer. The
//! store ships with [`FjallEngine`] (see `docs/embedded-engine.md` for why and how).

use std::ops::Bound;
use std::path::{Path, PathBuf};

use crate::idfilter::{IdFilter, IdScan};

/// Why an engine call failed. Any of these inside a write makes the store fail closed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The operating system refused a read, write or sync.
    #[error("I/O error: {0}")]
    Io(std::io::Error),
    /// The engine found data it cannot read.
    #[error("engine data is corrupt: {0}")]
    Corrupt(String),
    /// Anything else the engine reported.
    #[error("{0}")]
    Other(String),
}

// By hand rather than `#[from]`: the message already holds the cause, so it is not also the
// error's source (a report walking the sources would say it twice).
impl From<std::io::Error> for EngineError {
    fn from(e: std::io::Error) -> Self {
        EngineError::Io(e)
    }
}

/// One write transaction, as the writer sees it. Reads may see the state before the
/// transaction only: the writer reads each key before it writes it and never reads it again in
/// the same transaction (its own overlay answers later ops on the same id).
pub trait Txn {
    /// Copies the value stored under `id` into `out`; false when there is none.
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError>;
    /// Stores `value` under `id`, replacing any.
    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError>;
    /// Removes the value under `id`, if any.
    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError>;
    /// Stores an expiry-index record (see [`crate::codec::expiry_key`]), replacing any.
    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError>;
    /// Removes an expiry-index record, if present.
    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError>;
    /// Appends to `out` up to `max` expiry-index records (key, record) whose keys sort before
    /// `bound`, smallest first.
    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError>;
    /// Reads a named number.
    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError>;
    /// Writes a named number.
    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError>;
    /// True when no entry is stored (checked only when a store has no format version).
    fn is_empty(&mut self) -> Result<bool, EngineError>;
    /// Stores an entry of a key-set table (see [`crate::keyset`]), replacing any. Unlike
    /// [`Txn::put`], later reads of the key set in the same transaction see it. An engine
    /// without a key set holds an empty one: its reads find nothing, its writes fail.
    fn set_put(&mut self, table: SetTable, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
        let _ = (table, key, value);
        Err(no_key_set())
    }
    /// Copies the entry of a key-set table stored under `key` into `out`; false when there is
    /// none.
    fn set_get(
        &mut self,
        table: SetTable,
        key: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, EngineError> {
        let _ = (table, key, out);
        Ok(false)
    }
    /// Removes an entry of a key-set table, if any.
    fn set_remove(&mut self, table: SetTable, key: &[u8]) -> Result<(), EngineError> {
        let _ = (table, key);
        Err(no_key_set())
    }
    /// Appends to `out` up to `max` entries of a key-set table whose keys lie in `range`,
    /// smallest first.
    fn set_scan(
        &mut self,
        table: SetTable,
        range: (Bound<&[u8]>, Bound<&[u8]>),
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        let _ = (table, range, max, out);
        Ok(())
    }
}

/// The key set's tables (see [`crate::keyset`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTable {
    /// The chunks of format 4.
    Chunks,
    /// One entry per key (`16 id bytes ++ namespace` → version byte ++ expiry): in format 3 the
    /// whole set (emptied by the migration to chunks); in format 4 the ids of the chunks
    /// spilled out of the writer's memory.
    Index,
}

/// What an engine without a key set answers (the comparison engines of the benchmarks).
fn no_key_set() -> EngineError {
    EngineError::Other("this engine keeps no key set".into())
}

/// A read-only view of the entries exactly as the last durable commit left them: callers read it
/// without the writer's queue, so answers that change nothing (duplicates, gets) need no commit.
pub trait DurableView: Send + Sync {
    /// Copies the value stored under `id` into `out`; false when there is none.
    fn get(&self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError>;
}

/// What the writer asks a [`Txn`] body to return: whether to commit.
pub type TxnBody<'a> = dyn FnMut(&mut dyn Txn) -> Result<bool, EngineError> + 'a;

/// A storage engine driven by one writer thread.
pub trait Engine: Send + 'static {
    /// Runs `body` in one write transaction. When it returns `Ok(true)` the transaction commits
    /// and this returns only once the commit is on stable storage (fsync'd); `Ok(false)` aborts.
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError>;
    /// What the engine is, for logs.
    fn describe(&self) -> String;
    /// A view of everything committed so far. The writer takes one after each durable commit
    /// (before it answers) and never while a failed engine awaits reopening; `None` when the
    /// engine cannot offer one, and every op then goes through the writer.
    fn durable_view(&self) -> Option<std::sync::Arc<dyn DurableView>> {
        None
    }
    /// Called once at a clean shutdown (never after a failed write): lets the engine leave its
    /// files in the state that reopens fastest. Everything acknowledged is already durable.
    fn close(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Called after the reopen that follows a failed write or sync, before anything is answered:
    /// makes what the engine recovered durable in files written after the failure. Linux may
    /// drop the pages an fsync failed to write while reporting later fsyncs as successful
    /// ("fsyncgate"), so a journal appended to after the failure can hold a hole that ends its
    /// replay early and takes later acknowledged commits with it.
    fn checkpoint_after_failure(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// Opens (or reopens after a failure) an engine. Called on the writer thread.
pub type EngineOpener = Box<dyn FnMut() -> Result<Box<dyn Engine>, EngineError> + Send>;

impl From<fjall::Error> for EngineError {
    fn from(e: fjall::Error) -> Self {
        match e {
            fjall::Error::Io(io) | fjall::Error::Storage(lsm_tree::Error::Io(io)) => {
                EngineError::Io(io)
            }
            fjall::Error::Poisoned => EngineError::Other(
                "a previous journal write or fsync failed; the engine must be reopened".into(),
            ),
            fjall::Error::JournalRecovery(r) => {
                EngineError::Corrupt(format!("journal recovery failed: {r:?}"))
            }
            fjall::Error::Decode(d) => EngineError::Corrupt(format!("undecodable data: {d:?}")),
            fjall::Error::Storage(other) => {
                EngineError::Corrupt(format!("unreadable engine files: {other:?}"))
            }
            fjall::Error::InvalidVersion(v) => {
                EngineError::Corrupt(format!("not a readable keyspace (version marker {v:?})"))
            }
            other => EngineError::Other(format!("{other:?}")),
        }
    }
}

/// fjall: a log-structured merge tree. Writes go to an in-memory table and to a journal; the
/// writer persists the journal (flush, then `fdatasync`) once per group commit, so a commit costs
/// one small sequential write however scattered the batch's keys are. Sorted segments are written
/// and compacted in the background.
///
/// Writes use `PartitionHandle::insert`/`remove` with `manual_journal_persist`, not
/// `fjall::Batch`: fjall 2.11's `Batch::commit` ignores the journal write's error, so on a full
/// disk it acknowledged a batch that never reached the journal (our full-disk test caught it).
/// The per-key path returns every write error. A batch is therefore not one atomic unit on disk:
/// a crash mid-batch may keep some of its (unacknowledged) changes, which the writer tolerates by
/// ordering them (a batch's expiry-index records before its entries).
pub struct FjallEngine {
    /// Which ids `entries` may hold (see [`crate::idfilter`]); lent to each transaction. First,
    /// so it is dropped first: dropping it stops and joins a scan still reading the keyspace,
    /// whose file handles fjall closes when the keyspace goes (the scan would then panic on a
    /// block it has to read).
    ids: Option<IdFilter>,
    keyspace: fjall::Keyspace,
    entries: fjall::PartitionHandle,
    expiry: fjall::PartitionHandle,
    meta: fjall::PartitionHandle,
    /// The key set of `dedup --ledger` (see [`crate::keyset`]), in chunks.
    keyset: fjall::PartitionHandle,
    /// The key set's per-key index ([`SetTable::Index`]).
    keyset_index: fjall::PartitionHandle,
    path: PathBuf,
    /// The write transaction's buffered entry puts, kept for the next one.
    puts: PutBuffer,
    /// The entries the last commit put (the last that reached fjall, when it gave them in
    /// parts), sorted: the values fjall holds for those keys until the next change. A
    /// transaction reads them here before fjall, until it changes an entry itself. The writer
    /// reads each key of a batch once, and the keys it just wrote come back soon in the
    /// retriable ledger (a claim, then its completion in the next batch): one binary search of
    /// a few thousand keys instead of a walk down the memtable's skip list.
    last: PutBuffer,
    /// Scratch for a transaction's applied puts (becomes `last` at a commit).
    applied: PutBuffer,
}

/// Bytes of entry puts a transaction buffers before it gives them to fjall (a batch of 8,192
/// claims is about 1.5 MB).
const PUT_BUFFER_BYTES_MAX: usize = 16 << 20;

/// fjall's throttles, which sleep on the thread that writes (ours: the writer, so every caller
/// waits): past 90% of `max_journaling_size` an insert that seals a memtable sleeps 500 ms, and
/// past 90% of `max_write_buffer_size` an insert sleeps 100 ms (10 ms at a time above it). A
/// sealed journal counts its 32 MiB preallocation and stays until every partition written in it
/// has flushed (the small expiry and meta memtables too), so at the old 64 MiB two sealed
/// journals crossed the line: a load of new keys slept ~25% of the writer's time (`perf sched`:
/// 500 ms and 100 ms sleeps) and a batch's p99 was ~0.7 s. These (fjall's defaults are 512 and
/// 64 MiB) leave room for the active memtables, the sealed ones being flushed and more before
/// throttling, which still comes when the flushes fall behind for good. The price:
/// a crash with that much unflushed replays it at the next open (a clean close flushes
/// everything first; see `docs/embedded-engine.md`).
const JOURNALING_BYTES_MAX: u64 = 192 << 20;
/// Memtable bytes (active and sealed, every partition) before fjall throttles; see above.
const WRITE_BUFFER_BYTES_MAX: u64 = 128 << 20;

/// The engine's block cache unless [`crate::EmbeddedOptions::cache_bytes`] says otherwise.
pub const CACHE_BYTES_DEFAULT: u64 = 64 << 20;

impl FjallEngine {
    /// Opens the keyspace in directory `path`, creating it when it does not exist and replaying
    /// its journal after a crash, with the default block cache.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        Self::open_with_cache(path, CACHE_BYTES_DEFAULT)
    }

    fn set_table(&self, table: SetTable) -> &fjall::PartitionHandle {
        match table {
            SetTable::Chunks => &self.keyset,
            SetTable::Index => &self.keyset_index,
        }
    }

    /// Every partition, for what touches them all (memtable rotation, flush waits).
    fn partitions(&self) -> [&fjall::PartitionHandle; 5] {
        [
            &self.entries,
            &self.expiry,
            &self.meta,
            &self.keyset,
            &self.keyset_index,
        ]
    }

    /// [`FjallEngine::open`] with `cache_bytes` of block cache.
    pub fn open_with_cache(path: &Path, cache_bytes: u64) -> Result<Self, EngineError> {
        let keyspace = fjall::Config::new(path)
            // Journals are replayed on open after a crash; see the constants for the bounds.
            .max_journaling_size(JOURNALING_BYTES_MAX)
            .max_write_buffer_size(WRITE_BUFFER_BYTES_MAX)
            .cache_size(cache_bytes)
            // Durability comes from the writer's persist at each commit, and nothing is synced
            // on a timer.
            .manual_journal_persist(true)
            .fsync_ms(None)
            .open()?;
        // No block compression: entries hold random tokens and barely compress, and lz4 cost
        // the background flusher about a tenth of a claim's CPU on a 2-core machine.
        //
        // `manual_journal_persist` here too: without it a partition hands every insert to the
        // operating system (one `write` system call per entry, ~15% of the writer's CPU in a
        // `dedup --ledger` run); with it the journal's 8 KiB buffer fills first, and the writer's
        // persist at each commit writes the rest. Nothing acknowledged changes: an answer is
        // sent only after that persist's fdatasync. A partition keeps the options it was created
        // with, so a store made before this setting keeps a system call per entry.
        let opts = || {
            fjall::PartitionCreateOptions::default()
                .compression(lsm_tree::CompressionType::None)
                .manual_journal_persist(true)
        };
        let entries = keyspace.open_partition("entries", opts())?;
        let expiry = keyspace.open_partition("expiry", opts())?;
        let meta = keyspace.open_partition("meta", opts())?;
        let keyset = keyspace.open_partition("keyset_chunks", opts())?;
        let keyset_index = keyspace.open_partition("keyset", opts())?;
        Ok(Self {
            keyspace,
            entries,
            expiry,
            meta,
            keyset,
            keyset_index,
            path: path.to_owned(),
            puts: PutBuffer::default(),
            last: PutBuffer::default(),
            applied: PutBuffer::default(),
            ids: Some(IdFilter::new()),
        })
    }
}

/// Meta key counting checkpoints after failures (see `checkpoint_after_failure`).
const META_CHECKPOINTS: &str = "checkpoints_after_failure";

/// Fsyncs `dir` and every directory under it, so every entry in them is durable.
fn sync_dirs(dir: &Path) -> Result<(), EngineError> {
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            }
        }
        std::fs::File::open(&d)?.sync_all()?;
    }
    Ok(())
}

/// Longest a checkpoint after a failure waits for fjall to flush; the writer retries after it.
const CHECKPOINT_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(30);
/// Longest it waits while the flush makes no visible progress.
const CHECKPOINT_STALL_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Longest a clean close waits for fjall to flush its memtables.
const CLOSE_FLUSH_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

struct FjallTxn<'e> {
    engine: &'e FjallEngine,
    wrote: bool,
    /// Entry puts not yet given to fjall, applied in key order (see [`FjallTxn::flush`]).
    puts: &'e mut PutBuffer,
    /// The entries the last commit put, as it left them (see [`FjallEngine::last`]).
    last: &'e PutBuffer,
    /// The puts this transaction gave fjall last (sorted).
    applied: &'e mut PutBuffer,
    /// Set once this transaction changed an entry in fjall: `last` may no longer be current.
    entries_changed: bool,
    /// Which ids `entries` may hold: told of every put before fjall is.
    ids: &'e mut IdFilter,
}

/// Entry puts of one transaction: `(start, key length, value length)` spans into `bytes`, each
/// a key then its value. Kept from one transaction to the next (no allocation per put once
/// warm).
#[derive(Default)]
struct PutBuffer {
    bytes: Vec<u8>,
    spans: Vec<(u32, u32, u32)>,
}

impl PutBuffer {
    fn key(&self, &(at, key_len, _): &(u32, u32, u32)) -> &[u8] {
        &self.bytes[at as usize..at as usize + key_len as usize]
    }

    fn value(&self, &(at, key_len, value_len): &(u32, u32, u32)) -> &[u8] {
        let at = at as usize + key_len as usize;
        &self.bytes[at..at + value_len as usize]
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.spans.clear();
    }

    /// Sorts the spans by key; puts of one key keep their order (the last is the latest).
    fn sort(&mut self) {
        let mut spans = std::mem::take(&mut self.spans);
        spans.sort_by(|a, b| self.key(a).cmp(self.key(b)));
        self.spans = spans;
    }

    /// The latest value put under `key`, in a sorted buffer.
    fn find(&self, key: &[u8]) -> Option<&[u8]> {
        let after = self.spans.partition_point(|s| self.key(s) <= key);
        let span = self.spans[..after].last()?;
        (self.key(span) == key).then(|| self.value(span))
    }
}

impl FjallTxn<'_> {
    /// Gives the buffered entry puts to fjall, sorted by key; they become `applied`, and the
    /// buffer is empty again. A commit's puts come one after another (every read and every
    /// other write of the transaction applies them first), so sorting them changes no order that
    /// anything relies on: the journal still holds the batch's expiry-index records before its
    /// entries, and its entries before its meta writes. In key order, consecutive inserts walk
    /// nearly the same path of the memtable's skip list, which is then mostly in the CPU cache:
    /// in random order they missed it at almost every level.
    fn flush(&mut self) -> Result<(), EngineError> {
        if self.puts.spans.is_empty() {
            return Ok(());
        }
        self.entries_changed = true;
        self.puts.sort();
        let puts = &*self.puts;
        for span in &puts.spans {
            self.engine
                .entries
                .insert(puts.key(span), puts.value(span))?;
        }
        std::mem::swap(self.puts, self.applied);
        self.puts.clear();
        Ok(())
    }
}

impl Txn for FjallTxn<'_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        self.flush()?;
        if !self.ids.may_hold(id) {
            return Ok(false);
        }
        if !self.entries_changed {
            if let Some(v) = self.last.find(id) {
                out.clear();
                out.extend_from_slice(v);
                return Ok(true);
            }
        }
        Ok(copy_found(self.engine.entries.get(id)?, out))
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.ids.add(id);
        let buf = &mut *self.puts;
        let too_long = || EngineError::Other("an entry longer than 4 GiB".into());
        let at = u32::try_from(buf.bytes.len()).map_err(|_| too_long())?;
        let key_len = u32::try_from(id.len()).map_err(|_| too_long())?;
        let value_len = u32::try_from(value.len()).map_err(|_| too_long())?;
        buf.bytes.extend_from_slice(id);
        buf.bytes.extend_from_slice(value);
        buf.spans.push((at, key_len, value_len));
        if buf.bytes.len() > PUT_BUFFER_BYTES_MAX {
            self.flush()?;
        }
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.flush()?;
        // The puts applied so far may include this key: none of them may become `last`.
        self.applied.clear();
        self.entries_changed = true;
        self.ids.removed();
        self.engine.entries.remove(id)?;
        Ok(())
    }

    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.flush()?;
        self.engine.expiry.insert(key, record)?;
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.flush()?;
        self.engine.expiry.remove(key)?;
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        self.flush()?;
        push_range(self.engine.expiry.range(..bound), max, out)
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        self.flush()?;
        match self.engine.meta.get(name)? {
            Some(v) => {
                let bytes: [u8; 8] = v.as_ref().try_into().map_err(|_| {
                    EngineError::Corrupt(format!("meta {name} holds {} bytes, not 8", v.len()))
                })?;
                Ok(Some(u64::from_le_bytes(bytes)))
            }
            None => Ok(None),
        }
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        self.wrote = true;
        self.flush()?;
        self.engine.meta.insert(name, value.to_le_bytes())?;
        Ok(())
    }

    fn is_empty(&mut self) -> Result<bool, EngineError> {
        self.flush()?;
        Ok(self.engine.entries.is_empty()?
            && self.engine.keyset.is_empty()?
            && self.engine.keyset_index.is_empty()?)
    }

    fn set_put(&mut self, table: SetTable, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.engine.set_table(table).insert(key, value)?;
        Ok(())
    }

    fn set_get(
        &mut self,
        table: SetTable,
        key: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, EngineError> {
        Ok(copy_found(self.engine.set_table(table).get(key)?, out))
    }

    fn set_remove(&mut self, table: SetTable, key: &[u8]) -> Result<(), EngineError> {
        self.wrote = true;
        self.engine.set_table(table).remove(key)?;
        Ok(())
    }

    fn set_scan(
        &mut self,
        table: SetTable,
        range: (Bound<&[u8]>, Bound<&[u8]>),
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        push_range(
            self.engine.set_table(table).range::<&[u8], _>(range),
            max,
            out,
        )
    }
}

/// Appends the first `max` (key, value) pairs of a range scan to `out`.
fn push_range(
    range: impl Iterator<Item = fjall::Result<(fjall::Slice, fjall::Slice)>>,
    max: usize,
    out: &mut Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<(), EngineError> {
    for item in range.take(max) {
        let (k, v) = item?;
        out.push((k.to_vec(), v.to_vec()));
    }
    Ok(())
}

/// Copies a value the engine found into `out`; false when there was none.
fn copy_found(found: Option<fjall::Slice>, out: &mut Vec<u8>) -> bool {
    match found {
        Some(v) => {
            out.clear();
            out.extend_from_slice(&v);
            true
        }
        None => false,
    }
}

/// Every key of a snapshot of `entries`, for the id filter's scan (which owns the snapshot, so
/// the versions it reads stay).
fn scan_ids(snapshot: fjall::Snapshot) -> IdScan {
    Box::new(move |each| {
        for key in snapshot.keys() {
            let key = key.map_err(|e| EngineError::from(fjall::Error::from(e)).to_string())?;
            if !each(&key) {
                break;
            }
        }
        Ok(())
    })
}

struct FjallView(fjall::Snapshot);

impl DurableView for FjallView {
    fn get(&self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        Ok(copy_found(self.0.get(id).map_err(fjall::Error::from)?, out))
    }
}

impl Engine for FjallEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let mut ids = self.ids.take().expect("lent to one transaction at a time");
        // Between transactions, so a scan's snapshot holds every put made before it.
        ids.maintain(
            || self.entries.approximate_len() as u64,
            || Ok(scan_ids(self.entries.snapshot_at(self.keyspace.instant()))),
        );
        let mut puts = std::mem::take(&mut self.puts);
        let mut applied = std::mem::take(&mut self.applied);
        let last = std::mem::take(&mut self.last);
        let mut txn = FjallTxn {
            engine: self,
            wrote: false,
            puts: &mut puts,
            last: &last,
            applied: &mut applied,
            entries_changed: false,
            ids: &mut ids,
        };
        let commit = body(&mut txn);
        // An aborted transaction writes nothing more (what it wrote before is not committed:
        // the writer fails closed or never wrote, see `Engine::write`).
        let flushed = match &commit {
            Ok(true) => txn.flush(),
            _ => Ok(()),
        };
        let (wrote, entries_changed) = (txn.wrote, txn.entries_changed);
        // `last` stays current only while nothing changes an entry; after a commit, the puts
        // it gave fjall last are the latest of their keys.
        (self.last, self.applied) = match (&commit, &flushed) {
            (Ok(true), Ok(())) if entries_changed => (applied, last),
            _ if entries_changed => (PutBuffer::default(), applied),
            _ => (last, applied),
        };
        self.applied.clear();
        puts.clear();
        self.puts = puts;
        self.ids = Some(ids);
        let commit = commit?;
        flushed?;
        if commit && wrote {
            // The durability point: flush the journal buffer, then fdatasync. A failure poisons
            // the keyspace; the writer fails closed and reopens it.
            self.keyspace.persist(fjall::PersistMode::SyncData)?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("fjall {}", self.path.display())
    }

    /// Seals every memtable (a new journal takes the next writes), waits until they are flushed
    /// into sorted segments and the journals written before are released, then syncs. Found by
    /// dedupgate-torture's `failed-io --then-power-loss`: without it, 629 acknowledged keys of
    /// one run were gone after a power loss that dropped what a failed fsync had not written.
    fn checkpoint_after_failure(&mut self) -> Result<(), EngineError> {
        use lsm_tree::AbstractTree;
        // One write, so there is a memtable to seal even when everything was flushed: sealing
        // it starts a new journal, and nothing written to the old one (its header included)
        // is relied upon any more.
        let n = match self.meta.get(META_CHECKPOINTS)? {
            Some(v) => v.as_ref().try_into().map(u64::from_le_bytes).unwrap_or(0),
            None => 0,
        };
        self.meta.insert(META_CHECKPOINTS, (n + 1).to_le_bytes())?;
        let partitions = self.partitions();
        for partition in partitions {
            partition.rotate_memtable()?;
        }
        let started = std::time::Instant::now();
        let pending = || {
            (
                partitions
                    .iter()
                    .map(|p| p.tree.sealed_memtable_count())
                    .sum::<usize>(),
                self.keyspace.journal_count(),
            )
        };
        let (mut last, mut last_change) = (pending(), started);
        while !(last.0 == 0 && last.1 <= 1) {
            // A flush that stopped moving (seen after a poisoned keyspace was dropped) is given
            // up soon; the writer reopens and tries again.
            if last_change.elapsed() >= CHECKPOINT_STALL_MAX
                || started.elapsed() >= CHECKPOINT_WAIT_MAX
            {
                return Err(EngineError::Other(format!(
                    "the journals written before the failure were not flushed (waited {:?})",
                    started.elapsed()
                )));
            }
            // A failed flush poisons the keyspace (and stops its flusher): give up at once.
            self.keyspace.persist(fjall::PersistMode::Buffer)?;
            std::thread::sleep(std::time::Duration::from_millis(5));
            let now = pending();
            if now != last {
                (last, last_change) = (now, std::time::Instant::now());
            }
        }
        self.keyspace.persist(fjall::PersistMode::SyncAll)?;
        // A directory fsync that failed before is not retried by fjall: the active journal
        // (created then) would have no durable entry, and a power loss would take it and every
        // commit in it. Sync every directory of the keyspace once more.
        sync_dirs(&self.path)?;
        Ok(())
    }

    fn durable_view(&self) -> Option<std::sync::Arc<dyn DurableView>> {
        // The writer is the only writer, so the keyspace's visible instant is exactly "after
        // the last commit": the snapshot sees that commit and nothing later.
        let at = self.keyspace.instant();
        Some(std::sync::Arc::new(FjallView(self.entries.snapshot_at(at))))
    }

    /// Flushes every memtable into sorted segments, so the journals they came from are freed
    /// and the next open replays (almost) nothing: replaying ~20 MB of journal for 100k entries
    /// took ~0.7 s of every start-up. Only a clean close does this: after a failed write the
    /// memtables may hold changes that never reached the journal, and those must not be made
    /// durable behind the writer's back.
    ///
    /// The wait is bounded: fjall's own `rotate_memtable_and_wait` once waited forever here (a
    /// queued flush its idle flusher never picked up). Giving up loses nothing (the journal holds
    /// every change); the next open is merely slower.
    fn close(&mut self) -> Result<(), EngineError> {
        use lsm_tree::AbstractTree;
        let partitions = self.partitions();
        for partition in partitions {
            partition.rotate_memtable()?;
        }
        let deadline = std::time::Instant::now() + CLOSE_FLUSH_WAIT_MAX;
        loop {
            let flushed = partitions
                .iter()
                .all(|p| p.tree.sealed_memtable_count() == 0)
                && self.keyspace.journal_count() <= 1;
            if flushed {
                break;
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(
                    "fjall did not finish flushing within {CLOSE_FLUSH_WAIT_MAX:?} at close; \
                     the next open will replay the journal"
                );
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        self.keyspace.persist(fjall::PersistMode::SyncAll)?;
        Ok(())
    }
}
