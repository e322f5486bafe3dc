//! [`TransactionalPipe`]: Kafka to Kafka in one transaction per batch. Records are consumed
//! (`read_committed`), gated by key, turned into output records by a handler, produced by a
//! transactional producer, and the consumed offsets are sent to the same transaction; the
//! gate's claims are completed once the transaction commits and released when it aborts.
//! See the [module docs](super) for what the transaction covers and what the gate adds.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, GateError, InvalidInput, Mode, State, Token};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::{watch, Notify};

use super::dead_letter::dead_letter_headers;
use super::partitions::Tp;
use super::record::key_of;
use super::{blocking, KafkaConfig, KafkaError, Record, DEDUP_KEY_HEADER};
use crate::{ConsumerGate, Rejection};

/// Default bound of records in one transaction: a batch commits when it holds this many.
pub const BATCH_RECORDS_DEFAULT: usize = 500;
/// Largest batch accepted: each record of an open batch keeps its claim (a key and a token)
/// in memory, and an abort makes every one of them be consumed again.
pub const BATCH_RECORDS_MAX: usize = 10_000;
/// Default longest time a transaction stays open: a record is committed (and visible to
/// `read_committed` readers) at most this long after it was consumed, while records keep coming.
pub const BATCH_EVERY_DEFAULT: Duration = Duration::from_millis(100);
/// Default `transaction.timeout.ms`: the broker aborts a transaction left open this long (a
/// pipe that died mid-batch), which lets the partitions' next holder read past it.
pub const TRANSACTION_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);
/// Default bound of one blocking transaction call (init, send offsets, commit, abort).
pub const TRANSACTION_CALL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// How many times `commit_transaction` is called in all while it fails with a retriable error
/// (its outcome unknown: librdkafka says to call it again). Past that the pipe stops with
/// [`KafkaError::CommitUnknown`], the claims left held: the transaction may have committed.
const COMMIT_TRIES: u32 = 5;
/// How long an output waits for room in the producer's queue before the batch is aborted.
const QUEUE_FULL_WAIT: Duration = Duration::from_secs(10);

/// The pipe's settings: the consumer's ([`KafkaConfig`]: cluster, group, topics, keys,
/// dead-letter topic) plus the producer's transactional id and the batch bounds.
/// [`KafkaConfig::in_flight`], `commit_every` and `shutdown_grace` do not apply: records are
/// handled one at a time, in order, and committed with their transaction.
#[derive(Clone, Debug)]
pub struct PipeConfig {
    pub(crate) source: KafkaConfig,
    pub(crate) transactional_id: String,
    pub(crate) batch_records: usize,
    pub(crate) batch_every: Duration,
    pub(crate) transaction_timeout: Duration,
    pub(crate) call_timeout: Duration,
}

impl PipeConfig {
    /// A pipe consuming as `source` says and producing as `transactional_id`, which must be
    /// the same for every run of one pipe instance (a restarted instance fences its
    /// predecessor with it) and different between instances that run at once.
    pub fn new(source: KafkaConfig, transactional_id: &str) -> Result<Self, InvalidInput> {
        if transactional_id.is_empty() {
            return Err(InvalidInput::new("transactional_id", "must not be empty"));
        }
        Ok(Self {
            source,
            transactional_id: transactional_id.to_owned(),
            batch_records: BATCH_RECORDS_DEFAULT,
            batch_every: BATCH_EVERY_DEFAULT,
            transaction_timeout: TRANSACTION_TIMEOUT_DEFAULT,
            call_timeout: TRANSACTION_CALL_TIMEOUT_DEFAULT,
        })
    }

    /// Commits a transaction once it holds `records` records (1..=[`BATCH_RECORDS_MAX`]) or
    /// has been open `every` (1 ms to 60 s), whichever comes first.
    pub fn batch(mut self, records: usize, every: Duration) -> Result<Self, InvalidInput> {
        if records == 0 || records > BATCH_RECORDS_MAX {
            return Err(InvalidInput::new(
                "batch_records",
                format!("must be 1..={BATCH_RECORDS_MAX}, got {records}"),
            ));
        }
        if every < Duration::from_millis(1) || every > Duration::from_secs(60) {
            return Err(InvalidInput::new(
                "batch_every",
                format!("must be 1 ms to 60 s, got {every:?}"),
            ));
        }
        self.batch_records = records;
        self.batch_every = every;
        Ok(self)
    }

    /// The producer's `transaction.timeout.ms`, 1 s to 15 minutes (the broker's default cap).
    pub fn transaction_timeout(mut self, timeout: Duration) -> Result<Self, InvalidInput> {
        if timeout < Duration::from_secs(1) || timeout > Duration::from_secs(900) {
            return Err(InvalidInput::new(
                "transaction_timeout",
                format!("must be 1 s to 15 minutes, got {timeout:?}"),
            ));
        }
        self.transaction_timeout = timeout;
        Ok(self)
    }

    /// How long one blocking transaction call (init, send offsets, commit, abort) may take,
    /// 1 s to 5 minutes (default [`TRANSACTION_CALL_TIMEOUT_DEFAULT`]). A commit that times out
    /// is called again (see [`KafkaError::CommitUnknown`]), so the pipe waits for a commit at
    /// most a few times this.
    pub fn call_timeout(mut self, timeout: Duration) -> Result<Self, InvalidInput> {
        if timeout < Duration::from_secs(1) || timeout > Duration::from_secs(300) {
            return Err(InvalidInput::new(
                "call_timeout",
                format!("must be 1 s to 5 minutes, got {timeout:?}"),
            ));
        }
        self.call_timeout = timeout;
        Ok(self)
    }

    /// The transactional id.
    pub fn transactional_id(&self) -> &str {
        &self.transactional_id
    }
}

