//! PostgreSQL upsert sink: each message is one row by key, written only when its version is
//! higher than the stored one, so an older event arriving late (or a stale holder's write
//! after its lease was taken over) cannot overwrite a newer one:
//!
//! ```sql
//! INSERT INTO t AS stored (key, payload, version) VALUES ($1, $2::jsonb, $3)
//! ON CONFLICT (key) DO UPDATE SET payload = EXCLUDED.payload, version = EXCLUDED.version
//! WHERE stored.version < EXCLUDED.version
//! ```
//!
//! One row written is `applied`; none is `stale`: the row already holds that version or a
//! newer one, so the message is confirmed (acked) and counted, never retried, since a retry
//! would be refused alike. The version is the gate's fencing token (`version=fence`, the
//! default: a later claim of a key always carries a higher one) or a numeric field of the
//! payload (`version=FIELD`). A payload that is not JSON, or lacks the field, is refused
//! ([`SinkError::Refused`]: dead-lettered).
//!
//! Identifiers are checked when the URL is parsed ([`crate::route::PgUpsert`]) and written
//! quoted, so the statement is fixed before any message arrives.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Statement};

use super::{Outgoing, Sink, SinkError};
use crate::metrics::RouteMetrics;
use crate::route::{PgUpsert, PgVersion};

/// How long connecting may take before the send fails (and the relay retries it).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// One upsert's bound: a lock held elsewhere must not hold the delivery forever.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

pub struct PostgresSink {
    name: String,
    spec: PgUpsert,
    sql: String,
    metrics: Arc<RouteMetrics>,
    /// The connection and its prepared upsert; `None` after it broke, until the next send
    /// connects again.
    conn: Mutex<Option<Arc<(Client, Statement)>>>,
}

impl PostgresSink {
    pub async fn connect(spec: &PgUpsert, metrics: Arc<RouteMetrics>) -> Result<Self, SinkError> {
        let sink = Self {
            name: spec.to_string(),
            sql: spec.upsert_sql(),
            spec: spec.clone(),
            metrics,
            conn: Mutex::new(None),
        };
        // Connect and prepare now: a missing table or column fails the start, not a message.
        sink.connection().await.map_err(|reason| SinkError::Open {
            sink: sink.name.clone(),
            reason,
        })?;
        Ok(sink)
    }

    async fn connection(&self) -> Result<Arc<(Client, Statement)>, String> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref().filter(|c| !c.0.is_closed()) {
            return Ok(c.clone());
        }
        let mut config: tokio_postgres::Config = self.spec.conninfo.parse().map_err(cause)?;
        config.connect_timeout(CONNECT_TIMEOUT);
        let (client, connection) = config.connect(NoTls).await.map_err(cause)?;
        let name = self.name.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(sink = %name, error = %e, "relay: PostgreSQL connection lost");
            }
        });
        let statement = client.prepare(&self.sql).await.map_err(cause)?;
        let c = Arc::new((client, statement));
        *conn = Some(c.clone());
        Ok(c)
    }

    fn refused(&self, reason: impl Into<String>) -> SinkError {
        SinkError::Refused {
            sink: self.name.clone(),
            reason: reason.into(),
        }
    }

    /// The row's version: the fence, or the payload's field.
    fn version(&self, out: &Outgoing<'_>, payload: &serde_json::Value) -> Result<i64, SinkError> {
        match &self.spec.version {
            PgVersion::Fence => {
                let fence = out.fence.ok_or_else(|| {
                    self.refused("no fencing token (a dead letter) to use as the version")
                })?;
                i64::try_from(fence)
                    .map_err(|_| self.refused(format!("fence {fence} exceeds a bigint")))
            }
            PgVersion::Field(field) => payload
                .get(field)
                .and_then(serde_json::Value::as_i64)
                .ok_or_else(|| {
                    self.refused(format!(
                        "the payload has no integer field {field:?} to use as the version"
                    ))
                }),
        }
    }
}

/// A PostgreSQL error with its server message (tokio-postgres's own text alone says "db error").
fn cause(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => e.to_string(),
    }
}

#[async_trait]
impl Sink for PostgresSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let payload: serde_json::Value = serde_json::from_slice(out.payload)
            .map_err(|e| self.refused(format!("the payload is not JSON ({e}), so not jsonb")))?;
        let version = self.version(&out, &payload)?;
        // Valid JSON text, as jsonb reads it (parsed above, so a bad payload never reaches SQL).
        let text = std::str::from_utf8(out.payload)
            .map_err(|_| self.refused("the payload is not UTF-8"))?;
        let failed = |reason: String| SinkError::Send {
            sink: self.name.clone(),
            reason,
        };
        let conn = self.connection().await.map_err(failed)?;
        let (client, statement) = conn.as_ref();
        let written = tokio::time::timeout(
            STATEMENT_TIMEOUT,
            client.execute(statement, &[&out.key, &text, &version]),
        )
        .await
        .map_err(|_| failed(format!("no answer within {STATEMENT_TIMEOUT:?}")))?
        .map_err(|e| failed(cause(e)))?;
        let counter: &AtomicU64 = if written == 1 {
            &self.metrics.sink_rows_applied
        } else {
            tracing::debug!(sink = %self.name, key = %out.key, version, "relay: stale row refused");
            &self.metrics.sink_rows_stale
        };
        RouteMetrics::bump(counter);
        Ok(())
    }
}
