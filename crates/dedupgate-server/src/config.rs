//! What a server is told: default durations, limits, auth tokens and the background sweeper's
//! pace ([`ServerConfig`]), and the TOML file the binary reads them from ([`FileConfig`]).
//!
//! Precedence (flags > `DEDUPGATE_*` environment > file > built-in defaults) is applied by the
//! binary; this module only knows the file's shape and the defaults.

use std::path::Path;

use dedupgate_core::model::{KEY_BYTES_MAX, NAMESPACE_BYTES_MAX};
use dedupgate_core::{Defaults, BATCH_OPS_MAX};
use serde::Deserialize;

/// Size, time and concurrency limits. Each one bounds memory or time a single caller can take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body; bigger ones get 413 `payload_too_large` before they are read whole
    /// (at once, unread, when their `Content-Length` is bigger).
    pub body_bytes_max: usize,
    /// Longest key accepted (at most API.md's 1024, else [`Limits::validated`] refuses it);
    /// longer gets 400 `invalid_request`.
    pub key_bytes_max: usize,
    /// Longest namespace accepted (at most API.md's 128, else [`Limits::validated`] refuses
    /// it); longer gets 400 `invalid_request`.
    pub namespace_bytes_max: usize,
    /// Largest `result` of complete/mark, as compact JSON; bigger gets 413 `payload_too_large`.
    pub result_bytes_max: usize,
    /// Most ops in one batch (at most API.md's 10,000); more gets 400 for the whole request.
    pub batch_ops_max: usize,
    /// A request whose decision takes longer is answered 503 `unavailable` with `Retry-After`;
    /// a request body that has not arrived whole within it, 400 `invalid_request`.
    pub request_timeout_ms: u64,
    /// Requests decided at once (a request takes a slot once its body has arrived, so slow
    /// senders cannot hold slots); the next one is answered 503 with `Retry-After` instead of
    /// queueing.
    pub in_flight_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            // A full batch of 10,000 ops with 1 KiB keys fits with room to spare.
            body_bytes_max: 16 * 1024 * 1024,
            key_bytes_max: KEY_BYTES_MAX,
            namespace_bytes_max: NAMESPACE_BYTES_MAX,
            result_bytes_max: 64 * 1024,
            batch_ops_max: BATCH_OPS_MAX,
            request_timeout_ms: 10_000,
            in_flight_max: 1024,
        }
    }
}

impl Limits {
    /// Refuses zeros and values above the caps API.md sets (key 1024 bytes, namespace 128
    /// bytes, batch 10,000 ops): a setting the server could not honour stops the start rather
    /// than being quietly lowered.
    pub fn validated(self) -> Result<Self, ConfigError> {
        for (name, v) in [
            ("body_bytes_max", self.body_bytes_max as u64),
            ("key_bytes_max", self.key_bytes_max as u64),
            ("namespace_bytes_max", self.namespace_bytes_max as u64),
            ("result_bytes_max", self.result_bytes_max as u64),
            ("batch_ops_max", self.batch_ops_max as u64),
            ("request_timeout", self.request_timeout_ms),
            ("in_flight_max", self.in_flight_max as u64),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
        }
        for (name, v, max) in [
            ("key_bytes_max", self.key_bytes_max, KEY_BYTES_MAX),
            (
                "namespace_bytes_max",
                self.namespace_bytes_max,
                NAMESPACE_BYTES_MAX,
            ),
            ("batch_ops_max", self.batch_ops_max, BATCH_OPS_MAX),
        ] {
            if v > max {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be at most {max} (API.md's limit), got {v}"
                )));
            }
        }
        Ok(self)
    }
}

/// What a bearer token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// claim, complete, release, extend, mark, get and batch in its namespaces.
    Client,
    /// Everything a client may, plus `DELETE /v1/record`.
    Admin,
}

