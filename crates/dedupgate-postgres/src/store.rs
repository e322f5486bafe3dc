//! [`PgStore`]: the [`Store`] trait over a pool of tokio-postgres connections, and the
//! transactional API ([`PgStore::apply_in`]) that decides inside the caller's own transaction.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use dedupgate_core::{
    Claim, CoalesceLimits, Coalescer, Defaults, GateError, Lease, Mark, MarkOptions, Op, Outcome,
    Record, RecordId, State, Store, StoreError, StoreStats, Token, ValidOp, BATCH_OPS_MAX,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, NoTls, Row};

use crate::error::{describe_pg, is_retryable, open_pool_error, PgError};
use crate::options::{describe, parse_url, PgOptions};
use crate::schema;

/// Attempts of one store-owned transaction that PostgreSQL rolled back for a deadlock or
/// serialization failure (two batches locking overlapping keys in opposite orders).
const RETRIES_MAX: usize = 4;

/// Which function answers an op; also how its answer row is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Claim = 1,
    Mark = 2,
    Complete = 3,
    Release = 4,
    Extend = 5,
    Get = 6,
    Forget = 7,
}

/// Answer codes of the SQL functions (see migrations/v1.sql).
const CODE_OK: i16 = 1;
const CODE_DUPLICATE: i16 = 2;
const CODE_MISMATCH: i16 = 3;
const CODE_LEASE_LOST: i16 = 4;
const CODE_ABSENT: i16 = 5;

/// The SQL text of every call, with the schema filled in once at open.
#[derive(Debug)]
struct Sql {
    calls: [String; 7],
    batch: String,
    sweep: String,
}

impl Sql {
    fn new(s: &str) -> Self {
        let call = |f: &str, n: usize| {
            let args: Vec<String> = (1..=n).map(|i| format!("${i}")).collect();
            format!("SELECT * FROM {s}.dedupgate_{f}({})", args.join(", "))
        };
        Self {
            calls: [
                call("claim", 7),
                call("mark", 5),
                call("complete", 5),
                call("release", 3),
                call("extend", 4),
                call("get", 2),
                call("forget", 2),
            ],
            batch: call("apply_batch", 9),
            sweep: format!("SELECT {s}.dedupgate_sweep($1)"),
        }
    }

    fn call(&self, kind: Kind) -> &str {
        &self.calls[kind as usize - 1]
    }
}

type Param = (Box<dyn ToSql + Sync + Send>, Type);

fn bytes(v: &str) -> Param {
    (Box::new(v.as_bytes().to_vec()), Type::BYTEA)
}

fn opt_bytes(v: Option<&str>) -> Param {
    (Box::new(v.map(|s| s.as_bytes().to_vec())), Type::BYTEA)
}

fn int(v: u64) -> Param {
    // Durations are validated (≤ DURATION_MS_MAX), so they fit.
    (Box::new(v as i64), Type::INT8)
}

fn json_bytes(v: &Option<serde_json::Value>) -> Option<Vec<u8>> {
    // serde_json escapes control characters, so the text holds no raw NUL; with
    // arbitrary_precision numbers keep their exact digits.
    v.as_ref()
        .map(|v| serde_json::to_vec(v).expect("a JSON value always serializes"))
}

/// One op as a function call: which one, and its parameters in order.
fn call_of(id: &RecordId, op: &Op, fresh_token: &Token) -> (Kind, Vec<Param>) {
    let ns = bytes(id.namespace.as_str());
    let key = bytes(id.key.as_str());
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => (
            Kind::Claim,
            vec![
                ns,
                key,
                int(*ttl_ms),
                int(*lease_ms),
                opt_bytes(fingerprint.as_deref()),
                opt_bytes(owner.as_deref()),
                bytes(fresh_token.as_str()),
            ],
        ),
        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => (
            Kind::Mark,
            vec![
                ns,
                key,
                int(*ttl_ms),
                opt_bytes(fingerprint.as_deref()),
                (Box::new(json_bytes(result)), Type::BYTEA),
            ],
        ),
        Op::Complete {
            token,
            result,
            ttl_ms,
        } => (
            Kind::Complete,
            vec![
                ns,
                key,
                bytes(token.as_str()),
                (Box::new(json_bytes(result)), Type::BYTEA),
                (Box::new(ttl_ms.map(|t| t as i64)), Type::INT8),
            ],
        ),
        Op::Release { token } => (Kind::Release, vec![ns, key, bytes(token.as_str())]),
        Op::Extend { token, lease_ms } => (
            Kind::Extend,
            vec![ns, key, bytes(token.as_str()), int(*lease_ms)],
        ),
        Op::Get => (Kind::Get, vec![ns, key]),
        Op::Forget => (Kind::Forget, vec![ns, key]),
    }
}

