//! The STORE forms every `--store` and `--ledger` flag takes (API.md "Command line"), parsed once
//! and opened here, so the binary and the torture harness accept the same spellings.
//!
//! - [`StoreSpec`]: a parsed STORE string (`memory:`, a path or `embedded:PATH`, `redis://…`,
//!   `redis+cluster://…`, `postgres://…`, `tiered:FAST,DURABLE`, or `http://…`/`https://…`
//!   for another dedupgate reached over its HTTP API); parsing fails with a [`SpecError`].
//! - [`open`]: the store a spec names, as an `Arc<dyn Store>` ([`open_with`] when
//!   [`OpenOptions`] are not the defaults); failures are an
//!   [`OpenStoreError`] that names the store with its password redacted ([`redact`]) and keeps
//!   the store's own error as its source (so callers can still match, e.g., a locked directory).
//! - [`open_with_key_set`]: the same, and the store's [`dedupgate_core::KeySet`] when it keeps
//!   one (for `dedup`'s ledger), so no face names a concrete store.
//! - [`open_or_pending`]: the same, but a store whose server is unavailable at start becomes a
//!   [`PendingStore`] answering `unavailable` while it keeps opening in the background.
//!
//! Each engine is a cargo feature (`embedded`, `redis`, `postgres`, `tiered`, `http`), so a
//! build can leave out the ones it does not use. Every STORE form still parses in every build;
//! opening one whose engine was left out is refused with [`OpenStoreError::NotBuilt`], which
//! names the feature to build with.

use std::path::PathBuf;
use std::sync::Arc;

use dedupgate_core::{MemoryStore, Store};

mod pending;
pub use pending::{open_or_pending, Backoff, PendingStore};
mod key_set;
pub use key_set::WithKeySet;
#[cfg(feature = "embedded")]
pub use key_set::{open_with_key_set, EmbeddedOptions, KEY_SET_MEMORY_IDS_DEFAULT};

/// Where the gate keeps its records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// `memory:` — forgets on restart; for tests and trials.
    Memory,
    /// A path, or `embedded:PATH` — the durable default.
    Embedded(PathBuf),
    /// `redis://…` or `rediss://…`.
    Redis(String),
    /// `redis+cluster://host:port,host:port,…`.
    RedisCluster(String),
    /// `postgres://…` or `postgresql://…`.
    Postgres(String),
    /// `http://…` or `https://…`: another dedupgate, through its HTTP API.
    Http(String),
    /// `tiered:FAST,DURABLE` — the fast store answers most duplicates; the durable one decides.
    Tiered(Box<StoreSpec>, Box<StoreSpec>),
}

/// The default data directory of the embedded store.
pub const DEFAULT_DATA_DIR: &str = "./dedupgate-data";

/// Why a STORE string does not parse.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// Nothing was given.
    #[error("empty store: give a path, embedded:PATH, memory:, redis://…, redis+cluster://…, postgres://… or tiered:FAST,DURABLE")]
    Empty,
    /// `tiered:` without a comma before a recognisable durable spec.
    #[error("tiered store {spec:?}: expected tiered:FAST,DURABLE")]
    Tiered {
        /// The STORE string, password redacted.
        spec: String,
    },
    /// `embedded:` with no directory.
    #[error("embedded: needs a directory, e.g. embedded:./dedupgate-data")]
    EmbeddedNoPath,
    /// A `scheme://` the gate has no store for.
    #[error("unknown store scheme {scheme:?}: use memory:, embedded:PATH, redis://, redis+cluster://, postgres:// or tiered:")]
    UnknownScheme {
        /// The scheme as given.
        scheme: String,
    },
    /// `memory:` followed by something: the memory store takes no argument.
    #[error("memory: takes no argument (got {spec:?}): give memory: alone")]
    MemoryArgument {
        /// The STORE string.
        spec: String,
    },
    /// A known scheme without its `//` (`redis:/host`), or another `word:` prefix: a URL
    /// spelled wrong, not a directory name.
    #[error("{spec:?} is not a store form: {hint}")]
    Malformed {
        /// The STORE string, password redacted.
        spec: String,
        /// What to write instead.
        hint: String,
    },
}

