//! Kafka consumer groups through rdkafka (librdkafka): [`KafkaConsumer::run`] receives records
//! and runs a handler once per key through a [`ConsumerGate`](crate::ConsumerGate), whatever the number of times a
//! record is delivered (rebalances, restarts before a commit, producer retries, replays).
//!
//! Kafka has no per-message acknowledgement: a consumer commits a position, which says every
//! record below it is done. So the consumer never lets librdkafka commit (no auto-commit, no
//! auto offset store); each partition has an [`OffsetTracker`], and a partition's position is
//! committed (every [`KafkaConfig::commit_every`], on revoke and on shutdown) up to its lowest
//! record not yet settled. Records of one partition are handled concurrently, up to
//! [`KafkaConfig::in_flight`] in hand across partitions (at the bound the consumer stops
//! fetching); their commits stay in order.
//!
//! Each outcome's [`Action`](crate::Action) (the table in the [crate docs](crate)) becomes:
//!
//! | action | Kafka |
//! |---|---|
//! | ack (ran, duplicate, ran but unrecorded) | settled: committed once every record before it is |
//! | retry after a delay (a failure, a key held elsewhere, the gate unavailable) | held: waits the delay and is processed again in process, as delivery `n + 1`; its partition's commit stays below it meanwhile, the other records go on |
//! | reject (no usable key, fingerprint mismatch, a failure not retried) | produced to the dead-letter topic with why in `dedupgate-reason` (and `dedupgate-outcome`, `dedupgate-source`, `dedupgate-key`) headers, then settled; a failed publish is tried again (idempotent mode: recorded as [`Unsettled`](crate::Unsettled) first, so the partition's next holder dead-letters the record instead of acking it as a duplicate); with no dead-letter topic, logged as an error and settled |
//!
//! Delivery counts ([`Attempt`](crate::Attempt)) are this consumer's own attempts at a record:
//! Kafka does not count deliveries. `max_attempts` ([`ConsumerGate::max_attempts`](crate::ConsumerGate::max_attempts)) applies
//! to them, and a record's count starts again at 1 on its partition's next holder.
//!
//! A rebalance that revokes a partition stops its records in hand from counting: they are not
//! retried, not settled and not committed, and what was settled before is committed while the
//! partition is still ours. Its next holder receives the unsettled records again; the gate
//! holds a key still running here (its lease is renewed while the handler runs, by
//! [`Gate::run_with`](dedupgate_core::Gate::run_with)), so the copy waits and then finds it
//! completed. No record is lost (nothing unsettled is committed) and none runs twice.
//!
//! Keys: by default the record's `idempotency-key` header ([`KafkaConfig::key_header`] names
//! another). With a key template on the gate ([`ConsumerGate::key_template`](crate::ConsumerGate::key_template)) the key is
//! rendered over the payload's JSON fields, with the record's headers under `headers`
//! (`{headers.tenant}:{order.id}`, `{asset}_{ts|window:5m}`). [`KafkaConfig::key_from_position`]
//! keys by `topic/partition/offset`, which catches only redeliveries of the same record: a
//! redriven or re-produced record has a new offset, hence a new key, and runs again.
//!
//! Limits: the consumer polls Kafka only while it has room for another record, and rebalance
//! callbacks run inside that poll. A consumer whose every slot stays taken (handlers or retries
//! that wait) past librdkafka's `max.poll.interval.ms` (5 minutes) is dropped from the group;
//! its partitions go to another member and its records in hand are abandoned as on a revoke.
//!
//! ## Kafka to Kafka, exactly once: [`TransactionalPipe`]
//!
//! [`TransactionalPipe::run`] consumes (`read_committed`, in a group), gates each record by
//! key (the same key sources as above), and for a new key runs a handler that returns the
//! [`Output`] records to produce. A transactional, idempotent producer
//! ([`PipeConfig::new`]'s `transactional.id`) puts them into a transaction, with the consumed
//! offsets (`send_offsets_to_transaction`, the group's metadata); the transaction commits once
//! per [`PipeConfig::batch`] (N records or T ms). Records are handled one at a time, in order.
//!
//! | what happens | the pipe |
//! |---|---|
//! | a new key | claimed; the handler's outputs go into the open transaction (each with the key in the `dedupgate-key` header); the claim is completed after the commit |
//! | a duplicate of a completed key, or of a key this transaction already holds | nothing produced; its offset commits in the transaction |
//! | a key held by another member, or the gate undecided | the open transaction commits first (its claims are not held while waiting), then the claim is asked again after the in-progress (or unavailable) delay |
//! | the handler fails | its claim is released, the transaction commits what came before, and the record is tried again in process after the failure delay; on attempt `max_attempts` (when set) it is dead-lettered instead |
//! | no usable key, a fingerprint mismatch | its copy goes to the dead-letter topic in the same transaction (logged and committed past with none configured) |
//! | an output cannot be produced, or the commit is refused (an error that needs an abort) | the transaction is aborted, **every claim it holds is released**, and its partitions are rewound to the batch's first offsets (and to the record in hand, consumed again too): its records are consumed again (a record whose outputs fail `max_attempts` times is dead-lettered) |
//! | the commit's outcome is unknown (it keeps timing out) | `commit_transaction` is called again, a few times; then [`TransactionalPipe::run`] stops with [`KafkaError::CommitUnknown`], **the claims held** (not released: the transaction may have committed) until their leases run out |
//! | a partition cannot be rewound after an abort | the pipe stops with [`KafkaError::Rewind`], its claims released; the partition's next reader resumes from its committed offset |
//! | shutdown while a record is retried | the wait before its next attempt ends; the record is left uncommitted, what came before commits, and `run` returns |
//! | a rebalance revokes partitions | the open transaction is aborted inside the revoke callback, before the partitions go; its claims are released and the partitions still held are rewound |
//! | the producer is fenced (another instance initialized the same `transactional.id`) or a fatal error | the claims are released and [`TransactionalPipe::run`] stops with [`KafkaError::Fenced`] (or [`KafkaError::Transaction`]) |
//!
//! What Kafka's transaction covers, and only within Kafka: the outputs and the consumed
//! offsets become visible together or not at all, so a record consumed again after a crash,
//! an abort or a rebalance (offsets not committed) has left no visible output, and once they
//! are committed the record is not consumed again by the group. The idempotent producer stops
//! its own retries from writing a record twice. What the gate adds: keys seen across records,
//! not positions. A copy of an event produced again upstream (a producer that retried with a
//! new record, a replay of a range, a record redriven from a dead-letter topic, a second
//! source topic) has a new offset, which Kafka's transaction takes for a new record; the gate
//! answers it as a duplicate for the key's ttl. And a handler with effects outside Kafka (a
//! call, a write elsewhere) runs again whenever a transaction aborts: the gate cannot undo
//! it, so such effects must be idempotent themselves, or go through a separate
//! [`ConsumerGate`](crate::ConsumerGate) keyed in the handler, whose completion an abort does
//! not release.
//!
//! Crash windows, plainly:
//! - before the commit (in the handler, while producing, in `commit_transaction`): the broker
//!   aborts the transaction (at the next `init_transactions` with the same id, or after its
//!   timeout); no output is visible, no offset committed; the claims stay held until their
//!   lease runs out, so the records, consumed again by the next holder, wait up to a lease and
//!   then run.
//! - after `commit_transaction` and before the claims are completed: the outputs and offsets
//!   are committed, so Kafka does not deliver those records again (no duplicate from Kafka);
//!   but the claims are left to expire with their lease, nothing completed, so a *redriven or
//!   re-produced copy* of one of those keys runs again (one arriving within the lease waits
//!   for it to run out, then takes the key over): for those keys the gate adds nothing. The
//!   same holds when the store cannot record the completions ([`PipeStats::unrecorded`]).
//! - the gate answered a duplicate, the transaction aborted: nothing was produced for it, and
//!   the copy is consumed again and answered again.
//!
//! Bounds: a batch holds at most [`BATCH_RECORDS_MAX`] records and stays open at most 60 s
//! and at most a third of the gate's lease (refused otherwise); the claims of the open batch
//! are renewed while a handler runs, while an output waits for room in the producer's queue,
//! and while the batch commits. A key held by another pipe's open transaction waits
//! for that transaction to commit (up to its batch period). The pipe must be the only writer of its
//! `transactional.id`: two instances with one id fence each other, two instances with
//! different ids share the group's partitions.
//!
//! Inside: `config` ([`KafkaConfig`]), `offsets` ([`OffsetTracker`]), `partitions` (the held
//! partitions and their epochs), `record` ([`Record`] and its key), `dead_letter` (the
//! dead-letter producer), `consumer` (the loop and the rebalance callbacks) and
//! `transactional` (the pipe).

