//! The client's `HttpStore` against the conformance suite: a dedupgate server (in this process,
//! over a memory store on a clock the suite moves by hand) seen as one more `Store`, the way
//! `--store http://…` and the torture harness use it, with and without the client's retries.

use std::sync::Arc;

use dedupgate_client::{HttpStore, HttpStoreOptions};
use dedupgate_core::testkit::{run_all, ClockedHarness};
use dedupgate_core::{ManualClock, MemoryStore};
use dedupgate_server::{AppState, ServerConfig};
use tokio::sync::oneshot;

/// Serves a memory store on a free port; the server stops when the returned sender drops.
async fn server_over_memory(clock: &ManualClock) -> (String, oneshot::Sender<()>) {
    let memory = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = AppState::new(memory, ServerConfig::default());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(dedupgate_server::serve(listener, state, async move {
        let _ = stopped.await;
    }));
    (url, stop)
}

async fn passes(options: HttpStoreOptions) {
    let clock = ManualClock::new(1_764_000_000_000);
    let (url, _stop) = server_over_memory(&clock).await;
    let store = Arc::new(HttpStore::new(&url, options).unwrap());
    run_all(&ClockedHarness { clock, store }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_store_without_retries_passes_the_conformance_suite() {
    passes(HttpStoreOptions::without_retries()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_store_with_the_clis_retries_passes_the_conformance_suite() {
    passes(HttpStoreOptions::default()).await;
}

/// Every op kind in one `apply_batch`, each answer decoded as `apply` decodes it: the suite's
/// batches hold claims and marks only.
async fn every_op_in_one_batch(options: HttpStoreOptions, with_release: bool) {
    use dedupgate_core::{Claim, ClaimOptions, CompleteOptions, GateError, Mark, MarkOptions};
    use dedupgate_core::{Outcome, RecordId, State, Store, Token, ValidOp};

    let clock = ManualClock::new(1_764_000_000_000);
    let (url, _stop) = server_over_memory(&clock).await;
    let store = HttpStore::new(&url, options).unwrap();
    let id = |k: &str| RecordId::new("batch", k).unwrap();
    let claim = || ValidOp::claim(ClaimOptions::default(), Default::default()).unwrap();
    let mut tokens = Vec::new();
    for k in ["a", "b", "c"] {
        match store.apply(id(k), claim()).await.unwrap() {
            Outcome::Claimed(Claim::New(lease)) => tokens.push(lease.token),
            other => panic!("{k}: {other:?}"),
        }
    }
    let complete = CompleteOptions {
        result: Some(serde_json::json!({"x": 1})),
        ..Default::default()
    };
    let mark = || ValidOp::mark(MarkOptions::default(), Default::default()).unwrap();
    let mut ops = vec![
        (
            id("a"),
            ValidOp::complete(tokens[0].clone(), complete).unwrap(),
        ),
        (id("b"), ValidOp::extend(tokens[1].clone(), 5_000).unwrap()),
        (id("d"), mark()),
        (id("d"), mark()),
        (id("a"), ValidOp::get()),
        (id("zz"), ValidOp::get()),
        (id("e"), claim()),
        (id("e"), claim()),
        (
            id("b"),
            ValidOp::complete(Token::new("not-the-token"), Default::default()).unwrap(),
        ),
        (id("a"), ValidOp::forget()),
        (id("a"), ValidOp::forget()),
    ];
    if with_release {
        ops.push((id("c"), ValidOp::release(tokens[2].clone()).unwrap()));
    }
    let answers = store.apply_batch(ops).await;
    let mut answers = answers.into_iter();
    let mut next = || answers.next().expect("one answer per op");
    match next() {
        Ok(Outcome::Completed(r)) => {
            assert_eq!(r.state, State::Completed);
            assert_eq!(r.result, Some(serde_json::json!({"x": 1})));
        }
        other => panic!("complete: {other:?}"),
    }
    assert!(
        matches!(next(), Ok(Outcome::Extended { lease_expires_at_ms }) if lease_expires_at_ms == 1_764_000_000_000 + 5_000)
    );
    assert!(matches!(next(), Ok(Outcome::Marked(Mark::New { .. }))));
    assert!(matches!(
        next(),
        Ok(Outcome::Marked(Mark::Duplicate { .. }))
    ));
    assert!(matches!(next(), Ok(Outcome::Found(Some(r))) if r.state == State::Completed));
    assert!(matches!(next(), Ok(Outcome::Found(None))));
    assert!(matches!(next(), Ok(Outcome::Claimed(Claim::New(_)))));
    assert!(matches!(
        next(),
        Ok(Outcome::Claimed(Claim::Duplicate { .. }))
    ));
    assert!(matches!(next(), Err(GateError::LeaseLost)));
    assert!(matches!(next(), Ok(Outcome::Forgotten(true))));
    assert!(matches!(next(), Ok(Outcome::Forgotten(false))));
    if with_release {
        assert!(matches!(next(), Ok(Outcome::Released)));
        assert!(matches!(
            store.apply(id("c"), claim()).await,
            Ok(Outcome::Claimed(Claim::New(_)))
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_every_op_is_answered_as_each_op_alone() {
    every_op_in_one_batch(HttpStoreOptions::without_retries(), true).await;
    every_op_in_one_batch(HttpStoreOptions::default(), false).await;
    // With retries too, a release whose key no other op touches goes in the batch.
    every_op_in_one_batch(HttpStoreOptions::default(), true).await;
}

/// A proxy to `upstream` that lets the server answer the first request it carries and then
/// drops the connection, so that answer is lost; later connections pass as they are.
async fn losing_the_first_answer(upstream: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut inbound, _)) = listener.accept().await {
            let mut outbound = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            if !std::mem::take(&mut first) {
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
                continue;
            }
            let (mut from_client, _to_client) = inbound.into_split();
            let (mut from_server, mut to_server) = outbound.into_split();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = from_client.read(&mut buf).await {
                    if n == 0 || to_server.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            // The server answered, so it decided; the answer goes nowhere.
            let mut answer = [0u8; 1];
            let _ = from_server.read(&mut answer).await;
        }
    });
    url
}

/// A release whose batch answer was lost: the batch is sent again, its release then answers
/// lease_lost (the token released already), and the store looks the key up as the typed
/// release does, so the caller learns the release was done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_in_a_batch_whose_answer_was_lost_is_reported_done() {
    use dedupgate_core::{Claim, ClaimOptions, Outcome, RecordId, Store, ValidOp};

    let clock = ManualClock::new(1_764_000_000_000);
    let (url, _stop) = server_over_memory(&clock).await;
    let direct = HttpStore::new(&url, HttpStoreOptions::without_retries()).unwrap();
    let id = || RecordId::new("lost", "k").unwrap();
    let claim = || ValidOp::claim(ClaimOptions::default(), Default::default()).unwrap();
    let token = match direct.apply(id(), claim()).await.unwrap() {
        Outcome::Claimed(Claim::New(lease)) => lease.token,
        other => panic!("{other:?}"),
    };
    let proxied = losing_the_first_answer(url.trim_start_matches("http://").to_owned()).await;
    let store = HttpStore::new(&proxied, HttpStoreOptions::default()).unwrap();
    let answers = store
        .apply_batch(vec![(id(), ValidOp::release(token).unwrap())])
        .await;
    assert!(
        matches!(answers.as_slice(), [Ok(Outcome::Released)]),
        "{answers:?}"
    );
    assert!(matches!(
        direct.apply(id(), claim()).await,
        Ok(Outcome::Claimed(Claim::New(_)))
    ));
}
