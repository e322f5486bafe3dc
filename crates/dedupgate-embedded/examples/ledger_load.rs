//! The store's side of `dedupgate dedup --ledger embedded:DIR` without the CLI: batches of ledger
//! ops on distinct 64-hex-digit keys (what the CLI sends for keys its window has not seen), in a
//! store that grows to millions of entries. Prints wall and process CPU time per step of keys,
//! so a cost that grows with the store shows, then the CPU time of each thread.
//!
//! `cargo run --release -p dedupgate-embedded --example ledger_load -- DIR KEYS [MODE [STEP]]`
//!
//! MODE: `mark` (at-most-once: one mark per key), `claim` (retriable: each call completes the
//! previous call's claims and claims a new batch), `again` (a re-run: claims of keys 0..KEYS,
//! which a previous run into DIR made known). Batches of 4096 keys, one call at a time.

use dedupgate_core::testkit::ApplyOp;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Op, Outcome, RecordId, Token};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};

// As in the CLI binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BATCH: usize = 4096;
const TTL_MS: u64 = 86_400_000;

fn key(i: u64) -> String {
    // A stand-in for a hex SHA-256: 64 hex digits, spread like a hash.
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5151_5151;
    let mut s = String::with_capacity(64);
    for _ in 0..4 {
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 29;
        s.push_str(&format!("{x:016x}"));
    }
    s
}

/// Clock ticks per second of /proc's CPU times (`USER_HZ`, 100 on Linux).
const TICKS_PER_SEC: f64 = 100.0;

/// User and system CPU time in a /proc `stat` line (after the command's closing parenthesis).
fn stat_cpu_secs(stat: &str) -> Option<(String, f64)> {
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let rest: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
    let ticks: f64 = rest.get(11)?.parse::<f64>().ok()? + rest.get(12)?.parse::<f64>().ok()?;
    Some((stat[open + 1..close].to_owned(), ticks / TICKS_PER_SEC))
}

/// The process's CPU time so far (all threads, user and system).
fn cpu_now() -> Duration {
    let secs = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_cpu_secs(&s))
        .map_or(0.0, |(_, secs)| secs);
    Duration::from_secs_f64(secs)
}

/// CPU seconds of each live thread, by thread name.
fn thread_cpu() -> Vec<(String, f64)> {
    let mut by_name: std::collections::BTreeMap<String, f64> = Default::default();
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        if let Some((name, secs)) = stat_cpu_secs(&stat) {
            *by_name.entry(name).or_default() += secs;
        }
    }
    by_name.into_iter().collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).ok_or("usage: DIR KEYS [MODE [STEP]]")?;
    let keys: u64 = args.get(2).ok_or("KEYS")?.parse()?;
    let mode = args.get(3).map(String::as_str).unwrap_or("mark").to_owned();
    let step: u64 = args
        .get(4)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(500_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let opened = Instant::now();
    let store = EmbeddedStore::open(dir, EmbeddedOptions::default())?;
    eprintln!("open {:.2}s", opened.elapsed().as_secs_f64());
    let owner = "dedup-load".to_owned();
    let (t0, c0) = (Instant::now(), cpu_now());
    let (mut tl, mut cl) = (t0, c0);
    let mut to_complete: Vec<(RecordId, Token)> = Vec::new();
    let (mut new, mut dup) = (0u64, 0u64);
    let mut next = 0u64;
    while next < keys || !to_complete.is_empty() {
        let end = (next + BATCH as u64).min(keys);
        let mut ops: Vec<(RecordId, Op)> = Vec::with_capacity(2 * BATCH);
        let completes = to_complete.len();
        for (id, token) in to_complete.drain(..) {
            ops.push((
                id,
                Op::Complete {
                    token,
                    result: None,
                    ttl_ms: Some(TTL_MS),
                },
            ));
        }
        for i in next..end {
            let id = RecordId::new("dedup", key(i).as_str())?;
            let op = match mode.as_str() {
                "mark" => Op::Mark {
                    ttl_ms: TTL_MS,
                    fingerprint: None,
                    result: None,
                },
                _ => Op::Claim {
                    ttl_ms: TTL_MS,
                    lease_ms: 600_000,
                    fingerprint: None,
                    owner: Some(owner.clone()),
                },
            };
            ops.push((id, op));
        }
        if std::env::var_os("LOAD_SORT").is_some() {
            // Experiment: ops in storage-key order.
            let mut buf = Vec::new();
            let mut keyed: Vec<(Vec<u8>, (RecordId, Op))> = ops
                .drain(completes..)
                .map(|(id, op)| {
                    dedupgate_embedded::codec::encode_id(&id, &mut buf);
                    (buf.clone(), (id, op))
                })
                .collect();
            keyed.sort_by(|a, b| a.0.cmp(&b.0));
            ops.extend(keyed.into_iter().map(|(_, o)| o));
        }
        let ids: Vec<RecordId> = ops[completes..].iter().map(|(id, _)| id.clone()).collect();
        let answers = rt.block_on(store.apply_ops(ops));
        for (i, a) in answers.into_iter().enumerate() {
            match a? {
                Outcome::Claimed(Claim::New(lease)) if mode == "claim" => {
                    new += 1;
                    to_complete.push((ids[i - completes].clone(), lease.token));
                }
                Outcome::Claimed(Claim::New(_)) => new += 1,
                Outcome::Marked(dedupgate_core::Mark::New { .. }) => new += 1,
                Outcome::Completed(_) => {}
                _ => dup += 1,
            }
        }
        let before = next;
        next = end;
        if next / step != before / step || (next == keys && before < keys) {
            let (t, c) = (Instant::now(), cpu_now());
            eprintln!(
                "{next:>10} keys  step wall {:6.2}s cpu {:6.2}s  ({:5.1} us cpu/key)  total wall {:7.2}s cpu {:7.2}s",
                (t - tl).as_secs_f64(),
                (c - cl).as_secs_f64(),
                (c - cl).as_secs_f64() * 1e6 / step as f64,
                (t - t0).as_secs_f64(),
                (c - c0).as_secs_f64()
            );
            let threads: Vec<String> = thread_cpu()
                .into_iter()
                .filter(|(_, secs)| *secs > 0.05)
                .map(|(name, secs)| format!("{name} {secs:.1}"))
                .collect();
            eprintln!(
                "           threads (cumulative cpu s): {}",
                threads.join(", ")
            );
            (tl, cl) = (t, c);
        }
    }
    let (wall, cpu) = (t0.elapsed(), cpu_now() - c0);
    eprintln!(
        "{mode}: {keys} keys, {new} new, {dup} duplicates: wall {:.2}s, cpu {:.2}s ({:.2} us cpu/key)",
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / keys as f64
    );
    for (name, secs) in thread_cpu() {
        if secs > 0.05 {
            eprintln!("  thread {name:<24} {secs:7.2}s");
        }
    }
    let closed = Instant::now();
    drop(store);
    eprintln!("close {:.2}s", closed.elapsed().as_secs_f64());
    Ok(())
}
