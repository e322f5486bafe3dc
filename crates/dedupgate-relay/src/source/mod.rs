//! Sources: each reads its broker and runs every delivery through the consumers crate
//! ([`ConsumerGate::process`](dedupgate_consumers::ConsumerGate::process) or the Kafka
//! consumer), with one handler for all: forward to the sink and wait for its confirmation. The
//! outcome's [`Action`] (decided there, never here) is then carried out, with additions that
//! concern the sink, which the gate cannot know (`Forward::settle_action`): a reject goes to
//! the route's dead-letter sink, with the reason, before the delivery is acked; and in
//! idempotent mode a marked key whose dead letter is not confirmed is not acked as a duplicate
//! ([`Unsettled`], the consumers crate's rule). A forward the sink refuses outright is rejected
//! at once by the gate itself ([`SinkError`] is a [`Permanence`](dedupgate_consumers::Permanence)).
//!
//! One file per broker: `kafka` (a [`KafkaConsumer`](dedupgate_consumers::kafka::KafkaConsumer)
//! group member), `rabbitmq` (a queue consumer) and `nats` (a JetStream durable pull consumer);
//! and `kafka_pipe`, a Kafka source to a transactional Kafka sink as one transactional pipe.

#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "kafka")]
mod kafka_lag;
#[cfg(feature = "kafka")]
pub(crate) mod kafka_pipe;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "rabbitmq")]
pub(crate) mod rabbitmq;

use std::sync::Arc;

use dedupgate_consumers::{Action, Handled, Message, Unsettled};
use dedupgate_core::Mode;

use crate::metrics::RouteMetrics;
use crate::sink::{Header, Outgoing, Sink, SinkError};

/// Dead letters carry why in this header, the consumers crate's (as the Kafka consumer's do).
pub use dedupgate_consumers::REASON_HEADER;
/// Dead letters carry their key, when one could be made, in this header. Not the sinks'
/// [`sink::KEY_HEADER`](crate::sink::KEY_HEADER), which carries the gate key of a forward.
pub const DEAD_LETTER_KEY_HEADER: &str = "dedupgate-key";
/// The former name of [`DEAD_LETTER_KEY_HEADER`].
#[deprecated(note = "renamed DEAD_LETTER_KEY_HEADER: the sinks' key header is another")]
pub const KEY_HEADER: &str = DEAD_LETTER_KEY_HEADER;
/// Dead letters carry where they came from (the route's name) in this header.
pub const ROUTE_HEADER: &str = "dedupgate-route";

/// Deliveries in hand at once per route (AMQP prefetch, concurrent JetStream messages): the
/// bound on the relay's memory and on the sink's concurrent sends.
pub const IN_FLIGHT: u16 = 64;

/// What every delivery of a route shares.
#[derive(Clone)]
pub(crate) struct Forward {
    pub(crate) route: String,
    pub(crate) sink: Arc<dyn Sink>,
    pub(crate) dead_letter: Option<Arc<dyn Sink>>,
    pub(crate) metrics: Arc<RouteMetrics>,
    /// The route's mode: idempotent mode keeps [`Unsettled`] records.
    pub(crate) mode: Mode,
    pub(crate) unsettled: Unsettled,
}

