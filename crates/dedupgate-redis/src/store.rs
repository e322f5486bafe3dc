//! [`RedisStore`]: the [`Store`] trait over one Redis server or a Redis Cluster.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupgate_core::decide::FENCE_PER_MS;
use dedupgate_core::{
    Claim, CoalesceLimits, Coalescer, GateError, Lease, Mark, Op, Outcome, Record, RecordId, State,
    Store, StoreError, Token,
};
use futures::stream::{self, StreamExt};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Pipeline, Value};

use crate::keys::{record_keys, RecordKeys};
use crate::options::{cluster_nodes, redact, RedisOptions};
use crate::OpenError;

/// The decision script: `dedupgate_core::decide` re-expressed in Lua.
pub const DECIDE_LUA: &str = include_str!("decide.lua");

/// Most slot groups of one batch in flight at once on a cluster.
const CLUSTER_GROUPS_IN_FLIGHT_MAX: usize = 64;

/// Fewest claims and marks of fresh-looking keys in one `apply_batch` for which the native
/// fast path (see [`Inner::decide_fast`]) is tried: it costs one more round trip (`TIME`), which
/// a few keys do not pay back.
const FAST_PATH_OPS_MIN: usize = 16;

/// Largest spread between the clocks of a cluster's masters (their `TIME` replies to one
/// request) at which the fast path still takes the earliest of them as the batch's time;
/// beyond it the batch goes through the script, which reads each node's own clock.
const CLUSTER_CLOCK_SPREAD_MAX_MS: u64 = 250;

#[derive(Clone)]
enum Conn {
    Single(Arc<Rebuilt<ConnectionManager>>),
    Cluster(Arc<Rebuilt<ClusterConnection>>),
}

impl Conn {
    /// A new pipeline for `key_commands` commands on the slot of `guard` (one of their keys),
    /// with room for `capacity` commands, and how many replies of its own the caller skips.
    ///
    /// On a cluster, more than one key command go after a read of `guard` (`EXISTS`, its reply
    /// skipped). While a slot migrates, its source node answers `ASK` for keys it does not
    /// hold, and the client then sends the whole pipeline to the target behind a single
    /// `ASKING`, which admits only the pipeline's first command there (the rest are refused
    /// with `MOVED`, and the batch is answered "unavailable", safe to retry). Without the read,
    /// that first command was a write that ran on the target for a key the source still held:
    /// a second, stray copy of a live record, which later broke the slot's `MIGRATE` with
    /// `BUSYKEY` (`tests/resharding.rs`). A pipeline with one key command needs no read: that
    /// command got `ASK` only if the source does not hold its keys, so it belongs on the target.
    fn start_pipeline(
        &self,
        capacity: usize,
        key_commands: usize,
        guard: &[u8],
    ) -> (Pipeline, usize) {
        let mut pipe = Pipeline::with_capacity(capacity + 1);
        if matches!(self, Conn::Cluster(_)) && key_commands > 1 {
            pipe.cmd("EXISTS").arg(guard);
            (pipe, 1)
        } else {
            (pipe, 0)
        }
    }

    /// Sends `pipe` and answers `count` replies after its first `offset` (see
    /// [`Conn::start_pipeline`]).
    async fn pipeline(
        &self,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        match self {
            Conn::Single(h) => {
                let r = h.current().req_packed_commands(pipe, offset, count).await;
                h.check(&r);
                r
            }
            Conn::Cluster(h) => {
                let r = h.current().req_packed_commands(pipe, offset, count).await;
                h.check(&r);
                r
            }
        }
    }
}

/// A connection that is rebuilt from its client after failures the `redis` crate does not
/// recover from by itself:
/// - a cluster connection, after a master was killed and restarted, was seen to time out every
///   request for good (any error rebuilds it);
/// - a single server's `ConnectionManager` reconnects after a dropped connection, but when that
///   reconnection itself fails with anything but an I/O error (a reply cut short during the
///   handshake: a parse error) it keeps answering that same error to every later request and
///   never tries again (redis 1.8 `reconnect_if_io_error!`). Found by `dedupgate-torture`'s
///   net-fault run over a TCP proxy that truncates replies: every answer after one truncation
///   was "Parse error … Unexpected end of input" until the end of the run. Such errors (the
///   `redis` crate's "reconnect" class) rebuild the manager.
struct Rebuilt<C> {
    conn: std::sync::RwLock<C>,
    rebuilding: AtomicBool,
    /// Whether an error calls for a rebuild.
    rebuild_on: fn(&redis::RedisError) -> bool,
    connect:
        Box<dyn Fn() -> futures::future::BoxFuture<'static, redis::RedisResult<C>> + Send + Sync>,
}

impl Rebuilt<ConnectionManager> {
    /// Sends one command (a rebuild follows the errors that call for one).
    async fn command(self: &Arc<Self>, cmd: &Cmd) -> redis::RedisResult<Value> {
        let r = self.current().req_packed_command(cmd).await;
        self.check(&r);
        r
    }
}

/// Least time between two rebuilds of a connection.
const REBUILD_INTERVAL: Duration = Duration::from_secs(1);

impl<C: Clone + Send + Sync + 'static> Rebuilt<C> {
    fn new(
        conn: C,
        rebuild_on: fn(&redis::RedisError) -> bool,
        connect: impl Fn() -> futures::future::BoxFuture<'static, redis::RedisResult<C>>
            + Send
            + Sync
            + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            conn: std::sync::RwLock::new(conn),
            rebuilding: AtomicBool::new(false),
            rebuild_on,
            connect: Box::new(connect),
        })
    }

    fn current(&self) -> C {
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Starts a rebuild when `result` failed in a way that calls for one.
    fn check<T>(self: &Arc<Self>, result: &redis::RedisResult<T>) {
        if let Err(e) = result {
            if (self.rebuild_on)(e) {
                self.failed();
            }
        }
    }

    /// Starts a rebuild in the background, unless one ran within the last second.
    fn failed(self: &Arc<Self>) {
        if self.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            if let Ok(fresh) = (me.connect)().await {
                *me.conn.write().unwrap_or_else(|p| p.into_inner()) = fresh;
            }
            tokio::time::sleep(REBUILD_INTERVAL).await;
            me.rebuilding.store(false, Ordering::Release);
        });
    }
}

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
struct Inner {
    conn: Conn,
    opts: RedisOptions,
    script: redis::Script,
    describe: String,
}

