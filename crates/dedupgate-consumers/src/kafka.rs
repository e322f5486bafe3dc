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
//! | reject (no usable key, fingerprint mismatch, a failure not retried) | produced to the dead-letter topic with why in `dedupgate-reason` (and `dedupgate-outcome`, `dedupgate-source`, `dedupgate-key`) headers, then settled; a failed publish is tried again; with no dead-letter topic, logged as an error and settled |
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
//! Producing results to Kafka in the same transaction as the consumed offsets is not done here.
//!
//! Inside: `config` ([`KafkaConfig`]), `offsets` ([`OffsetTracker`]), `partitions` (the held
//! partitions and their epochs), `record` ([`Record`] and its key), `dead_letter` (the
//! dead-letter producer) and `consumer` (the loop and the rebalance callbacks).

mod config;
mod consumer;
mod dead_letter;
mod offsets;
mod partitions;
mod record;
mod transactional;

pub use config::{
    KafkaConfig, COMMIT_EVERY_DEFAULT, IN_FLIGHT_DEFAULT, IN_FLIGHT_MAX, KEY_HEADER_DEFAULT,
    SHUTDOWN_GRACE_DEFAULT,
};
pub use consumer::{KafkaConsumer, Stats};
pub use dead_letter::{KEY_HEADER, OUTCOME_HEADER, REASON_HEADER, SOURCE_HEADER};
pub use offsets::{OffsetError, OffsetTracker};
/// The rdkafka this module is built on, for producers and admin clients of the same version.
pub use rdkafka;
pub use record::Record;
pub use transactional::{
    Input, Output, PipeConfig, PipeStats, TransactionalPipe, BATCH_EVERY_DEFAULT,
    BATCH_RECORDS_DEFAULT, BATCH_RECORDS_MAX, TRANSACTION_TIMEOUT_DEFAULT,
};

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
}
