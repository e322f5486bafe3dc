//! Sources: each reads its broker and runs every delivery through the consumers crate
//! ([`ConsumerGate::process`](dedupgate_consumers::ConsumerGate::process) or the Kafka
//! consumer), with one handler for all: forward to the sink and wait for its confirmation. The
//! outcome's [`Action`] (decided there, never here) is then carried out, with one addition: a
//! reject goes to the route's dead-letter sink, with the reason, before the delivery is acked.
//!
//! One file per broker: `kafka` (a [`KafkaConsumer`](dedupgate_consumers::kafka::KafkaConsumer)
//! group member), `rabbitmq` (a queue consumer) and `nats` (a JetStream durable pull consumer).

#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "kafka")]
mod kafka_lag;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "rabbitmq")]
pub(crate) mod rabbitmq;

use std::sync::Arc;

use dedupgate_consumers::{Action, Handled, Message};

use crate::metrics::RouteMetrics;
use crate::sink::{Header, Sink, SinkError};

/// Dead letters carry why in this header (as the Kafka consumer's do).
pub const REASON_HEADER: &str = "dedupgate-reason";
/// Dead letters carry their key, when one could be made, in this header.
pub const KEY_HEADER: &str = "dedupgate-key";
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
                let sent = sink.send(&msg.key, &msg.payload, &[]).await;
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
    /// except that a reject that reached the dead-letter sink becomes an ack, and one that did
    /// not becomes a retry (nothing is dropped while a dead-letter sink is configured).
    pub(crate) async fn settle_action<E: std::fmt::Display>(
        &self,
        handled: &Handled<(), E>,
        payload: &[u8],
    ) -> Action {
        RouteMetrics::bump(&self.metrics.records_in);
        let action = handled.action();
        match action {
            Action::Ack => {
                if matches!(handled, Handled::Duplicate { .. }) {
                    RouteMetrics::bump(&self.metrics.duplicates);
                }
                action
            }
            Action::Retry { .. } => {
                RouteMetrics::bump(&self.metrics.retries);
                action
            }
            Action::Reject => match &self.dead_letter {
                None => {
                    RouteMetrics::bump(&self.metrics.rejected);
                    tracing::error!(route = %self.route, "relay: rejected, no dead-letter destination: {handled}");
                    action
                }
                Some(dead) => {
                    let key = handled.key().unwrap_or_default();
                    let mut headers: Vec<Header> = vec![
                        (REASON_HEADER.into(), handled.to_string().into_bytes()),
                        (ROUTE_HEADER.into(), self.route.clone().into_bytes()),
                    ];
                    if !key.is_empty() {
                        headers.push((KEY_HEADER.into(), key.as_bytes().to_vec()));
                    }
                    match dead.send(key, payload, &headers).await {
                        Ok(()) => {
                            RouteMetrics::bump(&self.metrics.dead_lettered);
                            tracing::warn!(route = %self.route, "relay: dead-lettered: {handled}");
                            Action::Ack
                        }
                        Err(e) => {
                            RouteMetrics::bump(&self.metrics.retries);
                            tracing::error!(route = %self.route, error = %e, "relay: dead-letter send failed; the delivery is retried");
                            Action::Retry {
                                after: DEAD_LETTER_RETRY,
                                failure: false,
                            }
                        }
                    }
                }
            },
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
