//! A worker: consumes a list of deliveries (events, some delivered to several workers, some
//! hot keys delivered to all) through the gate, in the retriable or the idempotent ordering, and
//! performs each event's side effect through the fence-checking [`Sink`]. Every call and answer
//! goes to its [`AnswerLog`] first, so a SIGKILL at any instant leaves evidence the checker can
//! read: an unanswered call is an unknown outcome.
//!
//! Retriable: claim (owner = this attempt, retried on an unknown answer so a lost answer does
//! not lock the attempt out) → [optional self-SIGSTOP, the pause fault] → effect with the fence →
//! a short random gap (where a SIGKILL lands "between effect and completion") → complete. A
//! complete is sent even when the sink refused the write as late: it is the stale completion
//! the gate must refuse.
//!
//! Idempotent: mark (retried on an unknown answer; a retry that answers duplicate means the
//! effect is skipped, which the ordering allows) → effect with the record's fence.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::{Claim, GateError, Mark, RecordId, Store, StoreError, ValidOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

pub use crate::delivery::{Delivery, DeliveryMode};
use crate::history::{wall_ns, HAnswer, HOp};
use crate::ledger::{AnswerLog, Sink};

/// Times a delivery that found its event in progress is put back.
const REQUEUES_MAX: u32 = 8;

/// What a worker leaves behind before it stops itself (`paused-<worker>.json`), so that the
/// orchestrator can have the event taken over while the holder is stopped.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PauseNote {
    /// The delivery whose lease the stopped worker holds.
    pub delivery: Delivery,
    /// When its lease ends (store clock).
    pub lease_expires_at_ms: u64,
}

/// What one worker process does (written by the orchestrator as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerPlan {
    /// The process's name in logs and the ledger (worker and incarnation).
    pub worker: String,
    /// Seed of its random choices.
    pub seed: u64,
    /// Lease asked for on claims.
    pub lease_ms: u64,
    /// Retention asked for (long: the whole run is one window).
    pub ttl_ms: u64,
    /// Percent of held leases after which the worker SIGSTOPs itself before its effect.
    pub pause_pct: u32,
    /// A call that takes longer is abandoned as unknown.
    pub call_timeout_ms: u64,
    /// Longest gap between an effect and its completion.
    pub effect_gap_ms_max: u64,
    /// Tries per call on unknown answers.
    pub tries_max: u32,
    /// What to consume, in order.
    pub deliveries: Vec<Delivery>,
}

/// What a worker saw (for its exit line; the checkers never trust it).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Deliveries consumed.
    pub deliveries: u64,
    /// Effects the sink accepted.
    pub effects_accepted: u64,
    /// Effects the sink refused as late.
    pub effects_rejected: u64,
    /// Self-inflicted SIGSTOPs.
    pub pauses: u64,
    /// Duplicates answered.
    pub duplicates: u64,
    /// Calls whose outcome stayed unknown.
    pub unknown: u64,
}

/// A worker over one store.
pub struct Worker {
    store: Arc<dyn Store>,
    log: AnswerLog,
    sink: Sink,
    plan: WorkerPlan,
    rng: StdRng,
    attempts: u64,
    run_dir: std::path::PathBuf,
    cron: Option<(crate::cron::CronPlan, crate::cron::CronLog)>,
    proxy: Option<(crate::proxyface::ProxyPlan, crate::proxyface::PxLog)>,
    /// What it saw.
    pub stats: WorkerStats,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("worker", &self.plan.worker)
            .finish()
    }
}

impl Worker {
    /// A worker writing its answer log and effects under `run_dir`.
    pub fn new(store: Arc<dyn Store>, run_dir: &Path, plan: WorkerPlan) -> io::Result<Self> {
        Ok(Self {
            cron: None,
            proxy: None,
            log: AnswerLog::create(run_dir, &plan.worker)?,
            sink: Sink::open(run_dir)?,
            rng: StdRng::seed_from_u64(plan.seed),
            store,
            plan,
            attempts: 0,
            run_dir: run_dir.to_owned(),
            stats: WorkerStats::default(),
        })
    }

