//! [`RedisStore`]: the [`Store`] trait over one Redis server or a Redis Cluster, from opening it
//! to choosing each batch's path (the script or the fast path) and coalescing single operations.

use std::sync::Arc;

use async_trait::async_trait;
use dedupgate_core::{
    CoalesceLimits, Coalescer, GateError, Outcome, RecordId, Store, StoreError, Token, ValidOp,
};
use futures::stream::{self, StreamExt};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::Value;

use crate::args::call_token;
use crate::cluster::{by_slot, CLUSTER_GROUPS_IN_FLIGHT_MAX};
use crate::conn::Conn;
use crate::keys::{record_keys, RecordKeys};
use crate::options::{redact, RedisOptions};
use crate::reply::server_error;
use crate::OpenError;

/// The decision script: `dedupgate_core::decide` re-expressed in Lua.
pub const DECIDE_LUA: &str = include_str!("decide.lua");

/// The gate's records in Redis. Every operation is one atomic step judged on Redis's own clock:
/// a run of the Lua script, or, for the claims and marks of new keys in a large `apply_batch`,
/// a native `SET … NX GET` of the record the script would write (`Inner::decide_fast`).
/// A batch is one pipeline (per slot on a cluster). See `docs/redis.md`.
///
/// On a single server, single operations from concurrent callers are coalesced: whatever queued
/// while earlier calls were in flight goes out as one script call (each op still atomic, each
/// caller still gets its own answer), so the per-call cost is shared under load and nothing
/// waits for a batch to fill.
pub struct RedisStore {
    inner: Arc<Inner>,
    coalescer: Option<Coalescer>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.inner.describe)
    }
}

/// Most single operations waiting to be coalesced; callers wait when it is full.
const QUEUE_OPS_MAX: usize = 4_096;
/// Most coalesced calls in flight at once. Few: Redis runs one call at a time anyway, and ops
/// that wait for a slot share the next call (under 50 concurrent callers, 4 gave ~8 ops per
/// call and less CPU per op on both sides than 16, at ~2 ops per call).
const COALESCED_IN_FLIGHT_MAX: usize = 4;

/// The connection and what every call needs.
pub(crate) struct Inner {
    pub(crate) conn: Conn,
    pub(crate) opts: RedisOptions,
    pub(crate) script: redis::Script,
    pub(crate) describe: String,
}

/// Which paths a batch may take.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchPath {
    /// Every op through the decision script.
    Script,
    /// Claims and marks of keys that look fresh first try a native `SET … NX GET` (when the
    /// batch has enough of them and the options allow it); the rest through the script.
    FreshKeysNative,
}

/// One valid operation on its way to the script.
pub(crate) struct Prepared {
    pub(crate) index: usize,
    pub(crate) id: RecordId,
    pub(crate) keys: RecordKeys,
    pub(crate) op: ValidOp,
    /// See [`call_token`].
    pub(crate) token: Option<Token>,
}

impl RedisStore {
    /// Opens `redis://…`, `rediss://…`, `redis+unix://…` or `redis+cluster://h:p,h:p…`, with the
    /// store's options in the query string (see [`RedisOptions`]). Refuses a server whose
    /// `maxmemory-policy` could evict records.
    pub async fn open(url: &str) -> Result<Self, OpenError> {
        let (opts, url) = RedisOptions::from_url(url)?;
        Self::open_with(&url, opts).await
    }

    /// Opens `url` (without store options) with `opts`.
    pub async fn open_with(url: &str, opts: RedisOptions) -> Result<Self, OpenError> {
        let shown = redact(url);
        let conn = Conn::open(url, &shown, &opts).await?;
        let mut describe = format!("redis: {shown}");
        if opts.wait_replicas > 0 {
            describe.push_str(&format!(
                " (WAIT {} replicas, {} ms)",
                opts.wait_replicas, opts.wait_timeout_ms
            ));
        }
        let inner = Inner {
            conn,
            script: redis::Script::new(DECIDE_LUA),
            opts,
            describe,
        };
        inner.check_eviction_policy(&shown).await?;
        inner.check_version(&shown).await?;
        let inner = Arc::new(inner);
        let coalescer = match inner.conn {
            Conn::Single(_) => {
                let limits = CoalesceLimits {
                    queue_max: QUEUE_OPS_MAX,
                    in_flight_max: COALESCED_IN_FLIGHT_MAX,
                    batch_max: inner.opts.script_ops_max,
                };
                let inner = inner.clone();
                Some(Coalescer::spawn(limits, move |ops| {
                    let inner = inner.clone();
                    async move { inner.decide_batch(ops, BatchPath::Script).await }
                }))
            }
            // On a cluster, concurrent single ops mostly fall in different slots: nothing to share.
            Conn::Cluster(_) => None,
        };
        Ok(Self { inner, coalescer })
    }

    /// The options in force.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.opts
    }
}

