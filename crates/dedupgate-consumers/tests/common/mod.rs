//! What the broker tests share: a gate on the embedded store in a temp dir, and a ledger of
//! every handler run, from which "ran exactly once per key" is checked.

#![allow(dead_code)] // each test binary uses part of it

#[cfg(feature = "rabbitmq")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;
mod names;
#[cfg(feature = "kafka")]
pub mod workload;

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupgate_consumers::{Action, ConsumerGate, FailureRetry, Handled, Message};
use dedupgate_core::{Gate, Mode};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
use futures::{Stream, StreamExt};
use tokio::sync::watch;

pub use names::unique;

/// The failure delays of the tests' gates: 20 ms, doubling, capped at 60 ms.
pub const FAILURE_RETRY_INITIAL: Duration = Duration::from_millis(20);
pub const FAILURE_RETRY_MAX: Duration = Duration::from_millis(60);

/// An embedded store in a fresh temp dir (kept alive by the returned guard) and a consumer gate
/// over it with short retry delays, so duplicates in progress and failed messages come back
/// quickly.
pub fn gate(mode: Mode) -> (ConsumerGate, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = EmbeddedStore::open(dir.path(), EmbeddedOptions::default()).expect("open store");
    let gate = ConsumerGate::new(Gate::new(store), "consumers-test")
        .expect("namespace")
        .mode(mode)
        .in_progress_retry(Duration::from_millis(50))
        .expect("in-progress delay")
        .unavailable_retry(Duration::from_millis(200))
        .expect("unavailable delay")
        .failure_retry(FAILURE_RETRY_INITIAL, FAILURE_RETRY_MAX)
        .expect("failure retry delays");
    (gate, dir)
}

/// One delivery of a message a retry test follows: which delivery the broker said it was,
/// when it arrived, and what the consumer made of it.
#[derive(Debug)]
pub struct Seen {
    pub attempt: Option<u32>,
    pub at: Instant,
    pub label: &'static str,
    pub text: String,
    pub action: Action,
}

impl Seen {
    pub fn new<T, E: std::fmt::Display>(
        attempt: Option<u32>,
        at: Instant,
        handled: &Handled<T, E>,
    ) -> Self {
        Self {
            attempt,
            at,
            label: handled.label(),
            text: handled.to_string(),
            action: handled.action(),
        }
    }
}

/// A handler that fails its first `failures` calls (counted in `calls`), then succeeds.
pub async fn fail_first(
    calls: &AtomicUsize,
    failures: usize,
    msg: Message,
) -> Result<String, String> {
    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
    if call <= failures {
        Err(format!("injected failure {call} of {}", msg.key))
    } else {
        Ok(format!("done:{}", msg.key))
    }
}

/// Checks the deliveries of one followed message against `policy`: every delivery but the last
/// was retried as a failure after the policy's delay for the broker's count, and each
/// redelivery arrived no sooner than that delay after the delivery before it (a lower bound:
/// load can only make it later).
pub fn assert_backed_off(seen: &[Seen], policy: FailureRetry) {
    for (i, pair) in seen.windows(2).enumerate() {
        let want = policy.delay(pair[0].attempt);
        assert!(
            is_failure_retry_after(&pair[0].action, want),
            "delivery {i}: {seen:#?}"
        );
        let gap = pair[1].at.duration_since(pair[0].at);
        assert!(
            gap >= want,
            "delivery {} came {gap:?} after the one before, sooner than its delay {want:?}: {seen:#?}",
            i + 1
        );
    }
}

/// True when `action` retries a failure after `delay` plus at most its quarter of jitter.
pub fn is_failure_retry_after(action: &Action, delay: std::time::Duration) -> bool {
    matches!(action, Action::Retry { after, failure: true }
        if *after >= delay && *after <= delay + delay / 4)
}

/// Every handler call, by key; `fail_first` keys fail on their first call.
#[derive(Default)]
pub struct Ledger {
    pub succeeded: Mutex<BTreeMap<String, u32>>,
    pub failed: Mutex<BTreeMap<String, u32>>,
    pub fail_first: HashSet<String>,
    /// Every outcome: key, [`Handled::label`] and what it says, in order.
    pub outcomes: Mutex<Vec<(Option<String>, &'static str, String)>>,
}

impl Ledger {
    pub fn new(fail_first: &[&str]) -> Arc<Self> {
        Arc::new(Self {
            fail_first: fail_first.iter().map(|k| k.to_string()).collect(),
            ..Self::default()
        })
    }

