//! The versioned schema: created or migrated when a store opens, one migration per version, in
//! order, inside one transaction that holds an advisory lock, so several gates starting at once
//! migrate exactly once and none sees a half-made schema.
//!
//! The functions (`functions.sql`) are kept apart from the versioned migrations: they hold no
//! data, so in the same transaction they are dropped and created again whenever the md5 of their
//! text differs from the one recorded in `<schema>.dedupgate_schema_functions`. A schema made by
//! a build with other function bodies (an unreleased v1 included) is thereby brought to this
//! build's functions, with its rows untouched.

use tokio_postgres::Client;

use crate::error::{describe_pg, open_error, PgError};
use crate::options::PgOptions;

/// The newest schema version this build knows. A database at a newer version is refused.
pub const SCHEMA_VERSION: i32 = 2;

/// Each version's SQL; `{s}` stands for the quoted schema name.
const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("migrations/v1.sql")),
    (2, include_str!("migrations/v2.sql")),
];

/// Every function, over the objects of the migrations; `{s}` stands for the quoted schema name.
const FUNCTIONS: &str = include_str!("functions.sql");

fn pg(e: tokio_postgres::Error) -> PgError {
    open_error(&e, describe_pg(&e))
}

/// Brings `options.schema` to [`SCHEMA_VERSION`], or refuses a newer one. Returns the version
/// found before migrating (0 for a new schema).
pub(crate) async fn migrate(client: &mut Client, options: &PgOptions) -> Result<i32, PgError> {
    let s = options.quoted_schema();
    let tx = client.transaction().await.map_err(pg)?;
    // Held until commit: a second gate waits here, then finds the schema current.
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1::text, 0))",
        &[&format!("dedupgate.migrate.{}", options.schema)],
    )
    .await
    .map_err(pg)?;
    let exists = tx
        .query_opt(
            "SELECT 1 FROM pg_namespace WHERE nspname = $1::text",
            &[&options.schema],
        )
        .await
        .map_err(pg)?
        .is_some();
    if !exists {
        // Only when missing: CREATE SCHEMA needs a privilege a deployed gate may not have.
        tx.batch_execute(&format!("CREATE SCHEMA {s}"))
            .await
            .map_err(pg)?;
    }
    let versioned = tx
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL",
            &[&format!("{s}.dedupgate_schema_version")],
        )
        .await
        .map_err(pg)?
        .get::<_, bool>(0);
    if !versioned {
        // Only when missing, for the same reason as the schema.
        tx.batch_execute(&format!(
            "CREATE TABLE {s}.dedupgate_schema_version (
                 version    integer PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                 applied_by text NOT NULL DEFAULT current_user)"
        ))
        .await
        .map_err(pg)?;
    }
    let found: i32 = tx
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {s}.dedupgate_schema_version"),
            &[],
        )
        .await
        .map_err(pg)?
        .get(0);
    if found > SCHEMA_VERSION {
        return Err(PgError::SchemaTooNew {
            schema: options.schema.clone(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.batch_execute(&sql.replace("{s}", &s))
            .await
            .map_err(|e| open_error(&e, format!("migration {version}: {}", describe_pg(&e))))?;
        tx.execute(
            &format!("INSERT INTO {s}.dedupgate_schema_version (version) VALUES ($1)"),
            &[version],
        )
        .await
        .map_err(pg)?;
        tracing::info!(schema = %options.schema, version, "dedupgate postgres schema migrated");
    }
    install_functions(&tx, options, &s, found).await?;
    tx.commit().await.map_err(pg)?;
    Ok(found)
}

/// Creates the functions, or re-creates them when the recorded md5 of their text is not this
/// build's (or none is recorded: a schema made before the functions were kept apart).
async fn install_functions(
    tx: &tokio_postgres::Transaction<'_>,
    options: &PgOptions,
    s: &str,
    found: i32,
) -> Result<(), PgError> {
    let table = format!("{s}.dedupgate_schema_functions");
    let recorded = tx
        .query_one("SELECT to_regclass($1::text) IS NOT NULL", &[&table])
        .await
        .map_err(pg)?
        .get::<_, bool>(0);
    if !recorded {
        // Only when missing: a gate role may lack the CREATE privilege.
        tx.batch_execute(&format!(
            "CREATE TABLE {table} (
                 one        boolean PRIMARY KEY DEFAULT true CHECK (one),
                 md5        text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                 applied_by text NOT NULL DEFAULT current_user)"
        ))
        .await
        .map_err(pg)?;
    }
    let row = tx
        .query_one(
            &format!("SELECT md5($1::text), (SELECT md5 FROM {table})"),
            &[&FUNCTIONS],
        )
        .await
        .map_err(pg)?;
    let wanted: String = row.get(0);
    let stored: Option<String> = row.get(1);
    if stored.as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    let old = tx
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p
             JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = $1::text AND p.proname LIKE 'dedupgate\\_%'",
            &[&options.schema],
        )
        .await
        .map_err(pg)?;
    for f in &old {
        let signature: String = f.get(0);
        tx.batch_execute(&format!("DROP FUNCTION {signature}"))
            .await
            .map_err(|e| {
                open_error(
                    &e,
                    format!("replacing function {signature}: {}", describe_pg(&e)),
                )
            })?;
    }
    tx.batch_execute(&FUNCTIONS.replace("{s}", s))
        .await
        .map_err(|e| open_error(&e, format!("creating functions: {}", describe_pg(&e))))?;
    tx.execute(
        &format!(
            "INSERT INTO {table} (md5) VALUES ($1) ON CONFLICT (one) DO UPDATE SET md5 = $1,
                 applied_at = clock_timestamp(), applied_by = current_user"
        ),
        &[&wanted],
    )
    .await
    .map_err(pg)?;
    if found > 0 {
        tracing::warn!(
            schema = %options.schema,
            previous = stored.as_deref().unwrap_or("none recorded"),
            md5 = %wanted,
            "dedupgate postgres functions replaced: their text differed from this build's \
             (every gate on one schema should run the same build)"
        );
    }
    Ok(())
}

/// Refuses a server that can lose acknowledged commits, unless the options accept the risk (then
/// it warns on every start).
pub(crate) async fn check_durability(client: &Client, options: &PgOptions) -> Result<(), PgError> {
    for setting in ["synchronous_commit", "fsync"] {
        let value: String = client
            .query_one(&format!("SHOW {setting}"), &[])
            .await
            .map_err(pg)?
            .get(0);
        if value == "off" {
            if options.allow_async_commit {
                tracing::warn!(
                    setting,
                    "POSTGRES {setting} IS OFF: a server crash can lose claims dedupgate already \
                     acknowledged, and their duplicates will then be answered `new` \
                     (accepted with dedupgate_allow_async_commit=true)"
                );
            } else {
                return Err(PgError::UnsafeDurability { setting, value });
            }
        }
    }
    Ok(())
}
