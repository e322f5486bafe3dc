//! The key set of `dedup --ledger` (`EmbeddedStore::key_set`): both orders, expiry on the
//! store's clock, namespaces, repeats within a call, what survives a reopen, the sweeper,
//! forgetting, undecodable chunks, and refusals that change nothing.

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::{GateError, ManualClock, Namespace, Store};
use dedupgate_embedded::keyset::KeyId;
use dedupgate_embedded::{EmbeddedOptions, EmbeddedStore, KeySetCall};

const TTL_MS: u64 = 10_000;

fn id(i: u32) -> KeyId {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&i.to_be_bytes());
    k[4..8].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    k
}

fn ids(range: std::ops::Range<u32>) -> Vec<KeyId> {
    range.map(id).collect()
}

fn call(ns: &str, record: Vec<KeyId>, check: Vec<KeyId>, record_new: bool) -> KeySetCall {
    KeySetCall {
        namespace: Namespace::new(ns).unwrap(),
        record,
        check,
        record_new,
        gate_keys: Vec::new(),
        ttl_ms: TTL_MS,
        forget: Vec::new(),
    }
}

fn open(dir: &std::path::Path, clock: &ManualClock) -> EmbeddedStore {
    let options = EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        ..EmbeddedOptions::default()
    };
    EmbeddedStore::open(dir, options).unwrap()
}

/// Options on `clock` with a sweeper that runs every 20 ms.
fn sweeping(clock: &ManualClock) -> EmbeddedOptions {
    EmbeddedOptions {
        clock: Some(Arc::new(clock.clone())),
        sweep_interval_ms: 20,
        ..EmbeddedOptions::default()
    }
}

/// Waits (up to `polls` x 20 ms) until the sweeper has removed at least `ids`; returns how many.
async fn wait_swept(store: &EmbeddedStore, ids: u64, polls: usize) -> u64 {
    let mut swept = 0;
    for _ in 0..polls {
        swept = store.stats().await.unwrap().swept_total.unwrap();
        if swept >= ids {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    swept
}

/// A key-set partition of a closed store's engine, opened directly.
fn raw_partition(dir: &std::path::Path, name: &str) -> (fjall::Keyspace, fjall::PartitionHandle) {
    let keyspace = dir
        .join(dedupgate_embedded::ENGINE_DIR_NAME)
        .join("keyspace");
    let ks = fjall::Config::new(keyspace).open().unwrap();
    let p = ks
        .open_partition(name, fjall::PartitionCreateOptions::default())
        .unwrap();
    (ks, p)
}

#[tokio::test]
async fn record_new_stores_new_keys_in_the_same_call_and_they_survive_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    let first = store.key_set(call("p", vec![], ids(0..100), true)).await;
    assert_eq!(first.unwrap(), vec![true; 100]);
    // Half known, half new.
    let again = store
        .key_set(call("p", vec![], ids(50..150), true))
        .await
        .unwrap();
    assert_eq!(again[..50], [false; 50]);
    assert_eq!(again[50..], [true; 50]);
    drop(store);
    let store = open(tmp.path(), &clock);
    let after = store
        .key_set(call("p", vec![], ids(0..160), true))
        .await
        .unwrap();
    assert_eq!(
        after[..150],
        [false; 150],
        "every acknowledged key survived"
    );
    assert_eq!(after[150..], [true; 10]);
}

#[tokio::test]
async fn check_alone_stores_nothing_until_the_keys_are_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    let batch = ids(0..10);
    for _ in 0..2 {
        let answers = store
            .key_set(call("p", vec![], batch.clone(), false))
            .await
            .unwrap();
        assert_eq!(answers, vec![true; 10], "nothing was recorded yet");
    }
    // The next call records the emitted batch, then checks a new one that overlaps it.
    let answers = store
        .key_set(call("p", batch.clone(), ids(5..15), false))
        .await
        .unwrap();
    assert_eq!(answers[..5], [false; 5]);
    assert_eq!(answers[5..], [true; 5]);
    drop(store);
    let store = open(tmp.path(), &clock);
    let answers = store
        .key_set(call("p", vec![], ids(0..15), false))
        .await
        .unwrap();
    assert_eq!(answers[..10], [false; 10]);
    assert_eq!(answers[10..], [true; 5]);
}