fn corrupt(what: impl std::fmt::Display) -> GateError {
    GateError::Store(StoreError::Corrupt(format!("postgres row: {what}")))
}

fn text(bytes: Option<Vec<u8>>, field: &str) -> Result<Option<String>, GateError> {
    bytes
        .map(|b| String::from_utf8(b).map_err(|_| corrupt(format!("{field} is not UTF-8"))))
        .transpose()
}

fn ms(v: Option<i64>, field: &str) -> Result<Option<u64>, GateError> {
    v.map(|v| u64::try_from(v).map_err(|_| corrupt(format!("{field} is negative"))))
        .transpose()
}

fn need<T>(v: Option<T>, field: &str) -> Result<T, GateError> {
    v.ok_or_else(|| corrupt(format!("{field} is missing")))
}

/// The answer row of any function: code, then the entry's columns (null when not given).
struct Answer {
    code: i16,
    row: Row,
}

impl Answer {
    fn from_row(row: Row) -> Result<Self, GateError> {
        let code: Option<i16> = row.try_get(0).map_err(corrupt)?;
        Ok(Self {
            code: need(code, "code")?,
            row,
        })
    }

    fn get<'a, T: tokio_postgres::types::FromSql<'a>>(&'a self, i: usize) -> Result<T, GateError> {
        self.row.try_get(i).map_err(corrupt)
    }

    fn record(&self, id: &RecordId) -> Result<Record, GateError> {
        let state = match need(self.get::<Option<i16>>(1)?, "state")? {
            0 => State::InProgress,
            1 => State::Completed,
            other => return Err(corrupt(format!("state {other} has no public record"))),
        };
        let result = match self.get::<Option<Vec<u8>>>(10)? {
            Some(b) => {
                Some(serde_json::from_slice(&b).map_err(|e| corrupt(format!("result: {e}")))?)
            }
            None => None,
        };
        Ok(Record {
            namespace: id.namespace.clone(),
            key: id.key.clone(),
            state,
            fence: need(ms(self.get(2)?, "fence")?, "fence")?,
            fingerprint: text(self.get(4)?, "fingerprint")?,
            owner: text(self.get(5)?, "owner")?,
            created_at_ms: need(ms(self.get(6)?, "created_at_ms")?, "created_at_ms")?,
            expires_at_ms: need(ms(self.get(7)?, "expires_at_ms")?, "expires_at_ms")?,
            lease_expires_at_ms: ms(self.get(8)?, "lease_expires_at_ms")?,
            completed_at_ms: ms(self.get(9)?, "completed_at_ms")?,
            result,
        })
    }

    fn unexpected(&self, kind: Kind) -> GateError {
        corrupt(format!("answer code {} to {kind:?}", self.code))
    }

