//! What the layer and the proxy are told: [`IdempotencyConfig`] (which requests are gated and
//! how), its [`Route`] rules, and the TOML file form ([`ConfigFile`]) the command line loads.

use std::collections::HashSet;
use std::path::Path;

use http::{HeaderName, Method};
use serde::Deserialize;

use crate::error::ConfigError;
use crate::problem::ErrorFormat;
use crate::seal::Sealer;

/// Longest `Idempotency-Key` accepted, in characters (API.md: longer keys get 400).
pub const IDEMPOTENCY_KEY_CHARS_MAX: usize = 255;
/// Default cap on a request body, in bytes: requests gated by a key are buffered to fingerprint them.
pub const DEFAULT_REQUEST_BYTES_MAX: u64 = 10 * 1024 * 1024;
/// Default cap on a stored response body, in bytes: a first response is buffered to store it.
pub const DEFAULT_RESPONSE_BYTES_MAX: u64 = 10 * 1024 * 1024;
/// Default namespace of the proxy's records.
pub const DEFAULT_NAMESPACE: &str = "idempotency";
/// Default header whose value scopes keys to a caller.
pub const DEFAULT_SCOPE_HEADER: &str = "authorization";
/// Default lease: covers the default upstream timeout (30 s) plus time to store the answer.
pub const DEFAULT_LEASE_MS: u64 = 35_000;
/// Default time a gated request's body has to arrive once its head has.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;

/// Whether a route needs an `Idempotency-Key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Requirement {
    /// A request without the header gets 400.
    Required,
    /// A request without the header passes straight through, unprotected.
    Optional,
    /// The route is never gated, with or without the header.
    Off,
}

/// One route rule: methods and a path pattern. The first rule that matches a request decides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Methods the rule applies to.
    pub methods: Vec<Method>,
    /// Path pattern: `*` matches within one segment, `**` matches across segments.
    pub path: String,
    /// What the rule asks of a matching request.
    pub key: Requirement,
    /// How the proxy words its own errors on this route; `None`: the configuration's.
    pub errors: Option<ErrorFormat>,
}

impl Route {
    /// True when the rule applies to this method and path.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        self.methods.iter().any(|m| m == method)
            && glob_match(self.path.as_bytes(), path.as_bytes())
    }
}

/// Matches `path` against `pattern` where `*` spans any bytes but `/` and `**` spans anything.
/// Iterative with one backtrack point per star kind, so a hostile path cannot make it slow.
fn glob_match(pattern: &[u8], path: &[u8]) -> bool {
    // Recursion depth is bounded by the number of `**` in the pattern (operator-written, short).
    fn go(p: &[u8], s: &[u8]) -> bool {
        let (mut pi, mut si) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while si < s.len() {
            if p.get(pi..pi + 2) == Some(b"**") {
                let rest = &p[pi + 2..];
                return (si..=s.len()).any(|k| go(rest, &s[k..]));
            }
            match p.get(pi) {
                Some(b'*') => {
                    star = Some((pi, si));
                    pi += 1;
                }
                Some(&c) if c == s[si] => {
                    pi += 1;
                    si += 1;
                }
                _ => match star {
                    Some((sp, ss)) if s[ss] != b'/' => {
                        pi = sp + 1;
                        si = ss + 1;
                        star = Some((sp, ss + 1));
                    }
                    _ => return false,
                },
            }
        }
        p[pi..].iter().all(|&c| c == b'*')
    }
    go(pattern, path)
}

