//! The Rust library face: [`Gate`] over any [`Store`], with typed methods and [`Gate::run`],
//! which wraps a handler in either ordering.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{GateError, StoreError};
use crate::model::{Record, RecordId, Token};
use crate::op::{Claim, Mark, Outcome};
use crate::store::Store;
use crate::valid::{ClaimOptions, CompleteOptions, Defaults, MarkOptions, ValidOp};

/// Which ordering [`Gate::run`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Claim, process, complete (release on failure, so the next delivery retries).
    #[default]
    Retriable,
    /// Mark, then process: a failed attempt is never retried.
    Idempotent,
}

/// What [`Gate::run`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Run<T> {
    /// The handler ran and returned this.
    Ran(T),
    /// The event was a duplicate; the handler did not run.
    Duplicate(Record),
}

impl<T> Run<T> {
    /// True when the handler ran.
    pub fn ran(&self) -> bool {
        matches!(self, Run::Ran(_))
    }
}

impl<T: DeserializeOwned> Run<T> {
    /// The handler's value: this run's, or the one stored by the first run (None when the first
    /// run stored no result, as in idempotent mode, or it is still in progress).
    pub fn value(self) -> Option<T> {
        match self {
            Run::Ran(v) => Some(v),
            Run::Duplicate(r) => r.result.and_then(|v| serde_json::from_value(v).ok()),
        }
    }
}

/// Why [`Gate::run`] failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError<E> {
    /// The gate could not decide; the handler did not run.
    #[error(transparent)]
    Gate(GateError),
    /// The handler failed. In retriable mode the claim was released, so the next delivery
    /// runs it again.
    #[error("handler failed: {0}")]
    Handler(E),
    /// Retriable mode: the handler failed and releasing its claim failed too (the store was
    /// down, or the lease was already lost). The key stays held until the lease runs out; a
    /// delivery after that runs it again.
    #[error("handler failed: {error}; its claim was not released ({release}), so it is held until the lease runs out")]
    HandlerUnreleased {
        /// The handler's error.
        error: E,
        /// Why the release failed.
        release: GateError,
    },
    /// The handler succeeded but its completion was not recorded (lease lost, or the store
    /// still down after the completion was asked again for about 2 s): another worker may run
    /// it again once the lease runs out.
    #[error("handler ran but its completion was not recorded: {error}")]
    Unrecorded {
        /// Why the completion failed.
        error: GateError,
    },
}