    /// The outcome of `kind` on `id`: the translation, never a decision.
    fn outcome(self, kind: Kind, id: &RecordId) -> Result<Outcome, GateError> {
        match (kind, self.code) {
            (Kind::Claim | Kind::Mark, CODE_MISMATCH) => Err(GateError::FingerprintMismatch),
            (Kind::Claim, CODE_OK) => {
                let token = need(text(self.get(3)?, "token")?, "token")?;
                Ok(Outcome::Claimed(Claim::New(Lease {
                    token: Token::new(token),
                    fence: need(ms(self.get(2)?, "fence")?, "fence")?,
                    lease_expires_at_ms: need(
                        ms(self.get(8)?, "lease_expires_at_ms")?,
                        "lease_expires_at_ms",
                    )?,
                    expires_at_ms: need(ms(self.get(7)?, "expires_at_ms")?, "expires_at_ms")?,
                })))
            }
            (Kind::Claim, CODE_DUPLICATE) => Ok(Outcome::Claimed(Claim::Duplicate {
                record: self.record(id)?,
            })),
            (Kind::Mark, CODE_OK) => Ok(Outcome::Marked(Mark::New {
                record: self.record(id)?,
            })),
            (Kind::Mark, CODE_DUPLICATE) => Ok(Outcome::Marked(Mark::Duplicate {
                record: self.record(id)?,
            })),
            (Kind::Complete | Kind::Release | Kind::Extend, CODE_LEASE_LOST) => {
                Err(GateError::LeaseLost)
            }
            (Kind::Complete, CODE_OK) => Ok(Outcome::Completed(self.record(id)?)),
            (Kind::Release, CODE_OK) => Ok(Outcome::Released),
            (Kind::Extend, CODE_OK) => Ok(Outcome::Extended {
                lease_expires_at_ms: need(
                    ms(self.get(8)?, "lease_expires_at_ms")?,
                    "lease_expires_at_ms",
                )?,
            }),
            (Kind::Get, CODE_OK) => Ok(Outcome::Found(Some(self.record(id)?))),
            (Kind::Get, CODE_ABSENT) => Ok(Outcome::Found(None)),
            (Kind::Forget, CODE_OK) => Ok(Outcome::Forgotten(true)),
            (Kind::Forget, CODE_ABSENT) => Ok(Outcome::Forgotten(false)),
            _ => Err(self.unexpected(kind)),
        }
    }
}

fn unavailable(e: tokio_postgres::Error) -> GateError {
    GateError::Store(StoreError::Unavailable(describe_pg(&e)))
}

/// A pooled connection with a statement of ours in flight. Dropped before [`Busy::finish`] (a
/// timeout gave up on the statement), it takes the connection out of the pool and asks the
/// server to cancel the statement: left running, a statement waiting for rows goes on holding
/// the rows it took, and the next op given the connection would queue behind it (or, with the
/// connection back in the pool, be the one cancelled).
struct Busy(Option<deadpool_postgres::Object>);

impl Busy {
    /// The statement is over: the connection goes back to the pool.
    fn finish(mut self) {
        self.0.take();
    }
}

impl std::ops::Deref for Busy {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        self.0
            .as_ref()
            .expect("a Busy holds its connection until finish")
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let Some(client) = self.0.take() else {
            return;
        };
        let client = deadpool_postgres::Object::take(client);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = client.cancel_token().cancel_query(NoTls).await {
                    tracing::debug!(error = %describe_pg(&e), "postgres: cancelling a timed-out statement failed");
                }
                drop(client);
            });
        }
    }
}

/// The PostgreSQL store. Cheap to share behind an `Arc`; every operation borrows a pooled
/// connection for one call.
pub struct PgStore {
    pool: Pool,
    options: PgOptions,
    sql: Sql,
    description: String,
    swept_total: AtomicU64,
    /// Single ops of concurrent callers, sent together through the batch function (one call,
    /// one transaction, one commit for all of them); `None` in the store that does the sending.
    coalescer: Option<Coalescer>,
}

/// Most ops one coalesced call carries: few enough that a call's row locks stay short.
const COALESCED_OPS_MAX: usize = 128;
/// Most coalesced calls in flight at once (at most the pool). Ops that arrive meanwhile share
/// the next call. `cargo bench -p dedupgate-postgres` on 2 cores (docs/benchmarks-postgres.md):
/// with 50 callers, 2 gave 27.6k claims/s, 4 gave 22.8k, a quarter of the pool (13) 15.0k and
/// no coalescing 8.3k, against pgbench's 11–15k single-statement rate.
const COALESCED_IN_FLIGHT_MAX: usize = 2;

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("store", &self.description)
            .finish()
    }
}

impl PgStore {
    /// Opens the store a `postgres://…` URL names (the `--store` form), taking the
    /// `dedupgate_*` options out of its query string.
    pub async fn open(url: &str) -> Result<Self, PgError> {
        let (config, options) = parse_url(url)?;
        Self::connect(config, options).await
    }