#[tokio::test]
async fn a_repeat_within_one_call_is_new_once_and_namespaces_are_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    for record_new in [false, true] {
        let ns = if record_new { "b" } else { "a" };
        let answers = store
            .key_set(call(
                ns,
                vec![],
                vec![id(1), id(2), id(1), id(1)],
                record_new,
            ))
            .await
            .unwrap();
        assert_eq!(
            answers,
            vec![true, true, false, false],
            "record_new {record_new}"
        );
    }
    let other = store
        .key_set(call("c", vec![], vec![id(1)], true))
        .await
        .unwrap();
    assert_eq!(other, vec![true], "another namespace has its own keys");
}

/// `forget` removes members (an operator's `dedupgate forget`): their answers say which were
/// live, the next sighting of each is new, other keys and namespaces are untouched, and the
/// removal survives a reopen.
#[tokio::test]
async fn forgotten_keys_are_new_again_and_stay_forgotten_after_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    store
        .key_set(call("p", vec![], ids(0..10), true))
        .await
        .unwrap();
    store
        .key_set(call("q", vec![], ids(0..10), true))
        .await
        .unwrap();
    let mut forget = call("p", vec![], vec![], false);
    // Two live keys, one never stored.
    forget.forget = vec![id(3), id(7), id(99)];
    assert_eq!(
        store.key_set(forget).await.unwrap(),
        vec![true, true, false]
    );
    drop(store);
    let store = open(tmp.path(), &clock);
    let p = store
        .key_set(call("p", vec![], ids(0..10), false))
        .await
        .unwrap();
    let new: Vec<usize> = (0..10).filter(|&i| p[i]).collect();
    assert_eq!(new, vec![3, 7], "only the forgotten keys are new");
    let q = store
        .key_set(call("q", vec![], ids(0..10), false))
        .await
        .unwrap();
    assert_eq!(q, vec![false; 10], "another namespace is untouched");

    // Forgotten and checked in one call: forgotten first, so new (and stored again).
    let mut both = call("p", vec![], vec![id(1)], true);
    both.forget = vec![id(1)];
    assert_eq!(store.key_set(both).await.unwrap(), vec![true, true]);
    let again = store
        .key_set(call("p", vec![], vec![id(1)], false))
        .await
        .unwrap();
    assert_eq!(again, vec![false], "recorded again by the same call");

    // An expired member is removed too, but was not live.
    clock.advance(TTL_MS);
    let mut expired = call("p", vec![], vec![], false);
    expired.forget = vec![id(0)];
    assert_eq!(store.key_set(expired).await.unwrap(), vec![false]);
}

#[tokio::test]
async fn keys_expire_on_the_stores_clock_and_the_sweeper_removes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let options = EmbeddedOptions {
        sweep_batch_max: 64,
        ..sweeping(&clock)
    };
    let store = EmbeddedStore::open(tmp.path(), options).unwrap();
    store
        .key_set(call("p", vec![], ids(0..500), true))
        .await
        .unwrap();
    clock.advance(TTL_MS / 2);
    let keeper = store
        .key_set(call("p", vec![], ids(500..501), true))
        .await
        .unwrap();
    assert_eq!(keeper, vec![true]);
    clock.advance(TTL_MS / 2 - 1);
    let live = store
        .key_set(call("p", vec![], ids(0..1), false))
        .await
        .unwrap();
    assert_eq!(
        live,
        vec![false],
        "one ms before its ttl a key is still known"
    );
    clock.advance(1);
    // The background sweeper removes the expired chunk, 500 keys, and keeps the live one.
    let swept = wait_swept(&store, 500, 500).await;
    assert_eq!(swept, 500, "every expired key swept, the live one kept");
    let answers = store
        .key_set(call("p", vec![], ids(0..501), false))
        .await
        .unwrap();
    assert_eq!(answers[..500], [true; 500], "expired keys are new again");
    assert!(!answers[500], "the keeper is still known");
}

#[tokio::test]
async fn a_bad_ttl_is_refused_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    let before = store.commits_total();
    for ttl_ms in [0, u64::MAX] {
        let mut c = call("p", ids(0..3), ids(3..6), true);
        c.ttl_ms = ttl_ms;
        let err = store.key_set(c).await.unwrap_err();
        assert!(matches!(err, GateError::Invalid(_)), "{err:?}");
    }
    assert_eq!(store.commits_total(), before);
    let answers = store
        .key_set(call("p", vec![], ids(0..6), false))
        .await
        .unwrap();
    assert_eq!(answers, vec![true; 6]);
}

