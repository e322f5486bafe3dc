//! [`Sink`]: where a route forwards, and its dead letters go. `send` returns only once the sink
//! confirmed (a broker's ack, a file's fsync): the relay acks or commits the source after that,
//! so a confirmed message is never lost and an unconfirmed one is delivered again.
//!
//! One file per sink: `stdout` and `file` (JSON lines, [`json_line`]), `kafka` (idempotent
//! producer), `rabbitmq` (publisher confirms), `nats` (JetStream PubAck), `webhook` (an HTTP
//! POST answered 2xx) and `postgres` (a versioned upsert, committed).

mod file;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "webhook")]
mod webhook;

use std::sync::Arc;

use async_trait::async_trait;
use dedupgate_consumers::Permanence;

use crate::metrics::RouteMetrics;
use crate::route::SinkSpec;

/// The header (Kafka, NATS) or AMQP property that carries the gate key at a broker sink.
pub const KEY_HEADER: &str = "idempotency-key";

/// A header: name and value bytes.
pub type Header = (String, Vec<u8>);

/// Why a sink could not be opened or did not confirm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The sink cannot be reached or set up.
    #[error("sink {sink}: cannot open: {reason}")]
    Open {
        /// The sink.
        sink: String,
        /// Why.
        reason: String,
    },
    /// The sink did not confirm this message (it is retried, or dead-lettered).
    #[error("sink {sink}: not confirmed: {reason}")]
    Send {
        /// The sink.
        sink: String,
        /// Why.
        reason: String,
    },
    /// The sink cannot carry this message as it is (a NATS header value with a line break):
    /// sending it again would fail alike, so it is permanent ([`Permanence`]) and the message is
    /// dead-lettered at once.
    #[error("sink {sink}: cannot carry this message: {reason}")]
    Refused {
        /// The sink.
        sink: String,
        /// Why.
        reason: String,
    },
    /// The sink's kind is not in this build (its cargo feature is off).
    #[error("sink {0}: this build has no support for it (cargo feature off)")]
    NotBuilt(String),
}

/// Only a refusal: an open or send that failed may pass on a later try.
impl Permanence for SinkError {
    fn is_permanent(&self) -> bool {
        matches!(self, SinkError::Refused { .. })
    }
}

/// One message for a sink.
#[derive(Clone, Copy, Debug)]
pub struct Outgoing<'a> {
    /// The gate key (empty: a dead letter whose key could not be made).
    pub key: &'a str,
    /// The payload bytes, as the source delivered them.
    pub payload: &'a [u8],
    /// Extra headers (a dead letter's reason, route and key).
    pub headers: &'a [Header],
    /// The gate's fencing token for this forward; `None` for a dead letter, which no gate
    /// claim covers. A sink that can refuse stale writes (a versioned upsert) or pass it on
    /// (a webhook header) uses it.
    pub fence: Option<u64>,
}

/// A destination that confirms what it received.
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// Sends one message and returns once the destination confirmed it.
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError>;
}

/// Opens the sink `spec` names (connects, for a broker or a database); a sink that counts what
/// it wrote (the PostgreSQL upsert's applied and stale rows) counts into `metrics`.
pub async fn open(
    spec: &SinkSpec,
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))] metrics: &Arc<RouteMetrics>,
) -> Result<Arc<dyn Sink>, SinkError> {
    match spec {
        SinkSpec::Stdout => Ok(Arc::new(file::StdoutSink::new())),
        SinkSpec::File(path) => Ok(Arc::new(file::FileSink::open(path).await?)),
        // Produced to by its route's transactional pipe, inside the transaction, never alone.
        SinkSpec::Kafka {
            transactional_id: Some(_),
            ..
        } => Err(SinkError::Open {
            sink: spec.to_string(),
            reason: "a transactional Kafka sink is written inside its route's transaction".into(),
        }),
        #[cfg(feature = "kafka")]
        SinkSpec::Kafka {
            bootstrap,
            topic,
            transactional_id: None,
        } => Ok(Arc::new(kafka::KafkaSink::new(bootstrap, topic)?)),
        #[cfg(feature = "rabbitmq")]
        SinkSpec::Amqp {
            uri,
            exchange,
            routing_key,
        } => Ok(Arc::new(
            rabbitmq::AmqpSink::connect(uri, exchange, routing_key).await?,
        )),
        #[cfg(feature = "nats")]
        SinkSpec::Nats { server, subject } => {
            Ok(Arc::new(nats::NatsSink::connect(server, subject).await?))
        }
        #[cfg(feature = "webhook")]
        SinkSpec::Webhook { url } => {
            Ok(Arc::new(webhook::WebhookSink::new(url, spec.to_string())?))
        }
        #[cfg(feature = "postgres")]
        SinkSpec::Postgres(upsert) => Ok(Arc::new(
            postgres::PostgresSink::connect(upsert, metrics.clone()).await?,
        )),
        #[allow(unreachable_patterns)]
        other => Err(SinkError::NotBuilt(other.to_string())),
    }
}

/// One message as a JSON line (no newline, keys sorted): `{"headers":{…},"key":…,"payload":…}`. The payload
/// is embedded as JSON when it parses as JSON, else as a string when it is UTF-8, else as
/// `payload_hex`; `headers` only when there are any (a dead letter's reason).
pub fn json_line(key: &str, payload: &[u8], headers: &[Header]) -> String {
    let mut line = serde_json::Map::new();
    line.insert("key".into(), key.into());
    match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(value) => {
            line.insert("payload".into(), value);
        }
        Err(_) => match std::str::from_utf8(payload) {
            Ok(text) => {
                line.insert("payload".into(), text.into());
            }
            Err(_) => {
                line.insert("payload_hex".into(), hex::encode(payload).into());
            }
        },
    }
    if !headers.is_empty() {
        let headers = headers
            .iter()
            .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned().into()))
            .collect();
        line.insert("headers".into(), serde_json::Value::Object(headers));
    }
    serde_json::Value::Object(line).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_embed_json_text_or_hex() {
        assert_eq!(
            json_line("k", br#"{"a":1}"#, &[]),
            r#"{"key":"k","payload":{"a":1}}"#
        );
        assert_eq!(json_line("k", b"hi", &[]), r#"{"key":"k","payload":"hi"}"#);
        assert_eq!(
            json_line("k", &[0xff], &[("why".into(), b"bad".to_vec())]),
            r#"{"headers":{"why":"bad"},"key":"k","payload_hex":"ff"}"#
        );
    }
}