/// Why a store would not open. Each variant keeps the store's own error as its source, and its
/// message names the store (password redacted) once: not again when that error names it.
#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    /// The embedded store refused to open (locked directory, corrupt journal, I/O).
    #[cfg(feature = "embedded")]
    #[error("cannot open the embedded store{}", unless_named(&dir.display().to_string(), source))]
    Embedded {
        /// The data directory.
        dir: PathBuf,
        /// The store's error.
        #[source]
        source: dedupgate_embedded::OpenError,
    },
    /// The blocking task that opens the embedded store panicked or was cancelled.
    #[error("cannot open the embedded store: its open task failed")]
    EmbeddedTask(#[source] tokio::task::JoinError),
    /// The PostgreSQL store refused to open.
    #[cfg(feature = "postgres")]
    #[error("cannot open the PostgreSQL store{}", unless_named(spec, source))]
    Postgres {
        /// The URL, password redacted.
        spec: String,
        /// The store's error.
        #[source]
        source: dedupgate_postgres::PgError,
    },
    /// The Redis (or Redis Cluster) store refused to open.
    #[cfg(feature = "redis")]
    #[error("cannot open the Redis store{}", unless_named(spec, source))]
    Redis {
        /// The URL, password redacted.
        spec: String,
        /// The store's error.
        #[source]
        source: dedupgate_redis::OpenError,
    },
    /// The HTTP store's client would not build (the URL is unusable).
    #[cfg(feature = "http")]
    #[error("cannot open the HTTP store{}", unless_named(spec, source))]
    Http {
        /// The URL, password redacted.
        spec: String,
        /// The client's error.
        #[source]
        source: dedupgate_client::ClientError,
    },
    /// The fast tier of a tiered store refused to open.
    #[error("cannot open the tiered store's fast tier")]
    TieredFast(#[source] Box<OpenStoreError>),
    /// The durable tier of a tiered store refused to open.
    #[error("cannot open the tiered store's durable tier")]
    TieredDurable(#[source] Box<OpenStoreError>),
    /// The STORE form names an engine this build left out: refused, rather than guessed at,
    /// so the user learns which feature to build with.
    #[error("{form} stores need dedupgate built with the {feature:?} feature")]
    NotBuilt {
        /// The form as the user writes it (`redis://`, `embedded:PATH`…).
        form: &'static str,
        /// The cargo feature that compiles the engine in.
        feature: &'static str,
    },
}

/// `" {name}"`, or nothing when `source`'s message already names the store (its directory, or
/// a URL: the PostgreSQL and Redis stores name theirs, the password left out).
#[cfg(any(feature = "embedded", feature = "redis", feature = "postgres"))]
fn unless_named(name: &str, source: &dyn std::fmt::Display) -> String {
    let said = source.to_string();
    if said.contains(name) || (name.contains("://") && said.contains("://")) {
        String::new()
    } else {
        format!(" {name}")
    }
}

impl OpenStoreError {
    /// True when an embedded store directory (in either tier) is locked by another process:
    /// the one failure worth waiting out.
    pub fn is_locked(&self) -> bool {
        match self {
            #[cfg(feature = "embedded")]
            OpenStoreError::Embedded { source, .. } => {
                matches!(source, dedupgate_embedded::OpenError::Locked { .. })
            }
            OpenStoreError::TieredFast(e) | OpenStoreError::TieredDurable(e) => e.is_locked(),
            _ => false,
        }
    }

    /// True when the store's server (Redis, PostgreSQL, in either tier) could not be reached or
    /// did not answer: a failure that may pass, as opposed to a refusal of the URL, options or
    /// configuration, or a server that answers but refuses the login or the database (a wrong
    /// or missing Redis password, PostgreSQL SQLSTATE class 28, 3D or 42). An embedded store's
    /// failures are never this: its disk is local.
    pub fn is_unavailable(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            OpenStoreError::Redis { source, .. } => matches!(
                source,
                dedupgate_redis::OpenError::Connect { .. }
                    | dedupgate_redis::OpenError::Unavailable { .. }
            ),
            #[cfg(feature = "postgres")]
            OpenStoreError::Postgres { source, .. } => {
                matches!(source, dedupgate_postgres::PgError::Unavailable(_))
            }
            OpenStoreError::TieredFast(e) | OpenStoreError::TieredDurable(e) => e.is_unavailable(),
            _ => false,
        }
    }
}

/// A STORE string (or URL) without its password, for messages and logs: the userinfo password
/// (of each URL: a tiered spec holds two) and any `password=` query value become `***`; a URL
/// that gives no password is left as it is.
pub fn redact(spec: &str) -> String {
    let mut s = String::with_capacity(spec.len());
    let mut rest = spec;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        s.push_str(head);
        // The authority ends at the path, the query, or the next URL of a tiered spec.
        let end = [tail.find(['/', '?', '#']), tail.find("://")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(tail.len());
        let (authority, after) = tail.split_at(end);
        match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                match userinfo.split_once(':') {
                    Some((user, _password)) => s.push_str(&format!("{user}:***")),
                    None => s.push_str(userinfo),
                }
                s.push('@');
                s.push_str(hosts);
            }
            None => s.push_str(authority),
        }
        rest = after;
    }
    s.push_str(rest);
    let Some((head, query)) = s.split_once('?') else {
        return s;
    };
    let query: Vec<String> = query
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_owned(),
        })
        .collect();
    format!("{head}?{}", query.join("&"))
}

