//! [`KafkaConsumer`]: the receive loop, one task per record in hand, the periodic commit and
//! the rebalance callbacks.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError as RdKafkaError, KafkaResult};
use rdkafka::{ClientContext, TopicPartitionList};
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::config::RecordKey;
use super::dead_letter::DeadLetters;
use super::partitions::{Partitions, Tp};
use super::record::key_of;
use super::{blocking, KafkaConfig, KafkaError, Record};
use crate::{Action, Attempt, ConsumerGate, Handled, Message};

/// What a consumer did so far, counted per record outcome.
#[derive(Debug, Default)]
struct Counters {
    records: AtomicU64,
    ran: AtomicU64,
    duplicates: AtomicU64,
    retries: AtomicU64,
    dead_lettered: AtomicU64,
    dropped: AtomicU64,
    abandoned: AtomicU64,
    assigned: AtomicU64,
    revoked: AtomicU64,
}

/// A snapshot of a consumer's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Records taken into hand.
    pub records: u64,
    /// Records whose handler ran on this consumer (including runs whose completion was not
    /// recorded).
    pub ran: u64,
    /// Records settled as duplicates of a completed key.
    pub duplicates: u64,
    /// Attempts retried in process (a failure, a key in progress elsewhere, the gate
    /// unavailable).
    pub retries: u64,
    /// Records rejected and produced to the dead-letter topic.
    pub dead_lettered: u64,
    /// Records rejected with no dead-letter topic configured: logged and committed past.
    pub dropped: u64,
    /// Records whose partition was revoked while they were in hand (also those whose handler
    /// ran meanwhile): not committed, left to the partition's next holder.
    pub abandoned: u64,
    /// Partitions assigned to this consumer by the group, counted per assignment.
    pub partitions_assigned: u64,
    /// Partitions revoked from this consumer by a rebalance (or its leaving the group).
    pub partitions_revoked: u64,
}

impl Counters {
    fn snapshot(&self) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            records: get(&self.records),
            ran: get(&self.ran),
            duplicates: get(&self.duplicates),
            retries: get(&self.retries),
            dead_lettered: get(&self.dead_lettered),
            dropped: get(&self.dropped),
            abandoned: get(&self.abandoned),
            partitions_assigned: get(&self.assigned),
            partitions_revoked: get(&self.revoked),
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The consumer's rdkafka context: keeps [`Partitions`] in step with the group's assignment
/// and commits a partition's settled records before it is revoked.
struct GroupContext {
    partitions: Arc<Partitions>,
    counters: Arc<Counters>,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                // From here the partitions' records in hand no longer count (see Partitions);
                // what is settled is committed while the partitions are still ours.
                let settled = self.partitions.revoke(tpl);
                if settled.count() > 0 {
                    if let Err(e) = consumer.commit(&settled, CommitMode::Sync) {
                        tracing::warn!(error = %e, "kafka: commit on revoke failed; the next holder redelivers those records, which the gate answers as duplicates");
                    }
                }
                self.counters
                    .revoked
                    .fetch_add(tpl.count() as u64, Ordering::Relaxed);
                tracing::info!(partitions = tpl.count(), "kafka: partitions revoked");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka: rebalance error"),
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.partitions.assign(tpl);
            self.counters
                .assigned
                .fetch_add(tpl.count() as u64, Ordering::Relaxed);
            tracing::info!(partitions = tpl.count(), "kafka: partitions assigned");
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => self.partitions.committed(offsets),
            // Offered again at the next commit (OffsetTracker::to_commit).
            Err(e) => tracing::debug!(error = %e, "kafka: commit failed; retried"),
        }
    }
}

/// What every record task shares.
struct Shared {
    gate: ConsumerGate,
    record_key: RecordKey,
    key_header: String,
    partitions: Arc<Partitions>,
    dead_letters: Option<DeadLetters>,
    counters: Arc<Counters>,
}

/// A Kafka consumer group member that runs a handler once per key through a [`ConsumerGate`].
/// See the [module docs](super) for how each outcome maps onto Kafka.
pub struct KafkaConsumer {
    consumer: Arc<StreamConsumer<GroupContext>>,
    config: KafkaConfig,
    shared: Arc<Shared>,
}

