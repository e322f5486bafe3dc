//! The linearizability checker: it rejects hand-built histories no order explains, accepts
//! histories recorded under concurrency on the memory store (the reference), and catches a
//! store that decides check-then-act across two critical sections.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dedupgate_core::{
    decide, Change, Claim, Entry, GateError, Lease, MemoryStore, Outcome, Record, RecordId, State,
    Store, StoreError, Token, ValidOp,
};
use dedupgate_torture::linrun::{self, LinRunConfig};
use dedupgate_torture::{check, check_key, Event, HAnswer, HOp, LinConfig, Verdict};

const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000_000;

fn ev(client: &str, op: HOp, call_ms: u64, ret_ms: Option<u64>, answer: HAnswer) -> Event {
    Event {
        client: client.into(),
        namespace: "ns".into(),
        key: "k".into(),
        op,
        call_ns: (T0 + call_ms) * MS,
        return_ns: ret_ms.map(|r| (T0 + r) * MS + 500_000),
        answer,
    }
}

fn claim(owner: Option<&str>) -> HOp {
    HOp::Claim {
        ttl_ms: 10_000,
        lease_ms: 1_000,
        fingerprint: None,
        owner: owner.map(str::to_owned),
    }
}

fn new_at(token: &str, now_ms: u64, fence: u64) -> HAnswer {
    HAnswer::Claimed {
        claim: Claim::New(Lease {
            token: Token::new(token),
            fence,
            lease_expires_at_ms: T0 + now_ms + 1_000,
            expires_at_ms: T0 + now_ms + 10_000,
        }),
    }
}

fn in_progress(created_ms: u64, fence: u64, owner: Option<&str>) -> Record {
    Record {
        namespace: dedupgate_core::Namespace::new("ns").unwrap(),
        key: dedupgate_core::Key::new("k").unwrap(),
        state: State::InProgress,
        fence,
        fingerprint: None,
        owner: owner.map(str::to_owned),
        created_at_ms: T0 + created_ms,
        expires_at_ms: T0 + created_ms + 10_000,
        lease_expires_at_ms: Some(T0 + created_ms + 1_000),
        completed_at_ms: None,
        result: None,
    }
}

fn fence_at(ms: u64) -> u64 {
    (T0 + ms) * 1000
}

fn cfg() -> LinConfig {
    LinConfig::default()
}

#[test]
fn accepts_a_simple_sequential_history() {
    let h = vec![
        ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0))),
        ev(
            "b",
            claim(None),
            5,
            Some(6),
            HAnswer::Claimed {
                claim: Claim::Duplicate {
                    record: in_progress(0, fence_at(0), None),
                },
            },
        ),
        ev(
            "a",
            HOp::Release { token: "x".into() },
            7,
            Some(8),
            HAnswer::Released,
        ),
        ev("b", claim(None), 9, Some(10), new_at("y", 9, fence_at(9))),
    ];
    assert!(matches!(
        check_key(&h, &cfg()),
        Verdict::Linearizable { .. }
    ));
}

#[test]
fn rejects_two_new_claims_inside_one_lease() {
    // b's claim starts after a's returned, well inside a's lease: it must be a duplicate.
    let h = vec![
        ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0))),
        ev("b", claim(None), 5, Some(6), new_at("y", 5, fence_at(5))),
    ];
    let v = check_key(&h, &cfg());
    assert!(matches!(v, Verdict::Violation { .. }), "{v:?}");
}

#[test]
fn concurrent_new_claims_are_still_one_too_many() {
    // Overlapping windows do not help: whichever goes first, the second is a duplicate.
    let h = vec![
        ev("a", claim(None), 0, Some(9), new_at("x", 3, fence_at(3))),
        ev("b", claim(None), 1, Some(9), new_at("y", 4, fence_at(4))),
    ];
    assert!(matches!(check_key(&h, &cfg()), Verdict::Violation { .. }));
}

#[test]
fn rejects_a_read_that_misses_an_acknowledged_claim() {
    let h = vec![
        ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0))),
        ev("b", HOp::Get, 3, Some(4), HAnswer::Found { record: None }),
    ];
    assert!(matches!(check_key(&h, &cfg()), Verdict::Violation { .. }));
}

#[test]
fn rejects_a_fence_that_does_not_increase() {
    let h = vec![
        ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0))),
        ev(
            "a",
            HOp::Release { token: "x".into() },
            2,
            Some(3),
            HAnswer::Released,
        ),
        // Claimed in the same millisecond as the first claim's fence would allow, but the
        // fence must be at least the previous + 1.
        ev("b", claim(None), 4, Some(4), new_at("y", 0, fence_at(0))),
    ];
    assert!(matches!(check_key(&h, &cfg()), Verdict::Violation { .. }));
}