/// The gate: typed operations over a shared store.
#[derive(Clone)]
pub struct Gate {
    store: Arc<dyn Store>,
    defaults: Defaults,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("store", &self.store.describe())
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl Gate {
    /// A gate over `store` with API.md's defaults (ttl 24 h, lease 30 s).
    pub fn new(store: impl Store) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A gate over a shared store.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            defaults: Defaults::default(),
        }
    }

    /// Changes the default durations.
    pub fn with_defaults(mut self, defaults: Defaults) -> Self {
        self.defaults = defaults;
        self
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The default durations.
    pub fn defaults(&self) -> Defaults {
        self.defaults
    }

    /// Claims `key` in `namespace` (retriable ordering).
    pub async fn claim(
        &self,
        namespace: &str,
        key: &str,
        opts: ClaimOptions,
    ) -> Result<Claim, GateError> {
        let id = RecordId::new(namespace, key)?;
        let op = ValidOp::claim(opts, self.defaults)?;
        match self.store.apply(id, op).await? {
            Outcome::Claimed(c) => Ok(c),
            other => Err(unexpected(other)),
        }
    }

    /// Completes a claim with its result.
    pub async fn complete(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        result: Option<serde_json::Value>,
    ) -> Result<Record, GateError> {
        let id = RecordId::new(namespace, key)?;
        let op = ValidOp::complete(
            token.clone(),
            CompleteOptions {
                result,
                ttl_ms: None,
            },
        )?;
        match self.store.apply(id, op).await? {
            Outcome::Completed(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Releases a claim so the next delivery runs again.
    pub async fn release(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
    ) -> Result<(), GateError> {
        let id = RecordId::new(namespace, key)?;
        let op = ValidOp::release(token.clone())?;
        match self.store.apply(id, op).await? {
            Outcome::Released => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Renews a lease for `lease_ms` from now; returns the new lease end.
    pub async fn extend(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        lease_ms: u64,
    ) -> Result<u64, GateError> {
        let id = RecordId::new(namespace, key)?;
        let op = ValidOp::extend(token.clone(), lease_ms)?;
        match self.store.apply(id, op).await? {
            Outcome::Extended {
                lease_expires_at_ms,
            } => Ok(lease_expires_at_ms),
            other => Err(unexpected(other)),
        }
    }

    /// Marks `key` completed before processing (idempotent ordering).
    pub async fn mark(
        &self,
        namespace: &str,
        key: &str,
        ttl_ms: Option<u64>,
        fingerprint: Option<String>,
        result: Option<serde_json::Value>,
    ) -> Result<Mark, GateError> {
        let id = RecordId::new(namespace, key)?;
        let opts = MarkOptions {
            ttl_ms,
            fingerprint,
            result,
        };
        let op = ValidOp::mark(opts, self.defaults)?;
        match self.store.apply(id, op).await? {
            Outcome::Marked(m) => Ok(m),
            other => Err(unexpected(other)),
        }
    }

    /// Reads a record (never its token).
    pub async fn get(&self, namespace: &str, key: &str) -> Result<Option<Record>, GateError> {
        let id = RecordId::new(namespace, key)?;
        match self.store.apply(id, ValidOp::get()).await? {
            Outcome::Found(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Deletes a record; true when a live one existed.
    pub async fn forget(&self, namespace: &str, key: &str) -> Result<bool, GateError> {
        let id = RecordId::new(namespace, key)?;
        match self.store.apply(id, ValidOp::forget()).await? {
            Outcome::Forgotten(b) => Ok(b),
            other => Err(unexpected(other)),
        }
    }

    /// Runs `handler` at most once per (namespace, key) within the ttl.
    ///
    /// - [`Mode::Retriable`]: claims, keeps the lease alive while the handler runs, completes
    ///   with its value (stored and replayed to duplicates) or releases on error.
    /// - [`Mode::Idempotent`]: marks first, then runs; a failure is never retried.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use dedupgate_core::{Gate, MemoryStore, Mode, Run};
    /// let gate = Gate::new(MemoryStore::new());
    /// let charge = || async { Ok::<_, std::io::Error>(42u32) };
    /// let first = gate.run("payments", "evt_1", Mode::Retriable, charge).await.unwrap();
    /// assert_eq!(first, Run::Ran(42));
    /// let again = gate.run("payments", "evt_1", Mode::Retriable, charge).await.unwrap();
    /// assert!(!again.ran());
    /// assert_eq!(again.value(), Some(42)); // the stored result, replayed
    /// # });
    /// ```
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use dedupgate_core::{Gate, MemoryStore, Mode};
    /// let gate = Gate::new(MemoryStore::new());
    /// // Idempotent: the mark is set before the trade is placed; a failed attempt is not retried.
    /// let failing = || async { Err::<(), _>("exchange down") };
    /// assert!(gate.run("trades", "ETH_5m_14:30", Mode::Idempotent, failing).await.is_err());
    /// let retry = gate.run("trades", "ETH_5m_14:30", Mode::Idempotent, || async { Ok::<_, &str>(()) });
    /// assert!(!retry.await.unwrap().ran());
    /// # });
    /// ```
    pub async fn run<F, Fut, T, E>(
        &self,
        namespace: &str,
        key: &str,
        mode: Mode,
        handler: F,
    ) -> Result<Run<T>, RunError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize,
    {
        self.run_with(namespace, key, mode, ClaimOptions::default(), handler)
            .await
    }

    /// [`Gate::run`] with options: a payload `fingerprint` (a redelivery of the key with another
    /// payload is then [`GateError::FingerprintMismatch`], never a duplicate), `ttl_ms`, and in
    /// retriable mode `lease_ms` (also the keep-alive's period basis) and `owner`. Idempotent
    /// mode uses only `ttl_ms` and `fingerprint`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use dedupgate_core::{ClaimOptions, Gate, GateError, MemoryStore, Mode, RunError};
    /// let gate = Gate::new(MemoryStore::new());
    /// let opts = |fp: &str| ClaimOptions { fingerprint: Some(fp.into()), ..Default::default() };
    /// let ok = || async { Ok::<_, std::io::Error>(1u8) };
    /// assert!(gate.run_with("orders", "o-1", Mode::Retriable, opts("aa"), ok).await.unwrap().ran());
    /// let reused = gate.run_with("orders", "o-1", Mode::Retriable, opts("bb"), ok).await;
    /// assert!(matches!(reused, Err(RunError::Gate(GateError::FingerprintMismatch))));
    /// # });
    /// ```
    pub async fn run_with<F, Fut, T, E>(
        &self,
        namespace: &str,
        key: &str,
        mode: Mode,
        opts: ClaimOptions,
        handler: F,
    ) -> Result<Run<T>, RunError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize,
    {
        self.run_fenced(namespace, key, mode, opts, |_fence| handler())
            .await
    }

    /// [`Gate::run_with`] whose handler is given the run's fencing token (the claim's fence in
    /// retriable mode, the marked record's in idempotent mode), so it can pass it downstream,
    /// where a write carrying an older fence than one already applied is refused: a holder
    /// whose lease was taken over cannot overwrite the newer holder's work.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use dedupgate_core::{ClaimOptions, Gate, MemoryStore, Mode, Run};
    /// let gate = Gate::new(MemoryStore::new());
    /// let run = gate.run_fenced("orders", "o-1", Mode::Retriable, ClaimOptions::default(),
    ///     |fence| async move { Ok::<_, std::io::Error>(fence) });
    /// assert!(matches!(run.await.unwrap(), Run::Ran(f) if f > 0));
    /// # });
    /// ```
    pub async fn run_fenced<F, Fut, T, E>(
        &self,
        namespace: &str,
        key: &str,
        mode: Mode,
        opts: ClaimOptions,
        handler: F,
    ) -> Result<Run<T>, RunError<E>>
    where
        F: FnOnce(u64) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize,
    {
        match mode {
            Mode::Idempotent => match self
                .mark(namespace, key, opts.ttl_ms, opts.fingerprint, None)
                .await
                .map_err(RunError::Gate)?
            {
                Mark::Duplicate { record } => Ok(Run::Duplicate(record)),
                Mark::New { record } => handler(record.fence)
                    .await
                    .map(Run::Ran)
                    .map_err(RunError::Handler),
            },
            Mode::Retriable => {
                let lease_ms = opts.lease_ms.unwrap_or(self.defaults.lease_ms);
                let lease = match self
                    .claim(namespace, key, opts)
                    .await
                    .map_err(RunError::Gate)?
                {
                    Claim::Duplicate { record } => return Ok(Run::Duplicate(record)),
                    Claim::New(lease) => lease,
                };
                let outcome = self
                    .while_held(namespace, key, &lease.token, lease_ms, handler(lease.fence))
                    .await;
                match outcome {
                    Ok(value) => {
                        let stored = serde_json::to_value(&value).ok();
                        // The lease is still renewed while the completion is asked again.
                        let completed = self.complete_retried(namespace, key, &lease.token, stored);
                        match self
                            .while_held(namespace, key, &lease.token, lease_ms, completed)
                            .await
                        {
                            Ok(()) => Ok(Run::Ran(value)),
                            Err(error) => Err(RunError::Unrecorded { error }),
                        }
                    }
                    Err(e) => match self.release(namespace, key, &lease.token).await {
                        Ok(()) => Err(RunError::Handler(e)),
                        Err(release) => Err(RunError::HandlerUnreleased { error: e, release }),
                    },
                }
            }
        }
    }

    /// Completes a claim whose handler succeeded, asking again (after each of
    /// [`COMPLETE_RETRY_DELAYS`]) while the store is unavailable. A completion with the current
    /// token is safe to repeat, also after its first answer was lost, and even after the lease
    /// time has passed as long as nobody took the key over (API.md); giving up leaves the key in
    /// progress until its lease runs out, after which a redelivery runs the handler again.
    async fn complete_retried(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        result: Option<serde_json::Value>,
    ) -> Result<(), GateError> {
        let mut delays = COMPLETE_RETRY_DELAYS.iter();
        loop {
            match self.complete(namespace, key, token, result.clone()).await {
                Ok(_) => return Ok(()),
                Err(GateError::Store(StoreError::Unavailable(why))) => match delays.next() {
                    Some(delay) => tokio::time::sleep(*delay).await,
                    None => return Err(GateError::Store(StoreError::Unavailable(why))),
                },
                Err(other) => return Err(other),
            }
        }
    }

    /// Drives `work` while renewing the lease every third of its length.
    async fn while_held<T>(
        &self,
        namespace: &str,
        key: &str,
        token: &Token,
        lease_ms: u64,
        work: impl Future<Output = T>,
    ) -> T {
        let period = Duration::from_millis((lease_ms / 3).max(1));
        let keep_alive = async {
            loop {
                tokio::time::sleep(period).await;
                // A failed renewal is not fatal here: completion will tell the caller.
                let _ = self.extend(namespace, key, token, lease_ms).await;
            }
        };
        tokio::pin!(work);
        tokio::select! {
            value = &mut work => value,
            _ = keep_alive => unreachable!("the keep-alive loop never ends"),
        }
    }
}

/// The waits before [`Gate::run_with`] asks an unavailable store again to record a completed
/// run: about 2 s in all, well inside the default 30 s lease.
const COMPLETE_RETRY_DELAYS: [Duration; 4] = [
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(500),
    Duration::from_millis(1_000),
];

fn unexpected(outcome: Outcome) -> GateError {
    // A store that answers an op with another op's outcome is broken; fail closed.
    GateError::Store(StoreError::Corrupt(format!(
        "store answered with an outcome of another operation: {}",
        outcome.label()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreStats;
    use crate::MemoryStore;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The memory store, but its first `down` completions answer "unavailable" (a store outage
    /// at the moment a handler finishes).
    struct CompletionsDown {
        inner: MemoryStore,
        down: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Store for CompletionsDown {
        async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
            if matches!(*op, crate::Op::Complete { .. })
                && self
                    .down
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                return Err(StoreError::Unavailable("down for this test".into()).into());
            }
            self.inner.apply(id, op).await
        }
        async fn health(&self) -> Result<(), StoreError> {
            self.inner.health().await
        }
        async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
            self.inner.sweep_expired(batch_max).await
        }
        async fn stats(&self) -> Result<StoreStats, StoreError> {
            self.inner.stats().await
        }
        fn describe(&self) -> String {
            "memory, completions down".into()
        }
    }

    /// A store outage when the handler finishes must not cost the run its record: the
    /// completion is asked again, and only an outage longer than the retries is `Unrecorded`.
    #[tokio::test(start_paused = true)]
    async fn a_completion_the_store_could_not_answer_is_asked_again() {
        let down = |n| CompletionsDown {
            inner: MemoryStore::new(),
            down: AtomicUsize::new(n),
        };
        let ok = || async { Ok::<_, &str>(7u8) };
        let gate = Gate::new(down(COMPLETE_RETRY_DELAYS.len()));
        let r = gate.run("jobs", "a", Mode::Retriable, ok).await;
        assert!(matches!(r, Ok(Run::Ran(7))), "{r:?}");
        let record = gate.get("jobs", "a").await.unwrap().expect("recorded");
        assert_eq!(record.state, crate::State::Completed);
        assert_eq!(record.result, Some(serde_json::json!(7)));

        let gate = Gate::new(down(COMPLETE_RETRY_DELAYS.len() + 1));
        let r = gate.run("jobs", "b", Mode::Retriable, ok).await;
        assert!(
            matches!(
                r,
                Err(RunError::Unrecorded {
                    error: GateError::Store(StoreError::Unavailable(_))
                })
            ),
            "{r:?}"
        );
        let record = gate.get("jobs", "b").await.unwrap().expect("still claimed");
        assert_eq!(record.state, crate::State::InProgress);
    }

    /// A run whose ttl is shorter than its lease blocks its key for the ttl only: the next run
    /// after it runs (the completed record kept the lease's expiry).
    #[tokio::test]
    async fn a_run_blocks_its_key_for_its_ttl_even_below_the_lease() {
        let clock = crate::ManualClock::new(1_000_000);
        let gate = Gate::new(MemoryStore::with_clock(Arc::new(clock.clone())));
        let opts = || ClaimOptions {
            ttl_ms: Some(2_000),
            lease_ms: Some(30_000),
            ..Default::default()
        };
        let ok = || async { Ok::<_, &str>(1u8) };
        let run = || gate.run_with("jobs", "a", Mode::Retriable, opts(), ok);
        assert!(run().await.unwrap().ran());
        clock.advance(1_000);
        assert!(!run().await.unwrap().ran(), "within the ttl");
        clock.advance(1_500);
        assert!(run().await.unwrap().ran(), "after the ttl");
    }

    /// The handler is given the run's fence: a later claim of the key (after a release, or a
    /// mark after the ttl) gets a higher one, which is what lets a sink refuse a stale holder.
    #[tokio::test]
    async fn successive_runs_of_a_key_are_given_increasing_fences() {
        let gate = Gate::new(MemoryStore::new());
        let fails = |fence| async move { Err::<(), _>(fence) };
        let first = gate
            .run_fenced("jobs", "a", Mode::Retriable, ClaimOptions::default(), fails)
            .await;
        let Err(RunError::Handler(first)) = first else {
            panic!("{first:?}")
        };
        let second = gate
            .run_fenced(
                "jobs",
                "a",
                Mode::Retriable,
                ClaimOptions::default(),
                |fence| async move { Ok::<_, ()>(fence) },
            )
            .await;
        let Ok(Run::Ran(second)) = second else {
            panic!("{second:?}")
        };
        assert!(second > first, "fences {first} then {second}");

        let clock = crate::ManualClock::new(1_000_000);
        let gate = Gate::new(MemoryStore::with_clock(Arc::new(clock.clone())));
        let opts = || ClaimOptions {
            ttl_ms: Some(1_000),
            ..Default::default()
        };
        let mark = || {
            gate.run_fenced("jobs", "m", Mode::Idempotent, opts(), |fence| async move {
                Ok::<_, ()>(fence)
            })
        };
        let Ok(Run::Ran(first)) = mark().await else {
            panic!("the first mark runs")
        };
        clock.advance(2_000);
        let Ok(Run::Ran(second)) = mark().await else {
            panic!("a mark after the ttl runs")
        };
        assert!(second > first, "marked fences {first} then {second}");
    }

    /// A retriable handler's failure says whether its claim was released: when the release
    /// fails (here the record was forgotten under the holder), the caller must not be told the
    /// key is free again.
    #[tokio::test]
    async fn a_failed_handler_reports_whether_its_claim_was_released() {
        let gate = Gate::new(MemoryStore::new());
        let fails = || async { Err::<(), _>("boom") };
        let r = gate.run("jobs", "a", Mode::Retriable, fails).await;
        assert!(matches!(r, Err(RunError::Handler("boom"))), "{r:?}");
        assert!(gate.get("jobs", "a").await.unwrap().is_none(), "released");

        let inner = gate.clone();
        let r = gate
            .run("jobs", "b", Mode::Retriable, || async move {
                inner.forget("jobs", "b").await.unwrap();
                Err::<(), _>("boom")
            })
            .await;
        assert!(
            matches!(
                r,
                Err(RunError::HandlerUnreleased {
                    error: "boom",
                    release: _
                })
            ),
            "{r:?}"
        );
    }
}
