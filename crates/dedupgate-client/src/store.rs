//! The HTTP API seen as a core [`Store`]: a dedupgate server is one more store to every face.
//!
//! [`HttpStore`] carries each operation to the server with a [`Client`] and maps the answer
//! back; its error mapping ([`ClientError`] into [`GateError`]) is the only one from HTTP
//! problems to core errors. How it retries is the client's [`RetryPolicy`], set through
//! [`HttpStoreOptions`]: the CLI keeps the safe retries, the torture harness turns them off
//! so that each recorded operation is exactly one request.

use std::time::Duration;

use async_trait::async_trait;
use dedupgate_core::error::chain_text;
use dedupgate_core::{
    ClaimOptions, GateError, Op, Outcome, RecordId, Store, StoreError, Token, ValidOp,
    BATCH_OPS_MAX,
};
use serde_json::{json, Value};

use crate::{Client, ClientError, MarkOptions, Problem, RetryPolicy, DEFAULT_TIMEOUT_MS};

/// How an [`HttpStore`] talks to its server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpStoreOptions {
    /// How a call is retried (see [`RetryPolicy`] for why its retries are safe).
    pub retry: RetryPolicy,
    /// Per-request timeout.
    pub timeout: Duration,
}

impl Default for HttpStoreOptions {
    /// The client's own defaults: safe retries, [`DEFAULT_TIMEOUT_MS`] per request.
    fn default() -> Self {
        Self {
            retry: RetryPolicy::default(),
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
        }
    }
}

impl HttpStoreOptions {
    /// One try per call and 10 s per request: a caller that records every request it makes
    /// (the torture harness) must see each retry as an operation of its own.
    pub fn without_retries() -> Self {
        Self {
            retry: RetryPolicy {
                attempts_max: 1,
                backoff_initial_ms: 1,
                backoff_max_ms: 1,
            },
            timeout: Duration::from_secs(10),
        }
    }
}

/// A dedupgate server as a [`Store`]. Transport errors and 503s are
/// [`StoreError::Unavailable`]: unknown outcomes.
#[derive(Clone, Debug)]
pub struct HttpStore {
    client: Client,
    base: String,
    /// Whether a claim without an owner is sent as it is (a batch item). Only when calls are
    /// never retried: a retried ownerless claim whose first answer was lost would answer its
    /// own caller `duplicate`, so with retries the typed claim names a fresh owner instead.
    ownerless_as_is: bool,
}

impl HttpStore {
    /// A store talking to the server at `base` as `options` say.
    pub fn new(base: &str, options: HttpStoreOptions) -> Result<Self, ClientError> {
        let client = Client::new(base)?
            .with_retry(options.retry)
            .with_timeout(options.timeout)?;
        Ok(Self {
            client,
            base: base.to_owned(),
            ownerless_as_is: options.retry.attempts_max <= 1,
        })
    }

    /// The client the store calls through.
    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl From<Problem> for ClientError {
    /// The core's error when the core defines the problem's code, else the problem as sent.
    fn from(problem: Problem) -> Self {
        match problem.to_gate_error() {
            Some(e) => ClientError::Gate(e),
            None => ClientError::Rejected(problem),
        }
    }
}

impl From<ClientError> for GateError {
    /// An answer the core defines stays itself; any other failure (a transport error, an
    /// answer the core has no word for) is unavailable: the outcome is unknown. Its detail is
    /// the client's message with its causes, as a caller of the [`Client`] would print it.
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Gate(g) => g,
            other => GateError::Store(StoreError::Unavailable(chain_text(&other))),
        }
    }
}

