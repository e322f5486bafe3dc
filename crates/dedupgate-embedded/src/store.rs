//! [`EmbeddedStore`]: opening a directory, and the [`Store`] face over the writer thread.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasherDefault;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use dedupgate_core::decide::decide_read_only;
use dedupgate_core::{
    Clock, GateError, Op, Outcome, RecordId, Store, StoreError, StoreStats, SystemClock, ValidOp,
};
use tokio::sync::{mpsc, oneshot};

use crate::codec::{decode_entry, encode_id};
use crate::engine::{Engine, EngineError, EngineOpener, FjallEngine};
use crate::error::OpenError;
use crate::keyset::KeySetCall;
use crate::writer::{check_format, FormatProblem, Request, Shared, Writer};
use crate::{ENGINE_DIR_NAME, FORMAT_FILE_NAME, LOCK_FILE_NAME};

/// How the store runs. Durability is not among these: every acknowledged write is fsync'd.
#[derive(Clone, Debug)]
pub struct EmbeddedOptions {
    /// Requests that may wait for the writer; when full, callers wait (backpressure).
    pub queue_requests_max: usize,
    /// Most ops decided and committed in one transaction (a batch request is never split).
    pub batch_ops_max: usize,
    /// How often the background sweeper looks for expired entries.
    pub sweep_interval_ms: u64,
    /// Most entries one sweep transaction removes, so a sweep never holds the writer long.
    pub sweep_batch_max: usize,
    /// The store's one clock. `None` (production): the system clock, floored at the latest
    /// instant the store has persisted, so a restart or a clock step back never judges a lease
    /// on an earlier instant. Tests pass a [`dedupgate_core::ManualClock`].
    pub clock: Option<Arc<dyn Clock>>,
    /// Bytes of the engine's block cache (1 MiB to 64 GiB; default 64 MiB). Lookups of keys
    /// whose blocks are not cached read and decode a block each: a `dedup --ledger` re-run over
    /// 7M known keys took 141 s with 64 MiB and 34 s with 256 MiB, which held the whole set.
    pub cache_bytes: u64,
    /// Most key-set ids the writer holds in memory (about 40–60 bytes each; default 8,388,608,
    /// so about 0.5 GB at most). Past it, the ids of the chunks that expire first move to a
    /// per-key index on disk, where lookups are slower (an LSM read per key the memory does not
    /// hold), and memory stays bounded whatever the set's size.
    pub key_set_memory_ids: usize,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        Self {
            queue_requests_max: 16_384,
            batch_ops_max: 8_192,
            sweep_interval_ms: 1_000,
            sweep_batch_max: 1_000,
            clock: None,
            cache_bytes: crate::engine::CACHE_BYTES_DEFAULT,
            key_set_memory_ids: crate::keyset::MEMORY_IDS_DEFAULT,
        }
    }
}

impl EmbeddedOptions {
    fn check(&self) -> Result<(), OpenError> {
        let fail = |what: &str| Err(OpenError::Options(what.to_owned()));
        if self.queue_requests_max == 0 || self.queue_requests_max > 1 << 20 {
            return fail("queue_requests_max must be 1..=1048576");
        }
        if self.batch_ops_max == 0 || self.batch_ops_max > 1 << 20 {
            return fail("batch_ops_max must be 1..=1048576");
        }
        if self.sweep_interval_ms == 0 || self.sweep_interval_ms > 24 * 3_600_000 {
            return fail("sweep_interval_ms must be 1..=86400000");
        }
        if self.sweep_batch_max == 0 || self.sweep_batch_max > 1 << 20 {
            return fail("sweep_batch_max must be 1..=1048576");
        }
        if !(1 << 20..=64 << 30).contains(&self.cache_bytes) {
            return fail("cache_bytes must be 1 MiB..=64 GiB");
        }
        if self.key_set_memory_ids == 0 || self.key_set_memory_ids as u64 > u64::from(u32::MAX) {
            return fail("key_set_memory_ids must be 1..=4294967295");
        }
        Ok(())
    }
}

/// The embedded durable store. Dropping it stops its threads, closes the engine and releases the
/// directory lock (waiting for a commit in flight).
pub struct EmbeddedStore {
    tx: Option<mpsc::Sender<Request>>,
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
    sweeper: Option<JoinHandle<()>>,
    stop_sweeper: Option<std_mpsc::Sender<()>>,
    clock: Arc<dyn Clock>,
    description: String,
    /// When to try the durable view for claims and marks (see [`ViewCredit`]).
    view_credit: ViewCredit,
    /// Held for the store's life: its flock is the directory's exclusive lock.
    _lock: Option<File>,
}

