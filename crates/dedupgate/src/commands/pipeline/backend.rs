//! Where the CLI's gate lives: a STORE opened in this process, or a dedupgate server reached
//! with the client crate. Either way the core decides; this module only carries calls.
//!
//! The embedded store locks its directory for one process. A cron gate must let a second
//! `run` of the same key see the first one's claim while the first is still running, so for
//! `run` the embedded store is opened around each operation only ([`Backend::per_op`]) and a
//! locked directory is retried for a bounded time instead of failing at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "http-client")]
use anyhow::Context;
use anyhow::{anyhow, bail};
#[cfg(feature = "http-client")]
use dedupgate_client::{Client, ClientError, MarkOptions};
use dedupgate_core::{
    Claim, ClaimOptions, CompleteOptions, Gate, GateError, KeySet, Mark, Outcome, Record, RecordId,
    State, Token, ValidOp,
};
#[cfg(feature = "http-client")]
use serde_json::json;
use serde_json::Value;

use dedupgate_stores::{self as store_spec, EmbeddedOptions, StoreSpec, WithKeySet};

/// Pause between two tries of a locked directory.
const LOCK_RETRY_MS: u64 = 25;
/// How long a wait for a locked directory goes before it says so on stderr.
const LOCK_NOTICE_AFTER: Duration = Duration::from_secs(1);

/// A gate reached in-process or over HTTP. Cheap to clone.
#[derive(Clone)]
pub enum Backend {
    /// A store opened in this process.
    Local {
        /// The store's spec (to reopen it per operation).
        spec: StoreSpec,
        /// The open store, unless it is opened per operation.
        gate: Option<Gate>,
        /// The same store's key set, when it keeps one and is held open.
        key_set: Option<Arc<dyn KeySet>>,
        /// Longest wait for a locked directory.
        lock_wait_ms: u64,
    },
    /// A dedupgate server.
    #[cfg(feature = "http-client")]
    Remote(Client),
}

/// Opens `spec`, waiting up to `lock_wait_ms` while another process holds an embedded store's
/// directory (another command's moment on it); a wait of more than a second says so on stderr.
pub async fn open_waiting(
    spec: &StoreSpec,
    lock_wait_ms: u64,
    embedded: &EmbeddedOptions,
) -> anyhow::Result<WithKeySet> {
    let started = Instant::now();
    let mut told = false;
    loop {
        match store_spec::open_with_key_set(spec, embedded.clone()).await {
            Ok(opened) => return Ok(opened),
            Err(e) if e.is_locked() && started.elapsed().as_millis() < u128::from(lock_wait_ms) => {
                // A lock held for a moment (another cron trigger's claim) passes unsaid; a
                // longer wait says what it waits for, so a forgotten `serve` is not a mystery.
                if !told && started.elapsed() >= LOCK_NOTICE_AFTER {
                    told = true;
                    eprintln!(
                        "dedupgate: store {} is in use by another process (a `dedupgate serve`?); \
                         waiting up to {} for it (--lock-wait)",
                        describe(spec),
                        dedupgate_core::keys::format_duration_ms(lock_wait_ms)
                    );
                }
                tokio::time::sleep(Duration::from_millis(LOCK_RETRY_MS)).await;
            }
            Err(e) => return Err(open_failed(e)),
        }
    }
}

/// Whether `spec` opens an embedded store directory, alone or as a tier of `tiered:`: its lock
/// admits one process at a time.
fn holds_embedded(spec: &StoreSpec) -> bool {
    match spec {
        StoreSpec::Embedded(_) => true,
        StoreSpec::Tiered(fast, durable) => holds_embedded(fast) || holds_embedded(durable),
        _ => false,
    }
}

impl Backend {
    /// A server at `url`, or the store `spec` held open for the whole command.
    pub async fn open(
        spec: Option<StoreSpec>,
        server: Option<&str>,
        lock_wait_ms: u64,
    ) -> anyhow::Result<Self> {
        Self::open_with(spec, server, lock_wait_ms, EmbeddedOptions::default()).await
    }

    /// [`Backend::open`], with `embedded` options for an embedded store.
    pub async fn open_with(
        spec: Option<StoreSpec>,
        server: Option<&str>,
        lock_wait_ms: u64,
        embedded: EmbeddedOptions,
    ) -> anyhow::Result<Self> {
        #[cfg(feature = "http-client")]
        if let Some(url) = server {
            return Ok(Backend::Remote(
                Client::new(url).with_context(|| format!("server {url}"))?,
            ));
        }
        #[cfg(not(feature = "http-client"))]
        if server.is_some() {
            bail!("--server needs dedupgate built with the \"http-client\" feature");
        }
        let spec = spec.unwrap_or_default();
        let (store, key_set) = open_waiting(&spec, lock_wait_ms, &embedded).await?;
        Ok(Backend::Local {
            spec,
            gate: Some(Gate::from_arc(store)),
            key_set,
            lock_wait_ms,
        })
    }

