//! [`Record`]: a consumed Kafka record, owned (it outlives the consumer's buffer while it is in
//! hand), and its key as the consumer's settings say to make it.

use dedupgate_core::{Clock, SystemClock};
use rdkafka::message::{BorrowedMessage, Headers, Message as _};
use serde_json::{Map, Value};

use super::config::RecordKey;
use crate::{ConsumerGate, KeySource, Rejection};

/// One consumed record: where it is, and what it carries.
#[derive(Clone, Debug)]
pub struct Record {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
    /// The record's Kafka key (which partitions it; not the dedup key).
    pub key: Option<Vec<u8>>,
    /// The payload; a tombstone's is empty.
    pub payload: Vec<u8>,
    /// The headers in order; a header may repeat and its value may be null.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The record's timestamp, in ms since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// Copies a record out of the consumer's buffer.
    pub fn from_message(message: &BorrowedMessage<'_>) -> Self {
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
            headers,
            timestamp_ms: message.timestamp().to_millis(),
        }
    }

    /// The first header named `name` whose value is non-empty UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
    }

    /// `topic/partition/offset`.
    pub fn position(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// The record as a key template sees it: the payload's JSON object with the record's
    /// UTF-8 headers under `headers` (the first of a repeated name; a payload field named
    /// `headers` is replaced). A payload that is not a JSON object is seen as an object holding
    /// only the headers, so a template over headers alone works for any payload; a template
    /// that also names payload fields then fails on the missing field, and is reported as
    /// "not JSON" when the payload is not JSON at all.
    fn template_event(&self) -> (Value, Option<serde_json::Error>) {
        let mut headers = Map::new();
        for (name, value) in &self.headers {
            if headers.contains_key(name) {
                continue;
            }
            if let Some(text) = value.as_deref().and_then(|v| std::str::from_utf8(v).ok()) {
                headers.insert(name.clone(), Value::String(text.to_owned()));
            }
        }
        let (mut object, not_json) = match serde_json::from_slice::<Value>(&self.payload) {
            Ok(Value::Object(object)) => (object, None),
            Ok(_) => (Map::new(), None),
            Err(e) => (Map::new(), Some(e)),
        };
        object.insert("headers".to_owned(), Value::Object(headers));
        (Value::Object(object), not_json)
    }
}

/// The dedup key of `record`: its key header, a template rendered over it, or its position, as
/// `gate` and `record_key` say; or why it has none (the record is then rejected).
pub(crate) fn key_of(
    gate: &ConsumerGate,
    record_key: &RecordKey,
    key_header: &str,
    record: &Record,
) -> Result<String, Rejection> {
    if *record_key == RecordKey::Position {
        return Ok(record.position());
    }
    match gate.key_source() {
        KeySource::MessageId => {
            record
                .header(key_header)
                .map(str::to_owned)
                .ok_or_else(|| Rejection::NoHeader {
                    name: key_header.to_owned(),
                })
        }
        KeySource::Template(template) => {
            let (event, not_json) = record.template_event();
            let now_ms = i64::try_from(SystemClock::default().now_ms()).unwrap_or(i64::MAX);
            template
                .render(&event, now_ms)
                .map_err(|cause| match not_json {
                    Some(cause) => Rejection::NotJson {
                        template: template.as_str().to_owned(),
                        cause,
                    },
                    None => Rejection::Template {
                        template: template.as_str().to_owned(),
                        cause,
                    },
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::keys::KeyTemplate;
    use dedupgate_core::{Gate, MemoryStore};

    fn record(payload: &str, headers: &[(&str, Option<&[u8]>)]) -> Record {
        Record {
            topic: "orders".into(),
            partition: 2,
            offset: 41,
            key: None,
            payload: payload.as_bytes().to_vec(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.map(<[u8]>::to_vec)))
                .collect(),
            timestamp_ms: None,
        }
    }

    fn gate() -> ConsumerGate {
        ConsumerGate::new(Gate::new(MemoryStore::new()), "orders").unwrap()
    }

    #[test]
    fn the_key_header_is_the_first_usable_one_by_that_name() {
        let g = gate();
        let from = RecordKey::FromGate;
        let r = record(
            "x",
            &[
                ("idempotency-key", Some(b"k-1")),
                ("idempotency-key", Some(b"k-2")),
            ],
        );
        assert_eq!(key_of(&g, &from, "idempotency-key", &r).unwrap(), "k-1");
        for bad in [
            record("x", &[]),
            record("x", &[("Idempotency-Key", Some(b"k"))]),
            record("x", &[("idempotency-key", None)]),
            record("x", &[("idempotency-key", Some(b""))]),
            record("x", &[("idempotency-key", Some(&[0xff, 0xfe]))]),
        ] {
            let why = key_of(&g, &from, "idempotency-key", &bad).unwrap_err();
            assert!(matches!(why, Rejection::NoHeader { .. }), "{why}");
        }
        let r = record("x", &[("x-id", Some(b"k-9"))]);
        assert_eq!(key_of(&g, &from, "x-id", &r).unwrap(), "k-9");
    }

    #[test]
    fn templates_see_payload_fields_and_headers() {
        let template = KeyTemplate::parse("{headers.tenant}:{order.id}:{ts|window:5m}").unwrap();
        let g = gate().key_template(template);
        let from = RecordKey::FromGate;
        let r = record(
            r#"{"order":{"id":7},"ts":"2026-11-22T10:03:00Z","headers":"shadowed"}"#,
            &[("tenant", Some(b"acme")), ("tenant", Some(b"other"))],
        );
        assert_eq!(
            key_of(&g, &from, "unused", &r).unwrap(),
            "acme:7:2026-11-22T10:00:00Z"
        );
        // A missing field is a template error; a payload that is not JSON says so.
        let r = record(
            r#"{"ts":"2026-11-22T10:03:00Z"}"#,
            &[("tenant", Some(b"a"))],
        );
        let why = key_of(&g, &from, "unused", &r).unwrap_err();
        assert!(matches!(why, Rejection::Template { .. }), "{why}");
        let r = record("not json", &[("tenant", Some(b"a"))]);
        let why = key_of(&g, &from, "unused", &r).unwrap_err();
        assert!(matches!(why, Rejection::NotJson { .. }), "{why}");
        // A template over headers alone works whatever the payload.
        let g = gate().key_template(KeyTemplate::parse("{headers.tenant}").unwrap());
        assert_eq!(key_of(&g, &from, "unused", &r).unwrap(), "a");
    }

    #[test]
    fn the_position_key_names_topic_partition_and_offset() {
        let r = record("x", &[("idempotency-key", Some(b"k-1"))]);
        assert_eq!(
            key_of(&gate(), &RecordKey::Position, "idempotency-key", &r).unwrap(),
            "orders/2/41"
        );
    }
}
