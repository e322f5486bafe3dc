//! [`KafkaConfig`]: the consumer group, its topics, where keys come from, the dead-letter topic
//! and the bounds of the consumer's work in hand, with their defaults and checks.

use std::time::Duration;

use dedupgate_core::InvalidInput;

/// The header of a consumed record that its dedup key is read from, by default
/// ([`KafkaConfig::key_header`] names another). Not [`DEDUP_KEY_HEADER`](super::DEDUP_KEY_HEADER),
/// which the pipe and the dead letters write.
pub const SOURCE_KEY_HEADER_DEFAULT: &str = "idempotency-key";
/// The former name of [`SOURCE_KEY_HEADER_DEFAULT`].
#[deprecated(note = "renamed SOURCE_KEY_HEADER_DEFAULT: the header keys are read from")]
pub const KEY_HEADER_DEFAULT: &str = SOURCE_KEY_HEADER_DEFAULT;
/// Default bound of records in hand at once (handled, waiting for a retry, or being
/// dead-lettered), across all partitions. At the bound the consumer stops fetching: that is
/// the backpressure, and the memory bound.
pub const IN_FLIGHT_DEFAULT: usize = 64;
/// Largest in-flight bound accepted: each record in hand is a task and a copy of the record.
pub const IN_FLIGHT_MAX: usize = 10_000;
/// Default period of the offset commits. A record settled is committed within this long; a
/// consumer that dies loses at most this much progress, which the gate turns into duplicates
/// (not runs) after the restart.
pub const COMMIT_EVERY_DEFAULT: Duration = Duration::from_millis(500);
/// Default time [`KafkaConsumer::run`](super::KafkaConsumer::run) lets records in hand settle
/// after it was told to stop; those still unsettled then are abandoned uncommitted.
pub const SHUTDOWN_GRACE_DEFAULT: Duration = Duration::from_secs(10);

/// librdkafka properties the consumer sets itself and refuses to take from the caller: offsets
/// are stored and committed only by the consumer, once a record is settled.
const OWNED_PROPERTIES: [&str; 3] = [
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.partition.eof",
];

/// Where a Kafka record's key comes from, beyond [`KeySource`](crate::KeySource): with
/// [`KeySource::MessageId`](crate::KeySource::MessageId) (the default) the key is a header, whose
/// name [`KafkaConfig::key_header`] sets; with a [`KeySource::Template`](crate::KeySource::Template)
/// it is rendered over the record (see the [module docs](super)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RecordKey {
    /// The [`ConsumerGate`](crate::ConsumerGate)'s key source.
    FromGate,
    /// `topic/partition/offset`: see [`KafkaConfig::key_from_position`].
    Position,
}

/// The consumer's settings. Built with [`KafkaConfig::new`] and the checked setters.
#[derive(Clone, Debug)]
pub struct KafkaConfig {
    pub(crate) properties: Vec<(String, String)>,
    pub(crate) topics: Vec<String>,
    pub(crate) key_header: String,
    pub(crate) record_key: RecordKey,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) in_flight: usize,
    pub(crate) commit_every: Duration,
    pub(crate) shutdown_grace: Duration,
}

