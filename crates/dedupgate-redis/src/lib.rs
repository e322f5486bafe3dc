//! # dedupgate-redis
//!
//! The gate's records in Redis or Redis Cluster.
//!
//! - [`RedisStore`]: the [`dedupgate_core::Store`] over one server (`redis://…`, through a
//!   reconnecting [`redis::aio::ConnectionManager`]) or a cluster (`redis+cluster://h:p,…`).
//!   Every operation is one run of the Lua script [`DECIDE_LUA`], which re-expresses
//!   [`dedupgate_core::decide`] on Redis's own clock (`TIME`, `PXAT`); a batch is one pipeline
//!   of script calls (one per slot on a cluster), and on a single server concurrent single
//!   operations are coalesced into shared script calls. An `apply_batch` with 16 or more
//!   claims and marks first writes the new keys among them with native `SET … NX GET` (the
//!   script's own record bytes, one `TIME` per batch) and sends the keys that exist to the
//!   script.
//! - [`RedisOptions`]: durability (`WAIT` replicas), key prefix and timeouts, read from the URL's
//!   query string.
//! - [`keys`]: the key layout — one key per record, under a hash tag derived from its id.
//! - [`record`]: a stored record's bytes, read back as the core's entry
//!   ([`record::decode_record`]); a new key's record comes from [`dedupgate_core::decide`].
//! - [`OpenError`]: why a store would not open (bad URL, unreachable server or an answer lost
//!   on the way, refused authentication or connection setup, an eviction policy that could
//!   drop records).
//! - `testkit` (feature): start real `redis-server` processes and clusters for tests.
//!
//! Inside, one concern per module: `store` (the struct, opening, each batch's path), `conn`
//! (connections and their rebuilds), `checks` (open-time checks), `cluster` (grouping by slot),
//! `args` (the script's arguments), `script` (script calls in pipelines), `fast_path` (native
//! `SET … NX GET` of new keys) and `reply` (decoding replies).
//!
//! What an acknowledged claim survives (persistence, replication, failover) is in `docs/redis.md`.

mod args;
mod checks;
mod cluster;
mod conn;
mod fast_path;
pub mod keys;
mod options;
pub mod record;
mod reply;
mod script;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use options::{redact, RedisOptions};
pub use store::{RedisStore, DECIDE_LUA};

/// Why a Redis store would not open.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL cannot be used.
    #[error("invalid Redis URL: {0}")]
    Url(String),
    /// A store option in the URL's query string is wrong.
    #[error("Redis store option {name}: {reason}")]
    Option {
        /// The option.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached, or did not answer the connection's setup in time, or
    /// answered that it is busy (loading, cluster down): worth retrying.
    #[error("cannot reach Redis at {url}: {reason}")]
    Connect {
        /// The server (password redacted).
        url: String,
        /// The connection error.
        reason: String,
    },
    /// The server was reached but refused to authenticate the connection: a wrong user or
    /// password (`WRONGPASS`), or none given to a server that requires one (`NOAUTH`). Not
    /// worth retrying until the URL or the server's users change.
    #[error(
        "Redis at {url} refused authentication ({reason}): check the user and password in the \
         store URL (redis://USER:PASSWORD@host:port)"
    )]
    Auth {
        /// The server (password redacted).
        url: String,
        /// The server's or client's refusal.
        reason: String,
    },
    /// The server was reached but refused to set the connection up as the URL asks (a database
    /// index out of range, a client configuration it rejects). Not worth retrying.
    #[error("Redis at {url} refused the store's connection ({reason})")]
    Refused {
        /// The server (password redacted).
        url: String,
        /// The refusal.
        reason: String,
    },
    /// The server was reached but its answer to an open-time check was lost: the connection
    /// dropped, the reply was cut short or unreadable, it timed out, or the server was busy
    /// (loading, cluster down). Nothing is wrong with its configuration as far as is known:
    /// unavailable, worth retrying.
    #[error("Redis at {url} did not answer the open-time check ({reason})")]
    Unavailable {
        /// The server (password redacted).
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The server may evict keys, and an evicted record lets a duplicate through.
    #[error(
        "Redis at {url} has maxmemory-policy {policy}: it may evict dedup records under memory \
         pressure, which lets duplicates through. Set `maxmemory-policy noeviction` (writes then \
         fail as `unavailable` when memory is full) or use a dedicated server"
    )]
    EvictionPolicy {
        /// The server.
        url: String,
        /// Its policy.
        policy: String,
    },
    /// The server refused to tell its eviction policy (e.g. `CONFIG` is disabled or renamed, or
    /// the user may not run it).
    #[error(
        "cannot read maxmemory-policy from Redis at {url} ({reason}). If CONFIG is disabled on \
         purpose and the policy is noeviction, add `assume_noeviction=true` to the store URL's \
         query string"
    )]
    ConfigUnavailable {
        /// The server.
        url: String,
        /// Why it could not be read.
        reason: String,
    },
    /// The server is older than the store needs: `SET … NX GET` came with Redis 7.0, and on an
    /// older server every claim would fail with a syntax error.
    #[error(
        "Redis at {url} is version {version}; the dedupgate Redis store needs Redis 7.0 or later \
         (for SET … NX GET)"
    )]
    Version {
        /// The server.
        url: String,
        /// The version it reported.
        version: String,
    },
}

impl From<OpenError> for dedupgate_core::StoreError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Connect { .. } | OpenError::Unavailable { .. } => {
                Self::Unavailable(e.to_string())
            }
            _ => Self::Config(e.to_string()),
        }
    }
}
