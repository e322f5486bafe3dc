//! # dedupgate-relay
//!
//! The gate between a source and a sink, without writing Rust: each message a source delivers
//! is forwarded to a sink once per key, and the source is acked (RabbitMQ, JetStream) or
//! committed (Kafka) only after the sink confirmed. It is the consumers crate with one handler,
//! "forward and wait for the confirmation": [`dedupgate_consumers`] decides every outcome and
//! its broker action; the relay only carries them out.
//!
//! - [`Route`]: a source ([`SourceSpec`]), a sink ([`SinkSpec`]), the key (a template, or the
//!   source's message id), the [`Mode`](dedupgate_core::Mode) (retriable: claim, forward,
//!   complete, and a failed forward is released and retried; idempotent: mark, then forward, at
//!   most once), the namespace and ttl, and an optional dead-letter sink. The URL forms are in
//!   [`route`]'s docs and `docs/relay.md`.
//! - [`RouteConfig`] and [`RelayConfig`] (`config`): a route as flags or a TOML `[[route]]`
//!   gives it, checked into a [`Route`] ([`ConfigError`]).
//! - [`sink`]: the [`Sink`] trait (`send` returns once the destination confirmed) and its
//!   stdout, file, Kafka, RabbitMQ, JetStream, HTTP webhook and PostgreSQL upsert forms,
//!   opened by [`sink::open`]; [`Outgoing`] carries the gate's fence to it.
//! - A Kafka source with a `kafka://…/TOPIC?transactional=ID` sink runs as one
//!   [`TransactionalPipe`](dedupgate_consumers::kafka::TransactionalPipe) (`source::kafka_pipe`):
//!   the records produced and the offsets consumed commit in one Kafka transaction.
//! - `source`: one reader per broker; a reject (no usable key, a fingerprint mismatch, a
//!   forward that failed `max_attempts` times, a failed idempotent forward) goes to the
//!   dead-letter sink with the reason in headers before the delivery is acked.
//! - [`Metrics`] (`metrics`): counters per route, served as Prometheus text on `/metrics`.
//! - [`run`]: every route at once until the shutdown future resolves.
//!
//! Brokers are behind the cargo features `kafka`, `rabbitmq` and `nats`, the webhook sink
//! behind `webhook` and the PostgreSQL sink behind `postgres`; stdout and file sinks need none.
//! A route whose broker or sink is not built is refused when the relay starts.

// A build with no broker still parses routes and opens stdout and file sinks; the sources'
// shared machinery is then unused.
#![cfg_attr(
    not(any(feature = "kafka", feature = "rabbitmq", feature = "nats")),
    allow(dead_code)
)]

mod config;
#[cfg(feature = "kafka")]
mod kafka_error;
pub mod metrics;
pub mod route;
pub mod sink;
mod source;

use std::collections::HashMap;
use std::future::Future;

use dedupgate_consumers::ConsumerGate;
use dedupgate_core::{Gate, InvalidInput};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use config::{ConfigError, RelayConfig, RouteConfig};
pub use metrics::Metrics;
pub use route::{Route, SinkSpec, SourceSpec};
pub use sink::{Outgoing, Sink, SinkError};
#[allow(deprecated)]
pub use source::KEY_HEADER;
pub use source::{DEAD_LETTER_KEY_HEADER, IN_FLIGHT, REASON_HEADER, ROUTE_HEADER};

/// Why the relay could not start or could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A route's settings are not usable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A route's gate settings were refused.
    #[error("route {route:?}: {cause}")]
    Gate {
        /// The route.
        route: String,
        /// What was refused.
        cause: InvalidInput,
    },
    /// A sink (or dead-letter sink) could not be opened.
    #[error("route {route:?}: {cause}")]
    Sink {
        /// The route.
        route: String,
        /// Why.
        cause: SinkError,
    },
    /// A source could not be reached, or stopped.
    #[error("route {route:?}: {reason}")]
    Source {
        /// The route.
        route: String,
        /// Why.
        reason: String,
    },
    /// A route's source is a broker this build leaves out.
    #[error("route {route:?}: this build has no {broker} support (cargo feature off)")]
    NotBuilt {
        /// The route.
        route: String,
        /// The broker.
        broker: &'static str,
    },
    /// A route's task ended without an answer: it panicked (a bug) or was cancelled.
    #[error("route {route:?}: stopped unexpectedly: {reason}")]
    RouteFailed {
        /// The route.
        route: String,
        /// What happened (a panic's message, when it had one).
        reason: String,
    },
    /// The metrics address cannot be listened on.
    #[error("metrics: cannot listen on {addr}: {cause}")]
    Metrics {
        /// The address.
        addr: String,
        /// Why.
        cause: std::io::Error,
    },
}

