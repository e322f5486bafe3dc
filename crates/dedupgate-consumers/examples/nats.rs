//! A NATS JetStream consumer that handles each order once, however often it is delivered:
//! `cargo run -p dedupgate-consumers --example nats`.
//!
//! Publishes five messages to the local server (`NATS_URL`, default `nats://127.0.0.1:4222`,
//! JetStream enabled) with three distinct `Nats-Msg-Id`s, then consumes them with a durable pull
//! consumer through the gate on the embedded store in `./dedupgate-example-data`. Run it twice:
//! the second run finds every order already handled, because the store is durable.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use dedupgate_consumers::{nats, ConsumerGate, Handled};
use dedupgate_core::{Gate, Mode};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
use futures::StreamExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let js = jetstream::new(async_nats::connect(&url).await?);
    let stream_name = "DEDUPGATE_EXAMPLE_ORDERS";
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.to_owned(),
            subjects: vec!["dedupgate.example.orders".to_owned()],
            // JetStream itself drops a repeated Nats-Msg-Id within this window (2 min by
            // default). Short here so the repeats below get through, as they do in production
            // once the window has passed; the gate remembers keys for its ttl (24 h).
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await?;

    // The producer retried: order-1 and order-2 went out twice.
    let orders = ["order-1", "order-2", "order-3", "order-1", "order-2"];
    for (i, id) in orders.into_iter().enumerate() {
        if i == 3 {
            tokio::time::sleep(Duration::from_millis(300)).await; // past the window
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(nats::MESSAGE_ID_HEADER, id);
        let body = format!(r#"{{"order":"{id}","amount_cents":1000}}"#);
        js.publish_with_headers("dedupgate.example.orders", headers, body.into())
            .await?
            .await?;
    }

    // The gate: the embedded durable store, retriable mode, key = the Nats-Msg-Id header.
    let store = EmbeddedStore::open("./dedupgate-example-data", EmbeddedOptions::default())?;
    // A namespace of its own: the RabbitMQ example uses the same directory and message ids.
    let gate = ConsumerGate::new(Gate::new(store), "orders.nats")?.mode(Mode::Retriable);

    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("orders-worker".to_owned()),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut settled = 0;
    while settled < orders.len() {
        let Some(message) = messages.next().await else {
            break;
        };
        let handled = nats::handle(&gate, &message?, |msg| async move {
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
    js.delete_stream(stream_name).await?;
    Ok(())
}
