//! The embedded store's own behaviour: reopening, the directory lock, the clock floor, and the
//! clear errors (missing, not a directory, corrupt, unknown format, read-only, full) that leave
//! the directory as they found it. Failing closed on a real full disk is tested on a tiny tmpfs.

use dedupgate_core::testkit::ApplyOp;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{
    Claim, GateError, ManualClock, Mark, Op, Outcome, Record, RecordId, State, Store, StoreError,
    Token,
};
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore, OpenError, ENGINE_DIR_NAME};
use serde_json::json;

const DAY_MS: u64 = 86_400_000;

fn id(key: &str) -> RecordId {
    RecordId::new("test", key).unwrap()
}

fn claim_op() -> Op {
    Op::Claim {
        ttl_ms: DAY_MS,
        lease_ms: 3_600_000,
        fingerprint: None,
        owner: None,
    }
}

fn mark_op(result: serde_json::Value) -> Op {
    Op::Mark {
        ttl_ms: DAY_MS,
        fingerprint: Some("fp".into()),
        result: Some(result),
    }
}

async fn get(store: &dyn Store, key: &str) -> Result<Option<Record>, GateError> {
    match store.apply_op(id(key), Op::Get).await? {
        Outcome::Found(r) => Ok(r),
        other => panic!("get answered {other:?}"),
    }
}

/// Every file and directory under `dir` with a hash of its bytes, to prove an open changed nothing.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (usize, u64)> {
    fn digest(bytes: Vec<u8>) -> (usize, u64) {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        (bytes.len(), h.finish())
    }
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, (usize, u64)>) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    out.insert(path.clone(), (0, 0));
                    walk(&path, out);
                } else {
                    out.insert(
                        path.clone(),
                        digest(std::fs::read(&path).unwrap_or_default()),
                    );
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, &mut out);
    out
}

/// Reads a named number of the store's meta from its engine files directly (the store closed).
fn raw_meta(dir: &Path, name: &str) -> u64 {
    let ks = fjall::Config::new(dir.join(ENGINE_DIR_NAME).join("keyspace"))
        .open()
        .unwrap();
    let meta = ks
        .open_partition("meta", fjall::PartitionCreateOptions::default())
        .unwrap();
    let v = meta.get(name).unwrap().expect("the meta number is there");
    u64::from_le_bytes(v.as_ref().try_into().unwrap())
}

/// Writes into the store's engine files directly (the store closed), as a bug or a disk fault
/// would.
fn raw_put(dir: &Path, partition: &str, key: &[u8], value: &[u8]) {
    let ks = fjall::Config::new(dir.join(ENGINE_DIR_NAME).join("keyspace"))
        .open()
        .unwrap();
    let p = ks
        .open_partition(partition, fjall::PartitionCreateOptions::default())
        .unwrap();
    p.insert(key, value).unwrap();
    ks.persist(fjall::PersistMode::SyncAll).unwrap();
}

/// One attempt: `Locked` while anyone holds the directory.
fn try_open(dir: &Path) -> Result<EmbeddedStore, OpenError> {
    EmbeddedStore::open(dir, EmbeddedOptions::default())
}

/// Opens `dir`, waiting up to 10 s while its lock is held. A store this process dropped has
/// closed its lock file, but a child process that another test thread is starting at that moment
/// holds a copy of every descriptor (the lock's too) until its exec closes them. Found by CI:
/// `a_second_open_of_the_same_directory_is_refused` saw the lock of the store it had just dropped.
fn open(dir: &Path) -> Result<EmbeddedStore, OpenError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match try_open(dir) {
            Err(OpenError::Locked { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            result => return result,
        }
    }
}

#[tokio::test]
async fn reopen_after_close_keeps_every_record() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let mut expected: BTreeMap<String, Record> = BTreeMap::new();
    let mut released = Vec::new();
    {
        let store = open(&dir).unwrap();
        for i in 0..300 {
            let key = format!("k{i}");
            match i % 4 {
                0 => {
                    let Outcome::Claimed(Claim::New(_)) =
                        store.apply_op(id(&key), claim_op()).await.unwrap()
                    else {
                        panic!("fresh key")
                    };
                }
                1 => {
                    let Outcome::Claimed(Claim::New(l)) =
                        store.apply_op(id(&key), claim_op()).await.unwrap()
                    else {
                        panic!("fresh key")
                    };
                    let op = Op::Complete {
                        token: l.token,
                        result: Some(json!({"n": i, "s": "ü"})),
                        ttl_ms: None,
                    };
                    store.apply_op(id(&key), op).await.unwrap();
                }
                2 => {
                    store
                        .apply_op(id(&key), mark_op(json!([i, 1.5, null])))
                        .await
                        .unwrap();
                }
                _ => {
                    let Outcome::Claimed(Claim::New(l)) =
                        store.apply_op(id(&key), claim_op()).await.unwrap()
                    else {
                        panic!("fresh key")
                    };
                    store
                        .apply_op(id(&key), Op::Release { token: l.token })
                        .await
                        .unwrap();
                    released.push((key.clone(), l.fence));
                    continue;
                }
            }
            expected.insert(key.clone(), get(&store, &key).await.unwrap().unwrap());
        }
    }
    let store = open(&dir).unwrap();
    for (key, record) in &expected {
        assert_eq!(
            get(&store, key).await.unwrap().as_ref(),
            Some(record),
            "{key}"
        );
    }
    for (key, fence) in released {
        assert_eq!(get(&store, &key).await.unwrap(), None);
        // The release tombstone survived the restart: the next claim's fence is higher.
        let Outcome::Claimed(Claim::New(l)) = store.apply_op(id(&key), claim_op()).await.unwrap()
        else {
            panic!("a released key is free")
        };
        assert!(l.fence > fence);
    }
}