/// What the handler gets: a consumed record whose key this pipe now holds.
#[derive(Clone, Debug)]
pub struct Input {
    /// The dedup key.
    pub key: String,
    /// The record.
    pub record: Record,
    /// This pipe's attempt at the record, from 1 (a failed handler is retried in process).
    pub attempt: u32,
    /// The gate's fencing token of this attempt's claim (as [`crate::Message::fence`]).
    pub fence: u64,
}

/// One record for the handler to produce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// The topic.
    pub topic: String,
    /// The partition; `None` lets the producer's partitioner choose (by `key`).
    pub partition: Option<i32>,
    /// The record's Kafka key.
    pub key: Option<Vec<u8>>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Headers, in order. The pipe adds [`DEDUP_KEY_HEADER`] with the dedup key.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Output {
    /// A record of `payload` for `topic`.
    pub fn new(topic: &str, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            topic: topic.to_owned(),
            partition: None,
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Sets the Kafka key.
    pub fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the partition.
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }
}

#[derive(Debug, Default)]
struct Counters {
    records: AtomicU64,
    ran: AtomicU64,
    duplicates: AtomicU64,
    produced: AtomicU64,
    retries: AtomicU64,
    dead_lettered: AtomicU64,
    dropped: AtomicU64,
    committed: AtomicU64,
    aborted: AtomicU64,
    unrecorded: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A snapshot of a pipe's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PipeStats {
    /// Records consumed and handled (a record consumed again after an abort counts again).
    pub records: u64,
    /// Handler runs whose outputs went into a transaction (also runs later aborted).
    pub ran: u64,
    /// Records whose key was completed (or taken earlier in the same batch): nothing produced.
    pub duplicates: u64,
    /// Output records produced into transactions (also those later aborted).
    pub produced: u64,
    /// Attempts retried in process (a failed handler, a key held elsewhere, the gate
    /// unavailable).
    pub retries: u64,
    /// Records produced to the dead-letter topic, in their transaction.
    pub dead_lettered: u64,
    /// Records rejected with no dead-letter topic configured: logged and committed past.
    pub dropped: u64,
    /// Transactions committed.
    pub transactions_committed: u64,
    /// Transactions aborted (their claims released, their records consumed again).
    pub transactions_aborted: u64,
    /// Claims whose transaction committed but whose completion the store did not record: the
    /// keys stay held until their lease runs out.
    pub unrecorded: u64,
}

impl Counters {
    fn snapshot(&self) -> PipeStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PipeStats {
            records: get(&self.records),
            ran: get(&self.ran),
            duplicates: get(&self.duplicates),
            produced: get(&self.produced),
            retries: get(&self.retries),
            dead_lettered: get(&self.dead_lettered),
            dropped: get(&self.dropped),
            transactions_committed: get(&self.committed),
            transactions_aborted: get(&self.aborted),
            unrecorded: get(&self.unrecorded),
        }
    }
}

/// A claim held by the open transaction.
#[derive(Clone, Debug)]
struct Held {
    key: String,
    token: Token,
}

/// The open transaction: what it claimed and which records it consumed.
#[derive(Debug, Default)]
struct Batch {
    /// `begin_transaction` was called and neither commit nor abort since.
    open: bool,
    started: Option<Instant>,
    /// Full: commit at the receive loop's next turn.
    due: bool,
    records: usize,
    claims: Vec<Held>,
    keys: HashSet<String>,
    /// Per partition: the batch's first offset (where a rewind goes back to) and the next
    /// offset to consume (what the transaction commits).
    positions: HashMap<Tp, (i64, i64)>,
    /// A revoke aborted the transaction (inside the consumer's poll); the receive loop
    /// releases the claims and rewinds what is still assigned. `Some(Err)`: the abort failed.
    revoked: Option<Result<(), RdKafkaError>>,
}

impl Batch {
    /// Takes a consumed record's position. The first offset is the lowest taken, not the
    /// first seen: a record consumed again after a rewind comes before records taken earlier
    /// in the batch, and the rewind must go back to it.
    fn take_position(&mut self, tp: Tp, offset: i64) {
        let next = offset.saturating_add(1);
        self.positions
            .entry(tp)
            .and_modify(|(first, n)| {
                *first = (*first).min(offset);
                *n = (*n).max(next);
            })
            .or_insert((offset, next));
    }

    /// A revoke aborted the transaction (`aborted` says whether the abort went through). No
    /// transaction is open and no commit is due: the run loop's next turn releases the claims
    /// and rewinds ([`TransactionalPipe::after_revoke`]) instead of a commit timer firing
    /// again and again on a batch that cannot commit.
    fn revoke(&mut self, aborted: Result<(), RdKafkaError>) {
        self.open = false;
        self.started = None;
        self.due = false;
        self.revoked = Some(aborted);
    }

    /// When the open batch must commit: now when full, else its period after it began; never
    /// with no transaction open.
    fn deadline(&self, every: Duration) -> Option<Instant> {
        let started = self.started?;
        Some(if self.due { started } else { started + every })
    }
}

fn lock(batch: &Mutex<Batch>) -> MutexGuard<'_, Batch> {
    // Each change to the batch is one call under the lock; a panic elsewhere cannot leave it
    // half-updated.
    batch.lock().unwrap_or_else(|p| p.into_inner())
}

/// The consumer's context: on a revoke, aborts the open transaction before the partitions go,
/// so that no offset of theirs is committed by this member afterwards.
struct PipeContext {
    producer: Arc<FutureProducer>,
    batch: Arc<Mutex<Batch>>,
    call_timeout: Duration,
    /// Wakes the run loop after a revoke: the poll that ran the callback may end without a
    /// record, and the revoked batch's claims must not wait for the next one to be released.
    revoked: Arc<Notify>,
}

