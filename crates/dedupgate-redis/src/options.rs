//! Store options, read from the query string of the store URL so that one `--store` string says
//! everything: `redis://host:6379/0?wait_replicas=1&wait_timeout_ms=100`. Options the store does
//! not know are left in the URL for the `redis` crate (e.g. `protocol=resp3`).

use crate::OpenError;

/// How the store talks to Redis and what it asks of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// After each write, `WAIT` for this many replicas to acknowledge it (0: do not wait). A write
    /// that fewer replicas acknowledged in time is answered `unavailable`.
    pub wait_replicas: u32,
    /// How long `WAIT` may block, in ms.
    pub wait_timeout_ms: u64,
    /// First part of every key (`[A-Za-z0-9._:-]`, 1..=64 bytes), so stores can share a server.
    pub key_prefix: String,
    /// How long a record's key outlives the record's expiry, in ms: within this time a claim's
    /// fence increases even if Redis's clock stepped back (the expired record still holds it).
    pub fence_keep_ms: u64,
    /// Skip the `maxmemory-policy` check (for servers where `CONFIG` is disabled or renamed).
    /// The operator then vouches that the policy is `noeviction`.
    pub assume_noeviction: bool,
    /// How long one request may wait for its answer before it is `unavailable`, in ms.
    pub response_timeout_ms: u64,
    /// How long a connection attempt may take, in ms.
    pub connect_timeout_ms: u64,
    /// Most operations one script call decides (a batch is split into calls of this size, all
    /// sent in one pipeline). Bounded so one call never holds Redis for long.
    pub script_ops_max: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            wait_replicas: 0,
            wait_timeout_ms: 100,
            key_prefix: "dg".to_owned(),
            fence_keep_ms: 60 * 60 * 1000,
            assume_noeviction: false,
            response_timeout_ms: 2_000,
            connect_timeout_ms: 1_000,
            script_ops_max: 128,
        }
    }
}

/// Longest key prefix, in bytes.
pub const KEY_PREFIX_BYTES_MAX: usize = 64;
/// Most operations one script call may decide.
pub const SCRIPT_OPS_MAX: usize = 1_000;

impl RedisOptions {
    /// Splits the store's own options off `url`, returning them and the URL the `redis` crate
    /// gets (with every other query parameter kept).
    pub fn from_url(url: &str) -> Result<(Self, String), OpenError> {
        let mut opts = Self::default();
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => (url, ""),
        };
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let bad = |why: &str| OpenError::Option {
                name: name.to_owned(),
                reason: why.to_owned(),
            };
            let int = |max: u64| {
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|v| *v <= max)
                    .ok_or_else(|| bad(&format!("must be an integer 0..={max}, got {value:?}")))
            };
            match name {
                "wait_replicas" => opts.wait_replicas = int(1_000)? as u32,
                "wait_timeout_ms" => opts.wait_timeout_ms = int(60_000)?.max(1),
                "key_prefix" => {
                    let ok = !value.is_empty()
                        && value.len() <= KEY_PREFIX_BYTES_MAX
                        && value.chars().all(|c| {
                            c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
                        });
                    if !ok {
                        return Err(bad("must be 1..=64 bytes of [A-Za-z0-9._:-]"));
                    }
                    opts.key_prefix = value.to_owned();
                }
                "fence_keep_ms" => opts.fence_keep_ms = int(dedupgate_core::op::DURATION_MS_MAX)?,
                "assume_noeviction" => {
                    opts.assume_noeviction = match value {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(bad("must be true or false")),
                    }
                }
                "response_timeout_ms" => opts.response_timeout_ms = int(600_000)?.max(1),
                "connect_timeout_ms" => opts.connect_timeout_ms = int(600_000)?.max(1),
                "script_ops_max" => {
                    opts.script_ops_max = int(SCRIPT_OPS_MAX as u64)?.max(1) as usize
                }
                _ => rest.push(pair),
            }
        }
        let passed_on = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        Ok((opts, passed_on))
    }
}

/// The URL without its password, for logs.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{hosts}{tail}")
        }
        None => url.to_owned(),
    }
}

/// Splits `redis+cluster://[user:pass@]h1:p1,h2:p2[/][?query]` into one `redis://` URL per node.
pub fn cluster_nodes(url: &str) -> Result<Vec<String>, OpenError> {
    let rest = url.strip_prefix("redis+cluster://").ok_or_else(|| {
        OpenError::Url(format!(
            "{}: expected redis+cluster://host:port,…",
            redact(url)
        ))
    })?;
    let (authority, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    let authority = authority.trim_end_matches('/');
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| {
            let mut node = String::from("redis://");
            if let Some(u) = userinfo {
                node.push_str(u);
                node.push('@');
            }
            node.push_str(h);
            if let Some(q) = query {
                node.push('?');
                node.push_str(q);
            }
            node
        })
        .collect();
    if nodes.is_empty() {
        return Err(OpenError::Url(format!(
            "{}: name at least one node, e.g. redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
            redact(url)
        )));
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_options_are_split_off_and_others_kept() {
        let (o, url) = RedisOptions::from_url(
            "redis://h:1/2?wait_replicas=1&protocol=resp3&wait_timeout_ms=50",
        )
        .unwrap();
        assert_eq!(o.wait_replicas, 1);
        assert_eq!(o.wait_timeout_ms, 50);
        assert_eq!(url, "redis://h:1/2?protocol=resp3");
        let (o, url) = RedisOptions::from_url("redis://h").unwrap();
        assert_eq!(o, RedisOptions::default());
        assert_eq!(url, "redis://h");
    }

    #[test]
    fn bad_options_are_refused_clearly() {
        for bad in [
            "redis://h?wait_replicas=-1",
            "redis://h?wait_replicas=x",
            "redis://h?key_prefix=a{b}",
            "redis://h?key_prefix=",
            "redis://h?assume_noeviction=maybe",
        ] {
            let err = RedisOptions::from_url(bad).unwrap_err();
            assert!(matches!(err, OpenError::Option { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn cluster_urls_become_node_urls_and_passwords_are_redacted() {
        let nodes = cluster_nodes("redis+cluster://:pw@a:1,b:2/?protocol=resp3").unwrap();
        assert_eq!(
            nodes,
            [
                "redis://:pw@a:1?protocol=resp3",
                "redis://:pw@b:2?protocol=resp3"
            ]
        );
        assert!(cluster_nodes("redis+cluster://").is_err());
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
    }
}