impl fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("topics", &self.config.topics)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// Creates the consumer (and the dead-letter producer, when configured) and subscribes to
    /// the topics; records are received once [`KafkaConsumer::run`] runs.
    pub fn new(gate: ConsumerGate, config: KafkaConfig) -> Result<Self, KafkaError> {
        let partitions = Arc::new(Partitions::default());
        let counters = Arc::new(Counters::default());
        let mut client = ClientConfig::new();
        for (name, value) in &config.properties {
            client.set(name, value);
        }
        client
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        let consumer: StreamConsumer<GroupContext> = client
            .create_with_context(GroupContext {
                partitions: partitions.clone(),
                counters: counters.clone(),
            })
            .map_err(KafkaError::Client)?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(KafkaError::Client)?;
        let dead_letters = DeadLetters::new(&config)?;
        Ok(Self {
            consumer: Arc::new(consumer),
            shared: Arc::new(Shared {
                gate,
                record_key: config.record_key.clone(),
                key_header: config.key_header.clone(),
                partitions,
                dead_letters,
                counters,
            }),
            config,
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> Stats {
        self.shared.counters.snapshot()
    }

    /// Receives records and runs `handler` for each through the gate until `shutdown`
    /// completes; then lets the records in hand settle (for up to the configured grace),
    /// commits what settled and returns the counters. Fails (after the same settling) only on
    /// an error librdkafka calls fatal; others it retries by itself. Records of a partition are handled
    /// concurrently (up to the in-flight bound); their offsets are committed in order, each
    /// once it and every record before it settled.
    ///
    /// ```no_run
    /// # async fn demo(gate: dedupgate_consumers::ConsumerGate) -> Result<(), Box<dyn std::error::Error>> {
    /// use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer};
    /// let config = KafkaConfig::new("localhost:9092", "billing", &["orders"])?
    ///     .dead_letter_topic("orders.dlq")?;
    /// let consumer = KafkaConsumer::new(gate, config)?;
    /// let stats = consumer
    ///     .run(
    ///         |msg| async move {
    ///             println!("charging {}", msg.key);
    ///             Ok::<_, std::io::Error>("done")
    ///         },
    ///         async { tokio::signal::ctrl_c().await.ok(); },
    ///     )
    ///     .await?;
    /// println!("{stats:?}");
    /// # Ok(()) }
    /// ```
    pub async fn run<H, Fut, T, E, S>(&self, handler: H, shutdown: S) -> Result<Stats, KafkaError>
    where
        H: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + Send + 'static,
        E: fmt::Display + crate::Permanence + Send + 'static,
        S: Future<Output = ()>,
    {
        let handler = Arc::new(handler);
        let slots = Arc::new(Semaphore::new(self.config.in_flight));
        let mut tasks = JoinSet::new();
        let mut commits = tokio::time::interval(self.config.commit_every);
        commits.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut slot = None;
        let mut fatal = None;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = commits.tick() => self.commit(),
                Some(joined) = tasks.join_next() => log_join(joined),
                permit = slots.clone().acquire_owned(), if slot.is_none() => {
                    // The semaphore is never closed.
                    slot = permit.ok();
                }
                received = self.consumer.recv(), if slot.is_some() => match received {
                    Ok(message) => {
                        let record = Record::from_message(&message);
                        drop(message);
                        let tp: Tp = (record.topic.clone(), record.partition);
                        match self.shared.partitions.take(&tp, record.offset) {
                            Ok(epoch) => {
                                bump(&self.shared.counters.records);
                                let permit = slot.take();
                                let shared = self.shared.clone();
                                let handler = handler.clone();
                                tasks.spawn(async move {
                                    handle_record(&shared, record, epoch, handler.as_ref()).await;
                                    drop(permit);
                                });
                            }
                            Err(why) => tracing::debug!(
                                position = %record.position(),
                                "kafka: record not taken: {why}"
                            ),
                        }
                    }
                    // The consumer cannot go on (librdkafka says so): stop taking records and
                    // settle what is in hand, as on shutdown, then say why.
                    Err(e @ RdKafkaError::MessageConsumptionFatal(_)) => {
                        tracing::error!(error = %e, "kafka: fatal consumer error");
                        fatal = Some(e);
                        break;
                    }
                    Err(e) => {
                        // librdkafka retries by itself; a pause keeps a persistent error from
                        // spinning this loop.
                        tracing::warn!(error = %e, "kafka: receive failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        let grace = tokio::time::sleep(self.config.shutdown_grace);
        tokio::pin!(grace);
        while !tasks.is_empty() {
            tokio::select! {
                Some(joined) = tasks.join_next() => log_join(joined),
                () = &mut grace => {
                    tracing::warn!(
                        in_hand = tasks.len(),
                        "kafka: records still in hand at shutdown are abandoned uncommitted"
                    );
                    self.shared
                        .counters
                        .abandoned
                        .fetch_add(tasks.len() as u64, Ordering::Relaxed);
                    tasks.shutdown().await;
                }
            }
        }
        self.commit_at_stop().await;
        match fatal {
            Some(e) => Err(KafkaError::Client(e)),
            None => Ok(self.stats()),
        }
    }

    /// Commits every held partition's settled position that the broker has not acknowledged,
    /// asynchronously: librdkafka only queues the request, so this does not block.
    fn commit(&self) {
        let positions = self.shared.partitions.to_commit();
        if positions.count() == 0 {
            return;
        }
        // Acknowledged through the commit callback; a failure is offered again next time.
        if let Err(e) = self.consumer.commit(&positions, CommitMode::Async) {
            tracing::debug!(error = %e, "kafka: commit failed; retried");
        }
    }

    /// The last commit, synchronous (the broker's answer is awaited, up to librdkafka's
    /// timeout), so off the runtime's threads.
    async fn commit_at_stop(&self) {
        let positions = self.shared.partitions.to_commit();
        if positions.count() == 0 {
            return;
        }
        let consumer = self.consumer.clone();
        let sent = positions.clone();
        match blocking(move || consumer.commit(&sent, CommitMode::Sync)).await {
            Ok(()) => self.shared.partitions.committed(&positions),
            Err(e) => tracing::warn!(error = %e, "kafka: commit at stop failed"),
        }
    }

    /// Records in hand right now.
    pub fn in_flight(&self) -> usize {
        self.shared.partitions.in_flight()
    }
}

fn log_join(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            // The record stays unsettled: its partition's commits stop there, and it is
            // received again after a restart or a rebalance.
            tracing::error!(error = %e, "kafka: a record task panicked");
        }
    }
}

/// One record, from its key to settled: processed through the gate and, as the outcome's
/// [`Action`] says, settled (ack), held and retried in process (retry), or dead-lettered and
/// then settled (reject). Stops, unsettled, once its partition is revoked.
async fn handle_record<H, Fut, T, E>(shared: &Shared, record: Record, epoch: u64, handler: &H)
where
    H: Fn(Message) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize,
    E: fmt::Display + crate::Permanence,
{
    let tp: Tp = (record.topic.clone(), record.partition);
    let counters = &shared.counters;
    let key = match key_of(
        &shared.gate,
        &shared.record_key,
        &shared.key_header,
        &record,
    ) {
        Ok(key) => key,
        Err(why) => {
            // No key: the gate logs the rejection, and the record is dead-lettered.
            let handled: Handled<T, E> = shared
                .gate
                .process_key(Err(why), &record.payload, Attempt::FIRST, handler)
                .await;
            if !(dead_letter(shared, &record, &tp, epoch, Why::of(&handled)).await
                && shared.partitions.settle(&tp, epoch, record.offset))
            {
                bump(&counters.abandoned);
            }
            return;
        }
    };
    let mut attempt = 1u32;
    loop {
        if !shared.partitions.holds(&tp, epoch) {
            bump(&counters.abandoned);
            return;
        }
        let handled: Handled<T, E> = shared
            .gate
            .process_key(
                Ok(key.clone()),
                &record.payload,
                Attempt::nth(attempt),
                handler,
            )
            .await;
        // Idempotent mode: a failed handler's dead letter is recorded as unsettled until the
        // broker acknowledges it, so a revoke, stop or crash meanwhile does not let the next
        // holder ack the record as a duplicate; a duplicate that finds the record is
        // dead-lettered instead.
        let (action, pending) = shared.gate.settle_action(&handled).await;
        match (&handled, &action) {
            (Handled::Ran { .. } | Handled::Unrecorded { .. }, _) => bump(&counters.ran),
            (Handled::Duplicate { .. }, Action::Ack) => bump(&counters.duplicates),
            _ => {}
        }
        match action {
            Action::Ack => break,
            Action::Retry { after, .. } => {
                bump(&counters.retries);
                tokio::time::sleep(after).await;
                attempt = attempt.saturating_add(1);
            }
            Action::Reject => {
                let mut why = Why::of(&handled);
                drop(handled);
                if let Some(pending) = &pending {
                    // A duplicate's dead letter says why its first delivery was rejected.
                    why.label = "failed";
                    why.reason.clone_from(&pending.reason);
                }
                if !dead_letter(shared, &record, &tp, epoch, why).await {
                    bump(&counters.abandoned);
                    return;
                }
                if let Some(pending) = pending {
                    shared.gate.unsettled().clear(&pending.key).await;
                }
                break;
            }
        }
    }
    // Revoked while it was processed: its outcome does not count here (see Partitions).
    if !shared.partitions.settle(&tp, epoch, record.offset) {
        bump(&counters.abandoned);
    }
}

/// Why a record is dead-lettered, owned: the outcome is not held across the publish.
struct Why {
    key: Option<String>,
    label: &'static str,
    reason: String,
}

impl Why {
    fn of<T, E: fmt::Display>(handled: &Handled<T, E>) -> Self {
        Self {
            key: handled.key().map(str::to_owned),
            label: handled.label(),
            reason: handled.to_string(),
        }
    }
}

/// Dead-letters a rejected record, trying again after the gate's unavailable delay until the
/// broker acknowledges (or, with no dead-letter topic, logs it as dropped). False when the
/// partition was revoked first: the record is then left unsettled.
async fn dead_letter(shared: &Shared, record: &Record, tp: &Tp, epoch: u64, why: Why) -> bool {
    let Some(dead_letters) = &shared.dead_letters else {
        bump(&shared.counters.dropped);
        tracing::error!(
            position = %record.position(),
            "kafka: rejected with no dead-letter topic configured, committed past: {}",
            why.reason
        );
        return true;
    };
    loop {
        match dead_letters
            .send(record, why.key.as_deref(), why.label, &why.reason)
            .await
        {
            Ok(()) => {
                bump(&shared.counters.dead_lettered);
                return true;
            }
            Err(e) => {
                tracing::warn!(error = %e, position = %record.position(), "kafka: dead-letter publish failed; retried");
                tokio::time::sleep(shared.gate.unavailable_delay()).await;
                if !shared.partitions.holds(tp, epoch) {
                    return false;
                }
            }
        }
    }
}