impl std::str::FromStr for StoreSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(SpecError::Empty);
        }
        if s == "memory:" || s == "memory" {
            return Ok(StoreSpec::Memory);
        }
        if s.starts_with("memory:") {
            return Err(SpecError::MemoryArgument { spec: redact(s) });
        }
        if let Some(rest) = s.strip_prefix("tiered:") {
            // Split at the first comma that starts a store spec (cluster specs hold commas).
            let (fast, durable) =
                split_tiered(rest).ok_or_else(|| SpecError::Tiered { spec: redact(s) })?;
            return Ok(StoreSpec::Tiered(
                Box::new(fast.parse()?),
                Box::new(durable.parse()?),
            ));
        }
        if let Some(path) = s.strip_prefix("embedded:") {
            if path.is_empty() {
                return Err(SpecError::EmbeddedNoPath);
            }
            return Ok(StoreSpec::Embedded(PathBuf::from(path)));
        }
        if s.starts_with("redis+cluster://") {
            return Ok(StoreSpec::RedisCluster(s.to_owned()));
        }
        if s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("redis+unix://")
        {
            return Ok(StoreSpec::Redis(s.to_owned()));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(StoreSpec::Postgres(s.to_owned()));
        }
        if s.starts_with("http://") || s.starts_with("https://") {
            return Ok(StoreSpec::Http(s.to_owned()));
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(SpecError::UnknownScheme {
                scheme: scheme.to_owned(),
            });
        }
        if let Some(hint) = malformed_hint(s) {
            return Err(SpecError::Malformed {
                spec: redact_malformed(s),
                hint,
            });
        }
        Ok(StoreSpec::Embedded(PathBuf::from(s)))
    }
}

/// [`redact`] for a `scheme:` string whose `//` is missing or short (`redis:/u:pw@h`).
fn redact_malformed(s: &str) -> String {
    let Some((scheme, rest)) = s.split_once(':') else {
        return redact(s);
    };
    let authority = rest.trim_start_matches('/');
    let slashes = &rest[..rest.len() - authority.len()];
    let redacted = redact(&format!("{scheme}://{authority}"));
    let authority = redacted.split_once("://").map_or("", |(_, a)| a);
    format!("{scheme}:{slashes}{authority}")
}

/// URL schemes of the store forms, each as it must be written.
const URL_SCHEMES: [&str; 8] = [
    "http",
    "https",
    "redis",
    "rediss",
    "redis+unix",
    "redis+cluster",
    "postgres",
    "postgresql",
];

