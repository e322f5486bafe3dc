//! Counters per route and `/metrics` in Prometheus text format. Names follow
//! `dedupgate_relay_<noun>_total` (and the gauge `dedupgate_relay_kafka_lag_records`); the
//! labels are the route's name (bounded: one per route, never a key) and, for
//! `dedupgate_relay_sink_rows_total`, the `outcome` (`applied` or `stale`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One route's counters.
#[derive(Debug)]
pub struct RouteMetrics {
    /// Deliveries taken from the source (a redelivery counts again).
    pub records_in: AtomicU64,
    /// Messages the sink confirmed (a transactional route: records produced into a transaction,
    /// so an aborted one's count again when they run again).
    pub forwarded: AtomicU64,
    /// Deliveries whose key was already completed: acked, not forwarded.
    pub duplicates: AtomicU64,
    /// Deliveries sent to the dead-letter destination.
    pub dead_lettered: AtomicU64,
    /// Rejected deliveries with no dead-letter destination: logged, then acked (Kafka) or
    /// rejected to the broker (RabbitMQ's dead-letter exchange, if any; JetStream term).
    pub rejected: AtomicU64,
    /// Forwards that failed (the sink did not confirm).
    pub forward_failures: AtomicU64,
    /// Deliveries put back for later (a failure, a key held elsewhere, the gate unavailable).
    pub retries: AtomicU64,
    /// Errors reading the source that its client recovers from by itself (JetStream: a failed
    /// pull or a missed heartbeat, as while the server is away; Kafka: a lag read the brokers
    /// did not answer). A count that keeps rising says the source is not being read.
    pub source_errors: AtomicU64,
    /// Transactional routes (`?transactional=`): Kafka transactions committed.
    pub transactions_committed: AtomicU64,
    /// Transactional routes: Kafka transactions aborted (their claims released, their records
    /// consumed and forwarded again).
    pub transactions_aborted: AtomicU64,
    /// PostgreSQL upsert sinks: rows written (a new key, or a higher version).
    pub sink_rows_applied: AtomicU64,
    /// PostgreSQL upsert sinks: rows refused as stale (the stored version was as high or
    /// higher); the message is confirmed all the same.
    pub sink_rows_stale: AtomicU64,
    /// Kafka sources: records past the group's committed offsets at the last read; `u64::MAX`
    /// until read (and for other sources), when it is not exported.
    pub kafka_lag: AtomicU64,
}

impl Default for RouteMetrics {
    fn default() -> Self {
        Self {
            records_in: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            forward_failures: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            source_errors: AtomicU64::new(0),
            transactions_committed: AtomicU64::new(0),
            transactions_aborted: AtomicU64::new(0),
            sink_rows_applied: AtomicU64::new(0),
            sink_rows_stale: AtomicU64::new(0),
            kafka_lag: AtomicU64::new(LAG_UNKNOWN),
        }
    }
}

/// [`RouteMetrics::kafka_lag`] before it is read.
const LAG_UNKNOWN: u64 = u64::MAX;

impl RouteMetrics {
    /// The Kafka lag last read, when one was.
    pub fn kafka_lag(&self) -> Option<u64> {
        Some(self.kafka_lag.load(Ordering::Relaxed)).filter(|v| *v != LAG_UNKNOWN)
    }

    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn set_kafka_lag(&self, lag: u64) {
        self.kafka_lag
            .store(lag.min(LAG_UNKNOWN - 1), Ordering::Relaxed);
    }

    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set(counter: &AtomicU64, value: u64) {
        counter.store(value, Ordering::Relaxed);
    }
}

/// One counter family: its noun, its help text, and which counter of a route it reads.
type Family = (&'static str, &'static str, fn(&RouteMetrics) -> &AtomicU64);

/// Every route's counters, by route name.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    routes: Vec<(String, Arc<RouteMetrics>)>,
}

impl Metrics {
    /// Adds a route's counters.
    pub fn add(&mut self, route: &str) -> Arc<RouteMetrics> {
        let metrics = Arc::new(RouteMetrics::default());
        self.routes.push((route.to_owned(), metrics.clone()));
        metrics
    }

    /// The counters of `route`.
    pub fn route(&self, route: &str) -> Option<&RouteMetrics> {
        self.routes
            .iter()
            .find(|(name, _)| name == route)
            .map(|(_, m)| m.as_ref())
    }