/// The consumer-side gate of `route`: its namespace, mode, key, ttl and attempts.
fn consumer_gate(route: &Route, gate: Gate) -> Result<ConsumerGate, RelayError> {
    let refused = |cause| RelayError::Gate {
        route: route.name.clone(),
        cause,
    };
    let mut cg = ConsumerGate::new(gate, &route.namespace)
        .map_err(refused)?
        .mode(route.mode);
    if let Some(template) = &route.key {
        cg = cg.key_template(template.clone());
    }
    if let Some(ttl) = route.ttl {
        cg = cg.ttl(ttl).map_err(refused)?;
    }
    if let Some(n) = route.max_attempts {
        cg = cg.max_attempts(n).map_err(refused)?;
    }
    Ok(cg)
}

/// Relays every route, each over its gate, until `shutdown` resolves (then lets the deliveries
/// in hand settle and returns the counters) or a route fails (then stops the others and says
/// why). With `metrics_listen`, `/metrics` is served there meanwhile. Sinks are opened before
/// any source, so a bad sink fails the start, not the first message.
pub async fn run(
    routes: Vec<(Route, Gate)>,
    metrics_listen: Option<&str>,
    shutdown: impl Future<Output = ()>,
) -> Result<Metrics, RelayError> {
    let mut metrics = Metrics::default();
    let mut ready = Vec::with_capacity(routes.len());
    let mut pipes = Vec::new();
    for (route, gate) in routes {
        let cg = consumer_gate(&route, gate)?;
        if route.sink.transactional_id().is_some() {
            // Kafka to Kafka in one transaction: the pipe produces; no sink is opened.
            let route_metrics = metrics.add(&route.name);
            pipes.push((route, cg, route_metrics));
            continue;
        }
        let opened = |cause| RelayError::Sink {
            route: route.name.clone(),
            cause,
        };
        let route_metrics = metrics.add(&route.name);
        let sink = sink::open(&route.sink, &route_metrics)
            .await
            .map_err(opened)?;
        let dead_letter = match (&route.source, &route.dead_letter) {
            // The Kafka consumer dead-letters through its own producer.
            (SourceSpec::Kafka { .. }, _) | (_, None) => None,
            (_, Some(spec)) => Some(sink::open(spec, &route_metrics).await.map_err(opened)?),
        };
        let forward = source::Forward {
            route: route.name.clone(),
            sink,
            dead_letter,
            metrics: route_metrics,
            mode: route.mode,
            unsettled: cg.unsettled(),
        };
        ready.push((route, cg, forward));
    }
    let server = match metrics_listen {
        Some(addr) => {
            let listener =
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|cause| RelayError::Metrics {
                        addr: addr.to_owned(),
                        cause,
                    })?;
            if let Ok(local) = listener.local_addr() {
                tracing::info!("relay: metrics on http://{local}/metrics");
            }
            Some(tokio::spawn(metrics::serve(listener, metrics.clone())))
        }
        None => None,
    };
    let (stop, stopped) = watch::channel(false);
    let mut tasks = JoinSet::new();
    // Which route each task runs: a task that panics is known only by its id.
    let mut names = HashMap::new();
    for (route, cg, forward) in ready {
        let stopped = stopped.clone();
        tracing::info!(route = %route.name, to = %route.sink, "relay: route started");
        let name = route.name.clone();
        let task = tasks.spawn(run_route(route, cg, forward, stopped));
        names.insert(task.id(), name);
    }
    for (route, cg, route_metrics) in pipes {
        tracing::info!(route = %route.name, to = %route.sink, "relay: transactional route started");
        let name = route.name.clone();
        #[cfg(feature = "kafka")]
        let task = tasks.spawn(source::kafka_pipe::run(
            route,
            cg,
            route_metrics,
            stopped.clone(),
        ));
        #[cfg(not(feature = "kafka"))]
        let task = {
            drop((route, cg, route_metrics));
            let name = name.clone();
            tasks.spawn(async move {
                Err(RelayError::NotBuilt {
                    route: name,
                    broker: "Kafka",
                })
            })
        };
        names.insert(task.id(), name);
    }
    tokio::pin!(shutdown);
    let mut failure = None;
    tokio::select! {
        () = &mut shutdown => {}
        Some(joined) = tasks.join_next_with_id() => failure = Some(joined),
    }
    let _ = stop.send(true);
    let mut first_error = None;
    let mut note = |joined| {
        if let Err(e) = route_ended(&names, joined) {
            tracing::error!(error = %e, "relay: route stopped");
            first_error.get_or_insert(e);
        }
    };
    if let Some(joined) = failure {
        note(joined);
    }
    while let Some(joined) = tasks.join_next_with_id().await {
        note(joined);
    }
    if let Some(server) = server {
        server.abort();
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(metrics),
    }
}