/// Decides whether a claim or mark first tries the durable view. A try costs a lookup and a
/// decision on the caller's thread and pays off only for duplicates, so after a run of misses
/// (unique keys) only one op in [`VIEW_PROBE_EVERY`] tries, until one hits again.
#[derive(Debug)]
struct ViewCredit {
    credit: AtomicI64,
    ticks: AtomicU64,
}

/// Misses in a row after which claims and marks stop trying the view.
const VIEW_CREDIT_MAX: i64 = 8;
/// While out of credit, one op in this many still tries the view.
const VIEW_PROBE_EVERY: u64 = 32;

impl ViewCredit {
    fn new() -> Self {
        Self {
            credit: AtomicI64::new(VIEW_CREDIT_MAX),
            ticks: AtomicU64::new(0),
        }
    }

    fn worth_trying(&self) -> bool {
        self.credit.load(Ordering::Relaxed) > 0
            || self.ticks.fetch_add(1, Ordering::Relaxed) % VIEW_PROBE_EVERY == 0
    }

    fn record(&self, hit: bool) {
        if hit {
            self.credit.store(VIEW_CREDIT_MAX, Ordering::Relaxed);
        } else if self.credit.load(Ordering::Relaxed) > -VIEW_CREDIT_MAX {
            self.credit.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
}

/// Files and the directory an open created, removed again if the open fails.
#[derive(Default)]
struct Undo {
    dir: Option<PathBuf>,
    files: Vec<PathBuf>,
    trees: Vec<PathBuf>,
}

impl Undo {
    fn run(self) {
        for t in self.trees.iter().rev() {
            let _ = fs::remove_dir_all(t);
        }
        for f in self.files.iter().rev() {
            let _ = fs::remove_file(f);
        }
        if let Some(d) = self.dir {
            let _ = fs::remove_dir(d);
        }
    }
}

fn engine_open_error(path: &Path, e: EngineError) -> OpenError {
    match e {
        // Unreadable engine files surface as invalid data, or as "not a directory" when a file
        // sits where the engine's directory should be.
        EngineError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::InvalidData
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::NotADirectory
            ) =>
        {
            OpenError::Corrupt {
                path: path.to_owned(),
                detail: format!("unreadable engine files ({io})"),
            }
        }
        EngineError::Io(io) => OpenError::io(path, io),
        EngineError::Corrupt(detail) => OpenError::Corrupt {
            path: path.to_owned(),
            detail,
        },
        EngineError::Other(detail) => OpenError::Engine {
            path: path.to_owned(),
            detail,
        },
    }
}

/// Writes the format file of an engine directory (a new one, or a migrated one's over the old):
/// written aside, fsync'd, renamed into place, and the directory fsync'd, so a crash leaves the
/// old file (or none) or the new one.
fn write_format_file(engine_dir: &Path) -> std::io::Result<()> {
    let aside = engine_dir.join(format!("{FORMAT_FILE_NAME}.new"));
    let mut f = File::create(&aside)?;
    std::io::Write::write_all(&mut f, format!("{}\n", crate::FORMAT_VERSION).as_bytes())?;
    f.sync_all()?;
    fs::rename(&aside, engine_dir.join(FORMAT_FILE_NAME))?;
    File::open(engine_dir)?.sync_all()
}

/// Reads the format file before anything opens the engine, so an unknown format is refused
/// without a byte changed. Returns the version found: [`crate::FORMAT_VERSION`], or one of
/// [`crate::FORMATS_MIGRATED`] for a store to migrate.
fn check_format_file(engine_dir: &Path) -> Result<u64, OpenError> {
    let path = engine_dir.join(FORMAT_FILE_NAME);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(OpenError::Corrupt {
                path,
                detail: "the format file is missing: not a dedupgate store".into(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            return Err(OpenError::Corrupt {
                path: engine_dir.to_owned(),
                detail: "a file sits where the engine directory should be".into(),
            })
        }
        Err(e) => return Err(OpenError::io(&path, e)),
    };
    match text.trim().parse::<u64>() {
        Ok(v) if v == crate::FORMAT_VERSION || crate::FORMATS_MIGRATED.contains(&v) => Ok(v),
        Ok(found) => Err(OpenError::UnknownFormat {
            path,
            found,
            supported: crate::FORMAT_VERSION,
        }),
        Err(_) => Err(OpenError::Corrupt {
            path,
            detail: format!(
                "the format file holds {:?}, not a version number",
                text.trim()
            ),
        }),
    }
}

/// The fjall keyspace inside the engine directory.
const KEYSPACE_DIR_NAME: &str = "keyspace";

/// Opens the engine in an engine directory, turning a panic on malformed files into a corrupt-files error.
fn open_engine(path: &Path, cache_bytes: u64) -> Result<Box<dyn Engine>, EngineError> {
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        FjallEngine::open_with_cache(&path.join(KEYSPACE_DIR_NAME), cache_bytes)
    }));
    match opened {
        Ok(Ok(engine)) => Ok(Box::new(engine)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(EngineError::Corrupt(
            "the engine could not read its files".into(),
        )),
    }
}

