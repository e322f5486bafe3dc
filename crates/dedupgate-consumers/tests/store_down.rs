//! The gate unavailable: a delivery whose key the store cannot decide is requeued, never acked,
//! and runs once the store is back. The store is Redis on a `redis-server` this test owns and
//! kills (`dedupgate_redis::testkit`); the broker is the machine's RabbitMQ.

mod common;

use std::time::Duration;

use common::{amqp, unique};
use dedupgate_consumers::{rabbitmq, Action, ConsumerGate, Handled};
use dedupgate_core::{Gate, Mode};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::RedisStore;
use futures::StreamExt;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_the_gate_cannot_decide_is_requeued_and_runs_once_the_store_is_back() {
    let mut server = tokio::task::spawn_blocking(|| RedisServer::start(&[]))
        .await
        .unwrap()
        .expect("start redis-server");
    let store = RedisStore::open(&server.url())
        .await
        .expect("open the redis store");
    let gate = ConsumerGate::new(Gate::new(store), "consumers-test")
        .expect("namespace")
        .mode(Mode::Retriable)
        .unavailable_retry(Duration::from_millis(100))
        .expect("unavailable delay");

    let conn = amqp::connect().await;
    let channel = amqp::confirming_channel(&conn).await;
    let queue = unique("dedupgate-consumers-down");
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    channel
        .queue_declare(&queue, QueueDeclareOptions::default(), args)
        .await
        .expect("declare");
    amqp::publish(&channel, &queue, Some("o-1"), b"{\"order\":\"o-1\"}").await;

    server.kill();
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let handler = |_msg| async {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>("done")
    };

    // Store down: the delivery is requeued (nack), and the handler does not run.
    let delivery = consumer.next().await.expect("delivery").expect("delivery");
    assert!(!delivery.redelivered);
    let handled = rabbitmq::handle(&gate, &delivery, handler)
        .await
        .expect("settle");
    assert!(
        matches!(handled, Handled::Unavailable { .. }),
        "store down: {handled}"
    );
    assert!(matches!(handled.action(), Action::Retry { .. }));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);

    // Store back: the requeued delivery comes again and runs once. The store's first call after
    // the restart may still find the old connection broken; such answers requeue it again.
    let _server = tokio::task::spawn_blocking(move || {
        let restarted = server.restart();
        restarted.map(|()| server)
    })
    .await
    .unwrap()
    .expect("restart redis-server");
    let mut unavailable_after_restart = 0;
    loop {
        let delivery = consumer.next().await.expect("delivery").expect("delivery");
        assert!(
            delivery.redelivered,
            "the message came back as a redelivery"
        );
        let handled = rabbitmq::handle(&gate, &delivery, handler)
            .await
            .expect("settle");
        match handled {
            Handled::Ran { .. } => break,
            Handled::Unavailable { .. } if unavailable_after_restart < 20 => {
                unavailable_after_restart += 1
            }
            other => panic!("after the restart: {other}"),
        }
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    channel
        .basic_cancel("c", Default::default())
        .await
        .expect("cancel");
    let left = channel
        .queue_delete(&queue, QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    assert_eq!(left, 0, "the message was acked");
    conn.close(200, "done").await.expect("close");
}
