//! The two halves of scripts/bench-relay.sh that are not the relay itself:
//!
//! - `produce BOOTSTRAP TOPIC N PARTITIONS`: creates `TOPIC` (PARTITIONS partitions) and writes
//!   N records, each with a distinct `idempotency-key` header and a small JSON payload.
//! - `plain BOOTSTRAP FROM TO GROUP N`: the baseline, a plain consume-and-produce loop with no
//!   gate: consumes `FROM` in group `GROUP`, produces each record to `TO` with the relay's
//!   producer settings (`enable.idempotence=true`, record key = the header's key), keeps up to 64
//!   deliveries in flight (the relay's default `in_flight`), stores each offset once its
//!   delivery is confirmed and lets librdkafka commit them every 500 ms (the relay commits every
//!   500 ms too). Prints one line `PLAIN {"records":N,"seconds":S}`: from the first record
//!   received to the N-th delivery confirmed, so the group join is not counted.

use std::time::{Duration, Instant};

use dedupgate_consumers::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use dedupgate_consumers::kafka::rdkafka::client::DefaultClientContext;
use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use dedupgate_consumers::kafka::rdkafka::message::{Header, Headers, OwnedHeaders};
use dedupgate_consumers::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use dedupgate_consumers::kafka::rdkafka::Message;
use futures::stream::{FuturesUnordered, StreamExt};

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Result<&str, Error> {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| "usage: kafka_bench produce BOOTSTRAP TOPIC N PARTITIONS | plain BOOTSTRAP FROM TO GROUP N".into())
    };
    match arg(0)? {
        "produce" => produce(arg(1)?, arg(2)?, arg(3)?.parse()?, arg(4)?.parse()?).await,
        "plain" => plain(arg(1)?, arg(2)?, arg(3)?, arg(4)?, arg(5)?.parse()?).await,
        other => Err(format!("unknown command {other:?}").into()),
    }
}

async fn produce(bootstrap: &str, topic: &str, n: u64, partitions: i32) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let new_topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    admin
        .create_topics([&new_topic], &AdminOptions::new())
        .await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;
    let mut sends = FuturesUnordered::new();
    for i in 0..n {
        let key = format!("k-{i}");
        let body = format!(r#"{{"id":"{key}","amount_cents":{i}}}"#);
        let producer = producer.clone();
        sends.push(async move {
            let headers = OwnedHeaders::new().insert(Header {
                key: "idempotency-key",
                value: Some(key.as_str()),
            });
            let record = FutureRecord::to(topic)
                .key(&key)
                .payload(&body)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        });
        if sends.len() >= 10_000 {
            if let Some(sent) = sends.next().await {
                sent?;
            }
        }
    }
    while let Some(sent) = sends.next().await {
        sent?;
    }
    println!("produced {n} records to {topic}");
    Ok(())
}

async fn plain(bootstrap: &str, from: &str, to: &str, group: &str, n: u64) -> Result<(), Error> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("enable.auto.offset.store", "false")
        .create()?;
    consumer.subscribe(&[from])?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .create()?;
    let mut in_flight = FuturesUnordered::new();
    let mut stream = consumer.stream();
    let mut started: Option<Instant> = None;
    let mut done = 0u64;
    while done < n {
        tokio::select! {
            delivered = in_flight.next(), if !in_flight.is_empty() => {
                let (topic, partition, offset): (String, i32, i64) =
                    delivered.expect("not empty")?;
                consumer.store_offset(&topic, partition, offset)?;
                done += 1;
            }
            received = stream.next(), if in_flight.len() < 64 => {
                let Some(received) = received else { break };
                let message = received?;
                started.get_or_insert_with(Instant::now);
                let key = message
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "idempotency-key"))
                    .and_then(|h| h.value)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default();
                let payload = message.payload().unwrap_or_default().to_vec();
                let at = (message.topic().to_owned(), message.partition(), message.offset());
                let producer = producer.clone();
                let to = to.to_owned();
                in_flight.push(async move {
                    let record = FutureRecord::to(&to).key(&key).payload(&payload);
                    producer
                        .send(record, Duration::from_secs(30))
                        .await
                        .map(|_| at)
                        .map_err(|(e, _)| Box::new(e) as Error)
                });
            }
        }
    }
    let seconds = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    println!(r#"PLAIN {{"records":{done},"seconds":{seconds:.3}}}"#);
    Ok(())
}
