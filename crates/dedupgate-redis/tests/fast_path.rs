//! The batch fast path: `apply_batch` with 16 or more claims and marks of keys that appear once
//! writes new keys with a native `SET … NX GET` and sends keys that exist through the script.
//! Each scenario runs on a server of its own and on a three-master cluster, counts the commands
//! the servers ran (so a test fails if the path it means to exercise was not taken), and checks
//! that the records the fast path writes are the ones the script writes and reads.

use dedupgate_core::testkit::ApplyOp;
use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::{
    Claim, GateError, Lease, Mark, Op, Outcome, Record, RecordId, State, Store, StoreError,
};
use dedupgate_redis::keys::record_keys;
use dedupgate_redis::testkit::{cli, RedisCluster, RedisServer};
use dedupgate_redis::RedisStore;
use serde_json::json;

/// Ops of fresh keys each batch below carries, at least the fast path's threshold.
const FRESH: usize = 20;

/// A store and the servers behind it.
struct Target {
    store: Arc<dyn Store>,
    ports: Vec<u16>,
    cluster: bool,
    url: String,
}

impl Target {
    fn reset_stats(&self) {
        for &port in &self.ports {
            cli(port, &["CONFIG", "RESETSTAT"]).expect("CONFIG RESETSTAT");
        }
    }

