//! [`WalRedbEngine`]: redb behind a write-ahead log of our own (a candidate engine, measured in
//! the comparison; not the one shipped, see `docs/embedded-engine.md`).
//!
//! Why: a redb commit with `Durability::Immediate` writes every B-tree page the batch dirtied and
//! fsyncs them, so 64 scattered keys cost ~64 random page writes per fsync. Here a commit is
//!
//! 1. stage the batch in a redb write transaction (reads see it; nothing is on disk yet);
//! 2. append the batch's changes to the log as one checksummed record, then `fdatasync` the log
//!    (one small sequential write: the only I/O a caller waits for);
//! 3. commit the redb transaction with `Durability::None` (memory only).
//!
//! A checkpoint (a `Durability::Immediate` commit, then truncating the log) runs when the log
//! passes [`CHECKPOINT_LOG_BYTES`] or [`CHECKPOINT_INTERVAL`] has passed. Opening replays the
//! log's valid prefix onto the last checkpoint and checkpoints at once. Replay is idempotent:
//! records hold whole values and removals, applied in order.
//!
//! Log record: `u32 LE payload length, u32 LE crc32 of the payload, payload`; the payload is a
//! sequence of `u8 table, u8 kind (1 put, 2 remove), u32 LE key length, key, [u32 LE value
//! length, value]`. A torn or corrupt tail (a crash mid-append) ends the valid prefix; it was
//! never acknowledged, and the log is truncated to the prefix before anything is appended.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use redb::{
    Database, Durability, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};

use dedupgate_embedded::engine::{Engine, EngineError, Txn, TxnBody};

/// Entries by id (see [`crate::codec`] for both encodings).
const ENTRIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
/// The expiry index: records as `dedupgate_embedded::codec::expiry_key` describes.
const EXPIRY: TableDefinition<&[u8], &[u8]> = TableDefinition::new("expiry");
/// Named numbers (u64 little-endian): the format version, the clock's high-water mark, counts.
const META: TableDefinition<&[u8], &[u8]> = TableDefinition::new("meta");

/// The database file inside the engine directory.
const DB_FILE: &str = "data.redb";
/// The log file inside the engine directory.
const LOG_FILE: &str = "wal";
/// Log size that triggers a checkpoint: bounds replay time after a crash.
const CHECKPOINT_LOG_BYTES: u64 = 64 << 20;
/// Longest time between checkpoints while writes arrive: bounds redb's unflushed memory.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(60);
/// Largest log record accepted on replay (a batch of 10,000 ops of 1 MiB results is far below).
const RECORD_BYTES_MAX: usize = 1 << 30;

const T_ENTRIES: u8 = 1;
const T_EXPIRY: u8 = 2;
const T_META: u8 = 3;
const K_PUT: u8 = 1;
const K_REMOVE: u8 = 2;

fn redb_err(e: impl Into<redb::Error>) -> EngineError {
    match e.into() {
        redb::Error::Io(io) => EngineError::Io(io),
        redb::Error::Corrupted(s) => EngineError::Corrupt(s),
        redb::Error::PreviousIo => {
            EngineError::Other("a previous I/O error left the database needing repair".into())
        }
        other => EngineError::Other(other.to_string()),
    }
}

/// redb plus a write-ahead log; see the module docs.
pub(crate) struct WalRedbEngine {
    db: Database,
    log: File,
    log_bytes: u64,
    last_checkpoint: Instant,
    record: Vec<u8>,
    dir: PathBuf,
    /// Set by any failed write: the engine is then only dropped, never written through again.
    failed: bool,
}

impl WalRedbEngine {
    /// Opens the engine in directory `dir` (created when missing; its parent must exist),
    /// replays the log onto the database and checkpoints.
    pub(crate) fn open(dir: &Path) -> Result<Self, EngineError> {
        if !dir.exists() {
            std::fs::create_dir(dir)?;
        }
        // Read and check the log before touching the database, so a refused open (a malformed
        // log) changes nothing.
        let log_path = dir.join(LOG_FILE);
        let bytes = match std::fs::read(&log_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let valid_bytes = scan(&bytes, |_, _, _| Ok(()))?;
        let db_path = dir.join(DB_FILE);
        let mut builder = Database::builder();
        // Hot entries stay cached; 256 MiB holds millions of small entries.
        builder.set_cache_size(256 << 20);
        let db = if db_path.exists() {
            builder.open(&db_path).map_err(redb_err)?
        } else {
            builder.create(&db_path).map_err(redb_err)?
        };
        let log = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log_path)?;
        let mut engine = Self {
            db,
            log,
            log_bytes: bytes.len() as u64,
            last_checkpoint: Instant::now(),
            record: Vec::with_capacity(64 << 10),
            dir: dir.to_owned(),
            failed: false,
        };
        if !bytes.is_empty() {
            engine.replay(&bytes[..valid_bytes])?;
            if valid_bytes < bytes.len() {
                tracing::warn!(
                    valid_bytes,
                    log_bytes = bytes.len(),
                    "the write-ahead log ends with a torn record (a crash mid-append); dropping it"
                );
            }
            engine.checkpoint()?;
        }
        Ok(engine)
    }

