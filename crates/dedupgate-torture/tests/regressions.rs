//! Defects the harness found in other crates, kept as failing tests until they are fixed there.
//! Each is `#[ignore]`d with its reason; run them with `cargo test -p dedupgate-torture --test
//! regressions -- --ignored`.
//!
//! None is open now. Fixed and moved to the crate they belong to:
//!
//! - PostgreSQL decided an operation on a clock read taken before it waited for a row lock (a
//!   claim that waited while a record expired answered "duplicate" with the expired record; a
//!   claim granted after a wait got a lease that started in the past). The functions now read
//!   the clock once the row lock is held: `crates/dedupgate-postgres/tests/clock.rs`.
