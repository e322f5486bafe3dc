//! A record's key outlives the record by `fence_keep_ms`, and a claim after expiry takes its
//! fence from that expired record: fences keep increasing even if Redis's clock stepped back.

use dedupgate_core::testkit::ApplyOp;
use dedupgate_core::{Claim, Op, Outcome, RecordId};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::testkit::shared_redis_url;
use dedupgate_redis::RedisStore;

fn claim(ttl_ms: u64) -> Op {
    Op::Claim {
        ttl_ms,
        lease_ms: ttl_ms,
        fingerprint: None,
        owner: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_record_keeps_its_fence_for_fence_keep_ms() {
    let url = shared_redis_url();
    let store = RedisStore::open(&format!("{url}?fence_keep_ms=60000"))
        .await
        .expect("the local Redis (DEDUPGATE_TEST_REDIS_URL) must be reachable");
    let ns = format!("fencekeep.{}", std::process::id());
    let id = RecordId::new(ns.as_str(), "k").unwrap();
    let key = record_keys("dg", &id).record;
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let Ok(Outcome::Claimed(Claim::New(first))) = store.apply_op(id.clone(), claim(100)).await
    else {
        panic!("first claim not new");
    };
    // The key lives fence_keep_ms past the record's expiry, on Redis's clock.
    let (pexpiretime, now): (i64, (u64, u64)) = redis::pipe()
        .cmd("PEXPIRETIME")
        .arg(&key[..])
        .cmd("TIME")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pexpiretime as u64, first.expires_at_ms + 60_000);
    let now_ms = now.0 * 1000 + now.1 / 1000;

    // Pretend Redis's clock stepped back after the record was written: give it an expired
    // record whose fence is far above now * 1000. The next claim must still go above it.
    let high = now_ms * 1000 + 5_000_000_000;
    let _: () = redis::cmd("EVAL")
        .arg(
            "return redis.call('SET', KEYS[1], cmsgpack.pack({'c', tonumber(ARGV[1]), false, \
             false, false, tonumber(ARGV[2]) - 2000, tonumber(ARGV[2]) - 1000, false, \
             tonumber(ARGV[2]) - 2000, false}), 'PX', 60000)",
        )
        .arg(1)
        .arg(&key[..])
        .arg(high)
        .arg(now_ms)
        .query_async(&mut conn)
        .await
        .unwrap();
    let Ok(Outcome::Claimed(Claim::New(second))) = store.apply_op(id.clone(), claim(60_000)).await
    else {
        panic!("claim after expiry not new");
    };
    assert_eq!(second.fence, high + 1);

    let _: () = redis::cmd("DEL")
        .arg(&key[..])
        .query_async(&mut conn)
        .await
        .unwrap();
}
