//! The rows the PostgreSQL store keeps are the entries `dedupgate_core::decide` produces: the
//! core's stored-shape check ([`check_stored_shapes`]) runs against the local PostgreSQL in a
//! schema of its own, reading each row with a plain `SELECT` (every column against every field
//! of the entry), on the server's clock as the store's functions read it
//! (`dedupgate_now_ms()`). Its batch of new keys takes the functions for distinct keys.

mod common;

use async_trait::async_trait;
use dedupgate_core::testkit::{check_stored_shapes, StoredShapes};
use dedupgate_core::{Entry, EntryState, RecordId, Store, Token};
use dedupgate_postgres::PgStore;

/// The store, a plain connection to read its rows, and the schema they live in.
struct Shapes {
    store: PgStore,
    client: tokio_postgres::Client,
    schema: String,
}

#[async_trait]
impl StoredShapes for Shapes {
    fn store(&self) -> &dyn Store {
        &self.store
    }

    fn namespace(&self) -> &str {
        "shapes"
    }

    /// The server's clock as the store's functions read it.
    async fn now_ms(&mut self) -> u64 {
        let sql = format!("SELECT \"{}\".dedupgate_now_ms()", self.schema);
        let now: i64 = self.client.query_one(&sql, &[]).await.unwrap().get(0);
        u64::try_from(now).unwrap()
    }

    /// The row of `id` as an entry, or `None` when there is none.
    async fn stored(&mut self, id: &RecordId) -> Option<Entry> {
        let sql = format!(
            "SELECT state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms, \
             lease_expires_at_ms, completed_at_ms, result, ttl_ms \
             FROM \"{}\".dedupgate_records WHERE namespace = $1 AND key = $2",
            self.schema
        );
        let ns = id.namespace.as_str().as_bytes();
        let key = id.key.as_str().as_bytes();
        let row = self.client.query_opt(&sql, &[&ns, &key]).await.unwrap()?;
        let text = |i: usize| {
            row.get::<_, Option<Vec<u8>>>(i)
                .map(|b| String::from_utf8(b).expect("UTF-8 column"))
        };
        let ms = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap();
        let opt_ms = |i: usize| {
            row.get::<_, Option<i64>>(i)
                .map(|v| u64::try_from(v).unwrap())
        };
        Some(Entry {
            state: match row.get::<_, i16>(0) {
                0 => EntryState::InProgress,
                1 => EntryState::Completed,
                2 => EntryState::Released,
                other => panic!("state {other}"),
            },
            fence: ms(1),
            token: text(2).map(Token::new),
            fingerprint: text(3),
            owner: text(4),
            created_at_ms: ms(5),
            expires_at_ms: ms(6),
            lease_expires_at_ms: opt_ms(7),
            completed_at_ms: opt_ms(8),
            result: row
                .get::<_, Option<Vec<u8>>>(9)
                .map(|b| serde_json::from_slice(&b).expect("a JSON result")),
            ttl_ms: opt_ms(10),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_rows_are_the_entries_decide_produces() {
    let url = common::url();
    let schema = common::fresh_schema("shapes");
    let store = common::open(&url, &schema, 2).await;
    let (u, sch) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let mut shapes = Shapes {
            store,
            client: common::connect(&u).await,
            schema: sch,
        };
        check_stored_shapes(&mut shapes).await;
    })
    .await;
}
