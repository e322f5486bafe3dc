//! RabbitMQ for the AMQP tests: the machine's broker (`DEDUPGATE_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). The relay's and the binary's tests include this
//! file too (`#[path]`).

use dedupgate_consumers::rabbitmq;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, Consumer};

/// The broker's URL: `DEDUPGATE_TEST_AMQP_URL`, or the local default.
pub fn url() -> String {
    std::env::var("DEDUPGATE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Connects, or fails the test naming the broker it needs.
pub async fn connect() -> Connection {
    let url = url();
    rabbitmq::connect(&url).await.unwrap_or_else(|e| {
        panic!("these tests need RabbitMQ at {url} (DEDUPGATE_TEST_AMQP_URL): {e}")
    })
}

/// A channel in publisher-confirm mode, for [`publish`].
pub async fn confirming_channel(conn: &Connection) -> Channel {
    let channel = conn.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    channel
}

/// Publishes through the default exchange and waits for the broker's confirm, so the message
/// is in `queue` when this returns.
pub async fn publish(channel: &Channel, queue: &str, message_id: Option<&str>, payload: &[u8]) {
    let mut props = BasicProperties::default();
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    let confirm = channel
        .basic_publish("", queue, BasicPublishOptions::default(), payload, props)
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack(), "the broker did not confirm a publish");
}

/// A consumer on `queue` with the consumer tag `tag`.
pub async fn consumer(channel: &Channel, queue: &str, tag: &str) -> Consumer {
    channel
        .basic_consume(
            queue,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume")
}

/// The messages in `queue` (a passive declare), or `None` when it does not exist.
pub async fn message_count(channel: &Channel, queue: &str) -> Option<u32> {
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok()
        .map(|q| q.message_count())
}