#[async_trait]
impl Store for HttpStore {
    async fn apply(&self, id: RecordId, op: ValidOp) -> Result<Outcome, GateError> {
        // Only a batch item leaves a claim's owner out (the typed claim names one).
        if self.ownerless_as_is && matches!(*op, Op::Claim { owner: None, .. }) {
            let mut answers = self.apply_batch(vec![(id, op)]).await;
            return answers
                .pop()
                .unwrap_or_else(|| Err(unavailable("the server answered no item to a claim")));
        }
        let (ns, key) = (id.namespace.to_string(), id.key.to_string());
        let c = &self.client;
        match op.into_op() {
            Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner,
            } => Ok(Outcome::Claimed(
                c.claim(
                    &ns,
                    &key,
                    ClaimOptions {
                        ttl_ms: Some(ttl_ms),
                        lease_ms: Some(lease_ms),
                        fingerprint,
                        owner,
                    },
                )
                .await?,
            )),
            Op::Complete {
                token,
                result,
                ttl_ms,
            } => Ok(Outcome::Completed(
                c.complete(&ns, &key, &token, result, ttl_ms).await?,
            )),
            Op::Release { token } => {
                c.release(&ns, &key, &token).await?;
                Ok(Outcome::Released)
            }
            Op::Extend { token, lease_ms } => Ok(Outcome::Extended {
                lease_expires_at_ms: c.extend(&ns, &key, &token, lease_ms).await?,
            }),
            Op::Mark {
                ttl_ms,
                fingerprint,
                result,
            } => Ok(Outcome::Marked(
                c.mark(
                    &ns,
                    &key,
                    MarkOptions {
                        ttl_ms: Some(ttl_ms),
                        fingerprint,
                        result,
                    },
                )
                .await?,
            )),
            Op::Get => Ok(Outcome::Found(c.get(&ns, &key).await?)),
            Op::Forget => Ok(Outcome::Forgotten(c.forget(&ns, &key).await?)),
        }
    }

    /// One `POST /v1/batch` per [`BATCH_OPS_MAX`] ops instead of a request per op: the server
    /// decides them in order, each atomically, sharing its store's commit. A release answered
    /// `lease_lost` by a batch that was retried is looked up as the typed release does (its
    /// first try may have freed the key); that look-up tells only when no other op of the
    /// batch touches the key, so with retries on such a batch goes op by op instead.
    async fn apply_batch(&self, ops: Vec<(RecordId, ValidOp)>) -> Vec<Result<Outcome, GateError>> {
        if !self.ownerless_as_is && a_release_shares_its_key(&ops) {
            let mut out = Vec::with_capacity(ops.len());
            for (id, op) in ops {
                out.push(self.apply(id, op).await);
            }
            return out;
        }
        let mut out = Vec::with_capacity(ops.len());
        let mut ops = ops.into_iter().peekable();
        while ops.peek().is_some() {
            let chunk: Vec<(RecordId, ValidOp)> = ops.by_ref().take(BATCH_OPS_MAX).collect();
            let kinds: Vec<(&'static str, RecordId)> = chunk
                .iter()
                .map(|(id, op)| (op.name(), id.clone()))
                .collect();
            let items = chunk
                .into_iter()
                .map(|(id, op)| batch_item(&id, op, self.ownerless_as_is))
                .collect();
            match self.client.batch_repeated(items).await {
                (Ok(answers), repeated) if answers.len() == kinds.len() => {
                    for ((kind, id), answer) in kinds.into_iter().zip(answers) {
                        out.push(match batch_outcome(kind, answer) {
                            Err(GateError::LeaseLost) if repeated && kind == "release" => {
                                self.released_before(&id).await
                            }
                            outcome => outcome,
                        });
                    }
                }
                (Ok(answers), _) => {
                    let why = format!(
                        "the server answered {} items to a batch of {}",
                        answers.len(),
                        kinds.len()
                    );
                    out.extend(kinds.iter().map(|_| Err(unavailable(&why))));
                }
                (Err(e), _) => {
                    let failed = GateError::from(e);
                    out.extend(kinds.iter().map(|_| Err(same_error(&failed))));
                }
            }
        }
        out
    }

    async fn health(&self) -> Result<(), StoreError> {
        self.client
            .health()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }

    async fn sweep_expired(&self, _batch_max: usize) -> Result<u64, StoreError> {
        // The server sweeps on its own.
        Ok(0)
    }

    /// The server at the other end owns its store's sweeping.
    fn sweeps_itself(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("http: {}", self.base)
    }
}

impl HttpStore {
    /// The answer to a release that a retried batch answered `lease_lost`, as
    /// [`Client::release`] gives it: released when no live record holds the key any more.
    async fn released_before(&self, id: &RecordId) -> Result<Outcome, GateError> {
        match self
            .client
            .get(id.namespace.as_str(), id.key.as_str())
            .await?
        {
            None => Ok(Outcome::Released),
            Some(_) => Err(GateError::LeaseLost),
        }
    }
}

/// Whether an op of `ops` touches the key of a release other than that release.
fn a_release_shares_its_key(ops: &[(RecordId, ValidOp)]) -> bool {
    let released: std::collections::HashSet<&RecordId> = ops
        .iter()
        .filter(|(_, op)| matches!(**op, Op::Release { .. }))
        .map(|(id, _)| id)
        .collect();
    !released.is_empty()
        && ops.iter().filter(|(id, _)| released.contains(id)).count() > released.len()
}

fn unavailable(why: &str) -> GateError {
    GateError::Store(StoreError::Unavailable(why.to_owned()))
}

/// `e` again, for each op of a batch whose request failed as a whole (a [`GateError`] is not
/// `Clone`): each op gets the answer [`Store::apply`] would have given it.
fn same_error(e: &GateError) -> GateError {
    match e {
        GateError::Invalid(invalid) => GateError::Invalid(invalid.clone()),
        GateError::LeaseLost => GateError::LeaseLost,
        GateError::FingerprintMismatch => GateError::FingerprintMismatch,
        GateError::Store(StoreError::Unavailable(why)) => unavailable(why),
        other => unavailable(&other.to_string()),
    }
}

