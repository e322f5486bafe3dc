//! Model-based test: random operations (single and batched) on the Redis store and on the memory
//! store, the reference model, must get the same answers. Leases and ttls are long, so the two
//! clocks never disagree about expiry (the conformance suite covers time); fences and times are
//! compared by what they mean (same claim or a new one), not by value.

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;

use dedupgate_core::{Claim, GateError, Mark, MemoryStore, Op, Outcome, Record, RecordId, Token};
use dedupgate_redis::testkit::{shared_redis_url, RedisServer};
use dedupgate_redis::RedisStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

const KEYS: usize = 6;
const LONG_MS: u64 = 600_000;

/// Per store: the tokens each key was given, in order, so "the k-th token of key x" names the
/// same claim in both stores.
#[derive(Default)]
struct Tokens(HashMap<String, Vec<Token>>);

impl Tokens {
    fn index(&mut self, key: &str, t: &Token) -> usize {
        let list = self.0.entry(key.to_owned()).or_default();
        match list.iter().position(|x| x == t) {
            Some(i) => i,
            None => {
                list.push(t.clone());
                list.len() - 1
            }
        }
    }
    fn pick(&self, key: &str, choice: usize) -> Token {
        self.0
            .get(key)
            .and_then(|l| l.get(choice))
            .cloned()
            .unwrap_or_else(|| Token::new("never-issued"))
    }
}

/// An op in store-neutral form: tokens by index.
#[derive(Clone, Debug)]
enum Gen {
    Claim(Option<&'static str>, Option<&'static str>),
    Mark(Option<&'static str>, Option<serde_json::Value>),
    Complete(usize, Option<serde_json::Value>, Option<u64>),
    Release(usize),
    Extend(usize),
    Get,
    Forget,
}

fn gen(rng: &mut StdRng) -> Gen {
    let fp = |rng: &mut StdRng| [None, Some("fa"), Some("fb")][rng.gen_range(0..3)];
    match rng.gen_range(0..10) {
        0..=2 => Gen::Claim(fp(rng), [None, Some("o1"), Some("o2")][rng.gen_range(0..3)]),
        3 => Gen::Mark(
            fp(rng),
            rng.gen_bool(0.5).then(|| json!({"m": rng.gen::<u8>()})),
        ),
        4 | 5 => Gen::Complete(
            rng.gen_range(0..4),
            rng.gen_bool(0.7)
                .then(|| json!([rng.gen::<u8>(), "r", null])),
            rng.gen_bool(0.3).then_some(LONG_MS * 2),
        ),
        6 => Gen::Release(rng.gen_range(0..4)),
        7 => Gen::Extend(rng.gen_range(0..4)),
        8 => Gen::Get,
        _ => Gen::Forget,
    }
}

fn to_op(g: &Gen, key: &str, tokens: &Tokens) -> Op {
    match g.clone() {
        Gen::Claim(fp, owner) => Op::Claim {
            ttl_ms: LONG_MS,
            lease_ms: LONG_MS,
            fingerprint: fp.map(Into::into),
            owner: owner.map(Into::into),
        },
        Gen::Mark(fp, result) => Op::Mark {
            ttl_ms: LONG_MS,
            fingerprint: fp.map(Into::into),
            result,
        },
        Gen::Complete(t, result, ttl_ms) => Op::Complete {
            token: tokens.pick(key, t),
            result,
            ttl_ms,
        },
        Gen::Release(t) => Op::Release {
            token: tokens.pick(key, t),
        },
        Gen::Extend(t) => Op::Extend {
            token: tokens.pick(key, t),
            lease_ms: LONG_MS,
        },
        Gen::Get => Op::Get,
        Gen::Forget => Op::Forget,
    }
}

/// What an answer means, without clock-dependent values. `fences` maps each store's fence values
/// to the order they were first seen, so equal meaning gives equal text.
fn meaning(
    key: &str,
    r: Result<Outcome, GateError>,
    tokens: &mut Tokens,
    fences: &mut HashMap<(String, u64), usize>,
) -> String {
    let mut fence = |f: u64| {
        let n = fences.len();
        *fences.entry((key.to_owned(), f)).or_insert(n)
    };
    let mut rec = |r: &Record| {
        format!(
            "{:?} fence#{} fp={:?} owner={:?} result={:?} lease={} completed={}",
            r.state,
            fence(r.fence),
            r.fingerprint,
            r.owner,
            r.result,
            r.lease_expires_at_ms.is_some(),
            r.completed_at_ms.is_some()
        )
    };
    match r {
        Ok(Outcome::Claimed(Claim::New(l))) => {
            let f = fence(l.fence);
            format!("new token#{} fence#{f}", tokens.index(key, &l.token))
        }
        Ok(Outcome::Claimed(Claim::Duplicate { record })) => format!("dup {}", rec(&record)),
        Ok(Outcome::Marked(Mark::New { record })) => format!("marked {}", rec(&record)),
        Ok(Outcome::Marked(Mark::Duplicate { record })) => format!("mark-dup {}", rec(&record)),
        Ok(Outcome::Completed(record)) => format!("completed {}", rec(&record)),
        Ok(Outcome::Found(found)) => format!("found {:?}", found.as_ref().map(rec)),
        Ok(other) => format!("{other:?}")
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned(),
        Err(e) => format!("error {}", e.code()),
    }
}

/// Runs `rounds` rounds of random ops on `redis` and on the model, comparing every answer.
/// Each round is one op through `apply` when `batch_len` gives 1, else a batch of that many.
async fn compare(
    redis: &RedisStore,
    seed: u64,
    rounds: usize,
    keys: usize,
    batch_len: impl Fn(&mut StdRng) -> usize,
    gen: impl Fn(&mut StdRng) -> Gen,
) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let model = MemoryStore::new();
    let ns = format!("model.{seed:x}.{keys}");
    let (mut tok_r, mut tok_m) = (Tokens::default(), Tokens::default());
    let (mut fen_r, mut fen_m) = (HashMap::new(), HashMap::new());
    let mut step = 0;
    for round in 0..rounds {
        let n = batch_len(&mut rng);
        let gens: Vec<(String, Gen)> = (0..n)
            .map(|_| (format!("k{}", rng.gen_range(0..keys)), gen(&mut rng)))
            .collect();
        let batch = |tokens: &Tokens| -> Vec<(RecordId, Op)> {
            gens.iter()
                .map(|(k, g)| {
                    (
                        RecordId::new(ns.clone(), k.clone()).unwrap(),
                        to_op(g, k, tokens),
                    )
                })
                .collect()
        };
        let (ops_r, ops_m) = (batch(&tok_r), batch(&tok_m));
        let (out_r, out_m) = if n == 1 {
            let (id_r, op_r) = ops_r.into_iter().next().unwrap();
            let (id_m, op_m) = ops_m.into_iter().next().unwrap();
            (
                vec![redis.apply_op(id_r, op_r).await],
                vec![model.apply_op(id_m, op_m).await],
            )
        } else {
            (redis.apply_ops(ops_r).await, model.apply_ops(ops_m).await)
        };
        for (((k, g), r), m) in gens.iter().zip(out_r).zip(out_m) {
            step += 1;
            let got = meaning(k, r, &mut tok_r, &mut fen_r);
            let want = meaning(k, m, &mut tok_m, &mut fen_m);
            assert_eq!(
                got, want,
                "seed {seed}, round {round}, step {step}: {g:?} on {k}: Redis answered\n  {got}\nthe model\n  {want}"
            );
        }
    }
    step
}

