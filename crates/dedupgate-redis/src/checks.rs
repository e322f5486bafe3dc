//! The open-time checks: a server (or any master of a cluster) whose eviction policy could drop
//! records, or older than Redis 7.0, is refused, and an error of the checks is told apart from an
//! unavailable server.

use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Value};

use crate::conn::{is_auth_refusal, server_busy, Conn};
use crate::reply::text;
use crate::store::Inner;
use crate::OpenError;

impl Inner {
    /// Refuses servers that may evict keys: an evicted record lets a duplicate through. With
    /// `assume_noeviction` the policy is not read, but a `PING` still checks that the
    /// connection is authenticated (a server that requires a password answers `NOAUTH` to
    /// every command, which no retry cures).
    pub(crate) async fn check_eviction_policy(&self, shown: &str) -> Result<(), OpenError> {
        let cmd = if self.opts.assume_noeviction {
            redis::cmd("PING")
        } else {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("GET").arg("maxmemory-policy");
            cmd
        };
        let replies = self.ask_every_master(cmd, shown).await?;
        if self.opts.assume_noeviction {
            return Ok(());
        }
        for (node, v) in replies {
            let policy = policy_of(&v).ok_or_else(|| OpenError::ConfigUnavailable {
                url: node.clone(),
                reason: format!("unexpected CONFIG GET reply {v:?}"),
            })?;
            if policy != "noeviction" {
                return Err(OpenError::EvictionPolicy { url: node, policy });
            }
        }
        Ok(())
    }

    /// Refuses servers older than 7.0, which would fail every claim with a syntax error. A server
    /// that does not say its version in `INFO server` (a proxy, a restricted user) is let
    /// through: the first claim then reports the server's own error.
    pub(crate) async fn check_version(&self, shown: &str) -> Result<(), OpenError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server");
        let replies = match self.ask_every_master(cmd, shown).await {
            Ok(replies) => replies,
            // INFO disabled or not allowed: nothing to judge by.
            Err(OpenError::ConfigUnavailable { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        for (node, v) in replies {
            let info = match v {
                Value::VerbatimString { text, .. } => text,
                other => match text(&other) {
                    Some(info) => info,
                    None => continue,
                },
            };
            if let Some(version) = too_old(&info) {
                return Err(OpenError::Version { url: node, version });
            }
        }
        Ok(())
    }

    /// Sends `cmd` to the server, or to every master of a cluster, and returns each node's reply.
    pub(crate) async fn ask_every_master(
        &self,
        cmd: Cmd,
        shown: &str,
    ) -> Result<Vec<(String, Value)>, OpenError> {
        let replies: Vec<(String, Value)> = match &self.conn {
            Conn::Single(h) => vec![(shown.to_owned(), h.command(&cmd).await)],
            Conn::Cluster(h) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match h.current().route_command(cmd, routing).await {
                    Ok(Value::Map(per_node)) => per_node
                        .into_iter()
                        .map(|(node, v)| (text(&node).unwrap_or_default(), Ok(v)))
                        .collect(),
                    other => vec![(shown.to_owned(), other)],
                }
            }
        }
        .into_iter()
        .map(|(node, r)| match r {
            Ok(Value::ServerError(e)) => (node, Err(redis::RedisError::from(e))),
            other => (node, other),
        })
        .map(|(node, r)| {
            r.map(|v| (node.clone(), v))
                .map_err(|e| check_error(node, e))
        })
        .collect::<Result<_, _>>()?;
        Ok(replies)
    }
}

/// An open-time check that failed. Only the server's own refusal (an error reply: `CONFIG`
/// unknown or renamed, no permission) says something about its configuration; a dropped
/// connection, a reply cut short or unreadable, a timeout, or a server busy loading or with its
/// cluster down is the store being unavailable, and worth retrying.
fn check_error(url: String, e: redis::RedisError) -> OpenError {
    use redis::ErrorKind;
    let refused = !server_busy(&e)
        && matches!(
            e.kind(),
            ErrorKind::Server(_)
                | ErrorKind::Extension
                | ErrorKind::AuthenticationFailed
                | ErrorKind::UnexpectedReturnType
        );
    let reason = e.to_string();
    if is_auth_refusal(&e) {
        // Not a CONFIG problem: the connection itself is not authenticated.
        OpenError::Auth { url, reason }
    } else if refused {
        OpenError::ConfigUnavailable { url, reason }
    } else {
        OpenError::Unavailable { url, reason }
    }
}

/// The version an `INFO server` reply gives, when it is below 7.0.
fn too_old(info: &str) -> Option<String> {
    let version = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let major: u32 = version.split('.').next()?.parse().ok()?;
    (major < 7).then(|| version.to_owned())
}

fn policy_of(v: &Value) -> Option<String> {
    match v {
        Value::Array(items) if items.len() == 2 => text(&items[1]),
        Value::Map(pairs) if pairs.len() == 1 => text(&pairs[0].1),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_before_7_0_are_too_old() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_git_sha1:0\r\n");
        assert_eq!(too_old(&info("6.2.14")), Some("6.2.14".to_owned()));
        assert_eq!(too_old(&info("5.0.7")), Some("5.0.7".to_owned()));
        assert_eq!(too_old(&info("7.0.15")), None);
        assert_eq!(too_old(&info("7.4.1")), None);
        assert_eq!(too_old(&info("255.255.255")), None);
        // A reply without a readable version is not judged.
        assert_eq!(too_old("# Server\r\nuptime_in_seconds:3\r\n"), None);
        assert_eq!(too_old(&info("unknown")), None);
    }
}
