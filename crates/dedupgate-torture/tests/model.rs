//! Model-based tests: random sequences of operations (with the store's clock moved by hand
//! between them) run against a store, and every answer is compared with
//! [`dedupgate_core::decide`] replayed on the same instants, tokens compared by the claim that
//! issued them. The comparison is the linearizability checker given exact instants: with one
//! client and `[t, t]` windows it is a step-by-step equality check.
//!
//! Stores: the memory store (the reference itself: this checks the model plumbing), the
//! embedded store on a `ManualClock`. Seeds are printed; replay with `DEDUPGATE_TORTURE_SEED`.

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;

use dedupgate_core::{Claim, ManualClock, MemoryStore, RecordId, Store};
use dedupgate_torture::{check_key, Event, HAnswer, HOp, LinConfig, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

const T0_MS: u64 = 1_800_000_000_000;

/// One step: an operation on key 0 or 1, or time passing.
#[derive(Clone, Debug)]
enum Step {
    Advance(u64),
    Op { key: u8, op: Gen },
}

/// An operation with its token chosen by role: the n-th token issued so far, or a made-up one.
#[derive(Clone, Debug)]
enum Gen {
    Claim {
        ttl_ms: u64,
        lease_ms: u64,
        fp: Option<u8>,
        owner: Option<u8>,
    },
    Complete {
        token: Option<usize>,
        ttl_ms: Option<u64>,
        result: Option<u8>,
    },
    Release {
        token: Option<usize>,
    },
    Extend {
        token: Option<usize>,
        lease_ms: u64,
    },
    Mark {
        ttl_ms: u64,
        fp: Option<u8>,
        result: Option<u8>,
    },
    Get,
    Forget,
}

fn gen_op() -> impl Strategy<Value = Gen> {
    let token = proptest::option::weighted(0.9, 0usize..6);
    prop_oneof![
        4 => (1u64..60, 1u64..25, proptest::option::of(0u8..2), proptest::option::of(0u8..2))
            .prop_map(|(ttl_ms, lease_ms, fp, owner)| Gen::Claim { ttl_ms, lease_ms, fp, owner }),
        3 => (token.clone(), proptest::option::of(1u64..60), proptest::option::of(0u8..3))
            .prop_map(|(token, ttl_ms, result)| Gen::Complete { token, ttl_ms, result }),
        2 => token.clone().prop_map(|token| Gen::Release { token }),
        2 => (token, 1u64..25).prop_map(|(token, lease_ms)| Gen::Extend { token, lease_ms }),
        2 => (1u64..60, proptest::option::of(0u8..2), proptest::option::of(0u8..3))
            .prop_map(|(ttl_ms, fp, result)| Gen::Mark { ttl_ms, fp, result }),
        2 => Just(Gen::Get),
        1 => Just(Gen::Forget),
    ]
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        2 => (0u64..30).prop_map(Step::Advance),
        5 => (0u8..2, gen_op()).prop_map(|(key, op)| Step::Op { key, op }),
    ];
    proptest::collection::vec(step, 1..40)
}

fn to_hop(op: &Gen, tokens: &[String]) -> HOp {
    let tok = |t: &Option<usize>| match t {
        Some(i) if !tokens.is_empty() => tokens[i % tokens.len()].clone(),
        _ => "made-up".to_owned(),
    };
    let tag = |p: &str, v: &Option<u8>| v.map(|v| format!("{p}{v}"));
    match op {
        Gen::Claim {
            ttl_ms,
            lease_ms,
            fp,
            owner,
        } => HOp::Claim {
            ttl_ms: *ttl_ms,
            lease_ms: *lease_ms,
            fingerprint: tag("fp", fp),
            owner: tag("owner", owner),
        },
        Gen::Complete {
            token,
            ttl_ms,
            result,
        } => HOp::Complete {
            token: tok(token),
            result: result.map(|r| serde_json::json!({ "r": r })),
            ttl_ms: *ttl_ms,
        },
        Gen::Release { token } => HOp::Release { token: tok(token) },
        Gen::Extend { token, lease_ms } => HOp::Extend {
            token: tok(token),
            lease_ms: *lease_ms,
        },
        Gen::Mark { ttl_ms, fp, result } => HOp::Mark {
            ttl_ms: *ttl_ms,
            fingerprint: tag("fp", fp),
            result: result.map(|r| serde_json::json!(r)),
        },
        Gen::Get => HOp::Get,
        Gen::Forget => HOp::Forget,
    }
}

/// Runs `steps` on `store` (whose clock is `clock`) from `start_ms` and checks every key
/// against the model.
fn run_and_check(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn Store>,
    clock: &ManualClock,
    ns: &str,
    steps: &[Step],
    start_ms: u64,
) -> Result<(), TestCaseError> {
    let mut now = start_ms;
    clock.set(now);
    let mut tokens: Vec<Vec<String>> = vec![vec![], vec![]];
    let mut events: Vec<Vec<Event>> = vec![vec![], vec![]];
    for s in steps {
        match s {
            Step::Advance(ms) => {
                now += ms;
                clock.set(now);
            }
            Step::Op { key, op } => {
                let k = *key as usize;
                let hop = to_hop(op, &tokens[k]);
                let id = RecordId::new(ns, format!("k{k}")).unwrap();
                let result = rt.block_on(store.apply_op(id, hop.to_wire_op()));
                let answer = HAnswer::from_result(&result);
                prop_assert!(!answer.is_unknown(), "store error {result:?}");
                if let HAnswer::Claimed {
                    claim: Claim::New(l),
                } = &answer
                {
                    tokens[k].push(l.token.as_str().to_owned());
                }
                events[k].push(Event {
                    client: "c".into(),
                    namespace: ns.into(),
                    key: format!("k{k}"),
                    op: hop,
                    call_ns: now * 1_000_000,
                    return_ns: Some(now * 1_000_000),
                    answer,
                });
            }
        }
    }
    for evs in &events {
        let v = check_key(evs, &LinConfig::default());
        prop_assert!(
            matches!(v, Verdict::Linearizable { .. }),
            "the store and the model disagree: {v:?}"
        );
    }
    Ok(())
}