impl ClientContext for PipeContext {}

impl ConsumerContext for PipeContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let mut batch = lock(&self.batch);
            if batch.open {
                // Blocking, inside the consumer's poll (so on the task that polls): the
                // partitions must not go while the transaction that would commit their
                // offsets is still open, and the callback cannot wait for anything else.
                let aborted = self.producer.abort_transaction(self.call_timeout);
                tracing::info!(
                    partitions = tpl.count(),
                    ok = aborted.is_ok(),
                    "kafka pipe: partitions revoked; the open transaction was aborted"
                );
                batch.revoke(aborted);
                self.revoked.notify_one();
            }
        }
    }
}

/// Kafka to Kafka, exactly once: consume, gate, produce and commit the consumed offsets in one
/// transaction. See the [module docs](super).
pub struct TransactionalPipe {
    gate: ConsumerGate,
    config: PipeConfig,
    consumer: Arc<StreamConsumer<PipeContext>>,
    producer: Arc<FutureProducer>,
    batch: Arc<Mutex<Batch>>,
    /// Per record (partition, offset): the attempts its outputs failed to be produced, so that
    /// a record whose outputs never go through is dead-lettered after `max_attempts` instead
    /// of aborting every batch. Entries go once their record commits.
    produce_failures: Mutex<HashMap<(Tp, i64), u32>>,
    /// Set once `run`'s shutdown completed: the waits between retries of the record in hand
    /// end early, so a stop is not held up by a record that keeps failing.
    stopping: watch::Sender<bool>,
    /// Notified by the revoke callback (see [`PipeContext`]).
    revoked: Arc<Notify>,
    counters: Counters,
}

