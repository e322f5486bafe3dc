//! `cargo bench -p dedupgate-embedded`: claims/s and latency of the memory and embedded stores,
//! beside the baselines measured in the same run (the disk's fsync rate, SQLite one transaction
//! per key, Redis `SET NX EX`), and the engine comparison (redb and SQLite under the same
//! group-commit writer). Prints markdown. Not a test: it asserts nothing.
//!
//! Environment: `DG_BENCH_DIR` (where the stores and the fsync file live; default: the system's
//! temporary directory), `DG_BENCH_SECS` (seconds per scenario, default 2),
//! `DG_BENCH_REDIS` (`host:port`, default `127.0.0.1:6379`; `off` skips it), `DG_BENCH_ONLY`
//! (`engines`: the baselines, the ceiling and the engine comparison; `ceiling`: the baselines and
//! the ceiling only).

use dedupgate_core::testkit::ApplyOp;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, MemoryStore, Op, Outcome, RecordId, Store};
use dedupgate_embedded::engine::{Engine, EngineError, EngineOpener, Txn, TxnBody};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore};
use rand::{Rng, SeedableRng};
use redb::{
    Database, Durability, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};

#[path = "engines/ceiling.rs"]
mod ceiling;
#[path = "engines/wal_redb.rs"]
mod wal_redb;
use wal_redb::WalRedbEngine;

#[derive(Clone, Copy, Debug)]
enum Workload {
    Unique,
    Dup90,
}

impl Workload {
    fn label(self) -> &'static str {
        match self {
            Workload::Unique => "unique keys",
            Workload::Dup90 => "90% duplicates",
        }
    }
}

struct Figures {
    ops: u64,
    new: u64,
    secs: f64,
    p50_us: f64,
    p99_us: f64,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.secs
    }
}

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: 86_400_000,
        lease_ms: 30_000,
        fingerprint: None,
        owner: None,
    }
}

/// Runs `tasks` closed-loop callers for `secs`, each claiming as fast as its answers come back.
async fn drive(
    store: Arc<dyn Store>,
    ns: &str,
    workload: Workload,
    tasks: usize,
    secs: f64,
) -> Figures {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let store = store.clone();
            let ns = ns.to_owned();
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
                let mut latencies_ns: Vec<u64> = Vec::with_capacity(1 << 16);
                let mut next_key = 0u64;
                let mut new = 0u64;
                while Instant::now() < deadline {
                    let k = match workload {
                        Workload::Dup90 if next_key > 0 && rng.gen_bool(0.9) => {
                            rng.gen_range(0..next_key)
                        }
                        _ => {
                            next_key += 1;
                            next_key - 1
                        }
                    };
                    let id = RecordId::new(ns.as_str(), format!("t{t}-k{k}")).unwrap();
                    let at = Instant::now();
                    let answer = store.apply_op(id, claim_op()).await;
                    latencies_ns.push(at.elapsed().as_nanos() as u64);
                    match answer {
                        Ok(Outcome::Claimed(Claim::New(_))) => new += 1,
                        Ok(Outcome::Claimed(Claim::Duplicate { .. })) => {}
                        other => panic!("claim failed: {other:?}"),
                    }
                }
                (latencies_ns, new)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut new = 0;
    for h in handles {
        let (l, n) = h.await.unwrap();
        all.extend(l);
        new += n;
    }
    let secs = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)] as f64 / 1000.0;
    Figures {
        ops: all.len() as u64,
        new,
        secs,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    }
}

