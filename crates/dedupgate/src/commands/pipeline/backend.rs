//! Where the CLI's gate lives: a STORE opened in this process, or a dedupgate server reached
//! with the client crate. Either way the core decides; this module only carries calls.
//!
//! The embedded store locks its directory for one process. A cron gate must let a second
//! `run` of the same key see the first one's claim while the first is still running, so for
//! `run` the embedded store is opened around each operation only ([`Backend::per_op`]) and a
//! locked directory is retried for a bounded time instead of failing at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use dedupgate_client::{Client, ClientError, MarkOptions};
use dedupgate_core::{
    Claim, ClaimOptions, Gate, GateError, Mark, Op, Outcome, Record, RecordId, Store, Token,
};
use serde_json::{json, Value};

use dedupgate_stores::{self as store_spec, StoreSpec};

/// How long an open waits for another process to let go of an embedded store directory.
pub const DEFAULT_LOCK_WAIT_MS: u64 = 30_000;
/// Pause between two tries of a locked directory.
const LOCK_RETRY_MS: u64 = 25;

/// A gate reached in-process or over HTTP. Cheap to clone.
#[derive(Clone)]
pub enum Backend {
    /// A store opened in this process.
    Local {
        /// The store's spec (to reopen it per operation).
        spec: StoreSpec,
        /// The open store, unless it is opened per operation.
        gate: Option<Gate>,
        /// Longest wait for a locked directory.
        lock_wait_ms: u64,
    },
    /// A dedupgate server.
    Remote(Client),
}

