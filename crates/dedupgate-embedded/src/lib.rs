//! # dedupgate-embedded
//!
//! The embedded durable store, dedupgate's default: no server, data under one directory.
//!
//! - [`EmbeddedStore`]: the [`dedupgate_core::Store`] implementation. [`EmbeddedStore::open`]
//!   locks the directory, opens (or creates) the engine, checks the format version and starts
//!   two threads: the group-commit writer and the background sweeper.
//! - [`EmbeddedOptions`]: queue and batch bounds, the sweep interval and an injectable clock.
//!   Durability is not an option: every acknowledged write has been fsync'd.
//! - [`OpenError`]: why a directory could not be opened (missing parent, locked, read-only, full,
//!   corrupt, unknown format). A failed open changes nothing on disk.
//! - `writer` (private): a single thread drains a bounded queue, decides each op in order with
//!   [`dedupgate_core::decide`], writes the batch in one transaction, fsyncs once, then answers
//!   every waiter. After a failed write or fsync it answers "unavailable" until the engine has
//!   reopened cleanly. At a clean shutdown it lets the engine flush its memtables, so the next
//!   open replays no journal.
//! - [`engine`]: the seam between the writer and the storage engine. [`engine::FjallEngine`]
//!   (an LSM tree: a commit is one journal append and one fdatasync) is the one shipped, chosen
//!   by measurement against redb, redb behind our own log, and SQLite (see
//!   `docs/embedded-engine.md`).
//! - [`codec`]: the versioned entry encoding; corrupt bytes decode to an error, never to "absent".
//! - [`keyset`]: a set of keys with expiry beside the records ([`EmbeddedStore::key_set`]), for
//!   `dedup --ledger`: 16 bytes of a chunk per new key instead of a gate record.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use dedupgate_core::{Claim, ClaimOptions, Gate};
//! use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
//! let dir = std::env::temp_dir().join(format!("dg-doc-{}", std::process::id()));
//! let gate = Gate::new(EmbeddedStore::open(&dir, EmbeddedOptions::default())?);
//! let claim = gate.claim("payments", "evt_1", ClaimOptions::default()).await?;
//! assert!(matches!(claim, Claim::New(_)));
//! # drop(gate);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

pub mod codec;
pub mod engine;
mod error;
mod idfilter;
pub mod keyset;
mod ledger;
mod store;
mod writer;

pub use error::OpenError;
pub use keyset::KeySetCall;
pub use store::{EmbeddedOptions, EmbeddedStore};

/// Format version of the store's layout (tables and encodings). A store of one of
/// [`FORMATS_MIGRATED`] is migrated when opened; any other version is refused with
/// [`OpenError::UnknownFormat`], changing nothing. Version 3 added the key set ([`keyset`]), 4
/// stores it in chunks: a build that knows an older version would ignore the chunks, so it must
/// refuse the store.
pub const FORMAT_VERSION: u64 = 4;
/// The older formats this build migrates at open: 2 (no key set: the migration creates the key
/// set's empty partition) and 3 (one entry per key-set member: rewritten as chunks). Each
/// writes the new version in the engine's meta in the same transaction, then in the format
/// file; a crash during it leaves a store that either version check accepts and the next open
/// finishes migrating.
pub const FORMATS_MIGRATED: [u64; 2] = [2, 3];
/// The engine's directory inside the store directory: the `FORMAT` file and the fjall keyspace.
pub const ENGINE_DIR_NAME: &str = "engine";
/// The file in the engine directory that holds [`FORMAT_VERSION`] as text; read before anything
/// else is opened.
pub const FORMAT_FILE_NAME: &str = "FORMAT";
/// The file whose exclusive lock marks the directory as in use by one process.
pub const LOCK_FILE_NAME: &str = "LOCK";
