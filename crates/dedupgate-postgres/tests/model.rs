//! Model-based test: random operations applied to the PostgreSQL store and to the memory store
//! (the reference model) must get the same answers. Tokens and fences differ between stores by
//! nature, so they are compared by identity (which earlier token or fence they are). Durations are
//! long so that time plays no part here; expiry and leases are the conformance suite's job.

mod common;

use dedupgate_core::testkit::ApplyOp;
use dedupgate_core::{
    Claim, GateError, Mark, MemoryStore, Op, Outcome, Record, RecordId, Store, Token,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::json;

/// Names tokens and fences by order of first appearance, per store.
#[derive(Default)]
struct Names {
    tokens: Vec<Token>,
    /// Per key: fences of different keys may coincide (both from the same millisecond).
    fences: Vec<(String, u64)>,
}

impl Names {
    fn token(&mut self, t: &Token) -> usize {
        match self.tokens.iter().position(|x| x == t) {
            Some(i) => i,
            None => {
                self.tokens.push(t.clone());
                self.tokens.len() - 1
            }
        }
    }

    fn fence(&mut self, key: &str, f: u64) -> usize {
        let named = (key.to_owned(), f);
        match self.fences.iter().position(|x| *x == named) {
            Some(i) => i,
            None => {
                self.fences.push(named);
                self.fences.len() - 1
            }
        }
    }

    fn record(&mut self, r: &Record) -> String {
        format!(
            "{}/{:?} fence#{} fp={:?} owner={:?} lease={} completed={} result={:?}",
            r.key,
            r.state,
            self.fence(r.key.as_str(), r.fence),
            r.fingerprint,
            r.owner,
            r.lease_expires_at_ms.is_some(),
            r.completed_at_ms.is_some(),
            r.result
        )
    }

    fn answer(&mut self, key: &str, a: &Result<Outcome, GateError>) -> String {
        match a {
            Ok(Outcome::Claimed(Claim::New(l))) => format!(
                "new token#{} fence#{} lease_within_record={}",
                self.token(&l.token),
                self.fence(key, l.fence),
                l.lease_expires_at_ms <= l.expires_at_ms
            ),
            Ok(Outcome::Claimed(Claim::Duplicate { record })) => {
                format!("dup {}", self.record(record))
            }
            Ok(Outcome::Marked(Mark::New { record })) => {
                format!("mark-new {}", self.record(record))
            }
            Ok(Outcome::Marked(Mark::Duplicate { record })) => {
                format!("mark-dup {}", self.record(record))
            }
            Ok(Outcome::Completed(r)) => format!("completed {}", self.record(r)),
            Ok(Outcome::Found(Some(r))) => format!("found {}", self.record(r)),
            Ok(other) => format!("{other:?}").replace(|c: char| c.is_ascii_digit(), "#"),
            Err(e) => format!("error {}", e.code()),
        }
    }
}

/// A random op; tokens are named by index into the tokens each store issued (or a bogus one).
#[derive(Clone, Debug)]
enum Step {
    Claim(Option<&'static str>, Option<&'static str>),
    Mark(Option<&'static str>, Option<serde_json::Value>),
    Complete(Option<usize>, Option<serde_json::Value>, Option<u64>),
    Release(Option<usize>),
    Extend(Option<usize>),
    Get,
    Forget,
}

fn random_step(rng: &mut impl Rng, issued: usize) -> Step {
    let fp = [None, Some("fp-a"), Some("fp-b")][rng.gen_range(0..3)];
    let owner = [None, Some("o1"), Some("o2")][rng.gen_range(0..3)];
    let result = [
        None,
        Some(json!(rng.gen_range(0..100))),
        Some(
            serde_json::from_str(
                r#"{"z": 1.50, "a": [1e400, "\u0000", 123456789012345678901234567890]}"#,
            )
            .unwrap(),
        ),
    ][rng.gen_range(0..3)]
    .clone();
    let token = if issued > 0 && rng.gen_bool(0.85) {
        // Mostly recent tokens, so complete/release/extend often hit the current holder.
        Some(issued - 1 - rng.gen_range(0..issued.min(3)))
    } else {
        None
    };
    match rng.gen_range(0..10) {
        0..=2 => Step::Claim(fp, owner),
        3 => Step::Mark(fp, result),
        4 | 5 => Step::Complete(token, result, [None, Some(900_000)][rng.gen_range(0..2)]),
        6 => Step::Release(token),
        7 => Step::Extend(token),
        8 => Step::Get,
        _ => Step::Forget,
    }
}

fn op_for(step: &Step, names: &Names) -> Op {
    let token = |t: &Option<usize>| {
        t.and_then(|i| names.tokens.get(i).cloned())
            .unwrap_or_else(|| Token::new("bogus-token"))
    };
    match step {
        Step::Claim(fp, owner) => Op::Claim {
            ttl_ms: 600_000,
            lease_ms: 300_000,
            fingerprint: fp.map(str::to_owned),
            owner: owner.map(str::to_owned),
        },
        Step::Mark(fp, result) => Op::Mark {
            ttl_ms: 600_000,
            fingerprint: fp.map(str::to_owned),
            result: result.clone(),
        },
        Step::Complete(t, result, ttl_ms) => Op::Complete {
            token: token(t),
            result: result.clone(),
            ttl_ms: *ttl_ms,
        },
        Step::Release(t) => Op::Release { token: token(t) },
        Step::Extend(t) => Op::Extend {
            token: token(t),
            lease_ms: 300_000,
        },
        Step::Get => Op::Get,
        Step::Forget => Op::Forget,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_answers_like_the_reference_model() {
    let seed: u64 = std::env::var("DEDUPGATE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("model test seed {seed} (replay with DEDUPGATE_TEST_SEED={seed})");
    let url = common::url();
    let schema = common::fresh_schema("model");
    let pg = common::open(&url, &schema, 2).await;
    common::with_schema_dropped(&url, &schema, async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let model = MemoryStore::new();
        let stores: [&dyn Store; 2] = [&model, &pg];
        let mut names = [Names::default(), Names::default()];
        let keys = ["k0", "k\u{0}1", "k2"];
        let mut step_no = 0;
        while step_no < 600 {
            // One step at a time, or a batch of a few (which must equal the steps one by one).
            let n = if rng.gen_bool(0.2) {
                rng.gen_range(2..6)
            } else {
                1
            };
            let issued = names[0].tokens.len();
            let mut steps: Vec<(String, Step)> = (0..n)
                .map(|_| {
                    (
                        keys[rng.gen_range(0..keys.len())].to_owned(),
                        random_step(&mut rng, issued),
                    )
                })
                .collect();
            if n > 1 && rng.gen_bool(0.4) {
                // Claims only (or marks only), of distinct keys: the set-based batch paths.
                let marks = rng.gen_bool(0.4);
                let mut distinct = keys.to_vec();
                distinct.shuffle(&mut rng);
                distinct.truncate(n.min(keys.len()));
                steps = distinct
                    .into_iter()
                    .map(|k| {
                        let fp = [None, Some("fp-a"), Some("fp-b")][rng.gen_range(0..3)];
                        let owner = [None, Some("o1"), Some("o2")][rng.gen_range(0..3)];
                        let step = if marks {
                            Step::Mark(fp, Some(json!(rng.gen_range(0..9))))
                        } else {
                            Step::Claim(fp, owner)
                        };
                        (k.to_owned(), step)
                    })
                    .collect();
            }
            let n = steps.len();
            let mut got: [Vec<String>; 2] = [Vec::new(), Vec::new()];
            for (s, store) in stores.iter().enumerate() {
                let ops: Vec<(RecordId, Op)> = steps
                    .iter()
                    .map(|(k, step)| {
                        (
                            RecordId::new("model", k.clone()).unwrap(),
                            op_for(step, &names[s]),
                        )
                    })
                    .collect();
                let answers = if n == 1 {
                    let (id, op) = ops.into_iter().next().unwrap();
                    vec![store.apply_op(id, op).await]
                } else {
                    store.apply_ops(ops).await
                };
                got[s] = steps
                    .iter()
                    .zip(&answers)
                    .map(|((k, _), a)| names[s].answer(k, a))
                    .collect();
            }
            assert_eq!(
                got[0], got[1],
                "seed {seed}, step {step_no}: {steps:?}\nmodel:    {:?}\npostgres: {:?}",
                got[0], got[1]
            );
            step_no += n;
        }
    })
    .await;
}
