//! Where the CLI's gate lives: one STORE, opened in this process through dedupgate-stores. A
//! server given with `--server URL` is the `http://` store of that URL, so every command talks
//! to it as to any other store, and the core decides either way.
//!
//! The embedded store locks its directory for one process. A cron gate must let a second
//! `run` of the same key see the first one's claim while the first is still running, so for
//! `run` the embedded store is opened around each operation only ([`Backend::per_op`]) and a
//! locked directory is retried for a bounded time instead of failing at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use dedupgate_core::error::chain_text;
use dedupgate_core::{
    Claim, ClaimOptions, CompleteOptions, Gate, GateError, InvalidInput, KeySet, Mark, Outcome,
    Record, RecordId, State, StoreError, Token, ValidOp,
};
use serde_json::Value;

use dedupgate_stores::{self as store_spec, EmbeddedOptions, StoreSpec, WithKeySet};

/// Pause between two tries of a locked directory.
const LOCK_RETRY_MS: u64 = 25;
/// How long a wait for a locked directory goes before it says so on stderr.
const LOCK_NOTICE_AFTER: Duration = Duration::from_secs(1);

/// The CLI's gate over one store. Cheap to clone.
#[derive(Clone)]
pub struct Backend {
    /// The store's spec (to reopen it per operation).
    spec: StoreSpec,
    /// The open store, unless it is opened per operation.
    gate: Option<Gate>,
    /// The same store's key set, when it keeps one and is held open.
    key_set: Option<Arc<dyn KeySet>>,
    /// Longest wait for a locked directory.
    lock_wait_ms: u64,
    /// Given with `--server`: messages call it "server" and say its failures as they read
    /// when the CLI called the server with the client directly ([`Backend::failed`]).
    server: bool,
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
        #[cfg(not(feature = "http-client"))]
        if server.is_some() {
            bail!("--server needs dedupgate built with the \"http-client\" feature");
        }
        let (spec, opened) = match server {
            // No directory to wait for: the store is the client, which sends nothing yet.
            Some(url) => {
                let spec = StoreSpec::Http(url.to_owned());
                let opened = store_spec::open_with_key_set(&spec, embedded)
                    .await
                    .map_err(|e| unusable_server(url, &e))?;
                (spec, opened)
            }
            None => {
                let spec = spec.unwrap_or_default();
                let opened = open_waiting(&spec, lock_wait_ms, &embedded).await?;
                (spec, opened)
            }
        };
        let (store, key_set) = opened;
        Ok(Backend {
            spec,
            gate: Some(Gate::from_arc(store)),
            key_set,
            lock_wait_ms,
            server: server.is_some(),
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
            return Ok(Backend {
                spec: spec_or_default,
                gate: None,
                key_set: None,
                lock_wait_ms,
                server: false,
            });
        }
        Self::open(spec, server, lock_wait_ms).await
    }

    /// The gate for one call: the held one, or a fresh open of the store.
    async fn gate(&self) -> anyhow::Result<Gate> {
        match &self.gate {
            Some(gate) => Ok(gate.clone()),
            None => Ok(Gate::from_arc(
                open_waiting(&self.spec, self.lock_wait_ms, &EmbeddedOptions::default())
                    .await?
                    .0,
            )),
        }
    }

    /// The key set of the store this backend holds open, if it keeps one (an embedded store).
    pub fn key_set(&self) -> Option<&Arc<dyn KeySet>> {
        self.key_set.as_ref()
    }

    /// `e` as the command reports it. A server's failures read as they did when the CLI called
    /// it with the client directly, so that its messages did not change when the server became
    /// a store: the client's own failure (transport, protocol, a refusal the core has no code
    /// for) without the store's prefix, and a request the core refused before sending it as
    /// the server refuses it.
    fn failed(&self, e: GateError) -> anyhow::Error {
        if !self.server {
            return e.into();
        }
        match e {
            GateError::Store(StoreError::Unavailable(why)) => anyhow!(why),
            GateError::Invalid(invalid) if invalid.field != "request" => {
                let said = GateError::Invalid(invalid).to_string();
                GateError::Invalid(InvalidInput::new("request", said)).into()
            }
            e => e.into(),
        }
    }

    /// Why one operation of a ledger call was refused. A server's reads as its problem's code
    /// and detail, as when the ledger sent its batches with the client directly.
    fn refusal(&self, e: GateError) -> String {
        if !self.server {
            return e.to_string();
        }
        let code = e.code();
        match e {
            GateError::Invalid(invalid) if invalid.field == "request" => {
                format!("{code}: {}", invalid.reason)
            }
            GateError::Store(StoreError::Unavailable(why)) => format!("{code}: {why}"),
            e => format!("{code}: {e}"),
        }
    }