/// How the idempotency layer gates requests. Built in code or loaded from TOML ([`ConfigFile`]).
#[derive(Clone, Debug)]
pub struct IdempotencyConfig {
    /// Namespace of the records (1..=128 bytes of `[A-Za-z0-9._:-]`).
    pub namespace: String,
    /// How long a completed response is kept and replayed.
    pub ttl_ms: u64,
    /// Lease of an in-flight request; renewed every third of it while the upstream works.
    pub lease_ms: u64,
    /// Rules, first match wins. A request no rule matches is not gated.
    pub routes: Vec<Route>,
    /// Header whose value scopes keys to a caller (hashed, never stored in clear).
    pub scope_header: HeaderName,
    /// Response headers that are stored and replayed although they are normally dropped
    /// (`set-cookie`).
    pub allow_headers: HashSet<HeaderName>,
    /// Response headers that are never stored or replayed (on top of hop-by-hop and `set-cookie`).
    pub deny_headers: HashSet<HeaderName>,
    /// Cap on a gated request's body; larger gets 413.
    pub request_bytes_max: u64,
    /// Time a gated request's body has to arrive, once its head has; a body still incomplete
    /// then gets 408 and nothing is claimed. A client trickling its body would otherwise hold
    /// a connection and a buffer for as long as it likes.
    pub body_read_timeout_ms: u64,
    /// Cap on a stored response body; larger is answered with a 502 problem, stored as the answer.
    pub response_bytes_max: u64,
    /// When set, a duplicate of an in-flight request waits up to this long for the first to
    /// finish and replays it, instead of getting 409 at once.
    pub wait_ms: Option<u64>,
    /// Encrypts stored responses at rest when set.
    pub sealer: Option<Sealer>,
    /// How the proxy words its own errors where the matching route does not say (and on
    /// requests no route matches): problem JSON unless the API behind it has a convention of
    /// its own that its clients parse (Stripe's).
    pub errors: ErrorFormat,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            ttl_ms: dedupgate_core::op::DEFAULT_TTL_MS,
            lease_ms: DEFAULT_LEASE_MS,
            routes: default_routes(),
            scope_header: HeaderName::from_static(DEFAULT_SCOPE_HEADER),
            allow_headers: HashSet::new(),
            deny_headers: HashSet::new(),
            request_bytes_max: DEFAULT_REQUEST_BYTES_MAX,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            response_bytes_max: DEFAULT_RESPONSE_BYTES_MAX,
            wait_ms: None,
            sealer: None,
            errors: ErrorFormat::Problem,
        }
    }
}

/// API.md's default: POST and PATCH on every path, key optional.
pub fn default_routes() -> Vec<Route> {
    vec![Route {
        methods: vec![Method::POST, Method::PATCH],
        path: "/**".to_owned(),
        key: Requirement::Optional,
        errors: None,
    }]
}

impl IdempotencyConfig {
    /// The requirement of the first rule matching the request, if any.
    pub fn requirement(&self, method: &Method, path: &str) -> Option<Requirement> {
        self.routes
            .iter()
            .find(|r| r.matches(method, path))
            .map(|r| r.key)
    }

    /// The error format of the first rule matching the request, else the configuration's.
    pub fn error_format(&self, method: &Method, path: &str) -> ErrorFormat {
        self.routes
            .iter()
            .find(|r| r.matches(method, path))
            .and_then(|r| r.errors)
            .unwrap_or(self.errors)
    }

    /// Checks the fields a store would otherwise refuse on the first request.
    pub fn validate(&self) -> Result<(), ConfigError> {
        dedupgate_core::Namespace::new(self.namespace.clone())
            .map_err(|e| ConfigError::Invalid(format!("namespace: {e}")))?;
        for (name, ms) in [
            ("ttl", self.ttl_ms),
            ("lease", self.lease_ms),
            ("body_read_timeout", self.body_read_timeout_ms),
        ] {
            if ms == 0 || ms > dedupgate_core::op::DURATION_MS_MAX {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be positive and at most ten years"
                )));
            }
        }
        if self.request_bytes_max == 0 || self.response_bytes_max == 0 {
            return Err(ConfigError::Invalid("byte limits must be positive".into()));
        }
        Ok(())
    }
}

