//! Coalescing single operations from concurrent callers into batches, for a store whose batch
//! costs much less per op than a single call (a round trip, a script run, a transaction and its
//! commit). Each op is still decided on its own and each caller gets its own answer; only the
//! per-call cost is shared. Nothing waits for a batch to fill: a batch takes whatever queued
//! while earlier batches were in flight, so a lone caller's op goes out at once, alone.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::error::{GateError, StoreError};
use crate::model::RecordId;
use crate::op::Outcome;
use crate::valid::ValidOp;

/// How much a [`Coalescer`] holds and sends at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoalesceLimits {
    /// Most ops waiting to be sent; callers wait for room when it is full.
    pub queue_max: usize,
    /// Most batches in flight at once: ops that wait for a slot share the next batch.
    pub in_flight_max: usize,
    /// Most ops in one batch.
    pub batch_max: usize,
}

/// One caller's op waiting to be sent.
struct Job {
    id: RecordId,
    op: ValidOp,
    reply: oneshot::Sender<Result<Outcome, GateError>>,
}

/// Sends the single ops given to [`Coalescer::apply`] as batches through a store's batch path.
/// Dropping it stops its task once the queued ops are answered.
#[derive(Debug)]
pub struct Coalescer {
    queue: mpsc::Sender<Job>,
}

