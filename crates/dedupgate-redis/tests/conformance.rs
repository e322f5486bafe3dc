//! The conformance suite on the shared local Redis and on a real three-master cluster.

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;

use dedupgate_core::testkit::{run_all, RealTimeHarness};
use dedupgate_core::{Claim, Op, Outcome, RecordId};
use dedupgate_redis::keys::{record_keys, CLUSTER_SLOTS};
use dedupgate_redis::testkit::{shared_redis_url, RedisCluster};
use dedupgate_redis::RedisStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_single_redis() {
    let store = RedisStore::open(&shared_redis_url())
        .await
        .expect("the local Redis (DEDUPGATE_TEST_REDIS_URL) must be reachable");
    run_all(&RealTimeHarness(Arc::new(store))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_and_every_slot_on_a_real_cluster() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .expect("start a three-master cluster from redis-server");
    let store = Arc::new(
        RedisStore::open(&cluster.url())
            .await
            .expect("open cluster"),
    );
    run_all(&RealTimeHarness(store.clone())).await;

    // Claim keys until every one of the 16384 slots holds one, in batches, then check each.
    let mut by_slot: Vec<Option<RecordId>> = vec![None; CLUSTER_SLOTS as usize];
    let mut missing = CLUSTER_SLOTS as usize;
    let mut i = 0u64;
    while missing > 0 {
        let id = RecordId::new("slots", format!("k{i}")).unwrap();
        let slot = record_keys("dg", &id).slot as usize;
        if by_slot[slot].is_none() {
            by_slot[slot] = Some(id);
            missing -= 1;
        }
        i += 1;
    }
    let ids: Vec<RecordId> = by_slot.into_iter().map(Option::unwrap).collect();
    let claim = || Op::Claim {
        ttl_ms: 60_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    };
    for round in 0..2 {
        for chunk in ids.chunks(4_096) {
            let out = store
                .apply_ops(chunk.iter().map(|id| (id.clone(), claim())).collect())
                .await;
            for (id, r) in chunk.iter().zip(out) {
                let ok = match (round, &r) {
                    (0, Ok(Outcome::Claimed(Claim::New(_)))) => true,
                    (1, Ok(Outcome::Claimed(Claim::Duplicate { record }))) => record.key == id.key,
                    _ => false,
                };
                assert!(ok, "round {round}, key {:?}: {r:?}", id.key);
            }
        }
    }
    // Every node holds records: the slots really are spread over the three masters.
    for node in cluster.nodes() {
        let keys: u64 = node.cli(&["DBSIZE"]).unwrap().trim().parse().unwrap();
        assert!(keys > 1_000, "node {} holds only {keys} keys", node.port());
    }
}