#[tokio::test]
async fn the_clock_never_starts_below_the_persisted_high_water_mark() {
    let tmp = tempfile::tempdir().unwrap();
    let far_future_ms = 32_503_680_000_000; // year 3000
    {
        let clock = Arc::new(ManualClock::new(far_future_ms));
        let options = EmbeddedOptions {
            clock: Some(clock),
            ..EmbeddedOptions::default()
        };
        let store = EmbeddedStore::open(tmp.path(), options).unwrap();
        store.apply_op(id("k"), claim_op()).await.unwrap();
    }
    // Production clock: the system clock, floored at what the store persisted.
    let store = open(tmp.path()).unwrap();
    assert!(store.clock().now_ms() >= far_future_ms);
    // So the lease of the claim made "in the year 3000" is still judged as held.
    let again = store.apply_op(id("k"), claim_op()).await.unwrap();
    assert!(matches!(again, Outcome::Claimed(Claim::Duplicate { .. })));
}

#[tokio::test]
async fn a_second_open_of_the_same_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path()).unwrap();
    let err = try_open(tmp.path()).unwrap_err();
    assert!(matches!(err, OpenError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("in use by another process"));
    drop(store);
    open(tmp.path()).expect("the lock goes with the store");
}

/// Found by CI: four `dedupgate run`s of one cron job opening a store that did not exist yet
/// raced on creating its directory, and the losers failed with "File exists" instead of
/// finding the store locked (or, once free, opening it).
#[test]
fn concurrent_first_opens_of_a_new_directory_get_the_store_or_the_lock() {
    for round in 0..8 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let results: Vec<Result<EmbeddedStore, OpenError>> = (0..4)
            .map(|_| {
                let (dir, barrier) = (dir.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    try_open(&dir)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let mut opened = 0;
        for r in &results {
            match r {
                Ok(_) => opened += 1,
                Err(OpenError::Locked { .. }) => {}
                Err(e) => panic!("round {round}: a racing open failed with {e}"),
            }
        }
        assert_eq!(opened, 1, "round {round}: exactly one open holds the store");
        drop(results);
        open(&dir).expect("the store the race made opens afterwards");
    }
}

/// Run by `a_second_process_gets_a_clear_lock_error` in a child process; a no-op otherwise.
#[test]
fn lock_child_process_entry() {
    let Ok(dir) = std::env::var("DG_LOCK_CHILD_DIR") else {
        return;
    };
    match try_open(Path::new(&dir)) {
        Ok(_) => println!("CHILD-OPENED"),
        Err(e) => println!("CHILD-ERROR {e}"),
    }
}

#[tokio::test]
async fn a_second_process_gets_a_clear_lock_error() {
    let tmp = tempfile::tempdir().unwrap();
    let _store = open(tmp.path()).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lock_child_process_entry", "--nocapture"])
        .env("DG_LOCK_CHILD_DIR", tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("CHILD-ERROR") && stdout.contains("in use by another process"),
        "child said: {stdout}"
    );
}

#[test]
fn a_missing_directory_is_created_only_when_its_parent_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let deep = tmp.path().join("no/such/parent");
    let err = open(&deep).unwrap_err();
    assert!(matches!(err, OpenError::ParentMissing { .. }), "{err}");
    assert!(!tmp.path().join("no").exists());

    let fresh = tmp.path().join("fresh");
    drop(open(&fresh).unwrap());
    assert!(fresh.join(ENGINE_DIR_NAME).exists());
}

#[test]
fn a_file_where_the_directory_should_be_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = open(&file).unwrap_err();
    assert!(matches!(err, OpenError::NotADirectory { .. }), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
}

#[test]
fn corrupt_engine_files_are_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let garbage: Vec<u8> = (0..10_000u32).map(|i| (i * 7919 % 251) as u8).collect();
    let cases: [(&str, &str, &[u8]); 3] = [
        (
            "a file where the engine's directory should be",
            "",
            &garbage,
        ),
        ("a garbled version marker", "keyspace/version", &garbage),
        (
            "a garbled partition manifest",
            "keyspace/partitions/entries/manifest",
            &garbage,
        ),
    ];
    for (n, (what, file, bytes)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("c{n}"));
        if file.is_empty() {
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join(ENGINE_DIR_NAME), bytes).unwrap();
        } else {
            drop(open(&dir).unwrap());
            std::fs::write(dir.join(ENGINE_DIR_NAME).join(file), bytes).unwrap();
        }
        let before = snapshot(&dir);
        let err = open(&dir).expect_err(what);
        eprintln!("{what}: {err}");
        assert!(matches!(err, OpenError::Corrupt { .. }), "{what}: {err}");
        assert_eq!(
            snapshot(&dir),
            before,
            "{what}: the open changed the directory"
        );
    }
}

