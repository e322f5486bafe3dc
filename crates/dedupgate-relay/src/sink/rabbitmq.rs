//! RabbitMQ sink: publishes on a channel in confirm mode and waits for the broker's ack, with
//! the gate key as the AMQP `message_id` (what a dedupgate consumer downstream keys on) and in
//! the `idempotency-key` header, and persistent delivery. `message_id` is an AMQP shortstr (at
//! most 255 bytes) while a gate key may be up to 1024: a longer key's `message_id` is
//! [`message_id`]'s digest of it, and the header keeps it whole.

use async_trait::async_trait;
use dedupgate_consumers::rabbitmq;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use sha2::{Digest, Sha256};

use super::{Outgoing, Sink, SinkError, KEY_HEADER};

/// The longest AMQP shortstr, and so the longest `message_id`.
const SHORTSTR_BYTES_MAX: usize = 255;

/// The `message_id` of a message with gate key `key`: the key itself when it fits a shortstr,
/// else `sha256:` and the hex SHA-256 of the key (71 bytes). SHA-256, because distinct keys
/// must keep distinct ids for a consumer downstream that dedups on `message_id` (a collision
/// would drop a message as a duplicate), and the consumers crate already fingerprints with it;
/// the prefix says the id is a digest, and the key is whole in the `idempotency-key` header.
pub(crate) fn message_id(key: &str) -> String {
    if key.len() <= SHORTSTR_BYTES_MAX {
        key.to_owned()
    } else {
        format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())))
    }
}

pub struct AmqpSink {
    name: String,
    exchange: String,
    routing_key: String,
    // Kept: the channel closes with its connection.
    _connection: Connection,
    channel: Channel,
}

impl AmqpSink {
    pub async fn connect(uri: &str, exchange: &str, routing_key: &str) -> Result<Self, SinkError> {
        let name = format!("amqp exchange {exchange:?} routing key {routing_key:?}");
        let open = |reason: String| SinkError::Open {
            sink: name.clone(),
            reason,
        };
        let connection = rabbitmq::connect(uri)
            .await
            .map_err(|e| open(e.to_string()))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| open(e.to_string()))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| open(e.to_string()))?;
        Ok(Self {
            name,
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            _connection: connection,
            channel,
        })
    }
}

#[async_trait]
impl Sink for AmqpSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let Outgoing {
            key,
            payload,
            headers,
            ..
        } = out;
        let failed = |reason: String| SinkError::Send {
            sink: self.name.clone(),
            reason,
        };
        let mut table = FieldTable::default();
        table.insert(
            ShortString::from(KEY_HEADER),
            AMQPValue::LongString(LongString::from(key.as_bytes().to_vec())),
        );
        for (name, value) in headers {
            table.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.clone())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(message_id(key).into())
            .with_delivery_mode(2)
            .with_headers(table);
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.as_str(),
                self.routing_key.as_str(),
                BasicPublishOptions {
                    // An unroutable message is returned, not silently dropped.
                    mandatory: true,
                    ..Default::default()
                },
                payload,
                properties,
            )
            .await
            .map_err(|e| failed(e.to_string()))?
            .await
            .map_err(|e| failed(e.to_string()))?;
        if !confirm.is_ack() {
            return Err(failed("the broker nacked the publish".into()));
        }
        if confirm.take_message().is_some() {
            return Err(failed(
                "unroutable: no queue is bound for this exchange and routing key".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_fit_a_shortstr_and_stay_distinct() {
        assert_eq!(message_id("k-1"), "k-1");
        let at_limit = "a".repeat(SHORTSTR_BYTES_MAX);
        assert_eq!(message_id(&at_limit), at_limit);
        let (a, b) = ("a".repeat(1000), format!("{}b", "a".repeat(999)));
        assert_eq!(message_id(&a).len(), 71);
        assert!(message_id(&a).starts_with("sha256:"));
        assert_ne!(message_id(&a), message_id(&b));
    }
}
