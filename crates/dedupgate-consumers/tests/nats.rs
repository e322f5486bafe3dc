//! Against the machine's NATS JetStream (`DEDUPGATE_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`): a durable pull consumer read by two concurrent tasks sharing one
//! embedded store runs the handler once per key, whether duplicates come as republished
//! `Nats-Msg-Id`s, as copies keyed by a template over the payload, or as redeliveries after a
//! failed handler; a failing handler is naked with growing delays counted from JetStream's
//! `delivered` and termed after `max_attempts` with its claim released; a message without a
//! usable key is termed with the reason. Each test uses its own stream and deletes it.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, stream};
use common::{keys, unique, Ledger, Seen};
use dedupgate_consumers::{nats, Action, ConsumerGate};
use dedupgate_core::keys::KeyTemplate;
use dedupgate_core::{Mode, State};
use futures::StreamExt;

/// JetStream drops a republished `Nats-Msg-Id` within the stream's duplicate window; the tests
/// keep it short and publish each round of copies after it, as copies arrive in production
/// after the default 2-minute window.
const DUPLICATE_WINDOW: Duration = Duration::from_millis(100);

struct Fixture {
    js: jetstream::Context,
    stream: String,
    subject: String,
    consumer: jetstream::consumer::PullConsumer,
}

async fn fixture() -> Fixture {
    let url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await.unwrap_or_else(|e| {
        panic!("these tests need NATS with JetStream at {url} (DEDUPGATE_TEST_NATS_URL): {e}")
    });
    let js = jetstream::new(client);
    let name = unique("dedupgate-consumers");
    let subject = format!("dedupgate.test.{name}");
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: DUPLICATE_WINDOW,
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("create stream");
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("workers".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .expect("create consumer");
    Fixture {
        js,
        stream: name,
        subject,
        consumer,
    }
}

impl Fixture {
    /// Publishes and waits for the stream's ack; true when JetStream stored it (not dropped as
    /// a duplicate within its window).
    async fn publish(&self, message_id: Option<&str>, payload: &[u8]) -> bool {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = message_id {
            headers.insert(nats::MESSAGE_ID_HEADER, id);
        }
        let ack = self
            .js
            .publish_with_headers(self.subject.clone(), headers, payload.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("stream ack");
        !ack.duplicate
    }

    /// Runs `tasks` concurrent readers of the one durable consumer until `expected` messages
    /// were settled for good (acked or termed).
    async fn consume(
        &self,
        gate: &ConsumerGate,
        ledger: &Arc<Ledger>,
        tasks: usize,
        expected: usize,
    ) {
        let mut readers = Vec::new();
        for _ in 0..tasks {
            readers.push(self.consumer.messages().await.expect("messages"));
        }
        common::consume(
            readers,
            gate,
            ledger,
            expected,
            |gate, ledger, message| async move {
                let message = message.expect("message");
                nats::handle(&gate, &message, |msg| ledger.handle(msg))
                    .await
                    .expect("settle")
            },
        )
        .await;
    }

    /// Follows the one message of the stream through every delivery until it is settled for
    /// good (acked or termed), running the `fail_first(calls, failures)` handler.
    async fn follow(&self, gate: &ConsumerGate, calls: &AtomicUsize, failures: usize) -> Vec<Seen> {
        let mut messages = self.consumer.messages().await.expect("messages");
        let mut seen = Vec::new();
        loop {
            assert!(seen.len() < 10, "the message never settled: {seen:#?}");
            let next = tokio::time::timeout(common::SETTLE_TIMEOUT, messages.next()).await;
            let message = next
                .unwrap_or_else(|_| panic!("no delivery within the timeout after {seen:#?}"))
                .expect("the consumer ended")
                .expect("message");
            let at = Instant::now();
            let attempt = nats::attempt(&message).number;
            let handled = nats::handle(gate, &message, |msg| {
                common::fail_first(calls, failures, msg)
            })
            .await
            .expect("settle");
            let done = !matches!(handled.action(), Action::Retry { .. });
            seen.push(Seen::new(attempt, at, &handled));
            if done {
                return seen;
            }
        }
    }

    /// Nothing left to deliver and nothing delivered but unsettled.
    async fn assert_all_settled(&self, published: usize) {
        let info = self.consumer.get_info().await.expect("consumer info");
        assert_eq!(info.num_pending, 0, "undelivered messages: {info:?}");
        assert_eq!(info.num_ack_pending, 0, "unacked messages: {info:?}");
        assert_eq!(info.delivered.stream_sequence, published as u64);
    }

    async fn delete(self) {
        self.js
            .delete_stream(&self.stream)
            .await
            .expect("delete stream");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republished_ids_and_redeliveries_run_once_across_two_consumers() {
    let fx = fixture().await;
    let keys = keys(20);
    let payload = |k: &str| format!("{{\"order\":\"{k}\",\"amount\":100}}").into_bytes();
    // Three rounds of every key, each after JetStream's duplicate window, so every copy is
    // stored and delivered: the gate is what drops them.
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(DUPLICATE_WINDOW * 3).await;
        }
        for k in &keys {
            assert!(
                fx.publish(Some(k), &payload(k)).await,
                "JetStream dropped {k} (round {round})"
            );
        }
    }
    assert!(fx.publish(None, b"{\"order\":\"no-id\"}").await);
    let published = keys.len() * 3 + 1;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let ledger = Ledger::new(&["key-04", "key-09"]);
    fx.consume(&gate, &ledger, 2, published).await;

    eprintln!("outcomes: {:?}", ledger.summary());
    let succeeded = ledger.succeeded();
    for k in &keys {
        assert_eq!(
            succeeded.get(k),
            Some(&1),
            "{k}: {:?}",
            ledger.outcomes.lock().unwrap()
        );
    }
    assert_eq!(succeeded.len(), keys.len());
    let failed = ledger.failed();
    assert_eq!(
        failed.keys().map(String::as_str).collect::<Vec<_>>(),
        ["key-04", "key-09"]
    );
    assert!(failed.values().all(|n| *n == 1), "failures: {failed:?}");
    assert_eq!(ledger.count("ran"), keys.len());
    assert_eq!(ledger.count("duplicate"), keys.len() * 2);
    assert_eq!(
        ledger.rejections(),
        ["rejected: the message has no Nats-Msg-Id, and the key comes from it"]
    );
    fx.assert_all_settled(published).await;
    fx.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_keys_dedup_copies_and_unkeyable_payloads_are_termed() {
    let fx = fixture().await;
    let keys = keys(12);
    let payload = |k: &str| format!("{{\"order\":\"{k}\",\"amount\":100}}").into_bytes();
    // No Nats-Msg-Id: JetStream stores every copy; the key is the payload's `order` field.
    // The copies go back to back, so the two readers often hold the same key at once.
    for k in &keys {
        for _copy in 0..3 {
            assert!(fx.publish(None, &payload(k)).await);
        }
    }
    assert!(fx.publish(None, b"{\"amount\":5}").await);
    assert!(fx.publish(None, b"not json").await);
    let published = keys.len() * 3 + 2;

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.key_template(KeyTemplate::parse("order_{order}").expect("template"));
    let ledger = Ledger::new(&["order_key-01"]);
    fx.consume(&gate, &ledger, 2, published).await;

    eprintln!("outcomes: {:?}", ledger.summary());
    let succeeded = ledger.succeeded();
    for k in &keys {
        assert_eq!(
            succeeded.get(&format!("order_{k}")),
            Some(&1),
            "{k}: {succeeded:?}"
        );
    }
    assert_eq!(succeeded.len(), keys.len());
    assert_eq!(ledger.failed().get("order_key-01"), Some(&1));
    assert_eq!(ledger.count("duplicate"), keys.len() * 2);
    let rejections = ledger.rejections();
    assert_eq!(rejections.len(), 2, "{rejections:?}");
    assert_eq!(
        rejections[0],
        "rejected: key template \"order_{order}\": missing field `order`"
    );
    assert!(
        rejections[1].starts_with(
            "rejected: the payload is not JSON, so key template \"order_{order}\" cannot be rendered"
        ),
        "{rejections:?}"
    );
    fx.assert_all_settled(published).await;
    fx.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_backs_off_and_is_termed_after_max_attempts() {
    let fx = fixture().await;
    // JetStream announces every term on this subject, with the deliveries it counted.
    let mut terminated = fx
        .js
        .client()
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.workers",
            fx.stream
        ))
        .await
        .expect("subscribe to term advisories");
    assert!(
        fx.publish(Some("poison-1"), b"{\"order\":\"poison-1\"}")
            .await
    );

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(4).expect("max_attempts");
    let calls = AtomicUsize::new(0);
    let seen = fx.follow(&gate, &calls, usize::MAX).await;
    eprintln!("deliveries: {seen:#?}");

    // JetStream delivered it four times (`delivered` 1..=4), naked after 20, 40 and 60 (the
    // cap) ms, then termed.
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
        seen[3].text.contains("delivery 4, max_attempts reached"),
        "{}",
        seen[3].text
    );

    let advisory = tokio::time::timeout(common::SETTLE_TIMEOUT, terminated.next())
        .await
        .expect("a term advisory within the timeout")
        .expect("subscription open");
    let advisory: serde_json::Value =
        serde_json::from_slice(&advisory.payload).expect("advisory JSON");
    assert_eq!(advisory["stream_seq"], 1, "{advisory}");
    assert_eq!(advisory["deliveries"], 4, "{advisory}");
    fx.assert_all_settled(1).await;
    assert_eq!(
        gate.gate().get("consumers-test", "poison-1").await.unwrap(),
        None
    );
    fx.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_twice_then_succeeding_runs_to_completion_once() {
    let fx = fixture().await;
    assert!(
        fx.publish(Some("flaky-1"), b"{\"order\":\"flaky-1\"}")
            .await
    );

    let (gate, _dir) = common::gate(Mode::Retriable);
    let gate = gate.max_attempts(4).expect("max_attempts");
    let calls = AtomicUsize::new(0);
    let seen = fx.follow(&gate, &calls, 2).await;
    eprintln!("deliveries: {seen:#?}");

    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let attempts: Vec<_> = seen.iter().map(|s| s.attempt).collect();
    assert_eq!(attempts, [Some(1), Some(2), Some(3)]);
    let labels: Vec<_> = seen.iter().map(|s| s.label).collect();
    assert_eq!(labels, ["failed", "failed", "ran"]);
    common::assert_backed_off(&seen, gate.failure_policy());
    assert_eq!(seen[2].action, Action::Ack);
    fx.assert_all_settled(1).await;
    let record = gate
        .gate()
        .get("consumers-test", "flaky-1")
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.state, State::Completed);
    assert_eq!(record.result, Some(serde_json::json!("done:flaky-1")));
    fx.delete().await;
}

/// Found by review: nothing told JetStream that a message was still being handled, so a
/// handler that ran longer than the consumer's ack wait got its message delivered again
/// meanwhile (found held, naked, and counted against `max_deliver`). The in-progress acks
/// restart the ack wait: here a 1 s ack wait and a 3 s handler, with one delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_longer_than_the_ack_wait_is_not_delivered_again() {
    let fx = fixture().await;
    let consumer: jetstream::consumer::PullConsumer = fx
        .js
        .get_stream(&fx.stream)
        .await
        .expect("stream")
        .create_consumer(pull::Config {
            durable_name: Some("slow".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("create consumer");
    assert!(fx.publish(Some("slow-1"), b"{}").await);
    let (gate, _dir) = common::gate(Mode::Retriable);
    let mut messages = consumer.messages().await.expect("messages");
    let message = tokio::time::timeout(common::SETTLE_TIMEOUT, messages.next())
        .await
        .expect("a delivery")
        .expect("the consumer ended")
        .expect("message");
    let handled =
        nats::handle_with_progress(&gate, &message, Duration::from_millis(300), |_msg| async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok::<_, String>("done")
        })
        .await
        .expect("settle");
    assert_eq!(handled.action(), Action::Ack, "{handled}");
    let info = consumer.get_info().await.expect("consumer info");
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    assert_eq!(info.delivered.consumer_sequence, 1, "{info:?}");
    fx.delete().await;
}

/// Idempotent mode: a failed handler's term that never reached the server (the client closed
/// first) leaves the message marked; its redelivery after the ack wait must be termed, not acked
/// as a duplicate, or it would go without a trace (no term advisory, no handler run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_term_that_failed_is_termed_on_redelivery_not_acked() {
    let fx = fixture().await;
    let url =
        std::env::var("DEDUPGATE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let consumer: jetstream::consumer::PullConsumer = fx
        .js
        .get_stream(&fx.stream)
        .await
        .expect("stream")
        .create_consumer(pull::Config {
            durable_name: Some("lossy".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("create consumer");
    let watcher = async_nats::connect(&url).await.expect("connect");
    let mut terminated = watcher
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.lossy",
            fx.stream
        ))
        .await
        .expect("subscribe to term advisories");
    watcher.flush().await.expect("flush");
    assert!(fx.publish(Some("term-1"), b"{}").await);
    let (gate, _dir) = common::gate(Mode::Idempotent);

    // The first delivery, on a client the failing handler closes: its term cannot be sent.
    let closed = Arc::new(tokio::sync::Notify::new());
    let on_close = closed.clone();
    let lossy = async_nats::ConnectOptions::new()
        .event_callback(move |event| {
            let on_close = on_close.clone();
            async move {
                if matches!(event, async_nats::Event::Closed) {
                    on_close.notify_one();
                }
            }
        })
        .connect(&url)
        .await
        .expect("connect");
    let first: jetstream::consumer::PullConsumer = jetstream::new(lossy.clone())
        .get_stream(&fx.stream)
        .await
        .expect("stream")
        .get_consumer("lossy")
        .await
        .expect("consumer");
    let mut batch = first
        .fetch()
        .max_messages(1)
        .messages()
        .await
        .expect("fetch");
    let message = tokio::time::timeout(common::SETTLE_TIMEOUT, batch.next())
        .await
        .expect("a delivery")
        .expect("the batch ended")
        .expect("message");
    let settled = nats::handle(&gate, &message, |_msg| async move {
        lossy.drain().await.expect("drain");
        closed.notified().await;
        Err::<(), _>("boom")
    })
    .await;
    assert!(settled.is_err(), "the term must fail: {settled:?}");

    // Redelivered after the ack wait, to a working client.
    let mut messages = consumer.messages().await.expect("messages");
    let again = tokio::time::timeout(common::SETTLE_TIMEOUT, messages.next())
        .await
        .expect("a redelivery")
        .expect("the consumer ended")
        .expect("message");
    let handled = nats::handle(&gate, &again, |_msg| async {
        Ok::<_, String>("must not run: the key is marked")
    })
    .await
    .expect("settle");
    assert!(
        matches!(handled, dedupgate_consumers::Handled::Duplicate { .. }),
        "{handled}"
    );
    let advisory = tokio::time::timeout(Duration::from_secs(10), terminated.next()).await;
    assert!(
        matches!(advisory, Ok(Some(_))),
        "the redelivery was acked, not termed"
    );
    let info = consumer.get_info().await.expect("consumer info");
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    fx.delete().await;
}
