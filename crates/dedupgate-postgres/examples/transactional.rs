//! The transactional API: record a payment and its dedup claim in ONE PostgreSQL transaction, so
//! either both exist or neither does. Run it twice: the second run sees a duplicate and skips.
//!
//! ```text
//! cargo run -p dedupgate-postgres --example transactional -- postgres://postgres@127.0.0.1:5432/test
//! ```

use dedupgate_core::{Claim, ClaimOptions, CompleteOptions, Defaults, Outcome, RecordId, ValidOp};
use dedupgate_postgres::tokio_postgres::{self, NoTls};
use dedupgate_postgres::PgStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = PgStore::open(&url).await?;

    // The application's own connection and table.
    let (mut client, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS example_payments (event_id text PRIMARY KEY, amount_cents bigint NOT NULL)",
        )
        .await?;

    let event_id = "stripe_evt_1234";
    let id = RecordId::new("payments", event_id)?;
    let tx = client.transaction().await?;
    // The defaults: a 24 h ttl and a 30 s lease.
    let claim = ValidOp::claim(ClaimOptions::default(), Defaults::default())?;
    match store.claim_in(&tx, id.clone(), claim).await? {
        Claim::Duplicate { record } => {
            println!("{event_id}: duplicate (fence {}), skipped", record.fence);
            tx.rollback().await?;
        }
        Claim::New(lease) => {
            // The business write, in the same transaction as the claim.
            tx.execute(
                "INSERT INTO example_payments (event_id, amount_cents) VALUES ($1, $2)",
                &[&event_id, &1250_i64],
            )
            .await?;
            let complete = CompleteOptions {
                result: Some(serde_json::json!({"amount_cents": 1250})),
                ttl_ms: None,
            };
            let complete = ValidOp::complete(lease.token, complete)?;
            let done = store.apply_in(&tx, id, complete).await?;
            // Both commit together; a crash before this line leaves neither.
            tx.commit().await?;
            if let Outcome::Completed(record) = done {
                println!("{event_id}: processed with fence {}", record.fence);
            }
        }
    }
    Ok(())
}