impl EmbeddedStore {
    /// Opens the store in `dir`. The directory is created when it is missing but its parent
    /// exists (never a chain of directories: a typo should not silently make a new store).
    /// A failed open changes nothing on disk.
    pub fn open(dir: impl AsRef<Path>, options: EmbeddedOptions) -> Result<Self, OpenError> {
        options.check()?;
        let dir = dir.as_ref();
        let mut undo = Undo::default();
        match Self::open_dir(dir, options, &mut undo) {
            Ok(store) => Ok(store),
            Err(e) => {
                undo.run();
                Err(e)
            }
        }
    }

    fn open_dir(dir: &Path, options: EmbeddedOptions, undo: &mut Undo) -> Result<Self, OpenError> {
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(OpenError::NotADirectory {
                    dir: dir.to_owned(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let parent = match dir.parent() {
                    Some(p) if p.as_os_str().is_empty() => Path::new("."),
                    Some(p) => p,
                    None => Path::new("/"),
                };
                if !parent.is_dir() {
                    return Err(OpenError::ParentMissing {
                        dir: dir.to_owned(),
                    });
                }
                match fs::create_dir(dir) {
                    Ok(()) => undo.dir = Some(dir.to_owned()),
                    // Another process opening the same new store made it first (concurrent
                    // `dedupgate run`s of a cron job): the directory lock below sorts them out.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
                    Err(e) => return Err(OpenError::io(dir, e)),
                }
            }
            Err(e) => return Err(OpenError::io(dir, e)),
        }

        let lock_path = dir.join(LOCK_FILE_NAME);
        if !lock_path.exists() {
            undo.files.push(lock_path.clone());
        }
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| OpenError::io(&lock_path, e))?;
        match fs4::fs_std::FileExt::try_lock_exclusive(&lock) {
            Ok(true) => {}
            Ok(false) => {
                // Someone else's lock file: never remove it.
                undo.files.retain(|f| f != &lock_path);
                return Err(OpenError::Locked {
                    dir: dir.to_owned(),
                });
            }
            Err(e) => return Err(OpenError::io(&lock_path, e)),
        }

        let db_path = dir.join(ENGINE_DIR_NAME);
        if !db_path.exists() {
            // A new engine is built aside and renamed into place, so a crash during creation
            // leaves no half-made engine for the next open to trip over.
            let staging = dir.join(format!("{ENGINE_DIR_NAME}.new"));
            if staging.exists() {
                fs::remove_dir_all(&staging).map_err(|e| OpenError::io(&staging, e))?;
            }
            undo.trees.push(staging.clone());
            fs::create_dir(&staging).map_err(|e| OpenError::io(&staging, e))?;
            write_format_file(&staging).map_err(|e| OpenError::io(&staging, e))?;
            {
                let mut fresh = open_engine(&staging, options.cache_bytes)
                    .map_err(|e| engine_open_error(&staging, e))?;
                match check_format(fresh.as_mut()) {
                    Ok(Ok(_)) => {}
                    Ok(Err(problem)) => {
                        return Err(OpenError::Engine {
                            path: staging,
                            detail: problem.to_string(),
                        })
                    }
                    Err(e) => return Err(engine_open_error(&staging, e)),
                }
            }
            // The staging directory's own entries (the format file, the keyspace) are durable
            // only once it is fsync'd; the parent's fsync below covers the rename alone. Found
            // by dedupgate-torture's power-loss run: engine/FORMAT was gone after a power loss.
            File::open(&staging)
                .and_then(|d| d.sync_all())
                .map_err(|e| OpenError::io(&staging, e))?;
            fs::rename(&staging, &db_path).map_err(|e| OpenError::io(&db_path, e))?;
            undo.trees.push(db_path.clone());
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| OpenError::io(dir, e))?;
        }
        let file_version = check_format_file(&db_path)?;
        let mut engine = open_engine(&db_path, options.cache_bytes)
            .map_err(|e| engine_open_error(&db_path, e))?;
        let floor_ms = match check_format(engine.as_mut()) {
            Ok(Ok(floor)) => {
                // The engine's meta says FORMAT_VERSION now (migrated if it was older): the
                // format file follows.
                if file_version != crate::FORMAT_VERSION {
                    write_format_file(&db_path).map_err(|e| OpenError::io(&db_path, e))?;
                    tracing::info!(
                        dir = %dir.display(),
                        from = file_version,
                        to = crate::FORMAT_VERSION,
                        "embedded store format migrated"
                    );
                }
                floor
            }
            Ok(Err(FormatProblem::Unknown(found))) => {
                return Err(OpenError::UnknownFormat {
                    path: db_path,
                    found,
                    supported: crate::FORMAT_VERSION,
                })
            }
            Ok(Err(problem @ (FormatProblem::Missing | FormatProblem::Unmigratable(_)))) => {
                return Err(OpenError::Corrupt {
                    path: db_path,
                    detail: problem.to_string(),
                })
            }
            Err(e) => return Err(engine_open_error(&db_path, e)),
        };
        let reopen_path = db_path.clone();
        let cache_bytes = options.cache_bytes;
        let opener: EngineOpener = Box::new(move || open_engine(&reopen_path, cache_bytes));
        let description = format!(
            "embedded:{} (fjall, one fdatasync per group commit)",
            dir.display()
        );
        Ok(Self::start(
            engine,
            opener,
            floor_ms,
            options,
            description,
            Some(lock),
        ))
    }

    /// Runs the store over any [`Engine`], without a directory lock: the engine comparison in
    /// `benches/claims.rs` uses this to put SQLite under the same writer. `open` is called now and
    /// again after every failure.
    #[doc(hidden)]
    pub fn with_engine(
        mut open: EngineOpener,
        options: EmbeddedOptions,
        description: String,
    ) -> Result<Self, OpenError> {
        options.check()?;
        let path = PathBuf::from(&description);
        let mut engine = open().map_err(|e| engine_open_error(&path, e))?;
        let floor_ms = match check_format(engine.as_mut()) {
            Ok(Ok(floor)) => floor,
            Ok(Err(problem)) => {
                return Err(OpenError::Engine {
                    path,
                    detail: problem.to_string(),
                })
            }
            Err(e) => return Err(engine_open_error(&path, e)),
        };
        Ok(Self::start(
            engine,
            open,
            floor_ms,
            options,
            description,
            None,
        ))
    }

    fn start(
        engine: Box<dyn Engine>,
        opener: EngineOpener,
        floor_ms: u64,
        options: EmbeddedOptions,
        description: String,
        lock: Option<File>,
    ) -> Self {
        let clock = options
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(SystemClock::with_floor(floor_ms)));
        let shared = Arc::new(Shared::default());
        shared.available.store(true, Ordering::Release);
        let (tx, rx) = mpsc::channel(options.queue_requests_max);
        let writer = Writer {
            scratch: Default::default(),
            rx,
            opener,
            engine: Some(engine),
            clock: clock.clone(),
            shared: shared.clone(),
            batch_ops_max: options.batch_ops_max,
            index_seq: 0,
            keyset_members: None,
            keyset_memory_ids: options.key_set_memory_ids,
        };
        let writer = std::thread::Builder::new()
            .name("dedupgate-writer".into())
            .spawn(move || writer.run())
            .expect("the OS could not start the writer thread");
        let (stop_tx, stop_rx) = std_mpsc::channel();
        let sweep_tx = tx.clone();
        let interval = Duration::from_millis(options.sweep_interval_ms);
        let batch_max = options.sweep_batch_max;
        let sweeper = std::thread::Builder::new()
            .name("dedupgate-sweeper".into())
            .spawn(move || sweeper(sweep_tx, stop_rx, interval, batch_max))
            .expect("the OS could not start the sweeper thread");
        Self {
            tx: Some(tx),
            shared,
            writer: Some(writer),
            sweeper: Some(sweeper),
            stop_sweeper: Some(stop_tx),
            clock,
            description,
            view_credit: ViewCredit::new(),
            _lock: lock,
        }
    }

    /// Answers `op` from the last durable commit when [`decide_read_only`] says the answer
    /// changes nothing (a duplicate, a refusal, a get); `None` when the writer must decide it.
    /// Sound because the writer publishes each commit's view before it sends that commit's
    /// answers (every acknowledged change is visible here), and because an id that the commit in flight may change, or any
    /// op during which a commit began or ended, is left to the writer (see `PendingIds`): so the
    /// answer's instant never runs ahead of a decision on the same id ordered after it.
    fn answer_from_view(&self, id: &RecordId, op: &ValidOp) -> Option<Result<Outcome, GateError>> {
        let pending = &self.shared.pending;
        let epoch = pending.epoch();
        let mut key = Vec::with_capacity(64);
        encode_id(id, &mut key);
        if epoch % 2 == 1 && pending.may_change(&key) {
            return None;
        }
        let view = self.shared.view.get()?;
        let mut value = Vec::with_capacity(256);
        // Errors and undecodable bytes are left to the writer, which reports them properly.
        let entry = match view.get(&key, &mut value) {
            Ok(true) => Some(decode_entry(&value).ok()?),
            Ok(false) => None,
            Err(_) => return None,
        };
        let now_ms = self.clock.now_ms();
        let answer = decide_read_only(id, op, entry.as_ref(), now_ms);
        if pending.epoch() != epoch {
            return None;
        }
        answer
    }

    /// Whether `op` is worth trying to answer from the view.
    fn view_worth_trying(&self, op: &Op) -> bool {
        match op {
            Op::Get => true,
            Op::Claim { .. } | Op::Mark { .. } => self.view_credit.worth_trying(),
            _ => false,
        }
    }

    /// The answer from the view, when worth trying and possible; keeps the credit up to date.
    fn try_view(&self, id: &RecordId, op: &ValidOp) -> Option<Result<Outcome, GateError>> {
        if !self.view_worth_trying(op) {
            return None;
        }
        let answer = self.answer_from_view(id, op);
        if !matches!(**op, Op::Get) {
            self.view_credit.record(answer.is_some());
        }
        answer
    }

    /// Runs one call on the key set (see [`crate::keyset`]): one bool per key of `call.check`,
    /// true when it was new, then one per key of `call.forget`, true when a live member was
    /// removed. Answered after the call's writes are fsync'd; an unreadable member fails the
    /// call with [`StoreError::Corrupt`] and writes nothing.
    pub async fn key_set(&self, call: KeySetCall) -> Result<Vec<bool>, GateError> {
        call.validate()?;
        self.check_available()?;
        if call.check.is_empty() && call.record.is_empty() && call.forget.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = oneshot::channel();
        self.send(Request::KeySet { call, reply }).await?;
        rx.await.map_err(|_| writer_gone())?
    }

    /// The store's clock (the one leases and ttls are judged on).
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    /// Commits since the store opened: with many concurrent callers, far fewer than ops.
    pub fn commits_total(&self) -> u64 {
        self.shared.commits_total.load(Ordering::Relaxed)
    }

    async fn send(&self, request: Request) -> Result<(), StoreError> {
        let tx = self.tx.as_ref().expect("present until drop");
        tx.send(request)
            .await
            .map_err(|_| StoreError::Unavailable("the embedded store's writer has stopped".into()))
    }

    fn check_available(&self) -> Result<(), StoreError> {
        if self.shared.available.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(self.shared.unavailable())
        }
    }
}

