//! The records the Redis store keeps are the entries `dedupgate_core::decide` produces: the
//! core's stored-shape check ([`check_stored_shapes`]) runs against the local Redis, reading each
//! stored value with `GET` and decoding it with the crate's own decoder, on Redis's clock
//! (`TIME`). Its batch of new keys takes the native fast path.
//!
//! One field is Redis's own: a mark's record keeps its call's nonce in the token slot where
//! `decide` keeps none; there the stored token must be 32 hex digits and is then compared as none.

use async_trait::async_trait;
use dedupgate_core::testkit::{check_stored_shapes, StoredShapes};
use dedupgate_core::{Entry, EntryState, RecordId, Store};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::record::decode_record;
use dedupgate_redis::testkit::shared_redis_url;
use dedupgate_redis::RedisStore;
use redis::aio::MultiplexedConnection;

/// The store, a plain connection to read what it stored, and this run's namespace.
struct Shapes {
    store: RedisStore,
    conn: MultiplexedConnection,
    ns: String,
}

#[async_trait]
impl StoredShapes for Shapes {
    fn store(&self) -> &dyn Store {
        &self.store
    }

    fn namespace(&self) -> &str {
        &self.ns
    }

    async fn now_ms(&mut self) -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME")
            .query_async(&mut self.conn)
            .await
            .unwrap();
        s * 1000 + us / 1000
    }

    async fn stored(&mut self, id: &RecordId) -> Option<Entry> {
        let raw: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&record_keys("dg", id).record[..])
            .query_async(&mut self.conn)
            .await
            .unwrap();
        raw.map(|r| decode_record(&r).unwrap_or_else(|e| panic!("{id:?}: {e}")))
    }

    /// `decide`'s entry, a mark's nonce aside (see the file's header).
    fn stored_equals(&self, stored: Option<&Entry>, decided: Option<&Entry>) -> bool {
        match (stored, decided) {
            (None, None) => true,
            (Some(s), Some(d)) => {
                let mut s = s.clone();
                if d.state == EntryState::Completed && d.token.is_none() {
                    let nonce_shape = s.token.as_ref().is_some_and(|t| {
                        t.as_str().len() == 32 && t.as_str().bytes().all(|b| b.is_ascii_hexdigit())
                    });
                    if !nonce_shape {
                        return false;
                    }
                    s.token = None;
                }
                &s == d
            }
            _ => false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_records_are_the_entries_decide_produces() {
    let url = shared_redis_url();
    let store = RedisStore::open(&url)
        .await
        .expect("the local Redis (DEDUPGATE_TEST_REDIS_URL) must be reachable");
    let conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let mut shapes = Shapes {
        store,
        conn,
        ns: format!("shapes.{}.{nanos}", std::process::id()),
    };
    let written = check_stored_shapes(&mut shapes).await;
    for id in written {
        let _: i64 = redis::cmd("DEL")
            .arg(&record_keys("dg", &id).record[..])
            .query_async(&mut shapes.conn)
            .await
            .unwrap();
    }
}
