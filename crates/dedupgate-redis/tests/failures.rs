//! Failure behaviour against servers these tests own: a killed and restarted server, script cache
//! loss, `WAIT` without enough replicas, and servers that could evict records.

use dedupgate_core::testkit::ApplyOp;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupgate_core::{Claim, GateError, Op, Outcome, RecordId, State, Store, StoreError};
use dedupgate_redis::testkit::RedisServer;
use dedupgate_redis::{OpenError, RedisStore};

fn claim() -> Op {
    Op::Claim {
        ttl_ms: 600_000,
        lease_ms: 600_000,
        fingerprint: None,
        owner: None,
    }
}

fn id(key: &str) -> RecordId {
    RecordId::new("failures", key).unwrap()
}

async fn start(args: &'static [&'static str]) -> RedisServer {
    tokio::task::spawn_blocking(move || RedisServer::start(args))
        .await
        .unwrap()
        .expect("start redis-server")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_mid_load_answers_unavailable_then_recovers_with_every_ack_kept() {
    let mut server = start(&["--appendonly", "yes", "--appendfsync", "always"]).await;
    let store = Arc::new(RedisStore::open(&server.url()).await.expect("open"));
    let down = Arc::new(AtomicBool::new(false));

    // Eight workers claim fresh keys until told to stop; every answer is logged.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (store, stop, down) = (store.clone(), stop.clone(), down.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut wrong_while_down = Vec::new();
                let mut unavailable = 0u64;
                let mut i = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let key = format!("w{w}-{i}");
                    i += 1;
                    let was_down = down.load(Ordering::Acquire);
                    let r = store.apply_op(id(&key), claim()).await;
                    let still_down = down.load(Ordering::Acquire);
                    match r {
                        Ok(Outcome::Claimed(Claim::New(lease))) => {
                            if was_down && still_down {
                                wrong_while_down.push(key.clone());
                            }
                            acked.push((key, lease.fence));
                        }
                        Err(GateError::Store(StoreError::Unavailable(_))) => unavailable += 1,
                        other => panic!("claim of fresh key {key}: {other:?}"),
                    }
                }
                (acked, wrong_while_down, unavailable)
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(700)).await;
    server.kill();
    // Set only once the server is dead: a claim sent from now on cannot have reached it.
    down.store(true, Ordering::Release);
    // While the server is down, every answer is unavailable (checked by the workers).
    tokio::time::sleep(Duration::from_millis(800)).await;
    let r = store.apply_op(id("probe"), claim()).await;
    assert!(
        matches!(r, Err(GateError::Store(StoreError::Unavailable(_)))),
        "while down: {r:?}"
    );
    assert!(store.health().await.is_err(), "health while down");
    down.store(false, Ordering::Release);
    tokio::task::block_in_place(|| server.restart()).expect("restart on the same port and dir");
    // Workers may still see a refused connection for a moment; the same store recovers.
    let started = Instant::now();
    while store.health().await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "never recovered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Release);

    let mut acked = Vec::new();
    let mut unavailable = 0;
    for w in workers {
        let (a, wrong, u) = w.await.expect("worker");
        assert!(
            wrong.is_empty(),
            "answered new while the server was down: {wrong:?}"
        );
        acked.extend(a);
        unavailable += u;
    }
    assert!(unavailable > 0, "the kill was never seen");
    assert!(acked.len() > 100, "too little load: {} acks", acked.len());
    eprintln!(
        "{} claims acknowledged, {unavailable} unavailable",
        acked.len()
    );

    // Every acknowledged claim is still decided the same way: held, same fence, a duplicate.
    let fences: HashMap<String, u64> = acked.into_iter().collect();
    let keys: Vec<&String> = fences.keys().collect();
    for chunk in keys.chunks(1_000) {
        let out = store
            .apply_ops(chunk.iter().map(|k| (id(k), claim())).collect())
            .await;
        for (k, r) in chunk.iter().zip(out) {
            match r {
                Ok(Outcome::Claimed(Claim::Duplicate { record })) => {
                    assert_eq!(record.state, State::InProgress, "{k}");
                    assert_eq!(record.fence, fences[*k], "{k}: fence changed");
                }
                other => panic!("acknowledged claim {k} lost after restart: {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_script_cache_is_reloaded() {
    let server = start(&[]).await;
    let store = RedisStore::open(&server.url()).await.unwrap();
    assert!(matches!(
        store.apply_op(id("a"), claim()).await,
        Ok(Outcome::Claimed(Claim::New(_)))
    ));
    server.cli(&["SCRIPT", "FLUSH"]).unwrap();
    let out = store
        .apply_ops(vec![
            (id("a"), claim()),
            (id("b"), claim()),
            (id("b"), claim()),
        ])
        .await;
    assert!(
        matches!(out[0], Ok(Outcome::Claimed(Claim::Duplicate { .. }))),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Ok(Outcome::Claimed(Claim::New(_)))),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(out[2], Ok(Outcome::Claimed(Claim::Duplicate { .. }))),
        "{:?}",
        out[2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_answers_unavailable_until_a_replica_acks() {
    let primary = start(&[]).await;
    let url = format!("{}?wait_replicas=1&wait_timeout_ms=100", primary.url());
    let store = RedisStore::open(&url).await.unwrap();
    let r = store.apply_op(id("w1"), claim()).await;
    assert!(
        matches!(&r, Err(GateError::Store(StoreError::Unavailable(m))) if m.contains("replicas")),
        "no replica: {r:?}"
    );
    // A read is not a write: it is not held to WAIT.
    assert!(matches!(
        store.apply_op(id("w1"), Op::Get).await,
        Ok(Outcome::Found(_))
    ));

    let port = primary.port();
    let replica = tokio::task::spawn_blocking(move || RedisServer::start_replica(port, &[]))
        .await
        .unwrap()
        .expect("start a linked replica");
    // A generous WAIT timeout here: on a loaded machine a freshly linked replica may take more
    // than 100 ms to acknowledge, and this half checks that an attached replica suffices.
    let url = format!("{}?wait_replicas=1&wait_timeout_ms=10000", primary.url());
    let store = RedisStore::open(&url).await.unwrap();
    let r = store.apply_op(id("w2"), claim()).await;
    assert!(
        matches!(r, Ok(Outcome::Claimed(Claim::New(_)))),
        "with a replica: {r:?}"
    );
    let on_replica = replica.cli(&["DBSIZE"]).unwrap();
    assert_ne!(on_replica.trim(), "0", "the write reached the replica");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_may_evict_are_refused() {
    let lru = start(&["--maxmemory-policy", "allkeys-lru"]).await;
    let err = RedisStore::open(&lru.url()).await.unwrap_err();
    assert!(
        matches!(&err, OpenError::EvictionPolicy { policy, .. } if policy == "allkeys-lru"),
        "{err}"
    );
    assert!(err.to_string().contains("noeviction"), "{err}");

    let no_config = start(&["--rename-command", "CONFIG", ""]).await;
    let err = RedisStore::open(&no_config.url()).await.unwrap_err();
    assert!(matches!(err, OpenError::ConfigUnavailable { .. }), "{err}");
    assert!(err.to_string().contains("assume_noeviction=true"), "{err}");
    let url = format!("{}?assume_noeviction=true", no_config.url());
    let store = RedisStore::open(&url)
        .await
        .expect("explicit override opens");
    assert!(store.health().await.is_ok());
}

/// A server that requires a password, opened with a wrong one or with none, and a database
/// index the server does not have: refusals ([`OpenError::Auth`], [`OpenError::Refused`]),
/// never `Connect` or `Unavailable`, which a proxy would keep retrying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_password_and_bad_database_are_refused() {
    let server = start(&[]).await;
    // Set after start: the testkit waits for a PING that a password would answer NOAUTH.
    let out = server
        .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
        .unwrap();
    assert_eq!(out.trim(), "OK");
    let port = server.port();

    let wrong = format!("redis://:wrong@127.0.0.1:{port}");
    let err = RedisStore::open(&wrong).await.unwrap_err();
    assert!(matches!(err, OpenError::Auth { .. }), "{err:?}");
    assert!(!err.to_string().contains("wrong"), "password shown: {err}");
    assert!(matches!(StoreError::from(err), StoreError::Config(_)));

    let none = format!("redis://127.0.0.1:{port}");
    let err = RedisStore::open(&none).await.unwrap_err();
    assert!(matches!(err, OpenError::Auth { .. }), "{err:?}");
    assert!(!err.to_string().contains("assume_noeviction"), "{err}");
    let err = RedisStore::open(&format!("{none}?assume_noeviction=true"))
        .await
        .unwrap_err();
    assert!(matches!(err, OpenError::Auth { .. }), "{err:?}");

    let right = format!("redis://:s3cret@127.0.0.1:{port}");
    let store = RedisStore::open(&right)
        .await
        .expect("the right password opens");
    assert!(store.health().await.is_ok());

    let err = RedisStore::open(&format!("redis://:s3cret@127.0.0.1:{port}/99"))
        .await
        .unwrap_err();
    assert!(matches!(err, OpenError::Refused { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_fails_to_open_clearly() {
    let port = dedupgate_redis::testkit::free_port();
    let err = RedisStore::open(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert!(matches!(err, OpenError::Connect { .. }), "{err}");
    assert!(RedisStore::open("redis://h?wait_replicas=x").await.is_err());
}

/// A cluster master killed with SIGKILL: the keys it serves answer unavailable (never a wrong
/// new or duplicate); after it restarts from its append-only file the same store recovers and
/// every acknowledged claim is still decided the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_master_killed_and_restarted() {
    use dedupgate_redis::keys::record_keys;
    use dedupgate_redis::testkit::RedisCluster;

    let mut cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
    })
    .await
    .unwrap()
    .expect("start a three-master cluster");
    let store = RedisStore::open(&cluster.url())
        .await
        .expect("open cluster");
    let victim = cluster.slots_of(0).expect("slots of node 0");
    let on_victim = |id: &RecordId| {
        let slot = record_keys("dg", id).slot;
        victim.iter().any(|r| r.contains(&slot))
    };

    let ids: Vec<RecordId> = (0..600).map(|i| id(&format!("c{i}"))).collect();
    let out = store
        .apply_ops(ids.iter().map(|i| (i.clone(), claim())).collect())
        .await;
    let mut fences = HashMap::new();
    for (i, r) in ids.iter().zip(out) {
        match r {
            Ok(Outcome::Claimed(Claim::New(l))) => fences.insert(i.key.to_string(), l.fence),
            other => panic!("{:?}: {other:?}", i.key),
        };
    }
    assert!(ids.iter().any(&on_victim) && !ids.iter().all(&on_victim));

    cluster.nodes_mut()[0].kill();
    let fresh: Vec<RecordId> = (0..300).map(|i| id(&format!("d{i}"))).collect();
    let mut both: Vec<RecordId> = ids.clone();
    both.extend(fresh.iter().cloned());
    let out = store
        .apply_ops(both.iter().map(|i| (i.clone(), claim())).collect())
        .await;
    let mut unavailable = 0;
    // Keys answered unavailable: whether the claim took effect is unknown (a live node may have
    // run it after the answer timed out), so afterwards either answer is right for them.
    let mut unknown = std::collections::HashSet::new();
    for (i, r) in both.iter().zip(out) {
        match r {
            Err(GateError::Store(StoreError::Unavailable(_))) => {
                unavailable += 1;
                unknown.insert(i.key.to_string());
            }
            Ok(_) if on_victim(i) => panic!("{:?} decided while its master was dead: {r:?}", i.key),
            Ok(Outcome::Claimed(Claim::Duplicate { record }))
                if fences.contains_key(i.key.as_str()) =>
            {
                assert_eq!(record.fence, fences[i.key.as_str()]);
            }
            Ok(Outcome::Claimed(Claim::New(l))) if !fences.contains_key(i.key.as_str()) => {
                fences.insert(i.key.to_string(), l.fence);
            }
            other => panic!("{:?} while a master was down: {other:?}", i.key),
        }
    }
    assert!(unavailable > 0, "the dead master was never noticed");

    tokio::task::block_in_place(|| {
        cluster.nodes_mut()[0]
            .restart()
            .expect("restart the master");
        cluster.wait_ok().expect("cluster ok again");
    });
    let started = Instant::now();
    loop {
        let out = store
            .apply_ops(both.iter().map(|i| (i.clone(), claim())).collect())
            .await;
        if out.iter().any(|r| matches!(r, Err(GateError::Store(_)))) {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "never recovered: {:?}",
                out.iter().find(|r| r.is_err())
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        for (i, r) in both.iter().zip(out) {
            match (fences.get(i.key.as_str()), r) {
                (Some(f), Ok(Outcome::Claimed(Claim::Duplicate { record }))) => {
                    assert_eq!(record.fence, *f, "{:?}", i.key)
                }
                (None, Ok(Outcome::Claimed(Claim::New(_)))) => {}
                (None, Ok(Outcome::Claimed(Claim::Duplicate { .. })))
                    if unknown.contains(i.key.as_str()) => {}
                (f, r) => panic!(
                    "{:?} after restart (acknowledged fence {f:?}): {r:?}",
                    i.key
                ),
            }
        }
        break;
    }
}

/// A TCP relay in front of a real server that, once a client sends `CONFIG`, passes on only the
/// first `keep` bytes of the server's next reply (0: none) and closes the connection: the
/// open-time check's answer lost on the way. Every other byte is relayed unchanged.
async fn cutting_relay(server: u16, keep: usize) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(upstream) = tokio::net::TcpStream::connect(("127.0.0.1", server)).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut ur, mut uw) = upstream.into_split();
            let cut = Arc::new(AtomicBool::new(false));
            let cut_up = cut.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let upper = buf[..n].to_ascii_uppercase();
                    if upper.windows(6).any(|w| w == b"CONFIG") {
                        cut_up.store(true, Ordering::SeqCst);
                    }
                    if uw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = ur.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if cut.load(Ordering::SeqCst) {
                        let _ = cw.write_all(&buf[..keep.min(n - 1)]).await;
                        break; // dropping both halves closes the connection
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// The open-time `CONFIG GET maxmemory-policy` answered by a healthy `noeviction` server, but
/// its reply cut short (or not delivered at all) and the connection closed: the store is
/// unavailable (retryable), not misconfigured. The same server reached directly opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_check_reply_cut_short_is_unavailable_not_config() {
    let server = start(&[]).await;
    for keep in [10, 0] {
        let port = cutting_relay(server.port(), keep).await;
        let err = RedisStore::open(&format!("redis://127.0.0.1:{port}"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, OpenError::Unavailable { .. }),
            "keep {keep}: {err:?}"
        );
        assert!(
            matches!(StoreError::from(err), StoreError::Unavailable(_)),
            "keep {keep}"
        );
    }
    let store = RedisStore::open(&server.url()).await.expect("direct open");
    assert!(store.health().await.is_ok());
}