#[test]
fn an_unknown_format_version_is_refused_with_a_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()).unwrap());
    std::fs::write(tmp.path().join(ENGINE_DIR_NAME).join("FORMAT"), "99\n").unwrap();
    let before = snapshot(tmp.path());
    let err = open(tmp.path()).unwrap_err();
    assert!(
        matches!(err, OpenError::UnknownFormat { found: 99, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("format version 99"));
    assert_eq!(snapshot(tmp.path()), before);
}

#[tokio::test]
async fn a_corrupt_entry_is_an_error_never_absent() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let store = open(tmp.path()).unwrap();
        store.apply_op(id("good"), mark_op(json!(1))).await.unwrap();
        store.apply_op(id("bad"), mark_op(json!(2))).await.unwrap();
    }
    let mut bad_key = Vec::new();
    dedupgate_embedded::codec::encode_id(&id("bad"), &mut bad_key);
    raw_put(tmp.path(), "entries", &bad_key, b"\x01\x07junk");
    let store = open(tmp.path()).unwrap();
    for op in [Op::Get, claim_op(), mark_op(json!(3)), Op::Forget] {
        let r = store.apply_op(id("bad"), op).await;
        assert!(
            matches!(r, Err(GateError::Store(StoreError::Corrupt(_)))),
            "{r:?}"
        );
    }
    // In a batch only that op fails; the store stays up for every other key.
    let answers = store
        .apply_ops(vec![(id("bad"), Op::Get), (id("good"), Op::Get)])
        .await;
    assert!(matches!(
        answers[0],
        Err(GateError::Store(StoreError::Corrupt(_)))
    ));
    assert!(matches!(&answers[1], Ok(Outcome::Found(Some(r))) if r.state == State::Completed));
    store.health().await.unwrap();
}

#[tokio::test]
async fn batches_see_earlier_ops_and_share_one_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path()).unwrap();
    let before = store.commits_total();
    let answers = store
        .apply_ops(vec![
            (id("b"), claim_op()),
            (id("b"), claim_op()),
            (
                id("b"),
                Op::Release {
                    token: Token::new("nope"),
                },
            ),
            (id("m"), mark_op(json!("r"))),
            (id("m"), Op::Get),
        ])
        .await;
    assert!(matches!(answers[0], Ok(Outcome::Claimed(Claim::New(_)))));
    assert!(matches!(
        answers[1],
        Ok(Outcome::Claimed(Claim::Duplicate { .. }))
    ));
    assert!(matches!(answers[2], Err(GateError::LeaseLost)));
    assert!(matches!(answers[3], Ok(Outcome::Marked(Mark::New { .. }))));
    assert!(matches!(&answers[4], Ok(Outcome::Found(Some(r))) if r.result == Some(json!("r"))));
    assert_eq!(store.commits_total(), before + 1);
}

#[tokio::test]
async fn the_background_sweeper_bounds_what_is_held() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let options = EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        sweep_interval_ms: 20,
        sweep_batch_max: 50,
        ..EmbeddedOptions::default()
    };
    let store = EmbeddedStore::open(tmp.path(), options).unwrap();
    let ops = (0..500)
        .map(|i| {
            let op = Op::Mark {
                ttl_ms: 1_000,
                fingerprint: None,
                result: None,
            };
            (id(&format!("s{i}")), op)
        })
        .collect();
    store.apply_ops(ops).await;
    store
        .apply_op(id("keeper"), mark_op(json!(0)))
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().records_held, Some(501));
    clock.advance(1_000);
    // No explicit sweep: the background thread removes them in batches of 50.
    for _ in 0..500 {
        if store.stats().await.unwrap().records_held == Some(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.records_held, Some(1));
    assert_eq!(stats.swept_total, Some(500));
    assert!(get(&store, "keeper").await.unwrap().is_some());
}