/// The TOML file `dedupgate proxy --config FILE` reads. Every field is optional.
///
/// ```toml
/// namespace = "shop-api"
/// ttl = "24h"
/// scope_header = "x-api-key"
/// allow_headers = ["set-cookie"]
/// deny_headers = ["x-request-id"]
/// request_bytes_max = 1048576
/// body_read_timeout = "30s"
/// wait = "10s"
/// errors = "problem"          # or "stripe"; a route may say otherwise
///
/// [[route]]
/// methods = ["POST"]
/// path = "/v1/charges"
/// key = "required"
/// errors = "stripe"
///
/// [[route]]
/// methods = ["POST"]
/// path = "/v1/charges/**"
/// key = "required"
///
/// [[route]]
/// methods = ["POST", "PATCH"]
/// path = "/**"
/// key = "optional"
/// ```
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Record namespace.
    pub namespace: Option<String>,
    /// Retention, with a unit (`24h`).
    pub ttl: Option<String>,
    /// Lease, with a unit (`35s`).
    pub lease: Option<String>,
    /// Caller scope header.
    pub scope_header: Option<String>,
    /// Headers stored although normally dropped.
    #[serde(default)]
    pub allow_headers: Vec<String>,
    /// Headers never stored.
    #[serde(default)]
    pub deny_headers: Vec<String>,
    /// Gated request body cap, bytes.
    pub request_bytes_max: Option<u64>,
    /// Time a gated request's body has to arrive, with a unit.
    pub body_read_timeout: Option<String>,
    /// Stored response body cap, bytes.
    pub response_bytes_max: Option<u64>,
    /// Wait for an in-flight duplicate, with a unit.
    pub wait: Option<String>,
    /// Error format where a route does not say: `problem` (default) or `stripe`.
    pub errors: Option<ErrorFormat>,
    /// Route rules; when absent, POST and PATCH everywhere, key optional.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteFile>,
}

/// One `[[route]]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteFile {
    /// Methods; default POST and PATCH.
    pub methods: Option<Vec<String>>,
    /// Path pattern; default `/**`.
    pub path: Option<String>,
    /// `required`, `optional` (default) or `off`.
    pub key: Option<Requirement>,
    /// `problem` or `stripe`; default: the file's (or the command line's) `errors`.
    pub errors: Option<ErrorFormat>,
}

impl ConfigFile {
    /// Reads and parses a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Invalid(format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Invalid(m) => ConfigError::Invalid(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// Applies the file over `base`: fields the file sets replace the base's.
    pub fn apply(self, mut base: IdempotencyConfig) -> Result<IdempotencyConfig, ConfigError> {
        if let Some(ns) = self.namespace {
            base.namespace = ns;
        }
        if let Some(t) = self.ttl {
            base.ttl_ms = parse_duration_ms(&t)?;
        }
        if let Some(t) = self.lease {
            base.lease_ms = parse_duration_ms(&t)?;
        }
        if let Some(h) = self.scope_header {
            base.scope_header = header_name(&h)?;
        }
        for h in self.allow_headers {
            base.allow_headers.insert(header_name(&h)?);
        }
        for h in self.deny_headers {
            base.deny_headers.insert(header_name(&h)?);
        }
        if let Some(n) = self.request_bytes_max {
            base.request_bytes_max = n;
        }
        if let Some(n) = self.response_bytes_max {
            base.response_bytes_max = n;
        }
        if let Some(t) = self.body_read_timeout {
            base.body_read_timeout_ms = parse_duration_ms(&t)?;
        }
        if let Some(w) = self.wait {
            base.wait_ms = Some(parse_duration_ms(&w)?);
        }
        if let Some(e) = self.errors {
            base.errors = e;
        }
        if !self.routes.is_empty() {
            base.routes = self
                .routes
                .into_iter()
                .map(RouteFile::into_route)
                .collect::<Result<_, _>>()?;
        }
        base.validate()?;
        Ok(base)
    }
}

impl RouteFile {
    fn into_route(self) -> Result<Route, ConfigError> {
        let methods = match self.methods {
            None => vec![Method::POST, Method::PATCH],
            Some(ms) if ms.is_empty() => {
                return Err(ConfigError::Invalid(
                    "route: methods must not be empty".into(),
                ))
            }
            Some(ms) => ms
                .iter()
                .map(|m| {
                    Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                        .map_err(|_| ConfigError::Invalid(format!("route: bad method {m:?}")))
                })
                .collect::<Result<_, _>>()?,
        };
        let path = self.path.unwrap_or_else(|| "/**".to_owned());
        if !path.starts_with('/') {
            return Err(ConfigError::Invalid(format!(
                "route: path pattern {path:?} must start with '/'"
            )));
        }
        Ok(Route {
            methods,
            path,
            key: self.key.unwrap_or(Requirement::Optional),
            errors: self.errors,
        })
    }
}

fn header_name(h: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
        .map_err(|_| ConfigError::Invalid(format!("bad header name {h:?}")))
}