    /// Delivers through `dedupgate run` instead of the store (the cron face, [`crate::cron`]);
    /// the store is then used only for [`Worker::read`].
    pub fn with_cron(mut self, plan: crate::cron::CronPlan) -> io::Result<Self> {
        let log = crate::cron::CronLog::create(&self.run_dir, &self.plan.worker)?;
        self.cron = Some((plan, log));
        Ok(self)
    }

    /// Delivers through the Idempotency-Key proxy instead of the store (the proxy face,
    /// [`crate::proxyface`]).
    pub fn with_proxy(mut self, plan: crate::proxyface::ProxyPlan) -> io::Result<Self> {
        let log = crate::proxyface::PxLog::create(&self.run_dir, &self.plan.worker)?;
        self.proxy = Some((plan, log));
        Ok(self)
    }

    /// Sends one op, logging the call before and the answer after.
    pub async fn call(&mut self, namespace: &str, key: &str, op: HOp) -> io::Result<HAnswer> {
        let call_ns = wall_ns();
        let seq = self.log.call(namespace, key, &op, call_ns)?;
        // The identity is checked first, then the op, as every face does.
        let checked = RecordId::new(namespace, key)
            .and_then(|id| Ok((id, ValidOp::try_from(op.to_wire_op())?)));
        let result = match checked {
            Err(e) => Err(GateError::Invalid(e)),
            Ok((id, wire_op)) => {
                let fut = self.store.apply(id, wire_op);
                match tokio::time::timeout(Duration::from_millis(self.plan.call_timeout_ms), fut)
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(GateError::Store(StoreError::Unavailable(
                        "client timeout".into(),
                    ))),
                }
            }
        };
        let answer = HAnswer::from_result(&result);
        let return_ns = (!answer.is_unknown()).then(wall_ns);
        if answer.is_unknown() {
            self.stats.unknown += 1;
        }
        self.log.ret(seq, &answer, return_ns)?;
        Ok(answer)
    }

    /// Sends `op` until an answer is known or the tries run out.
    async fn call_tries(&mut self, namespace: &str, key: &str, op: HOp) -> io::Result<HAnswer> {
        let mut answer = self.call(namespace, key, op.clone()).await?;
        for _ in 1..self.plan.tries_max.max(1) {
            if !answer.is_unknown() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(self.rng.gen_range(5..50))).await;
            answer = self.call(namespace, key, op.clone()).await?;
        }
        Ok(answer)
    }

    /// Consumes every delivery of the plan. A retriable delivery that finds its event in
    /// progress elsewhere is put back and tried again later (as a broker redelivers a message
    /// that was not acknowledged), a few times, so a stalled holder's event gets taken over.
    pub async fn run(&mut self) -> io::Result<()> {
        let mut queue: std::collections::VecDeque<(Delivery, tokio::time::Instant, u32)> = self
            .plan
            .deliveries
            .iter()
            .map(|d| (d.clone(), tokio::time::Instant::now(), 0))
            .collect();
        while let Some((d, not_before, requeues)) = queue.pop_front() {
            tokio::time::sleep_until(not_before).await;
            self.stats.deliveries += 1;
            let busy = if self.cron.is_some() {
                self.cron(&d).await?
            } else if self.proxy.is_some() {
                let attempt = self.next_attempt();
                match self.proxy.as_mut() {
                    Some((plan, log)) => {
                        crate::proxyface::deliver(plan, log, &self.plan.worker, &attempt, &d)
                            .await?
                    }
                    None => false,
                }
            } else {
                match d.mode {
                    DeliveryMode::Retriable => self.retriable(&d).await?,
                    DeliveryMode::Idempotent => {
                        self.idempotent(&d).await?;
                        false
                    }
                }
            };
            if busy && requeues < REQUEUES_MAX {
                let later = tokio::time::Instant::now()
                    + Duration::from_millis(self.plan.lease_ms / 2 + self.rng.gen_range(0..20));
                queue.push_back((d, later, requeues + 1));
            }
        }
        Ok(())
    }

    /// One delivery through `dedupgate run` (see [`crate::cron`]); true when the event was in
    /// progress elsewhere.
    async fn cron(&mut self, d: &Delivery) -> io::Result<bool> {
        let attempt = self.next_attempt();
        let Some((plan, log)) = self.cron.as_mut() else {
            return Ok(false);
        };
        let out = crate::cron::deliver(
            plan,
            log,
            &mut self.rng,
            &self.run_dir,
            &self.plan.worker,
            &attempt,
            d,
            self.plan.lease_ms,
            20_000,
        )
        .await?;
        Ok(out.busy)
    }

    fn next_attempt(&mut self) -> String {
        self.attempts += 1;
        format!("{}#{}", self.plan.worker, self.attempts)
    }

    fn effect(
        &mut self,
        d: &Delivery,
        fence: u64,
        attempt: &str,
        lease_end: Option<u64>,
    ) -> io::Result<bool> {
        let accepted = self.sink.write(
            &d.namespace,
            &d.key,
            fence,
            attempt,
            &self.plan.worker,
            lease_end,
        )?;
        if accepted {
            self.stats.effects_accepted += 1;
        } else {
            self.stats.effects_rejected += 1;
        }
        Ok(accepted)
    }

    /// Returns true when the event is in progress elsewhere (worth another delivery later).
    async fn retriable(&mut self, d: &Delivery) -> io::Result<bool> {
        let attempt = self.next_attempt();
        let claim = HOp::Claim {
            ttl_ms: self.plan.ttl_ms,
            lease_ms: self.plan.lease_ms,
            fingerprint: None,
            owner: Some(attempt.clone()),
        };
        let lease = match self.call_tries(&d.namespace, &d.key, claim).await? {
            HAnswer::Claimed {
                claim: Claim::New(lease),
            } => lease,
            HAnswer::Claimed {
                claim: Claim::Duplicate { record },
            } => {
                self.stats.duplicates += 1;
                return Ok(record.state == dedupgate_core::State::InProgress);
            }
            _ => return Ok(false),
        };
        if self.plan.pause_pct > 0 && self.rng.gen_range(0..100) < self.plan.pause_pct {
            // The pause fault: stop here, holding the lease, before the effect. The orchestrator
            // sees the stopped state and sends SIGCONT after 1.5-3x the lease.
            self.stats.pauses += 1;
            let note = PauseNote {
                delivery: d.clone(),
                lease_expires_at_ms: lease.lease_expires_at_ms,
            };
            std::fs::write(
                self.run_dir
                    .join(format!("paused-{}.json", self.plan.worker)),
                serde_json::to_vec(&note).map_err(io::Error::other)?,
            )?;
            rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::STOP,
            )?;
        }
        self.effect(d, lease.fence, &attempt, Some(lease.lease_expires_at_ms))?;
        if self.plan.effect_gap_ms_max > 0 {
            let gap = self.rng.gen_range(0..=self.plan.effect_gap_ms_max);
            tokio::time::sleep(Duration::from_millis(gap)).await;
        }
        let complete = HOp::Complete {
            token: lease.token.as_str().to_owned(),
            result: Some(serde_json::json!({"attempt": attempt, "fence": lease.fence})),
            ttl_ms: None,
        };
        self.call_tries(&d.namespace, &d.key, complete).await?;
        Ok(false)
    }

    async fn idempotent(&mut self, d: &Delivery) -> io::Result<()> {
        let attempt = self.next_attempt();
        let mark = HOp::Mark {
            ttl_ms: self.plan.ttl_ms,
            fingerprint: None,
            result: Some(serde_json::json!({"attempt": attempt})),
        };
        match self.call_tries(&d.namespace, &d.key, mark).await? {
            HAnswer::Marked {
                mark: Mark::New { record },
            } => {
                self.effect(d, record.fence, &attempt, None)?;
            }
            HAnswer::Marked { .. } => self.stats.duplicates += 1,
            _ => {}
        }
        Ok(())
    }

    /// Reads `key` once (the final check that acknowledged answers survived).
    pub async fn read(&mut self, namespace: &str, key: &str) -> io::Result<HAnswer> {
        self.call_tries(namespace, key, HOp::Get).await
    }
}