impl Forward {
    /// The handler: forward to the sink, confirmed, or fail (the gate releases the claim in
    /// retriable mode, so a redelivery forwards again).
    pub(crate) fn handler(
        &self,
    ) -> impl Fn(Message) -> futures::future::BoxFuture<'static, Result<(), SinkError>>
           + Clone
           + Send
           + Sync
           + 'static {
        let sink = self.sink.clone();
        let metrics = self.metrics.clone();
        move |msg: Message| {
            let sink = sink.clone();
            let metrics = metrics.clone();
            Box::pin(async move {
                let sent = sink
                    .send(Outgoing {
                        key: &msg.key,
                        payload: &msg.payload,
                        headers: &[],
                        fence: Some(msg.fence),
                    })
                    .await;
                match &sent {
                    Ok(()) => RouteMetrics::bump(&metrics.forwarded),
                    Err(e) => {
                        RouteMetrics::bump(&metrics.forward_failures);
                        tracing::warn!(key = %msg.key, error = %e, "relay: forward failed");
                    }
                }
                sent
            })
        }
    }

    /// Counts a delivery's outcome and says what to do with it: the outcome's own action,
    /// except that
    /// - a reject that reached the dead-letter sink becomes an ack, and one that did not becomes
    ///   a retry (nothing is dropped while a dead-letter sink is configured);
    /// - idempotent mode: a duplicate whose earlier delivery's dead letter was never confirmed
    ///   ([`Unsettled`]) is dead-lettered, not acked; and the same when the store cannot say,
    ///   which is retried.
    pub(crate) async fn settle_action(
        &self,
        handled: &Handled<(), SinkError>,
        payload: &[u8],
    ) -> Action {
        RouteMetrics::bump(&self.metrics.records_in);
        let action = handled.action();
        match (action, handled) {
            (Action::Ack, Handled::Duplicate { key, .. }) => self.duplicate(key, payload).await,
            (Action::Ack, _) => action,
            (Action::Retry { .. }, _) => {
                RouteMetrics::bump(&self.metrics.retries);
                action
            }
            (Action::Reject, _) => self.reject(handled, payload).await,
        }
    }

    /// A duplicate: acked, unless (idempotent mode) its key's dead letter is unsettled.
    async fn duplicate(&self, key: &str, payload: &[u8]) -> Action {
        if self.mode != Mode::Idempotent {
            RouteMetrics::bump(&self.metrics.duplicates);
            return Action::Ack;
        }
        match self.unsettled.recorded(key).await {
            Ok(None) => {
                RouteMetrics::bump(&self.metrics.duplicates);
                Action::Ack
            }
            Ok(Some(reason)) => match self.send_dead_letter(key, &reason, payload).await {
                Ok(()) => {
                    self.unsettled.clear(key).await;
                    Action::Ack
                }
                Err(action) => action,
            },
            Err(e) => {
                RouteMetrics::bump(&self.metrics.retries);
                tracing::warn!(route = %self.route, error = %e, "relay: cannot tell whether a marked key's dead letter is settled; the delivery is retried");
                Action::Retry {
                    after: DEAD_LETTER_RETRY,
                    failure: false,
                }
            }
        }
    }

    /// A rejected delivery: to the dead-letter sink (then acked), or, with none, logged and
    /// rejected to the broker.
    async fn reject(&self, handled: &Handled<(), SinkError>, payload: &[u8]) -> Action {
        if self.dead_letter.is_none() {
            RouteMetrics::bump(&self.metrics.rejected);
            tracing::error!(route = %self.route, "relay: rejected, no dead-letter destination: {handled}");
            return Action::Reject;
        }
        let key = handled.key().unwrap_or_default();
        let reason = handled.to_string();
        // Idempotent mode: the key is marked, so a redelivery would be acked as a duplicate
        // unless the unsettled record says otherwise. It is written first, so a crash before
        // the dead letter is confirmed leaves it too.
        let marked = self.mode == Mode::Idempotent && matches!(handled, Handled::Failed { .. });
        let mut recorded = !marked;
        loop {
            if !recorded {
                match self.unsettled.record(key, &reason).await {
                    Ok(()) => recorded = true,
                    Err(e) => {
                        tracing::error!(route = %self.route, error = %e, "relay: a marked key's pending dead letter cannot be recorded")
                    }
                }
            }
            match self.send_dead_letter(key, &reason, payload).await {
                Ok(()) => {
                    if marked && recorded {
                        self.unsettled.clear(key).await;
                    }
                    return Action::Ack;
                }
                Err(action) if recorded => return action,
                // Neither the dead letter nor the record that makes a redelivery send it again:
                // a redelivery would be acked as a duplicate, so the delivery stays in hand.
                Err(_) => tokio::time::sleep(DEAD_LETTER_RETRY).await,
            }
        }
    }

    /// Sends a dead letter with its headers; Ok once the dead-letter sink confirmed it, else the
    /// retry to carry out. A key the dead-letter sink refuses (a line break at a NATS sink) is
    /// left out of its message id; the key header still carries it.
    async fn send_dead_letter(
        &self,
        key: &str,
        reason: &str,
        payload: &[u8],
    ) -> Result<(), Action> {
        let Some(dead) = &self.dead_letter else {
            return Err(Action::Reject);
        };
        let mut headers: Vec<Header> = vec![
            (REASON_HEADER.into(), reason.as_bytes().to_vec()),
            (ROUTE_HEADER.into(), self.route.clone().into_bytes()),
        ];
        if !key.is_empty() {
            headers.push((DEAD_LETTER_KEY_HEADER.into(), key.as_bytes().to_vec()));
        }
        let letter = |key| Outgoing {
            key,
            payload,
            headers: &headers,
            fence: None,
        };
        let sent = match dead.send(letter(key)).await {
            Err(SinkError::Refused { .. }) if !key.is_empty() => dead.send(letter("")).await,
            sent => sent,
        };
        match sent {
            Ok(()) => {
                RouteMetrics::bump(&self.metrics.dead_lettered);
                tracing::warn!(route = %self.route, "relay: dead-lettered: {reason}");
                Ok(())
            }
            Err(e) => {
                RouteMetrics::bump(&self.metrics.retries);
                tracing::error!(route = %self.route, error = %e, "relay: dead-letter send failed; the delivery is retried");
                Err(Action::Retry {
                    after: DEAD_LETTER_RETRY,
                    failure: false,
                })
            }
        }
    }
}

/// How long the deliveries in hand may settle after the relay was told to stop (as the Kafka
/// consumer's default grace): a retry's delay (up to 60 s) is waited out before its requeue, so
/// waiting for all could hold a shutdown for a minute. Those cut short are redelivered by the
/// broker (AMQP: when the channel closes; JetStream: after the ack wait).
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits for `tasks` for up to [`SHUTDOWN_GRACE`], then aborts what is left.
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) async fn drain(route: &str, tasks: &mut tokio::task::JoinSet<()>) {
    let grace = tokio::time::sleep(SHUTDOWN_GRACE);
    tokio::pin!(grace);
    while !tasks.is_empty() {
        tokio::select! {
            _ = tasks.join_next() => {}
            () = &mut grace => {
                tracing::warn!(route, in_hand = tasks.len(), "relay: deliveries still in hand at shutdown are left to the broker to redeliver");
                tasks.shutdown().await;
            }
        }
    }
}

/// How long a delivery waits when its dead letter could not be sent.
const DEAD_LETTER_RETRY: std::time::Duration = std::time::Duration::from_secs(1);