#[test]
fn tokens_are_compared_by_role() {
    // The same owner re-claims: the model hands back the same token, so a store that handed out
    // another token for the same claim is caught even though both tokens look random.
    let first = new_at("x", 0, fence_at(0));
    let same = ev("a", claim(Some("w")), 0, Some(1), first.clone());
    // A renewal moves the lease, keeps the fence and the record's retention.
    let renewed = |token: &str| HAnswer::Claimed {
        claim: Claim::New(Lease {
            token: Token::new(token),
            fence: fence_at(0),
            lease_expires_at_ms: T0 + 2 + 1_000,
            expires_at_ms: T0 + 10_000,
        }),
    };
    let renewed_same_token = ev("a", claim(Some("w")), 2, Some(3), renewed("x"));
    let renewed_other_token = ev("a", claim(Some("w")), 2, Some(3), renewed("z"));
    assert!(matches!(
        check_key(&[same.clone(), renewed_same_token], &cfg()),
        Verdict::Linearizable { .. }
    ));
    assert!(matches!(
        check_key(&[same, renewed_other_token], &cfg()),
        Verdict::Violation { .. }
    ));
    // A complete with the issued token succeeds; one with a token never issued must be refused.
    let claim_x = ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0)));
    let bogus_ok = ev(
        "b",
        HOp::Release {
            token: "never-issued".into(),
        },
        2,
        Some(3),
        HAnswer::Released,
    );
    assert!(matches!(
        check_key(&[claim_x, bogus_ok], &cfg()),
        Verdict::Violation { .. }
    ));
}

#[test]
fn an_unknown_claim_may_have_taken_effect() {
    // a's claim timed out, but a later duplicate shows it happened (at 3 ms): accepted.
    let h = vec![
        ev(
            "a",
            claim(None),
            0,
            None,
            HAnswer::Unknown {
                why: "timeout".into(),
            },
        ),
        ev(
            "b",
            claim(None),
            5,
            Some(6),
            HAnswer::Claimed {
                claim: Claim::Duplicate {
                    record: in_progress(3, fence_at(3), None),
                },
            },
        ),
    ];
    assert!(matches!(
        check_key(&h, &cfg()),
        Verdict::Linearizable { .. }
    ));
    // ... or not: a new claim after it is fine too.
    let h2 = vec![
        h[0].clone(),
        ev("b", claim(None), 5, Some(6), new_at("y", 5, fence_at(5))),
    ];
    assert!(matches!(
        check_key(&h2, &cfg()),
        Verdict::Linearizable { .. }
    ));
    // But it cannot have taken effect before it was called.
    let h3 = vec![
        ev(
            "a",
            claim(None),
            5,
            None,
            HAnswer::Unknown {
                why: "timeout".into(),
            },
        ),
        ev(
            "b",
            claim(None),
            0,
            Some(1),
            HAnswer::Claimed {
                claim: Claim::Duplicate {
                    record: in_progress(0, fence_at(0), None),
                },
            },
        ),
    ];
    assert!(matches!(check_key(&h3, &cfg()), Verdict::Violation { .. }));
}

