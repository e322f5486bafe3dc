//! Opening the store: the versioned schema, concurrent starts, refusals with clear messages.

mod common;

use dedupgate_core::testkit::ApplyOp;
use dedupgate_postgres::{PgError, PgStore, SCHEMA_VERSION};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_starts_migrate_once_and_newer_schemas_are_refused() {
    let url = common::url();
    let schema = common::fresh_schema("schema");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        // Four gates start together on a schema that does not exist yet.
        let opens = (0..4).map(|_| {
            let (u, s) = (u.clone(), s.clone());
            tokio::spawn(async move { common::open(&u, &s, 1).await })
        });
        for store in futures::future::join_all(opens).await {
            store.expect("every concurrent start succeeds");
        }
        let client = common::connect(&u).await;
        let rows = client
            .query(
                &format!("SELECT version FROM \"{s}\".dedupgate_schema_version ORDER BY version"),
                &[],
            )
            .await
            .unwrap();
        let versions: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
        let expected: Vec<i32> = (1..=SCHEMA_VERSION).collect();
        assert_eq!(versions, expected, "each migration ran exactly once");

        // A schema written by a newer build is refused, and left untouched.
        client
            .execute(
                &format!("INSERT INTO \"{s}\".dedupgate_schema_version (version) VALUES (999)"),
                &[],
            )
            .await
            .unwrap();
        let (config, mut options) = dedupgate_postgres::parse_url(&u).unwrap();
        options.schema = s.clone();
        let err = PgStore::connect(config, options).await.unwrap_err();
        assert!(
            matches!(err, PgError::SchemaTooNew { found: 999, .. }),
            "got {err}"
        );
        let text = err.to_string();
        assert!(text.contains("999") && text.contains("newer"), "{text}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_commit_is_refused_unless_accepted() {
    let url = common::url();
    let schema = common::fresh_schema("durability");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let (mut config, mut options) = dedupgate_postgres::parse_url(&u).unwrap();
        config.options("-c synchronous_commit=off");
        options.schema = s.clone();
        let err = PgStore::connect(config.clone(), options.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                PgError::UnsafeDurability {
                    setting: "synchronous_commit",
                    ..
                }
            ),
            "got {err}"
        );
        assert!(
            err.to_string().contains("dedupgate_allow_async_commit"),
            "{err}"
        );
        options.allow_async_commit = true;
        PgStore::connect(config, options)
            .await
            .expect("accepted with the override");
    })
    .await;
}

#[tokio::test]
async fn bad_urls_get_clear_errors() {
    for url in [
        "postgres://127.0.0.1:5432/test?dedupgate_pool_size=0",
        "postgres://127.0.0.1:5432/test?dedupgate_unknown=1",
        "postgres://127.0.0.1:5432/test?dedupgate_schema=",
    ] {
        let err = PgStore::open(url).await.unwrap_err();
        assert!(matches!(err, PgError::Options(_)), "{url}: {err}");
    }
    // Nothing listens on port 1: unavailable, quickly, not a hang or a panic.
    let err = PgStore::open("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert!(matches!(err, PgError::Unavailable(_)), "{err}");
}

/// PostgreSQL refusing the store (a database that does not exist, a role that does not exist,
/// a role without the privilege to create the schema) is [`PgError::Refused`], with its
/// SQLSTATE, never [`PgError::Unavailable`], which a proxy would keep retrying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_by_the_server_are_refused_not_unavailable() {
    let url = common::url();
    let schema = common::fresh_schema("refused");
    let refused = |what: &str, err: PgError, code: &str| {
        assert!(matches!(err, PgError::Refused(_)), "{what}: {err:?}");
        assert!(err.to_string().contains(code), "{what}: {err}");
        assert!(matches!(
            dedupgate_core::StoreError::from(err),
            dedupgate_core::StoreError::Config(_)
        ));
    };

    let (mut config, _) = dedupgate_postgres::parse_url(&url).unwrap();
    config.dbname(format!("{schema}_missing"));
    let err = PgStore::connect(config, common::options(&schema))
        .await
        .unwrap_err();
    refused("missing database", err, "3D000");

    let role = format!("{schema}_role");
    let (mut config, _) = dedupgate_postgres::parse_url(&url).unwrap();
    config.user(&role);
    let err = PgStore::connect(config.clone(), common::options(&schema))
        .await
        .unwrap_err();
    refused("missing role", err, "28000");

    // A role that may log in but not create the store's schema.
    let admin = common::connect(&url).await;
    admin
        .batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN"))
        .await
        .unwrap();
    let err = PgStore::connect(config, common::options(&schema)).await;
    admin
        .batch_execute(&format!("DROP ROLE \"{role}\""))
        .await
        .unwrap();
    refused("role without privileges", err.unwrap_err(), "42501");
}

/// A schema whose functions are not this build's (made by an earlier build of the unreleased
/// v1, which recorded no md5, or by another build) gets this build's functions at open, stale
/// overloads included, and keeps its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_functions_are_replaced_at_open_and_rows_are_kept() {
    use dedupgate_core::{Mark, Op, Outcome, RecordId};

    let url = common::url();
    let schema = common::fresh_schema("functions");
    let (u, s) = (url.clone(), schema.clone());
    common::with_schema_dropped(&url, &schema, async move {
        let store = common::open(&u, &s, 1).await;
        let id = RecordId::new("ns", "kept").unwrap();
        let mark = Op::Mark {
            ttl_ms: 600_000,
            fingerprint: None,
            result: None,
        };
        store.apply_op(id.clone(), mark.clone()).await.unwrap();
        store.close();
        let client = common::connect(&u).await;
        let recorded = recorded_md5(&client, &s).await;
        // As an earlier build left it: no md5 recorded, a function with another body, and an
        // overload this build does not have.
        client
            .batch_execute(&format!(
                "DROP TABLE \"{s}\".dedupgate_schema_functions;
                 CREATE OR REPLACE FUNCTION \"{s}\".dedupgate_get(p_ns bytea, p_key bytea)
                 RETURNS \"{s}\".dedupgate_answer LANGUAGE plpgsql AS $$
                 BEGIN RAISE EXCEPTION 'stale function'; END $$;
                 CREATE FUNCTION \"{s}\".dedupgate_get(p_ns bytea) RETURNS integer
                 LANGUAGE sql AS $$ SELECT 1 $$;"
            ))
            .await
            .unwrap();
        let store = common::open(&u, &s, 1).await;
        match store.apply_op(id.clone(), Op::Get).await {
            Ok(Outcome::Found(Some(record))) => assert_eq!(record.key.as_str(), "kept"),
            other => panic!("get after the functions were replaced: {other:?}"),
        }
        match store.apply_op(id, mark).await {
            Ok(Outcome::Marked(Mark::Duplicate { .. })) => {}
            other => panic!("the row was kept, so a mark is a duplicate: {other:?}"),
        }
        let again = recorded_md5(&client, &s).await;
        assert_eq!(again, recorded, "this build's md5 is recorded again");
        let overloads: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                 WHERE n.nspname = $1::text AND p.proname = 'dedupgate_get'",
                &[&s],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(overloads, 1, "the stale overload is gone");
    })
    .await;
}

async fn recorded_md5(client: &tokio_postgres::Client, schema: &str) -> String {
    client
        .query_one(
            &format!("SELECT md5 FROM \"{schema}\".dedupgate_schema_functions"),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}