mod config;
mod consumer;
mod dead_letter;
mod offsets;
mod partitions;
mod record;
mod transactional;

pub use config::{
    KafkaConfig, COMMIT_EVERY_DEFAULT, IN_FLIGHT_DEFAULT, IN_FLIGHT_MAX, SHUTDOWN_GRACE_DEFAULT,
    SOURCE_KEY_HEADER_DEFAULT,
};
pub use consumer::{KafkaConsumer, Stats};
pub use dead_letter::{DEDUP_KEY_HEADER, OUTCOME_HEADER, REASON_HEADER, SOURCE_HEADER};
pub use offsets::{OffsetError, OffsetTracker};
/// The rdkafka this module is built on, for producers and admin clients of the same version.
pub use rdkafka;
pub use record::Record;
pub use transactional::{
    Input, Output, PipeConfig, PipeStats, TransactionalPipe, BATCH_EVERY_DEFAULT,
    BATCH_RECORDS_DEFAULT, BATCH_RECORDS_MAX, TRANSACTION_CALL_TIMEOUT_DEFAULT,
    TRANSACTION_TIMEOUT_DEFAULT,
};
#[allow(deprecated)]
pub use {config::KEY_HEADER_DEFAULT, dead_letter::KEY_HEADER};

/// Runs a blocking librdkafka call (a commit, a seek, a transaction call) off the runtime's
/// threads: each can wait for the broker up to its timeout.
pub(crate) async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, rdkafka::error::KafkaError> + Send + 'static,
) -> Result<T, rdkafka::error::KafkaError> {
    match tokio::task::spawn_blocking(call).await {
        Ok(result) => result,
        // The call panicked or the runtime is shutting down: treated as a failed call.
        Err(_) => Err(rdkafka::error::KafkaError::Canceled),
    }
}