    /// Claims a key.
    pub async fn claim(&self, ns: &str, key: &str, opts: ClaimOptions) -> anyhow::Result<Claim> {
        let gate = self.gate().await?;
        gate.claim(ns, key, opts).await.map_err(|e| self.failed(e))
    }

    /// Completes a claim, storing `result`.
    pub async fn complete(
        &self,
        ns: &str,
        key: &str,
        token: &Token,
        result: Option<Value>,
    ) -> anyhow::Result<Record> {
        let gate = self.gate().await?;
        gate.complete(ns, key, token, result)
            .await
            .map_err(|e| self.failed(e))
    }

    /// Releases a claim.
    pub async fn release(&self, ns: &str, key: &str, token: &Token) -> anyhow::Result<()> {
        let gate = self.gate().await?;
        gate.release(ns, key, token)
            .await
            .map_err(|e| self.failed(e))
    }

    /// Removes a key's record (over HTTP: an admin call); true when a live one went.
    pub async fn forget(&self, ns: &str, key: &str) -> anyhow::Result<bool> {
        let gate = self.gate().await?;
        gate.forget(ns, key).await.map_err(|e| self.failed(e))
    }

    /// Renews a lease; the new lease end.
    pub async fn extend(
        &self,
        ns: &str,
        key: &str,
        token: &Token,
        lease_ms: u64,
    ) -> anyhow::Result<u64> {
        let gate = self.gate().await?;
        gate.extend(ns, key, token, lease_ms)
            .await
            .map_err(|e| self.failed(e))
    }

    /// Marks a key completed before running.
    pub async fn mark(
        &self,
        ns: &str,
        key: &str,
        ttl_ms: u64,
        result: Option<Value>,
    ) -> anyhow::Result<Mark> {
        let gate = self.gate().await?;
        gate.mark(ns, key, Some(ttl_ms), None, result)
            .await
            .map_err(|e| self.failed(e))
    }

    /// One ledger round trip (one group commit on the embedded store, one `POST /v1/batch` per
    /// 10,000 operations on a server): first completes the claims in `completes` (keeping their
    /// records `ttl_ms` from now), then claims or marks each of `keys`, in that order, so a key
    /// completed here is settled before any key of the same call is decided. Answers one item
    /// per completion and one per key, each the refusal's reason on failure.
    pub async fn ledger_call(
        &self,
        ns: &str,
        completes: &[(String, Token)],
        keys: &[String],
        ttl_ms: u64,
        write: &LedgerWrite,
    ) -> anyhow::Result<LedgerAnswers> {
        let n = completes.len() + keys.len();
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
        let answers: Vec<Result<Fresh, String>> = gate
            .store()
            .apply_batch(ops)
            .await
            .into_iter()
            .map(|a| match a {
                Ok(Outcome::Completed(_)) => Ok(Fresh::Done),
                Ok(Outcome::Claimed(Claim::New(lease))) => Ok(Fresh::New(Some(lease.token))),
                Ok(Outcome::Marked(Mark::New { .. })) => Ok(Fresh::New(None)),
                Ok(Outcome::Claimed(Claim::Duplicate { record }))
                | Ok(Outcome::Marked(Mark::Duplicate { record })) => Ok(Fresh::known(&record)),
                Ok(other) => Err(format!("unexpected outcome {}", other.label())),
                Err(e) => Err(self.refusal(e)),
            })
            .collect();
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
        let Ok(gate) = self.gate().await else {
            return;
        };
        // One batch per 5,000 claims (the API takes 10,000 ops), not a round trip per claim.
        // Best effort: a claim left held frees itself when its lease runs out.
        for chunk in claims.chunks(5_000) {
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

    /// What the backend is, for messages.
    pub fn describe(&self) -> String {
        if self.server {
            "server".to_owned()
        } else {
            describe(&self.spec)
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
    e.chain()
        .any(|c| matches!(c.downcast_ref::<GateError>(), Some(GateError::LeaseLost)))
}

/// A `--server` URL the client cannot use, said as before the server became a store: the URL,
/// then the client's reason.
fn unusable_server(url: &str, e: &store_spec::OpenStoreError) -> anyhow::Error {
    let why = std::error::Error::source(e).map_or_else(|| e.to_string(), chain_text);
    anyhow!("server {url}: {why}")
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