fn runner(what: &str, cases: u32) -> TestRunner {
    let seed = dedupgate_torture::seed(what);
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let cases = std::env::var("DEDUPGATE_MODEL_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(cases);
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}

#[test]
fn memory_store_equals_the_model() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut runner = runner("model memory", 256);
    let n = std::cell::Cell::new(0u64);
    runner
        .run(&steps(), |steps| {
            n.set(n.get() + 1);
            let clock = ManualClock::new(T0_MS);
            let store: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
            run_and_check(&rt, &store, &clock, &format!("m{}", n.get()), &steps, T0_MS)
        })
        .unwrap();
}

#[test]
fn embedded_store_equals_the_model() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0_MS);
    let store: Arc<dyn Store> = {
        let _guard = rt.enter();
        Arc::new(
            dedupgate_embedded::EmbeddedStore::open(
                dir.path().join("data"),
                dedupgate_embedded::EmbeddedOptions {
                    clock: Some(Arc::new(clock.clone())),
                    ..Default::default()
                },
            )
            .expect("embedded store opens"),
        )
    };
    let mut runner = runner("model embedded", 48);
    let n = std::cell::Cell::new(0u64);
    // One store for every case: each case works in a namespace of its own, and time only moves
    // forward across cases (the embedded store's clock never goes back).
    let base = std::cell::Cell::new(T0_MS);
    runner
        .run(&steps(), |steps| {
            n.set(n.get() + 1);
            let start = base.get() + 1_000_000;
            base.set(start);
            run_and_check(&rt, &store, &clock, &format!("e{}", n.get()), &steps, start)
        })
        .unwrap();
}

/// The comparison has teeth: a store whose clock is stuck (it never sees the time the test
/// moves) must be caught.
#[test]
fn a_store_on_a_stuck_clock_is_caught() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut runner = runner("model stuck clock", 256);
    let n = std::cell::Cell::new(0u64);
    let result = runner.run(&steps(), |steps| {
        n.set(n.get() + 1);
        let moved = ManualClock::new(T0_MS);
        let stuck = ManualClock::new(T0_MS);
        let store: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(stuck)));
        run_and_check(&rt, &store, &moved, &format!("s{}", n.get()), &steps, T0_MS)
    });
    assert!(
        result.is_err(),
        "a store on a stuck clock passed {} cases",
        n.get()
    );
}

/// The same comparison for stores judged on a server's clock (Redis `TIME`, PostgreSQL's
/// clock): time passes for real and each answer's instant is bound by its call and return.
fn run_real(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn Store>,
    ns: &str,
    steps: &[Step],
    cfg: &LinConfig,
) -> Result<(), TestCaseError> {
    let rec = dedupgate_torture::Recorder::new(store.clone(), None);
    let mut tokens: Vec<Vec<String>> = vec![vec![], vec![]];
    for s in steps {
        match s {
            Step::Advance(ms) => {
                let d = std::time::Duration::from_millis(*ms);
                rt.block_on(async { tokio::time::sleep(d).await });
            }
            Step::Op { key, op } => {
                let k = *key as usize;
                let hop = to_hop(op, &tokens[k]);
                let answer = rt.block_on(rec.call("c", ns, &format!("k{k}"), hop));
                prop_assert!(!answer.is_unknown(), "store error {answer:?}");
                if let HAnswer::Claimed {
                    claim: Claim::New(l),
                } = &answer
                {
                    tokens[k].push(l.token.as_str().to_owned());
                }
            }
        }
    }
    let report = dedupgate_torture::check(&rec.events(), cfg);
    prop_assert!(report.violations().is_empty(), "{}", report.summary());
    Ok(())
}

fn remote(url: &str, what: &str, cfg: LinConfig) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    remote_on(&rt, url, what, cfg);
}

fn remote_on(rt: &tokio::runtime::Runtime, url: &str, what: &str, cfg: LinConfig) {
    let store = rt
        .block_on(dedupgate_torture::faces::open(url))
        .expect("local server");
    let mut runner = runner(what, 16);
    let tag: u64 = rand::random();
    let n = std::cell::Cell::new(0u64);
    runner
        .run(&steps(), |steps| {
            n.set(n.get() + 1);
            run_real(
                rt,
                &store,
                &format!("model.{tag:x}.{}", n.get()),
                &steps,
                &cfg,
            )
        })
        .unwrap();
}

#[test]
fn redis_store_equals_the_model() {
    let url = std::env::var("DEDUPGATE_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    remote(
        &url,
        "model redis",
        LinConfig {
            skew_ms: 1,
            ..LinConfig::default()
        },
    );
}

#[test]
fn postgres_store_equals_the_model() {
    let url = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // One client: no lock waits, so the clock can be required to be monotonic here.
    remote(
        &url,
        "model postgres",
        LinConfig {
            skew_ms: 1,
            ..LinConfig::default()
        },
    );
}

#[test]
fn http_face_equals_the_model() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(dedupgate_torture::faces::serve_gate(
        Arc::new(MemoryStore::new()),
        listener,
        async move {
            let _ = stop_rx.await;
        },
    ));
    remote_on(
        &rt,
        &format!("http://{addr}"),
        "model http",
        LinConfig {
            skew_ms: 1,
            ..LinConfig::default()
        },
    );
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
}