fn seed() -> u64 {
    std::env::var("DG_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_answers_like_the_reference_model() {
    let seed = seed();
    eprintln!("model test: seed {seed} (replay with DG_MODEL_SEED={seed})");
    let redis = RedisStore::open(&shared_redis_url())
        .await
        .expect("local Redis");
    let batch_len = |rng: &mut StdRng| {
        if rng.gen_bool(0.3) {
            rng.gen_range(2..8)
        } else {
            1
        }
    };
    let step = compare(&redis, seed, 1_500, KEYS, batch_len, gen).await;
    eprintln!("model test: {step} operations agreed");
}

/// Large batches, mostly claims and marks over a wider key space, so that most batches take the
/// store's batch fast path (new keys by native `SET … NX GET`, the rest through the script):
/// fresh keys, existing ones in every state, keys repeated within a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_batches_answer_like_the_reference_model() {
    let seed = seed();
    eprintln!("large-batch model test: seed {seed} (replay with DG_MODEL_SEED={seed})");
    let server = tokio::task::spawn_blocking(|| RedisServer::start(&["--appendonly", "no"]))
        .await
        .unwrap()
        .expect("start redis-server");
    let redis = RedisStore::open(&server.url()).await.expect("open store");
    let gen_big = |rng: &mut StdRng| {
        if rng.gen_bool(0.7) {
            let fp = [None, Some("fa"), Some("fb")][rng.gen_range(0..3)];
            if rng.gen_bool(0.7) {
                Gen::Claim(fp, [None, Some("o1"), Some("o2")][rng.gen_range(0..3)])
            } else {
                Gen::Mark(fp, rng.gen_bool(0.5).then(|| json!({"m": rng.gen::<u8>()})))
            }
        } else {
            gen(rng)
        }
    };
    let step = compare(&redis, seed, 300, 200, |rng| rng.gen_range(24..64), gen_big).await;
    let stats = server.cli(&["INFO", "commandstats"]).unwrap();
    let calls = |cmd: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    // Every script call reads TIME once; the fast path reads it twice per batch on its own.
    assert!(
        calls("time") > calls("evalsha"),
        "the fast path never ran: {stats}"
    );
    eprintln!("large-batch model test: {step} operations agreed");
}
