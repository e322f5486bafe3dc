//! # dedupgate-core
//!
//! The gate's semantics, once, with no I/O of its own:
//!
//! - [`model`]: [`RecordId`] (a validated [`Namespace`] and [`Key`]), the public [`Record`] and
//!   the stored [`Entry`] (which, unlike a record, keeps the holder's [`Token`]).
//! - [`op`]: the operations ([`Op`]) and what they produce ([`Outcome`], [`Claim`], [`Mark`]).
//! - [`valid`]: the one way in — a request's options ([`ClaimOptions`], [`MarkOptions`], …)
//!   and the [`Defaults`] become a [`ValidOp`], checked once; stores take only that.
//! - [`decide()`]: the pure function every store applies atomically — current entry, op, the
//!   store's clock in, answer and [`Change`] out.
//! - [`Store`]: the trait each store implements; [`MemoryStore`] is the reference model.
//! - [`ledger`]: [`KeySet`], what a store may offer `dedup`'s ledger beyond [`Store`].
//! - [`Gate`]: the library face — typed calls and [`Gate::run`], which wraps a handler in the
//!   retriable or idempotent ordering.
//! - [`Clock`]: the injectable time source ([`SystemClock`], [`ManualClock`] for tests).
//! - [`keys`]: [`KeyTemplate`] (`{asset}_{ts|window:5m}`), deterministic ids ([`record_id`],
//!   equal to Python's `json.dumps(…, sort_keys=True)` recipe) and [`parse_duration_ms`].
//! - `testkit` (feature): the conformance suite every store must pass.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use dedupgate_core::{Claim, ClaimOptions, Gate, MemoryStore};
//! let gate = Gate::new(MemoryStore::new());
//! let Claim::New(lease) = gate.claim("payments", "evt_1", ClaimOptions::default()).await? else {
//!     unreachable!("a fresh key is new")
//! };
//! // ... charge the card, passing lease.fence downstream ...
//! gate.complete("payments", "evt_1", &lease.token, Some(serde_json::json!({"charge": "ch_1"}))).await?;
//! let again = gate.claim("payments", "evt_1", ClaimOptions::default()).await?;
//! assert!(matches!(again, Claim::Duplicate { .. }));
//! # Ok::<(), dedupgate_core::GateError>(())
//! # }).unwrap();
//! ```

pub mod clock;
pub mod coalesce;
pub mod decide;
pub mod error;
pub mod gate;
pub mod keys;
pub mod ledger;
pub mod memory;
pub mod model;
pub mod op;
pub mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod valid;

pub use clock::{Clock, ManualClock, SystemClock};
pub use coalesce::{CoalesceLimits, Coalescer};
pub use decide::{decide, next_fence, Change, Decision, COMPLETE_GRACE_MS};
pub use error::{GateError, InvalidInput, StoreError};
pub use gate::{Gate, Mode, Run, RunError};
pub use keys::{parse_duration_ms, record_id, KeyFields, KeyTemplate};
pub use ledger::{KeyId, KeySet, KeySetCall};
pub use memory::MemoryStore;
pub use model::{Entry, EntryState, Key, Namespace, Record, RecordId, State, Token};
pub use op::{Claim, Lease, Mark, Op, Outcome};
pub use store::{Store, StoreStats, BATCH_OPS_MAX};
pub use valid::{ClaimOptions, CompleteOptions, Defaults, MarkOptions, Request, ValidOp};