    /// Calls of `cmd` on every server since the last reset (commands a script runs count too).
    fn calls(&self, cmd: &str) -> u64 {
        self.ports
            .iter()
            .map(|&port| {
                let stats = cli(port, &["INFO", "commandstats"]).expect("INFO commandstats");
                stats
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
                    .and_then(|rest| rest.split(',').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Runs a Lua script on the node of `key`, with the key as `KEYS[1]`.
    async fn eval_on_key(&self, script: &str, key: &[u8]) -> redis::Value {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(script).arg(1).arg(key);
        if self.cluster {
            let nodes: Vec<String> = self
                .ports
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}"))
                .collect();
            let client = redis::cluster::ClusterClient::new(nodes).unwrap();
            let mut conn = client.get_async_connection().await.unwrap();
            cmd.query_async(&mut conn).await.unwrap()
        } else {
            let client = redis::Client::open(self.url.as_str()).unwrap();
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            cmd.query_async(&mut conn).await.unwrap()
        }
    }
}

async fn single() -> (RedisServer, Target) {
    let server = tokio::task::spawn_blocking(|| RedisServer::start(&["--appendonly", "no"]))
        .await
        .unwrap()
        .expect("start redis-server");
    let store = RedisStore::open(&server.url()).await.expect("open store");
    let target = Target {
        store: Arc::new(store),
        ports: vec![server.port()],
        cluster: false,
        url: server.url(),
    };
    (server, target)
}

async fn cluster() -> (RedisCluster, Target) {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
        .expect("start a three-master cluster from redis-server");
    let store = RedisStore::open(&cluster.url())
        .await
        .expect("open cluster");
    let target = Target {
        store: Arc::new(store),
        ports: cluster.nodes().iter().map(RedisServer::port).collect(),
        cluster: true,
        url: cluster.url(),
    };
    (cluster, target)
}

fn id(ns: &str, key: impl Into<String>) -> RecordId {
    RecordId::new(ns, key).unwrap()
}

fn claim(ttl_ms: u64, lease_ms: u64, fingerprint: Option<&str>, owner: Option<&str>) -> Op {
    Op::Claim {
        ttl_ms,
        lease_ms,
        fingerprint: fingerprint.map(str::to_owned),
        owner: owner.map(str::to_owned),
    }
}

fn mark(ttl_ms: u64, fingerprint: Option<&str>, result: Option<serde_json::Value>) -> Op {
    Op::Mark {
        ttl_ms,
        fingerprint: fingerprint.map(str::to_owned),
        result,
    }
}

fn new_lease(r: &Result<Outcome, GateError>) -> Lease {
    match r {
        Ok(Outcome::Claimed(Claim::New(lease))) => lease.clone(),
        other => panic!("expected a new claim, got {other:?}"),
    }
}

fn duplicate(r: &Result<Outcome, GateError>) -> Record {
    match r {
        Ok(Outcome::Claimed(Claim::Duplicate { record }))
        | Ok(Outcome::Marked(Mark::Duplicate { record })) => record.clone(),
        other => panic!("expected a duplicate, got {other:?}"),
    }
}

async fn get(store: &Arc<dyn Store>, id: &RecordId) -> Option<Record> {
    match store.apply_op(id.clone(), Op::Get).await {
        Ok(Outcome::Found(r)) => r,
        other => panic!("get: {other:?}"),
    }
}

/// Fingerprints and owners of every MessagePack string header the record may need (fixstr,
/// str8, str16: tags are at most 256 bytes) and none.
fn tag(i: usize) -> Option<String> {
    match i % 5 {
        0 => None,
        1 => Some(format!("t{i}")),
        2 => Some(format!("{i:0>32}")),
        3 => Some(format!("{i:0>255}")),
        _ => Some(format!("{i:0>256}")),
    }
}

/// The ops of a batch of fresh keys: claims (plain, with fingerprint and owner, lease longer
/// than the ttl) and marks (with and without results of every length class).
fn fresh_ops(ns: &str) -> Vec<(RecordId, Op)> {
    (0..FRESH)
        .map(|i| {
            let k = id(ns, format!("fresh-{i}"));
            let op = match i % 4 {
                0 => claim(60_000, 30_000, None, None),
                1 => claim(5_000, 10_000, tag(i).as_deref(), tag(i + 1).as_deref()),
                2 => mark(60_000, tag(i).as_deref(), None),
                _ => mark(
                    60_000,
                    tag(i + 2).as_deref(),
                    Some(json!({"i": i, "pad": "x".repeat(i * 4000)})),
                ),
            };
            (k, op)
        })
        .collect()
}

/// Checks an answer to a fresh-key op against the op and what `GET` (the script) reads back.
async fn check_new(store: &Arc<dyn Store>, k: &RecordId, op: &Op, r: &Result<Outcome, GateError>) {
    let stored = get(store, k).await.expect("the new record is stored");
    match (op, r) {
        (
            Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner,
            },
            Ok(Outcome::Claimed(Claim::New(lease))),
        ) => {
            let now = stored.created_at_ms;
            assert_eq!(
                lease.fence,
                now * 1000,
                "fence is the decision's time × 1000"
            );
            assert_eq!(lease.lease_expires_at_ms, now + lease_ms);
            assert_eq!(lease.expires_at_ms, (now + ttl_ms).max(now + lease_ms));
            assert_eq!(lease.token.as_str().len(), 32);
            let want = Record {
                namespace: k.namespace.clone(),
                key: k.key.clone(),
                state: State::InProgress,
                fence: lease.fence,
                fingerprint: fingerprint.clone(),
                owner: owner.clone(),
                created_at_ms: now,
                expires_at_ms: lease.expires_at_ms,
                lease_expires_at_ms: Some(lease.lease_expires_at_ms),
                completed_at_ms: None,
                result: None,
            };
            assert_eq!(stored, want);
        }
        (
            Op::Mark {
                ttl_ms,
                fingerprint,
                result,
            },
            Ok(Outcome::Marked(Mark::New { record })),
        ) => {
            let now = record.created_at_ms;
            let want = Record {
                namespace: k.namespace.clone(),
                key: k.key.clone(),
                state: State::Completed,
                fence: now * 1000,
                fingerprint: fingerprint.clone(),
                owner: None,
                created_at_ms: now,
                expires_at_ms: now + ttl_ms,
                lease_expires_at_ms: None,
                completed_at_ms: Some(now),
                result: result.clone(),
            };
            assert_eq!(record, &want);
            assert_eq!(stored, want);
        }
        other => panic!("{k:?}: {other:?}"),
    }
}

/// Every record the fast path wrote repacks, through Redis's own cmsgpack in the order of the
/// script's `enc`, to exactly its stored bytes: the script would have written the same bytes.
async fn check_bytes(t: &Target, ids: &[RecordId]) {
    const REPACK: &str = "local raw = redis.call('GET', KEYS[1]) \
        local v = cmsgpack.unpack(raw) \
        if cmsgpack.pack({v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11]}) == raw \
        then return 1 else return 0 end";
    for k in ids {
        let key = record_keys("dg", k).record;
        let same = t.eval_on_key(REPACK, &key).await;
        assert_eq!(
            same,
            redis::Value::Int(1),
            "{k:?}: bytes differ from cmsgpack's"
        );
    }
}

/// A batch of fresh keys is decided without the script; the same batch again is all
/// duplicates (through the script), with the records and results the first batch stored, but
/// for claims naming an owner, which get their claim back.
async fn fresh_then_duplicates(t: &Target) {
    let ns = "fp.fresh";
    let ops = fresh_ops(ns);
    t.reset_stats();
    let first = t.store.apply_ops(ops.clone()).await;
    assert_eq!(t.calls("evalsha"), 0, "fresh keys must not run the script");
    assert_eq!(t.calls("set"), FRESH as u64);
    for ((k, op), r) in ops.iter().zip(&first) {
        check_new(&t.store, k, op, r).await;
    }
    let ids: Vec<RecordId> = ops.iter().map(|(k, _)| k.clone()).collect();
    check_bytes(t, &ids).await;

    t.reset_stats();
    let again = t.store.apply_ops(ops.clone()).await;
    assert!(
        t.calls("evalsha") > 0,
        "existing keys go through the script"
    );
    for (((k, op), r1), r2) in ops.iter().zip(&first).zip(&again) {
        let stored = get(&t.store, k).await.unwrap();
        match (op, r1) {
            (Op::Claim { owner: Some(_), .. }, Ok(Outcome::Claimed(Claim::New(lease)))) => {
                // The same owner claiming again gets its claim back, with a renewed lease.
                let renewed = new_lease(r2);
                assert_eq!((&renewed.token, renewed.fence), (&lease.token, lease.fence));
                assert!(renewed.lease_expires_at_ms >= lease.lease_expires_at_ms);
                assert_eq!(
                    stored.lease_expires_at_ms,
                    Some(renewed.lease_expires_at_ms)
                );
            }
            (Op::Claim { .. }, Ok(Outcome::Claimed(Claim::New(lease)))) => {
                assert_eq!(duplicate(r2), stored, "{k:?}");
                assert_eq!(stored.fence, lease.fence);
            }
            (Op::Mark { .. }, Ok(Outcome::Marked(Mark::New { record }))) => {
                assert_eq!(duplicate(r2), stored, "{k:?}");
                assert_eq!(&stored, record, "a mark's result is replayed");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Fresh keys beside existing ones in every state, in one batch.
async fn mixed(t: &Target) {
    let ns = "fp.mixed";
    let s = &t.store;
    let k = |name: &str| id(ns, name);
    let held = new_lease(
        &s.apply_op(k("held"), claim(60_000, 60_000, None, None))
            .await,
    );
    let stale = new_lease(&s.apply_op(k("stale"), claim(60_000, 100, None, None)).await);
    let done = new_lease(
        &s.apply_op(k("done"), claim(60_000, 60_000, None, None))
            .await,
    );
    s.apply_op(
        k("done"),
        Op::Complete {
            token: done.token.clone(),
            result: Some(json!({"ok": 1})),
            ttl_ms: None,
        },
    )
    .await
    .unwrap();
    let expired = new_lease(&s.apply_op(k("expired"), claim(100, 100, None, None)).await);
    let released = new_lease(
        &s.apply_op(k("released"), claim(60_000, 60_000, None, None))
            .await,
    );
    s.apply_op(
        k("released"),
        Op::Release {
            token: released.token.clone(),
        },
    )
    .await
    .unwrap();
    s.apply_op(k("fp"), claim(60_000, 60_000, Some("A"), None))
        .await
        .unwrap();
    let owned = new_lease(
        &s.apply_op(k("owned"), claim(60_000, 1_000, None, Some("w1")))
            .await,
    );
    let marked = match s
        .apply_op(k("marked"), mark(60_000, None, Some(json!("r"))))
        .await
    {
        Ok(Outcome::Marked(Mark::New { record })) => record,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut ops: Vec<(RecordId, Op)> = (0..FRESH)
        .map(|i| (k(&format!("new-{i}")), claim(60_000, 30_000, None, None)))
        .collect();
    let existing = [
        ("held", claim(60_000, 30_000, None, None)),
        ("stale", claim(60_000, 30_000, None, None)),
        ("done", claim(60_000, 30_000, None, None)),
        ("expired", claim(60_000, 30_000, None, None)),
        ("released", mark(60_000, None, Some(json!([1, 2])))),
        ("fp", claim(60_000, 30_000, Some("B"), None)),
        ("owned", claim(60_000, 30_000, None, Some("w1"))),
        ("marked", mark(60_000, None, None)),
        ("held-mark", mark(60_000, None, None)),
    ];
    // Interleave: existing keys between fresh ones.
    for (i, (name, op)) in existing.iter().enumerate() {
        let name = if *name == "held-mark" { "held" } else { name };
        ops.insert(i * 2 + 1, (k(name), op.clone()));
    }
    // "held" appears twice: both of its ops go through the script, in order.
    t.reset_stats();
    let out = s.apply_ops(ops.clone()).await;
    assert!(t.calls("evalsha") > 0);
    let by_key = |name: &str| -> Vec<&Result<Outcome, GateError>> {
        ops.iter()
            .zip(&out)
            .filter(|((id, _), _)| id.key.as_str() == name)
            .map(|(_, r)| r)
            .collect()
    };
    for ((kid, op), r) in ops.iter().zip(&out) {
        if kid.key.as_str().starts_with("new-") {
            check_new(s, kid, op, r).await;
        }
    }
    let held_answers = by_key("held");
    assert_eq!(held_answers.len(), 2);
    assert_eq!(duplicate(held_answers[0]).fence, held.fence);
    assert_eq!(duplicate(held_answers[1]).fence, held.fence);
    let taken = new_lease(by_key("stale")[0]);
    assert!(taken.fence > stale.fence && taken.token != stale.token);
    let done_rec = duplicate(by_key("done")[0]);
    assert_eq!(done_rec.state, State::Completed);
    assert_eq!(done_rec.result, Some(json!({"ok": 1})));
    assert!(new_lease(by_key("expired")[0]).fence > expired.fence);
    match by_key("released")[0] {
        Ok(Outcome::Marked(Mark::New { record })) => {
            assert!(record.fence > released.fence);
            assert_eq!(record.result, Some(json!([1, 2])));
        }
        other => panic!("released: {other:?}"),
    }
    assert!(matches!(
        by_key("fp")[0],
        Err(GateError::FingerprintMismatch)
    ));
    let again = new_lease(by_key("owned")[0]);
    assert_eq!((again.token, again.fence), (owned.token, owned.fence));
    assert_eq!(duplicate(by_key("marked")[0]), marked);
}

/// A key twice (and three times) in one batch keeps its ops' order; fingerprints are checked
/// between ops of one batch.
async fn repeated_keys(t: &Target) {
    let ns = "fp.repeat";
    let k = |name: &str| id(ns, name);
    let mut ops: Vec<(RecordId, Op)> = (0..FRESH)
        .map(|i| (k(&format!("new-{i}")), mark(60_000, None, None)))
        .collect();
    ops.insert(3, (k("x"), claim(60_000, 30_000, None, None)));
    ops.insert(9, (k("x"), claim(60_000, 30_000, None, None)));
    ops.push((k("x"), Op::Get));
    ops.insert(5, (k("y"), mark(60_000, Some("A"), Some(json!(1)))));
    ops.insert(6, (k("y"), mark(60_000, Some("B"), Some(json!(2)))));
    ops.insert(7, (k("y"), mark(60_000, Some("A"), Some(json!(3)))));
    let out = t.store.apply_ops(ops.clone()).await;
    let answers = |name: &str| -> Vec<&Result<Outcome, GateError>> {
        ops.iter()
            .zip(&out)
            .filter(|((id, _), _)| id.key.as_str() == name)
            .map(|(_, r)| r)
            .collect()
    };
    let x = answers("x");
    let lease = new_lease(x[0]);
    let dup = duplicate(x[1]);
    assert_eq!(dup.fence, lease.fence);
    assert!(matches!(x[2], Ok(Outcome::Found(Some(r))) if r == &dup));
    let y = answers("y");
    let first = match y[0] {
        Ok(Outcome::Marked(Mark::New { record })) => record.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(first.result, Some(json!(1)));
    assert!(matches!(y[1], Err(GateError::FingerprintMismatch)));
    assert_eq!(duplicate(y[2]), first);
    for ((kid, op), r) in ops.iter().zip(&out) {
        if kid.key.as_str().starts_with("new-") {
            check_new(&t.store, kid, op, r).await;
        }
    }
}

/// Fresh keys written by the fast path, then a batch of the same keys with other fingerprints:
/// every one a mismatch, nothing changed.
async fn fingerprint_mismatch(t: &Target) {
    let ns = "fp.mismatch";
    let ops: Vec<(RecordId, Op)> = (0..FRESH)
        .map(|i| {
            let k = id(ns, format!("k{i}"));
            if i % 2 == 0 {
                (k, claim(60_000, 30_000, Some(&format!("a{i}")), None))
            } else {
                (k, mark(60_000, Some(&format!("a{i}")), Some(json!(i))))
            }
        })
        .collect();
    t.reset_stats();
    let first = t.store.apply_ops(ops.clone()).await;
    assert_eq!(t.calls("evalsha"), 0);
    let before: Vec<Option<Record>> = {
        let mut v = Vec::new();
        for ((k, op), r) in ops.iter().zip(&first) {
            check_new(&t.store, k, op, r).await;
            v.push(get(&t.store, k).await);
        }
        v
    };
    let other: Vec<(RecordId, Op)> = ops
        .iter()
        .map(|(k, op)| {
            let op = match op {
                Op::Claim { .. } => claim(60_000, 30_000, Some("other"), None),
                _ => mark(60_000, Some("other"), Some(json!("other"))),
            };
            (k.clone(), op)
        })
        .collect();
    for r in t.store.apply_ops(other.clone()).await {
        assert!(matches!(r, Err(GateError::FingerprintMismatch)), "{r:?}");
    }
    for ((k, _), b) in other.iter().zip(before) {
        assert_eq!(get(&t.store, k).await, b, "a mismatch changes nothing");
    }
}

/// Marks with results, then the same marks replayed: duplicates carrying the stored results.
async fn marks_replayed(t: &Target) {
    let ns = "fp.marks";
    let ops: Vec<(RecordId, Op)> = (0..FRESH * 2)
        .map(|i| {
            let result = json!({"n": i, "text": "é".repeat(i * 1000), "list": [i, null, true]});
            (id(ns, format!("m{i}")), mark(60_000, None, Some(result)))
        })
        .collect();
    t.reset_stats();
    let first = t.store.apply_ops(ops.clone()).await;
    assert_eq!(t.calls("evalsha"), 0);
    let ids: Vec<RecordId> = ops.iter().map(|(k, _)| k.clone()).collect();
    check_bytes(t, &ids).await;
    let replayed = t.store.apply_ops(ops.clone()).await;
    for (((k, op), r1), r2) in ops.iter().zip(&first).zip(&replayed) {
        check_new(&t.store, k, op, r1).await;
        let Ok(Outcome::Marked(Mark::New { record })) = r1 else {
            panic!("{r1:?}");
        };
        assert!(
            matches!(r2, Ok(Outcome::Marked(Mark::Duplicate { record: d })) if d == record),
            "{k:?}: {r2:?}"
        );
    }
}

/// Records the fast path wrote, acted on through the script: complete, release, extend,
/// owner re-claim and takeover after the lease passed, each answered as for a record the script
/// wrote itself.
async fn script_acts_on_fast_records(t: &Target) {
    let ns = "fp.acts";
    let ops: Vec<(RecordId, Op)> = (0..FRESH)
        .map(|i| {
            let lease_ms = if i % 5 == 4 { 200 } else { 30_000 };
            let op = claim(60_000, lease_ms, tag(i).as_deref(), Some(&format!("w{i}")));
            (id(ns, format!("k{i}")), op)
        })
        .collect();
    t.reset_stats();
    let leases: Vec<Lease> = t
        .store
        .apply_ops(ops.clone())
        .await
        .iter()
        .map(new_lease)
        .collect();
    assert_eq!(t.calls("evalsha"), 0);
    let ids: Vec<RecordId> = ops.iter().map(|(k, _)| k.clone()).collect();
    check_bytes(t, &ids).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = &t.store;
    for (i, ((k, _), lease)) in ops.iter().zip(&leases).enumerate() {
        let before = get(s, k).await.unwrap();
        match i % 5 {
            0 => {
                let done = s
                    .apply_op(
                        k.clone(),
                        Op::Complete {
                            token: lease.token.clone(),
                            result: Some(json!({"i": i})),
                            ttl_ms: None,
                        },
                    )
                    .await;
                let Ok(Outcome::Completed(rec)) = done else {
                    panic!("{k:?}: {done:?}");
                };
                assert_eq!(rec.state, State::Completed);
                assert_eq!(rec.fence, lease.fence);
                assert_eq!(rec.created_at_ms, before.created_at_ms);
                assert_eq!(rec.expires_at_ms, before.expires_at_ms);
                assert_eq!(
                    (rec.fingerprint, rec.owner),
                    (before.fingerprint, before.owner)
                );
                assert_eq!(rec.result, Some(json!({"i": i})));
            }
            1 => {
                let r = s
                    .apply_op(
                        k.clone(),
                        Op::Release {
                            token: lease.token.clone(),
                        },
                    )
                    .await;
                assert!(matches!(r, Ok(Outcome::Released)), "{r:?}");
                let next = new_lease(
                    &s.apply_op(k.clone(), claim(60_000, 30_000, None, None))
                        .await,
                );
                assert!(next.fence > lease.fence);
            }
            2 => {
                let r = s
                    .apply_op(
                        k.clone(),
                        Op::Extend {
                            token: lease.token.clone(),
                            lease_ms: 90_000,
                        },
                    )
                    .await;
                let Ok(Outcome::Extended {
                    lease_expires_at_ms,
                }) = r
                else {
                    panic!("{k:?}: {r:?}");
                };
                let after = get(s, k).await.unwrap();
                assert_eq!(after.lease_expires_at_ms, Some(lease_expires_at_ms));
                assert!(after.expires_at_ms >= lease_expires_at_ms);
                assert_eq!(after.fence, lease.fence);
            }
            3 => {
                let owner = before.owner.clone();
                let again = new_lease(
                    &s.apply_op(
                        k.clone(),
                        claim(
                            60_000,
                            30_000,
                            before.fingerprint.as_deref(),
                            owner.as_deref(),
                        ),
                    )
                    .await,
                );
                assert_eq!(
                    (again.token, again.fence),
                    (lease.token.clone(), lease.fence)
                );
            }
            _ => {
                // The 200 ms lease has passed: another worker takes over, the old token is out.
                let taken = new_lease(
                    &s.apply_op(
                        k.clone(),
                        claim(60_000, 30_000, before.fingerprint.as_deref(), Some("other")),
                    )
                    .await,
                );
                assert!(taken.fence > lease.fence && taken.token != lease.token);
                let stale = s
                    .apply_op(
                        k.clone(),
                        Op::Complete {
                            token: lease.token.clone(),
                            result: None,
                            ttl_ms: None,
                        },
                    )
                    .await;
                assert!(matches!(stale, Err(GateError::LeaseLost)), "{stale:?}");
            }
        }
    }
    // A token the fast path issued is refused for another key.
    let wrong = s
        .apply_op(
            ids[1].clone(),
            Op::Complete {
                token: leases[0].token.clone(),
                result: None,
                ttl_ms: None,
            },
        )
        .await;
    assert!(matches!(wrong, Err(GateError::LeaseLost)), "{wrong:?}");
}

/// Fewer than 16 fresh-key ops go through the script (one round trip, no `TIME`).
async fn small_batches_use_the_script(t: &Target) {
    let ns = "fp.small";
    let ops: Vec<(RecordId, Op)> = (0..15)
        .map(|i| (id(ns, format!("k{i}")), claim(60_000, 30_000, None, None)))
        .collect();
    t.reset_stats();
    for r in t.store.apply_ops(ops).await {
        new_lease(&r);
    }
    let scripts = t.calls("evalsha");
    assert!(scripts > 0);
    // Each script call reads TIME once; the fast path would add its own.
    assert_eq!(t.calls("time"), scripts, "TIME runs inside the script only");
    assert_eq!(t.calls("set"), 15);
}

async fn all(t: &Target) {
    fresh_then_duplicates(t).await;
    mixed(t).await;
    repeated_keys(t).await;
    fingerprint_mismatch(t).await;
    marks_replayed(t).await;
    script_acts_on_fast_records(t).await;
    small_batches_use_the_script(t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_on_a_single_server() {
    let (_server, t) = single().await;
    all(&t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_on_a_cluster() {
    let (_cluster, t) = cluster().await;
    all(&t).await;
}

/// With `fence_keep_ms` too short for the clock argument, every op goes through the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_fence_keep_turns_the_fast_path_off() {
    let server = tokio::task::spawn_blocking(|| RedisServer::start(&["--appendonly", "no"]))
        .await
        .unwrap()
        .expect("start redis-server");
    let store = RedisStore::open(&format!("{}?fence_keep_ms=1000", server.url()))
        .await
        .expect("open store");
    let ops: Vec<(RecordId, Op)> = (0..FRESH)
        .map(|i| {
            (
                id("fp.keep", format!("k{i}")),
                claim(60_000, 30_000, None, None),
            )
        })
        .collect();
    // One op first, so the script is loaded before the count starts.
    new_lease(
        &store
            .apply_op(id("fp.keep", "first"), claim(60_000, 30_000, None, None))
            .await,
    );
    cli(server.port(), &["CONFIG", "RESETSTAT"]).unwrap();
    for r in store.apply_ops(ops).await {
        new_lease(&r);
    }
    let stats = cli(server.port(), &["INFO", "commandstats"]).unwrap();
    assert!(stats.contains("cmdstat_evalsha:calls=1,"), "{stats}");
}

fn fresh_claims(ns: &str) -> Vec<(RecordId, Op)> {
    (0..FRESH)
        .map(|i| (id(ns, format!("k{i}")), claim(60_000, 30_000, None, None)))
        .collect()
}

fn unavailable_because(r: &Result<Outcome, GateError>, why: &str) -> bool {
    matches!(r, Err(GateError::Store(StoreError::Unavailable(m))) if m.contains(why))
}

/// With `wait_replicas`, the fast path's writes are followed by `WAIT`: no answer before a
/// replica acknowledged them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_waits_for_replicas() {
    let primary = tokio::task::spawn_blocking(|| RedisServer::start(&["--appendonly", "no"]))
        .await
        .unwrap()
        .expect("start redis-server");
    let url = format!("{}?wait_replicas=1&wait_timeout_ms=100", primary.url());
    let store = RedisStore::open(&url).await.unwrap();
    cli(primary.port(), &["CONFIG", "RESETSTAT"]).unwrap();
    for r in store.apply_ops(fresh_claims("fp.wait1")).await {
        assert!(unavailable_because(&r, "replicas"), "no replica: {r:?}");
    }
    let stats = cli(primary.port(), &["INFO", "commandstats"]).unwrap();
    assert!(!stats.contains("cmdstat_evalsha"), "{stats}");
    assert!(stats.contains("cmdstat_wait:calls=1,"), "{stats}");

    let port = primary.port();
    let replica = tokio::task::spawn_blocking(move || {
        RedisServer::start_replica(port, &["--appendonly", "no"])
    })
    .await
    .unwrap()
    .expect("start a linked replica");
    // A generous WAIT timeout: a freshly linked replica on a loaded machine may be slow.
    let url = format!("{}?wait_replicas=1&wait_timeout_ms=10000", primary.url());
    let store = RedisStore::open(&url).await.unwrap();
    let ops = fresh_claims("fp.wait2");
    for r in store.apply_ops(ops.clone()).await {
        new_lease(&r);
    }
    let mut conn = redis::Client::open(replica.url().as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for (k, _) in &ops {
        let exists: bool = redis::cmd("EXISTS")
            .arg(&record_keys("dg", k).record[..])
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(exists, "{k:?} acknowledged but not on the replica");
    }
}

/// A server that refuses the writes (out of memory under `noeviction`) answers every op
/// `unavailable` and stores nothing; a server that is gone too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_or_lost_writes_are_unavailable() {
    let mut server = tokio::task::spawn_blocking(|| RedisServer::start(&["--appendonly", "no"]))
        .await
        .unwrap()
        .expect("start redis-server");
    let store = RedisStore::open(&server.url()).await.unwrap();
    server.cli(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    for r in store.apply_ops(fresh_claims("fp.oom")).await {
        assert!(unavailable_because(&r, "OOM"), "{r:?}");
    }
    server.cli(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    assert_eq!(server.cli(&["DBSIZE"]).unwrap().trim(), "0");
    tokio::task::spawn_blocking(move || server.kill())
        .await
        .unwrap();
    for r in store.apply_ops(fresh_claims("fp.gone")).await {
        assert!(unavailable_because(&r, ""), "{r:?}");
    }
}