/// What to write instead of `s` when it looks like a scheme (`word:` at its start, two
/// characters or more, so `C:` stays a path) but is no store form: `redis:/host` and
/// `postgres:host/db` are URLs with their `//` missing, not directory names. `None` when `s`
/// does not look like one.
fn malformed_hint(s: &str) -> Option<String> {
    let (scheme, rest) = s.split_once(':')?;
    let looks_like_scheme = scheme.len() >= 2
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !looks_like_scheme {
        return None;
    }
    let lower = scheme.to_ascii_lowercase();
    let hint = if URL_SCHEMES.contains(&lower.as_str()) {
        let url = format!("{lower}://{}", rest.trim_start_matches('/'));
        format!("did you mean {}?", redact(&url))
    } else if matches!(lower.as_str(), "embedded" | "tiered" | "memory") {
        format!("write {lower}: in lowercase")
    } else {
        format!(
            "use a path, embedded:PATH, memory:, redis://…, redis+cluster://…, postgres://… or \
             tiered:FAST,DURABLE (a directory whose name has a colon: ./{})",
            redact(s)
        )
    };
    Some(hint)
}

/// Splits `FAST,DURABLE` at the first comma followed by the start of a store spec: cluster
/// URLs hold commas of their own.
fn split_tiered(rest: &str) -> Option<(&str, &str)> {
    const STARTS: [&str; 9] = [
        "http://",
        "https://",
        "memory:",
        "embedded:",
        "redis://",
        "rediss://",
        "redis+cluster://",
        "postgres://",
        "postgresql://",
    ];
    rest.match_indices(',').map(|(i, _)| i).find_map(|i| {
        let (fast, durable) = (&rest[..i], &rest[i + 1..]);
        STARTS
            .iter()
            .any(|p| durable.starts_with(p))
            .then_some((fast, durable))
    })
}

impl Default for StoreSpec {
    fn default() -> Self {
        StoreSpec::Embedded(PathBuf::from(DEFAULT_DATA_DIR))
    }
}

/// Opens the embedded store in `dir` with `options`, as itself rather than as a [`Store`] (for
/// what only it offers, such as its key set).
#[cfg(feature = "embedded")]
pub async fn open_embedded(
    dir: &std::path::Path,
    options: dedupgate_embedded::EmbeddedOptions,
) -> Result<Arc<dedupgate_embedded::EmbeddedStore>, OpenStoreError> {
    let dir = dir.to_owned();
    // Opening replays the engine journal: file I/O, kept off the async workers.
    let store = tokio::task::spawn_blocking(move || {
        dedupgate_embedded::EmbeddedStore::open(&dir, options)
            .map_err(|source| OpenStoreError::Embedded { dir, source })
    })
    .await
    .map_err(OpenStoreError::EmbeddedTask)??;
    Ok(Arc::new(store))
}

/// How stores are opened beyond what their STORE string says.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    /// How an `http://…` store calls its server (by default the client's safe retries).
    #[cfg(feature = "http")]
    pub http: dedupgate_client::HttpStoreOptions,
}