    /// Applies the (already checked) records of `bytes` to the database, not yet durably.
    fn replay(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        let mut txn = self.db.begin_write().map_err(redb_err)?;
        txn.set_durability(Durability::None);
        {
            let mut t = open_tables(&txn)?;
            scan(bytes, |table, key, value| {
                match (table, value) {
                    (T_ENTRIES, Some(v)) => t.entries.insert(key, v).map(|_| ()),
                    (T_ENTRIES, None) => t.entries.remove(key).map(|_| ()),
                    (T_EXPIRY, Some(v)) => t.expiry.insert(key, v).map(|_| ()),
                    (T_EXPIRY, None) => t.expiry.remove(key).map(|_| ()),
                    (T_META, Some(v)) => t.meta.insert(key, v).map(|_| ()),
                    _ => t.meta.remove(key).map(|_| ()),
                }
                .map_err(redb_err)
            })?;
        }
        txn.commit().map_err(redb_err)?;
        Ok(())
    }

    /// Makes everything committed so far durable in the database, then empties the log.
    fn checkpoint(&mut self) -> Result<(), EngineError> {
        let mut txn = self.db.begin_write().map_err(redb_err)?;
        txn.set_durability(Durability::Immediate);
        txn.commit().map_err(redb_err)?;
        // Only now may the log go: a crash before this line replays it onto the checkpoint,
        // which is harmless (records hold whole values).
        self.log.set_len(0)?;
        self.log.sync_all()?;
        self.log_bytes = 0;
        self.last_checkpoint = Instant::now();
        Ok(())
    }
}

struct Tables<'t> {
    entries: redb::Table<'t, &'static [u8], &'static [u8]>,
    expiry: redb::Table<'t, &'static [u8], &'static [u8]>,
    meta: redb::Table<'t, &'static [u8], &'static [u8]>,
}

fn open_tables(txn: &WriteTransaction) -> Result<Tables<'_>, EngineError> {
    Ok(Tables {
        entries: txn.open_table(ENTRIES).map_err(redb_err)?,
        expiry: txn.open_table(EXPIRY).map_err(redb_err)?,
        meta: txn.open_table(META).map_err(redb_err)?,
    })
}

/// Walks the log's records, calling `f(table, key, value)` for each change (`None`: a removal).
/// Returns the length of the valid prefix: a torn or checksum-failing record ends it. A record
/// whose checksum holds but whose body does not parse was not written by this engine: corrupt.
fn scan(
    bytes: &[u8],
    mut f: impl FnMut(u8, &[u8], Option<&[u8]>) -> Result<(), EngineError>,
) -> Result<usize, EngineError> {
    let mut at = 0usize;
    while bytes.len() - at >= 8 {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
        if len > RECORD_BYTES_MAX || bytes.len() - at - 8 < len {
            break;
        }
        let payload = &bytes[at + 8..at + 8 + len];
        if crc32fast::hash(payload) != crc {
            break;
        }
        let malformed =
            || EngineError::Corrupt(format!("write-ahead log record at byte {at} is malformed"));
        let mut p = payload;
        while !p.is_empty() {
            let (table, kind) = match take(&mut p, 2) {
                Some(h) => (h[0], h[1]),
                None => return Err(malformed()),
            };
            let key = take_len(&mut p).ok_or_else(malformed)?;
            let value = match kind {
                K_PUT => Some(take_len(&mut p).ok_or_else(malformed)?),
                K_REMOVE => None,
                _ => return Err(malformed()),
            };
            if !matches!(table, T_ENTRIES | T_EXPIRY | T_META) {
                return Err(malformed());
            }
            f(table, key, value)?;
        }
        at += 8 + len;
    }
    Ok(at)
}

fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if p.len() < n {
        return None;
    }
    let (h, rest) = p.split_at(n);
    *p = rest;
    Some(h)
}

fn take_len<'a>(p: &mut &'a [u8]) -> Option<&'a [u8]> {
    let n = u32::from_le_bytes(take(p, 4)?.try_into().ok()?) as usize;
    take(p, n)
}

