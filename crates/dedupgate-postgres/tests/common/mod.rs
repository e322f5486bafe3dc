//! Helpers shared by the integration tests: the local server's URL and a schema of their own.
#![allow(dead_code)] // each test binary uses a different part

use dedupgate_postgres::{PgOptions, PgStore};
use rand::Rng;

/// The local PostgreSQL the tests talk to.
pub fn url() -> String {
    std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A schema name no other run uses, so parallel runs never collide.
pub fn fresh_schema(what: &str) -> String {
    format!("dgtest_{what}_{:016x}", rand::thread_rng().gen::<u64>())
}

/// Opens a store on `url` in `schema`, with a small pool (the server's connections are shared).
pub async fn open(url: &str, schema: &str, pool_size: usize) -> PgStore {
    let (config, mut options) = dedupgate_postgres::parse_url(url).expect("test URL parses");
    options.schema = schema.to_owned();
    options.pool_size = pool_size;
    PgStore::connect(config, options)
        .await
        .unwrap_or_else(|e| panic!("open postgres store at {url}: {e}"))
}

/// Default options with `schema`.
pub fn options(schema: &str) -> PgOptions {
    PgOptions {
        schema: schema.to_owned(),
        ..PgOptions::default()
    }
}

/// A plain connection for checks and clean-up.
pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    tokio::spawn(conn);
    client
}

/// Drops a test schema and everything in it.
pub async fn drop_schema(url: &str, schema: &str) {
    let client = connect(url).await;
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .unwrap_or_else(|e| panic!("drop schema {schema}: {e}"));
}

/// Runs `body` (which may panic), then drops `schema` whatever happened, then re-raises.
pub async fn with_schema_dropped<F>(url: &str, schema: &str, body: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let outcome = tokio::spawn(body).await;
    drop_schema(url, schema).await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}
