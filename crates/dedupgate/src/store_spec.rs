//! The STORE forms every `--store` and `--ledger` flag takes (API.md "Command line"), parsed once
//! and opened here, so every subcommand accepts the same spellings.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use dedupgate_core::{MemoryStore, Store};

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
    /// `tiered:FAST,DURABLE` — the fast store answers most duplicates; the durable one decides.
    Tiered(Box<StoreSpec>, Box<StoreSpec>),
}

/// The default data directory of the embedded store.
pub const DEFAULT_DATA_DIR: &str = "./dedupgate-data";

impl std::str::FromStr for StoreSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        if s.is_empty() {
            bail!("empty store: give a path, embedded:PATH, memory:, redis://…, redis+cluster://…, postgres://… or tiered:FAST,DURABLE");
        }
        if s == "memory:" || s == "memory" {
            return Ok(StoreSpec::Memory);
        }
        if let Some(rest) = s.strip_prefix("tiered:") {
            // Split at the first comma that starts a store spec (cluster specs hold commas).
            let (fast, durable) = split_tiered(rest)
                .with_context(|| format!("tiered store {s:?}: expected tiered:FAST,DURABLE"))?;
            return Ok(StoreSpec::Tiered(
                Box::new(fast.parse()?),
                Box::new(durable.parse()?),
            ));
        }
        if let Some(path) = s.strip_prefix("embedded:") {
            if path.is_empty() {
                bail!("embedded: needs a directory, e.g. embedded:./dedupgate-data");
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
        if let Some((scheme, _)) = s.split_once("://") {
            bail!("unknown store scheme {scheme:?}: use memory:, embedded:PATH, redis://, redis+cluster://, postgres:// or tiered:");
        }
        Ok(StoreSpec::Embedded(PathBuf::from(s)))
    }
}

fn split_tiered(rest: &str) -> Option<(&str, &str)> {
    const STARTS: [&str; 7] = [
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

/// Opens the store a spec names.
pub async fn open(spec: &StoreSpec) -> anyhow::Result<Arc<dyn Store>> {
    match spec {
        StoreSpec::Memory => Ok(Arc::new(MemoryStore::new())),
        StoreSpec::Embedded(dir) => {
            let dir = dir.clone();
            // Opening replays the engine journal: file I/O, kept off the async workers.
            let store = tokio::task::spawn_blocking(move || {
                dedupgate_embedded::EmbeddedStore::open(
                    &dir,
                    dedupgate_embedded::EmbeddedOptions::default(),
                )
                .with_context(|| format!("opening the embedded store in {}", dir.display()))
            })
            .await
            .context("the embedded store's open task failed")??;
            Ok(Arc::new(store))
        }
        StoreSpec::Postgres(url) => {
            let store = dedupgate_postgres::PgStore::open(url)
                .await
                .context("opening the PostgreSQL store")?;
            Ok(Arc::new(store))
        }
        StoreSpec::Redis(url) | StoreSpec::RedisCluster(url) => {
            let store = dedupgate_redis::RedisStore::open(url)
                .await
                .with_context(|| {
                    format!("opening the Redis store {}", dedupgate_redis::redact(url))
                })?;
            Ok(Arc::new(store))
        }
        StoreSpec::Tiered(fast, durable) => {
            let fast = Box::pin(open(fast))
                .await
                .context("opening the fast tier of the tiered store")?;
            let durable = Box::pin(open(durable))
                .await
                .context("opening the durable tier of the tiered store")?;
            Ok(Arc::new(dedupgate_tiered::TieredStore::new(fast, durable)))
        }
    }
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
        assert!("ftp://x".parse::<StoreSpec>().is_err());
        assert!("".parse::<StoreSpec>().is_err());
        assert!("tiered:memory:".parse::<StoreSpec>().is_err());
    }
}