/// `op` as an item of `POST /v1/batch`. A claim without an owner gets a fresh one unless
/// `ownerless_as_is`, for the reason [`HttpStore`]'s field gives.
fn batch_item(id: &RecordId, op: ValidOp, ownerless_as_is: bool) -> Value {
    let mut item =
        json!({"op": op.name(), "namespace": id.namespace.as_str(), "key": id.key.as_str()});
    let mut put = |field: &str, value: Value| {
        item[field] = value;
    };
    match op.into_op() {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => {
            put("ttl_ms", ttl_ms.into());
            put("lease_ms", lease_ms.into());
            if let Some(f) = fingerprint {
                put("fingerprint", f.into());
            }
            match owner {
                Some(o) => put("owner", o.into()),
                None if !ownerless_as_is => put(
                    "owner",
                    format!("client-{}", Token::generate().as_str()).into(),
                ),
                None => {}
            }
        }
        Op::Complete {
            token,
            result,
            ttl_ms,
        } => {
            put("token", token.as_str().into());
            if let Some(r) = result {
                put("result", r);
            }
            if let Some(t) = ttl_ms {
                put("ttl_ms", t.into());
            }
        }
        Op::Release { token } => put("token", token.as_str().into()),
        Op::Extend { token, lease_ms } => {
            put("token", token.as_str().into());
            put("lease_ms", lease_ms.into());
        }
        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => {
            put("ttl_ms", ttl_ms.into());
            if let Some(f) = fingerprint {
                put("fingerprint", f.into());
            }
            if let Some(r) = result {
                put("result", r);
            }
        }
        Op::Get | Op::Forget => {}
    }
    item
}

/// One batch item's answer (API.md's success body of the op named `kind`, or its problem) as
/// the outcome [`Store::apply`] gives for that op.
fn batch_outcome(kind: &str, answer: Result<Value, Problem>) -> Result<Outcome, GateError> {
    let body = match answer {
        Ok(body) => body,
        Err(p) if kind == "get" && p.code == "not_found" => return Ok(Outcome::Found(None)),
        Err(p) => return Err(ClientError::from(p).into()),
    };
    let field = |name: &str| body.get(name).cloned().unwrap_or(Value::Null);
    let decoded = match kind {
        "claim" => serde_json::from_value(body.clone()).map(Outcome::Claimed),
        "mark" => serde_json::from_value(body.clone()).map(Outcome::Marked),
        "complete" => serde_json::from_value(field("record")).map(Outcome::Completed),
        "release" => Ok(Outcome::Released),
        "extend" => {
            serde_json::from_value(field("lease_expires_at_ms")).map(|lease_expires_at_ms| {
                Outcome::Extended {
                    lease_expires_at_ms,
                }
            })
        }
        "get" => serde_json::from_value(body.clone()).map(|r| Outcome::Found(Some(r))),
        _ => serde_json::from_value(field("deleted")).map(Outcome::Forgotten),
    };
    decoded.map_err(|e| unavailable(&format!("unexpected {kind} answer from the server: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_the_core_defines_stay_themselves_and_the_rest_are_unavailable() {
        let lost = Problem {
            status: 409,
            code: "lease_lost".into(),
            detail: "x".into(),
        };
        assert!(matches!(
            GateError::from(ClientError::from(lost)),
            GateError::LeaseLost
        ));
        let forbidden = Problem {
            status: 403,
            code: "forbidden".into(),
            detail: "no".into(),
        };
        assert!(matches!(
            GateError::from(ClientError::from(forbidden)),
            GateError::Store(StoreError::Unavailable(_))
        ));
    }

    #[test]
    fn only_a_release_whose_key_another_op_touches_needs_ops_one_by_one() {
        let id = |k: &str| RecordId::new("ns", k).unwrap();
        let release = || ValidOp::release(Token::new("t")).unwrap();
        let claim = || ValidOp::claim(ClaimOptions::default(), Default::default()).unwrap();
        assert!(!a_release_shares_its_key(&[
            (id("a"), claim()),
            (id("a"), claim())
        ]));
        assert!(!a_release_shares_its_key(&[
            (id("a"), release()),
            (id("b"), claim())
        ]));
        assert!(a_release_shares_its_key(&[
            (id("a"), release()),
            (id("a"), claim())
        ]));
        assert!(a_release_shares_its_key(&[
            (id("a"), release()),
            (id("a"), release())
        ]));
    }

    #[test]
    fn options_without_retries_try_once() {
        assert_eq!(HttpStoreOptions::without_retries().retry.attempts_max, 1);
        assert_eq!(HttpStoreOptions::default().retry, RetryPolicy::default());
        assert!(HttpStore::new("ftp://x", HttpStoreOptions::default()).is_err());
    }
}
