//! RabbitMQ sink: publishes on a channel in confirm mode and waits for the broker's ack, with
//! the gate key as the AMQP `message_id` (what a dedupgate consumer downstream keys on) and
//! persistent delivery.

use async_trait::async_trait;
use dedupgate_consumers::rabbitmq;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::{Header, Sink, SinkError};

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
    async fn send(&self, key: &str, payload: &[u8], headers: &[Header]) -> Result<(), SinkError> {
        let failed = |reason: String| SinkError::Send {
            sink: self.name.clone(),
            reason,
        };
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.clone())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(key.into())
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