impl fmt::Debug for TransactionalPipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalPipe")
            .field("transactional_id", &self.config.transactional_id)
            .field("topics", &self.config.source.topics)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl TransactionalPipe {
    /// Creates the consumer (`read_committed`, subscribed) and the transactional producer;
    /// [`TransactionalPipe::run`] initializes the transactions and starts consuming. Refused
    /// when the gate is in idempotent mode (an aborted transaction must be able to release its
    /// keys, and a mark cannot be released) or when a batch may stay open longer than a third
    /// of the gate's lease (its claims would lapse before they are completed).
    pub fn new(gate: ConsumerGate, config: PipeConfig) -> Result<Self, KafkaError> {
        if gate.mode == Mode::Idempotent {
            return Err(KafkaError::Invalid(InvalidInput::new(
                "mode",
                "a transactional pipe needs the retriable mode: an aborted transaction releases its claims",
            )));
        }
        let lease = Duration::from_millis(
            gate.lease_ms
                .unwrap_or_else(|| gate.gate().defaults().lease_ms),
        );
        if config.batch_every.saturating_mul(3) > lease {
            return Err(KafkaError::Invalid(InvalidInput::new(
                "batch_every",
                format!(
                    "must be at most a third of the gate's lease ({lease:?}), got {:?}",
                    config.batch_every
                ),
            )));
        }
        let mut producer_config = config.source.producer_config();
        producer_config
            .set("transactional.id", &config.transactional_id)
            .set(
                "transaction.timeout.ms",
                config.transaction_timeout.as_millis().to_string(),
            );
        let producer: Arc<FutureProducer> =
            Arc::new(producer_config.create().map_err(KafkaError::Client)?);
        let batch = Arc::new(Mutex::new(Batch::default()));
        let revoked = Arc::new(Notify::new());
        let mut consumer_config = ClientConfig::new();
        for (name, value) in &config.source.properties {
            consumer_config.set(name, value);
        }
        consumer_config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            // Records of transactions still open or aborted upstream are not inputs.
            .set("isolation.level", "read_committed");
        let consumer: StreamConsumer<PipeContext> = consumer_config
            .create_with_context(PipeContext {
                producer: producer.clone(),
                batch: batch.clone(),
                call_timeout: config.call_timeout,
                revoked: revoked.clone(),
            })
            .map_err(KafkaError::Client)?;
        let topics: Vec<&str> = config.source.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(KafkaError::Client)?;
        Ok(Self {
            gate,
            config,
            consumer: Arc::new(consumer),
            producer,
            batch,
            produce_failures: Mutex::default(),
            stopping: watch::Sender::new(false),
            revoked,
            counters: Counters::default(),
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> PipeStats {
        self.counters.snapshot()
    }

    /// Initializes the transactions (fencing any earlier producer with this transactional id
    /// and aborting what it left open), then consumes until `shutdown` completes, and commits
    /// the open transaction. For each record whose key is new, `handler` returns the records
    /// to produce; a handler's error releases the key and, the records before it committed,
    /// the record is tried again in process after the gate's failure delay (dead-lettered on
    /// attempt `max_attempts`, when set). Fails when this producer is fenced
    /// ([`KafkaError::Fenced`]) or the transactions cannot go on ([`KafkaError::Transaction`]),
    /// in both cases after aborting and releasing the open batch's claims.
    ///
    /// ```no_run
    /// # async fn demo(gate: dedupgate_consumers::ConsumerGate) -> Result<(), Box<dyn std::error::Error>> {
    /// use dedupgate_consumers::kafka::{KafkaConfig, Output, PipeConfig, TransactionalPipe};
    /// let source = KafkaConfig::new("localhost:9092", "enricher", &["orders"])?;
    /// let pipe = TransactionalPipe::new(gate, PipeConfig::new(source, "enricher-0")?)?;
    /// let stats = pipe
    ///     .run(
    ///         |input| async move {
    ///             let out = Output::new("orders.enriched", input.record.payload.clone());
    ///             Ok::<_, std::io::Error>(vec![out])
    ///         },
    ///         async { tokio::signal::ctrl_c().await.ok(); },
    ///     )
    ///     .await?;
    /// println!("{stats:?}");
    /// # Ok(()) }
    /// ```
    pub async fn run<H, Fut, E, S>(&self, handler: H, shutdown: S) -> Result<PipeStats, KafkaError>
    where
        H: Fn(Input) -> Fut,
        Fut: Future<Output = Result<Vec<Output>, E>>,
        E: fmt::Display,
        S: Future<Output = ()>,
    {
        self.stopping.send_replace(false);
        let producer = self.producer.clone();
        let call_timeout = self.config.call_timeout;
        blocking(move || producer.init_transactions(call_timeout))
            .await
            .map_err(|e| self.fatal(e))?;
        tokio::pin!(shutdown);
        let stopped = loop {
            // A revoke happens inside the consumer's poll, which may end without a record:
            // its batch is settled at the next turn, whichever branch woke the loop.
            if let Err(e) = self.after_revoke().await {
                break Err(e);
            }
            // Checked before receiving: while records keep coming, the receive branch is
            // always ready and a timer alone would never get its turn.
            if self.due() {
                if let Err(e) = self.commit(None).await {
                    break Err(e);
                }
            }
            let deadline = lock(&self.batch)
                .deadline(self.config.batch_every)
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                () = sleep_until(deadline) => {
                    if let Err(e) = self.commit(None).await {
                        break Err(e);
                    }
                }
                // Settled at the top of the next turn.
                () = self.revoked.notified() => {}
                received = self.consumer.recv() => {
                    let rewound = match self.after_revoke().await {
                        Ok(rewound) => rewound,
                        Err(e) => break Err(e),
                    };
                    match received {
                        Ok(message) => {
                            let record = Record::from_message(&message);
                            drop(message);
                            let tp: Tp = (record.topic.clone(), record.partition);
                            // Fetched before the rewind: it comes again from the rewound position.
                            if rewound.contains(&tp) {
                                continue;
                            }
                            let work = self.process(record, &handler);
                            tokio::pin!(work);
                            let (done, stop) = tokio::select! {
                                biased;
                                done = &mut work => (done, false),
                                () = &mut shutdown => {
                                    // The record in hand finishes what it is doing (a
                                    // handler run, a commit) but waits for no retry.
                                    self.stopping.send_replace(true);
                                    (work.await, true)
                                }
                            };
                            if let Err(e) = done {
                                break Err(e);
                            }
                            if stop {
                                break Ok(());
                            }
                        }
                        Err(e @ RdKafkaError::MessageConsumptionFatal(_)) => {
                            break Err(KafkaError::Client(e));
                        }
                        Err(e) => {
                            // librdkafka retries by itself; a pause keeps a persistent error from
                            // spinning this loop.
                            tracing::warn!(error = %e, "kafka pipe: receive failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
        };
        match stopped {
            Ok(()) => {
                self.after_revoke().await?;
                self.commit(None).await?;
                Ok(self.stats())
            }
            Err(e) => {
                // Whatever is still open is given up: aborted when the producer still can,
                // its claims released either way.
                let batch = std::mem::take(&mut *lock(&self.batch));
                if batch.open {
                    let producer = self.producer.clone();
                    let _ = blocking(move || producer.abort_transaction(call_timeout)).await;
                }
                self.release(&batch.claims).await;
                Err(e)
            }
        }
    }

    /// True when the open batch is full or has been open for the batch period.
    fn due(&self) -> bool {
        lock(&self.batch)
            .deadline(self.config.batch_every)
            .is_some_and(|d| d <= Instant::now())
    }

    /// One record: its key, the gate, the handler, its outputs into the open transaction.
    /// When a commit made while it is in hand aborts, the record is dropped here: the rewind
    /// went back to it (or before), so it is consumed again.
    async fn process<H, Fut, E>(&self, record: Record, handler: &H) -> Result<(), KafkaError>
    where
        H: Fn(Input) -> Fut,
        Fut: Future<Output = Result<Vec<Output>, E>>,
        E: fmt::Display,
    {
        bump(&self.counters.records);
        let gate = &self.gate;
        let key = match key_of(
            gate,
            &self.config.source.record_key,
            &self.config.source.key_header,
            &record,
        ) {
            Ok(key) => key,
            Err(why) => {
                return self
                    .reject(&record, None, "rejected", &why.to_string())
                    .await
            }
        };
        let tp: Tp = (record.topic.clone(), record.partition);
        let in_hand = Some((&tp, record.offset));
        let failures = self.produce_failures_of(&tp, record.offset);
        let policy = gate.failure_retry;
        if failures > 0 && policy.gives_up(Some(failures)) {
            let reason = format!("{key}: its outputs could not be produced {failures} times");
            return self.reject(&record, Some(&key), "failed", &reason).await;
        }
        let mut attempt = failures.saturating_add(1);
        loop {
            if lock(&self.batch).keys.contains(&key) {
                // A copy of a key this transaction holds: it commits (or aborts) with the first.
                bump(&self.counters.duplicates);
                return self.add(&record).await;
            }
            let claimed = gate
                .gate()
                .claim(&gate.namespace, &key, gate.claim_options(&record.payload))
                .await;
            let lease = match claimed {
                Ok(Claim::New(lease)) => lease,
                Ok(Claim::Duplicate { record: held }) if held.state == State::Completed => {
                    bump(&self.counters.duplicates);
                    return self.add(&record).await;
                }
                Ok(Claim::Duplicate { record: held }) => {
                    // Held by another member: commit what is done (so this batch's claims
                    // are not held while waiting), then ask again.
                    if self.commit(in_hand).await? == Settled::Aborted {
                        return Ok(());
                    }
                    bump(&self.counters.retries);
                    if !self
                        .pause(gate.in_progress_delay(held.lease_expires_at_ms))
                        .await
                    {
                        return Ok(());
                    }
                    continue;
                }
                Err(GateError::FingerprintMismatch) => {
                    let why = Rejection::FingerprintMismatch { key: key.clone() };
                    return self
                        .reject(&record, Some(&key), "rejected", &why.to_string())
                        .await;
                }
                Err(GateError::Invalid(invalid)) if invalid.field == "key" => {
                    let why = Rejection::InvalidKey(invalid);
                    return self
                        .reject(&record, Some(&key), "rejected", &why.to_string())
                        .await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, position = %record.position(), "kafka pipe: the gate could not decide; retried");
                    if self.commit(in_hand).await? == Settled::Aborted {
                        return Ok(());
                    }
                    bump(&self.counters.retries);
                    if !self.pause(gate.unavailable_delay()).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            let held = Held {
                key: key.clone(),
                token: lease.token,
            };
            let input = Input {
                key: key.clone(),
                record: record.clone(),
                attempt,
                fence: lease.fence,
            };
            let outcome = self
                .renewing(std::slice::from_ref(&held), handler(input))
                .await;
            let outputs = match outcome {
                Ok(outputs) => outputs,
                Err(e) => {
                    self.release(std::slice::from_ref(&held)).await;
                    let reason = format!("{key}: handler failed on attempt {attempt}: {e}");
                    if policy.gives_up(Some(attempt)) {
                        return self.reject(&record, Some(&key), "failed", &reason).await;
                    }
                    tracing::warn!(position = %record.position(), "kafka pipe: {reason}; retried");
                    // The records before it commit now; it is retried in hand.
                    if self.commit(in_hand).await? == Settled::Aborted {
                        return Ok(());
                    }
                    bump(&self.counters.retries);
                    if !self.pause(policy.jittered_delay(Some(attempt))).await {
                        // Stopping: neither taken into the batch nor committed; consumed
                        // again by the partition's next reader.
                        return Ok(());
                    }
                    attempt = attempt.saturating_add(1);
                    continue;
                }
            };
            bump(&self.counters.ran);
            if let Err(e) = self.begun().await {
                // No transaction could begin: the claim is not the batch's, so it is let go here.
                self.release(std::slice::from_ref(&held)).await;
                return Err(e);
            }
            {
                let mut batch = lock(&self.batch);
                batch.keys.insert(key.clone());
                batch.claims.push(held.clone());
            }
            for output in &outputs {
                // A full producer queue can keep it waiting: the claims stay renewed.
                if let Err(e) = self.renewing(&[], self.produce(output, &key)).await {
                    // The record's position joins the batch so the rewind covers it.
                    self.add(&record).await?;
                    self.count_produce_failure(&tp, record.offset);
                    tracing::warn!(error = %e, position = %record.position(), "kafka pipe: an output could not be produced; the transaction is aborted");
                    let batch = std::mem::take(&mut *lock(&self.batch));
                    self.abort(batch, e, None).await?;
                    // A broker refusing the outputs is not hammered.
                    self.pause(policy.jittered_delay(Some(attempt))).await;
                    return Ok(());
                }
                bump(&self.counters.produced);
            }
            return self.add(&record).await;
        }
    }

    /// Waits `delay`, or less once the pipe is stopping: false when it is.
    async fn pause(&self, delay: Duration) -> bool {
        let mut stopping = self.stopping.subscribe();
        let slept = tokio::select! {
            () = tokio::time::sleep(delay) => true,
            _ = stopping.wait_for(|s| *s) => false,
        };
        slept && !*self.stopping.borrow()
    }

    /// Takes `record`'s offset into the open transaction (beginning one if none is open) and
    /// commits when the batch is full.
    async fn add(&self, record: &Record) -> Result<(), KafkaError> {
        self.begun().await?;
        let mut batch = lock(&self.batch);
        batch.take_position((record.topic.clone(), record.partition), record.offset);
        batch.records += 1;
        if batch.records >= self.config.batch_records {
            // Committed by the receive loop's next turn.
            batch.due = true;
        }
        Ok(())
    }

    /// Begins a transaction on the producer unless one is open. `begin_transaction` waits for
    /// librdkafka's own thread, so it runs off the runtime's threads; records are processed
    /// one at a time, so no other begin races it.
    async fn begun(&self) -> Result<(), KafkaError> {
        if lock(&self.batch).open {
            return Ok(());
        }
        let producer = self.producer.clone();
        blocking(move || producer.begin_transaction())
            .await
            .map_err(|e| self.fatal(e))?;
        let mut batch = lock(&self.batch);
        batch.open = true;
        batch.started = Some(Instant::now());
        Ok(())
    }

    /// Puts one output into the open transaction (its delivery is awaited by the commit).
    async fn produce(&self, output: &Output, key: &str) -> Result<(), RdKafkaError> {
        let mut headers = OwnedHeaders::new_with_capacity(output.headers.len() + 1);
        for (name, value) in &output.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        headers = headers.insert(Header {
            key: DEDUP_KEY_HEADER,
            value: Some(key),
        });
        let mut record = FutureRecord::<[u8], [u8]>::to(&output.topic)
            .payload(&output.payload)
            .headers(headers);
        if let Some(k) = &output.key {
            record = record.key(k);
        }
        if let Some(p) = output.partition {
            record = record.partition(p);
        }
        self.send(record).await
    }

    /// Enqueues `record` on the transactional producer, waiting for room in its queue.
    async fn send(&self, mut record: FutureRecord<'_, [u8], [u8]>) -> Result<(), RdKafkaError> {
        let waited = Instant::now();
        loop {
            match self.producer.send_result(record) {
                // The commit flushes the producer and fails when a delivery failed.
                Ok(_delivery) => return Ok(()),
                Err((RdKafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if waited.elapsed() < QUEUE_FULL_WAIT =>
                {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// A rejected record: its copy produced to the dead-letter topic in the open transaction
    /// (or, with none configured, logged), and its offset taken into the transaction.
    async fn reject(
        &self,
        record: &Record,
        key: Option<&str>,
        outcome: &str,
        reason: &str,
    ) -> Result<(), KafkaError> {
        let Some(topic) = &self.config.source.dead_letter_topic else {
            bump(&self.counters.dropped);
            tracing::error!(position = %record.position(), "kafka pipe: rejected with no dead-letter topic configured, committed past: {reason}");
            return self.add(record).await;
        };
        self.begun().await?;
        let mut copy = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(&record.payload)
            .headers(dead_letter_headers(record, key, outcome, reason));
        if let Some(k) = &record.key {
            copy = copy.key(k);
        }
        if let Err(e) = self.renewing(&[], self.send(copy)).await {
            self.add(record).await?;
            let batch = std::mem::take(&mut *lock(&self.batch));
            return self.abort(batch, e, None).await;
        }
        bump(&self.counters.dead_lettered);
        self.add(record).await
    }

    /// Commits the open transaction with its consumed offsets, then completes its claims.
    /// `in_hand`: the record being processed, not in the batch, when the commit is made
    /// before it settles. The batch's claims are renewed while the commit is under way.
    ///
    /// A commit known not to have happened (an error librdkafka says needs an abort, a fatal
    /// error, offsets the transaction refused) aborts: see [`TransactionalPipe::abort`]. A
    /// commit whose outcome is unknown (it kept timing out) is asked again, up to
    /// [`COMMIT_TRIES`] calls; then the pipe stops with [`KafkaError::CommitUnknown`] and the
    /// claims are neither completed nor released: they lapse with their leases, so that a
    /// transaction that did commit is not run again by another delivery meanwhile.
    async fn commit(&self, in_hand: Option<(&Tp, i64)>) -> Result<Settled, KafkaError> {
        if lock(&self.batch).revoked.is_some() {
            // Not here from the run loop, which settles a revoke first: a revoke cannot come
            // while a record is processed (it comes inside the consumer's poll).
            self.after_revoke().await?;
            return Ok(Settled::Aborted);
        }
        let batch = {
            let mut batch = lock(&self.batch);
            if !batch.open {
                return Ok(Settled::Nothing);
            }
            std::mem::take(&mut *batch)
        };
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), (_, next)) in &batch.positions {
            // The list only refuses a partition below -1; offsets are ≥ 0.
            let _ = offsets.add_partition_offset(topic, *partition, Offset::Offset(*next));
        }
        let Some(group) = self.consumer.group_metadata() else {
            // Only a consumer outside a group has none (`group.id` is required): abort.
            let e = RdKafkaError::ClientCreation("no consumer group metadata".into());
            return self
                .abort(batch, e, in_hand)
                .await
                .map(|()| Settled::Aborted);
        };
        let call_timeout = self.config.call_timeout;
        if !offsets.elements().is_empty() {
            let producer = self.producer.clone();
            let sent = blocking(move || {
                producer.send_offsets_to_transaction(&offsets, &group, call_timeout)
            });
            if let Err(e) = self.renewing(&batch.claims, sent).await {
                // Nothing was committed: the transaction can only abort.
                return self
                    .abort(batch, e, in_hand)
                    .await
                    .map(|()| Settled::Aborted);
            }
        }
        let mut calls = 0;
        loop {
            calls += 1;
            let producer = self.producer.clone();
            let committed = blocking(move || producer.commit_transaction(call_timeout));
            match self.renewing(&batch.claims, committed).await {
                Ok(()) => break,
                Err(e) if !outcome_unknown(&e) => {
                    return self
                        .abort(batch, e, in_hand)
                        .await
                        .map(|()| Settled::Aborted);
                }
                Err(e) if calls < COMMIT_TRIES => {
                    tracing::warn!(error = %e, calls, "kafka pipe: commit outcome unknown; called again");
                }
                Err(e) => {
                    tracing::error!(error = %e, calls, claims = batch.claims.len(), "kafka pipe: commit outcome still unknown; stopping with the claims held until their leases run out");
                    return Err(KafkaError::CommitUnknown {
                        transactional_id: self.config.transactional_id.clone(),
                        cause: e,
                    });
                }
            }
        }
        bump(&self.counters.committed);
        {
            let mut failures = self
                .produce_failures
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            failures.retain(|(tp, offset), _| {
                batch
                    .positions
                    .get(tp)
                    .is_none_or(|(_, next)| *offset >= *next)
            });
        }
        let gate = &self.gate;
        for held in &batch.claims {
            if let Err(e) = gate
                .gate()
                .complete(&gate.namespace, &held.key, &held.token, None)
                .await
            {
                // Kafka has committed: the record is not consumed again. A redriven copy
                // arriving after the lease ran out would run again (see the module docs).
                bump(&self.counters.unrecorded);
                tracing::error!(key = %held.key, error = %e, "kafka pipe: transaction committed but the claim was not completed; the key stays held until its lease runs out");
            }
        }
        Ok(Settled::Committed)
    }

    /// Aborts `batch`'s transaction because of `cause`, releases its claims and rewinds its
    /// partitions to the batch's first offsets (and to `in_hand`, the record being processed,
    /// when it is below), so its records are consumed again. Fails when the producer cannot
    /// go on (fenced, or another fatal error) or a partition could not be rewound.
    async fn abort(
        &self,
        mut batch: Batch,
        cause: RdKafkaError,
        in_hand: Option<(&Tp, i64)>,
    ) -> Result<(), KafkaError> {
        let mut fatal = is_fatal(&cause).then_some(cause);
        if fatal.is_none() && batch.open {
            let producer = self.producer.clone();
            let call_timeout = self.config.call_timeout;
            if let Err(e) = blocking(move || producer.abort_transaction(call_timeout)).await {
                fatal = Some(e);
            }
        }
        self.release(&batch.claims).await;
        bump(&self.counters.aborted);
        if let Some(e) = fatal {
            return Err(self.fatal(e));
        }
        if let Some((tp, offset)) = in_hand {
            batch.take_position(tp.clone(), offset);
        }
        self.rewind(batch.positions).await.map(drop)
    }

    /// After a revoke aborted the transaction (in the consumer's poll): releases its claims
    /// and rewinds its partitions still assigned here. Returns those partitions.
    async fn after_revoke(&self) -> Result<HashSet<Tp>, KafkaError> {
        let batch = {
            let mut batch = lock(&self.batch);
            if batch.revoked.is_none() {
                return Ok(HashSet::new());
            }
            std::mem::take(&mut *batch)
        };
        self.release(&batch.claims).await;
        bump(&self.counters.aborted);
        if let Some(Err(e)) = batch.revoked {
            return Err(self.fatal(e));
        }
        self.rewind(batch.positions).await
    }

    /// Seeks each partition still assigned back to its batch's first offset; returns them.
    ///
    /// A seek that fails stops the pipe ([`KafkaError::Rewind`]): the consumer would go on
    /// past records whose transaction aborted, and a later commit would commit their offsets
    /// unprocessed. Pausing the partition until a seek succeeds would keep it from the rest
    /// of the group meanwhile; stopping gives it up, and its next reader (another member, or
    /// this pipe restarted) resumes from its committed offset, which is at or below the
    /// aborted batch's first record. The claims are released before (by the abort).
    async fn rewind(&self, positions: HashMap<Tp, (i64, i64)>) -> Result<HashSet<Tp>, KafkaError> {
        if positions.is_empty() {
            return Ok(HashSet::new());
        }
        let consumer = self.consumer.clone();
        let rewound = blocking(move || {
            let assigned = consumer.assignment().unwrap_or_default();
            Ok(rewind_each(
                &positions,
                |(topic, partition)| assigned.find_partition(topic, *partition).is_some(),
                |(topic, partition), first| {
                    consumer.seek(
                        topic,
                        *partition,
                        Offset::Offset(first),
                        Duration::from_secs(5),
                    )
                },
            ))
        })
        .await
        .map_err(|cause| RewindFailed {
            tp: (String::new(), -1),
            cause,
        })
        .and_then(|r| r);
        rewound.map_err(|failed| {
            tracing::error!(topic = %failed.tp.0, partition = failed.tp.1, error = %failed.cause, "kafka pipe: rewind failed; stopping");
            KafkaError::Rewind {
                topic: failed.tp.0,
                partition: failed.tp.1,
                cause: failed.cause,
            }
        })
    }

    /// Releases claims of an aborted transaction. A release that fails leaves the key held
    /// until its lease runs out; the record, consumed again, waits for it.
    async fn release(&self, claims: &[Held]) {
        let gate = &self.gate;
        for held in claims {
            if let Err(e) = gate
                .gate()
                .release(&gate.namespace, &held.key, &held.token)
                .await
            {
                tracing::warn!(key = %held.key, error = %e, "kafka pipe: claim not released; held until its lease runs out");
            }
        }
    }

    /// Drives `work` (a handler, a produce waiting for room, a commit) while renewing the
    /// lease of every claim of the open batch and of `extra` (the claim in hand, or the
    /// claims of a batch being committed) every third of the lease: a wait longer than a
    /// lease must not let another delivery take a key this pipe still holds.
    async fn renewing<T>(&self, extra: &[Held], work: impl Future<Output = T>) -> T {
        let gate = &self.gate;
        let lease_ms = gate
            .lease_ms
            .unwrap_or_else(|| gate.gate().defaults().lease_ms);
        let period = Duration::from_millis((lease_ms / 3).max(1));
        tokio::pin!(work);
        loop {
            tokio::select! {
                value = &mut work => return value,
                () = tokio::time::sleep(period) => {
                    let mut held = lock(&self.batch).claims.clone();
                    held.extend_from_slice(extra);
                    for h in &held {
                        // A lost lease shows at the completion (counted as unrecorded).
                        let _ = gate
                            .gate()
                            .extend(&gate.namespace, &h.key, &h.token, lease_ms)
                            .await;
                    }
                }
            }
        }
    }

    fn produce_failures_of(&self, tp: &Tp, offset: i64) -> u32 {
        let failures = self
            .produce_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        failures.get(&(tp.clone(), offset)).copied().unwrap_or(0)
    }

    fn count_produce_failure(&self, tp: &Tp, offset: i64) {
        let mut failures = self
            .produce_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *failures.entry((tp.clone(), offset)).or_default() += 1;
    }

    /// The error a producer that cannot go on stops with.
    fn fatal(&self, cause: RdKafkaError) -> KafkaError {
        if is_fenced(&cause) {
            KafkaError::Fenced {
                transactional_id: self.config.transactional_id.clone(),
                cause,
            }
        } else {
            KafkaError::Transaction(cause)
        }
    }
}

/// True when the producer cannot go on: librdkafka says the error is fatal, or it is a
/// fencing error.
fn is_fatal(e: &RdKafkaError) -> bool {
    match e {
        RdKafkaError::Transaction(t) => t.is_fatal() || is_fenced(e),
        _ => is_fenced(e) || e.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal),
    }
}

/// True when another producer with the same transactional id took over.
fn is_fenced(e: &RdKafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::TransactionCoordinatorFenced
        )
    )
}

/// What a commit did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// No transaction was open.
    Nothing,
    Committed,
    /// The transaction aborted (or a revoke had aborted it): its claims are released and its
    /// partitions rewound, to the record in hand too.
    Aborted,
}

/// True when a failed `commit_transaction` may still have committed: not an error that
/// needs an abort (the coordinator refused) and not fatal (fenced and the like), which all
/// mean it did not. Retriable errors (a timeout) and any other say nothing either way.
fn outcome_unknown(e: &RdKafkaError) -> bool {
    match e {
        RdKafkaError::Transaction(t) => !t.txn_requires_abort() && !is_fatal(e),
        _ => !is_fatal(e),
    }
}

/// A partition whose seek failed.
#[derive(Debug)]
struct RewindFailed {
    tp: Tp,
    cause: RdKafkaError,
}

/// Seeks each partition of `positions` that `assigned` says is held back to its first
/// offset; the partitions sought, or the first whose seek failed.
fn rewind_each(
    positions: &HashMap<Tp, (i64, i64)>,
    assigned: impl Fn(&Tp) -> bool,
    mut seek: impl FnMut(&Tp, i64) -> Result<(), RdKafkaError>,
) -> Result<HashSet<Tp>, RewindFailed> {
    let mut rewound = HashSet::new();
    for (tp, (first, _)) in positions {
        if !assigned(tp) {
            continue;
        }
        seek(tp, *first).map_err(|cause| RewindFailed {
            tp: tp.clone(),
            cause,
        })?;
        rewound.insert(tp.clone());
    }
    Ok(rewound)
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "g", &["t"]).unwrap()
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(
            PipeConfig::new(source(), "").unwrap_err().field,
            "transactional_id"
        );
        let c = PipeConfig::new(source(), "tx").unwrap();
        assert_eq!(c.transactional_id(), "tx");
        assert_eq!(
            c.clone()
                .batch(0, Duration::from_millis(5))
                .unwrap_err()
                .field,
            "batch_records"
        );
        assert_eq!(
            c.clone().batch(1, Duration::ZERO).unwrap_err().field,
            "batch_every"
        );
        assert_eq!(
            c.clone()
                .transaction_timeout(Duration::from_millis(10))
                .unwrap_err()
                .field,
            "transaction_timeout"
        );
        let c = c.batch(7, Duration::from_millis(5)).unwrap();
        assert_eq!(
            (c.batch_records, c.batch_every),
            (7, Duration::from_millis(5))
        );
    }

    fn tp(partition: i32) -> Tp {
        ("t".to_owned(), partition)
    }

    /// A record consumed again after a rewind (here 3, after 7 and 8 were taken) lowers the
    /// batch's first offset: a later rewind goes back to it, not to the first offset seen.
    #[test]
    fn the_first_offset_is_the_lowest_taken() {
        let mut batch = Batch::default();
        batch.take_position(tp(0), 7);
        batch.take_position(tp(0), 8);
        batch.take_position(tp(1), 2);
        batch.take_position(tp(0), 3);
        batch.take_position(tp(0), 4);
        assert_eq!(batch.positions[&tp(0)], (3, 9));
        assert_eq!(batch.positions[&tp(1)], (2, 3));
    }

    /// A revoke leaves no commit due and no timer armed: before, the batch kept its start, so
    /// the loop's timer fired at once on every turn while the revoke waited for a record.
    #[test]
    fn a_revoked_batch_arms_no_commit_timer() {
        let every = Duration::from_millis(100);
        let mut batch = Batch {
            open: true,
            started: Some(Instant::now() - Duration::from_secs(1)),
            due: true,
            ..Batch::default()
        };
        assert!(batch.deadline(every).is_some_and(|d| d <= Instant::now()));
        batch.revoke(Ok(()));
        assert_eq!(batch.deadline(every), None);
        assert!(!batch.open);
        assert!(matches!(batch.revoked, Some(Ok(()))));
    }

    /// A seek that fails is reported with its partition (the pipe stops on it) instead of
    /// being skipped; partitions no longer assigned are not sought.
    #[test]
    fn a_failed_seek_is_an_error() {
        let positions: HashMap<Tp, (i64, i64)> =
            [(tp(0), (5, 9)), (tp(1), (2, 4)), (tp(2), (0, 1))].into();
        let mut sought = Vec::new();
        let ok = rewind_each(
            &positions,
            |t| t.1 != 2,
            |t, first| {
                sought.push((t.1, first));
                Ok(())
            },
        )
        .unwrap();
        sought.sort();
        assert_eq!(sought, [(0, 5), (1, 2)]);
        assert_eq!(ok, HashSet::from([tp(0), tp(1)]));
        let failed = rewind_each(
            &positions,
            |_| true,
            |t, _| {
                if t.1 == 1 {
                    Err(RdKafkaError::Seek("erroneous state".into()))
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
        assert_eq!(failed.tp, tp(1));
    }

    #[test]
    fn the_call_timeout_is_bounded() {
        let c = PipeConfig::new(source(), "tx").unwrap();
        assert_eq!(c.call_timeout, TRANSACTION_CALL_TIMEOUT_DEFAULT);
        assert_eq!(
            c.clone().call_timeout(Duration::ZERO).unwrap_err().field,
            "call_timeout"
        );
        assert_eq!(
            c.call_timeout(Duration::from_secs(2)).unwrap().call_timeout,
            Duration::from_secs(2)
        );
    }
}