/// Connection properties copied from the consumer's settings to its producers (dead letters,
/// the pipe's transactions): where the cluster is and how to authenticate; consumer
/// properties would only draw warnings.
fn is_connection_property(name: &str) -> bool {
    name == "bootstrap.servers"
        || name == "client.id"
        || ["security.", "sasl.", "ssl."]
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

impl KafkaConfig {
    /// The settings of a producer on this consumer's cluster: its connection properties, and
    /// idempotence, so that a retried publish is not written twice.
    pub(crate) fn producer_config(&self) -> rdkafka::config::ClientConfig {
        let mut client = rdkafka::config::ClientConfig::new();
        for (name, value) in &self.properties {
            if is_connection_property(name) {
                client.set(name, value);
            }
        }
        client.set("enable.idempotence", "true");
        client
    }

    /// A consumer of `topics` in group `group_id` of the cluster at `bootstrap_servers`
    /// (`host:port[,host:port…]`), starting from the earliest offset when the group has none.
    /// Refused when a value is empty or there are no topics.
    pub fn new(
        bootstrap_servers: &str,
        group_id: &str,
        topics: &[&str],
    ) -> Result<Self, InvalidInput> {
        non_empty("bootstrap_servers", bootstrap_servers)?;
        non_empty("group_id", group_id)?;
        if topics.is_empty() {
            return Err(InvalidInput::new("topics", "at least one topic is needed"));
        }
        for topic in topics {
            non_empty("topics", topic)?;
        }
        Ok(Self {
            properties: vec![
                ("bootstrap.servers".into(), bootstrap_servers.into()),
                ("group.id".into(), group_id.into()),
                ("auto.offset.reset".into(), "earliest".into()),
            ],
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            key_header: SOURCE_KEY_HEADER_DEFAULT.to_owned(),
            record_key: RecordKey::FromGate,
            dead_letter_topic: None,
            in_flight: IN_FLIGHT_DEFAULT,
            commit_every: COMMIT_EVERY_DEFAULT,
            shutdown_grace: SHUTDOWN_GRACE_DEFAULT,
        })
    }

    /// Sets a librdkafka property (`session.timeout.ms`, `security.protocol`, …), replacing any
    /// earlier value. The offset properties the consumer owns (`enable.auto.commit`,
    /// `enable.auto.offset.store`, `enable.partition.eof`) are refused: committing on a timer
    /// or on receipt would commit records not yet settled.
    pub fn set(mut self, name: &str, value: &str) -> Result<Self, InvalidInput> {
        non_empty("property", name)?;
        if OWNED_PROPERTIES.contains(&name) {
            return Err(InvalidInput::new(
                "property",
                format!("{name} is set by the consumer: offsets are committed once settled"),
            ));
        }
        self.properties.retain(|(n, _)| n != name);
        self.properties.push((name.to_owned(), value.to_owned()));
        Ok(self)
    }

    /// The header the key comes from when the gate's key source is the message id (default
    /// [`SOURCE_KEY_HEADER_DEFAULT`]). Header names are compared byte for byte, as Kafka keeps them.
    pub fn key_header(mut self, name: &str) -> Result<Self, InvalidInput> {
        non_empty("key_header", name)?;
        self.key_header = name.to_owned();
        Ok(self)
    }

    /// Keys each record by its position, `topic/partition/offset`, instead of a header or a
    /// template. Only a redelivery of the same record (a rebalance, a restart before the commit)
    /// is then caught: a record redriven from a dead-letter topic, produced again by a producer
    /// retry or by a replay, gets a new offset, hence a new key, and runs again. Use it only
    /// when records carry no id and their payloads no stable field.
    pub fn key_from_position(mut self) -> Self {
        self.record_key = RecordKey::Position;
        self
    }

    /// Where rejected records go (no usable key, a fingerprint mismatch, a handler failure that
    /// is not retried): produced there, with the reason in headers, before their offset counts
    /// as settled. Without one, a rejected record is logged as an error and committed past.
    pub fn dead_letter_topic(mut self, topic: &str) -> Result<Self, InvalidInput> {
        non_empty("dead_letter_topic", topic)?;
        self.dead_letter_topic = Some(topic.to_owned());
        Ok(self)
    }

    /// Records in hand at once, 1..=[`IN_FLIGHT_MAX`] (default [`IN_FLIGHT_DEFAULT`]). Records
    /// of one partition are handled concurrently; their offsets are still committed in order.
    pub fn in_flight(mut self, n: usize) -> Result<Self, InvalidInput> {
        if n == 0 || n > IN_FLIGHT_MAX {
            return Err(InvalidInput::new(
                "in_flight",
                format!("must be 1..={IN_FLIGHT_MAX}, got {n}"),
            ));
        }
        self.in_flight = n;
        Ok(self)
    }

    /// The period of the offset commits, 10 ms to 60 s (default [`COMMIT_EVERY_DEFAULT`]).
    pub fn commit_every(mut self, every: Duration) -> Result<Self, InvalidInput> {
        if every < Duration::from_millis(10) || every > Duration::from_secs(60) {
            return Err(InvalidInput::new(
                "commit_every",
                format!("must be 10 ms to 60 s, got {every:?}"),
            ));
        }
        self.commit_every = every;
        Ok(self)
    }

    /// How long records in hand may settle after the consumer was told to stop, up to 10
    /// minutes (default [`SHUTDOWN_GRACE_DEFAULT`]).
    pub fn shutdown_grace(mut self, grace: Duration) -> Result<Self, InvalidInput> {
        if grace > Duration::from_secs(600) {
            return Err(InvalidInput::new(
                "shutdown_grace",
                format!("must be at most 10 minutes, got {grace:?}"),
            ));
        }
        self.shutdown_grace = grace;
        Ok(self)
    }

    /// The value of a librdkafka property, when set.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The topics consumed.
    pub fn topics(&self) -> &[String] {
        &self.topics
    }
}

fn non_empty(field: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() {
        return Err(InvalidInput::new(field, "must not be empty"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "g", &["t"]).unwrap()
    }

    #[test]
    fn empty_values_and_owned_properties_are_refused() {
        assert_eq!(
            KafkaConfig::new("", "g", &["t"]).unwrap_err().field,
            "bootstrap_servers"
        );
        assert_eq!(
            KafkaConfig::new("b", "", &["t"]).unwrap_err().field,
            "group_id"
        );
        assert_eq!(KafkaConfig::new("b", "g", &[]).unwrap_err().field, "topics");
        assert_eq!(
            KafkaConfig::new("b", "g", &[""]).unwrap_err().field,
            "topics"
        );
        for owned in OWNED_PROPERTIES {
            assert_eq!(config().set(owned, "true").unwrap_err().field, "property");
        }
        assert_eq!(config().key_header("").unwrap_err().field, "key_header");
        assert_eq!(
            config().dead_letter_topic("").unwrap_err().field,
            "dead_letter_topic"
        );
        assert_eq!(config().in_flight(0).unwrap_err().field, "in_flight");
        assert_eq!(
            config().in_flight(IN_FLIGHT_MAX + 1).unwrap_err().field,
            "in_flight"
        );
        assert_eq!(
            config().commit_every(Duration::ZERO).unwrap_err().field,
            "commit_every"
        );
        assert_eq!(
            config()
                .shutdown_grace(Duration::from_secs(601))
                .unwrap_err()
                .field,
            "shutdown_grace"
        );
    }

    #[test]
    fn a_property_set_twice_keeps_the_last_value() {
        let c = config()
            .set("auto.offset.reset", "latest")
            .unwrap()
            .set("session.timeout.ms", "6000")
            .unwrap();
        assert_eq!(c.property("auto.offset.reset"), Some("latest"));
        assert_eq!(c.property("session.timeout.ms"), Some("6000"));
        assert_eq!(
            c.properties
                .iter()
                .filter(|(n, _)| n == "auto.offset.reset")
                .count(),
            1
        );
        assert_eq!(c.key_header, SOURCE_KEY_HEADER_DEFAULT);
        assert_eq!(c.record_key, RecordKey::FromGate);
        assert_eq!(c.key_from_position().record_key, RecordKey::Position);
    }
}
