//! Errors of opening the PostgreSQL store. Operations answer with [`dedupgate_core::GateError`];
//! a PostgreSQL failure there is always [`StoreError::Unavailable`] ("nothing was decided").

use dedupgate_core::StoreError;

/// Why the store did not open.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// The URL or an option is malformed.
    #[error("postgres store options: {0}")]
    Options(String),
    /// PostgreSQL could not be reached, did not answer in time, was shutting down or not
    /// accepting connections (57P0x), or a start-up statement failed otherwise: worth retrying.
    #[error("postgres unavailable: {0}")]
    Unavailable(String),
    /// PostgreSQL answered and refused the store: authentication failed (SQLSTATE class 28,
    /// e.g. 28P01 a wrong password), the database does not exist (3D000), or the role lacks a
    /// privilege the store needs (class 42, e.g. 42501). Retrying will not help until the URL,
    /// the role or the database changes.
    #[error("postgres refused the store: {0}")]
    Refused(String),
    /// The schema was written by a newer dedupgate; this build must not touch it.
    #[error(
        "postgres schema {schema} is at version {found}, newer than this build's {supported}: \
         upgrade dedupgate (or point it at another schema with dedupgate_schema=)"
    )]
    SchemaTooNew {
        /// The schema name.
        schema: String,
        /// Version recorded in the database.
        found: i32,
        /// Newest version this build knows.
        supported: i32,
    },
    /// The server may lose acknowledged claims in a crash and no override was given.
    #[error(
        "postgres {setting} = {value}: a crash can lose claims the gate already acknowledged \
         (duplicates would get through). Turn it on for dedupgate's role or database, or accept \
         the risk with dedupgate_allow_async_commit=true"
    )]
    UnsafeDurability {
        /// `synchronous_commit` or `fsync`.
        setting: &'static str,
        /// Its value.
        value: String,
    },
}

impl From<PgError> for StoreError {
    fn from(e: PgError) -> Self {
        match e {
            PgError::Unavailable(m) => StoreError::Unavailable(m),
            other => StoreError::Config(other.to_string()),
        }
    }
}

/// A PostgreSQL error as text with its SQLSTATE, for [`StoreError::Unavailable`].
pub(crate) fn describe_pg(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("postgres {}: {}", db.code().code(), db.message()),
        None => format!("postgres: {}", dedupgate_core::error::chain_text(e)),
    }
}

/// True when PostgreSQL refused the store rather than failed to serve it: SQLSTATE class 28
/// (invalid authorization), 3D (invalid catalog name: no such database) or 42 (syntax error or
/// access rule violation, e.g. 42501 insufficient privilege). A connection error, a timeout or
/// a server shutting down (57P0x) carries no such code or another one.
pub(crate) fn is_refusal(e: &tokio_postgres::Error) -> bool {
    e.code()
        .map(|c| c.code())
        .is_some_and(|c| c.starts_with("28") || c.starts_with("3D") || c.starts_with("42"))
}

/// An open-time failure `e`, described as `text`: [`PgError::Refused`] when PostgreSQL refused
/// ([`is_refusal`]), [`PgError::Unavailable`] otherwise.
pub(crate) fn open_error(e: &tokio_postgres::Error, text: String) -> PgError {
    if is_refusal(e) {
        PgError::Refused(text)
    } else {
        PgError::Unavailable(text)
    }
}

/// A connection the pool could not hand out at open: the server's refusal of the login or the
/// database is [`PgError::Refused`]; anything else (no connection, a timeout, a server starting
/// or shutting down) is [`PgError::Unavailable`].
pub(crate) fn open_pool_error(e: deadpool_postgres::PoolError, description: &str) -> PgError {
    match &e {
        deadpool_postgres::PoolError::Backend(pg) => open_error(
            pg,
            format!("postgres connect ({description}): {}", describe_pg(pg)),
        ),
        _ => PgError::Unavailable(format!("postgres connect ({description}): {e}")),
    }
}

/// True for the errors after which PostgreSQL rolled the transaction back and a retry is safe and
/// likely to succeed (serialization failure, deadlock).
pub(crate) fn is_retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    matches!(
        e.code(),
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED
    )
}
