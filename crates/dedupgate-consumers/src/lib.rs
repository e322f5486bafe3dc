//! # dedupgate-consumers
//!
//! Broker consumers through the gate: each delivery's handler runs at most once per key, the way
//! Apache Camel's idempotent consumer and AWS Powertools' idempotency utility do it, with
//! [`dedupgate_core::Gate::run_with`] making every decision.
//!
//! - [`ConsumerGate`]: a [`Gate`] plus the namespace, the [`Mode`], where the key comes from
//!   ([`KeySource`]: the broker's message id or a [`KeyTemplate`] over the JSON payload), the
//!   retry delays and the [`FailureRetry`] policy for a failed handler.
//!   [`ConsumerGate::process`] turns one delivery (its payload, id and [`Attempt`], the broker's
//!   delivery count) into a [`Handled`] outcome; it knows no broker.
//! - [`Handled`]: what happened (ran, duplicate, in progress elsewhere, failed, rejected, gate
//!   unavailable) and [`Handled::action`], the one [`Action`] the broker must take: ack, retry
//!   after a delay, or reject without requeue.
//! - [`Permanence`]: every handler error says whether retrying could help; a permanent failure
//!   is rejected at once instead of retried.
//! - [`rabbitmq`] (feature `rabbitmq`, lapin): [`rabbitmq::handle`] processes one
//!   [`lapin::message::Delivery`] and acks, nacks with requeue or rejects it; the key is the AMQP
//!   `message_id` property.
//! - [`nats`] (feature `nats`, async-nats): [`nats::handle`] does the same for a JetStream pull
//!   consumer's message (ack, nak with a delay, term); the key is the `Nats-Msg-Id` header.
//! - [`kafka`] (feature `kafka`, rdkafka): [`kafka::KafkaConsumer`] is a consumer group member
//!   that runs each record through the gate ([`ConsumerGate::process_key`]), several at once,
//!   and commits each partition's offsets in order once the records below them are settled; a
//!   retry holds the record in process, a reject dead-letters it ([`kafka::KafkaConfig`]). The
//!   key is the `idempotency-key` header by default. [`kafka::TransactionalPipe`] is Kafka to
//!   Kafka: a handler's outputs and the consumed offsets commit in one transaction, and an
//!   aborted transaction releases its claims.
//!
//! The rules, for every broker (Kafka's reading of each action is in [`kafka`]'s docs):
//!
//! | outcome | action |
//! |---|---|
//! | the handler ran (retriable: completed with its value; idempotent: marked first) | ack |
//! | duplicate of a completed key | ack, the handler does not run (idempotent mode: rejected instead while an earlier delivery's reject is [`Unsettled`]) |
//! | duplicate of a key another consumer holds | retry after the in-progress delay (at most the holder's remaining lease, but not under 100 ms) |
//! | retriable handler failed | the claim is released; retry after the failure delay (below), as a failure (AMQP: reject with requeue, which a quorum queue counts; JetStream: nak with the delay) |
//! | retriable handler failed on delivery `max_attempts` (when set, and the broker counts deliveries) | the claim is released; reject without requeue (dead-letter / term), logged with the error |
//! | retriable handler failed with an error that would fail alike every time ([`Permanence`]: a sink that cannot carry the message) | the claim is released; reject without requeue at once, logged with the error |
//! | idempotent handler failed | reject without requeue (dead-letter / term): never retried |
//! | no usable key, or the key was seen with another payload | reject without requeue, logged with the reason |
//! | the gate could not decide (the handler did not run) | retry after the unavailable delay; never ack |
//! | the handler ran, but its completion could not be recorded (the store stayed down while the gate asked again for ~2 s, or the lease was lost) | ack, logged as an error: a redelivery would find the key still held and run the handler again once the lease ran out |
//!
//! Idempotent mode marks the key before the handler runs, so a rejected message whose dead letter
//! (AMQP reject, JetStream term, Kafka dead-letter publish) is not confirmed would come back as
//! a duplicate and be acked, lost: [`Unsettled`] records such a reject in the store (beside the
//! mark, for its ttl) before it is sent and deletes it once it is confirmed, and a duplicate that
//! finds the record is rejected again instead of acked (the relay uses it too). A crash between
//! the mark and that record still loses the message: idempotent mode is at most once.
//!
//! The failure delay grows with the broker's delivery count `n` (JetStream: the message's
//! `delivered`; RabbitMQ: `x-delivery-count`, which quorum queues set, or the `rejected` counts of
//! `x-death`, plus one): `initial × 2^(n−1)`, capped at `max` (by default 1 s, 2 s, 4 s, … up to
//! 60 s; [`ConsumerGate::failure_retry`]), plus up to a quarter more at random, so that messages
//! that failed together (a downstream outage) do not all come back in the same instant. When the
//! broker gives no count (a classic RabbitMQ
//! queue's redelivery says only "redelivered") the delay is `initial`, and `max_attempts` cannot
//! apply. `max_attempts` is unset by default: a rejected message is dropped by a queue without a
//! dead-letter exchange, so giving up is the user's choice ([`ConsumerGate::max_attempts`]).
//!
//! When the key is the message id, the delivery's fingerprint is the SHA-256 of its payload
//! bytes, so a message id reused for another payload is rejected instead of being taken for a
//! duplicate. A key template makes the key from the payload, and events it maps to one key are
//! duplicates by design even when the rest of the payload differs (`{ts|window:5m}` merges the
//! events of five minutes), so template keys carry no fingerprint.
//!
//! Every claim names an owner unique to the delivery attempt (`host:pid/nonce-seq`, or
//! [`ConsumerGate::worker`]`/nonce-seq`), so a duplicate finding the key in progress says who
//! holds it. It is never shared by two deliveries: the gate gives a claim naming the holder's own
//! owner back to it, which for a per-consumer owner would let two copies of one message run at
//! once on one consumer.
//!
//! Inside, one concern per module: `gate` ([`ConsumerGate::process`] and what it applies),
//! `options` (settings, their defaults and bounds), `handled` (outcomes and the broker's
//! action), `delivery` ([`Attempt`], [`Message`]), and each broker's adapter in its own module
//! (Kafka's in a folder: its offsets, partitions, records and dead letters are each a concern).
//!
//! [`Gate`]: dedupgate_core::Gate
//! [`Mode`]: dedupgate_core::Mode
//! [`KeyTemplate`]: dedupgate_core::keys::KeyTemplate

mod delivery;
mod gate;
mod handled;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
mod options;
mod permanence;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
mod unsettled;

pub use delivery::{Attempt, Message};
pub use gate::ConsumerGate;
pub use handled::{Action, Handled, Rejection, REASON_HEADER};
pub use options::{
    FailureRetry, KeySource, FAILURE_RETRY_INITIAL_DEFAULT, FAILURE_RETRY_LIMIT,
    FAILURE_RETRY_MAX_DEFAULT, IN_PROGRESS_RETRY_DEFAULT, IN_PROGRESS_RETRY_FLOOR,
    UNAVAILABLE_RETRY_DEFAULT, WORKER_BYTES_MAX,
};
pub use permanence::Permanence;
pub use unsettled::Unsettled;