/// What a route task's end means for the relay: its own error, or (a panic, a cancellation)
/// an error naming the route, so that the relay never exits as if all went well.
fn route_ended(
    names: &HashMap<tokio::task::Id, String>,
    joined: Result<(tokio::task::Id, Result<(), RelayError>), tokio::task::JoinError>,
) -> Result<(), RelayError> {
    match joined {
        Ok((_, ran)) => ran,
        Err(e) => {
            let route = names
                .get(&e.id())
                .cloned()
                .unwrap_or_else(|| "unknown".to_owned());
            let reason = if e.is_cancelled() {
                "its task was cancelled".to_owned()
            } else {
                let payload = e.into_panic();
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned());
                match message {
                    Some(m) => format!("it panicked (a bug; please report it): {m}"),
                    None => "it panicked (a bug; please report it)".to_owned(),
                }
            };
            Err(RelayError::RouteFailed { route, reason })
        }
    }
}

// A build without a broker leaves its arm's bindings unused.
#[cfg_attr(
    not(all(feature = "kafka", feature = "rabbitmq", feature = "nats")),
    allow(unused_variables)
)]
async fn run_route(
    route: Route,
    gate: ConsumerGate,
    forward: source::Forward,
    stopped: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    #[cfg(not(all(feature = "kafka", feature = "rabbitmq", feature = "nats")))]
    let not_built = |broker| RelayError::NotBuilt {
        route: route.name.clone(),
        broker,
    };
    match &route.source {
        #[cfg(feature = "kafka")]
        SourceSpec::Kafka {
            bootstrap,
            topic,
            group,
        } => {
            source::kafka::run(
                gate,
                bootstrap,
                topic,
                group,
                route.dead_letter.as_ref(),
                forward,
                stopped,
            )
            .await
        }
        #[cfg(not(feature = "kafka"))]
        SourceSpec::Kafka { .. } => Err(not_built("Kafka")),
        #[cfg(feature = "rabbitmq")]
        SourceSpec::Amqp { uri, queue } => {
            source::rabbitmq::run(gate, uri, queue, forward, stopped).await
        }
        #[cfg(not(feature = "rabbitmq"))]
        SourceSpec::Amqp { .. } => Err(not_built("RabbitMQ")),
        #[cfg(feature = "nats")]
        SourceSpec::Nats {
            server,
            stream,
            consumer,
        } => source::nats::run(gate, server, stream, consumer, forward, stopped).await,
        #[cfg(not(feature = "nats"))]
        SourceSpec::Nats { .. } => Err(not_built("NATS")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route task that panics is an error naming the route and the panic, never a clean end.
    #[tokio::test]
    async fn a_panicked_route_is_an_error_naming_it() {
        let mut tasks: JoinSet<Result<(), RelayError>> = JoinSet::new();
        let task = tasks.spawn(async { panic!("the sink exploded") });
        let names = HashMap::from([(task.id(), "orders".to_owned())]);
        let joined = tasks.join_next_with_id().await.expect("one task");
        let err = route_ended(&names, joined).expect_err("a panic is an error");
        let text = err.to_string();
        assert!(matches!(err, RelayError::RouteFailed { .. }), "{text}");
        assert!(text.starts_with("route \"orders\": "), "{text}");
        assert!(
            text.contains("panicked") && text.contains("the sink exploded"),
            "{text}"
        );
    }
}