/// A tmpfs mounted for one test, unmounted on drop. `None` where this process may not mount
/// (not root): the tests that need a real full or read-only file system then say so and stop.
struct Tmpfs {
    path: PathBuf,
    _parent: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Self> {
        let parent = tempfile::tempdir().unwrap();
        let path = parent.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: cannot mount a tmpfs here (needs root); this case is not checked");
            return None;
        }
        Some(Self {
            path,
            _parent: parent,
        })
    }

    fn remount(&self, mode: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,{mode}")])
            .arg(&self.path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "remount {mode} failed");
    }

    /// Writes a filler file until the file system is full.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let filler = self.path.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0xAB; 4096];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[test]
fn a_full_disk_refuses_a_new_store_and_leaves_nothing_behind() {
    let Some(fs) = Tmpfs::mount("2m") else { return };
    fs.fill();
    let dir = fs.path.join("store");
    let err = open(&dir).unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, OpenError::Full { .. }), "{err}");
    assert!(err.to_string().contains("no space left"));
    assert!(!dir.exists(), "a failed open left the directory behind");
}

#[tokio::test]
async fn a_read_only_file_system_is_refused_and_unchanged() {
    let Some(fs) = Tmpfs::mount("16m") else {
        return;
    };
    let dir = fs.path.join("store");
    {
        let store = open(&dir).unwrap();
        store.apply_op(id("k"), mark_op(json!(1))).await.unwrap();
    }
    fs.remount("ro");
    let before = snapshot(&dir);
    let err = open(&dir).unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, OpenError::ReadOnly { .. }), "{err}");
    assert!(err.to_string().contains("read-only"));
    assert_eq!(snapshot(&dir), before);
    fs.remount("rw");
    let store = open(&dir).unwrap();
    assert!(get(&store, "k").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_fails_closed_until_the_store_has_reopened() {
    let Some(fs) = Tmpfs::mount("24m") else {
        return;
    };
    let dir = fs.path.join("store");
    let store = Arc::new(open(&dir).unwrap());
    let mut acked: Vec<(String, Record)> = Vec::new();
    for i in 0..50 {
        let key = format!("e{i}");
        let Outcome::Marked(Mark::New { record }) =
            store.apply_op(id(&key), mark_op(json!(i))).await.unwrap()
        else {
            panic!("fresh key")
        };
        acked.push((key, record));
    }
    let filler = fs.fill();
    // Results big enough that the engine must grow its file: the disk is full, so it cannot.
    let big = json!("x".repeat(60_000));
    let mut first_failure = None;
    for i in 0..5_000 {
        let key = format!("f{i}");
        match store.apply_op(id(&key), mark_op(big.clone())).await {
            Ok(Outcome::Marked(Mark::New { record })) => acked.push((key, record)),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(GateError::Store(StoreError::Unavailable(why))) => {
                first_failure = Some(why);
                break;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    let why = first_failure.expect("a full disk must make a write fail");
    eprintln!("acknowledged {} before the failure: {why}", acked.len());
    // While the disk stays full, nothing is acknowledged: every write answers unavailable
    // (the reopened engine cannot commit either, and fails closed again).
    for i in 0..20 {
        let r = store
            .apply_op(id(&format!("g{i}")), mark_op(big.clone()))
            .await;
        assert!(
            matches!(r, Err(GateError::Store(StoreError::Unavailable(_)))),
            "a write on a full disk answered {r:?}"
        );
    }
    // Free the space: the writer reopens by itself and the store resumes.
    std::fs::remove_file(filler).unwrap();
    let mut resumed = false;
    for _ in 0..300 {
        if store.health().await.is_ok()
            && store.apply_op(id("after"), mark_op(json!(1))).await.is_ok()
        {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(resumed, "the store never reopened after space was freed");
    drop(store);
    let store = open(&dir).unwrap();
    for (key, record) in &acked {
        assert_eq!(
            get(&store, key).await.unwrap().as_ref(),
            Some(record),
            "{key}"
        );
    }
    assert!(get(&store, "after").await.unwrap().is_some());
}

#[tokio::test]
async fn duplicates_and_gets_are_answered_from_the_last_durable_commit_without_a_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path()).unwrap();
    store
        .apply_op(id("seen"), mark_op(json!("r")))
        .await
        .unwrap();
    let before = store.commits_total();
    for _ in 0..20 {
        let again = store
            .apply_op(id("seen"), mark_op(json!("r")))
            .await
            .unwrap();
        assert!(
            matches!(again, Outcome::Marked(Mark::Duplicate { .. })),
            "{again:?}"
        );
        let got = store.apply_op(id("seen"), Op::Get).await.unwrap();
        assert!(matches!(got, Outcome::Found(Some(_))), "{got:?}");
    }
    assert_eq!(
        store.commits_total(),
        before,
        "no commit for answers that change nothing"
    );
    // A change is visible to the next read as soon as it is acknowledged.
    store.apply_op(id("seen"), Op::Forget).await.unwrap();
    let gone = store.apply_op(id("seen"), Op::Get).await.unwrap();
    assert!(matches!(gone, Outcome::Found(None)), "{gone:?}");
}

#[tokio::test]
async fn in_a_batch_ops_after_a_change_to_their_id_see_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path()).unwrap();
    store.apply_op(id("x"), mark_op(json!(1))).await.unwrap();
    let answers = store
        .apply_ops(vec![
            (id("x"), Op::Get),
            (id("x"), Op::Forget),
            (id("x"), Op::Get),
            (id("x"), mark_op(json!(2))),
            (id("y"), mark_op(json!(3))),
            (id("y"), mark_op(json!(3))),
        ])
        .await;
    assert!(
        matches!(&answers[0], Ok(Outcome::Found(Some(_)))),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[2], Ok(Outcome::Found(None))),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[3], Ok(Outcome::Marked(Mark::New { .. }))),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[4], Ok(Outcome::Marked(Mark::New { .. }))),
        "{answers:?}"
    );
    assert!(
        matches!(&answers[5], Ok(Outcome::Marked(Mark::Duplicate { .. }))),
        "{answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_on_an_id_a_commit_in_flight_changes_waits_for_that_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("engine");
    // Commits pass freely (usize::MAX) until the test holds them (0).
    let hold = Arc::new((
        std::sync::Mutex::new((usize::MAX, false)),
        std::sync::Condvar::new(),
    ));
    let opener_hold = hold.clone();
    let opener: dedupgate_embedded::engine::EngineOpener = Box::new(move || {
        Ok(Box::new(CountedCommits {
            inner: Box::new(dedupgate_embedded::engine::FjallEngine::open(&path)?),
            gate: opener_hold.clone(),
        }))
    });
    let clock = ManualClock::new(1_000_000);
    let options = EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        ..EmbeddedOptions::default()
    };
    let store = Arc::new(EmbeddedStore::with_engine(opener, options, "held".into()).unwrap());
    let short_lease = Op::Claim {
        ttl_ms: DAY_MS,
        lease_ms: 1_000,
        fingerprint: None,
        owner: None,
    };
    let first = store.apply_op(id("x"), short_lease.clone()).await.unwrap();
    let Outcome::Claimed(Claim::New(first)) = first else {
        panic!("{first:?}")
    };
    clock.advance(2_000);
    // A takeover is decided, synced, then held before its view is published.
    hold.0.lock().unwrap().0 = 0;
    let takeover = tokio::spawn({
        let store = store.clone();
        let op = short_lease.clone();
        async move { store.apply_op(id("x"), op).await }
    });
    {
        let (lock, cv) = &*hold;
        let mut state = lock.lock().unwrap();
        while !state.1 {
            state = cv.wait(state).unwrap();
        }
    }
    clock.advance(5);
    // The old snapshot still holds the first claim; a get must not answer from it at a later
    // instant than the takeover's, but wait for the takeover's commit.
    let read = tokio::spawn({
        let store = store.clone();
        async move { get(store.as_ref(), "x").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    {
        let (lock, cv) = &*hold;
        lock.lock().unwrap().0 = usize::MAX;
        cv.notify_all();
    }
    let Outcome::Claimed(Claim::New(second)) = takeover.await.unwrap().unwrap() else {
        panic!("the takeover was not granted")
    };
    assert!(second.fence > first.fence);
    let seen = read.await.unwrap().unwrap().expect("the record");
    assert_eq!(
        seen.fence, second.fence,
        "the get answered from the snapshot the takeover was replacing"
    );
}

/// fjall behind a turnstile: after its sync, a commit waits (before the writer publishes its view
/// or answers) until the test lets one more commit pass.
struct CountedCommits {
    inner: Box<dyn dedupgate_embedded::engine::Engine>,
    /// (commits that may still pass, whether one is waiting)
    gate: Arc<(std::sync::Mutex<(usize, bool)>, std::sync::Condvar)>,
}

impl dedupgate_embedded::engine::Engine for CountedCommits {
    fn write(
        &mut self,
        body: &mut dedupgate_embedded::engine::TxnBody<'_>,
    ) -> Result<(), dedupgate_embedded::engine::EngineError> {
        self.inner.write(body)?;
        let (lock, cv) = &*self.gate;
        let mut state = lock.lock().unwrap();
        state.1 = true;
        cv.notify_all();
        while state.0 == 0 {
            state = cv.wait(state).unwrap();
        }
        state.0 -= 1;
        state.1 = false;
        Ok(())
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn durable_view(&self) -> Option<Arc<dyn dedupgate_embedded::engine::DurableView>> {
        self.inner.durable_view()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_with_many_waiters_answers_them_only_after_its_sync_and_each_is_durable() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("engine");
    let gate = Arc::new((
        std::sync::Mutex::new((usize::MAX, false)),
        std::sync::Condvar::new(),
    ));
    let opener_gate = gate.clone();
    let opener_path = path.clone();
    let opener: dedupgate_embedded::engine::EngineOpener = Box::new(move || {
        Ok(Box::new(CountedCommits {
            inner: Box::new(dedupgate_embedded::engine::FjallEngine::open(&opener_path)?),
            gate: opener_gate.clone(),
        }))
    });
    let store = Arc::new(
        EmbeddedStore::with_engine(opener, EmbeddedOptions::default(), "counted".into()).unwrap(),
    );
    let set_passes = |n: usize| {
        let (lock, cv) = &*gate;
        lock.lock().unwrap().0 = n;
        cv.notify_all();
    };
    let wait_for_held = || {
        let (lock, cv) = &*gate;
        let mut state = lock.lock().unwrap();
        while !state.1 {
            state = cv.wait(state).unwrap();
        }
    };
    let spawn_claim = |key: String| {
        let store = store.clone();
        tokio::spawn(async move { (key.clone(), store.apply_op(id(&key), claim_op()).await) })
    };
    // A first commit is held after its sync; the claims sent meanwhile queue up and go into the
    // next commit together: more waiters than the writer answers itself.
    set_passes(0);
    let first = spawn_claim("first".into());
    wait_for_held();
    let many: Vec<_> = (0..32).map(|i| spawn_claim(format!("many-{i}"))).collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!first.is_finished(), "answered before its commit finished");
    set_passes(1);
    let (_, answer) = first.await.unwrap();
    assert!(
        matches!(answer, Ok(Outcome::Claimed(Claim::New(_)))),
        "{answer:?}"
    );
    // The 32 are decided, written and synced, then held before their answers.
    wait_for_held();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        many.iter().all(|t| !t.is_finished()),
        "a claim was answered before its commit finished"
    );
    set_passes(usize::MAX);
    let mut fences = Vec::new();
    for t in many {
        let (key, answer) = t.await.unwrap();
        let Ok(Outcome::Claimed(Claim::New(lease))) = answer else {
            panic!("{key}: {answer:?}")
        };
        fences.push((key, lease.fence));
    }
    // That commit's answers went through the answer thread.
    let threads: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .collect();
    assert!(
        threads.iter().any(|c| c.trim() == "dedupgate-answe"),
        "no answer thread among {threads:?}"
    );
    drop(store);
    let reopen_path = path.clone();
    let store = EmbeddedStore::with_engine(
        Box::new(move || {
            Ok(Box::new(dedupgate_embedded::engine::FjallEngine::open(
                &reopen_path,
            )?))
        }),
        EmbeddedOptions::default(),
        "reopened".into(),
    )
    .unwrap();
    for (key, fence) in fences {
        let record = get(&store, &key).await.unwrap().expect("acknowledged");
        assert_eq!(record.fence, fence, "{key}");
    }
}

/// A store of format 2 (before the key set) is migrated at open: its records stay, the engine
/// and the format file say the current version afterwards, and the key set works.
#[tokio::test]
async fn a_format_2_store_is_migrated_at_open_and_keeps_its_records() {
    use dedupgate_core::Namespace;
    use dedupgate_embedded::{KeySetCall, FORMAT_VERSION};
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = tmp.path().join(ENGINE_DIR_NAME);
    {
        let store = open(tmp.path()).unwrap();
        store.apply_op(id("kept"), mark_op(json!(7))).await.unwrap();
    }
    // Turn it into what a format-2 build left: version 2 in the engine's meta and the file.
    raw_put(tmp.path(), "meta", b"format_version", &2u64.to_le_bytes());
    std::fs::write(engine_dir.join("FORMAT"), "2\n").unwrap();

    let store = open(tmp.path()).unwrap();
    let record = get(&store, "kept")
        .await
        .unwrap()
        .expect("the record survived");
    assert_eq!(record.result, Some(json!(7)));
    let call = KeySetCall {
        namespace: Namespace::new("test").unwrap(),
        record: Vec::new(),
        check: vec![[1; 16]],
        record_new: true,
        gate_keys: Vec::new(),
        ttl_ms: DAY_MS,
        forget: Vec::new(),
    };
    assert_eq!(store.key_set(call).await.unwrap(), vec![true]);
    drop(store);
    let file = std::fs::read_to_string(engine_dir.join("FORMAT")).unwrap();
    assert_eq!(file.trim(), FORMAT_VERSION.to_string());
    assert_eq!(raw_meta(tmp.path(), "format_version"), FORMAT_VERSION);
}

/// Turns a closed store into what a format-3 build left, with `members` (key, value) in that
/// format's key set (one engine entry per key).
fn make_format_3(dir: &Path, members: &[(Vec<u8>, Vec<u8>)]) {
    {
        let ks = fjall::Config::new(dir.join(ENGINE_DIR_NAME).join("keyspace"))
            .open()
            .unwrap();
        let opts = fjall::PartitionCreateOptions::default;
        let set = ks.open_partition("keyset", opts()).unwrap();
        for (key, value) in members {
            set.insert(key, value).unwrap();
        }
        let meta = ks.open_partition("meta", opts()).unwrap();
        meta.insert("format_version", 3u64.to_le_bytes()).unwrap();
        ks.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    std::fs::write(dir.join(ENGINE_DIR_NAME).join("FORMAT"), "3\n").unwrap();
}

/// A format-3 member: 16 id bytes ++ namespace -> version 1 ++ expiry (u64 big-endian ms).
fn member_v3(id: u32, ns: &str, expires_at_ms: u64) -> (Vec<u8>, Vec<u8>) {
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&id.to_be_bytes());
    key[4..8].copy_from_slice(&id.wrapping_mul(2_654_435_761).to_le_bytes());
    let mut value = vec![1u8];
    value.extend_from_slice(&expires_at_ms.to_be_bytes());
    ([&key[..], ns.as_bytes()].concat(), value)
}

fn id_v3(id: u32) -> [u8; 16] {
    member_v3(id, "", 0).0.try_into().unwrap()
}

/// A store of format 3 (one key-set entry per key) is migrated at open: every live member is
/// known afterwards, in its own namespace only, an expired one is not, the records stay, and
/// no format-3 entry is left.
#[tokio::test]
async fn a_format_3_key_set_is_rewritten_as_chunks_at_open() {
    use dedupgate_core::Namespace;
    use dedupgate_embedded::{KeySetCall, FORMAT_VERSION};
    let tmp = tempfile::tempdir().unwrap();
    {
        let store = open(tmp.path()).unwrap();
        store.apply_op(id("kept"), mark_op(json!(7))).await.unwrap();
    }
    let now_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    // More than a migration page (10,000) and a chunk's worth in "p", one expired, one in "q"
    // with another expiry.
    let mut members: Vec<_> = (0..12_000)
        .map(|i| member_v3(i, "p", now_ms + DAY_MS))
        .collect();
    members.push(member_v3(20_000, "p", now_ms - 1));
    members.push(member_v3(20_001, "q", now_ms + 2 * DAY_MS));
    make_format_3(tmp.path(), &members);

    let store = open(tmp.path()).unwrap();
    let check = |ns: &str, check: Vec<[u8; 16]>| KeySetCall {
        namespace: Namespace::new(ns).unwrap(),
        record: Vec::new(),
        check,
        record_new: false,
        gate_keys: Vec::new(),
        ttl_ms: DAY_MS,
        forget: Vec::new(),
    };
    let live: Vec<_> = (0..12_000).map(id_v3).collect();
    assert_eq!(
        store.key_set(check("p", live)).await.unwrap(),
        vec![false; 12_000]
    );
    let others = vec![id_v3(20_000), id_v3(20_001)];
    assert_eq!(
        store.key_set(check("p", others.clone())).await.unwrap(),
        vec![true, true],
        "expired, and another namespace's"
    );
    assert_eq!(
        store.key_set(check("q", others)).await.unwrap(),
        vec![true, false]
    );
    let record = get(&store, "kept")
        .await
        .unwrap()
        .expect("the record survived");
    assert_eq!(record.result, Some(json!(7)));
    drop(store);
    let ks = fjall::Config::new(tmp.path().join(ENGINE_DIR_NAME).join("keyspace"))
        .open()
        .unwrap();
    let old = ks
        .open_partition("keyset", fjall::PartitionCreateOptions::default())
        .unwrap();
    assert!(old.is_empty().unwrap(), "format 3's members are gone");
    drop((old, ks));
    let file = std::fs::read_to_string(tmp.path().join(ENGINE_DIR_NAME).join("FORMAT")).unwrap();
    assert_eq!(file.trim(), FORMAT_VERSION.to_string());
    assert_eq!(raw_meta(tmp.path(), "format_version"), FORMAT_VERSION);
}

/// A format-3 member whose value this build cannot read stops the migration: the store does not
/// open (Corrupt, naming the member) rather than read that key as absent, and stays format 3.
#[tokio::test]
async fn an_unreadable_format_3_member_stops_the_migration() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()).unwrap());
    let (key, _) = member_v3(1, "p", 0);
    make_format_3(tmp.path(), &[(key, vec![7, 0, 0])]);
    match open(tmp.path()) {
        Err(OpenError::Corrupt { detail, .. }) => {
            assert!(detail.contains("key-set index entry"), "{detail}")
        }
        other => panic!("expected Corrupt, got {:?}", other.map(|_| ())),
    }
    let file = std::fs::read_to_string(tmp.path().join(ENGINE_DIR_NAME).join("FORMAT")).unwrap();
    assert_eq!(file.trim(), "3");
    assert_eq!(raw_meta(tmp.path(), "format_version"), 3);
}

