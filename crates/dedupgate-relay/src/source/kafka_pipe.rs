//! A Kafka source to a `kafka://…/TOPIC?transactional=ID` sink: the route as one
//! [`TransactionalPipe`], so the produced records and the consumed offsets commit in one Kafka
//! transaction per batch (the pipe's claims are completed after the commit and released when it
//! aborts). [`RouteConfig::check`](crate::RouteConfig::check) has already kept the sink on the
//! source's cluster and the mode retriable.
//!
//! Each new key becomes one record on the sink's topic, keyed by the gate key and carrying it in
//! the `idempotency-key` header, as the idempotent Kafka sink writes it. Rejects (no usable key,
//! a fingerprint mismatch, a record whose copy failed to be produced `max_attempts` times) go to
//! the route's dead-letter topic inside the same transaction, or are logged and counted as
//! rejected when the route has none. The pipe's counters are copied into the route's metrics
//! every [`STATS_EVERY`](super::kafka::STATS_EVERY), and the group's lag read as for the plain
//! Kafka source.

use std::convert::Infallible;
use std::sync::Arc;

use dedupgate_consumers::kafka::{Output, PipeConfig, PipeStats, TransactionalPipe};
use dedupgate_consumers::ConsumerGate;
use tokio::sync::watch;

use super::kafka::{source_config, Watchers};
use crate::kafka_error;
use crate::metrics::RouteMetrics;
use crate::route::{Route, SinkSpec, SourceSpec};
use crate::sink::KEY_HEADER;
use crate::RelayError;

/// Runs `route` (a Kafka source, a transactional Kafka sink) until `stop` turns true, then
/// commits the open transaction.
pub(crate) async fn run(
    route: Route,
    gate: ConsumerGate,
    metrics: Arc<RouteMetrics>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let failed = |reason: String| RelayError::Source {
        route: route.name.clone(),
        reason,
    };
    let (
        SourceSpec::Kafka {
            bootstrap,
            topic,
            group,
        },
        SinkSpec::Kafka {
            topic: sink_topic,
            transactional_id: Some(transactional_id),
            ..
        },
    ) = (&route.source, &route.sink)
    else {
        return Err(failed(
            "a transactional route needs a Kafka source and a transactional Kafka sink".into(),
        ));
    };
    let failed = |reason: String| failed(format!("kafka topic {topic:?}: {reason}"));
    let source =
        source_config(bootstrap, group, topic, route.dead_letter.as_ref()).map_err(failed)?;
    let config = PipeConfig::new(source, transactional_id).map_err(|e| failed(e.to_string()))?;
    let pipe = Arc::new(TransactionalPipe::new(gate, config).map_err(|e| {
        failed(format!(
            "cannot create the transactional pipe: {}",
            kafka_error::consumer_cause(&e)
        ))
    })?);
    let watchers = {
        let pipe = pipe.clone();
        Watchers::start(bootstrap, group, topic, metrics, move |m| {
            copy(m, pipe.stats())
        })
    };
    let sink_topic = sink_topic.clone();
    let ran = pipe
        .run(
            move |input| {
                let record = Output::new(&sink_topic, input.record.payload)
                    .key(input.key.as_bytes())
                    .header(KEY_HEADER, input.key.as_bytes());
                std::future::ready(Ok::<_, Infallible>(vec![record]))
            },
            async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            },
        )
        .await;
    watchers.stop().await;
    ran.map(|_| ()).map_err(|e| {
        failed(format!(
            "the transactional pipe stopped: {}",
            kafka_error::consumer_cause(&e)
        ))
    })
}

/// The pipe's counters as the route's: `forwarded` counts records produced into transactions,
/// so a transaction that aborted (counted in `transactions_aborted`) counts its records again
/// when they run again.
fn copy(metrics: &RouteMetrics, stats: PipeStats) {
    RouteMetrics::set(&metrics.records_in, stats.records);
    RouteMetrics::set(&metrics.forwarded, stats.produced);
    RouteMetrics::set(&metrics.duplicates, stats.duplicates);
    RouteMetrics::set(&metrics.dead_lettered, stats.dead_lettered);
    RouteMetrics::set(&metrics.rejected, stats.dropped);
    RouteMetrics::set(&metrics.retries, stats.retries);
    RouteMetrics::set(
        &metrics.transactions_committed,
        stats.transactions_committed,
    );
    RouteMetrics::set(&metrics.transactions_aborted, stats.transactions_aborted);
}