/// A 64-bit FNV-1a hash of an id, for the set of ids a batch sent to the writer: a
/// `HashSet<RecordId>` (two string clones and a SipHash of both per op, and rehashing as it
/// grew) cost ~7% of a `dedup --ledger` run's CPU.
fn id_hash(id: &RecordId) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let ns = id.namespace.as_str().as_bytes();
    let key = id.key.as_str().as_bytes();
    // The namespace's length first, so (ns, key) pairs that concatenate alike differ.
    for &b in [ns.len() as u8].iter().chain(ns).chain(key) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A hasher that passes a `u64` (already a hash) through.
#[derive(Default)]
struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

fn writer_gone() -> StoreError {
    StoreError::Unavailable("the embedded store's writer stopped before answering".into())
}

/// Sweeps every `interval`, in bounded batches, until no expired record remains or the store stops.
fn sweeper(
    tx: mpsc::Sender<Request>,
    stop: std_mpsc::Receiver<()>,
    interval: Duration,
    batch_max: usize,
) {
    loop {
        match stop.recv_timeout(interval) {
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        loop {
            let (reply, rx) = oneshot::channel();
            if tx
                .blocking_send(Request::Sweep { batch_max, reply })
                .is_err()
            {
                return;
            }
            match rx.blocking_recv() {
                Ok(Ok((_, true))) => {
                    if !matches!(stop.try_recv(), Err(std_mpsc::TryRecvError::Empty)) {
                        return;
                    }
                }
                Ok(Ok(_)) => break,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "background sweep failed");
                    break;
                }
                Err(_) => return,
            }
        }
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        drop(self.stop_sweeper.take());
        if let Some(s) = self.sweeper.take() {
            let _ = s.join();
        }
        drop(self.tx.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        self.check_available()?;
        if let Some(answer) = self.try_view(&id, &op) {
            return answer;
        }
        let (reply, rx) = oneshot::channel();
        self.send(Request::One { id, op, reply }).await?;
        rx.await.map_err(|_| writer_gone())?
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        if ops.is_empty() {
            return Vec::new();
        }
        let fail_all = |n: usize, e: &StoreError| {
            (0..n)
                .map(|_| Err(GateError::Store(StoreError::Unavailable(e.to_string()))))
                .collect()
        };
        let n = ops.len();
        if let Err(e) = self.check_available() {
            return fail_all(n, &e);
        }
        // Answer what the durable view can; the rest goes to the writer in order. Once an id has
        // an op for the writer, its later ops follow it there, so they see its change.
        let mut answers: Vec<Option<Result<Outcome, GateError>>> = Vec::with_capacity(n);
        let mut to_writer: Vec<(RecordId, ValidOp)> = Vec::with_capacity(n);
        // Hashes of the ids sent to the writer so far (a collision only sends an op there too).
        let mut writer_ids: HashSet<u64, BuildHasherDefault<PassThrough>> =
            HashSet::with_capacity_and_hasher(n, Default::default());
        for (id, op) in ops {
            let hash = id_hash(&id);
            let from_view = if writer_ids.contains(&hash) {
                None
            } else {
                self.try_view(&id, &op)
            };
            match from_view {
                Some(answer) => answers.push(Some(answer)),
                None => {
                    answers.push(None);
                    writer_ids.insert(hash);
                    to_writer.push((id, op));
                }
            }
        }
        if to_writer.is_empty() {
            return answers.into_iter().flatten().collect();
        }
        let sent = to_writer.len();
        let (reply, rx) = oneshot::channel();
        let from_writer = match self
            .send(Request::Many {
                ops: to_writer,
                reply,
            })
            .await
        {
            Ok(()) => rx.await.unwrap_or_else(|_| fail_all(sent, &writer_gone())),
            Err(e) => fail_all(sent, &e),
        };
        let mut from_writer = from_writer.into_iter();
        answers
            .into_iter()
            .map(|a| match a {
                Some(a) => a,
                None => from_writer
                    .next()
                    .unwrap_or_else(|| Err(GateError::Store(writer_gone()))),
            })
            .collect()
    }

    async fn health(&self) -> Result<(), StoreError> {
        self.check_available()
    }

    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        if batch_max == 0 {
            return Ok(0);
        }
        self.check_available()?;
        let (reply, rx) = oneshot::channel();
        self.send(Request::Sweep { batch_max, reply }).await?;
        rx.await
            .map_err(|_| writer_gone())?
            .map(|(removed, _)| removed)
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.check_available()?;
        let (reply, rx) = oneshot::channel();
        self.send(Request::Stats { reply }).await?;
        rx.await.map_err(|_| writer_gone())?
    }

    /// Its own sweeper thread (every `sweep_interval_ms`, see [`EmbeddedOptions`]) is the one
    /// owner that sweeps it.
    fn sweeps_itself(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.description.clone()
    }
}
