//! The seam between the group-commit writer and the storage engine.
//!
//! The writer needs very little from an engine: one write transaction at a time in which it can
//! read and write entries by id, keep an ordered expiry index, keep a few named numbers, and
//! commit durably (fsync'd) or abort. [`Engine`] and [`Txn`] say exactly that, so the engine
//! comparison in `benches/claims.rs` runs redb, SQLite and fjall under the very same writer. The
//! store ships with [`crate::wal::WalRedbEngine`] (see `docs/embedded-engine.md` for why).

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
    /// True when no entry is stored (checked only when a store has no format version).
    fn is_empty(&mut self) -> Result<bool, EngineError>;
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
