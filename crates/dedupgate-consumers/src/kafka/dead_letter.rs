//! [`DeadLetters`]: rejected records produced to a dead-letter topic, with why in headers, by an
//! idempotent producer. A record counts as settled only once the broker acknowledged its copy.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::{KafkaConfig, KafkaError, Record};

pub use crate::REASON_HEADER;
/// Header holding the outcome's label (`rejected`, `failed`).
pub const OUTCOME_HEADER: &str = "dedupgate-outcome";
/// Header holding where the record came from, `topic/partition/offset`.
pub const SOURCE_HEADER: &str = "dedupgate-source";
/// Header the gate writes with the dedup key it used (when one could be made), on dead
/// letters and on the transactional pipe's outputs. Not the header keys are read from
/// ([`SOURCE_KEY_HEADER_DEFAULT`](super::SOURCE_KEY_HEADER_DEFAULT)).
pub const DEDUP_KEY_HEADER: &str = "dedupgate-key";
/// The former name of [`DEDUP_KEY_HEADER`].
#[deprecated(note = "renamed DEDUP_KEY_HEADER: the header the gate writes with the key it used")]
pub const KEY_HEADER: &str = DEDUP_KEY_HEADER;

/// How long one dead-letter publish may wait for the broker's acknowledgement (librdkafka
/// retries within it) before the consumer tries again later.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The dead-letter topic and its producer.
pub(crate) struct DeadLetters {
    topic: String,
    producer: FutureProducer,
}

impl DeadLetters {
    /// The producer for `config`'s dead-letter topic, when it names one.
    pub(crate) fn new(config: &KafkaConfig) -> Result<Option<Self>, KafkaError> {
        let Some(topic) = &config.dead_letter_topic else {
            return Ok(None);
        };
        let producer = config
            .producer_config()
            .create()
            .map_err(KafkaError::Client)?;
        Ok(Some(Self {
            topic: topic.clone(),
            producer,
        }))
    }

    /// Produces a copy of `record` (its key, payload and headers) with the reason headers
    /// added, and waits for the broker's acknowledgement.
    pub(crate) async fn send(
        &self,
        record: &Record,
        key: Option<&str>,
        outcome: &str,
        reason: &str,
    ) -> Result<(), KafkaError> {
        let headers = dead_letter_headers(record, key, outcome, reason);
        let mut copy = FutureRecord::<[u8], [u8]>::to(&self.topic)
            .payload(&record.payload)
            .headers(headers);
        if let Some(key) = &record.key {
            copy = copy.key(key);
        }
        self.producer
            .send(copy, DELIVERY_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(cause, _)| KafkaError::DeadLetter {
                topic: self.topic.clone(),
                cause,
            })
    }
}

/// `record`'s headers with why it was dead-lettered added: the reason, the outcome's label,
/// where it came from and its key (when one could be made).
pub(crate) fn dead_letter_headers(
    record: &Record,
    key: Option<&str>,
    outcome: &str,
    reason: &str,
) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(record.headers.len() + 4);
    for (name, value) in &record.headers {
        headers = headers.insert(Header {
            key: name,
            value: value.as_deref(),
        });
    }
    let source = record.position();
    let mut added = vec![
        (REASON_HEADER, reason),
        (OUTCOME_HEADER, outcome),
        (SOURCE_HEADER, source.as_str()),
    ];
    if let Some(key) = key {
        added.push((DEDUP_KEY_HEADER, key));
    }
    for (name, value) in added {
        headers = headers.insert(Header {
            key: name,
            value: Some(value),
        });
    }
    headers
}
