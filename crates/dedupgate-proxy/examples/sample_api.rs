//! The sample API on its own, to put the proxy in front of (README, scripts/bench-proxy.sh).
//!
//! `cargo run -p dedupgate-proxy --features sample --example sample_api -- 127.0.0.1:3000`
//!
//! By default it is the in-memory echo of `dedupgate_proxy::sample` (no work per request: the
//! proxy's pure overhead shows against it). With `--postgres URL` every POST does what a payments
//! API does when it creates a charge: one durable INSERT (idempotency key, body hash, body) into a
//! PostgreSQL table, answered with the new row's id, so a benchmark can compare the proxy with an
//! upstream that does real work. `--help` lists the options.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use sha2::{Digest, Sha256};
use tokio_postgres::NoTls;

const HELP: &str = "\
sample_api [ADDR] [--postgres URL] [--pool N] [--table NAME]

  ADDR            where to listen (default 127.0.0.1:3000)
  --postgres URL  every POST inserts (idempotency key, body SHA-256, body) into a PostgreSQL
                  table and answers 201 with the new row's id, like a payments API creating a
                  charge; other methods answer 405. Also env SAMPLE_API_POSTGRES.
                  e.g. postgres://postgres@127.0.0.1:5432/test
                  Without it: the in-memory echo (counts executions, does no work).
  --pool N        PostgreSQL connections (default 8; env SAMPLE_API_POOL)
  --table NAME    table to insert into, created if missing (default sample_api_charges)

Commits use the server's synchronous_commit (on by default): each answer waits for its WAL
flush, as a real API's would.
";

struct Options {
    addr: String,
    postgres: Option<String>,
    pool: usize,
    table: String,
}

fn parse_args() -> Result<Options, String> {
    let mut opts = Options {
        addr: "127.0.0.1:3000".to_owned(),
        postgres: std::env::var("SAMPLE_API_POSTGRES")
            .ok()
            .filter(|s| !s.is_empty()),
        pool: match std::env::var("SAMPLE_API_POOL") {
            Ok(v) => v
                .parse()
                .map_err(|_| format!("SAMPLE_API_POOL: not a number: {v}"))?,
            Err(_) => 8,
        },
        table: "sample_api_charges".to_owned(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{HELP}");
                std::process::exit(0);
            }
            "--postgres" => opts.postgres = Some(value("--postgres")?),
            "--pool" => {
                let v = value("--pool")?;
                opts.pool = v
                    .parse()
                    .map_err(|_| format!("--pool: not a number: {v}"))?;
            }
            "--table" => opts.table = value("--table")?,
            a if a.starts_with('-') => return Err(format!("unknown option {a}\n\n{HELP}")),
            a => opts.addr = a.to_owned(),
        }
    }
    if opts.pool == 0 {
        return Err("--pool must be at least 1".to_owned());
    }
    let table_ok = !opts.table.is_empty()
        && opts
            .table
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !table_ok {
        return Err(format!(
            "--table: letters, digits and _ only: {}",
            opts.table
        ));
    }
    Ok(opts)
}

/// What a POST needs in postgres mode.
struct Charges {
    pool: Pool,
    insert: String,
}

async fn connect(url: &str, size: usize, table: &str) -> Result<Charges, String> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| format!("--postgres: {e}"))?;
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| format!("connection pool: {e}"))?;
    let client = pool
        .get()
        .await
        .map_err(|e| format!("postgres connect: {e}"))?;
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id bigserial PRIMARY KEY,
                idempotency_key text,
                body_sha256 bytea NOT NULL,
                body bytea NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now())"
        ))
        .await
        .map_err(|e| format!("create table {table}: {e}"))?;
    let sync: String = client
        .query_one("SHOW synchronous_commit", &[])
        .await
        .map_err(|e| format!("SHOW synchronous_commit: {e}"))?
        .get(0);
    eprintln!("sample API: POST inserts into {table} (pool {size}, synchronous_commit {sync})");
    Ok(Charges {
        pool,
        insert: format!(
            "INSERT INTO {table} (idempotency_key, body_sha256, body) VALUES ($1, $2, $3) \
             RETURNING id"
        ),
    })
}

/// Creates a charge: one INSERT, committed (autocommit) before the answer.
async fn create_charge(
    State(charges): State<Arc<Charges>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    let digest = Sha256::digest(&body);
    let unavailable = |e: String| {
        eprintln!("sample API: {e}");
        (StatusCode::SERVICE_UNAVAILABLE, "database unavailable\n").into_response()
    };
    let client = match charges.pool.get().await {
        Ok(c) => c,
        Err(e) => return unavailable(format!("pool: {e}")),
    };
    let stmt = match client.prepare_cached(&charges.insert).await {
        Ok(s) => s,
        Err(e) => return unavailable(format!("prepare: {e}")),
    };
    let row = match client
        .query_one(&stmt, &[&key, &digest.as_slice(), &body.as_ref()])
        .await
    {
        Ok(r) => r,
        Err(e) => return unavailable(format!("insert: {e}")),
    };
    let id: i64 = row.get(0);
    let answer = serde_json::json!({
        "id": format!("ch_{id}"),
        "object": "charge",
        "idempotency_key": key,
        "body_bytes": body.len(),
        "body_sha256": hex::encode(digest),
    });
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        answer.to_string(),
    )
        .into_response()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sample_api: {e}");
            std::process::exit(2);
        }
    };
    let listener = tokio::net::TcpListener::bind(&opts.addr).await?;
    match opts.postgres {
        None => {
            let api = dedupgate_proxy::sample::SampleApi::spawn(listener)?;
            eprintln!("sample API listening on {}", api.url());
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("sample API ran {} requests", api.counts.total());
        }
        Some(url) => {
            let charges = Arc::new(connect(&url, opts.pool, &opts.table).await?);
            let app = axum::Router::new()
                .fallback_service(axum::routing::post(create_charge).with_state(charges));
            eprintln!("sample API listening on http://{}", listener.local_addr()?);
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await?;
        }
    }
    Ok(())
}