/// The disk's sync rate: 4 KiB write + fdatasync, in a loop, on a file in `dir`.
fn fsync_rate(dir: &Path, secs: f64) -> f64 {
    let path = dir.join("fsync-probe");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![7u8; 4096];
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed().as_secs_f64() < secs {
        f.write_all(&block).unwrap();
        f.sync_data().unwrap();
        n += 1;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_file(path);
    rate
}

/// The seeds' "minimum viable gate": SQLite, WAL, synchronous=FULL, `INSERT OR IGNORE`, one
/// transaction per key.
fn sqlite_per_key_rate(dir: &Path, secs: f64) -> f64 {
    let path = dir.join("sqlite-per-key.db");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", "FULL").unwrap();
    conn.execute(
        "CREATE TABLE IF NOT EXISTS seen (k TEXT PRIMARY KEY, expires_at INTEGER)",
        [],
    )
    .unwrap();
    let mut stmt = conn
        .prepare("INSERT OR IGNORE INTO seen (k, expires_at) VALUES (?1, ?2)")
        .unwrap();
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed().as_secs_f64() < secs {
        stmt.execute(rusqlite::params![format!("key-{n}"), 86_400_000i64])
            .unwrap();
        n += 1;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop(stmt);
    drop(conn);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    rate
}

/// `redis-benchmark -c 50 -P 1 … SET key:__rand_int__ 1 NX EX 86400`, parsed requests/s.
fn redis_set_nx_rate(addr: &str) -> Result<f64, String> {
    let (host, port) = addr
        .split_once(':')
        .ok_or("DG_BENCH_REDIS must be host:port")?;
    let out = std::process::Command::new("redis-benchmark")
        .args([
            "-h", host, "-p", port, "-c", "50", "-P", "1", "-n", "100000", "-r", "1000000",
        ])
        .args(["-q", "SET", "key:__rand_int__", "1", "NX", "EX", "86400"])
        .output()
        .map_err(|e| format!("redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // With -q the summary is "…: 71428.57 requests per second, p50=…" after \r progress lines.
    let summary = text
        .split(['\r', '\n'])
        .rfind(|l| l.contains("requests per second"))
        .ok_or_else(|| format!("no rate in redis-benchmark output: {text}"))?;
    let before = summary.split("requests per second").next().unwrap_or("");
    before
        .split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("cannot parse {summary:?}"))
}

const ENTRIES_TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
const EXPIRY_TABLE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("expiry");
const META_TABLE: TableDefinition<&str, u64> = TableDefinition::new("meta");

fn redb_err(e: impl Into<redb::Error>) -> EngineError {
    match e.into() {
        redb::Error::Io(io) => EngineError::Io(io),
        redb::Error::Corrupted(s) => EngineError::Corrupt(s),
        other => EngineError::Other(format!("redb: {other}")),
    }
}

/// redb: a copy-on-write B-tree in one file; each commit with [`Durability::Immediate`] is made
/// durable with one fsync (a checksummed commit slot, then a header flip).
struct RedbEngine {
    db: Database,
    path: PathBuf,
}

impl RedbEngine {
    /// Opens the database file at `path`, creating it when it does not exist. An existing file
    /// that is not a redb database is refused, never overwritten.
    fn open(path: &Path) -> Result<Self, EngineError> {
        let mut builder = Database::builder();
        // The working set of a gate is its live keys; 256 MiB of page cache keeps lookups off
        // the disk for tens of millions of small entries without claiming the machine's memory.
        builder.set_cache_size(256 << 20);
        let db = if path.exists() {
            builder.open(path).map_err(redb_err)?
        } else {
            builder.create(path).map_err(redb_err)?
        };
        Ok(Self {
            db,
            path: path.to_owned(),
        })
    }
}

struct RedbTxn<'t> {
    entries: redb::Table<'t, &'static [u8], &'static [u8]>,
    expiry: redb::Table<'t, &'static [u8], &'static [u8]>,
    meta: redb::Table<'t, &'static str, u64>,
}

impl Txn for RedbTxn<'_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        match self.entries.get(id).map_err(redb_err)? {
            Some(v) => {
                out.clear();
                out.extend_from_slice(v.value());
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.entries.insert(id, value).map_err(redb_err)?;
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.entries.remove(id).map_err(redb_err)?;
        Ok(())
    }

    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError> {
        self.expiry.insert(key, record).map_err(redb_err)?;
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.expiry.remove(key).map_err(redb_err)?;
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        for item in self
            .expiry
            .range::<&[u8]>(..bound)
            .map_err(redb_err)?
            .take(max)
        {
            let (k, v) = item.map_err(redb_err)?;
            out.push((k.value().to_vec(), v.value().to_vec()));
        }
        Ok(())
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        Ok(self.meta.get(name).map_err(redb_err)?.map(|v| v.value()))
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        self.meta.insert(name, value).map_err(redb_err)?;
        Ok(())
    }

    fn is_empty(&mut self) -> Result<bool, EngineError> {
        self.entries.is_empty().map_err(redb_err)
    }
}

fn open_tables(txn: &WriteTransaction) -> Result<RedbTxn<'_>, EngineError> {
    Ok(RedbTxn {
        entries: txn.open_table(ENTRIES_TABLE).map_err(redb_err)?,
        expiry: txn.open_table(EXPIRY_TABLE).map_err(redb_err)?,
        meta: txn.open_table(META_TABLE).map_err(redb_err)?,
    })
}