/// Why the consumer could not be built or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// librdkafka refused the configuration or the subscription, or (from
    /// [`KafkaConsumer::run`]) reported an error it calls fatal.
    #[error("kafka: {0}")]
    Client(rdkafka::error::KafkaError),
    /// A rejected record could not be produced to the dead-letter topic (the consumer logs it
    /// and tries again; the record stays in hand meanwhile).
    #[error("kafka: dead-letter publish to {topic:?} failed: {cause}")]
    DeadLetter {
        /// The dead-letter topic.
        topic: String,
        /// The producer's error.
        cause: rdkafka::error::KafkaError,
    },
    /// A setting the pipe refuses ([`TransactionalPipe::new`]).
    #[error("kafka: {0}")]
    Invalid(dedupgate_core::InvalidInput),
    /// Another producer with this transactional id took over (a restarted or duplicated
    /// instance): this pipe aborted what it could, released its claims and stopped.
    #[error("kafka: producer fenced: another instance runs with transactional id {transactional_id:?} ({cause})")]
    Fenced {
        /// The transactional id.
        transactional_id: String,
        /// librdkafka's error.
        cause: rdkafka::error::KafkaError,
    },
    /// The transactional producer cannot go on (a fatal error, or an abort that failed): the
    /// pipe released its claims and stopped; the broker aborts the open transaction once
    /// its timeout passes.
    #[error("kafka: transaction failed: {0}")]
    Transaction(rdkafka::error::KafkaError),
    /// `commit_transaction` kept failing with errors that leave its outcome unknown (it may
    /// have committed): the pipe stopped without releasing the batch's claims, which lapse
    /// with their leases, so a committed batch is not run again meanwhile.
    #[error("kafka: commit outcome unknown for transactional id {transactional_id:?}; its claims are left to their leases ({cause})")]
    CommitUnknown {
        /// The transactional id.
        transactional_id: String,
        /// librdkafka's last error.
        cause: rdkafka::error::KafkaError,
    },
    /// After an abort, a partition could not be put back to the aborted batch's first record:
    /// the pipe stopped (its claims released) rather than read on past records whose outputs
    /// were aborted.
    #[error("kafka: could not rewind {topic}/{partition}: {cause}")]
    Rewind {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// librdkafka's error.
        cause: rdkafka::error::KafkaError,
    },
}
