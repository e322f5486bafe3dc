//! The crash test: a child process claims, completes and marks keys as fast as it can, printing
//! each key only after its answer returned; the parent SIGKILLs it at random moments, reopens the
//! store, and checks that every acknowledged key is present with its state and fence.
//!
//! The child is this test binary run again with `DG_CRASH_DIR` set (see `crash_child_entry`).
//! `DG_CRASH_SEED` replays a run; `DG_CRASH_ITERS` changes the number of kills (default 50).

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, Mark, Op, Outcome, RecordId, State, Store};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
use rand::{Rng, SeedableRng};

const NS: &str = "crash";
const CHILD_TASKS: usize = 16;

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: 86_400_000,
        lease_ms: 3_600_000,
        fingerprint: None,
        owner: None,
    }
}

/// The child's body; a no-op unless run by `sigkill_at_random_moments_loses_no_acknowledged_key`.
#[test]
fn crash_child_entry() {
    let Ok(dir) = std::env::var("DG_CRASH_DIR") else {
        return;
    };
    let seed: u64 = std::env::var("DG_CRASH_SEED").unwrap().parse().unwrap();
    let prefix = std::env::var("DG_CRASH_PREFIX").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = std::sync::Arc::new(
            EmbeddedStore::open(Path::new(&dir), EmbeddedOptions::default()).unwrap(),
        );
        println!("READY");
        let tasks = (0..CHILD_TASKS).map(|t| {
            let store = store.clone();
            let prefix = prefix.clone();
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((t as u64) << 32));
                for n in 0u64.. {
                    let action = ["c", "cc", "m"][rng.gen_range(0..3)];
                    let key = format!("{action}-{prefix}-{t}-{n}");
                    let id = RecordId::new(NS, key.clone()).unwrap();
                    let say = |what: &str, fence: u64| {
                        let mut out = std::io::stdout().lock();
                        writeln!(out, "{what} {key} {fence}").unwrap();
                        out.flush().unwrap();
                    };
                    if action == "m" {
                        let op = Op::Mark {
                            ttl_ms: 86_400_000,
                            fingerprint: None,
                            result: Some(serde_json::json!({"n": n})),
                        };
                        match store.apply_op(id, op).await {
                            Ok(Outcome::Marked(Mark::New { record })) => say("mark", record.fence),
                            other => panic!("mark {key}: {other:?}"),
                        }
                        continue;
                    }
                    let lease = match store.apply_op(id.clone(), claim_op()).await {
                        Ok(Outcome::Claimed(Claim::New(lease))) => lease,
                        other => panic!("claim {key}: {other:?}"),
                    };
                    say("claim", lease.fence);
                    if action == "cc" {
                        let op = Op::Complete {
                            token: lease.token,
                            result: Some(serde_json::json!(n)),
                            ttl_ms: None,
                        };
                        match store.apply_op(id, op).await {
                            Ok(Outcome::Completed(r)) => say("complete", r.fence),
                            other => panic!("complete {key}: {other:?}"),
                        }
                    }
                }
            })
        });
        for t in tasks.collect::<Vec<_>>() {
            t.await.unwrap();
        }
    });
}

/// What the parent knows about a key from the child's acknowledged answers.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Acked {
    fence: u64,
    completed: bool,
}

#[test]
fn sigkill_at_random_moments_loses_no_acknowledged_key() {
    let seed: u64 = std::env::var("DG_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    let iters: usize = std::env::var("DG_CRASH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    eprintln!("crash test seed {seed} (replay with DG_CRASH_SEED={seed}), {iters} kills");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut all: HashMap<String, Acked> = HashMap::new();
    let started = Instant::now();
    let mut kills_after_ready = 0;
    for iter in 0..iters {
        let iter_started = Instant::now();
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("DG_CRASH_DIR", &dir)
            .env(
                "DG_CRASH_SEED",
                (seed.wrapping_add(iter as u64)).to_string(),
            )
            .env("DG_CRASH_PREFIX", format!("i{iter}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    // A line cut by the kill was never fully acknowledged: ignore it.
                    Ok(_) if buf.last() != Some(&b'\n') => break,
                    Ok(_) => {
                        let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                        // libtest may print "test crash_child_entry ... " just before it.
                        if line.ends_with("READY") {
                            let _ = ready_tx.send(());
                        } else if line.starts_with("claim ")
                            || line.starts_with("complete ")
                            || line.starts_with("mark ")
                        {
                            lines.push(line);
                        }
                    }
                }
            }
            lines
        });
        // Most kills land while the child is hammering; some land during its open (recovery).
        if rng.gen_bool(0.15) {
            std::thread::sleep(Duration::from_millis(rng.gen_range(0..40)));
        } else {
            ready_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("child never became ready");
            kills_after_ready += 1;
            std::thread::sleep(Duration::from_millis(rng.gen_range(2..150)));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let lines = reader.join().unwrap();
        let mut this_run: HashMap<String, Acked> = HashMap::new();
        for line in &lines {
            let mut parts = line.split(' ');
            let (what, key, fence) = (
                parts.next().unwrap(),
                parts.next().unwrap().to_owned(),
                parts.next().unwrap().parse::<u64>().unwrap(),
            );
            let acked = Acked {
                fence,
                completed: what != "claim",
            };
            this_run.insert(key, acked);
        }
        let killed_after = iter_started.elapsed();
        let store = EmbeddedStore::open(&dir, EmbeddedOptions::default())
            .unwrap_or_else(|e| panic!("seed {seed} iter {iter}: the store did not reopen: {e}"));
        rt.block_on(async {
            store.health().await.unwrap();
            for (key, acked) in &this_run {
                check(&store, key, acked, seed, iter).await;
            }
            // And a sample of earlier runs' keys: later crashes must not lose them either.
            for (key, acked) in all.iter().take(200) {
                check(&store, key, acked, seed, iter).await;
            }
        });
        drop(store);
        eprintln!(
            "iter {iter}: {} acknowledged keys checked ({} lines); killed after {killed_after:?}, \
             checked after {:?}",
            this_run.len(),
            lines.len(),
            iter_started.elapsed()
        );
        all.extend(this_run);
    }
    eprintln!(
        "crash test: {iters} kills ({kills_after_ready} while hammering), {} keys checked, {:?}",
        all.len(),
        started.elapsed()
    );
    assert!(
        all.len() >= iters,
        "the child acknowledged too little to test anything"
    );
}

async fn check(store: &EmbeddedStore, key: &str, acked: &Acked, seed: u64, iter: usize) {
    let id = RecordId::new(NS, key).unwrap();
    let found = match store.apply_op(id, Op::Get).await {
        Ok(Outcome::Found(r)) => r,
        other => panic!("seed {seed} iter {iter}: get {key}: {other:?}"),
    };
    let record = found.unwrap_or_else(|| {
        panic!("seed {seed} iter {iter}: acknowledged key {key} ({acked:?}) is missing")
    });
    assert_eq!(record.fence, acked.fence, "seed {seed} iter {iter}: {key}");
    let may_have_completed = key.starts_with("cc-") || key.starts_with("m-");
    match (acked.completed, record.state) {
        (true, State::Completed) => {}
        (false, State::InProgress) => {}
        // A complete that committed but whose answer was cut by the kill.
        (false, State::Completed) if may_have_completed => {}
        (_, state) => panic!("seed {seed} iter {iter}: {key} acked {acked:?} but is {state:?}"),
    }
}