#[test]
fn out_of_range_options_are_refused_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    for options in [
        EmbeddedOptions {
            cache_bytes: 1024,
            ..EmbeddedOptions::default()
        },
        EmbeddedOptions {
            cache_bytes: 65 << 30,
            ..EmbeddedOptions::default()
        },
        EmbeddedOptions {
            sweep_batch_max: 0,
            ..EmbeddedOptions::default()
        },
    ] {
        let err = EmbeddedStore::open(&dir, options).unwrap_err();
        assert!(matches!(err, OpenError::Options(_)), "{err}");
        assert!(!dir.exists(), "nothing created");
    }
    let bigger = EmbeddedOptions {
        cache_bytes: 256 << 20,
        ..EmbeddedOptions::default()
    };
    drop(EmbeddedStore::open(&dir, bigger).unwrap());
}

/// A sweep raises the persisted clock floor to its own instant: what it removed had expired by
/// then, so a restart's clock must not start before it.
#[tokio::test]
async fn a_sweep_raises_the_persisted_clock_floor() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let options = EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        sweep_interval_ms: 86_400_000, // no background sweep: the test sweeps
        ..EmbeddedOptions::default()
    };
    {
        let store = EmbeddedStore::open(tmp.path(), options).unwrap();
        let op = Op::Mark {
            ttl_ms: 1_000,
            fingerprint: None,
            result: None,
        };
        store.apply_op(id("short"), op).await.unwrap();
        clock.advance(5_000_000);
        assert_eq!(store.sweep_expired(100).await.unwrap(), 1);
    }
    assert_eq!(
        raw_meta(tmp.path(), "clock_high_water_ms"),
        6_000_000,
        "the sweep's instant"
    );
}

