//! Publishes five orders, three distinct `message_id`s, to a RabbitMQ queue (declared if
//! missing), each confirmed by the broker: the input of the README's relay example.
//!
//! ```sh
//! cargo run -p dedupgate-relay --features rabbitmq --example amqp_publish -- [QUEUE] [AMQP_URL]
//! ```

use dedupgate_consumers::rabbitmq;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let queue = args.next().unwrap_or_else(|| "relay-demo".to_owned());
    let url = args
        .next()
        .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = rabbitmq::connect(&url).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare(
            queue.as_str(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    for (id, amount) in [
        ("order-1", 100),
        ("order-2", 250),
        ("order-1", 100),
        ("order-3", 75),
        ("order-2", 250),
    ] {
        let body = format!(r#"{{"order_id":"{id}","amount_cents":{amount}}}"#);
        let confirm = channel
            .basic_publish(
                "",
                queue.as_str(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default()
                    .with_message_id(id.into())
                    .with_delivery_mode(2),
            )
            .await?
            .await?;
        if !confirm.is_ack() {
            return Err(format!("the broker did not confirm {id}").into());
        }
        println!("published {id}");
    }
    conn.close(200, "done").await?;
    Ok(())
}