/// Which paths a batch may take.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BatchPath {
    /// Every op through the decision script.
    Script,
    /// Claims and marks of keys that look fresh first try a native `SET … NX GET` (when the
    /// batch has enough of them and the options allow it); the rest through the script.
    FreshKeysNative,
}

/// One valid operation on its way to the script.
struct Prepared {
    index: usize,
    id: RecordId,
    keys: RecordKeys,
    op: Op,
    /// See [`call_token`].
    token: Option<Token>,
}

/// A claim's, mark's or release's token drawn for this call: a claim keeps it only if it
/// creates a claim, a mark keeps it hidden in the record it creates, a release in the
/// tombstone it leaves. Fresh per call, so a call that finds its own token was sent twice (a
/// cluster client resends a pipeline after a lost connection or a redirect) and is answered as
/// its first run was: never as a duplicate of itself, and a release never as `lease_lost`.
fn call_token(op: &Op) -> Option<Token> {
    matches!(op, Op::Claim { .. } | Op::Mark { .. } | Op::Release { .. }).then(Token::generate)
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
        let connect_err = |e: redis::RedisError| connect_error(shown.clone(), e);
        let conn = if url.starts_with("redis+cluster://") {
            let nodes = cluster_nodes(url)?;
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(Duration::from_millis(opts.connect_timeout_ms))
                .response_timeout(Duration::from_millis(opts.response_timeout_ms))
                .retries(2)
                .min_retry_wait(20)
                .max_retry_wait(200)
                .build()
                .map_err(|e| OpenError::Url(format!("{shown}: {e}")))?;
            let conn = client.get_async_connection().await.map_err(connect_err)?;
            Conn::Cluster(Rebuilt::new(
                conn,
                |_| true,
                move || {
                    let client = client.clone();
                    Box::pin(async move { client.get_async_connection().await })
                },
            ))
        } else {
            let client =
                redis::Client::open(url).map_err(|e| OpenError::Url(format!("{shown}: {e}")))?;
            // Few reconnection retries: while Redis is down an operation should fail fast as
            // `unavailable`; the next operation tries to reconnect again.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(opts.connect_timeout_ms)))
                .set_response_timeout(Some(Duration::from_millis(opts.response_timeout_ms)))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(20))
                .set_max_delay(Duration::from_millis(200));
            let conn = ConnectionManager::new_with_config(client.clone(), config.clone())
                .await
                .map_err(connect_err)?;
            Conn::Single(Rebuilt::new(
                conn,
                redis::RedisError::is_unrecoverable_error,
                move || {
                    let (client, config) = (client.clone(), config.clone());
                    Box::pin(
                        async move { ConnectionManager::new_with_config(client, config).await },
                    )
                },
            ))
        };
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
    /// Refuses servers that may evict keys: an evicted record lets a duplicate through. With
    /// `assume_noeviction` the policy is not read, but a `PING` still checks that the
    /// connection is authenticated (a server that requires a password answers `NOAUTH` to
    /// every command, which no retry cures).
    async fn check_eviction_policy(&self, shown: &str) -> Result<(), OpenError> {
        let cmd = if self.opts.assume_noeviction {
            redis::cmd("PING")
        } else {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("GET").arg("maxmemory-policy");
            cmd
        };
        let replies = self.ask_every_master(cmd, shown).await?;
        if self.opts.assume_noeviction {
            return Ok(());
        }
        for (node, v) in replies {
            let policy = policy_of(&v).ok_or_else(|| OpenError::ConfigUnavailable {
                url: node.clone(),
                reason: format!("unexpected CONFIG GET reply {v:?}"),
            })?;
            if policy != "noeviction" {
                return Err(OpenError::EvictionPolicy { url: node, policy });
            }
        }
        Ok(())
    }

    /// Refuses servers older than 7.0, which would fail every claim with a syntax error. A server
    /// that does not say its version in `INFO server` (a proxy, a restricted user) is let
    /// through: the first claim then reports the server's own error.
    async fn check_version(&self, shown: &str) -> Result<(), OpenError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server");
        let replies = match self.ask_every_master(cmd, shown).await {
            Ok(replies) => replies,
            // INFO disabled or not allowed: nothing to judge by.
            Err(OpenError::ConfigUnavailable { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        for (node, v) in replies {
            let info = match v {
                Value::VerbatimString { text, .. } => text,
                other => match text(&other) {
                    Some(info) => info,
                    None => continue,
                },
            };
            if let Some(version) = too_old(&info) {
                return Err(OpenError::Version { url: node, version });
            }
        }
        Ok(())
    }

    /// Sends `cmd` to the server, or to every master of a cluster, and returns each node's reply.
    async fn ask_every_master(
        &self,
        cmd: Cmd,
        shown: &str,
    ) -> Result<Vec<(String, Value)>, OpenError> {
        let replies: Vec<(String, Value)> = match &self.conn {
            Conn::Single(h) => vec![(shown.to_owned(), h.command(&cmd).await)],
            Conn::Cluster(h) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match h.current().route_command(cmd, routing).await {
                    Ok(Value::Map(per_node)) => per_node
                        .into_iter()
                        .map(|(node, v)| (text(&node).unwrap_or_default(), Ok(v)))
                        .collect(),
                    other => vec![(shown.to_owned(), other)],
                }
            }
        }
        .into_iter()
        .map(|(node, r)| match r {
            Ok(Value::ServerError(e)) => (node, Err(redis::RedisError::from(e))),
            other => (node, other),
        })
        .map(|(node, r)| {
            r.map(|v| (node.clone(), v))
                .map_err(|e| check_error(node, e))
        })
        .collect::<Result<_, _>>()?;
        Ok(replies)
    }

    fn eval_cmd(&self, chunk: &[Prepared]) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(chunk.len());
        for p in chunk {
            cmd.arg(&p.keys.record[..]);
        }
        cmd.arg(self.opts.fence_keep_ms);
        let mut rest = chunk;
        while let Some(first) = rest.first() {
            // Consecutive plain claims with one ttl and lease go as one run: 'c' ttl lease n
            // and n tokens.
            if let Some(times) = plain_claim(&first.op) {
                let n = rest
                    .iter()
                    .take_while(|p| plain_claim(&p.op) == Some(times))
                    .count();
                cmd.arg("c").arg(times.0).arg(times.1).arg(n);
                for p in &rest[..n] {
                    cmd.arg(p.token.as_ref().map_or("", Token::as_str));
                }
                rest = &rest[n..];
            } else {
                push_op_args(&mut cmd, &first.op, first.token.as_ref());
                rest = &rest[1..];
            }
        }
        cmd
    }

    /// Sends one pipeline of script calls (all in one slot on a cluster, `guard` one of their
    /// keys: see [`Conn::start_pipeline`]), reloading the script once if the server lost it, then
    /// `WAIT`s if asked. One answer per call.
    async fn send(
        &self,
        calls: Vec<Cmd>,
        writes: bool,
        guard: &[u8],
    ) -> Vec<Result<Value, StoreError>> {
        let wait = writes && self.opts.wait_replicas > 0;
        let n = calls.len();
        let mut answers: Vec<Option<Result<Value, StoreError>>> = (0..n).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..n).collect();
        let mut wait_acked: Option<i64> = None;
        for attempt in 0..2 {
            let (mut pipe, offset) =
                self.conn
                    .start_pipeline(pending.len() + 2, pending.len(), guard);
            if attempt > 0 {
                pipe.cmd("SCRIPT").arg("LOAD").arg(DECIDE_LUA);
            }
            let skip = usize::from(attempt > 0);
            for &i in &pending {
                pipe.add_command(calls[i].clone());
            }
            if wait {
                pipe.cmd("WAIT")
                    .arg(self.opts.wait_replicas)
                    .arg(self.opts.wait_timeout_ms);
            }
            let count = skip + pending.len() + usize::from(wait);
            let values = match self.conn.pipeline(&pipe, offset, count).await {
                Ok(values) if values.len() == count => values,
                Ok(values) => {
                    let why = format!(
                        "redis answered {} replies to a pipeline of {count}",
                        values.len()
                    );
                    return fail_all(answers, &why);
                }
                Err(e) if is_noscript(&e) && attempt == 0 => {
                    continue; // every call of the pipeline missed the script: reload and resend
                }
                Err(e) => return fail_all(answers, &e.to_string()),
            };
            let mut values = values.into_iter().skip(skip);
            let mut missed = Vec::new();
            for &i in &pending {
                let v = values.next().unwrap_or(Value::Nil);
                match v {
                    Value::ServerError(e) if e.code() == "NOSCRIPT" && attempt == 0 => {
                        missed.push(i);
                    }
                    other => answers[i] = Some(Ok(other)),
                }
            }
            if wait {
                wait_acked = match values.next() {
                    Some(Value::Int(acked)) => Some(acked),
                    _ => Some(-1),
                };
            }
            pending = missed;
            if pending.is_empty() {
                break;
            }
        }
        if let Some(acked) = wait_acked {
            if acked < i64::from(self.opts.wait_replicas) {
                let why = format!(
                    "only {} of {} replicas acknowledged the write within {} ms (WAIT)",
                    acked.max(0),
                    self.opts.wait_replicas,
                    self.opts.wait_timeout_ms
                );
                return fail_all(answers, &why);
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Unavailable("no reply".to_owned()))))
            .collect()
    }

    /// Decides one run of prepared ops that share a connection (all ops on one server, or one
    /// slot on a cluster): chunks them into script calls, sends them in one pipeline.
    async fn run_group(&self, group: Vec<Prepared>) -> Vec<(usize, Result<Outcome, GateError>)> {
        let writes = group.iter().any(|p| p.op.writes());
        let chunks: Vec<&[Prepared]> = group.chunks(self.opts.script_ops_max).collect();
        let calls: Vec<Cmd> = chunks.iter().map(|chunk| self.eval_cmd(chunk)).collect();
        let guard = group.first().map_or(&[][..], |p| &p.keys.record[..]);
        let answers = self.send(calls, writes, guard).await;
        let mut out = Vec::with_capacity(group.len());
        for (chunk, answer) in chunks.into_iter().zip(answers) {
            match answer.and_then(|v| match v {
                Value::Array(items) if items.len() == chunk.len() + 1 => Ok(items),
                Value::ServerError(e) => Err(server_error(e)),
                other => Err(StoreError::Corrupt(format!(
                    "unexpected script reply {other:?}"
                ))),
            }) {
                Ok(items) => {
                    let mut items = items.into_iter();
                    let now = items.next().as_ref().and_then(number);
                    for (p, item) in chunk.iter().zip(items) {
                        out.push((p.index, decode(p, now, item)));
                    }
                }
                Err(e) => {
                    for p in chunk {
                        let err = match &e {
                            StoreError::Corrupt(why) => StoreError::Corrupt(why.clone()),
                            StoreError::Unavailable(why) => StoreError::Unavailable(why.clone()),
                            other => StoreError::Unavailable(other.to_string()),
                        };
                        out.push((p.index, Err(GateError::Store(err))));
                    }
                }
            }
        }
        out
    }

    async fn decide_batch(
        &self,
        ops: Vec<(RecordId, Op)>,
        path: BatchPath,
    ) -> Vec<Result<Outcome, GateError>> {
        let mut answers: Vec<Option<Result<Outcome, GateError>>> = Vec::with_capacity(ops.len());
        let mut prepared = Vec::with_capacity(ops.len());
        for (index, (id, op)) in ops.into_iter().enumerate() {
            match op.validate() {
                Err(e) => answers.push(Some(Err(GateError::Invalid(e)))),
                Ok(()) => {
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
            }
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
    async fn decide_script(
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

    /// Whether the options leave room for the fast path's clock argument (see
    /// [`Inner::set_fresh`]): an answered fast path takes at most two response timeouts (the
    /// `TIME`, then the pipeline), which must stay well inside `fence_keep_ms`. With a shorter
    /// keep every op goes through the script.
    fn fast_path_allowed(&self) -> bool {
        self.opts.fence_keep_ms > self.opts.response_timeout_ms.saturating_mul(2)
    }

    /// The batch path for many claims and marks of new keys. Inside the script a new key costs
    /// Redis a `redis.call` from Lua besides the `SET` itself; sent natively, the same `SET`
    /// costs Redis about a third less CPU (`docs/benchmarks-redis.md`). So:
    ///
    /// 1. one `TIME` (Redis's clock, never the gate's) for the batch;
    /// 2. per claim or mark whose record appears once in the batch, a native
    ///    `SET key <record> NX GET PXAT <expiry + keep>` in one pipeline (per slot on a
    ///    cluster), where `<record>` is byte for byte what `decide.lua` writes for a new claim
    ///    or mark decided at that time. A nil reply means the key did not exist: the op is
    ///    decided, with the answer the script gives as its short replies `1` and `2`;
    /// 3. an op whose `SET` found a value (a live, expired or released record) goes through the
    ///    script afterwards, which decides afresh on the record as it is then. Each op thus still
    ///    takes effect in one atomic step: the `SET NX` that created its record, or its script
    ///    call.
    ///
    /// Every other op (complete, release, extend, get, forget, and every op of a record that
    /// appears more than once in the batch, so that its ops keep their order) goes through the
    /// script, concurrently with steps 1-2: they touch other records.
    async fn decide_fast(
        &self,
        prepared: Vec<Prepared>,
    ) -> Vec<(usize, Result<Outcome, GateError>)> {
        let mut per_record: HashMap<&[u8], usize> = HashMap::with_capacity(prepared.len());
        for p in &prepared {
            *per_record.entry(&p.keys.record[..]).or_default() += 1;
        }
        let fresh_candidate: Vec<bool> = prepared
            .iter()
            .map(|p| {
                matches!(p.op, Op::Claim { .. } | Op::Mark { .. })
                    && per_record[&p.keys.record[..]] == 1
            })
            .collect();
        drop(per_record);
        if fresh_candidate.iter().filter(|&&c| c).count() < FAST_PATH_OPS_MIN {
            return self.decide_script(prepared).await;
        }
        let (mut fresh, mut rest) = (Vec::new(), Vec::new());
        for (p, candidate) in prepared.into_iter().zip(fresh_candidate) {
            if candidate {
                fresh.push(p);
            } else {
                rest.push(p);
            }
        }
        let ((mut decided, found), others) =
            futures::join!(self.claim_fresh(fresh), self.decide_script(rest));
        decided.extend(others);
        decided.extend(self.decide_script(found).await);
        decided
    }

    /// Steps 1-2 of [`Inner::decide_fast`]: the ops decided by a native `SET`, and the ops
    /// whose key existed (for the script). When Redis's time cannot be read (or a cluster's
    /// masters disagree on it), every op goes to the script.
    async fn claim_fresh(
        &self,
        fresh: Vec<Prepared>,
    ) -> (Vec<(usize, Result<Outcome, GateError>)>, Vec<Prepared>) {
        let now_ms = match self.redis_time_ms().await {
            Ok(now_ms) => now_ms,
            Err(why) => {
                tracing::debug!("redis batch fast path skipped: {why}");
                return (Vec::new(), fresh);
            }
        };
        let groups = match &self.conn {
            Conn::Single(_) => vec![fresh],
            Conn::Cluster(_) => by_slot(fresh),
        };
        let mut decided = Vec::new();
        let mut found = Vec::new();
        let mut results = stream::iter(groups)
            .map(|group| self.set_fresh(group, now_ms))
            .buffer_unordered(CLUSTER_GROUPS_IN_FLIGHT_MAX);
        while let Some((d, f)) = results.next().await {
            decided.extend(d);
            found.extend(f);
        }
        found.sort_by_key(|p| p.index);
        (decided, found)
    }

    /// Redis's time in ms: `TIME` on the server, or on a cluster the earliest of the masters'
    /// clocks (each node judges expiry on its own; see [`Inner::set_fresh`] for why the earliest
    /// is safe), refused when they spread by more than [`CLUSTER_CLOCK_SPREAD_MAX_MS`].
    async fn redis_time_ms(&self) -> Result<u64, String> {
        let cmd = redis::cmd("TIME");
        match &self.conn {
            Conn::Single(h) => {
                let v = h.command(&cmd).await.map_err(|e| e.to_string())?;
                time_ms(&v).ok_or_else(|| format!("unexpected TIME reply {v:?}"))
            }
            Conn::Cluster(h) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let v = h
                    .current()
                    .route_command(cmd, routing)
                    .await
                    .map_err(|e| e.to_string())?;
                let Value::Map(per_node) = &v else {
                    return Err(format!("unexpected TIME reply {v:?}"));
                };
                let times = per_node
                    .iter()
                    .map(|(_, t)| time_ms(t))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| format!("unexpected TIME reply {v:?}"))?;
                let (Some(&min), Some(&max)) = (times.iter().min(), times.iter().max()) else {
                    return Err("no master answered TIME".to_owned());
                };
                if max - min > CLUSTER_CLOCK_SPREAD_MAX_MS {
                    return Err(format!(
                        "the masters' clocks spread by {} ms (more than {CLUSTER_CLOCK_SPREAD_MAX_MS})",
                        max - min
                    ));
                }
                Ok(min)
            }
        }
    }

    /// Step 2 of [`Inner::decide_fast`] for one group (one server, or one slot): one pipeline
    /// of `SET key <record> NX GET PXAT …` per op, then `TIME`, then `WAIT` when replicas are
    /// asked for. Returns the decided ops and the ops whose key existed.
    ///
    /// Why a time read one round trip before the `SET` is safe. The `SET` runs at the instant
    /// `t1` on Redis's clock and finds the key absent; the op is decided as the script would
    /// decide it at the earlier instant `t0 = now_ms`:
    ///
    /// - Fences. A record's key lives until `keep` ms after the record's expiry `e`, and `e` is
    ///   at least 1 ms after the millisecond its fence was issued in (a fence is at most that
    ///   millisecond times 1000 plus 999, the design's "fewer than 1000 claims of one key per
    ///   ms"). A key absent at `t1` therefore last held a record with `e + keep < t1`. If
    ///   `t1 - t0 < keep`, then `e < t0`, and every fence that key ever held is below
    ///   `t0 * 1000`, the new fence. The trailing `TIME` (`t_end`, run after every `SET` of the
    ///   pipeline on the same node) checks `t_end - t0 < keep`, which implies `t1 - t0 < keep`.
    ///   Should it fail (a clock stepped forward by about `keep` within the round trip, or a
    ///   cluster node far ahead of the earliest master), the new ops are answered `unavailable`
    ///   (their outcome unknown, as after a timeout or a failed `WAIT`), never with a fence that
    ///   might not increase. If the clock stepped back instead, `t1 < t0` and the bound holds
    ///   anyway. On a cluster `t0` is the earliest master's clock, never later than the key's
    ///   own node's reading: the bound only gets stronger, and the `t_end` check covers the skew.
    ///   [`Inner::fast_path_allowed`] keeps `keep` above two response timeouts, so an answered
    ///   round trip never trips the check unless a clock jumped.
    /// - State. The key held no live record at `t0` either (`e < t0`), and none was written
    ///   between `t0` and `t1` (its key would still exist at `t1`), so "absent" held over the
    ///   whole interval and the decision is the script's decision at `t0`: created, lease and
    ///   expiry times from `t0`, an instant within the caller's call.
    async fn set_fresh(
        &self,
        group: Vec<Prepared>,
        now_ms: u64,
    ) -> (Vec<(usize, Result<Outcome, GateError>)>, Vec<Prepared>) {
        let keep = self.opts.fence_keep_ms;
        let wait = self.opts.wait_replicas > 0;
        // Sized up front: growing each command's buffer argument by argument was a visible
        // share of the client's CPU per key.
        let guard = group.first().map_or(&[][..], |p| &p.keys.record[..]);
        let (mut pipe, offset) = self
            .conn
            .start_pipeline(group.len() + 2, group.len(), guard);
        let mut record = Vec::new();
        let mut sent = Vec::with_capacity(group.len());
        let mut found = Vec::new();
        for p in group {
            match fresh_record(&p.op, p.token.as_ref(), now_ms, &mut record) {
                Some(expires_at_ms) => {
                    let key = &p.keys.record[..];
                    // SET, NX, GET, PXAT and the 13-digit time: under 64 bytes.
                    let mut cmd = Cmd::with_capacity(7, key.len() + record.len() + 64);
                    cmd.arg("SET")
                        .arg(key)
                        .arg(&record[..])
                        .arg("NX")
                        .arg("GET")
                        .arg("PXAT")
                        .arg(expires_at_ms + keep);
                    pipe.add_command(cmd);
                    sent.push(p);
                }
                None => found.push(p),
            }
        }
        if sent.is_empty() {
            return (Vec::new(), found);
        }
        pipe.cmd("TIME");
        if wait {
            pipe.cmd("WAIT")
                .arg(self.opts.wait_replicas)
                .arg(self.opts.wait_timeout_ms);
        }
        let count = sent.len() + 1 + usize::from(wait);
        let unavailable =
            |ops: Vec<Prepared>, why: &str| -> Vec<(usize, Result<Outcome, GateError>)> {
                ops.into_iter()
                    .map(|p| {
                        let err = StoreError::Unavailable(why.to_owned());
                        (p.index, Err(GateError::Store(err)))
                    })
                    .collect()
            };
        let values = match self.conn.pipeline(&pipe, offset, count).await {
            Ok(values) if values.len() == count => values,
            Ok(values) => {
                let why = format!(
                    "redis answered {} replies to a pipeline of {count}",
                    values.len()
                );
                return (unavailable(sent, &why), found);
            }
            Err(e) => return (unavailable(sent, &e.to_string()), found),
        };
        let mut values = values.into_iter();
        let mut decided = Vec::new();
        let mut created = Vec::new();
        for p in sent {
            match values.next().unwrap_or(Value::Nil) {
                Value::Nil => created.push(p),
                Value::BulkString(_) => found.push(p),
                Value::ServerError(e) => {
                    decided.push((p.index, Err(GateError::Store(server_error(e)))));
                }
                other => {
                    let why = format!("unexpected SET reply {other:?}");
                    decided.push((p.index, Err(GateError::Store(StoreError::Corrupt(why)))));
                }
            }
        }
        let end_ms = values.next().as_ref().and_then(time_ms);
        let wait_acked = if wait {
            match values.next() {
                Some(Value::Int(acked)) => Some(acked),
                _ => Some(-1),
            }
        } else {
            None
        };
        let late = match end_ms {
            Some(end_ms) => end_ms.saturating_sub(now_ms) >= keep,
            None => true,
        };
        if late && !created.is_empty() {
            let why = format!(
                "redis's clock moved {} ms during a batch (fence_keep_ms {keep}): the outcome of \
                 its new keys is unknown",
                end_ms.map_or("?".to_owned(), |e| e.saturating_sub(now_ms).to_string())
            );
            tracing::warn!("{why}");
            decided.extend(unavailable(created, &why));
            return (decided, found);
        }
        if let Some(acked) = wait_acked {
            if acked < i64::from(self.opts.wait_replicas) && !created.is_empty() {
                let why = format!(
                    "only {} of {} replicas acknowledged the write within {} ms (WAIT)",
                    acked.max(0),
                    self.opts.wait_replicas,
                    self.opts.wait_timeout_ms
                );
                decided.extend(unavailable(created, &why));
                return (decided, found);
            }
        }
        for p in created {
            let short = if matches!(p.op, Op::Claim { .. }) {
                1
            } else {
                2
            };
            let answer = decode(&p, Some(now_ms), Value::Int(short));
            decided.push((p.index, answer));
        }
        (decided, found)
    }
}

/// Splits ops into groups of one cluster slot each, keeping their order within a group.
fn by_slot(prepared: Vec<Prepared>) -> Vec<Vec<Prepared>> {
    let mut by_slot: BTreeMap<u16, Vec<Prepared>> = BTreeMap::new();
    for p in prepared {
        by_slot.entry(p.keys.slot).or_default().push(p);
    }
    by_slot.into_values().collect()
}

/// A `TIME` reply (seconds and microseconds, as text) in ms.
fn time_ms(v: &Value) -> Option<u64> {
    match v {
        Value::Array(parts) if parts.len() == 2 => {
            Some(number(&parts[0])? * 1000 + number(&parts[1])? / 1000)
        }
        _ => None,
    }
}

/// Writes to `out` the record `decide.lua` writes for a new claim or mark of a key that does
/// not exist, decided at `now_ms`, byte for byte (the script's `enc`: a MessagePack array of
/// 11 as Redis's cmsgpack packs it, `false` for none; see the script's header). Returns the
/// record's `expires_at_ms`, or `None` for other ops (and a claim or mark without its fresh token).
fn fresh_record(op: &Op, token: Option<&Token>, now_ms: u64, out: &mut Vec<u8>) -> Option<u64> {
    const FALSE: u8 = 0xc2;
    fn text(out: &mut Vec<u8>, s: &[u8]) {
        // cmsgpack's string headers: fixstr below 32 bytes, then str8, str16, str32.
        let n = s.len();
        if n < 32 {
            out.push(0xa0 | n as u8);
        } else if n <= 0xff {
            out.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= 0xffff {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(s);
    }
    fn opt_text(out: &mut Vec<u8>, s: Option<&str>) {
        match s {
            Some(s) => text(out, s.as_bytes()),
            None => out.push(FALSE),
        }
    }
    fn int(out: &mut Vec<u8>, n: u64) {
        // cmsgpack's unsigned integers: the shortest of fixint, uint8/16/32/64.
        if n <= 0x7f {
            out.push(n as u8);
        } else if n <= 0xff {
            out.extend_from_slice(&[0xcc, n as u8]);
        } else if n <= 0xffff {
            out.push(0xcd);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else if n <= 0xffff_ffff {
            out.push(0xce);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
    out.clear();
    let fence = now_ms * FENCE_PER_MS;
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => {
            let token = token?;
            let lease_expires_at_ms = now_ms + lease_ms;
            let expires_at_ms = (now_ms + ttl_ms).max(lease_expires_at_ms);
            out.push(0x9b);
            text(out, b"i");
            int(out, fence);
            text(out, token.as_str().as_bytes());
            opt_text(out, fingerprint.as_deref());
            opt_text(out, owner.as_deref());
            int(out, now_ms);
            int(out, expires_at_ms);
            int(out, lease_expires_at_ms);
            out.extend_from_slice(&[FALSE, FALSE]);
            int(out, *ttl_ms);
            Some(expires_at_ms)
        }
        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => {
            let token = token?;
            let expires_at_ms = now_ms + ttl_ms;
            out.push(0x9b);
            text(out, b"c");
            int(out, fence);
            text(out, token.as_str().as_bytes());
            opt_text(out, fingerprint.as_deref());
            out.push(FALSE);
            int(out, now_ms);
            int(out, expires_at_ms);
            out.push(FALSE);
            int(out, now_ms);
            match result {
                Some(v) => text(out, v.to_string().as_bytes()),
                None => out.push(FALSE),
            }
            out.push(FALSE);
            Some(expires_at_ms)
        }
        _ => None,
    }
}

/// Every call of a pipeline answered `unavailable` for the same reason.
fn fail_all(
    answers: Vec<Option<Result<Value, StoreError>>>,
    why: &str,
) -> Vec<Result<Value, StoreError>> {
    answers
        .into_iter()
        .map(|_| Err(StoreError::Unavailable(why.to_owned())))
        .collect()
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

fn server_error(e: redis::ServerError) -> StoreError {
    if e.code() == "DGCORRUPT" {
        StoreError::Corrupt(e.details().unwrap_or("record cannot be read").to_owned())
    } else if e.details().is_some_and(|d| d.starts_with("syntax error")) {
        // Before 7.0, Redis refuses `SET … NX GET`, which the script uses for every claim.
        StoreError::Unavailable(format!(
            "redis refused: {e} (the Redis store needs Redis 7.0 or later)"
        ))
    } else {
        StoreError::Unavailable(format!("redis refused: {e}"))
    }
}

/// True when `e` is the server refusing the connection's credentials: a failed `AUTH` or
/// `HELLO … AUTH` (`WRONGPASS`), or a command sent without authenticating to a server that
/// requires it (`NOAUTH`, an error code the client does not know).
fn is_auth_refusal(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// An error reply from a server that is loading, has its cluster down or asks to try again:
/// it will pass, unlike other error replies.
fn server_busy(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown,
        )
    )
}

/// A connection that could not be set up (connect, `AUTH`/`HELLO`, `SELECT`). The server's
/// refusal of the credentials ([`OpenError::Auth`]) or of the setup the URL asks for (a
/// database index out of range, a client configuration it rejects: [`OpenError::Refused`])
/// will not pass by retrying; no connection, an I/O error, a timeout, a reply cut short or a
/// server busy loading or with its cluster down is [`OpenError::Connect`], worth retrying.
fn connect_error(url: String, e: redis::RedisError) -> OpenError {
    use redis::ErrorKind;
    let reason = e.to_string();
    if is_auth_refusal(&e) {
        return OpenError::Auth { url, reason };
    }
    let refused = !server_busy(&e)
        && matches!(
            e.kind(),
            ErrorKind::Server(_)
                | ErrorKind::Extension
                | ErrorKind::InvalidClientConfig
                | ErrorKind::RESP3NotSupported
        );
    if refused {
        OpenError::Refused { url, reason }
    } else {
        OpenError::Connect { url, reason }
    }
}

/// An open-time check that failed. Only the server's own refusal (an error reply: `CONFIG`
/// unknown or renamed, no permission) says something about its configuration; a dropped
/// connection, a reply cut short or unreadable, a timeout, or a server busy loading or with its
/// cluster down is the store being unavailable, and worth retrying.
fn check_error(url: String, e: redis::RedisError) -> OpenError {
    use redis::ErrorKind;
    let refused = !server_busy(&e)
        && matches!(
            e.kind(),
            ErrorKind::Server(_)
                | ErrorKind::Extension
                | ErrorKind::AuthenticationFailed
                | ErrorKind::UnexpectedReturnType
        );
    let reason = e.to_string();
    if is_auth_refusal(&e) {
        // Not a CONFIG problem: the connection itself is not authenticated.
        OpenError::Auth { url, reason }
    } else if refused {
        OpenError::ConfigUnavailable { url, reason }
    } else {
        OpenError::Unavailable { url, reason }
    }
}

/// The version an `INFO server` reply gives, when it is below 7.0.
fn too_old(info: &str) -> Option<String> {
    let version = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let major: u32 = version.split('.').next()?.parse().ok()?;
    (major < 7).then(|| version.to_owned())
}

fn policy_of(v: &Value) -> Option<String> {
    match v {
        Value::Array(items) if items.len() == 2 => text(&items[1]),
        Value::Map(pairs) if pairs.len() == 1 => text(&pairs[0].1),
        _ => None,
    }
}

/// A time or fence: an integer reply (or, from older scripts, its decimal text).
fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// A claim without fingerprint or owner: its ttl and lease.
fn plain_claim(op: &Op) -> Option<(u64, u64)> {
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint: None,
            owner: None,
        } => Some((*ttl_ms, *lease_ms)),
        _ => None,
    }
}

/// Pushes a non-plain op's code and its arguments (see `decide.lua`; '' stands for none). `token` is a
/// claim's, mark's or release's token for this call ([`call_token`]).
fn push_op_args(cmd: &mut Cmd, op: &Op, token: Option<&Token>) {
    fn opt(s: &Option<String>) -> &str {
        s.as_deref().unwrap_or("")
    }
    let json =
        |v: &Option<serde_json::Value>| v.as_ref().map(|v| v.to_string()).unwrap_or_default();
    let fresh = token.map_or("", Token::as_str);
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => {
            cmd.arg("C")
                .arg(*ttl_ms)
                .arg(*lease_ms)
                .arg(opt(fingerprint))
                .arg(opt(owner))
                .arg(fresh);
        }
        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => {
            cmd.arg("M")
                .arg(*ttl_ms)
                .arg(opt(fingerprint))
                .arg(json(result))
                .arg(fresh);
        }
        Op::Complete {
            token,
            result,
            ttl_ms,
        } => {
            cmd.arg("K")
                .arg(token.as_str())
                .arg(json(result))
                .arg(ttl_ms.map(|t| t.to_string()).unwrap_or_default());
        }
        Op::Release { token } => {
            cmd.arg("R").arg(token.as_str()).arg(fresh);
        }
        Op::Extend { token, lease_ms } => {
            cmd.arg("X").arg(token.as_str()).arg(*lease_ms);
        }
        Op::Get => {
            cmd.arg("G");
        }
        Op::Forget => {
            cmd.arg("F");
        }
    }
}

/// Turns one op's script reply into its outcome. `now` is the call's time on Redis's clock (the
/// reply's first item), from which the short answers for a key that did not exist are rebuilt.
fn decode(p: &Prepared, now: Option<u64>, v: Value) -> Result<Outcome, GateError> {
    let (id, op) = (&p.id, &p.op);
    let corrupt =
        |what: &str| GateError::Store(StoreError::Corrupt(format!("script reply: {what}")));
    let items = match v {
        Value::Array(items) => items,
        Value::Int(short) => {
            let now = now.ok_or_else(|| corrupt("no time"))?;
            let fence = now * FENCE_PER_MS;
            return match (short, op, &p.token) {
                (
                    1,
                    Op::Claim {
                        ttl_ms, lease_ms, ..
                    },
                    Some(token),
                ) => {
                    let lease_expires_at_ms = now + lease_ms;
                    Ok(Outcome::Claimed(Claim::New(Lease {
                        token: token.clone(),
                        fence,
                        lease_expires_at_ms,
                        expires_at_ms: (now + ttl_ms).max(lease_expires_at_ms),
                    })))
                }
                (
                    2,
                    Op::Mark {
                        ttl_ms,
                        fingerprint,
                        result,
                    },
                    _,
                ) => Ok(Outcome::Marked(Mark::New {
                    record: Record {
                        namespace: id.namespace.clone(),
                        key: id.key.clone(),
                        state: State::Completed,
                        fence,
                        fingerprint: fingerprint.clone(),
                        owner: None,
                        created_at_ms: now,
                        expires_at_ms: now + ttl_ms,
                        lease_expires_at_ms: None,
                        completed_at_ms: Some(now),
                        result: result.clone(),
                    },
                })),
                _ => Err(corrupt(&format!("{short} does not answer {}", op.name()))),
            };
        }
        _ => return Err(corrupt("not an array")),
    };
    let tag = items
        .first()
        .and_then(text)
        .ok_or_else(|| corrupt("no tag"))?;
    if tag == "E" {
        return match items.get(1).and_then(text).as_deref() {
            Some("lease_lost") => Err(GateError::LeaseLost),
            Some("fingerprint_mismatch") => Err(GateError::FingerprintMismatch),
            _ => Err(corrupt("unknown refusal")),
        };
    }
    let rec = |items: &[Value]| parse_record(id, &items[1..]).ok_or_else(|| corrupt("bad record"));
    let outcome = match (op, tag.as_str()) {
        (Op::Claim { .. }, "N") => {
            let s = |i: usize| {
                items
                    .get(i)
                    .and_then(text)
                    .ok_or_else(|| corrupt("bad lease"))
            };
            let n = |i: usize| {
                items
                    .get(i)
                    .and_then(number)
                    .ok_or_else(|| corrupt("bad number"))
            };
            Outcome::Claimed(Claim::New(Lease {
                token: Token::new(s(1)?),
                fence: n(2)?,
                lease_expires_at_ms: n(3)?,
                expires_at_ms: n(4)?,
            }))
        }
        (Op::Claim { .. }, "D") => Outcome::Claimed(Claim::Duplicate {
            record: rec(&items)?,
        }),
        (Op::Mark { .. }, "M") => Outcome::Marked(Mark::New {
            record: rec(&items)?,
        }),
        (Op::Mark { .. }, "D") => Outcome::Marked(Mark::Duplicate {
            record: rec(&items)?,
        }),
        (Op::Complete { .. }, "K") => Outcome::Completed(rec(&items)?),
        (Op::Release { .. }, "R") => Outcome::Released,
        (Op::Extend { .. }, "X") => Outcome::Extended {
            lease_expires_at_ms: items
                .get(1)
                .and_then(number)
                .ok_or_else(|| corrupt("bad lease end"))?,
        },
        (Op::Get, "G") if items.len() == 1 => Outcome::Found(None),
        (Op::Get, "G") => Outcome::Found(Some(rec(&items)?)),
        (Op::Forget, "F") => Outcome::Forgotten(matches!(items.get(1), Some(Value::Int(1)))),
        _ => return Err(corrupt(&format!("tag {tag} does not answer {}", op.name()))),
    };
    Ok(outcome)
}

/// Parses `state, fence, fingerprint, owner, created, expires, lease, completed, result`.
fn parse_record(id: &RecordId, f: &[Value]) -> Option<Record> {
    if f.len() != 9 {
        return None;
    }
    let opt_text = |v: &Value| match v {
        Value::Nil => Some(None),
        other => text(other).map(Some),
    };
    let num = number;
    let opt_num = |v: &Value| match v {
        Value::Nil => Some(None),
        other => num(other).map(Some),
    };
    let state = match text(&f[0])?.as_str() {
        "in_progress" => State::InProgress,
        "completed" => State::Completed,
        _ => return None,
    };
    let result = match &f[8] {
        Value::Nil => None,
        Value::BulkString(b) => Some(serde_json::from_slice(b).ok()?),
        _ => return None,
    };
    Some(Record {
        namespace: id.namespace.clone(),
        key: id.key.clone(),
        state,
        fence: num(&f[1])?,
        fingerprint: opt_text(&f[2])?,
        owner: opt_text(&f[3])?,
        created_at_ms: num(&f[4])?,
        expires_at_ms: num(&f[5])?,
        lease_expires_at_ms: opt_num(&f[6])?,
        completed_at_ms: opt_num(&f[7])?,
        result,
    })
}

#[async_trait]
impl Store for RedisStore {
    async fn apply(&self, id: RecordId, op: Op) -> Result<Outcome, GateError> {
        if let Err(e) = op.validate() {
            return Err(GateError::Invalid(e));
        }
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

    async fn apply_batch(&self, ops: Vec<(RecordId, Op)>) -> Vec<Result<Outcome, GateError>> {
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

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{shared_redis_url, RedisCluster};

    fn prepared(index: usize, ns: &str, key: &str, op: Op) -> Prepared {
        let id = RecordId::new(ns, key).expect("a valid id");
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

    #[test]
    fn servers_before_7_0_are_too_old() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_git_sha1:0\r\n");
        assert_eq!(too_old(&info("6.2.14")), Some("6.2.14".to_owned()));
        assert_eq!(too_old(&info("5.0.7")), Some("5.0.7".to_owned()));
        assert_eq!(too_old(&info("7.0.15")), None);
        assert_eq!(too_old(&info("7.4.1")), None);
        assert_eq!(too_old(&info("255.255.255")), None);
        // A reply without a readable version is not judged.
        assert_eq!(too_old("# Server\r\nuptime_in_seconds:3\r\n"), None);
        assert_eq!(too_old(&info("unknown")), None);
    }
}
