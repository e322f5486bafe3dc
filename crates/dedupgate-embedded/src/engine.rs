//! The seam between the group-commit writer and the storage engine.
//!
//! The writer needs very little from an engine: one write transaction at a time in which it can
//! read and write entries by id, keep an ordered expiry index, keep a few named numbers, and
//! commit durably (fsync'd) or abort. [`Engine`] and [`Txn`] say exactly that, so the engine
//! comparison in `benches/claims.rs` runs SQLite and redb under the very same writer. The store
//! ships with [`RedbEngine`] (see `docs/embedded-engine.md` for why).

use std::path::{Path, PathBuf};

use redb::{
    Database, Durability, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};

/// Entries by id (see [`crate::codec`] for both encodings).
pub const ENTRIES_TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
/// The expiry index: `u64 big-endian expires_at_ms ++ id`, no value.
pub const EXPIRY_TABLE: TableDefinition<&[u8], ()> = TableDefinition::new("expiry");
/// Named numbers: the format version and the clock's high-water mark.
pub const META_TABLE: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// Why an engine call failed. Any of these inside a write makes the store fail closed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The operating system refused a read, write or sync.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The engine found data it cannot read.
    #[error("engine data is corrupt: {0}")]
    Corrupt(String),
    /// Anything else the engine reported.
    #[error("{0}")]
    Other(String),
}

impl From<redb::Error> for EngineError {
    fn from(e: redb::Error) -> Self {
        match e {
            redb::Error::Io(io) => EngineError::Io(io),
            redb::Error::Corrupted(s) => EngineError::Corrupt(s),
            redb::Error::PreviousIo => {
                EngineError::Other("a previous I/O error left the database needing repair".into())
            }
            other => EngineError::Other(other.to_string()),
        }
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for EngineError {
            fn from(e: $t) -> Self {
                redb::Error::from(e).into()
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// One write transaction, as the writer sees it.
pub trait Txn {
    /// Copies the value stored under `id` into `out`; false when there is none.
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError>;
    /// Stores `value` under `id`, replacing any.
    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError>;
    /// Removes the value under `id`, if any.
    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError>;
    /// Adds a key to the expiry index.
    fn index_insert(&mut self, key: &[u8]) -> Result<(), EngineError>;
    /// Removes a key from the expiry index, if present.
    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError>;
    /// Appends to `out` up to `max` index keys that sort before `bound`, smallest first.
    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), EngineError>;
    /// Reads a named number.
    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError>;
    /// Writes a named number.
    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError>;
    /// How many entries are stored.
    fn count(&mut self) -> Result<u64, EngineError>;
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
}

/// Opens (or reopens after a failure) an engine. Called on the writer thread.
pub type EngineOpener = Box<dyn FnMut() -> Result<Box<dyn Engine>, EngineError> + Send>;

/// redb: a copy-on-write B-tree in one file; each commit with [`Durability::Immediate`] is made
/// durable with one fsync (a checksummed commit slot, then a header flip).
pub struct RedbEngine {
    db: Database,
    path: PathBuf,
}

impl RedbEngine {
    /// Opens the database file at `path`, creating it when it does not exist. An existing file
    /// that is not a redb database is refused, never overwritten.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let mut builder = Database::builder();
        // The working set of a gate is its live keys; 256 MiB of page cache keeps lookups off
        // the disk for tens of millions of small entries without claiming the machine's memory.
        builder.set_cache_size(256 << 20);
        let db = if path.exists() {
            builder.open(path)?
        } else {
            builder.create(path)?
        };
        Ok(Self {
            db,
            path: path.to_owned(),
        })
    }
}

struct RedbTxn<'t> {
    entries: redb::Table<'t, &'static [u8], &'static [u8]>,
    expiry: redb::Table<'t, &'static [u8], ()>,
    meta: redb::Table<'t, &'static str, u64>,
}

impl Txn for RedbTxn<'_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        match self.entries.get(id)? {
            Some(v) => {
                out.clear();
                out.extend_from_slice(v.value());
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.entries.insert(id, value)?;
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.entries.remove(id)?;
        Ok(())
    }

    fn index_insert(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.expiry.insert(key, ())?;
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.expiry.remove(key)?;
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), EngineError> {
        for item in self.expiry.range::<&[u8]>(..bound)?.take(max) {
            let (k, _) = item?;
            out.push(k.value().to_vec());
        }
        Ok(())
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        Ok(self.meta.get(name)?.map(|v| v.value()))
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        self.meta.insert(name, value)?;
        Ok(())
    }

    fn count(&mut self) -> Result<u64, EngineError> {
        Ok(self.entries.len()?)
    }
}

fn open_tables(txn: &WriteTransaction) -> Result<RedbTxn<'_>, EngineError> {
    Ok(RedbTxn {
        entries: txn.open_table(ENTRIES_TABLE)?,
        expiry: txn.open_table(EXPIRY_TABLE)?,
        meta: txn.open_table(META_TABLE)?,
    })
}

impl Engine for RedbEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate);
        let commit = {
            let mut tables = open_tables(&txn)?;
            body(&mut tables)?
        };
        if commit {
            txn.commit()?;
        } else {
            txn.abort()?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("redb {}", self.path.display())
    }
}