#[tokio::test]
async fn live_gate_records_of_the_namespace_count_as_known_keys() {
    use dedupgate_core::{Claim, Op, Outcome, RecordId};
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let store = open(tmp.path(), &clock);
    let rid = |k: &str| RecordId::new("p", k).unwrap();
    // A ledger kept as gate records: a mark (completed) and claims (in progress).
    let mark = Op::Mark {
        ttl_ms: TTL_MS,
        fingerprint: None,
        result: None,
    };
    let claim = |lease_ms| Op::Claim {
        ttl_ms: TTL_MS,
        lease_ms,
        fingerprint: None,
        owner: None,
    };
    store.apply_op(rid("marked"), mark).await.unwrap();
    store.apply_op(rid("held"), claim(TTL_MS)).await.unwrap();
    let Outcome::Claimed(Claim::New(lease)) = store
        .apply_op(rid("released"), claim(TTL_MS))
        .await
        .unwrap()
    else {
        panic!("a new claim")
    };
    let release = Op::Release {
        token: lease.token.clone(),
    };
    store.apply_op(rid("released"), release).await.unwrap();
    store.apply_op(rid("lapsed"), claim(100)).await.unwrap();
    clock.advance(100);
    let names = ["marked", "held", "released", "lapsed", "never"];
    let mut c = call("p", vec![], ids(0..5), false);
    c.gate_keys = names.iter().map(|n| n.to_string()).collect();
    let answers = store.key_set(c.clone()).await.unwrap();
    assert_eq!(answers, vec![false, false, true, true, true], "{names:?}");
    // Another namespace's records do not count; nor do records after their ttl.
    let mut other = c.clone();
    other.namespace = Namespace::new("q").unwrap();
    assert_eq!(store.key_set(other).await.unwrap(), vec![true; 5]);
    clock.advance(TTL_MS);
    assert_eq!(store.key_set(c.clone()).await.unwrap(), vec![true; 5]);
    // A mismatched list is refused.
    c.gate_keys.pop();
    assert!(matches!(store.key_set(c).await, Err(GateError::Invalid(_))));
}

/// A store opened only for short runs still sweeps every expired key: chunks sort by expiry,
/// so the sweeper finds the expired ones first however many live keys the set holds.
#[tokio::test]
async fn expired_keys_are_swept_in_short_sessions_behind_many_live_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let open_sweeping = || {
        let options = EmbeddedOptions {
            sweep_batch_max: 64,
            ..sweeping(&clock)
        };
        EmbeddedStore::open(tmp.path(), options).unwrap()
    };
    // 2,000 live keys first in key order, then 100 that expire.
    let live: Vec<KeyId> = (0..2_000u32)
        .map(|i| {
            let mut k = [0u8; 16];
            k[1..5].copy_from_slice(&i.to_be_bytes());
            k
        })
        .collect();
    let doomed: Vec<KeyId> = (0..100u32)
        .map(|i| {
            let mut k = [0xffu8; 16];
            k[1..5].copy_from_slice(&i.to_be_bytes());
            k
        })
        .collect();
    {
        let store = open_sweeping();
        let mut c = call("p", vec![], doomed.clone(), true);
        c.ttl_ms = 10;
        store.key_set(c).await.unwrap();
        let mut c = call("p", vec![], live.clone(), true);
        c.ttl_ms = 3_600_000;
        store.key_set(c).await.unwrap();
    }
    clock.advance(10);
    // Short sessions: each a few sweeps of at most 64 chunks.
    let mut swept = 0;
    for _ in 0..40 {
        let store = open_sweeping();
        tokio::time::sleep(Duration::from_millis(150)).await;
        swept += store.stats().await.unwrap().swept_total.unwrap();
        drop(store);
        if swept >= 100 {
            break;
        }
    }
    assert_eq!(swept, 100, "every expired key swept over short sessions");
    let store = open_sweeping();
    let answers = store
        .key_set(call("p", vec![], live[..5].to_vec(), false))
        .await
        .unwrap();
    assert_eq!(answers, vec![false; 5], "live keys kept");
}

