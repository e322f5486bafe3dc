//! librdkafka's errors in the relay's words: its `Display` opens with its own labels ("Client
//! creation error: …"), which tell a user nothing about what the relay was doing. [`cause`]
//! keeps librdkafka's reason and leaves the label out; the caller says what failed.

use dedupgate_consumers::kafka::rdkafka::error::KafkaError;

/// The reason inside `e`, without librdkafka's label when it has one of ours to replace it.
pub(crate) fn cause(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientCreation(reason) => reason.clone(),
        KafkaError::ClientConfig(_, reason, key, value) => {
            format!("setting {key}={value} refused: {reason}")
        }
        other => other.to_string(),
    }
}

/// The consumers crate's Kafka error, in the same words.
pub(crate) fn consumer_cause(e: &dedupgate_consumers::kafka::KafkaError) -> String {
    match e {
        dedupgate_consumers::kafka::KafkaError::Client(e) => cause(e),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn librdkafka_labels_are_left_out() {
        let e = KafkaError::ClientCreation("No provider for SASL mechanism GSSAPI".into());
        assert_eq!(cause(&e), "No provider for SASL mechanism GSSAPI");
        let e = dedupgate_consumers::kafka::KafkaError::Client(e);
        assert_eq!(consumer_cause(&e), "No provider for SASL mechanism GSSAPI");
    }
}