/// Parses a duration with the one grammar of every dedupgate duration
/// ([`dedupgate_core::parse_duration_ms`]: `500ms`, `30s`, `5m`, `24h`, `7d`, sums such as
/// `1h30m`; a bare number is refused).
pub fn parse_duration_ms(text: &str) -> Result<u64, ConfigError> {
    dedupgate_core::parse_duration_ms(text).map_err(|e| ConfigError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(b"/**", b"/a/b/c"));
        assert!(glob_match(b"/**", b"/"));
        assert!(glob_match(b"/v1/*/pay", b"/v1/x/pay"));
        assert!(!glob_match(b"/v1/*/pay", b"/v1/x/y/pay"));
        assert!(glob_match(b"/v1/charges/**", b"/v1/charges/ch_1/refund"));
        assert!(!glob_match(b"/v1/charges/**", b"/v1/refunds"));
        assert!(glob_match(b"/a*c", b"/abbbc"));
        assert!(!glob_match(b"/a*c", b"/ab/c"));
        assert!(glob_match(b"/exact", b"/exact"));
        assert!(!glob_match(b"/exact", b"/exactly"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("500ms").unwrap(), 500);
        assert_eq!(parse_duration_ms("24h").unwrap(), 86_400_000);
        assert!(parse_duration_ms("0s").is_err());
        assert!(parse_duration_ms("5").is_err());
        assert!(parse_duration_ms("5y").is_err());
        assert!(parse_duration_ms("99999999999999999999d").is_err());
    }

    #[test]
    fn file_applies() {
        let f = ConfigFile::parse(
            r#"
namespace = "shop"
ttl = "1h"
wait = "2s"
body_read_timeout = "5s"
allow_headers = ["Set-Cookie"]
[[route]]
methods = ["post"]
path = "/pay/**"
key = "required"
[[route]]
path = "/health"
key = "off"
"#,
        )
        .unwrap();
        let c = f.apply(IdempotencyConfig::default()).unwrap();
        assert_eq!(c.namespace, "shop");
        assert_eq!(c.ttl_ms, 3_600_000);
        assert_eq!(c.wait_ms, Some(2000));
        assert_eq!(c.body_read_timeout_ms, 5000);
        assert!(c.allow_headers.contains(&http::header::SET_COOKIE));
        assert_eq!(
            c.requirement(&Method::POST, "/pay/x"),
            Some(Requirement::Required)
        );
        assert_eq!(c.requirement(&Method::PATCH, "/pay/x"), None);
        assert_eq!(
            c.requirement(&Method::PATCH, "/health"),
            Some(Requirement::Off)
        );
        assert_eq!(c.errors, ErrorFormat::Problem);
        assert_eq!(
            c.error_format(&Method::POST, "/pay/x"),
            ErrorFormat::Problem
        );
        assert!(ConfigFile::parse("bogus = 1").is_err());
        assert!(ConfigFile::parse("body_read_timeout = \"0s\"")
            .unwrap()
            .apply(IdempotencyConfig::default())
            .is_err());
        assert!(ConfigFile::parse("namespace = \"bad ns\"")
            .unwrap()
            .apply(IdempotencyConfig::default())
            .is_err());
    }

    #[test]
    fn error_formats_per_route_and_globally() {
        let c = ConfigFile::parse(
            r#"
errors = "stripe"
[[route]]
methods = ["POST"]
path = "/v1/**"
key = "required"
[[route]]
methods = ["POST"]
path = "/internal/**"
errors = "problem"
"#,
        )
        .unwrap()
        .apply(IdempotencyConfig::default())
        .unwrap();
        assert_eq!(
            c.error_format(&Method::POST, "/v1/charges"),
            ErrorFormat::Stripe
        );
        assert_eq!(
            c.error_format(&Method::POST, "/internal/x"),
            ErrorFormat::Problem
        );
        // No route matches: the file's format.
        assert_eq!(
            c.error_format(&Method::GET, "/v1/charges"),
            ErrorFormat::Stripe
        );
        assert!(ConfigFile::parse("errors = \"json\"").is_err());
        let d = IdempotencyConfig::default();
        assert_eq!(d.error_format(&Method::POST, "/x"), ErrorFormat::Problem);
    }
}