async fn open_waiting(spec: &StoreSpec, lock_wait_ms: u64) -> anyhow::Result<Arc<dyn Store>> {
    let started = Instant::now();
    loop {
        match store_spec::open(spec).await {
            Ok(store) => return Ok(store),
            Err(e) if e.is_locked() && started.elapsed().as_millis() < u128::from(lock_wait_ms) => {
                tokio::time::sleep(Duration::from_millis(LOCK_RETRY_MS)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl Backend {
    /// A server at `url`, or the store `spec` held open for the whole command.
    pub async fn open(
        spec: Option<StoreSpec>,
        server: Option<&str>,
        lock_wait_ms: u64,
    ) -> anyhow::Result<Self> {
        if let Some(url) = server {
            return Ok(Backend::Remote(
                Client::new(url).with_context(|| format!("server {url}"))?,
            ));
        }
        let spec = spec.unwrap_or_default();
        let store = open_waiting(&spec, lock_wait_ms)
            .await
            .with_context(|| format!("opening store {}", describe(&spec)))?;
        Ok(Backend::Local {
            spec,
            gate: Some(Gate::from_arc(store)),
            lock_wait_ms,
        })
    }

    /// Like [`Backend::open`], but an embedded store is opened around each call only, so other
    /// processes can use it between calls (the cron gate).
    pub async fn per_op(
        spec: Option<StoreSpec>,
        server: Option<&str>,
        lock_wait_ms: u64,
    ) -> anyhow::Result<Self> {
        let spec_or_default = spec.clone().unwrap_or_default();
        if server.is_none() && matches!(spec_or_default, StoreSpec::Embedded(_)) {
            // Open once now so a bad directory fails before anything runs.
            drop(
                open_waiting(&spec_or_default, lock_wait_ms)
                    .await
                    .with_context(|| format!("opening store {}", describe(&spec_or_default)))?,
            );
            return Ok(Backend::Local {
                spec: spec_or_default,
                gate: None,
                lock_wait_ms,
            });
        }
        Self::open(spec, server, lock_wait_ms).await
    }

    /// The gate for one call: the held one, or a fresh open of the store.
    async fn gate(&self) -> anyhow::Result<Gate> {
        match self {
            Backend::Local {
                gate: Some(gate), ..
            } => Ok(gate.clone()),
            Backend::Local {
                spec,
                gate: None,
                lock_wait_ms,
            } => Ok(Gate::from_arc(
                open_waiting(spec, *lock_wait_ms)
                    .await
                    .with_context(|| format!("opening store {}", describe(spec)))?,
            )),
            Backend::Remote(_) => Err(anyhow!("no local gate for a server backend")),
        }
    }

    /// Claims a key.
    pub async fn claim(&self, ns: &str, key: &str, opts: ClaimOptions) -> anyhow::Result<Claim> {
        match self {
            Backend::Remote(c) => Ok(c.claim(ns, key, opts).await?),
            _ => Ok(self.gate().await?.claim(ns, key, opts).await?),
        }
    }

    /// Completes a claim, storing `result`.
    pub async fn complete(
        &self,
        ns: &str,
        key: &str,
        token: &Token,
        result: Option<Value>,
    ) -> anyhow::Result<Record> {
        match self {
            Backend::Remote(c) => Ok(c.complete(ns, key, token, result, None).await?),
            _ => Ok(self.gate().await?.complete(ns, key, token, result).await?),
        }
    }

    /// Releases a claim.
    pub async fn release(&self, ns: &str, key: &str, token: &Token) -> anyhow::Result<()> {
        match self {
            Backend::Remote(c) => Ok(c.release(ns, key, token).await?),
            _ => Ok(self.gate().await?.release(ns, key, token).await?),
        }
    }

    /// Renews a lease; the new lease end.
    pub async fn extend(
        &self,
        ns: &str,
        key: &str,
        token: &Token,
        lease_ms: u64,
    ) -> anyhow::Result<u64> {
        match self {
            Backend::Remote(c) => Ok(c.extend(ns, key, token, lease_ms).await?),
            _ => Ok(self.gate().await?.extend(ns, key, token, lease_ms).await?),
        }
    }

    /// Marks a key completed before running.
    pub async fn mark(
        &self,
        ns: &str,
        key: &str,
        ttl_ms: u64,
        result: Option<Value>,
    ) -> anyhow::Result<Mark> {
        match self {
            Backend::Remote(c) => Ok(c
                .mark(
                    ns,
                    key,
                    MarkOptions {
                        ttl_ms: Some(ttl_ms),
                        fingerprint: None,
                        result,
                    },
                )
                .await?),
            _ => Ok(self
                .gate()
                .await?
                .mark(ns, key, Some(ttl_ms), None, result)
                .await?),
        }
    }

    /// Claims many keys in one round trip (one group commit on the embedded store). Each item
    /// is that key's claim, or why it was refused.
    pub async fn claim_batch(
        &self,
        ns: &str,
        keys: &[String],
        ttl_ms: u64,
        lease_ms: u64,
        owner: &str,
    ) -> anyhow::Result<Vec<Result<Claim, String>>> {
        match self {
            Backend::Remote(c) => {
                let ops = keys
                    .iter()
                    .map(|k| json!({"op": "claim", "namespace": ns, "key": k, "ttl_ms": ttl_ms, "lease_ms": lease_ms, "owner": owner}))
                    .collect();
                let answers = c.batch(ops).await?;
                answers
                    .into_iter()
                    .map(|a| match a {
                        Ok(v) => serde_json::from_value::<Claim>(v)
                            .map(Ok)
                            .map_err(|e| anyhow!("unexpected claim answer from the server: {e}")),
                        Err(p) => Ok(Err(format!("{}: {}", p.code, p.detail))),
                    })
                    .collect()
            }
            _ => {
                let gate = self.gate().await?;
                let mut ops = Vec::with_capacity(keys.len());
                for k in keys {
                    ops.push((
                        RecordId::new(ns, k.as_str())?,
                        Op::Claim {
                            ttl_ms,
                            lease_ms,
                            fingerprint: None,
                            owner: Some(owner.to_owned()),
                        },
                    ));
                }
                let answers = gate.store().apply_batch(ops).await;
                Ok(answers
                    .into_iter()
                    .map(|a| match a {
                        Ok(Outcome::Claimed(c)) => Ok(c),
                        Ok(other) => Err(format!("unexpected outcome {}", other.label())),
                        Err(e) => Err(e.to_string()),
                    })
                    .collect())
            }
        }
    }

    /// Marks many keys in one round trip (the at-most-once ledger). Each item is true when the
    /// key was new, false for a duplicate, or why it was refused.
    pub async fn mark_batch(
        &self,
        ns: &str,
        keys: &[String],
        ttl_ms: u64,
    ) -> anyhow::Result<Vec<Result<bool, String>>> {
        let is_new = |m: Mark| matches!(m, Mark::New { .. });
        match self {
            Backend::Remote(c) => {
                let ops = keys
                    .iter()
                    .map(|k| json!({"op": "mark", "namespace": ns, "key": k, "ttl_ms": ttl_ms}))
                    .collect();
                c.batch(ops)
                    .await?
                    .into_iter()
                    .map(|a| match a {
                        Ok(v) => serde_json::from_value::<Mark>(v)
                            .map(|m| Ok(is_new(m)))
                            .map_err(|e| anyhow!("unexpected mark answer from the server: {e}")),
                        Err(p) => Ok(Err(format!("{}: {}", p.code, p.detail))),
                    })
                    .collect()
            }
            _ => {
                let gate = self.gate().await?;
                let mut ops = Vec::with_capacity(keys.len());
                for k in keys {
                    ops.push((
                        RecordId::new(ns, k.as_str())?,
                        Op::Mark {
                            ttl_ms,
                            fingerprint: None,
                            result: None,
                        },
                    ));
                }
                Ok(gate
                    .store()
                    .apply_batch(ops)
                    .await
                    .into_iter()
                    .map(|a| match a {
                        Ok(Outcome::Marked(m)) => Ok(is_new(m)),
                        Ok(other) => Err(format!("unexpected outcome {}", other.label())),
                        Err(e) => Err(e.to_string()),
                    })
                    .collect())
            }
        }
    }

    /// Completes many claims in one round trip. Fails as a whole if any completion failed:
    /// an uncompleted claim is re-offered after its lease, so the caller must know.
    /// The records are kept `ttl_ms` from now (a claim's own expiry is stretched to its lease).
    pub async fn complete_batch(
        &self,
        ns: &str,
        claims: &[(String, Token)],
        ttl_ms: u64,
    ) -> anyhow::Result<()> {
        if claims.is_empty() {
            return Ok(());
        }
        let failures: Vec<String> = match self {
            Backend::Remote(c) => {
                let ops = claims
                    .iter()
                    .map(|(k, t)| json!({"op": "complete", "namespace": ns, "key": k, "token": t.as_str(), "ttl_ms": ttl_ms}))
                    .collect();
                c.batch(ops)
                    .await?
                    .into_iter()
                    .filter_map(|a| a.err().map(|p| format!("{}: {}", p.code, p.detail)))
                    .collect()
            }
            _ => {
                let gate = self.gate().await?;
                let mut ops = Vec::with_capacity(claims.len());
                for (k, t) in claims {
                    ops.push((
                        RecordId::new(ns, k.as_str())?,
                        Op::Complete {
                            token: t.clone(),
                            result: None,
                            ttl_ms: Some(ttl_ms),
                        },
                    ));
                }
                gate.store()
                    .apply_batch(ops)
                    .await
                    .into_iter()
                    .filter_map(|a| a.err().map(|e| e.to_string()))
                    .collect()
            }
        };
        match failures.first() {
            None => Ok(()),
            Some(first) => Err(anyhow!(
                "{} of {} ledger completions failed (first: {first})",
                failures.len(),
                claims.len()
            )),
        }
    }

    /// Releases many claims (best effort, after a failure).
    pub async fn release_batch(&self, ns: &str, claims: &[(String, Token)]) {
        for (k, t) in claims {
            let _ = self.release(ns, k, t).await;
        }
    }

    /// What the backend is, for messages.
    pub fn describe(&self) -> String {
        match self {
            Backend::Local { spec, .. } => describe(spec),
            Backend::Remote(_) => "server".to_owned(),
        }
    }
}

/// True when the error is the gate's "lease lost".
pub fn is_lease_lost(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(c.downcast_ref::<GateError>(), Some(GateError::LeaseLost))
            || matches!(
                c.downcast_ref::<ClientError>(),
                Some(ClientError::Gate(GateError::LeaseLost))
            )
    })
}

/// A spec for messages (never a password: URLs are cut at their authority).
pub fn describe(spec: &StoreSpec) -> String {
    match spec {
        StoreSpec::Memory => "memory:".to_owned(),
        StoreSpec::Embedded(p) => format!("embedded:{}", p.display()),
        StoreSpec::Redis(u) | StoreSpec::RedisCluster(u) | StoreSpec::Postgres(u) => {
            match u.split_once("://") {
                Some((scheme, rest)) => {
                    let host = rest.rsplit('@').next().unwrap_or(rest);
                    format!("{scheme}://{host}")
                }
                None => u.clone(),
            }
        }
        StoreSpec::Tiered(a, b) => format!("tiered:{},{}", describe(a), describe(b)),
    }
}