/// One bearer token and what it may touch.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRule {
    /// A name for logs (the token itself is never logged).
    #[serde(default)]
    pub name: Option<String>,
    /// The secret, as sent in `Authorization: Bearer …`.
    pub token: String,
    /// Namespace globs (`*` any run of characters, `?` one), e.g. `["pay*", "orders"]`.
    pub namespaces: Vec<String>,
    /// client or admin.
    pub role: Role,
}

impl std::fmt::Debug for TokenRule {
    // Tokens are secrets: a config dump must never show one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRule")
            .field("name", &self.name)
            .field("token", &"<redacted>")
            .field("namespaces", &self.namespaces)
            .field("role", &self.role)
            .finish()
    }
}

/// Everything the HTTP service needs besides its store and listener.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// ttl and lease used when a request gives none.
    pub defaults: Defaults,
    /// Size, time and concurrency limits.
    pub limits: Limits,
    /// Bearer tokens; empty means auth is off.
    pub tokens: Vec<TokenRule>,
    /// Pause between sweeps of expired records, of a store that does not sweep itself (see
    /// `Store::sweeps_itself`).
    pub sweep_interval_ms: u64,
    /// Most records one sweep call removes, so a sweep never holds the store for long.
    pub sweep_batch_max: usize,
    /// Most namespaces given a metrics label at run time: the first seen when
    /// `metrics_namespaces` is empty, else those its globs match. The rest count as `other`.
    pub namespace_labels_max: usize,
    /// Namespaces (names, or globs with `*` and `?`) labelled by name in metrics; a listed
    /// name always is, so junk namespaces cannot push it into `other`. Empty: first come.
    pub metrics_namespaces: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            defaults: Defaults::default(),
            limits: Limits::default(),
            tokens: Vec::new(),
            sweep_interval_ms: 1_000,
            sweep_batch_max: 10_000,
            namespace_labels_max: 1_000,
            metrics_namespaces: Vec::new(),
        }
    }
}

/// A configuration that could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    // The cause is the error's source, not repeated in its text: `{:#}` chains show it once.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The optional TOML file (`dedupgate serve --config FILE`). Every field is optional; flags and
/// `DEDUPGATE_*` variables override it. Unknown fields are refused so a typo is not silently
/// ignored. Durations are strings with units (`"500ms"`, `"30s"`, `"24h"`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Address to listen on, e.g. `127.0.0.1:7878`.
    pub listen: Option<String>,
    /// STORE spec.
    pub store: Option<String>,
    /// Serve without tokens on a non-loopback address.
    pub allow_unauthenticated_remote: Option<bool>,
    /// Default record retention.
    pub default_ttl: Option<String>,
    /// Default lease.
    pub default_lease: Option<String>,
    /// See [`Limits::body_bytes_max`].
    pub body_bytes_max: Option<usize>,
    /// See [`Limits::key_bytes_max`].
    pub key_bytes_max: Option<usize>,
    /// See [`Limits::namespace_bytes_max`].
    pub namespace_bytes_max: Option<usize>,
    /// See [`Limits::result_bytes_max`].
    pub result_bytes_max: Option<usize>,
    /// See [`Limits::batch_ops_max`].
    pub batch_ops_max: Option<usize>,
    /// See [`Limits::request_timeout_ms`].
    pub request_timeout: Option<String>,
    /// See [`Limits::in_flight_max`].
    pub in_flight_max: Option<usize>,
    /// See [`ServerConfig::sweep_interval_ms`].
    pub sweep_interval: Option<String>,
    /// See [`ServerConfig::sweep_batch_max`].
    pub sweep_batch_max: Option<usize>,
    /// See [`ServerConfig::namespace_labels_max`].
    pub namespace_labels_max: Option<usize>,
    /// See [`ServerConfig::metrics_namespaces`].
    #[serde(default)]
    pub metrics_namespaces: Vec<String>,
    /// Bearer tokens (`[[tokens]]` tables).
    #[serde(default)]
    pub tokens: Vec<TokenRule>,
}