/// The writer skips the engine's read of an id its filter of stored ids has never seen
/// (`idfilter`). A stored id must be found by the writer whether it was stored before this open
/// (found by the filter's scan, or read from the engine while the scan runs) or during it, and a
/// new id must stay new. Extending a lease is a change, so the writer (never the durable view)
/// reads each entry: a stored id it took for absent would answer "lease lost".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_finds_stored_ids_across_reopens_while_and_after_the_id_filter_is_built() {
    const STORED: usize = 30_000;
    const BATCH: usize = 2_500;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let key = |i: usize| id(&format!("k{i}"));
    let claims = |range: std::ops::Range<usize>| -> Vec<(RecordId, Op)> {
        range.map(|i| (key(i), claim_op())).collect()
    };
    let new_tokens = |answers: Vec<Result<Outcome, GateError>>| -> Vec<Token> {
        answers
            .into_iter()
            .map(|a| match a {
                Ok(Outcome::Claimed(Claim::New(lease))) => lease.token,
                other => panic!("a fresh key answered {other:?}"),
            })
            .collect()
    };
    let mut tokens = Vec::with_capacity(STORED);
    {
        let store = open(&dir).unwrap();
        for start in (0..STORED).step_by(BATCH) {
            tokens.extend(new_tokens(
                store.apply_ops(claims(start..start + BATCH)).await,
            ));
        }
    }
    for round in 0..3 {
        let store = open(&dir).unwrap();
        // The first batch goes in at once, while the scan of the stored ids has barely begun.
        for start in (0..STORED).step_by(BATCH) {
            let extends = (start..start + BATCH)
                .map(|i| {
                    let op = Op::Extend {
                        token: tokens[i].clone(),
                        lease_ms: 3_600_000,
                    };
                    (key(i), op)
                })
                .collect();
            for (i, answer) in store.apply_ops(extends).await.into_iter().enumerate() {
                assert!(
                    matches!(answer, Ok(Outcome::Extended { .. })),
                    "round {round}, key {}: {answer:?}",
                    start + i
                );
            }
        }
        let fresh = STORED + round * BATCH..STORED + (round + 1) * BATCH;
        let fresh_tokens = new_tokens(store.apply_ops(claims(fresh.clone())).await);
        assert_eq!(fresh_tokens.len(), BATCH);
        for answer in store.apply_ops(claims(fresh)).await {
            assert!(
                matches!(answer, Ok(Outcome::Claimed(Claim::Duplicate { .. }))),
                "{answer:?}"
            );
        }
    }
}
