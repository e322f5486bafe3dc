//! A RabbitMQ consumer that handles each order once, however often it is delivered:
//! `cargo run -p dedupgate-consumers --example rabbitmq`.
//!
//! Publishes five messages to the local broker (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`) with three distinct `message_id`s, then consumes
//! them through the gate on the embedded store in `./dedupgate-example-data`. Run it twice: the
//! second run finds every order already handled, because the store is durable.

use dedupgate_consumers::{rabbitmq, ConsumerGate, Handled};
use dedupgate_core::{Gate, Mode};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = rabbitmq::connect(&url).await?;
    let channel = conn.create_channel().await?;
    let queue = "dedupgate-example-orders";
    channel
        .queue_declare(queue, QueueDeclareOptions::default(), FieldTable::default())
        .await?;

    // The producer retried: order-1 and order-2 went out twice.
    let orders = ["order-1", "order-2", "order-1", "order-3", "order-2"];
    for id in orders {
        let body = format!(r#"{{"order":"{id}","amount_cents":1000}}"#);
        let props = BasicProperties::default().with_message_id(id.into());
        channel
            .basic_publish(
                "",
                queue,
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?
            .await?;
    }

    // The gate: the embedded durable store, retriable mode, key = the AMQP message_id.
    let store = EmbeddedStore::open("./dedupgate-example-data", EmbeddedOptions::default())?;
    let gate = ConsumerGate::new(Gate::new(store), "orders")?.mode(Mode::Retriable);

    let mut consumer = channel
        .basic_consume(
            queue,
            "example",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut settled = 0;
    while settled < orders.len() {
        let Some(delivery) = consumer.next().await else {
            break;
        };
        let handled = rabbitmq::handle(&gate, &delivery?, |msg| async move {
            // The side effect goes here (charge the card, send the email, ...).
            let order: serde_json::Value = msg.json()?;
            println!("  handling {} for {} cents", msg.key, order["amount_cents"]);
            Ok::<_, serde_json::Error>(format!("charged {}", msg.key))
        })
        .await?;
        match &handled {
            Handled::Ran { key, value } => println!("{key}: ran -> {value:?}"),
            Handled::Duplicate { key, record } => {
                println!(
                    "{key}: duplicate, not run again (first run returned {})",
                    record
                        .result
                        .as_ref()
                        .map_or("nothing".to_owned(), |r| r.to_string())
                )
            }
            other => println!("{other}"),
        }
        if !matches!(handled.action(), dedupgate_consumers::Action::Retry { .. }) {
            settled += 1;
        }
    }
    channel
        .queue_delete(queue, QueueDeleteOptions::default())
        .await?;
    conn.close(200, "bye").await?;
    Ok(())
}
