//! # dedupgate-torture
//!
//! A harness that tries hard to break dedupgate's promise (an acknowledged key is never lost; no
//! event's effect runs twice inside its window), judged by oracles the gate cannot fool:
//!
//! - [`history`]: [`Event`]s (call and return times, what was asked, what was answered, unknown
//!   outcomes kept as unknown) and the [`Recorder`] that writes them around any store.
//! - [`lin`]: the per-key linearizability checker; its model is [`dedupgate_core::decide`]
//!   replayed on a chosen clock, tokens compared by the claim that issued them. [`linrun`]
//!   records concurrent histories to feed it.
//! - [`ledger`]: the oracle's evidence outside the gate: the fence-checking [`ledger::Sink`]
//!   whose effect ledger is fsync'd per effect, and the per-process [`ledger::AnswerLog`].
//! - [`delivery`]: the [`delivery::Delivery`] a worker consumes and its ordering, shared by the
//!   worker, the faces it delivers through and the oracle.
//! - [`worker`]: a worker process consuming deliveries in the retriable or idempotent ordering.
//! - [`runner`]: the orchestrator that starts gate and worker processes and fires faults
//!   (SIGKILL, SIGSTOP/SIGCONT), counting each, then drains and checks.
//! - [`oracle`]: the checks I1-I5 of issue 7 over the ledger and the answer logs.
//! - [`failover`]: the loss of a Redis failover (primary SIGKILLed, replica promoted), measured.
//! - [`tcpfault`]: a TCP proxy that delays, cuts and truncates a store's connections, counted.
//! - [`cron`]: the `dedupgate run` face as a workload, and its checks.
//! - [`proxyface`]: the Idempotency-Key proxy as a workload, its upstream, and its checks.
//! - [`faces`]: every face (library over a store, HTTP) as a [`dedupgate_core::Store`].
//! - [`storage_faults`]: failed writes and fsyncs (libfiu) and loss of never-synced writes
//!   under the embedded store; [`clock_jumps`]: the gate's clock jumped (libfaketime); both on
//!   the frame of [`faultrun`].
//!
//! What the checks mean and the figures measured with them: `docs/reliability.md`.
//!
//! Every randomized run prints its seed and replays from it.

pub mod clock_jumps;
pub mod cron;
pub mod delivery;
pub mod faces;
pub mod failover;
pub mod fault_cli;
pub mod faultrun;
pub mod history;
pub mod ledger;
pub mod lin;
pub mod linrun;
pub mod oracle;
pub mod proxyface;
pub mod runner;
pub mod storage_faults;
pub mod tcpfault;
pub mod worker;

/// The seed of a randomized run: `DEDUPGATE_TORTURE_SEED` when set (to replay a run), else a
/// fresh one. Printed either way, with what to set to replay it.
pub fn seed(what: &str) -> u64 {
    let seed = std::env::var("DEDUPGATE_TORTURE_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{what}: seed {seed} (replay with DEDUPGATE_TORTURE_SEED={seed})");
    seed
}

pub use history::{wall_ns, Event, Fate, HAnswer, HOp, Recorder};
pub use lin::{check, check_key, LinConfig, Report, Verdict};
