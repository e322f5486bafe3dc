//! How a [`crate::PgStore`] is configured: the `postgres://` URL of the STORE forms plus a few
//! `dedupgate_*` query parameters that the store takes out before tokio-postgres sees the URL.

use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::Host;

use crate::error::PgError;

/// Default schema that holds the table and functions.
pub const DEFAULT_SCHEMA: &str = "dedupgate";
/// Default pool size: enough for a busy gate, small next to PostgreSQL's usual 100 connections.
pub const DEFAULT_POOL_SIZE: usize = 16;
/// Default bound on one operation (waiting for a connection included). Past it the answer is
/// `unavailable`, so a hung server never hangs the gate.
pub const DEFAULT_OP_TIMEOUT_MS: u64 = 10_000;
/// Default bound on opening one connection.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Longest schema name PostgreSQL keeps (NAMEDATALEN - 1).
pub const SCHEMA_BYTES_MAX: usize = 63;

/// Options of the PostgreSQL store.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// Schema for the table and functions (created if missing). `dedupgate_schema=` in the URL.
    pub schema: String,
    /// Connections in the pool. `dedupgate_pool_size=` in the URL.
    pub pool_size: usize,
    /// Bound on one operation, waiting for a connection included. `dedupgate_op_timeout_ms=`.
    pub op_timeout_ms: u64,
    /// Bound on opening a connection (applied when the URL sets none).
    pub connect_timeout_ms: u64,
    /// Open even when `synchronous_commit` is off or `fsync` is off, which can lose acknowledged
    /// claims in a crash. `dedupgate_allow_async_commit=true` in the URL. Off by default.
    pub allow_async_commit: bool,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            pool_size: DEFAULT_POOL_SIZE,
            op_timeout_ms: DEFAULT_OP_TIMEOUT_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            allow_async_commit: false,
        }
    }
}

impl PgOptions {
    /// Checks the options before anything connects.
    pub fn validate(&self) -> Result<(), PgError> {
        if self.schema.is_empty()
            || self.schema.len() > SCHEMA_BYTES_MAX
            || self.schema.contains('\0')
        {
            return Err(PgError::Options(format!(
                "dedupgate_schema must be 1..={SCHEMA_BYTES_MAX} bytes without NUL, got {:?}",
                self.schema
            )));
        }
        if self.pool_size == 0 || self.pool_size > 1_000 {
            return Err(PgError::Options(format!(
                "dedupgate_pool_size must be 1..=1000, got {}",
                self.pool_size
            )));
        }
        if self.op_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return Err(PgError::Options("timeouts must be positive".to_owned()));
        }
        Ok(())
    }

    pub(crate) fn op_timeout(&self) -> Duration {
        Duration::from_millis(self.op_timeout_ms)
    }

    /// The schema name quoted as an SQL identifier.
    pub(crate) fn quoted_schema(&self) -> String {
        format!("\"{}\"", self.schema.replace('"', "\"\""))
    }
}

/// Splits a `postgres://` URL into the tokio-postgres config and the store's own options.
pub fn parse_url(url: &str) -> Result<(tokio_postgres::Config, PgOptions), PgError> {
    let mut options = PgOptions::default();
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let bad = |what: &str| PgError::Options(format!("{name}={value:?}: {what}"));
        match name {
            "dedupgate_schema" => options.schema = percent_decode(value).map_err(|e| bad(&e))?,
            "dedupgate_pool_size" => {
                options.pool_size = value.parse().map_err(|_| bad("expected a count"))?
            }
            "dedupgate_op_timeout_ms" => {
                options.op_timeout_ms = value.parse().map_err(|_| bad("expected milliseconds"))?
            }
            "dedupgate_allow_async_commit" => {
                options.allow_async_commit = match value {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(bad("expected true or false")),
                }
            }
            other if other.starts_with("dedupgate_") => {
                return Err(bad("unknown dedupgate option (known: dedupgate_schema, dedupgate_pool_size, dedupgate_op_timeout_ms, dedupgate_allow_async_commit)"))
            }
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| PgError::Options(format!("invalid PostgreSQL URL: {e}")))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_millis(options.connect_timeout_ms));
    }
    if config.get_application_name().is_none() {
        config.application_name("dedupgate");
    }
    options.validate()?;
    Ok((config, options))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or("truncated %-escape")?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| "bad %-escape")?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8".to_owned())
}

/// The store's description for logs: user, hosts, database and schema, never a password.
pub(crate) fn describe(config: &tokio_postgres::Config, options: &PgOptions) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let port = config
                .get_ports()
                .get(i)
                .or(config.get_ports().first())
                .copied()
                .unwrap_or(5432);
            match h {
                Host::Tcp(name) => format!("{name}:{port}"),
                Host::Unix(path) => format!("{}:{port}", path.display()),
            }
        })
        .collect();
    format!(
        "postgres://{}@{}/{} schema={} pool={}",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or(""),
        options.schema,
        options.pool_size
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_out_own_options_and_keeps_the_rest() {
        let (config, options) = parse_url(
            "postgres://u:secret@h:5433/db?dedupgate_schema=my%20gate&sslmode=disable&dedupgate_pool_size=4",
        )
        .unwrap();
        assert_eq!(options.schema, "my gate");
        assert_eq!(options.pool_size, 4);
        assert_eq!(config.get_dbname(), Some("db"));
        let text = describe(&config, &options);
        assert!(
            text.contains("h:5433") && !text.contains("secret"),
            "{text}"
        );
        assert_eq!(options.quoted_schema(), "\"my gate\"");
    }

    #[test]
    fn refuses_bad_options_clearly() {
        for url in [
            "postgres://h/db?dedupgate_pool_size=0",
            "postgres://h/db?dedupgate_pool_size=x",
            "postgres://h/db?dedupgate_schema=",
            "postgres://h/db?dedupgate_nope=1",
            "postgres://h/db?dedupgate_allow_async_commit=maybe",
            "postgres://h/db?nonsense_libpq_option=1",
        ] {
            assert!(parse_url(url).is_err(), "{url} accepted");
        }
        let (_, o) = parse_url("postgres://h/db?dedupgate_allow_async_commit=true").unwrap();
        assert!(o.allow_async_commit);
    }
}
