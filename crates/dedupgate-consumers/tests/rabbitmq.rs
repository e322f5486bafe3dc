//! Against the machine's RabbitMQ (`DEDUPGATE_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): duplicates and redeliveries across two concurrent
//! consumers sharing one embedded store run the handler once per key; a failed handler is
//! retried on redelivery, after growing delays counted from the quorum queue's
//! `x-delivery-count`, and dead-lettered after `max_attempts` with its claim released; a message
//! without a key, or a key reused with another payload, is rejected to the dead-letter queue.
//! Each test uses its own queues and deletes them.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::{amqp, keys, unique, Ledger, Seen};
use dedupgate_consumers::{rabbitmq, Action, ConsumerGate, Handled, Rejection};
use dedupgate_core::{Mode, State};
use futures::StreamExt;
use lapin::message::BasicGetMessage;
use lapin::options::{BasicGetOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};

/// The work queue (dead-lettering to `dlq` through the default exchange) and the dead-letter
/// queue. Both expire after 10 unused minutes should a failed test leave them behind.
/// With `quorum`, the work queue is a quorum queue (durable, counting deliveries in
/// `x-delivery-count`).
async fn declare(channel: &Channel, queue: &str, dlq: &str, quorum: bool) {
    let mut expiring = FieldTable::default();
    expiring.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    channel
        .queue_declare(dlq, QueueDeclareOptions::default(), expiring.clone())
        .await
        .expect("declare dlq");
    let mut args = expiring;
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dlq.into()),
    );
    let mut options = QueueDeclareOptions::default();
    if quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        options.durable = true;
    }
    channel
        .queue_declare(queue, options, args)
        .await
        .expect("declare queue");
}

fn payload(key: &str) -> Vec<u8> {
    format!("{{\"order\":\"{key}\",\"amount\":100}}").into_bytes()
}

/// Runs `consumers` consumers on `queue`, each on its own channel, until `expected` deliveries
/// were settled for good (acked or rejected). Returns their outcomes through `ledger`.
async fn consume(
    conn: &Connection,
    queue: &str,
    gate: &ConsumerGate,
    ledger: &Arc<Ledger>,
    consumers: usize,
    expected: usize,
) {
    let mut channels = Vec::new();
    let mut streams = Vec::new();
    for i in 0..consumers {
        let channel = conn.create_channel().await.expect("channel");
        channel
            .basic_qos(4, BasicQosOptions::default())
            .await
            .expect("qos");
        streams.push(amqp::consumer(&channel, queue, &format!("consumer-{i}")).await);
        channels.push(channel);
    }
    common::consume(
        streams,
        gate,
        ledger,
        expected,
        |gate, ledger, delivery| async move {
            let delivery = delivery.expect("delivery");
            rabbitmq::handle(&gate, &delivery, |msg| ledger.handle(msg))
                .await
                .expect("settle")
        },
    )
    .await;
    // Closing the channels returns any unacked delivery to the queue, where the final message
    // count would show it.
    for channel in channels {
        channel
            .close(200, "test done")
            .await
            .expect("close channel");
    }
}

/// A connection, a channel with publisher confirms, and a fresh work queue with its dead-letter
/// queue, declared.
async fn setup() -> (Connection, Channel, String, String) {
    setup_typed(false).await
}

/// [`setup`], with the work queue a quorum queue when `quorum`.
async fn setup_typed(quorum: bool) -> (Connection, Channel, String, String) {
    let conn = amqp::connect().await;
    let channel = amqp::confirming_channel(&conn).await;
    let (queue, dlq) = (
        unique("dedupgate-consumers"),
        unique("dedupgate-consumers-dlq"),
    );
    declare(&channel, &queue, &dlq, quorum).await;
    (conn, channel, queue, dlq)
}