    /// Opens the store: builds the pool, refuses an unsafe durability setting, then creates or
    /// migrates the schema.
    pub async fn connect(
        config: tokio_postgres::Config,
        options: PgOptions,
    ) -> Result<Self, PgError> {
        options.validate()?;
        let description = describe(&config, &options);
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                // Fast: a closed connection is dropped at checkout; a query on a half-dead one
                // fails once and answers `unavailable`, which is the truth.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let timeout = Some(options.op_timeout());
        let pool = Pool::builder(manager)
            .max_size(options.pool_size)
            .wait_timeout(timeout)
            .create_timeout(timeout)
            .recycle_timeout(timeout)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| PgError::Options(format!("connection pool: {e}")))?;
        let mut client = pool
            .get()
            .await
            .map_err(|e| open_pool_error(e, &description))?;
        schema::check_durability(&client, &options).await?;
        schema::migrate(&mut client, &options).await?;
        drop(client);
        tracing::debug!(store = %description, "dedupgate postgres store open");
        // The sender of coalesced calls: the same pool and options, without a coalescer.
        let batcher = Arc::new(Self {
            pool: pool.clone(),
            options: options.clone(),
            sql: Sql::new(&options.quoted_schema()),
            description: description.clone(),
            swept_total: AtomicU64::new(0),
            coalescer: None,
        });
        // Under load the per-call cost (round trip, function entry, commit) is shared.
        let limits = CoalesceLimits {
            queue_max: 4_096,
            in_flight_max: options.pool_size.min(COALESCED_IN_FLIGHT_MAX),
            batch_max: COALESCED_OPS_MAX,
        };
        let coalescer = Coalescer::spawn(limits, move |ops| {
            let batcher = batcher.clone();
            async move { batcher.apply_batch(ops).await }
        });
        Ok(Self {
            pool,
            sql: Sql::new(&options.quoted_schema()),
            options,
            description,
            swept_total: AtomicU64::new(0),
            coalescer: Some(coalescer),
        })
    }

    /// Closes the pool: idle connections at once, busy ones when they come back. Every later
    /// operation answers `unavailable`. For a graceful shutdown.
    pub fn close(&self) {
        self.pool.close();
    }

    /// The schema holding the table and functions.
    pub fn schema(&self) -> &str {
        &self.options.schema
    }

    /// The pool, for callers that want a connection to run their own transaction on (the
    /// transactional API) against the same database.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, GateError> {
        self.pool
            .get()
            .await
            .map_err(|e| GateError::Store(StoreError::Unavailable(format!("postgres pool: {e}"))))
    }

    async fn apply_pooled(&self, id: &RecordId, op: &Op) -> Result<Outcome, GateError> {
        let token = Token::generate();
        let (kind, params) = call_of(id, op, &token);
        let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
        let refs: Vec<&(dyn ToSql + Sync)> = params
            .iter()
            .map(|(p, _)| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let client = Busy(Some(self.client().await?));
            let stmt = client
                .prepare_typed_cached(self.sql.call(kind), &types)
                .await
                .map_err(unavailable)?;
            let answer = client.query_one(&stmt, &refs).await;
            client.finish();
            match answer {
                Ok(row) => return Answer::from_row(row)?.outcome(kind, id),
                Err(e) if is_retryable(&e) && attempt < RETRIES_MAX => continue,
                Err(e) => return Err(unavailable(e)),
            }
        }
    }

    /// Decides `op` inside the caller's transaction (or on the caller's connection): the dedup
    /// record commits or rolls back with the caller's own writes. Until the caller commits, the
    /// row stays locked, so a concurrent claim of the same key waits and then sees the outcome.
    ///
    /// Use it for claim or mark (and complete in the same transaction): on rollback the claim
    /// never happened, so there is nothing to release. An SQL error here aborts the caller's
    /// transaction, as any failed statement does; duplicates, mismatches and lost leases are
    /// answers and leave it usable. The answer is durable only once the caller's commit returns.
    /// One round trip (`query_typed`, no prepared statement kept on the caller's connection).
    pub async fn apply_in<C: GenericClient + Sync>(
        &self,
        client: &C,
        id: RecordId,
        op: ValidOp,
    ) -> Result<Outcome, GateError> {
        let token = Token::generate();
        let (kind, params) = call_of(&id, &op, &token);
        let typed: Vec<(&(dyn ToSql + Sync), Type)> = params
            .iter()
            .map(|(p, t)| (p.as_ref() as &(dyn ToSql + Sync), t.clone()))
            .collect();
        // No timeout of ours here: abandoning a statement would leave the caller's transaction
        // in an unknown state. The caller bounds it (statement_timeout, or its own timeout and
        // a rollback).
        let row = client
            .query_typed_one(self.sql.call(kind), &typed)
            .await
            .map_err(unavailable)?;
        Answer::from_row(row)?.outcome(kind, &id)
    }

    /// Claims `key` inside the caller's transaction; see [`PgStore::apply_in`].
    pub async fn claim_in<C: GenericClient + Sync>(
        &self,
        client: &C,
        id: RecordId,
        op: ValidOp,
    ) -> Result<Claim, GateError> {
        if !matches!(*op, Op::Claim { .. }) {
            return Err(dedupgate_core::InvalidInput::new("op", "claim_in takes a claim").into());
        }
        match self.apply_in(client, id, op).await? {
            Outcome::Claimed(c) => Ok(c),
            other => Err(corrupt(format!("claim answered {}", other.label()))),
        }
    }

    /// Marks `key` inside the caller's transaction; see [`PgStore::apply_in`].
    pub async fn mark_in<C: GenericClient + Sync>(
        &self,
        client: &C,
        id: RecordId,
        ttl_ms: u64,
        fingerprint: Option<String>,
        result: Option<serde_json::Value>,
    ) -> Result<Mark, GateError> {
        let opts = MarkOptions {
            ttl_ms: Some(ttl_ms),
            fingerprint,
            result,
        };
        let op = ValidOp::mark(opts, Defaults::default())?;
        match self.apply_in(client, id, op).await? {
            Outcome::Marked(m) => Ok(m),
            other => Err(corrupt(format!("mark answered {}", other.label()))),
        }
    }

    /// Sends the valid ops of a batch as one call of `dedupgate_apply_batch`: one round trip,
    /// one transaction, one commit.
    async fn batch_pooled(
        &self,
        ops: &[(RecordId, ValidOp)],
    ) -> Result<Vec<Result<Outcome, GateError>>, GateError> {
        let n = ops.len();
        let mut kind = Vec::with_capacity(n);
        let mut kinds = Vec::with_capacity(n);
        let mut ns = Vec::with_capacity(n);
        let mut key = Vec::with_capacity(n);
        let mut ttl: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut lease: Vec<Option<i64>> = Vec::with_capacity(n);
        let mut fp: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut owner: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut token: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut result: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let b = |s: &str| Some(s.as_bytes().to_vec());
        for (id, op) in ops {
            ns.push(id.namespace.as_str().as_bytes().to_vec());
            key.push(id.key.as_str().as_bytes().to_vec());
            let (k, t, l, f, o, tk, r) = match &**op {
                Op::Claim {
                    ttl_ms,
                    lease_ms,
                    fingerprint,
                    owner,
                } => (
                    Kind::Claim,
                    Some(*ttl_ms as i64),
                    Some(*lease_ms as i64),
                    fingerprint.as_deref().and_then(b),
                    owner.as_deref().and_then(b),
                    b(Token::generate().as_str()),
                    None,
                ),
                Op::Mark {
                    ttl_ms,
                    fingerprint,
                    result,
                } => (
                    Kind::Mark,
                    Some(*ttl_ms as i64),
                    None,
                    fingerprint.as_deref().and_then(b),
                    None,
                    None,
                    json_bytes(result),
                ),
                Op::Complete {
                    token,
                    result,
                    ttl_ms,
                } => (
                    Kind::Complete,
                    ttl_ms.map(|t| t as i64),
                    None,
                    None,
                    None,
                    b(token.as_str()),
                    json_bytes(result),
                ),
                Op::Release { token } => (
                    Kind::Release,
                    None,
                    None,
                    None,
                    None,
                    b(token.as_str()),
                    None,
                ),
                Op::Extend { token, lease_ms } => (
                    Kind::Extend,
                    None,
                    Some(*lease_ms as i64),
                    None,
                    None,
                    b(token.as_str()),
                    None,
                ),
                Op::Get => (Kind::Get, None, None, None, None, None, None),
                Op::Forget => (Kind::Forget, None, None, None, None, None, None),
            };
            kind.push(k);
            kinds.push(k as i16);
            ttl.push(t);
            lease.push(l);
            fp.push(f);
            owner.push(o);
            token.push(tk);
            result.push(r);
        }
        let params: [&(dyn ToSql + Sync); 9] = [
            &kinds, &ns, &key, &ttl, &lease, &fp, &owner, &token, &result,
        ];
        let mut attempt = 0;
        let rows = loop {
            attempt += 1;
            let client = Busy(Some(self.client().await?));
            let stmt = client
                .prepare_cached(&self.sql.batch)
                .await
                .map_err(unavailable)?;
            let answer = client.query(&stmt, &params).await;
            client.finish();
            match answer {
                Ok(rows) => break rows,
                Err(e) if is_retryable(&e) && attempt < RETRIES_MAX => continue,
                Err(e) => return Err(unavailable(e)),
            }
        };
        if rows.len() != n {
            return Err(corrupt(format!(
                "batch of {n} answered {} rows",
                rows.len()
            )));
        }
        Ok(rows
            .into_iter()
            .zip(ops)
            .zip(kind)
            .map(|((row, (id, _)), k)| Answer::from_row(row).and_then(|a| a.outcome(k, id)))
            .collect())
    }
}