    /// The Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        let families: [Family; 10] = [
            ("records_in", "Deliveries taken from the source.", |m| {
                &m.records_in
            }),
            ("forwarded", "Messages the sink confirmed.", |m| {
                &m.forwarded
            }),
            (
                "duplicates",
                "Deliveries of an already completed key: not forwarded.",
                |m| &m.duplicates,
            ),
            (
                "dead_lettered",
                "Deliveries sent to the dead-letter destination with the reason.",
                |m| &m.dead_lettered,
            ),
            (
                "rejected",
                "Rejected deliveries with no dead-letter destination (logged).",
                |m| &m.rejected,
            ),
            (
                "forward_failures",
                "Forwards the sink did not confirm.",
                |m| &m.forward_failures,
            ),
            ("retries", "Deliveries put back for a later attempt.", |m| {
                &m.retries
            }),
            (
                "source_errors",
                "Errors reading the source (the client reconnects by itself).",
                |m| &m.source_errors,
            ),
            (
                "transactions_committed",
                "Kafka transactions committed (transactional routes).",
                |m| &m.transactions_committed,
            ),
            (
                "transactions_aborted",
                "Kafka transactions aborted: their records run again (transactional routes).",
                |m| &m.transactions_aborted,
            ),
        ];
        let mut out = String::new();
        for (noun, help, get) in families {
            let name = format!("dedupgate_relay_{noun}_total");
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (route, m) in &self.routes {
                let value = get(m).load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{route=\"{}\"}} {value}", escape(route));
            }
        }
        let rows = "dedupgate_relay_sink_rows_total";
        let _ = writeln!(
            out,
            "# HELP {rows} Rows an upsert sink wrote (applied) or refused as older than the stored one (stale).\n# TYPE {rows} counter"
        );
        for (route, m) in &self.routes {
            for (outcome, counter) in [
                ("applied", &m.sink_rows_applied),
                ("stale", &m.sink_rows_stale),
            ] {
                let value = counter.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{rows}{{route=\"{}\",outcome=\"{outcome}\"}} {value}",
                    escape(route)
                );
            }
        }
        let lag = "dedupgate_relay_kafka_lag_records";
        let _ = writeln!(
            out,
            "# HELP {lag} Records past the consumer group's committed offsets (Kafka routes).\n# TYPE {lag} gauge"
        );
        for (route, m) in &self.routes {
            if let Some(value) = m.kafka_lag() {
                let _ = writeln!(out, "{lag}{{route=\"{}\"}} {value}", escape(route));
            }
        }
        out
    }
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Largest request head read: `/metrics` needs only the request line.
const REQUEST_BYTES_MAX: usize = 8 * 1024;

/// Serves `GET /metrics` on `listener` until the task is dropped. A minimal HTTP/1.0-style
/// responder (one request per connection): a scrape needs nothing more, and the relay stays free
/// of an HTTP server stack.
pub async fn serve(listener: TcpListener, metrics: Metrics) {
    let metrics = Arc::new(metrics);
    loop {
        let mut socket = match listener.accept().await {
            Ok((socket, _)) => socket,
            Err(e) => {
                // Out of file descriptors, say: pause rather than spin until one frees up.
                tracing::debug!(error = %e, "relay: metrics accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut head = Vec::with_capacity(512);
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < REQUEST_BYTES_MAX {
                match tokio::time::timeout(std::time::Duration::from_secs(5), socket.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
            let response = if line.starts_with(b"GET /metrics ") {
                let body = metrics.render();
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    .to_owned()
            };
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_lists_every_counter_per_route() {
        let mut metrics = Metrics::default();
        let a = metrics.add("a");
        metrics.add("b\"");
        RouteMetrics::bump(&a.forwarded);
        let text = metrics.render();
        assert!(
            text.contains("dedupgate_relay_forwarded_total{route=\"a\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("dedupgate_relay_forwarded_total{route=\"b\\\"\"} 0\n"));
        assert!(text.contains("# TYPE dedupgate_relay_dead_lettered_total counter"));
        RouteMetrics::bump(&a.source_errors);
        assert!(metrics
            .render()
            .contains("dedupgate_relay_source_errors_total{route=\"a\"} 1\n"));
        assert!(
            !text.contains("dedupgate_relay_kafka_lag_records{"),
            "{text}"
        );
        RouteMetrics::bump(&a.sink_rows_stale);
        assert!(metrics
            .render()
            .contains("dedupgate_relay_sink_rows_total{route=\"a\",outcome=\"stale\"} 1\n"));
        a.set_kafka_lag(7);
        assert!(metrics
            .render()
            .contains("dedupgate_relay_kafka_lag_records{route=\"a\"} 7\n"));
    }
}