/// Follows the one message in `consumer`'s queue through every delivery until it is acked, or
/// rejected unless `rejects_come_back` (a dead-letter loop returns them), running the
/// `fail_first(calls, failures)` handler.
async fn follow(
    consumer: &mut Consumer,
    gate: &ConsumerGate,
    calls: &AtomicUsize,
    failures: usize,
    rejects_come_back: bool,
) -> Vec<Seen> {
    let mut seen = Vec::new();
    loop {
        assert!(seen.len() < 10, "the message never settled: {seen:#?}");
        let next = tokio::time::timeout(common::SETTLE_TIMEOUT, consumer.next()).await;
        let delivery = next
            .unwrap_or_else(|_| panic!("no delivery within the timeout after {seen:#?}"))
            .expect("the consumer ended")
            .expect("delivery");
        let at = Instant::now();
        let attempt = rabbitmq::attempt(&delivery).number;
        let handled = rabbitmq::handle(gate, &delivery, |msg| {
            common::fail_first(calls, failures, msg)
        })
        .await
        .expect("settle");
        let done = match handled.action() {
            Action::Ack => true,
            Action::Reject => !rejects_come_back,
            Action::Retry { .. } => false,
        };
        seen.push(Seen::new(attempt, at, &handled));
        if done {
            return seen;
        }
    }
}

/// The one message in `queue`, taken off it.
async fn take(channel: &Channel, queue: &str) -> Option<BasicGetMessage> {
    channel
        .basic_get(queue, BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
}

/// Cancels the tests' consumer ("c") and checks that `queue` holds nothing.
async fn stop_with_queue_empty(channel: &Channel, queue: &str) {
    channel
        .basic_cancel("c", Default::default())
        .await
        .expect("cancel");
    assert_eq!(message_count(channel, queue).await, 0);
}

async fn message_count(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
}

async fn drain(channel: &Channel, queue: &str) -> Vec<(Option<String>, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some(got) = channel
        .basic_get(queue, BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let d = got.delivery;
        out.push((
            d.properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned()),
            d.data,
        ));
    }
    out
}