impl FileConfig {
    /// Reads and parses a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses TOML text, and refuses `[[tokens]]` that could not mean what they say: a token
    /// that may use no namespace, and one secret listed twice (only one entry could apply).
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        check_tokens(&file.tokens)?;
        check_metrics_namespaces(&file.metrics_namespaces)?;
        Ok(file)
    }
}

/// How a token entry is named in messages: its position and name, never the secret.
fn token_label(i: usize, rule: &TokenRule) -> String {
    format!(
        "token {} ({})",
        i + 1,
        rule.name.as_deref().unwrap_or("unnamed")
    )
}

/// Refuses token entries that cannot work as written (see [`FileConfig::parse`]).
pub fn check_tokens(tokens: &[TokenRule]) -> Result<(), String> {
    for (i, rule) in tokens.iter().enumerate() {
        if rule.namespaces.is_empty() {
            return Err(format!(
                "{}: `namespaces` is empty, so the token could use no namespace; list the \
                 namespace globs it may use (\"*\" for all)",
                token_label(i, rule)
            ));
        }
        if let Some(j) = tokens[..i].iter().position(|r| r.token == rule.token) {
            return Err(format!(
                "{} has the same secret as {}: each token must be listed once, with one role \
                 and one set of namespaces",
                token_label(i, rule),
                token_label(j, &tokens[j])
            ));
        }
    }
    Ok(())
}

/// Refuses a `metrics_namespaces` entry that could match no namespace (a typo such as
/// `"payments, orders"` would otherwise label nothing, silently).
pub fn check_metrics_namespaces(patterns: &[String]) -> Result<(), String> {
    for pattern in patterns {
        let allowed = |c: char| c.is_ascii_alphanumeric() || ".-_:*?".contains(c);
        if pattern.is_empty() || !pattern.chars().all(allowed) {
            return Err(format!(
                "metrics_namespaces: {pattern:?} is not a namespace or a glob of one \
                 ([A-Za-z0-9._:-], with * for any run of characters and ? for one)"
            ));
        }
    }
    Ok(())
}

/// Parses a duration into milliseconds with the one grammar of every dedupgate duration
/// ([`dedupgate_core::parse_duration_ms`]: `500ms`, `30s`, `5m`, `24h`, `7d`, sums such as
/// `1h30m`; a bare number is refused, since its unit would be a guess), for flags, environment
/// variables and the config file alike.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    dedupgate_core::parse_duration_ms(text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("30s"), Ok(30_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
        assert_eq!(parse_duration_ms("7d"), Ok(604_800_000));
        assert_eq!(parse_duration_ms("1h30m"), Ok(5_400_000));
        for bad in [
            "",
            "250",
            "0s",
            "-1s",
            "5x",
            "s",
            "99999999999999999999d",
            "4000d",
        ] {
            assert!(parse_duration_ms(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn file_config_parses_tokens_and_refuses_unknown_fields() {
        let file = FileConfig::parse(
            r#"
            listen = "0.0.0.0:7878"
            default_ttl = "1h"
            [[tokens]]
            name = "payments-workers"
            token = "s3cret"
            namespaces = ["pay*"]
            role = "client"
            "#,
        )
        .unwrap();
        assert_eq!(file.tokens.len(), 1);
        assert_eq!(file.tokens[0].role, Role::Client);
        assert!(!format!("{file:?}").contains("s3cret"));
        assert!(FileConfig::parse("lisen = \"x\"").is_err());
        let file = FileConfig::parse(r#"metrics_namespaces = ["payments", "orders-*"]"#).unwrap();
        assert_eq!(file.metrics_namespaces, ["payments", "orders-*"]);
        for bad in [r#"[""]"#, r#"["payments, orders"]"#, r#"["pay/ments"]"#] {
            assert!(FileConfig::parse(&format!("metrics_namespaces = {bad}")).is_err());
        }
        assert!(
            FileConfig::parse("[[tokens]]\ntoken=\"a\"\nnamespaces=[]\nrole=\"root\"").is_err()
        );
    }
}
