//! A Kafka consumer that handles each order once, however often it is delivered:
//! `cargo run -p dedupgate-consumers --example kafka`.
//!
//! Produces five records with three distinct `idempotency-key` headers to the topic
//! `dedupgate-example-orders` on the broker at `KAFKA_BOOTSTRAP` (default `127.0.0.1:9092`),
//! then consumes them in the group `dedupgate-example` through the gate on the embedded store in
//! `./dedupgate-example-data`, committing each offset only once its record is settled. Run it
//! twice: the second run's five new records are all duplicates, because the store is durable.

use std::time::Duration;

use dedupgate_consumers::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use dedupgate_consumers::kafka::rdkafka::client::DefaultClientContext;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::message::{Header, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use dedupgate_consumers::kafka::{KafkaConfig, KafkaConsumer};
use dedupgate_consumers::ConsumerGate;
use dedupgate_core::{Gate, Mode};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let topic = "dedupgate-example-orders";

    // The topic (an error saying it exists is fine).
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()?;
    let new_topic = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    admin
        .create_topics([&new_topic], &AdminOptions::new())
        .await?;

    // The producer retried: order-1 and order-2 went out twice, each copy at a new offset.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .create()?;
    let orders = ["order-1", "order-2", "order-1", "order-3", "order-2"];
    for id in orders {
        let body = format!(r#"{{"order":"{id}","amount_cents":1000}}"#);
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(id),
        });
        let record = FutureRecord::to(topic)
            .key(id)
            .payload(&body)
            .headers(headers);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)?;
    }

    // The gate: the embedded durable store, retriable mode, key = the idempotency-key header.
    let store = EmbeddedStore::open("./dedupgate-example-data", EmbeddedOptions::default())?;
    let gate = ConsumerGate::new(Gate::new(store), "kafka-orders")?.mode(Mode::Retriable);
    let config = KafkaConfig::new(&bootstrap, "dedupgate-example", &[topic])?
        .set("session.timeout.ms", "6000")?;
    let consumer = KafkaConsumer::new(gate, config)?;

    // Stop once this run's five records are settled (ran or duplicate) and committed.
    let settled = async {
        loop {
            let s = consumer.stats();
            if s.ran + s.duplicates >= orders.len() as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let stats = consumer
        .run(
            |msg| async move {
                // The side effect goes here (charge the card, send the email, ...).
                let order: serde_json::Value = msg.json()?;
                println!("  charging {} cents for {}", order["amount_cents"], msg.key);
                Ok::<_, serde_json::Error>(format!("charged {}", msg.key))
            },
            settled,
        )
        .await?;
    println!(
        "{} records: {} ran, {} duplicates",
        stats.records, stats.ran, stats.duplicates
    );
    Ok(())
}