    /// Like [`Backend::open`], but a store with an embedded directory (alone or as a tier) is
    /// opened around each call only, so other processes can use it between calls (the cron
    /// gate).
    pub async fn per_op(
        spec: Option<StoreSpec>,
        server: Option<&str>,
        lock_wait_ms: u64,
    ) -> anyhow::Result<Self> {
        let spec_or_default = spec.clone().unwrap_or_default();
        if server.is_none() && holds_embedded(&spec_or_default) {
            // Open once now so a bad directory fails before anything runs.
            drop(open_waiting(&spec_or_default, lock_wait_ms, &EmbeddedOptions::default()).await?);
            return Ok(Backend::Local {
                spec: spec_or_default,
                gate: None,
                key_set: None,
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
                ..
            } => Ok(Gate::from_arc(
                open_waiting(spec, *lock_wait_ms, &EmbeddedOptions::default())
                    .await?
                    .0,
            )),
            #[cfg(feature = "http-client")]
            Backend::Remote(_) => Err(anyhow!("no local gate for a server backend")),
        }
    }

    /// The key set of the store this backend holds open, if it keeps one (an embedded store).
    pub fn key_set(&self) -> Option<&Arc<dyn KeySet>> {
        match self {
            Backend::Local { key_set, .. } => key_set.as_ref(),
            #[cfg(feature = "http-client")]
            Backend::Remote(_) => None,
        }
    }

    /// Claims a key.
    pub async fn claim(&self, ns: &str, key: &str, opts: ClaimOptions) -> anyhow::Result<Claim> {
        match self {
            #[cfg(feature = "http-client")]
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
            #[cfg(feature = "http-client")]
            Backend::Remote(c) => Ok(c.complete(ns, key, token, result, None).await?),
            _ => Ok(self.gate().await?.complete(ns, key, token, result).await?),
        }
    }

    /// Releases a claim.
    pub async fn release(&self, ns: &str, key: &str, token: &Token) -> anyhow::Result<()> {
        match self {
            #[cfg(feature = "http-client")]
            Backend::Remote(c) => Ok(c.release(ns, key, token).await?),
            _ => Ok(self.gate().await?.release(ns, key, token).await?),
        }
    }

    /// Removes a key's record (over HTTP: an admin call); true when a live one went.
    pub async fn forget(&self, ns: &str, key: &str) -> anyhow::Result<bool> {
        match self {
            #[cfg(feature = "http-client")]
            Backend::Remote(c) => Ok(c.forget(ns, key).await?),
            _ => Ok(self.gate().await?.forget(ns, key).await?),
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
            #[cfg(feature = "http-client")]
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
            #[cfg(feature = "http-client")]
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

    /// One ledger round trip (one group commit on the embedded store): first completes the
    /// claims in `completes` (keeping their records `ttl_ms` from now), then claims or marks
    /// each of `keys`, in that order, so a key completed here is settled before any key of the
    /// same call is decided. Answers one item per completion and one per key, each the
    /// refusal's reason on failure.
    pub async fn ledger_call(
        &self,
        ns: &str,
        completes: &[(String, Token)],
        keys: &[String],
        ttl_ms: u64,
        write: &LedgerWrite,
    ) -> anyhow::Result<LedgerAnswers> {
        let n = completes.len() + keys.len();
        let answers: Vec<Result<Fresh, String>> = match self {
            #[cfg(feature = "http-client")]
            Backend::Remote(c) => {
                let mut ops = Vec::with_capacity(n);
                for (k, t) in completes {
                    ops.push(json!({"op": "complete", "namespace": ns, "key": k, "token": t.as_str(), "ttl_ms": ttl_ms}));
                }
                for k in keys {
                    ops.push(match write {
                        LedgerWrite::Claim { lease_ms, owner } => json!({"op": "claim", "namespace": ns, "key": k, "ttl_ms": ttl_ms, "lease_ms": lease_ms, "owner": owner}),
                        LedgerWrite::Mark => json!({"op": "mark", "namespace": ns, "key": k, "ttl_ms": ttl_ms}),
                    });
                }
                let mut out = Vec::with_capacity(n);
                for (i, a) in c.batch(ops).await?.into_iter().enumerate() {
                    out.push(match a {
                        Err(p) => Err(format!("{}: {}", p.code, p.detail)),
                        Ok(_) if i < completes.len() => Ok(Fresh::Done),
                        Ok(v) => match write {
                            LedgerWrite::Claim { .. } => match serde_json::from_value::<Claim>(v) {
                                Ok(Claim::New(lease)) => Ok(Fresh::New(Some(lease.token))),
                                Ok(Claim::Duplicate { record }) => Ok(Fresh::known(&record)),
                                Err(e) => bail!("unexpected claim answer from the server: {e}"),
                            },
                            LedgerWrite::Mark => match serde_json::from_value::<Mark>(v) {
                                Ok(Mark::New { .. }) => Ok(Fresh::New(None)),
                                Ok(Mark::Duplicate { record }) => Ok(Fresh::known(&record)),
                                Err(e) => bail!("unexpected mark answer from the server: {e}"),
                            },
                        },
                    });
                }
                out
            }
            _ => {
                let gate = self.gate().await?;
                let mut ops = Vec::with_capacity(n);
                for (k, t) in completes {
                    let opts = CompleteOptions {
                        result: None,
                        ttl_ms: Some(ttl_ms),
                    };
                    ops.push((
                        RecordId::new(ns, k.as_str())?,
                        ValidOp::complete(t.clone(), opts)?,
                    ));
                }
                for k in keys {
                    let op = match write {
                        LedgerWrite::Claim { lease_ms, owner } => {
                            let opts = ClaimOptions {
                                ttl_ms: Some(ttl_ms),
                                lease_ms: Some(*lease_ms),
                                fingerprint: None,
                                owner: Some(owner.clone()),
                            };
                            ValidOp::claim(opts, gate.defaults())?
                        }
                        LedgerWrite::Mark => {
                            let opts = dedupgate_core::MarkOptions {
                                ttl_ms: Some(ttl_ms),
                                ..Default::default()
                            };
                            ValidOp::mark(opts, gate.defaults())?
                        }
                    };
                    ops.push((RecordId::new(ns, k.as_str())?, op));
                }
                gate.store()
                    .apply_batch(ops)
                    .await
                    .into_iter()
                    .map(|a| match a {
                        Ok(Outcome::Completed(_)) => Ok(Fresh::Done),
                        Ok(Outcome::Claimed(Claim::New(lease))) => {
                            Ok(Fresh::New(Some(lease.token)))
                        }
                        Ok(Outcome::Marked(Mark::New { .. })) => Ok(Fresh::New(None)),
                        Ok(Outcome::Claimed(Claim::Duplicate { record }))
                        | Ok(Outcome::Marked(Mark::Duplicate { record })) => {
                            Ok(Fresh::known(&record))
                        }
                        Ok(other) => Err(format!("unexpected outcome {}", other.label())),
                        Err(e) => Err(e.to_string()),
                    })
                    .collect()
            }
        };
        if answers.len() != n {
            bail!("the ledger answered {} of {n} operations", answers.len());
        }
        let mut fresh = answers;
        let completed = fresh
            .drain(..completes.len())
            .map(|a| match a {
                Ok(Fresh::Done) => Ok(()),
                Ok(_) => Err("unexpected answer to a completion".to_owned()),
                Err(e) => Err(e),
            })
            .collect();
        Ok(LedgerAnswers { completed, fresh })
    }

    /// Releases many claims (best effort, after a failure).
    pub async fn release_batch(&self, ns: &str, claims: &[(String, Token)]) {
        // One batch per 5,000 claims (the API takes 10,000 ops), not a round trip per claim.
        // Best effort: a claim left held frees itself when its lease runs out.
        for chunk in claims.chunks(5_000) {
            match self {
                #[cfg(feature = "http-client")]
                Backend::Remote(c) => {
                    let ops = chunk
                        .iter()
                        .map(|(k, t)| json!({"op": "release", "namespace": ns, "key": k, "token": t.as_str()}))
                        .collect();
                    let _ = c.batch(ops).await;
                }
                _ => {
                    let Ok(gate) = self.gate().await else {
                        return;
                    };
                    let mut ops = Vec::with_capacity(chunk.len());
                    for (k, t) in chunk {
                        let id = RecordId::new(ns, k.as_str());
                        if let (Ok(id), Ok(op)) = (id, ValidOp::release(t.clone())) {
                            ops.push((id, op));
                        }
                    }
                    let _ = gate.store().apply_batch(ops).await;
                }
            }
        }
    }

    /// What the backend is, for messages.
    pub fn describe(&self) -> String {
        match self {
            Backend::Local { spec, .. } => describe(spec),
            #[cfg(feature = "http-client")]
            Backend::Remote(_) => "server".to_owned(),
        }
    }
}

/// What a ledger call writes for each new key.
#[derive(Clone, Debug)]
pub enum LedgerWrite {
    /// A claim under a lease, completed once the record is written (retriable).
    Claim {
        /// The claim's lease.
        lease_ms: u64,
        /// The run's owner id.
        owner: String,
    },
    /// A mark: completed at once (at-most-once).
    Mark,
}

/// The ledger's answer for one operation of a [`Backend::ledger_call`].
#[derive(Clone, Debug, PartialEq)]
pub enum Fresh {
    /// The key was new: the claim's token (none for a mark).
    New(Option<Token>),
    /// The key was known and completed.
    Duplicate,
    /// Another run holds the key (claimed, not completed): it may yet write the record, or
    /// fail and release it, or have died, leaving the claim to expire.
    Held {
        /// The holder's owner name.
        owner: Option<String>,
        /// When the holder's lease ends (the store's clock, unix ms).
        lease_expires_at_ms: Option<u64>,
    },
    /// A completion went through.
    Done,
}

impl Fresh {
    /// The answer for a key the ledger already had.
    fn known(record: &Record) -> Self {
        match record.state {
            State::Completed => Fresh::Duplicate,
            State::InProgress => Fresh::Held {
                owner: record.owner.clone(),
                lease_expires_at_ms: record.lease_expires_at_ms,
            },
        }
    }
}

/// The answers of a [`Backend::ledger_call`].
#[derive(Debug)]
pub struct LedgerAnswers {
    /// One per completion sent.
    pub completed: Vec<Result<(), String>>,
    /// One per key sent: [`Fresh::New`], [`Fresh::Duplicate`] or [`Fresh::Held`], or why it
    /// was refused.
    pub fresh: Vec<Result<Fresh, String>>,
}

/// True when the error is the gate's "lease lost".
pub fn is_lease_lost(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        #[cfg(feature = "http-client")]
        if matches!(
            c.downcast_ref::<ClientError>(),
            Some(ClientError::Gate(GateError::LeaseLost))
        ) {
            return true;
        }
        matches!(c.downcast_ref::<GateError>(), Some(GateError::LeaseLost))
    })
}

/// Why a store did not open (the error names the store), with what to do when another process
/// holds its directory (the usual cause: a `dedupgate serve` or `proxy` on the default
/// `./dedupgate-data`): go through that server, or use another directory.
pub fn open_failed(e: store_spec::OpenStoreError) -> anyhow::Error {
    with_lock_hint(
        e,
        "if a `dedupgate serve` holds it, go through it with --server URL, or give another \
         store directory (--store; --ledger for dedup)",
    )
}

/// [`open_failed`] for `serve` and `proxy` (`command`), which hold their store for their whole
/// life and have no `--server` to go through.
pub fn serving_open_failed(e: store_spec::OpenStoreError, command: &str) -> anyhow::Error {
    with_lock_hint(
        e,
        &format!(
            "if another `dedupgate serve` or `proxy` holds it, stop that one, or give this \
             {command} a store directory of its own with --store"
        ),
    )
}

/// `e`, followed by `hint` when its directory is locked (after the cause, which the message
/// then holds: the error keeps no source, so the chain is not said twice).
fn with_lock_hint(e: store_spec::OpenStoreError, hint: &str) -> anyhow::Error {
    if e.is_locked() {
        anyhow!("{:#}; {hint}", anyhow::Error::new(e))
    } else {
        anyhow::Error::new(e)
    }
}

/// A spec for messages (never a password: URLs are cut at their authority).
pub fn describe(spec: &StoreSpec) -> String {
    match spec {
        StoreSpec::Memory => "memory:".to_owned(),
        StoreSpec::Embedded(p) => format!("embedded:{}", p.display()),
        StoreSpec::Redis(u)
        | StoreSpec::RedisCluster(u)
        | StoreSpec::Postgres(u)
        | StoreSpec::Http(u) => match u.split_once("://") {
            Some((scheme, rest)) => {
                let host = rest.rsplit('@').next().unwrap_or(rest);
                format!("{scheme}://{host}")
            }
            None => u.clone(),
        },
        StoreSpec::Tiered(a, b) => format!("tiered:{},{}", describe(a), describe(b)),
    }
}