struct WalTxn<'t, 'r> {
    tables: Tables<'t>,
    record: &'r mut Vec<u8>,
}

impl WalTxn<'_, '_> {
    fn log(&mut self, table: u8, kind: u8, key: &[u8], value: Option<&[u8]>) {
        self.record.extend_from_slice(&[table, kind]);
        self.record
            .extend_from_slice(&(key.len() as u32).to_le_bytes());
        self.record.extend_from_slice(key);
        if let Some(v) = value {
            self.record
                .extend_from_slice(&(v.len() as u32).to_le_bytes());
            self.record.extend_from_slice(v);
        }
    }
}

impl Txn for WalTxn<'_, '_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        match self.tables.entries.get(id).map_err(redb_err)? {
            Some(v) => {
                out.clear();
                out.extend_from_slice(v.value());
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.tables.entries.insert(id, value).map_err(redb_err)?;
        self.log(T_ENTRIES, K_PUT, id, Some(value));
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.tables.entries.remove(id).map_err(redb_err)?;
        self.log(T_ENTRIES, K_REMOVE, id, None);
        Ok(())
    }

    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError> {
        self.tables.expiry.insert(key, record).map_err(redb_err)?;
        self.log(T_EXPIRY, K_PUT, key, Some(record));
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.tables.expiry.remove(key).map_err(redb_err)?;
        self.log(T_EXPIRY, K_REMOVE, key, None);
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        let range = self
            .tables
            .expiry
            .range::<&[u8]>(..bound)
            .map_err(redb_err)?;
        for item in range.take(max) {
            let (k, v) = item.map_err(redb_err)?;
            out.push((k.value().to_vec(), v.value().to_vec()));
        }
        Ok(())
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        match self.tables.meta.get(name.as_bytes()).map_err(redb_err)? {
            Some(v) => {
                let bytes: [u8; 8] = v.value().try_into().map_err(|_| {
                    EngineError::Corrupt(format!("meta {name} is not an 8-byte number"))
                })?;
                Ok(Some(u64::from_le_bytes(bytes)))
            }
            None => Ok(None),
        }
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        let v = value.to_le_bytes();
        self.tables
            .meta
            .insert(name.as_bytes(), &v[..])
            .map_err(redb_err)?;
        self.log(T_META, K_PUT, name.as_bytes(), Some(&v));
        Ok(())
    }

    fn is_empty(&mut self) -> Result<bool, EngineError> {
        self.tables.entries.is_empty().map_err(redb_err)
    }
}

impl Drop for WalRedbEngine {
    fn drop(&mut self) {
        // A clean close leaves an empty log. Not after a failure: the engine is being dropped
        // because writing failed, so nothing more is written through it; the log replays on
        // the next open instead.
        if self.log_bytes > 0 && !self.failed {
            if let Err(e) = self.checkpoint() {
                tracing::warn!(error = %e, "checkpoint at close failed; the log will replay on open");
            }
        }
    }
}

impl Engine for WalRedbEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let result = self.write_inner(body);
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    fn describe(&self) -> String {
        format!("redb+wal {}", self.dir.display())
    }
}

impl WalRedbEngine {
    fn write_inner(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let mut txn = self.db.begin_write().map_err(redb_err)?;
        txn.set_durability(Durability::None);
        self.record.clear();
        self.record.extend_from_slice(&[0; 8]);
        let commit = {
            let mut t = WalTxn {
                tables: open_tables(&txn)?,
                record: &mut self.record,
            };
            body(&mut t)?
        };
        if !commit {
            txn.abort().map_err(redb_err)?;
            return Ok(());
        }
        let payload_len = self.record.len() - 8;
        if payload_len > 0 {
            let crc = crc32fast::hash(&self.record[8..]);
            self.record[..4].copy_from_slice(&(payload_len as u32).to_le_bytes());
            self.record[4..8].copy_from_slice(&crc.to_le_bytes());
            // The one write and the one sync a caller waits for. Any failure here fails the
            // store closed: the engine is dropped and reopened from disk, never retried.
            self.log.write_all(&self.record)?;
            self.log.sync_data()?;
            self.log_bytes += self.record.len() as u64;
        }
        // Durable through the log; the database catches up at the next checkpoint.
        txn.commit().map_err(redb_err)?;
        if self.log_bytes >= CHECKPOINT_LOG_BYTES
            || (self.log_bytes > 0 && self.last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL)
        {
            self.checkpoint()?;
        }
        Ok(())
    }
}
