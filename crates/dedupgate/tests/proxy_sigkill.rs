//! `dedupgate proxy` killed with SIGKILL while requests are in flight, then restarted on the same
//! durable store: no request whose response was stored is ever executed again.

mod proxy_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proxy_support::{free_port, post_order as post, sample_api, start_proxy, Reply, Scratch};

/// Each burst request's key and what came back (None: cut off).
type Answers = Vec<(String, Option<Reply>)>;

#[test]
fn sigkill_mid_request_never_reruns_a_completed_request() {
    let (_rt, api) = sample_api();
    let dir = Scratch::new("proxy-sigkill");
    // The embedded store by default; DEDUPGATE_TEST_PROXY_STORE may name another durable one.
    let store = std::env::var("DEDUPGATE_TEST_PROXY_STORE")
        .unwrap_or_else(|_| format!("embedded:{}", dir.0.join("data").display()));
    // Unique per run, so a shared store (Redis, PostgreSQL) holds no answers from earlier runs.
    let namespace = dir.0.file_name().unwrap().to_string_lossy().into_owned();
    let log = dir.0.join("proxy.log");
    let port = free_port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let url = api.url();
    // A long lease: a request cut off by the kill stays held (409) rather than running again.
    let args = [
        "--upstream",
        url.as_str(),
        "--store",
        store.as_str(),
        "--namespace",
        namespace.as_str(),
        "--lease",
        "60s",
    ];

    let mut proxy = start_proxy(port, &args, &log);
    for i in 0..20 {
        let r = post(addr, "/v1/charges", &format!("done-{i}")).expect("an answer");
        assert_eq!(r.status, 201);
    }

    // In flight at the kill: one slow request and a steady burst of quick ones.
    let slow = std::thread::spawn(move || post(addr, "/v1/charges?delay_ms=4000", "inflight"));
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<Answers>> = Arc::default();
    let burst: Vec<_> = (0..6)
        .map(|t| {
            let (stop, answers) = (stop.clone(), answers.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let key = format!("burst-{t}-{n}");
                    let r = post(addr, "/v1/charges?delay_ms=5", &key);
                    let dead = r.is_none();
                    answers.lock().unwrap().push((key, r));
                    if dead {
                        break;
                    }
                    n += 1;
                }
            })
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(20);
    while api.counts.of("inflight") == 0 || answers.lock().unwrap().len() < 60 {
        assert!(Instant::now() < end, "the requests did not get going");
        std::thread::sleep(Duration::from_millis(5));
    }
    proxy.0.kill().expect("SIGKILL"); // std's kill() is SIGKILL on Unix
    proxy.0.wait().unwrap();
    stop.store(true, Ordering::SeqCst);
    for b in burst {
        b.join().unwrap();
    }
    assert!(
        slow.join().unwrap().is_none(),
        "the slow request was cut off by the kill"
    );
    let executed_before = api.counts.total();

    let _proxy = start_proxy(port, &args, &log);
    for i in 0..20 {
        let key = format!("done-{i}");
        let r = post(addr, "/v1/charges", &key).expect("an answer");
        assert!(r.replayed(), "{key} replayed after the restart");
        assert_eq!(api.counts.of(&key), 1, "{key} ran once");
    }
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    let (mut answered, mut cut, mut never_ran) = (0, 0, 0);
    for (key, first) in &answers {
        let ran_before = api.counts.of(key);
        let retry = post(addr, "/v1/charges?delay_ms=5", key).expect("an answer");
        match first {
            Some(first) => {
                answered += 1;
                assert_eq!(first.status, 201, "{key}: {first:?}");
                assert!(
                    retry.replayed(),
                    "{key} was answered before the kill, so it is replayed"
                );
                assert_eq!(retry.body, first.body, "{key}: same bytes");
            }
            None if retry.status == 201 && !retry.replayed() => {
                // Killed before it was even claimed: it never ran, so now it runs, once.
                never_ran += 1;
                assert_eq!(ran_before, 0, "{key} had run, yet ran again");
            }
            None => {
                cut += 1;
                // Cut off by the kill after its claim: either its response was stored (replay)
                // or the dead proxy's lease still holds it (409). Never a second execution.
                assert!(retry.replayed() || retry.status == 409, "{key}: {retry:?}");
            }
        }
        assert!(
            api.counts.of(key) <= 1,
            "{key} ran {} times",
            api.counts.of(key)
        );
    }
    let slow_retry = post(addr, "/v1/charges?delay_ms=4000", "inflight").expect("an answer");
    assert_eq!(
        slow_retry.status, 409,
        "the cut-off request is still held: {slow_retry:?}"
    );
    assert_eq!(api.counts.of("inflight"), 1);
    assert_eq!(
        api.counts.total(),
        executed_before + never_ran,
        "after the restart only requests that had never run executed"
    );
    eprintln!(
        "sigkill on {store}: 20 completed before; burst: {answered} answered, {cut} cut off after the \
         claim, {never_ran} cut off before it; {} upstream executions, none repeated",
        api.counts.total()
    );
}
