//! The loss of a Redis failover, measured: marks are acknowledged by a primary under load, the
//! primary is SIGKILLed mid-load, its replica is promoted (`REPLICAOF NO ONE`), and every
//! acknowledged mark is looked up on the promoted replica. Redis replicates asynchronously, so
//! acknowledged marks the replica had not received yet are lost; `wait_replicas=1` makes the
//! gate wait for the replica before it answers (an unacknowledged write is then `unavailable`,
//! which is not a loss).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupgate_core::{Defaults, Mark, MarkOptions, Outcome, RecordId, Store, ValidOp};
use dedupgate_redis::testkit::{free_port, RedisServer};
use dedupgate_redis::RedisStore;
use serde::Serialize;

/// One measured failover.
#[derive(Clone, Debug, Serialize)]
pub struct FailoverReport {
    /// `wait_replicas` of the gate.
    pub wait_replicas: u32,
    /// Marks the primary acknowledged (answered "new").
    pub acknowledged: u64,
    /// Of which absent on the promoted replica.
    pub lost: u64,
    /// Marks answered `unavailable` (not acknowledged: not a loss).
    pub unavailable: u64,
    /// How long the load ran before the kill, ms.
    pub load_ms: u64,
    /// How long the replica was stopped before the kill, ms.
    pub replica_stall_ms: u64,
}

/// Why a measurement could not be made.
#[derive(Debug, thiserror::Error)]
pub enum FailoverError {
    /// Starting or driving a server failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The store would not open.
    #[error("redis: {0}")]
    Open(String),
    /// The replica never caught up with its primary.
    #[error("the replica did not link to its primary within 10 s")]
    NoLink,
}

/// Measures one failover: `clients` concurrent writers for `load_ms`, then the kill.
///
/// With `replica_stall_ms > 0` the replica is SIGSTOPped for the last `replica_stall_ms` of the
/// load (a replica that fell behind: a slow link, a pause), then resumed after the kill.
pub async fn measure(
    wait_replicas: u32,
    clients: usize,
    load_ms: u64,
    replica_stall_ms: u64,
) -> Result<FailoverReport, FailoverError> {
    let primary_dir = tempdir()?;
    let replica_dir = tempdir()?;
    let mut primary = RedisServer::start_in(&primary_dir, free_port(), &["--appendonly", "no"])?;
    let primary_port = primary.port().to_string();
    let replica = RedisServer::start_in(
        &replica_dir,
        free_port(),
        &[
            "--appendonly",
            "no",
            "--replicaof",
            "127.0.0.1",
            &primary_port,
        ],
    )?;
    let linked = Instant::now();
    while !replica
        .cli(&["INFO", "replication"])?
        .contains("master_link_status:up")
    {
        if linked.elapsed() > Duration::from_secs(10) {
            return Err(FailoverError::NoLink);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!(
        "{}?wait_replicas={wait_replicas}&wait_timeout_ms=200",
        primary.url()
    );
    let store: Arc<dyn Store> = Arc::new(
        RedisStore::open(&url)
            .await
            .map_err(|e| FailoverError::Open(e.to_string()))?,
    );
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let unavailable = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (store, acked, unavailable, stop) = (
            store.clone(),
            acked.clone(),
            unavailable.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let key = format!("c{c}-{n}");
                let Ok(id) = RecordId::new("failover", key.clone()) else {
                    continue;
                };
                let op = MarkOptions {
                    ttl_ms: Some(3_600_000),
                    ..Default::default()
                };
                let op = ValidOp::mark(op, Defaults::default()).expect("a valid mark");
                match store.apply(id, op).await {
                    Ok(Outcome::Marked(Mark::New { .. })) => {
                        acked.lock().unwrap_or_else(|p| p.into_inner()).push(key)
                    }
                    Ok(_) => {}
                    Err(_) => {
                        unavailable.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                    }
                }
            }
        }));
    }
    let signal = |sig| {
        if let Some(pid) = replica
            .pid()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, sig);
        }
    };
    tokio::time::sleep(Duration::from_millis(
        load_ms.saturating_sub(replica_stall_ms),
    ))
    .await;
    if replica_stall_ms > 0 {
        signal(rustix::process::Signal::STOP);
        tokio::time::sleep(Duration::from_millis(replica_stall_ms)).await;
    }
    // SIGKILL under load, then promote the replica.
    primary.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if replica_stall_ms > 0 {
        signal(rustix::process::Signal::CONT);
    }
    for t in tasks {
        let _ = t.await;
    }
    replica.cli(&["REPLICAOF", "NO", "ONE"])?;
    let promoted: Arc<dyn Store> = Arc::new(
        RedisStore::open(&replica.url())
            .await
            .map_err(|e| FailoverError::Open(e.to_string()))?,
    );
    let keys = acked.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut lost = 0u64;
    for key in &keys {
        let id = RecordId::new("failover", key.clone()).expect("made valid above");
        match promoted.apply(id, ValidOp::get()).await {
            Ok(Outcome::Found(Some(_))) => {}
            _ => lost += 1,
        }
    }
    drop(primary);
    drop(replica);
    let _ = std::fs::remove_dir_all(&primary_dir);
    let _ = std::fs::remove_dir_all(&replica_dir);
    Ok(FailoverReport {
        wait_replicas,
        acknowledged: keys.len() as u64,
        lost,
        unavailable: unavailable.load(std::sync::atomic::Ordering::Relaxed),
        load_ms,
        replica_stall_ms,
    })
}

fn tempdir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "dedupgate-failover-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