impl Inner {
    async fn decide_batch(
        &self,
        ops: Vec<(RecordId, ValidOp)>,
        path: BatchPath,
    ) -> Vec<Result<Outcome, GateError>> {
        let mut answers: Vec<Option<Result<Outcome, GateError>>> = Vec::with_capacity(ops.len());
        let mut prepared = Vec::with_capacity(ops.len());
        for (index, (id, op)) in ops.into_iter().enumerate() {
            answers.push(None);
            let keys = record_keys(&self.opts.key_prefix, &id);
            let token = call_token(&op);
            prepared.push(Prepared {
                index,
                id,
                keys,
                op,
                token,
            });
        }
        let decided = if path == BatchPath::FreshKeysNative && self.fast_path_allowed() {
            self.decide_fast(prepared).await
        } else {
            self.decide_script(prepared).await
        };
        for (index, answer) in decided {
            answers[index] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    Err(GateError::Store(StoreError::Unavailable(
                        "no answer".to_owned(),
                    )))
                })
            })
            .collect()
    }

    /// Decides `prepared` (in order within each record) through the script.
    pub(crate) async fn decide_script(
        &self,
        prepared: Vec<Prepared>,
    ) -> Vec<(usize, Result<Outcome, GateError>)> {
        if prepared.is_empty() {
            return Vec::new();
        }
        match &self.conn {
            Conn::Single(_) => self.run_group(prepared).await,
            Conn::Cluster(_) => {
                // One pipeline per slot (a pipeline on a cluster may not cross slots), in
                // flight together; ops keep their order within a slot, and ops on one record
                // always share a slot.
                stream::iter(by_slot(prepared))
                    .map(|group| self.run_group(group))
                    .buffer_unordered(CLUSTER_GROUPS_IN_FLIGHT_MAX)
                    .flat_map(stream::iter)
                    .collect()
                    .await
            }
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        if let Some(coalescer) = &self.coalescer {
            return coalescer.apply(id, op).await;
        }
        self.inner
            .decide_batch(vec![(id, op)], BatchPath::Script)
            .await
            .pop()
            .unwrap_or_else(|| {
                Err(GateError::Store(StoreError::Unavailable(
                    "no answer".to_owned(),
                )))
            })
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        self.inner
            .decide_batch(ops, BatchPath::FreshKeysNative)
            .await
    }

    async fn health(&self) -> Result<(), StoreError> {
        let cmd = redis::cmd("PING");
        let r = match &self.inner.conn {
            Conn::Single(h) => h.command(&cmd).await,
            Conn::Cluster(h) => {
                let routing = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(redis::cluster_routing::ResponsePolicy::AllSucceeded),
                ));
                let r = h.current().route_command(cmd, routing).await;
                h.check(&r);
                r
            }
        };
        match r {
            Ok(Value::ServerError(e)) => Err(server_error(e)),
            Ok(_) => Ok(()),
            Err(e) => Err(StoreError::unavailable(e)),
        }
    }

    async fn sweep_expired(&self, _batch_max: usize) -> Result<u64, StoreError> {
        // Records carry their expiry (PXAT): Redis removes them itself.
        Ok(0)
    }

    /// Records carry their expiry (PXAT): Redis is the one that removes them.
    fn sweeps_itself(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{shared_redis_url, RedisCluster};
    use dedupgate_core::{Claim, Mark, Op, Record};

    fn prepared(index: usize, ns: &str, key: &str, op: Op) -> Prepared {
        let id = RecordId::new(ns, key).expect("a valid id");
        let op = ValidOp::try_from(op).expect("a valid op");
        Prepared {
            index,
            keys: record_keys("dg", &id),
            id,
            token: call_token(&op),
            op,
        }
    }

    /// The ops below, each with the token `tokens` gives (or a fresh one).
    fn ops(ns: &str, tokens: Option<&[Option<Token>]>) -> Vec<Prepared> {
        let claim = |fingerprint: Option<&str>, owner: Option<&str>| Op::Claim {
            ttl_ms: 60_000,
            lease_ms: 30_000,
            fingerprint: fingerprint.map(str::to_owned),
            owner: owner.map(str::to_owned),
        };
        let mark = |fingerprint: Option<&str>| Op::Mark {
            ttl_ms: 60_000,
            fingerprint: fingerprint.map(str::to_owned),
            result: Some(serde_json::json!({"n": 1})),
        };
        let all = [
            claim(None, None),
            claim(None, None),
            claim(Some("fp"), None),
            claim(None, Some("worker-1")),
            mark(None),
            mark(Some("fp")),
        ];
        all.into_iter()
            .enumerate()
            .map(|(i, op)| {
                let mut p = prepared(i, ns, &format!("k{i}"), op);
                if let Some(tokens) = tokens {
                    p.token = tokens[i].clone();
                }
                p
            })
            .collect()
    }

    fn new_answer(r: &Result<Outcome, GateError>) -> (Option<Token>, u64, Option<Record>) {
        match r {
            Ok(Outcome::Claimed(Claim::New(lease))) => {
                (Some(lease.token.clone()), lease.fence, None)
            }
            Ok(Outcome::Marked(Mark::New { record })) => (None, record.fence, Some(record.clone())),
            other => panic!("not new: {other:?}"),
        }
    }

    fn sorted(mut v: Vec<(usize, Result<Outcome, GateError>)>) -> Vec<Result<Outcome, GateError>> {
        v.sort_by_key(|(i, _)| *i);
        v.into_iter().map(|(_, r)| r).collect()
    }

    /// A call sent twice (what a cluster client does after a lost connection or a redirect
    /// when the first send did run) answers the second time as it did the first: the same
    /// claim (token and fence) or the same mark, never a duplicate of itself. The same ops
    /// with other tokens, as from another caller, are duplicates.
    async fn resent_calls_get_their_own_answer(store: &RedisStore, ns: &str) {
        let inner = &store.inner;
        // Through the script: the same EVALSHA twice.
        let script_ops = ops(&format!("{ns}.script"), None);
        let tokens: Vec<Option<Token>> = script_ops.iter().map(|p| p.token.clone()).collect();
        let first = sorted(inner.decide_script(script_ops).await);
        let again = sorted(
            inner
                .decide_script(ops(&format!("{ns}.script"), Some(&tokens)))
                .await,
        );
        // Through the fast path: the same native SETs twice, whose second run finds the
        // records and goes on to the script.
        let fast_ops = ops(&format!("{ns}.fast"), None);
        let fast_tokens: Vec<Option<Token>> = fast_ops.iter().map(|p| p.token.clone()).collect();
        let (decided, found) = inner.claim_fresh(fast_ops).await;
        assert!(found.is_empty(), "fresh keys found: {}", found.len());
        let fast_first = sorted(decided);
        let (decided, found) = inner
            .claim_fresh(ops(&format!("{ns}.fast"), Some(&fast_tokens)))
            .await;
        assert!(
            decided.is_empty(),
            "a resent SET NX decided {} ops",
            decided.len()
        );
        let fast_again = sorted(inner.decide_script(found).await);

        for (first, again) in [(first, again), (fast_first, fast_again)] {
            for (i, (a, b)) in first.iter().zip(&again).enumerate() {
                let (token_a, fence_a, record_a) = new_answer(a);
                let (token_b, fence_b, record_b) = new_answer(b);
                assert_eq!(token_a, token_b, "op {i}");
                assert_eq!(fence_a, fence_b, "op {i}");
                assert_eq!(record_a, record_b, "op {i}");
            }
        }

        // A release sent twice is released both times; a second release by the holder, a call
        // of its own, is `lease_lost` (API.md: a released token is not the holder's).
        let rel = format!("{ns}.release");
        let claim = Op::Claim {
            ttl_ms: 60_000,
            lease_ms: 30_000,
            fingerprint: None,
            owner: None,
        };
        let claimed = sorted(
            inner
                .decide_script(vec![prepared(0, &rel, "k", claim)])
                .await,
        );
        let (Some(token), _, _) = new_answer(&claimed[0]) else {
            panic!("a claim without a token");
        };
        let release = |nonce: &Token| {
            let mut p = prepared(
                0,
                &rel,
                "k",
                Op::Release {
                    token: token.clone(),
                },
            );
            p.token = Some(nonce.clone());
            p
        };
        let nonce = Token::generate();
        for run in ["first run", "resent"] {
            let answer = sorted(inner.decide_script(vec![release(&nonce)]).await);
            assert!(
                matches!(answer[0], Ok(Outcome::Released)),
                "{run}: {answer:?}"
            );
        }
        let again = sorted(inner.decide_script(vec![release(&Token::generate())]).await);
        assert!(matches!(again[0], Err(GateError::LeaseLost)), "{again:?}");

        // Another caller's calls (fresh tokens) on the same keys are duplicates.
        for ns in [format!("{ns}.script"), format!("{ns}.fast")] {
            for r in sorted(inner.decide_script(ops(&ns, None)).await)
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != 3)
                .map(|(_, r)| r)
            {
                assert!(
                    matches!(
                        r,
                        Ok(Outcome::Claimed(Claim::Duplicate { .. }))
                            | Ok(Outcome::Marked(Mark::Duplicate { .. }))
                    ),
                    "{ns}: {r:?}"
                );
            }
        }
    }

    fn unique_ns(what: &str) -> String {
        format!("resend.{what}.{}", Token::generate().as_str())
    }

    #[tokio::test]
    async fn a_resent_call_is_not_its_own_duplicate_on_one_server() {
        let store = RedisStore::open(&shared_redis_url()).await.expect("open");
        resent_calls_get_their_own_answer(&store, &unique_ns("single")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_call_is_not_its_own_duplicate_on_a_cluster() {
        let cluster = RedisCluster::start().expect("start a cluster");
        let store = RedisStore::open(&cluster.url()).await.expect("open");
        resent_calls_get_their_own_answer(&store, &unique_ns("cluster")).await;
    }
}
