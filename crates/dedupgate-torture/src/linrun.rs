//! A concurrent workload that records a history for the linearizability checker: several
//! clients on a few hot keys with short leases and retentions (so takeovers and expiries happen
//! during the run), presenting their own, stale and made-up tokens, some with an owner, and some
//! calls whose answers are lost or that are never sent (unknown outcomes of both kinds).
//!
//! Each client draws its operations from its own generator seeded from the run's seed, so a
//! seed replays the same operations; the interleaving is the scheduler's and is not replayed.

use std::sync::Arc;

use dedupgate_core::{Claim, Store};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::history::{Event, Fate, HAnswer, HOp, Recorder};

/// Shape of a run.
#[derive(Clone, Debug)]
pub struct LinRunConfig {
    /// Concurrent clients.
    pub clients: usize,
    /// Operations each client sends.
    pub ops_per_client: usize,
    /// Distinct keys, shared by all clients.
    pub keys: usize,
    /// Namespace of the run (keep it fresh per run on shared stores).
    pub namespace: String,
    /// Lease range, ms (short, so leases run out mid-run).
    pub lease_ms: (u64, u64),
    /// Retention range, ms (short, so records expire mid-run).
    pub ttl_ms: (u64, u64),
    /// Longest pause between a client's operations, ms.
    pub pause_ms_max: u64,
    /// Percent of calls whose answer is dropped after the store decided.
    pub lose_answer_pct: u32,
    /// Percent of calls recorded as sent but never sent.
    pub never_sent_pct: u32,
}

impl LinRunConfig {
    /// A small run for CI: 4 clients x 50 ops over 3 keys, leases of 3-12 ms.
    pub fn small(namespace: impl Into<String>) -> Self {
        Self {
            clients: 4,
            ops_per_client: 50,
            keys: 3,
            namespace: namespace.into(),
            lease_ms: (3, 12),
            ttl_ms: (15, 60),
            pause_ms_max: 3,
            lose_answer_pct: 3,
            never_sent_pct: 2,
        }
    }
}

/// Runs the workload against `store` and returns its history.
pub async fn run(store: Arc<dyn Store>, cfg: &LinRunConfig, seed: u64) -> Vec<Event> {
    let recorder = Recorder::new(store, Some(std::time::Duration::from_secs(5)));
    let mut tasks = Vec::new();
    for c in 0..cfg.clients {
        let recorder = recorder.clone();
        let cfg = cfg.clone();
        let client_seed = seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        tasks.push(tokio::spawn(async move {
            client(recorder, cfg, c, client_seed).await;
        }));
    }
    for t in tasks {
        // A panicking client is a bug in this module; surface it.
        t.await.expect("a history client panicked");
    }
    recorder.events()
}

async fn client(recorder: Recorder, cfg: LinRunConfig, c: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let name = format!("c{c}");
    let owner = format!("owner-{c}");
    // Tokens this client was given, per key: the newest is "held", older ones are stale.
    let mut tokens: Vec<Vec<String>> = vec![Vec::new(); cfg.keys];
    for n in 0..cfg.ops_per_client {
        let k = rng.gen_range(0..cfg.keys);
        let key = format!("k{k}");
        let lease_ms = rng.gen_range(cfg.lease_ms.0..=cfg.lease_ms.1);
        let ttl_ms = rng.gen_range(cfg.ttl_ms.0..=cfg.ttl_ms.1);
        let held = tokens[k].last().cloned();
        let any_token = |rng: &mut StdRng| -> String {
            let all = &tokens[k];
            if !all.is_empty() && rng.gen_bool(0.8) {
                all[rng.gen_range(0..all.len())].clone()
            } else {
                format!("made-up-{}", rng.gen::<u32>())
            }
        };
        let op = match rng.gen_range(0..100) {
            0..=29 => HOp::Claim {
                ttl_ms,
                lease_ms,
                fingerprint: None,
                owner: rng.gen_bool(0.3).then(|| owner.clone()),
            },
            30..=44 => HOp::Complete {
                token: held.clone().unwrap_or_else(|| any_token(&mut rng)),
                result: Some(serde_json::json!({"by": name, "n": n})),
                ttl_ms: rng.gen_bool(0.3).then_some(ttl_ms),
            },
            45..=52 => HOp::Release {
                token: held.clone().unwrap_or_else(|| any_token(&mut rng)),
            },
            53..=62 => HOp::Extend {
                token: held.clone().unwrap_or_else(|| any_token(&mut rng)),
                lease_ms,
            },
            63..=74 => HOp::Mark {
                ttl_ms,
                fingerprint: None,
                result: rng.gen_bool(0.5).then(|| serde_json::json!(n)),
            },
            75..=89 => HOp::Get,
            90..=97 => {
                let token = any_token(&mut rng);
                match rng.gen_range(0..3) {
                    0 => HOp::Complete {
                        token,
                        result: None,
                        ttl_ms: None,
                    },
                    1 => HOp::Release { token },
                    _ => HOp::Extend { token, lease_ms },
                }
            }
            _ => HOp::Forget,
        };
        let roll = rng.gen_range(0..100);
        let fate = if roll < cfg.lose_answer_pct {
            Fate::LoseAnswer
        } else if roll < cfg.lose_answer_pct + cfg.never_sent_pct {
            Fate::NeverSent
        } else {
            Fate::Deliver
        };
        let answer = recorder
            .call_with(&name, &cfg.namespace, &key, op, fate)
            .await;
        if let HAnswer::Claimed {
            claim: Claim::New(lease),
        } = answer
        {
            let t = lease.token.as_str().to_owned();
            if tokens[k].last() != Some(&t) {
                tokens[k].push(t);
            }
        }
        let pause = rng.gen_range(0..=cfg.pause_ms_max);
        if pause > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}