impl Engine for RedbEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let mut txn = self.db.begin_write().map_err(redb_err)?;
        txn.set_durability(Durability::Immediate);
        let commit = {
            let mut tables = open_tables(&txn)?;
            body(&mut tables)?
        };
        if commit {
            txn.commit().map_err(redb_err)?;
        } else {
            txn.abort().map_err(redb_err)?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("redb {}", self.path.display())
    }
}

fn fjall_err(e: fjall::Error) -> EngineError {
    match e {
        fjall::Error::Io(io) => EngineError::Io(io),
        other => EngineError::Other(format!("fjall: {other:?}")),
    }
}

/// fjall through `Batch::commit` (measured for comparison only: it swallows journal write
/// errors, see `docs/embedded-engine.md`). A commit appends the batch to the journal (one sequential
/// write) and fdatasyncs it; memtables are flushed to sorted segments in the background. The
/// journal makes a commit cost one small sequential write however scattered the batch's keys are,
/// which is why it was chosen (see `docs/embedded-engine.md`).
struct FjallBatchEngine {
    keyspace: fjall::Keyspace,
    entries: fjall::PartitionHandle,
    expiry: fjall::PartitionHandle,
    meta: fjall::PartitionHandle,
    path: PathBuf,
}

impl FjallBatchEngine {
    /// Opens the keyspace in directory `path`, creating it when it does not exist and replaying
    /// its journal after a crash.
    fn open(path: &Path) -> Result<Self, EngineError> {
        let keyspace = fjall::Config::new(path)
            // Journals are replayed on open: bounding them bounds recovery time after a crash.
            .max_journaling_size(64 << 20)
            .max_write_buffer_size(32 << 20)
            .cache_size(64 << 20)
            // Durability comes from the writer's SyncData at each commit, nothing periodic.
            .fsync_ms(None)
            .open()
            .map_err(fjall_err)?;
        let opts = fjall::PartitionCreateOptions::default;
        let entries = keyspace
            .open_partition("entries", opts())
            .map_err(fjall_err)?;
        let expiry = keyspace
            .open_partition("expiry", opts())
            .map_err(fjall_err)?;
        let meta = keyspace.open_partition("meta", opts()).map_err(fjall_err)?;
        Ok(Self {
            keyspace,
            entries,
            expiry,
            meta,
            path: path.to_owned(),
        })
    }
}

struct FjallTxn<'e> {
    engine: &'e FjallBatchEngine,
    batch: fjall::Batch,
}

impl Txn for FjallTxn<'_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        match self.engine.entries.get(id).map_err(fjall_err)? {
            Some(v) => {
                out.clear();
                out.extend_from_slice(&v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.batch.insert(&self.engine.entries, id, value);
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.batch.remove(&self.engine.entries, id);
        Ok(())
    }

    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError> {
        self.batch.insert(&self.engine.expiry, key, record);
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.batch.remove(&self.engine.expiry, key);
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        for item in self.engine.expiry.range(..bound).take(max) {
            let (k, v) = item.map_err(fjall_err)?;
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(())
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        match self.engine.meta.get(name).map_err(fjall_err)? {
            Some(v) => {
                let bytes: [u8; 8] = v.as_ref().try_into().map_err(|_| {
                    EngineError::Corrupt(format!("meta {name} holds {} bytes, not 8", v.len()))
                })?;
                Ok(Some(u64::from_le_bytes(bytes)))
            }
            None => Ok(None),
        }
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        self.batch
            .insert(&self.engine.meta, name, value.to_le_bytes());
        Ok(())
    }

    fn is_empty(&mut self) -> Result<bool, EngineError> {
        self.engine.entries.is_empty().map_err(fjall_err)
    }
}

impl Engine for FjallBatchEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let mut txn = FjallTxn {
            engine: self,
            batch: self.keyspace.batch(),
        };
        if body(&mut txn)? {
            // One journal append, then fdatasync; a failure poisons the keyspace (fail closed).
            txn.batch
                .durability(Some(fjall::PersistMode::SyncData))
                .commit()
                .map_err(fjall_err)?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("fjall {}", self.path.display())
    }
}