fn timed_out() -> GateError {
    GateError::Store(StoreError::Unavailable(
        "postgres: the operation timed out; it may or may not have taken effect".to_owned(),
    ))
}

#[async_trait]
impl Store for PgStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        if let Some(coalescer) = &self.coalescer {
            // Bounded like an uncoalesced op: the wait for a slot counts too (a timed-out op
            // may still be decided later, which is what `unavailable` means).
            return tokio::time::timeout(self.options.op_timeout(), coalescer.apply(id, op))
                .await
                .map_err(|_| timed_out())?;
        }
        tokio::time::timeout(self.options.op_timeout(), self.apply_pooled(&id, &op))
            .await
            .map_err(|_| timed_out())?
    }

    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        let n = ops.len();
        if n > BATCH_OPS_MAX {
            let msg = format!("a batch holds at most {BATCH_OPS_MAX} ops, got {n}");
            return (0..n)
                .map(|_| Err(dedupgate_core::InvalidInput::new("ops", msg.clone()).into()))
                .collect();
        }
        if ops.is_empty() {
            return Vec::new();
        }
        let answers =
            tokio::time::timeout(self.options.op_timeout(), self.batch_pooled(&ops)).await;
        let mut answers = match answers {
            Ok(Ok(a)) => a.into_iter(),
            Ok(Err(e)) => {
                let msg = e.to_string();
                return ops
                    .iter()
                    .map(|_| Err(StoreError::Unavailable(msg.clone()).into()))
                    .collect();
            }
            Err(_) => return ops.iter().map(|_| Err(timed_out())).collect(),
        };
        (0..n)
            .map(|_| {
                answers
                    .next()
                    .unwrap_or_else(|| Err(corrupt("batch answer missing")))
            })
            .collect()
    }

    async fn health(&self) -> Result<(), StoreError> {
        let check = async {
            let client = self.pool.get().await.map_err(StoreError::unavailable)?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| StoreError::Unavailable(describe_pg(&e)))?;
            Ok(())
        };
        tokio::time::timeout(self.options.op_timeout(), check)
            .await
            .map_err(|_| StoreError::Unavailable("postgres: health check timed out".to_owned()))?
    }

    async fn sweep_expired(&self, batch_max: usize) -> Result<u64, StoreError> {
        let batch_max = i32::try_from(batch_max).unwrap_or(i32::MAX);
        let sweep = async {
            let client = self.pool.get().await.map_err(StoreError::unavailable)?;
            let row = client
                .query_one(&self.sql.sweep, &[&batch_max])
                .await
                .map_err(|e| StoreError::Unavailable(describe_pg(&e)))?;
            let n: i64 = row.get(0);
            Ok::<u64, StoreError>(n.max(0) as u64)
        };
        let n = tokio::time::timeout(self.options.op_timeout(), sweep)
            .await
            .map_err(|_| StoreError::Unavailable("postgres: sweep timed out".to_owned()))??;
        self.swept_total.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        Ok(StoreStats {
            // count(*) scans the table: too dear to answer on every metrics scrape.
            records_held: None,
            swept_total: Some(self.swept_total.load(Ordering::Relaxed)),
        })
    }

    fn describe(&self) -> String {
        self.description.clone()
    }
}

/// Opens a store from a URL for callers that hold stores as `Arc<dyn Store>`.
pub async fn open_store(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(PgStore::open(url).await?))
}
