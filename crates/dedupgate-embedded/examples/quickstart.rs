//! The README's library quickstart on the embedded durable store:
//! `cargo run -p dedupgate-embedded --example quickstart`.
//!
//! Run it twice: the second run finds both events already handled in ./dedupgate-example-data, because
//! every answer was fsync'd before it was given.

use dedupgate_core::{Gate, Mode, Run};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gate = Gate::new(EmbeddedStore::open(
        "./dedupgate-example-data",
        EmbeddedOptions::default(),
    )?);

    // Retriable: claim, run, complete with the value (or release on error so a redelivery retries).
    let charge = gate
        .run("payments", "evt_1", Mode::Retriable, || async {
            println!("charging the card for evt_1");
            Ok::<_, std::io::Error>("ch_1".to_string())
        })
        .await?;
    match &charge {
        Run::Ran(id) => println!("evt_1 ran: {id}"),
        Run::Duplicate(record) => {
            println!("evt_1 is a duplicate; stored result {:?}", record.result)
        }
    }

    // Idempotent: the mark is set before the trade is placed; a failed attempt is never retried.
    let trade = gate
        .run(
            "trades",
            "ETH_momentum_2026-03-01T14:30:00Z",
            Mode::Idempotent,
            || async {
                println!("placing the trade");
                Ok::<_, std::io::Error>(())
            },
        )
        .await?;
    println!("trade ran this time: {}", trade.ran());
    Ok(())
}
