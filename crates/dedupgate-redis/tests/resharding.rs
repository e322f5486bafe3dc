//! Batches on a Redis Cluster while one of their slots is resharded, step by step as
//! `redis-cli --cluster reshard` does it: `CLUSTER SETSLOT … IMPORTING/MIGRATING`, `MIGRATE` of
//! the slot's keys, `CLUSTER SETSLOT … NODE`. While the slot is migrating the source answers
//! `ASK` for keys it does not hold, which the client does not follow inside a pipeline: such a
//! batch may be answered `unavailable` (a retry is safe), but here an existing key is never
//! answered "new" (no second copy on the target), and each new key is "new" exactly once over
//! the whole reshard. Once the slot has moved, batches are decided on the target. (The client's
//! resend of a call that already ran, after a redirect, is `docs/redis.md`'s narrow case.)

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;

use dedupgate_core::{Claim, GateError, Mark, Op, Outcome, RecordId, Store, StoreError};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::testkit::{RedisCluster, RedisServer};
use dedupgate_redis::RedisStore;

const DAY_MS: u64 = 86_400_000;

fn claim() -> Op {
    Op::Claim {
        ttl_ms: DAY_MS,
        lease_ms: 60_000,
        fingerprint: None,
        owner: None,
    }
}

fn mark() -> Op {
    Op::Mark {
        ttl_ms: DAY_MS,
        fingerprint: None,
        result: None,
    }
}

/// Some(true) new, Some(false) duplicate, None unavailable.
fn is_new(r: &Result<Outcome, GateError>) -> Option<bool> {
    match r {
        Ok(Outcome::Claimed(Claim::New(_))) | Ok(Outcome::Marked(Mark::New { .. })) => Some(true),
        Ok(Outcome::Claimed(Claim::Duplicate { .. }))
        | Ok(Outcome::Marked(Mark::Duplicate { .. })) => Some(false),
        Err(GateError::Store(StoreError::Unavailable(_))) => None,
        other => panic!("unexpected answer {other:?}"),
    }
}

/// `n` ids of namespace `ns` whose records live in `slot`.
fn ids_in_slot(ns: &str, slot: u16, n: usize, skip: usize) -> Vec<RecordId> {
    (0u64..)
        .map(|i| RecordId::new(ns, format!("k{i}")).unwrap())
        .filter(|id| record_keys("dg", id).slot == slot)
        .skip(skip)
        .take(n)
        .collect()
}

fn node_id(node: &RedisServer) -> String {
    node.cli(&["CLUSTER", "MYID"]).unwrap().trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_during_a_reshard_are_never_answered_wrongly() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .expect("start a three-master cluster from redis-server");
    let store: Arc<dyn Store> = Arc::new(RedisStore::open(&cluster.url()).await.unwrap());
    let (source, target) = (&cluster.nodes()[0], &cluster.nodes()[1]);
    let (source_id, target_id) = (node_id(source), node_id(target));
    let first_slot = *cluster.slots_of(0).unwrap()[0].start();
    for (round, op) in [("claims", claim()), ("marks", mark())] {
        let slot = first_slot + u16::from(round == "marks");
        let slot_arg = slot.to_string();
        let ns = format!("reshard-{round}");
        let old = ids_in_slot(&ns, slot, 20, 0);
        let new = ids_in_slot(&ns, slot, 20, 20);
        let answers = store
            .apply_ops(old.iter().map(|id| (id.clone(), op.clone())).collect())
            .await;
        assert!(
            answers.iter().all(|a| is_new(a) == Some(true)),
            "{round}: first batch"
        );
        // Old and new keys interleaved in one batch (one slot: one pipeline).
        let batch: Vec<(RecordId, Op)> = old
            .iter()
            .zip(&new)
            .flat_map(|(o, n)| [(o.clone(), op.clone()), (n.clone(), op.clone())])
            .collect();
        let count = |node: &RedisServer| -> u64 {
            let n = node
                .cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot_arg])
                .unwrap();
            n.trim().parse().unwrap()
        };
        let mut new_answers = vec![0u32; new.len()];
        let mut check = |answers: Vec<Result<Outcome, GateError>>, step: &str| {
            assert_eq!(answers.len(), batch.len());
            for (i, answer) in answers.iter().enumerate() {
                match (i % 2, is_new(answer)) {
                    (0, Some(true)) => {
                        panic!("{round} {step}: existing {:?} answered new", old[i / 2].key)
                    }
                    (1, Some(true)) => new_answers[i / 2] += 1,
                    _ => {}
                }
            }
        };

        // 1. The slot starts migrating; no key has moved yet.
        target
            .cli(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source_id])
            .unwrap();
        source
            .cli(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target_id])
            .unwrap();
        check(store.apply_ops(batch.clone()).await, "migrating");
        assert_eq!(
            count(source),
            old.len() as u64,
            "{round}: the source kept its keys"
        );

        // 2. Half the old keys have moved.
        let names: Vec<Vec<u8>> = old.iter().map(|id| record_keys("dg", id).record).collect();
        let migrate = |keys: &[Vec<u8>]| {
            let mut cmd = redis::cmd("MIGRATE");
            cmd.arg("127.0.0.1")
                .arg(target.port())
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS");
            for k in keys {
                cmd.arg(&k[..]);
            }
            let mut c = redis::Client::open(source.url())
                .unwrap()
                .get_connection()
                .unwrap();
            let reply: String = cmd.query(&mut c).unwrap();
            assert_eq!(reply, "OK");
        };
        migrate(&names[..10]);
        check(store.apply_ops(batch.clone()).await, "half moved");

        // 3. Every key has moved and the slot belongs to the target.
        migrate(&names[10..]);
        for node in cluster.nodes() {
            node.cli(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target_id])
                .unwrap();
        }
        assert_eq!(count(source), 0, "{round}");
        // The client learns the new owner from MOVED; a batch may fail while it does.
        let mut settled = false;
        for _ in 0..50 {
            let answers = store.apply_ops(batch.clone()).await;
            let all_answered = answers.iter().all(|a| is_new(a).is_some());
            check(answers, "moved");
            if all_answered {
                settled = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(
            settled,
            "{round}: batches on the moved slot never succeeded"
        );
        assert_eq!(
            new_answers,
            vec![1; new.len()],
            "{round}: each new key new exactly once"
        );
        assert_eq!(
            count(target),
            (old.len() + new.len()) as u64,
            "{round}: no stray copy"
        );
    }
}
