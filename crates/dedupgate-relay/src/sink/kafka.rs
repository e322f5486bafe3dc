//! Kafka sink: an idempotent producer (`enable.idempotence=true`, so librdkafka's own retries
//! do not write a record twice). The record's Kafka key is the gate key (records of one key
//! stay in one partition, in order) and so is its `idempotency-key` header, so a relay or
//! consumer downstream dedups on the same key. A send is confirmed by the delivery report.

use std::time::Duration;

use async_trait::async_trait;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::message::{Header as KHeader, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};

use super::{Outgoing, Sink, SinkError, KEY_HEADER};

/// How long a send may wait for its delivery report (librdkafka retries inside it).
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct KafkaSink {
    name: String,
    topic: String,
    producer: FutureProducer,
}

impl KafkaSink {
    pub fn new(bootstrap: &str, topic: &str) -> Result<Self, SinkError> {
        let name = format!("kafka://{bootstrap}/{topic}");
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                DELIVERY_TIMEOUT.as_millis().to_string(),
            )
            .create()
            .map_err(|e| SinkError::Open {
                sink: name.clone(),
                reason: format!(
                    "librdkafka refused to create the producer: {}",
                    crate::kafka_error::cause(&e)
                ),
            })?;
        Ok(Self {
            name,
            topic: topic.to_owned(),
            producer,
        })
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let Outgoing {
            key,
            payload,
            headers,
            ..
        } = out;
        let mut kafka_headers =
            OwnedHeaders::new_with_capacity(headers.len() + 1).insert(KHeader {
                key: KEY_HEADER,
                value: Some(key),
            });
        for (name, value) in headers {
            kafka_headers = kafka_headers.insert(KHeader {
                key: name,
                value: Some(value),
            });
        }
        let record = FutureRecord::to(&self.topic)
            .key(key)
            .payload(payload)
            .headers(kafka_headers);
        self.producer
            .send(record, DELIVERY_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(e, _)| SinkError::Send {
                sink: self.name.clone(),
                reason: crate::kafka_error::cause(&e),
            })
    }
}