async fn delete(channel: &Channel, queues: &[&str]) {
    for q in queues {
        channel
            .queue_delete(q, QueueDeleteOptions::default())
            .await
            .expect("delete queue");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_redeliveries_run_once_across_two_consumers() {
    let (conn, channel, queue, dlq) = setup().await;

    // 20 keys, each published three times: two copies back to back (so the two consumers get
    // them at once and one finds the key in progress), a third after all the others.
    let keys = keys(20);
    for k in &keys {
        amqp::publish(&channel, &queue, Some(k), &payload(k)).await;
        amqp::publish(&channel, &queue, Some(k), &payload(k)).await;
    }
    for k in &keys {
        amqp::publish(&channel, &queue, Some(k), &payload(k)).await;
    }
    // No message id: rejected. key-00 again with another payload: rejected as key reuse.
    amqp::publish(&channel, &queue, None, b"{\"order\":\"no-id\"}").await;
    amqp::publish(
        &channel,
        &queue,
        Some("key-00"),
        b"{\"order\":\"key-00\",\"amount\":999}",
    )
    .await;
    let published = keys.len() * 3 + 2;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let ledger = Ledger::new(&["key-03", "key-07", "key-11"]);
    consume(&conn, &queue, &gate, &ledger, 2, published).await;

    eprintln!("outcomes: {:?}", ledger.summary());
    let succeeded = ledger.succeeded();
    for k in &keys {
        assert_eq!(
            succeeded.get(k),
            Some(&1),
            "{k} ran {:?} times",
            succeeded.get(k)
        );
    }
    assert_eq!(succeeded.len(), keys.len(), "runs: {succeeded:?}");
    let failed = ledger.failed();
    assert_eq!(
        failed.keys().map(String::as_str).collect::<Vec<_>>(),
        ["key-03", "key-07", "key-11"]
    );
    assert!(failed.values().all(|n| *n == 1), "failures: {failed:?}");
    assert_eq!(ledger.count("ran"), keys.len());
    assert_eq!(ledger.count("failed"), 3);
    assert_eq!(
        ledger.rejections(),
        [
            "rejected: key \"key-00\" was seen with a different payload (fingerprint mismatch)",
            "rejected: the message has no AMQP message_id property, and the key comes from it",
        ]
    );
    assert_eq!(ledger.count("duplicate"), published - keys.len() - 2);

    // Every delivery was acked or rejected: nothing is left in the work queue, and exactly the
    // two rejected messages are in the dead-letter queue.
    assert_eq!(message_count(&channel, &queue).await, 0);
    let mut dead = drain(&channel, &dlq).await;
    dead.sort();
    assert_eq!(
        dead,
        vec![
            (None, b"{\"order\":\"no-id\"}".to_vec()),
            (
                Some("key-00".to_owned()),
                b"{\"order\":\"key-00\",\"amount\":999}".to_vec()
            ),
        ]
    );
    // The stored result of a run is what its duplicates see.
    let record = gate
        .gate()
        .get("consumers-test", "key-05")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.result, Some(serde_json::json!("done:key-05")));

    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_key_is_rejected_with_the_reason() {
    let (conn, channel, queue, dlq) = setup().await;
    amqp::publish(&channel, &queue, None, b"{\"order\":\"o-1\"}").await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let delivery = consumer
        .next()
        .await
        .expect("a delivery")
        .expect("delivery");
    let handled = rabbitmq::handle(&gate, &delivery, |_msg| async {
        Err::<(), _>("the handler must not run for a message without a key")
    })
    .await
    .expect("settle");
    match &handled {
        Handled::Rejected(why @ Rejection::NoMessageId { field }) => {
            assert_eq!(*field, rabbitmq::MESSAGE_ID_FIELD);
            assert_eq!(
                why.to_string(),
                "the message has no AMQP message_id property, and the key comes from it"
            );
        }
        other => panic!("expected a rejection, got {other}"),
    }
    assert_eq!(handled.action(), Action::Reject);
    stop_with_queue_empty(&channel, &queue).await;
    assert_eq!(
        drain(&channel, &dlq).await.len(),
        1,
        "the message is dead-lettered"
    );
    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_mode_never_retries_a_failed_handler() {
    let (conn, channel, queue, dlq) = setup().await;
    let keys = keys(6);
    for _copy in 0..2 {
        for k in &keys {
            amqp::publish(&channel, &queue, Some(k), &payload(k)).await;
        }
    }
    let published = keys.len() * 2;

    let (gate, _dir) = common::gate(Mode::Idempotent);
    let ledger = Ledger::new(&["key-02"]);
    consume(&conn, &queue, &gate, &ledger, 2, published).await;

    eprintln!("outcomes: {:?}", ledger.summary());
    let succeeded = ledger.succeeded();
    for k in &keys {
        let want = if k == "key-02" { None } else { Some(&1) };
        assert_eq!(succeeded.get(k), want, "{k}: {succeeded:?}");
    }
    assert_eq!(ledger.failed().get("key-02"), Some(&1));
    // The failed first copy is dead-lettered; its duplicate never runs. With two deliveries in
    // hand, the duplicate may arrive while the first copy's dead letter is still unsettled (its
    // unsettled record not yet cleared): the unsettled rule then dead-letters it too (an extra
    // dead letter, never a loss), so key-02 is dead-lettered once or twice, never run again.
    assert_eq!(ledger.count("failed"), 1);
    assert_eq!(ledger.count("duplicate"), keys.len());
    assert_eq!(message_count(&channel, &queue).await, 0);
    let dead = drain(&channel, &dlq).await;
    assert!(
        (1..=2).contains(&dead.len()),
        "dead letters: {}",
        dead.len()
    );
    assert!(dead.iter().all(|d| d.0.as_deref() == Some("key-02")));
    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

/// Idempotent mode: a failed handler's reject that the broker never got (its channel closed
/// first) leaves the message marked; its redelivery must be dead-lettered, not acked as a
/// duplicate, or it would reach neither the handler nor the dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_reject_that_failed_is_dead_lettered_on_redelivery_not_acked() {
    let (conn, channel, queue, dlq) = setup().await;
    amqp::publish(&channel, &queue, Some("key-u"), &payload("key-u")).await;
    let (gate, _dir) = common::gate(Mode::Idempotent);

    // The first delivery, unacked on a channel of its own, which the failing handler closes:
    // its reject then fails and the broker puts the message back.
    let first = conn.create_channel().await.expect("channel");
    let got = first
        .basic_get(&queue, BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
        .expect("the message");
    let closing = first.clone();
    let settled = rabbitmq::handle(&gate, &got.delivery, |_msg| async move {
        closing.close(200, "lost before the reject").await.ok();
        Err::<(), _>("boom")
    })
    .await;
    assert!(settled.is_err(), "the reject must fail: {settled:?}");

    let again = conn.create_channel().await.expect("channel");
    let redelivered = again
        .basic_get(&queue, BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
        .expect("the message, put back");
    let handled = rabbitmq::handle(&gate, &redelivered.delivery, |_msg| async {
        Ok::<_, String>("must not run: the key is marked")
    })
    .await
    .expect("settle");
    assert!(matches!(handled, Handled::Duplicate { .. }), "{handled}");

    let dead = drain(&channel, &dlq).await;
    assert_eq!(dead.len(), 1, "the redelivery was acked, not dead-lettered");
    assert_eq!(dead[0].0.as_deref(), Some("key-u"));
    assert_eq!(message_count(&channel, &queue).await, 0);
    // Settled: a later copy is a plain duplicate again, acked.
    amqp::publish(&channel, &queue, Some("key-u"), &payload("key-u")).await;
    let copy = again
        .basic_get(&queue, BasicGetOptions { no_ack: false })
        .await
        .expect("basic.get")
        .expect("the copy");
    rabbitmq::handle(&gate, &copy.delivery, |_msg| async {
        Ok::<_, String>("must not run")
    })
    .await
    .expect("settle");
    assert!(
        drain(&channel, &dlq).await.is_empty(),
        "dead-lettered twice"
    );
    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_backs_off_and_is_dead_lettered_after_max_attempts() {
    let (conn, channel, queue, dlq) = setup_typed(true).await;
    amqp::publish(&channel, &queue, Some("poison-1"), &payload("poison-1")).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(4).expect("max_attempts");
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let calls = AtomicUsize::new(0);
    let seen = follow(&mut consumer, &gate, &calls, usize::MAX, false).await;
    eprintln!("deliveries: {seen:#?}");

    // The broker counted four deliveries (x-delivery-count 0..=3), the handler failed on each;
    // the first three were retried after 20, 40 and 60 (the cap) ms, the fourth rejected.
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let attempts: Vec<_> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [Some(1), Some(2), Some(3), Some(4)]);
    assert!(seen.iter().all(|s| s.label == "failed"), "{seen:#?}");
    common::assert_backed_off(&seen, gate.failure_policy());
    for (s, ms) in seen[..3].iter().zip([20, 40, 60]) {
        let delay = std::time::Duration::from_millis(ms);
        assert!(common::is_failure_retry_after(&s.action, delay), "{s:?}");
    }
    assert_eq!(seen[3].action, Action::Reject);
    assert!(
        seen[3].text.contains("delivery 4, max_attempts reached")
            && seen[3].text.contains("injected failure 4 of poison-1"),
        "{}",
        seen[3].text
    );

    // Nothing is left in the work queue; the message is in the dead-letter queue, rejected
    // once from the work queue; and its key is free again (released, not completed).
    stop_with_queue_empty(&channel, &queue).await;
    let dead = take(&channel, &dlq)
        .await
        .expect("the message is dead-lettered");
    assert_eq!(
        dead.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("poison-1")
    );
    let headers = dead
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let death = headers
        .inner()
        .get("x-death")
        .and_then(AMQPValue::as_array)
        .and_then(|deaths| deaths.as_slice().first().cloned())
        .unwrap_or_else(|| panic!("no x-death header: {headers:?}"));
    let death = death.as_field_table().expect("an x-death entry");
    assert_eq!(
        death.inner().get("reason"),
        Some(&AMQPValue::LongString("rejected".into())),
        "{death:?}"
    );
    assert_eq!(
        death.inner().get("queue"),
        Some(&AMQPValue::LongString(queue.as_str().into())),
        "{death:?}"
    );
    assert!(take(&channel, &dlq).await.is_none());
    assert_eq!(
        gate.gate().get("consumers-test", "poison-1").await.unwrap(),
        None
    );

    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_twice_then_succeeding_runs_to_completion_once() {
    let (conn, channel, queue, dlq) = setup_typed(true).await;
    amqp::publish(&channel, &queue, Some("flaky-1"), &payload("flaky-1")).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(4).expect("max_attempts");
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let calls = AtomicUsize::new(0);
    let seen = follow(&mut consumer, &gate, &calls, 2, false).await;
    eprintln!("deliveries: {seen:#?}");

    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let attempts: Vec<_> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [Some(1), Some(2), Some(3)]);
    let labels: Vec<_> = seen.iter().map(|s| s.label).collect();
    assert_eq!(labels, ["failed", "failed", "ran"]);
    common::assert_backed_off(&seen, gate.failure_policy());
    assert_eq!(seen[2].action, Action::Ack);

    stop_with_queue_empty(&channel, &queue).await;
    assert!(
        take(&channel, &dlq).await.is_none(),
        "nothing dead-lettered"
    );
    let record = gate
        .gate()
        .get("consumers-test", "flaky-1")
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.state, State::Completed);
    assert_eq!(record.result, Some(serde_json::json!("done:flaky-1")));
    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

/// A classic queue says only "redelivered": a redelivery's failure waits the initial delay, and
/// `max_attempts` cannot count it, so it never drops the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncounted_redelivery_waits_the_initial_delay_and_is_not_given_up() {
    let (conn, channel, queue, dlq) = setup_typed(false).await;
    amqp::publish(&channel, &queue, Some("classic-1"), &payload("classic-1")).await;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(2).expect("max_attempts");
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let calls = AtomicUsize::new(0);
    let seen = follow(&mut consumer, &gate, &calls, 3, false).await;
    eprintln!("deliveries: {seen:#?}");

    let attempts: Vec<_> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [Some(1), None, None, None]);
    let labels: Vec<_> = seen.iter().map(|s| s.label).collect();
    assert_eq!(labels, ["failed", "failed", "failed", "ran"]);
    common::assert_backed_off(&seen, gate.failure_policy());
    assert!(seen[..3]
        .iter()
        .all(|s| common::is_failure_retry_after(&s.action, common::FAILURE_RETRY_INITIAL)));

    stop_with_queue_empty(&channel, &queue).await;
    assert!(
        take(&channel, &dlq).await.is_none(),
        "nothing dead-lettered"
    );
    delete(&channel, &[&queue, &dlq]).await;
    conn.close(200, "done").await.expect("close");
}

/// A dead-letter retry loop (the work queue dead-letters into a wait queue whose expired
/// messages go back): each return carries `x-death` with the work queue's `rejected` count,
/// from which the delivery is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_are_counted_from_x_death_in_a_dead_letter_retry_loop() {
    let conn = amqp::connect().await;
    let channel = amqp::confirming_channel(&conn).await;
    let (queue, wait) = (
        unique("dedupgate-consumers"),
        unique("dedupgate-consumers-wait"),
    );
    let route_to = |target: &str, extra: Option<(&str, AMQPValue)>| {
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(target.into()),
        );
        if let Some((k, v)) = extra {
            args.insert(k.into(), v);
        }
        args
    };
    channel
        .queue_declare(
            &queue,
            QueueDeclareOptions::default(),
            route_to(&wait, None),
        )
        .await
        .expect("declare work queue");
    channel
        .queue_declare(
            &wait,
            QueueDeclareOptions::default(),
            route_to(&queue, Some(("x-message-ttl", AMQPValue::LongInt(10)))),
        )
        .await
        .expect("declare wait queue");
    amqp::publish(&channel, &queue, Some("looped-1"), &payload("looped-1")).await;

    // max_attempts 1: every failure rejects, and the loop brings the message back.
    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(1).expect("max_attempts");
    let mut consumer = amqp::consumer(&channel, &queue, "c").await;
    let calls = AtomicUsize::new(0);
    let seen = follow(&mut consumer, &gate, &calls, 2, true).await;
    eprintln!("deliveries: {seen:#?}");

    let attempts: Vec<_> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [Some(1), Some(2), Some(3)]);
    let actions: Vec<_> = seen.iter().map(|s| s.action).collect();
    assert_eq!(actions, [Action::Reject, Action::Reject, Action::Ack]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    stop_with_queue_empty(&channel, &queue).await;
    assert_eq!(message_count(&channel, &wait).await, 0);
    delete(&channel, &[&queue, &wait]).await;
    conn.close(200, "done").await.expect("close");
}