/// Opens the store a spec names, with the default [`OpenOptions`].
pub async fn open(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenStoreError> {
    open_with(spec, &OpenOptions::default()).await
}

/// Opens the store a spec names, as `options` say.
// Only the HTTP store reads the options, and a tiered store passes them to its tiers.
#[cfg_attr(
    not(any(feature = "http", feature = "tiered")),
    allow(unused_variables)
)]
pub async fn open_with(
    spec: &StoreSpec,
    options: &OpenOptions,
) -> Result<Arc<dyn Store>, OpenStoreError> {
    match spec {
        StoreSpec::Memory => Ok(Arc::new(MemoryStore::new())),
        #[cfg(feature = "http")]
        StoreSpec::Http(url) => {
            let store = dedupgate_client::HttpStore::new(url, options.http).map_err(|source| {
                OpenStoreError::Http {
                    spec: redact(url),
                    source,
                }
            })?;
            Ok(Arc::new(store))
        }
        // The binary's feature, named as the user builds it (this crate's is `http`).
        #[cfg(not(feature = "http"))]
        StoreSpec::Http(_) => Err(not_built("http://", "http-client")),
        #[cfg(feature = "embedded")]
        StoreSpec::Embedded(dir) => Ok(open_embedded(dir, Default::default()).await?),
        #[cfg(not(feature = "embedded"))]
        StoreSpec::Embedded(_) => Err(not_built("embedded:PATH (or a path)", "embedded")),
        #[cfg(feature = "postgres")]
        StoreSpec::Postgres(url) => {
            let store = dedupgate_postgres::PgStore::open(url)
                .await
                .map_err(|source| OpenStoreError::Postgres {
                    spec: redact(url),
                    source,
                })?;
            Ok(Arc::new(store))
        }
        #[cfg(not(feature = "postgres"))]
        StoreSpec::Postgres(_) => Err(not_built("postgres://", "postgres")),
        #[cfg(feature = "redis")]
        StoreSpec::Redis(url) | StoreSpec::RedisCluster(url) => {
            let store = dedupgate_redis::RedisStore::open(url)
                .await
                .map_err(|source| OpenStoreError::Redis {
                    spec: redact(url),
                    source,
                })?;
            Ok(Arc::new(store))
        }
        #[cfg(not(feature = "redis"))]
        StoreSpec::Redis(_) => Err(not_built("redis://", "redis")),
        #[cfg(not(feature = "redis"))]
        StoreSpec::RedisCluster(_) => Err(not_built("redis+cluster://", "redis")),
        #[cfg(feature = "tiered")]
        StoreSpec::Tiered(fast, durable) => {
            let fast = Box::pin(open_with(fast, options))
                .await
                .map_err(|e| OpenStoreError::TieredFast(Box::new(e)))?;
            let durable = Box::pin(open_with(durable, options))
                .await
                .map_err(|e| OpenStoreError::TieredDurable(Box::new(e)))?;
            Ok(Arc::new(dedupgate_tiered::TieredStore::new(fast, durable)))
        }
        #[cfg(not(feature = "tiered"))]
        StoreSpec::Tiered(..) => Err(not_built("tiered:", "tiered")),
    }
}