impl Coalescer {
    /// Starts the coalescing task on the current tokio runtime. `batch` decides a run of ops and
    /// answers each, in order, as a store's `apply_batch` does.
    pub fn spawn<F, Fut>(limits: CoalesceLimits, batch: F) -> Self
    where
        F: Fn(Vec<(RecordId, ValidOp)>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<Outcome, GateError>>> + Send + 'static,
    {
        let (queue, rx) = mpsc::channel(limits.queue_max.max(1));
        tokio::spawn(run(limits, batch, rx));
        Self { queue }
    }

    /// Decides `op` in the next batch; answers as the batch answered it.
    pub async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        let stopped = || {
            GateError::Store(StoreError::Unavailable(
                "the coalescing task stopped".into(),
            ))
        };
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Job { id, op, reply })
            .await
            .map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

/// Takes queued ops and sends them as batches: each batch takes whatever queued while it waited
/// for an in-flight slot (never waiting for more), up to `batch_max`. An op whose caller has
/// stopped waiting (its future dropped, as at a store's `op_timeout`, and told `unavailable`)
/// is dropped unsent: sent, it would still be decided, and a claim its caller was told was not
/// decided would hold the key for its lease against the caller's own retry. An op already sent
/// when its caller goes is decided; `unavailable` allows that.
async fn run<F, Fut>(limits: CoalesceLimits, batch: F, mut queue: mpsc::Receiver<Job>)
where
    F: Fn(Vec<(RecordId, ValidOp)>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Result<Outcome, GateError>>> + Send + 'static,
{
    let in_flight = Arc::new(Semaphore::new(limits.in_flight_max.max(1)));
    while let Some(first) = queue.recv().await {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut jobs = vec![first];
        while jobs.len() < limits.batch_max {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        // Checked once the slot is taken: waiting for it is where callers time out.
        jobs.retain(|job| !job.reply.is_closed());
        if jobs.is_empty() {
            continue;
        }
        let (ops, replies): (Vec<_>, Vec<_>) =
            jobs.into_iter().map(|j| ((j.id, j.op), j.reply)).unzip();
        let decided = batch(ops);
        tokio::spawn(async move {
            let _permit = permit;
            let mut answers = decided.await.into_iter();
            for reply in replies {
                let answer = answers.next().unwrap_or_else(|| {
                    Err(GateError::Store(StoreError::Unavailable(
                        "the batch answered fewer ops than it was given".into(),
                    )))
                });
                let _ = reply.send(answer);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::memory::MemoryStore;
    use crate::op::Claim;
    use crate::store::Store;

    fn claim() -> ValidOp {
        let opts = crate::ClaimOptions {
            ttl_ms: Some(60_000),
            lease_ms: Some(30_000),
            ..Default::default()
        };
        ValidOp::claim(opts, crate::Defaults::default()).unwrap()
    }

    /// Concurrent callers share batches, each gets its own answer (one "new" per key), and a
    /// lone call goes out at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_ops_share_batches_and_get_their_own_answers() {
        let store = Arc::new(MemoryStore::new());
        let batches = Arc::new(AtomicUsize::new(0));
        let limits = CoalesceLimits {
            queue_max: 1_024,
            in_flight_max: 1,
            batch_max: 64,
        };
        let coalescer = {
            let (store, batches) = (store.clone(), batches.clone());
            Arc::new(Coalescer::spawn(limits, move |ops| {
                let (store, batches) = (store.clone(), batches.clone());
                async move {
                    batches.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    store.apply_batch(ops).await
                }
            }))
        };
        let tasks: Vec<_> = (0..400)
            .map(|i| {
                let coalescer = coalescer.clone();
                tokio::spawn(async move {
                    let id = RecordId::new("co", format!("k{}", i % 100)).unwrap();
                    coalescer.apply(id, claim()).await
                })
            })
            .collect();
        let mut new = 0;
        for t in tasks {
            if let Ok(Outcome::Claimed(Claim::New(_))) = t.await.unwrap() {
                new += 1;
            }
        }
        assert_eq!(new, 100, "one new per key");
        let sent = batches.load(Ordering::SeqCst);
        assert!(sent < 400, "ops shared batches: {sent} batches for 400 ops");

        let before = batches.load(Ordering::SeqCst);
        let lone = coalescer
            .apply(RecordId::new("co", "alone").unwrap(), claim())
            .await;
        assert!(matches!(lone, Ok(Outcome::Claimed(Claim::New(_)))));
        assert_eq!(batches.load(Ordering::SeqCst), before + 1);
    }

    /// An op whose caller stopped waiting while it queued (as a store's `op_timeout` does,
    /// answering `unavailable`) was still sent once a slot came free, and decided: a claim
    /// the caller was told was not decided took the key for its lease. It is dropped unsent.
    #[tokio::test]
    async fn an_op_whose_caller_is_gone_is_never_sent() {
        let store = Arc::new(MemoryStore::new());
        let gate = Arc::new(Semaphore::new(0));
        let batches = Arc::new(AtomicUsize::new(0));
        let limits = CoalesceLimits {
            queue_max: 8,
            in_flight_max: 1,
            batch_max: 8,
        };
        // The memory store behind a batch call that waits until the test lets it through.
        let coalescer = {
            let (store, gate, batches) = (store.clone(), gate.clone(), batches.clone());
            Arc::new(Coalescer::spawn(limits, move |ops| {
                let (store, gate, batches) = (store.clone(), gate.clone(), batches.clone());
                async move {
                    batches.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    store.apply_batch(ops).await
                }
            }))
        };
        let id = |key: &str| RecordId::new("co", key).unwrap();
        // The one slot is taken by a batch held in the store.
        let first = {
            let coalescer = coalescer.clone();
            tokio::spawn(async move { coalescer.apply(id("first"), claim()).await })
        };
        while batches.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // This op queues behind it, and its caller gives up waiting.
        let gone = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            coalescer.apply(id("gone"), claim()),
        )
        .await;
        assert!(gone.is_err(), "the op was answered while the slot was held");
        gate.add_permits(1_000);
        assert!(matches!(
            first.await.unwrap(),
            Ok(Outcome::Claimed(Claim::New(_)))
        ));
        // An op queued after it is answered only once anything sent before it was decided.
        let after = coalescer.apply(id("after"), claim()).await;
        assert!(matches!(after, Ok(Outcome::Claimed(Claim::New(_)))));
        let found = store.apply(id("gone"), ValidOp::get()).await;
        assert!(
            matches!(found, Ok(Outcome::Found(None))),
            "the op of a caller that had gone was decided: {found:?}"
        );
    }

    /// A batch that answers fewer ops than it was given leaves no caller hanging.
    #[tokio::test]
    async fn a_short_batch_answers_the_rest_unavailable() {
        let limits = CoalesceLimits {
            queue_max: 8,
            in_flight_max: 1,
            batch_max: 8,
        };
        let coalescer = Coalescer::spawn(limits, |_ops| async { Vec::new() });
        let answer = coalescer
            .apply(RecordId::new("co", "k").unwrap(), claim())
            .await;
        assert!(matches!(
            answer,
            Err(GateError::Store(StoreError::Unavailable(_)))
        ));
    }
}