    /// The handler: fails on the first call for a `fail_first` key, otherwise works for a
    /// moment (so that another consumer's copy finds the key in progress) and succeeds.
    pub async fn handle(self: Arc<Self>, msg: Message) -> Result<String, String> {
        let first_call = {
            let failed = self.failed.lock().unwrap();
            !failed.contains_key(&msg.key)
        };
        if self.fail_first.contains(&msg.key) && first_call {
            *self
                .failed
                .lock()
                .unwrap()
                .entry(msg.key.clone())
                .or_default() += 1;
            return Err(format!("injected failure for {}", msg.key));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        *self
            .succeeded
            .lock()
            .unwrap()
            .entry(msg.key.clone())
            .or_default() += 1;
        Ok(format!("done:{}", msg.key))
    }

    pub fn record<T, E: std::fmt::Display>(&self, handled: &Handled<T, E>) {
        self.outcomes.lock().unwrap().push((
            handled.key().map(str::to_owned),
            handled.label(),
            handled.to_string(),
        ));
    }

    /// What the rejected outcomes said, sorted.
    pub fn rejections(&self) -> Vec<String> {
        let outcomes = self.outcomes.lock().unwrap();
        let mut out: Vec<String> = outcomes
            .iter()
            .filter(|(_, l, _)| *l == "rejected")
            .map(|(_, _, s)| s.clone())
            .collect();
        out.sort();
        out
    }

    pub fn count(&self, label: &str) -> usize {
        let outcomes = self.outcomes.lock().unwrap();
        outcomes.iter().filter(|(_, l, _)| *l == label).count()
    }

    /// How many outcomes of each label, for the test's output.
    pub fn summary(&self) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        for (_, label, _) in self.outcomes.lock().unwrap().iter() {
            *out.entry(*label).or_default() += 1;
        }
        out
    }

    pub fn succeeded(&self) -> BTreeMap<String, u32> {
        self.succeeded.lock().unwrap().clone()
    }

    pub fn failed(&self) -> BTreeMap<String, u32> {
        self.failed.lock().unwrap().clone()
    }
}

/// `n` keys `key-00`, `key-01`, …
pub fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("key-{i:02}")).collect()
}

/// How long a test may wait for its messages before it fails with what it has seen (a guard
/// against a hang, not a timing assertion).
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Reads each of `streams` (one per consumer) in its own task until `expected` messages were
/// settled for good (anything but a retry: acked, rejected or termed), recording every outcome in
/// `ledger`. `handle` runs one received item through the gate and settles it with the broker.
/// Fails with what it has seen when they have not settled within [`SETTLE_TIMEOUT`].
pub async fn consume<S, M, H, Fut>(
    streams: Vec<S>,
    gate: &ConsumerGate,
    ledger: &Arc<Ledger>,
    expected: usize,
    handle: H,
) where
    S: Stream<Item = M> + Unpin + Send + 'static,
    M: Send + 'static,
    H: Fn(ConsumerGate, Arc<Ledger>, M) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Handled<String, String>> + Send,
{
    let settled = Arc::new(AtomicUsize::new(0));
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    for mut stream in streams {
        let (gate, ledger, settled, stop_tx, handle) = (
            gate.clone(),
            ledger.clone(),
            settled.clone(),
            stop_tx.clone(),
            handle.clone(),
        );
        let mut stop_rx = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    item = stream.next() => item,
                    _ = stop_rx.changed() => break,
                };
                let item = item.expect("the consumer's stream ended");
                let handled = handle(gate.clone(), ledger.clone(), item).await;
                ledger.record(&handled);
                if !matches!(handled.action(), Action::Retry { .. })
                    && settled.fetch_add(1, Ordering::SeqCst) + 1 == expected
                {
                    let _ = stop_tx.send(true);
                }
            }
        }));
    }
    let done = tokio::time::timeout(SETTLE_TIMEOUT, stop_rx.wait_for(|s| *s)).await;
    assert!(
        done.is_ok(),
        "only {} of {expected} messages settled; outcomes: {:?}",
        settled.load(Ordering::SeqCst),
        ledger.outcomes.lock().unwrap()
    );
    for task in tasks {
        task.await.expect("consumer task");
    }
}