/// The refusal of a STORE form whose engine this build left out.
#[cfg(not(all(
    feature = "embedded",
    feature = "redis",
    feature = "postgres",
    feature = "tiered",
    feature = "http"
)))]
fn not_built(form: &'static str, feature: &'static str) -> OpenStoreError {
    OpenStoreError::NotBuilt { form, feature }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("memory:".parse::<StoreSpec>().unwrap(), StoreSpec::Memory);
        assert_eq!(
            "./data".parse::<StoreSpec>().unwrap(),
            StoreSpec::Embedded("./data".into())
        );
        assert_eq!(
            "embedded:/var/lib/dg".parse::<StoreSpec>().unwrap(),
            StoreSpec::Embedded("/var/lib/dg".into())
        );
        let tiered: StoreSpec = "tiered:redis+cluster://a:1,b:2,postgres://u@h/db"
            .parse()
            .unwrap();
        assert_eq!(
            tiered,
            StoreSpec::Tiered(
                Box::new(StoreSpec::RedisCluster("redis+cluster://a:1,b:2".into())),
                Box::new(StoreSpec::Postgres("postgres://u@h/db".into()))
            )
        );
        assert_eq!(
            "http://127.0.0.1:7878".parse::<StoreSpec>().unwrap(),
            StoreSpec::Http("http://127.0.0.1:7878".into())
        );
        assert_eq!(
            " https://gate.example/base ".parse::<StoreSpec>().unwrap(),
            StoreSpec::Http("https://gate.example/base".into())
        );
        assert_eq!(
            "tiered:memory:,http://h:1".parse::<StoreSpec>().unwrap(),
            StoreSpec::Tiered(
                Box::new(StoreSpec::Memory),
                Box::new(StoreSpec::Http("http://h:1".into()))
            )
        );
        assert!("ftp://x".parse::<StoreSpec>().is_err());
        assert!("".parse::<StoreSpec>().is_err());
        assert!("tiered:memory:".parse::<StoreSpec>().is_err());
    }

    #[test]
    fn refuses_what_only_looks_like_a_path() {
        let err = |s: &str| s.parse::<StoreSpec>().unwrap_err().to_string();
        assert!(
            err("memory:foo").contains("memory: takes no argument"),
            "{}",
            err("memory:foo")
        );
        assert!(err("redis:/host").contains("did you mean redis://host?"));
        assert!(err("http:/h:7878").contains("did you mean http://h:7878?"));
        assert!(err("rediss:host:6380").contains("did you mean rediss://host:6380?"));
        assert!(err("postgresql:/u@h/db").contains("did you mean postgresql://u@h/db?"));
        assert!(err("Redis://h").contains("\"Redis\""));
        let secret = err("postgres:/u:secret@h/db");
        assert!(!secret.contains("secret") && secret.contains("postgres://u:***@h/db"));
        assert!(err("sqlite:data.db").contains("./sqlite:data.db"));
        assert!(err("Embedded:dir").contains("lowercase"));
        // Paths stay paths, colons and all, when they do not start like a scheme.
        for path in ["./redis:/host", "C:/data", "data", "/var/lib/a:b", "1:2"] {
            assert_eq!(
                path.parse::<StoreSpec>().unwrap(),
                StoreSpec::Embedded(path.into()),
                "{path}"
            );
        }
    }

    #[test]
    fn masks_only_a_password_that_was_given() {
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        assert_eq!(redact("http://h:7878"), "http://h:7878");
        assert_eq!(
            redact("https://u:pw@gate.example:8443/base"),
            "https://u:***@gate.example:8443/base"
        );
        assert_eq!(redact("redis://:pw@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(
            redact("tiered:redis://u:one@h:1,postgres://u:two@h/db"),
            "tiered:redis://u:***@h:1,postgres://u:***@h/db"
        );
        assert_eq!(
            redact("redis+cluster://u:pw@a:1,b:2"),
            "redis+cluster://u:***@a:1,b:2"
        );
    }

    /// Every form parses in every build; opening one whose engine was left out is refused by
    /// name, with the feature to build with, and is no passing unavailability.
    #[tokio::test]
    async fn a_form_whose_engine_was_left_out_names_its_feature() {
        let left_out: Vec<(&str, &str)> = [
            (
                "embedded:./no-such-dir",
                "embedded",
                cfg!(feature = "embedded"),
            ),
            ("redis://127.0.0.1:1", "redis", cfg!(feature = "redis")),
            (
                "redis+cluster://127.0.0.1:1",
                "redis",
                cfg!(feature = "redis"),
            ),
            (
                "postgres://u@127.0.0.1:1/db",
                "postgres",
                cfg!(feature = "postgres"),
            ),
            ("tiered:memory:,memory:", "tiered", cfg!(feature = "tiered")),
            ("http://127.0.0.1:1", "http-client", cfg!(feature = "http")),
        ]
        .into_iter()
        .filter(|(_, _, built)| !built)
        .map(|(spec, feature, _)| (spec, feature))
        .collect();
        for (spec, feature) in left_out {
            let err = open(&spec.parse().unwrap()).await.err().expect(spec);
            let form = spec
                .split_once("//")
                .map_or(spec.split(':').next().unwrap(), |p| p.0);
            let said = err.to_string();
            assert!(said.starts_with(form), "{spec}: {said}");
            assert!(
                said.ends_with(&format!(
                    "need dedupgate built with the \"{feature}\" feature"
                )),
                "{spec}: {said}"
            );
            assert!(!err.is_unavailable() && !err.is_locked(), "{spec}");
        }
        assert!(open(&StoreSpec::Memory).await.is_ok());
    }

    /// An `http://` store is the client's: it opens without a server (nothing is sent until
    /// a call) and a call to no server is an unknown outcome, not a refusal.
    #[cfg(feature = "http")]
    #[tokio::test]
    async fn an_http_store_opens_and_a_call_to_no_server_is_unavailable() {
        let options = OpenOptions {
            http: dedupgate_client::HttpStoreOptions::without_retries(),
        };
        let store = open_with(&"http://127.0.0.1:1".parse().unwrap(), &options)
            .await
            .unwrap();
        assert_eq!(store.describe(), "http: http://127.0.0.1:1");
        assert!(matches!(
            store.health().await,
            Err(dedupgate_core::StoreError::Unavailable(_))
        ));
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://u:secret@h/db?password=also&sslmode=disable"),
            "postgres://u:***@h/db?password=***&sslmode=disable"
        );
        let err = "tiered:redis://u:secret@h:1"
            .parse::<StoreSpec>()
            .unwrap_err()
            .to_string();
        assert!(!err.contains("secret"), "{err}");
    }
}
