//! Kafka source: a [`KafkaConsumer`] group member; each record's handler forwards to the sink,
//! and the consumer commits a partition's offsets only past records whose outcome settled
//! (forwarded, duplicate, or dead-lettered to the route's dead-letter topic, which
//! [`RouteConfig::check`](crate::RouteConfig::check) keeps on the source's cluster). The
//! consumer's counters are copied into the route's metrics every [`STATS_EVERY`], and the
//! group's lag read every 5 s (`kafka_lag`).

use std::sync::Arc;
use std::time::Duration;

use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer, Stats};
use dedupgate_consumers::ConsumerGate;
use tokio::sync::watch;

use super::kafka_lag::{LagReader, LAG_EVERY};
use super::Forward;
use crate::kafka_error;
use crate::metrics::RouteMetrics;
use crate::route::SinkSpec;
use crate::RelayError;

/// How often the consumer's counters reach `/metrics`.
pub(super) const STATS_EVERY: Duration = Duration::from_millis(500);

/// Session timeout asked of the group: librdkafka's 45 s default lets a crashed relay's
/// partitions wait that long for a new holder.
pub(super) const SESSION_TIMEOUT_MS: &str = "10000";

#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    gate: ConsumerGate,
    bootstrap: &str,
    topic: &str,
    group: &str,
    dead_letter: Option<&SinkSpec>,
    forward: Forward,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let failed = |reason: String| RelayError::Source {
        route: forward.route.clone(),
        reason: format!("kafka topic {topic:?}: {reason}"),
    };
    let mut config = KafkaConfig::new(bootstrap, group, &[topic])
        .and_then(|c| c.set("session.timeout.ms", SESSION_TIMEOUT_MS))
        .map_err(|e| failed(e.to_string()))?;
    if let Some(SinkSpec::Kafka { topic: dlq, .. }) = dead_letter {
        config = config
            .dead_letter_topic(dlq)
            .map_err(|e| failed(e.to_string()))?;
    }
    let consumer = Arc::new(KafkaConsumer::new(gate, config).map_err(|e| {
        failed(format!(
            "cannot create the Kafka consumer: {}",
            kafka_error::consumer_cause(&e)
        ))
    })?);
    let metrics = forward.metrics.clone();
    let copier = {
        let consumer = consumer.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(STATS_EVERY);
            loop {
                every.tick().await;
                copy(&metrics, consumer.stats());
            }
        })
    };
    let lag = match LagReader::new(bootstrap, group, topic) {
        Ok(reader) => Some(Arc::new(reader)),
        Err(e) => {
            tracing::warn!(error = %kafka_error::cause(&e), "relay: kafka lag is not measured: its client cannot be created");
            None
        }
    };
    let lag_task = lag.clone().map(|reader| {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(LAG_EVERY);
            loop {
                every.tick().await;
                read_lag(&reader, &metrics).await;
            }
        })
    });
    let handler = forward.handler();
    let ran = consumer
        .run(handler, async move {
            let _ = stop.changed().await;
        })
        .await;
    copier.abort();
    copy(&metrics, consumer.stats());
    if let Some(task) = lag_task {
        task.abort();
    }
    // Once more after the final commit, so the last value says what is left.
    if let Some(reader) = lag {
        read_lag(&reader, &metrics).await;
    }
    ran.map(|_| ()).map_err(|e| {
        failed(format!(
            "the consumer stopped: {}",
            kafka_error::consumer_cause(&e)
        ))
    })
}

pub(super) async fn read_lag(reader: &Arc<LagReader>, metrics: &RouteMetrics) {
    let reader = reader.clone();
    match tokio::task::spawn_blocking(move || reader.read()).await {
        Ok(Ok(lag)) => metrics.set_kafka_lag(lag),
        // The brokers did not answer (librdkafka reconnects by itself): the gauge keeps its
        // last value, and the count says it is stale.
        Ok(Err(e)) => {
            RouteMetrics::bump(&metrics.source_errors);
            tracing::warn!(error = %kafka_error::cause(&e), "relay: kafka lag not read");
        }
        Err(e) => tracing::debug!(error = %e, "relay: kafka lag task failed"),
    }
}

fn copy(metrics: &RouteMetrics, stats: Stats) {
    RouteMetrics::set(&metrics.records_in, stats.records);
    RouteMetrics::set(&metrics.duplicates, stats.duplicates);
    RouteMetrics::set(&metrics.dead_lettered, stats.dead_lettered);
    RouteMetrics::set(&metrics.rejected, stats.dropped);
    RouteMetrics::set(&metrics.retries, stats.retries);
}