/// A chunk whose value this build cannot read fails every call that needs the set, changing
/// nothing (which keys it holds is unknown, and must never read as "absent"); once its expiry
/// has passed, the sweeper removes it (nothing in it is live) and the set works again.
#[tokio::test]
async fn an_unreadable_chunk_fails_calls_until_it_expires_and_is_swept() {
    use dedupgate_core::StoreError;
    use dedupgate_embedded::keyset::chunk_key;
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let open_sweeping = || EmbeddedStore::open(tmp.path(), sweeping(&clock)).unwrap();
    {
        let store = open(tmp.path(), &clock);
        store
            .key_set(call("p", vec![], ids(0..10), true))
            .await
            .unwrap();
    }
    {
        let (ks, p) = raw_partition(tmp.path(), "keyset_chunks");
        p.insert(chunk_key(1_000_000 + TTL_MS, u64::MAX), [9u8, 9, 9])
            .unwrap();
        ks.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    {
        let store = open_sweeping();
        let before = store.commits_total();
        let err = store
            .key_set(call("p", vec![], ids(0..20), true))
            .await
            .unwrap_err();
        assert!(
            matches!(err, GateError::Store(StoreError::Corrupt(_))),
            "{err:?}"
        );
        let mut forget = call("p", vec![], vec![], false);
        forget.forget = vec![id(0)];
        assert!(store.key_set(forget).await.is_err(), "forget refuses too");
        assert_eq!(store.commits_total(), before, "nothing written");
        clock.advance(TTL_MS);
        let swept = wait_swept(&store, 10, 200).await;
        assert_eq!(swept, 10, "the readable chunk's keys swept");
        let answers = store
            .key_set(call("p", vec![], ids(0..20), true))
            .await
            .unwrap();
        assert_eq!(answers, vec![true; 20]);
    }
    let (_ks, p) = raw_partition(tmp.path(), "keyset_chunks");
    assert_eq!(p.len().unwrap(), 1, "only the last call's chunk is left");
}

/// Past its memory limit the writer moves the ids of the chunks that expire first into a
/// per-key index on disk: every key stays known (before and after a reopen), a key recorded
/// with a shorter ttl (its chunk sorts before the moved ones) too, a forgotten moved key is new
/// again, and once all expire the sweeper removes chunks and index entries alike.
#[tokio::test]
async fn past_the_memory_limit_keys_move_to_an_index_and_stay_known() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_000_000);
    let open_limited = || {
        let options = EmbeddedOptions {
            key_set_memory_ids: 100,
            ..sweeping(&clock)
        };
        EmbeddedStore::open(tmp.path(), options).unwrap()
    };
    let store = open_limited();
    for c in 0..20 {
        let answers = store
            .key_set(call("p", vec![], ids(c * 50..(c + 1) * 50), true))
            .await
            .unwrap();
        assert_eq!(answers, vec![true; 50], "call {c}");
    }
    let mut short = call("p", ids(5_000..5_010), vec![], false);
    short.ttl_ms = TTL_MS / 2;
    store.key_set(short).await.unwrap();
    let all: Vec<KeyId> = ids(0..1_000).into_iter().chain(ids(5_000..5_010)).collect();
    let known = store
        .key_set(call("p", vec![], all.clone(), false))
        .await
        .unwrap();
    assert_eq!(known, vec![false; 1_010], "every key known");
    drop(store);
    let partition_len = |name: &str| raw_partition(tmp.path(), name).1.len().unwrap();
    assert!(
        partition_len("keyset") >= 900,
        "most ids moved to the index"
    );
    let store = open_limited();
    let known = store
        .key_set(call("p", vec![], all.clone(), false))
        .await
        .unwrap();
    assert_eq!(known, vec![false; 1_010], "every key known after a reopen");
    let mut forget = call("p", vec![], vec![], false);
    forget.forget = vec![id(0)];
    assert_eq!(store.key_set(forget).await.unwrap(), vec![true]);
    let answers = store
        .key_set(call("p", vec![], ids(0..2), false))
        .await
        .unwrap();
    assert_eq!(answers, vec![true, false], "the forgotten key alone is new");
    clock.advance(TTL_MS);
    let swept = wait_swept(&store, 1_009, 200).await;
    assert_eq!(swept, 1_009, "every id but the forgotten one swept");
    drop(store);
    assert_eq!(partition_len("keyset_chunks"), 0, "every chunk swept");
    assert_eq!(partition_len("keyset"), 0, "every index entry swept");
}
