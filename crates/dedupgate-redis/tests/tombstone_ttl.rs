//! A claim's record carries its ttl (the 11th element) only while in progress: the tombstones
//! that release and forget leave drop it, so a build that reads records of 10 still reads them.

use dedupgate_core::testkit::ApplyOp;
use dedupgate_core::{Claim, Op, Outcome, RecordId};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::testkit::shared_redis_url;
use dedupgate_redis::RedisStore;

/// The stored record's state and ttl_ms (`false` for none, as the script writes it).
const STATE_AND_TTL: &str = "local v = cmsgpack.unpack(redis.call('GET', KEYS[1])) \
    return {v[1], tostring(v[11])}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_forget_tombstones_keep_no_ttl() {
    let url = shared_redis_url();
    let store = RedisStore::open(&url)
        .await
        .expect("the local Redis (DEDUPGATE_TEST_REDIS_URL) must be reachable");
    let ns = format!("tombttl.{}", std::process::id());
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for (key, release) in [("released", true), ("forgotten", false)] {
        let id = RecordId::new(ns.as_str(), key).unwrap();
        let raw_key = record_keys("dg", &id).record;
        let claim = Op::Claim {
            ttl_ms: 60_000,
            lease_ms: 30_000,
            fingerprint: None,
            owner: None,
        };
        let Ok(Outcome::Claimed(Claim::New(lease))) = store.apply_op(id.clone(), claim).await
        else {
            panic!("{key}: claim not new");
        };
        let stored: (String, String) = redis::cmd("EVAL")
            .arg(STATE_AND_TTL)
            .arg(1)
            .arg(&raw_key[..])
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            stored,
            ("i".into(), "60000".into()),
            "{key}: the claim keeps its ttl"
        );
        let op = if release {
            Op::Release { token: lease.token }
        } else {
            Op::Forget
        };
        assert!(store.apply_op(id.clone(), op).await.is_ok(), "{key}");
        let stored: (String, String) = redis::cmd("EVAL")
            .arg(STATE_AND_TTL)
            .arg(1)
            .arg(&raw_key[..])
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            stored,
            ("r".into(), "false".into()),
            "{key}: a tombstone keeps no ttl_ms"
        );
        let _: () = redis::cmd("DEL")
            .arg(&raw_key[..])
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}
