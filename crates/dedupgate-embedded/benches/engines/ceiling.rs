//! The group-commit ceiling: how many durable acknowledgements closed-loop callers can get from
//! this disk when nothing but the commit itself is done. No engine, no decision, no index: each
//! caller sends a 64-byte record to one writer thread and waits; the writer drains the queue
//! (waiting up to 300 µs for as many callers as its last commit answered), writes every record
//! with one `pwrite` of whole pages, `fdatasync`s once, and hands the answers to a thread that
//! wakes the callers (as the store's writer does).
//!
//! Two journals: one that grows (appended records, as fjall's journal grows into its sparse
//! file), and one that only overwrites blocks written and synced before the run (as SQLite's
//! WAL overwrites its frames), the cheapest kind of sync this disk offers. Any store that makes
//! each answer durable before sending it, on this disk with these callers, stays under the
//! better of the two, so the figure bounds what a store could reach here.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

/// Bytes each caller's record takes in the journal.
const RECORD_BYTES: usize = 64;
/// Each commit writes whole pages.
const PAGE_BYTES: usize = 4096;
/// Size of the pre-written journal; writes wrap around inside it.
const PREWRITTEN_BYTES: u64 = 64 << 20;
/// Longest the writer waits to gather the callers its last commit answered.
const GATHER_WAIT_MAX: Duration = Duration::from_micros(300);

#[derive(Clone, Copy, Debug)]
pub enum Journal {
    Appended,
    PreWritten,
}

impl Journal {
    pub fn label(self) -> &'static str {
        match self {
            Journal::Appended => "appended journal",
            Journal::PreWritten => "pre-written journal",
        }
    }
}

/// What one run measured.
pub struct Ceiling {
    pub acks_per_sec: f64,
    pub acks_per_sync: f64,
}

type Request = ([u8; RECORD_BYTES], oneshot::Sender<()>);

/// Runs `tasks` closed-loop callers for `secs` against a bare group-commit writer on a journal
/// in `dir`.
pub fn run(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    journal: Journal,
    tasks: usize,
    secs: f64,
) -> Ceiling {
    let path = dir.join(format!("ceiling-{}", journal.label().replace(' ', "-")));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    if let Journal::PreWritten = journal {
        let zeros = vec![0u8; 1 << 20];
        for i in 0..PREWRITTEN_BYTES / zeros.len() as u64 {
            file.write_all_at(&zeros, i * zeros.len() as u64).unwrap();
        }
        file.sync_all().unwrap();
    }
    let (tx, mut rx) = mpsc::channel::<Request>(4096);
    let writer = std::thread::spawn(move || {
        let (answers, answered) = std::sync::mpsc::channel::<Vec<oneshot::Sender<()>>>();
        let answerer = std::thread::spawn(move || {
            while let Ok(replies) = answered.recv() {
                for reply in replies {
                    let _ = reply.send(());
                }
            }
        });
        let mut batch: Vec<Request> = Vec::new();
        let mut buf: Vec<u8> = Vec::new();
        let (mut offset, mut syncs, mut acks, mut last) = (0u64, 0u64, 0u64, 0usize);
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            let gather_until = Instant::now() + GATHER_WAIT_MAX;
            loop {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(mpsc::error::TryRecvError::Empty)
                        if batch.len() < last && Instant::now() < gather_until =>
                    {
                        std::thread::yield_now()
                    }
                    Err(_) => break,
                }
            }
            buf.clear();
            for (record, _) in &batch {
                buf.extend_from_slice(record);
            }
            // Whole pages, so that no sync rewrites a page the previous one already wrote.
            buf.resize(buf.len().div_ceil(PAGE_BYTES) * PAGE_BYTES, 0);
            if let Journal::PreWritten = journal {
                if offset + buf.len() as u64 > PREWRITTEN_BYTES {
                    offset = 0;
                }
            }
            file.write_all_at(&buf, offset).unwrap();
            file.sync_data().unwrap();
            offset += buf.len() as u64;
            syncs += 1;
            acks += batch.len() as u64;
            last = batch.len();
            // Waking the callers is left to another thread, as the store's writer does, so the
            // writer can gather the first of them while the rest are woken.
            let _ = answers.send(batch.drain(..).map(|(_, reply)| reply).collect());
        }
        drop(answers);
        let _ = answerer.join();
        (syncs, acks)
    });
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(secs);
    rt.block_on(async {
        let mut callers = Vec::new();
        for task in 0..tasks {
            let tx = tx.clone();
            callers.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let mut record = [0u8; RECORD_BYTES];
                    let key = format!("bench:{task}:{n}");
                    record[..key.len()].copy_from_slice(key.as_bytes());
                    let (reply, answered) = oneshot::channel();
                    tx.send((record, reply)).await.unwrap();
                    answered.await.unwrap();
                    n += 1;
                }
            }));
        }
        for c in callers {
            c.await.unwrap();
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    drop(tx);
    let (syncs, acks) = writer.join().unwrap();
    let _ = std::fs::remove_file(path);
    Ceiling {
        acks_per_sec: acks as f64 / elapsed,
        acks_per_sync: acks as f64 / syncs.max(1) as f64,
    }
}
