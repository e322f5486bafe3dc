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
use tokio::task::JoinHandle;

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
    let config = source_config(bootstrap, group, topic, dead_letter).map_err(failed)?;
    let consumer = Arc::new(KafkaConsumer::new(gate, config).map_err(|e| {
        failed(format!(
            "cannot create the Kafka consumer: {}",
            kafka_error::consumer_cause(&e)
        ))
    })?);
    let watchers = {
        let consumer = consumer.clone();
        Watchers::start(bootstrap, group, topic, forward.metrics.clone(), move |m| {
            copy(m, consumer.stats())
        })
    };
    let handler = forward.handler();
    let ran = consumer
        .run(handler, async move {
            let _ = stop.changed().await;
        })
        .await;
    watchers.stop().await;
    ran.map(|_| ()).map_err(|e| {
        failed(format!(
            "the consumer stopped: {}",
            kafka_error::consumer_cause(&e)
        ))
    })
}

/// The consumer settings both Kafka routes share: the group's session timeout and the route's
/// dead-letter topic. The error is the reason, for the caller to name the route and topic.
pub(super) fn source_config(
    bootstrap: &str,
    group: &str,
    topic: &str,
    dead_letter: Option<&SinkSpec>,
) -> Result<KafkaConfig, String> {
    let mut config = KafkaConfig::new(bootstrap, group, &[topic])
        .and_then(|c| c.set("session.timeout.ms", SESSION_TIMEOUT_MS))
        .map_err(|e| e.to_string())?;
    if let Some(SinkSpec::Kafka { topic: dlq, .. }) = dead_letter {
        config = config.dead_letter_topic(dlq).map_err(|e| e.to_string())?;
    }
    Ok(config)
}

/// What watches a Kafka route while its consumer runs: a task copying the consumer's counters
/// into the route's metrics every [`STATS_EVERY`], and one reading the group's lag every
/// [`LAG_EVERY`] (absent when the lag client cannot be created).
pub(super) struct Watchers {
    metrics: Arc<RouteMetrics>,
    copy: Arc<dyn Fn(&RouteMetrics) + Send + Sync>,
    copier: JoinHandle<()>,
    lag: Option<(Arc<LagReader>, JoinHandle<()>)>,
}

impl Watchers {
    pub(super) fn start(
        bootstrap: &str,
        group: &str,
        topic: &str,
        metrics: Arc<RouteMetrics>,
        copy: impl Fn(&RouteMetrics) + Send + Sync + 'static,
    ) -> Self {
        let copy: Arc<dyn Fn(&RouteMetrics) + Send + Sync> = Arc::new(copy);
        let copier = {
            let (copy, metrics) = (copy.clone(), metrics.clone());
            tokio::spawn(async move {
                let mut every = tokio::time::interval(STATS_EVERY);
                loop {
                    every.tick().await;
                    copy(&metrics);
                }
            })
        };
        let lag = match LagReader::new(bootstrap, group, topic) {
            Ok(reader) => {
                let reader = Arc::new(reader);
                let (task_reader, metrics) = (reader.clone(), metrics.clone());
                let task = tokio::spawn(async move {
                    let mut every = tokio::time::interval(LAG_EVERY);
                    loop {
                        every.tick().await;
                        read_lag(&task_reader, &metrics).await;
                    }
                });
                Some((reader, task))
            }
            Err(e) => {
                tracing::warn!(error = %kafka_error::cause(&e), "relay: kafka lag is not measured: its client cannot be created");
                None
            }
        };
        Self {
            metrics,
            copy,
            copier,
            lag,
        }
    }

    /// Once the consumer stopped: the counters copied a last time, and the lag read once more
    /// after the final commit, so the last values say what is left.
    pub(super) async fn stop(self) {
        self.copier.abort();
        (self.copy)(&self.metrics);
        if let Some((reader, task)) = self.lag {
            task.abort();
            read_lag(&reader, &self.metrics).await;
        }
    }
}

async fn read_lag(reader: &Arc<LagReader>, metrics: &RouteMetrics) {
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
