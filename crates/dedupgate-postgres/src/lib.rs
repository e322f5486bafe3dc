//! # dedupgate-postgres
//!
//! The PostgreSQL store of dedupgate (`--store postgres://…`):
//!
//! - [`PgStore`]: the [`dedupgate_core::Store`] trait over a pool of tokio-postgres connections.
//!   Each operation is one call of one PL/pgSQL function created by the schema migration; the
//!   function re-expresses [`dedupgate_core::decide`] for that operation, deciding under the row
//!   lock (`SELECT … FOR UPDATE`, or `INSERT … ON CONFLICT DO NOTHING` for a new key) on the
//!   database's clock (`clock_timestamp()`) read after that lock is held, never before a wait.
//!   A batch is one call of one function: one round trip, one transaction, one commit, ops
//!   decided in order.
//! - [`PgStore::apply_in`], [`PgStore::claim_in`], [`PgStore::mark_in`]: the transactional API —
//!   decide inside the caller's own transaction so a business write and its dedup record commit
//!   or roll back together.
//! - [`PgOptions`] and the `dedupgate_*` URL parameters: schema, pool size, timeouts, and the
//!   explicit override needed to run on a server with `synchronous_commit=off`.
//! - [`SCHEMA_VERSION`]: the versioned schema, migrated at open under an advisory lock; a newer
//!   schema is refused with [`PgError::SchemaTooNew`]. The functions are re-created at open when
//!   the md5 of their text differs from the one recorded in the schema.
//! - `testkit` (feature): an owned PostgreSQL server (initdb, pg_ctl, `kill -9`, restart) for
//!   tests and torture runs.
//!
//! Keys, namespaces, fingerprints, owners and tokens are stored as `bytea`, so any UTF-8 (NUL
//! included) comes back exactly; results are stored as their JSON text, never `jsonb`, so numbers
//! and key order come back as they were given. See `docs/postgres.md`.

mod error;
mod options;
mod schema;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use error::PgError;
pub use options::{
    parse_url, PgOptions, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_OP_TIMEOUT_MS, DEFAULT_POOL_SIZE,
    DEFAULT_SCHEMA,
};
pub use schema::SCHEMA_VERSION;
pub use store::{open_store, PgStore};

/// The tokio-postgres this crate is built with, for the transactional API's callers.
pub use tokio_postgres;