/// SQLite as an [`Engine`], so the comparison runs it under the very same writer as redb.
struct SqliteEngine {
    conn: rusqlite::Connection,
    path: PathBuf,
}

fn sql_err(e: rusqlite::Error) -> EngineError {
    EngineError::Other(format!("sqlite: {e}"))
}

impl SqliteEngine {
    fn open(path: &Path) -> Result<Self, EngineError> {
        let conn = rusqlite::Connection::open(path).map_err(sql_err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sql_err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sql_err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS entries (id BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS expiry (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, v INTEGER NOT NULL);",
        )
        .map_err(sql_err)?;
        Ok(Self {
            conn,
            path: path.to_owned(),
        })
    }
}

struct SqliteTxn<'a> {
    tx: &'a rusqlite::Transaction<'a>,
}

impl Txn for SqliteTxn<'_> {
    fn get(&mut self, id: &[u8], out: &mut Vec<u8>) -> Result<bool, EngineError> {
        let mut st = self
            .tx
            .prepare_cached("SELECT v FROM entries WHERE id = ?1")
            .map_err(sql_err)?;
        let mut rows = st.query([id]).map_err(sql_err)?;
        match rows.next().map_err(sql_err)? {
            Some(row) => {
                let v = row
                    .get_ref(0)
                    .map_err(sql_err)?
                    .as_blob()
                    .map_err(|e| EngineError::Corrupt(format!("sqlite: {e}")))?;
                out.clear();
                out.extend_from_slice(v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn put(&mut self, id: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.tx
            .prepare_cached("INSERT OR REPLACE INTO entries (id, v) VALUES (?1, ?2)")
            .map_err(sql_err)?
            .execute(rusqlite::params![id, value])
            .map_err(sql_err)?;
        Ok(())
    }

    fn remove(&mut self, id: &[u8]) -> Result<(), EngineError> {
        self.tx
            .prepare_cached("DELETE FROM entries WHERE id = ?1")
            .map_err(sql_err)?
            .execute([id])
            .map_err(sql_err)?;
        Ok(())
    }

    fn index_put(&mut self, key: &[u8], record: &[u8]) -> Result<(), EngineError> {
        self.tx
            .prepare_cached("INSERT OR REPLACE INTO expiry (k, v) VALUES (?1, ?2)")
            .map_err(sql_err)?
            .execute([key, record])
            .map_err(sql_err)?;
        Ok(())
    }

    fn index_remove(&mut self, key: &[u8]) -> Result<(), EngineError> {
        self.tx
            .prepare_cached("DELETE FROM expiry WHERE k = ?1")
            .map_err(sql_err)?
            .execute([key])
            .map_err(sql_err)?;
        Ok(())
    }

    fn index_before(
        &mut self,
        bound: &[u8],
        max: usize,
        out: &mut Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        let mut st = self
            .tx
            .prepare_cached("SELECT k, v FROM expiry WHERE k < ?1 ORDER BY k LIMIT ?2")
            .map_err(sql_err)?;
        let rows = st
            .query_map(rusqlite::params![bound, max as i64], |r| {
                Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, Vec<u8>>(1)?))
            })
            .map_err(sql_err)?;
        for r in rows {
            out.push(r.map_err(sql_err)?);
        }
        Ok(())
    }

    fn meta_get(&mut self, name: &str) -> Result<Option<u64>, EngineError> {
        let mut st = self
            .tx
            .prepare_cached("SELECT v FROM meta WHERE name = ?1")
            .map_err(sql_err)?;
        let mut rows = st.query([name]).map_err(sql_err)?;
        match rows.next().map_err(sql_err)? {
            Some(row) => Ok(Some(row.get::<_, i64>(0).map_err(sql_err)? as u64)),
            None => Ok(None),
        }
    }

    fn meta_put(&mut self, name: &str, value: u64) -> Result<(), EngineError> {
        self.tx
            .prepare_cached("INSERT OR REPLACE INTO meta (name, v) VALUES (?1, ?2)")
            .map_err(sql_err)?
            .execute(rusqlite::params![name, value as i64])
            .map_err(sql_err)?;
        Ok(())
    }

    fn is_empty(&mut self) -> Result<bool, EngineError> {
        let n: i64 = self
            .tx
            .query_row(
                "SELECT COUNT(*) FROM (SELECT 1 FROM entries LIMIT 1)",
                [],
                |r| r.get(0),
            )
            .map_err(sql_err)?;
        Ok(n == 0)
    }
}

impl Engine for SqliteEngine {
    fn write(&mut self, body: &mut TxnBody<'_>) -> Result<(), EngineError> {
        let tx = self.conn.transaction().map_err(sql_err)?;
        let commit = body(&mut SqliteTxn { tx: &tx })?;
        if commit {
            tx.commit().map_err(sql_err)?;
        } else {
            tx.rollback().map_err(sql_err)?;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }
}

/// The allocator the `dedupgate` binary ships with, so the figures are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    let secs: f64 = std::env::var("DG_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let base = std::env::var_os("DG_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("dedupgate-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let redis = std::env::var("DG_BENCH_REDIS").unwrap_or_else(|_| "127.0.0.1:6379".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();

    let only = std::env::var("DG_BENCH_ONLY").unwrap_or_default();
    let only_engines = only == "engines";
    let only_ceiling = only == "ceiling";
    eprintln!("baselines…");
    let fsync = fsync_rate(&dir, secs);
    let sqlite = sqlite_per_key_rate(&dir, secs.max(3.0));
    let redis_rate = if redis == "off" {
        Err("skipped (DG_BENCH_REDIS=off)".to_owned())
    } else {
        redis_set_nx_rate(&redis)
    };

    eprintln!("group-commit ceiling…");
    let mut ceilings = Vec::new();
    for journal in [ceiling::Journal::Appended, ceiling::Journal::PreWritten] {
        ceilings.push((journal, ceiling::run(&rt, &dir, journal, 64, secs)));
    }

    let mut rows = Vec::new();
    let mut embedded_64_unique = 0.0;
    let mut commits_note = String::new();
    let store_names: &[&str] = if only_engines || only_ceiling {
        &[]
    } else {
        &["memory", "embedded"]
    };
    for &store_name in store_names {
        for workload in [Workload::Unique, Workload::Dup90] {
            for tasks in [1usize, 64] {
                eprintln!("{store_name} {} {tasks} task(s)…", workload.label());
                let (store, embedded): (Arc<dyn Store>, Option<Arc<EmbeddedStore>>) =
                    match store_name {
                        "memory" => (Arc::new(MemoryStore::new()), None),
                        _ => {
                            let sub = dir.join(format!("embedded-{}-{tasks}", workload.label()));
                            let s = Arc::new(
                                EmbeddedStore::open(&sub, EmbeddedOptions::default()).unwrap(),
                            );
                            (s.clone(), Some(s))
                        }
                    };
                let commits_before = embedded.as_ref().map_or(0, |s| s.commits_total());
                let f = rt.block_on(drive(store, "bench", workload, tasks, secs));
                if let Some(s) = &embedded {
                    let commits = s.commits_total() - commits_before;
                    if tasks == 64 && matches!(workload, Workload::Unique) {
                        embedded_64_unique = f.rate();
                        commits_note = format!(
                            "{} claims in {} commits: {:.1} claims per fsync",
                            f.ops,
                            commits,
                            f.ops as f64 / commits.max(1) as f64
                        );
                    }
                }
                rows.push((store_name, workload, tasks, f));
            }
        }
    }

    eprintln!("engine comparison…");
    // Rounds alternate the engines so a noisy neighbour on the shared disk hits both alike.
    let rounds: usize = std::env::var("DG_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let mut engines: Vec<(&str, usize, Vec<Figures>)> = Vec::new();
    let engine_tasks: &[usize] = if only_ceiling { &[] } else { &[1, 64] };
    for &tasks in engine_tasks {
        for engine in [
            "shipped (fjall)",
            "fjall Batch::commit",
            "redb+wal",
            "redb",
            "sqlite",
        ] {
            engines.push((engine, tasks, Vec::new()));
        }
    }
    for round in 0..rounds {
        for (engine, tasks, figures) in engines.iter_mut() {
            let path = dir.join(format!("engine-{engine}-{tasks}-{round}"));
            std::fs::create_dir_all(&path).unwrap();
            let opener: EngineOpener = match *engine {
                "redb" => {
                    let file = path.join("store.redb");
                    Box::new(move || Ok(Box::new(RedbEngine::open(&file)?) as Box<dyn Engine>))
                }
                "redb+wal" => {
                    let sub = path.join("engine");
                    Box::new(move || Ok(Box::new(WalRedbEngine::open(&sub)?) as Box<dyn Engine>))
                }
                "shipped (fjall)" => {
                    let sub = path.join("keyspace");
                    Box::new(move || {
                        Ok(
                            Box::new(dedupgate_embedded::engine::FjallEngine::open(&sub)?)
                                as Box<dyn Engine>,
                        )
                    })
                }
                "fjall Batch::commit" => {
                    let sub = path.join("fjall");
                    Box::new(move || Ok(Box::new(FjallBatchEngine::open(&sub)?) as Box<dyn Engine>))
                }
                _ => {
                    let file = path.join("store.sqlite");
                    Box::new(move || Ok(Box::new(SqliteEngine::open(&file)?) as Box<dyn Engine>))
                }
            };
            let store: Arc<dyn Store> = Arc::new(
                EmbeddedStore::with_engine(opener, EmbeddedOptions::default(), engine.to_string())
                    .unwrap(),
            );
            let f = rt.block_on(drive(store, "engine", Workload::Unique, *tasks, secs));
            figures.push(f);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);

    println!("\n### Claims (each answer durable before it returns, for the embedded store)\n");
    println!("| store | workload | tasks | claims/s | new/s | p50 µs | p99 µs |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (store, workload, tasks, f) in &rows {
        println!(
            "| {store} | {} | {tasks} | {:.0} | {:.0} | {:.1} | {:.1} |",
            workload.label(),
            f.rate(),
            f.new as f64 / f.secs,
            f.p50_us,
            f.p99_us
        );
    }
    println!("\n### Baselines, same run, same disk\n");
    println!("| baseline | ops/s |");
    println!("|---|---:|");
    println!("| fsync rate (4 KiB write + fdatasync loop) | {fsync:.0} |");
    println!("| SQLite WAL synchronous=FULL, INSERT OR IGNORE, one txn per key | {sqlite:.0} |");
    match &redis_rate {
        Ok(r) => println!(
            "| redis-benchmark -c 50 -P 1 SET key:__rand_int__ 1 NX EX 86400 (no fsync) | {r:.0} |"
        ),
        Err(e) => println!("| redis-benchmark SET NX EX | n/a: {e} |"),
    }
    println!(
        "\n### Group-commit ceiling, same run: 64 callers, no engine, one 64-byte record per \
         answer, one pwrite + fdatasync per commit\n"
    );
    println!("| journal | acks/s | acks per sync | vs SQLite one txn per key |");
    println!("|---|---:|---:|---:|");
    for (journal, c) in &ceilings {
        println!(
            "| {} | {:.0} | {:.1} | {:.1}x |",
            journal.label(),
            c.acks_per_sec,
            c.acks_per_sync,
            c.acks_per_sec / sqlite
        );
    }
    println!("\n### Engines under the same group-commit writer (unique keys)\n");
    println!("| engine | tasks | claims/s (median of {rounds}) | each round | p50 µs | p99 µs |");
    println!("|---|---:|---:|---|---:|---:|");
    for (engine, tasks, figures) in &mut engines {
        figures.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
        let each: Vec<String> = figures.iter().map(|f| format!("{:.0}", f.rate())).collect();
        let median = &figures[figures.len() / 2];
        println!(
            "| {engine} | {tasks} | {:.0} | {} | {:.1} | {:.1} |",
            median.rate(),
            each.join(", "),
            median.p50_us,
            median.p99_us
        );
    }
    println!("\n### Targets\n");
    println!(
        "- embedded, 64 tasks, unique keys: {embedded_64_unique:.0} claims/s ({commits_note})"
    );
    println!(
        "- vs SQLite one txn per key: {:.1}x (target ≥ 50x)",
        embedded_64_unique / sqlite
    );
    for (journal, c) in &ceilings {
        println!(
            "- the group-commit ceiling ({}, no engine): {:.0} acks/s, {:.1}x SQLite",
            journal.label(),
            c.acks_per_sec,
            c.acks_per_sec / sqlite
        );
    }
    match redis_rate {
        Ok(r) => println!(
            "- vs Redis SET NX EX: {:.2}x (target ≥ 1x)",
            embedded_64_unique / r
        ),
        Err(e) => println!("- vs Redis SET NX EX: n/a ({e})"),
    }
}