#[test]
fn takeover_only_after_the_lease() {
    // b claims at 500 ms, inside a's 1 s lease: a violation; at 1000 ms it is a takeover.
    let a = ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0)));
    let early = ev(
        "b",
        claim(None),
        500,
        Some(501),
        new_at("y", 500, fence_at(500)),
    );
    let late = ev(
        "b",
        claim(None),
        1000,
        Some(1001),
        new_at("y", 1000, fence_at(1000)),
    );
    assert!(matches!(
        check_key(&[a.clone(), early], &cfg()),
        Verdict::Violation { .. }
    ));
    assert!(matches!(
        check_key(&[a.clone(), late.clone()], &cfg()),
        Verdict::Linearizable { .. }
    ));
    // After the takeover, a's complete with its old token must be refused, not accepted.
    let stale_ok = ev(
        "a",
        HOp::Complete {
            token: "x".into(),
            result: None,
            ttl_ms: None,
        },
        1002,
        Some(1003),
        HAnswer::Completed {
            record: in_progress(0, fence_at(0), None),
        },
    );
    assert!(matches!(
        check_key(&[a, late, stale_ok], &cfg()),
        Verdict::Violation { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_histories_recorded_on_the_memory_store() {
    let seed = dedupgate_torture::seed("lin memory");
    let mut total_ops = 0;
    for round in 0..3u64 {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let cfg_run = LinRunConfig::small(format!("lin{round}"));
        let events = linrun::run(store, &cfg_run, seed.wrapping_add(round)).await;
        let report = check(&events, &cfg());
        eprintln!("round {round}: {}", report.summary());
        assert!(
            report.violations().is_empty() && report.inconclusive() == 0,
            "seed {seed} round {round}: {}",
            report.summary()
        );
        assert!(report.unknown() > 0, "the run should hold unknown outcomes");
        total_ops += report.ops();
        // The same real history with one answer tampered with (a fence one too high) is refused.
        let mut tampered = events.clone();
        let i = tampered
            .iter()
            .position(|e| {
                matches!(
                    e.answer,
                    HAnswer::Claimed {
                        claim: Claim::New(_)
                    }
                )
            })
            .expect("a run has new claims");
        if let HAnswer::Claimed {
            claim: Claim::New(lease),
        } = &mut tampered[i].answer
        {
            lease.fence += 1;
        }
        let report = check(&tampered, &cfg());
        assert_eq!(
            report.violations().len(),
            1,
            "seed {seed}: tampered history accepted"
        );
    }
    assert_eq!(total_ops, 3 * 4 * 50);
}

/// A store that reads, yields, then writes: two claims that both read "absent" both win.
/// The real stores never do this; the checker must see it.
struct CheckThenActStore {
    map: Mutex<HashMap<RecordId, Entry>>,
    barrier: tokio::sync::Barrier,
}

#[async_trait]
impl Store for CheckThenActStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        let current = self.map.lock().unwrap().get(&id).cloned();
        // Both callers read before either writes.
        self.barrier.wait().await;
        let now_ms = dedupgate_core::Clock::now_ms(&dedupgate_core::SystemClock::default());
        let d = decide(&id, op, current.as_ref(), now_ms, Token::generate);
        if let Change::Put(e) = d.change {
            self.map.lock().unwrap().insert(id, e);
        }
        d.answer
    }
    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
    async fn sweep_expired(&self, _: usize) -> Result<u64, StoreError> {
        Ok(0)
    }
    fn describe(&self) -> String {
        "check-then-act (broken on purpose)".into()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catches_a_store_that_checks_then_acts() {
    let store: Arc<dyn Store> = Arc::new(CheckThenActStore {
        map: Mutex::new(HashMap::new()),
        barrier: tokio::sync::Barrier::new(2),
    });
    let rec = dedupgate_torture::Recorder::new(store, None);
    let op = HOp::Claim {
        ttl_ms: 60_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    };
    let (a, b) = tokio::join!(
        rec.call("a", "ns", "k", op.clone()),
        rec.call("b", "ns", "k", op.clone())
    );
    assert!(matches!(
        a,
        HAnswer::Claimed {
            claim: Claim::New(_)
        }
    ));
    assert!(matches!(
        b,
        HAnswer::Claimed {
            claim: Claim::New(_)
        }
    ));
    let report = check(&rec.events(), &cfg());
    assert_eq!(report.violations().len(), 1, "{}", report.summary());
}

/// A writer that read its clock at 4 ms but committed after a plain read called at 5 ms (which
/// did not wait for it, as PostgreSQL's reads do not) makes the store's clock appear to step
/// back by 1 ms along the order: refused with no slack, accepted with a slack of 2 ms.
#[test]
fn clock_slack_allows_a_reader_that_did_not_wait_for_a_commit() {
    let a = ev("a", claim(None), 0, Some(1), new_at("x", 0, fence_at(0)));
    let read_old = ev(
        "b",
        HOp::Get,
        1_005,
        Some(1_006),
        HAnswer::Found {
            record: Some(in_progress(0, fence_at(0), None)),
        },
    );
    // Called at 1003, decided at 1004, answered at 1008: a takeover of a's expired lease.
    let takeover = ev(
        "c",
        claim(None),
        1_003,
        Some(1_008),
        new_at("y", 1_004, fence_at(1_004)),
    );
    let h = [a, read_old, takeover];
    assert!(matches!(check_key(&h, &cfg()), Verdict::Violation { .. }));
    let slack = LinConfig {
        clock_slack_ms: 2,
        ..cfg()
    };
    assert!(matches!(
        check_key(&h, &slack),
        Verdict::Linearizable { .. }
    ));
}
