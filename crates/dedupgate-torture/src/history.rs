//! Histories: every operation a client sent the gate, with when it was called, when (and
//! whether) it returned and what it was told. A history is the input of the linearizability
//! checker ([`crate::lin`]) and, written as JSON Lines, the "log of every gate answer" the effect
//! oracle reads ([`crate::oracle`]).
//!
//! Times are wall-clock nanoseconds since the Unix epoch ([`wall_ns`]), read on the same host as
//! the store's clock. Using one system-wide clock for every process makes `a.return_ns <
//! b.call_ns` a real-time order across processes, and lets the checker bound the store's
//! millisecond clock by `[call_ns / 1e6, return_ns / 1e6]` (widened by a skew allowance for a
//! store that reads another clock).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupgate_core::{
    Claim, GateError, Mark, Op, Outcome, Record, RecordId, Store, StoreError, Token, ValidOp,
};
use serde::{Deserialize, Serialize};

/// Wall-clock nanoseconds since the Unix epoch (0 if the clock is before 1970).
pub fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// One operation as a client sent it. Tokens are kept as the text the client presented, since
/// the checker relates them to the claims that issued them, not to their value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum HOp {
    /// [`Op::Claim`].
    Claim {
        /// Retention.
        ttl_ms: u64,
        /// Lease.
        lease_ms: u64,
        /// Payload hash.
        #[serde(default)]
        fingerprint: Option<String>,
        /// Claimer id.
        #[serde(default)]
        owner: Option<String>,
    },
    /// [`Op::Complete`].
    Complete {
        /// The token presented.
        token: String,
        /// Result stored.
        #[serde(default)]
        result: Option<serde_json::Value>,
        /// New retention.
        #[serde(default)]
        ttl_ms: Option<u64>,
    },
    /// [`Op::Release`].
    Release {
        /// The token presented.
        token: String,
    },
    /// [`Op::Extend`].
    Extend {
        /// The token presented.
        token: String,
        /// New lease from now.
        lease_ms: u64,
    },
    /// [`Op::Mark`].
    Mark {
        /// Retention.
        ttl_ms: u64,
        /// Payload hash.
        #[serde(default)]
        fingerprint: Option<String>,
        /// Result stored.
        #[serde(default)]
        result: Option<serde_json::Value>,
    },
    /// [`Op::Get`].
    Get,
    /// [`Op::Forget`].
    Forget,
}

impl HOp {
    /// The core operation, with each presented token mapped by `token`.
    pub fn to_op(&self, token: impl Fn(&str) -> Token) -> Op {
        match self.clone() {
            HOp::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner,
            } => Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner,
            },
            HOp::Complete {
                token: t,
                result,
                ttl_ms,
            } => Op::Complete {
                token: token(&t),
                result,
                ttl_ms,
            },
            HOp::Release { token: t } => Op::Release { token: token(&t) },
            HOp::Extend { token: t, lease_ms } => Op::Extend {
                token: token(&t),
                lease_ms,
            },
            HOp::Mark {
                ttl_ms,
                fingerprint,
                result,
            } => Op::Mark {
                ttl_ms,
                fingerprint,
                result,
            },
            HOp::Get => Op::Get,
            HOp::Forget => Op::Forget,
        }
    }

    /// The core operation with tokens passed through unchanged (what a client sends).
    pub fn to_wire_op(&self) -> Op {
        self.to_op(|t: &str| Token::new(t))
    }

    /// The presented token, for complete, release and extend.
    pub fn token(&self) -> Option<&str> {
        match self {
            HOp::Complete { token, .. } | HOp::Release { token } | HOp::Extend { token, .. } => {
                Some(token)
            }
            _ => None,
        }
    }

    /// Durations this op names (lease and ttl), used as hints for placing unknown operations.
    pub fn durations_ms(&self) -> Vec<u64> {
        match self {
            HOp::Claim {
                ttl_ms, lease_ms, ..
            } => vec![*ttl_ms, *lease_ms],
            HOp::Complete {
                ttl_ms: Some(t), ..
            } => vec![*t],
            HOp::Extend { lease_ms, .. } => vec![*lease_ms],
            HOp::Mark { ttl_ms, .. } => vec![*ttl_ms],
            _ => vec![],
        }
    }
}

/// What the client was told. A call that timed out, hit an unavailable store or whose process
/// died is [`HAnswer::Unknown`]: it may or may not have taken effect, and the checkers treat it so.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum HAnswer {
    /// No answer: the operation may or may not have taken effect.
    Unknown {
        /// Why (timeout, unavailable, crashed), for reports.
        why: String,
    },
    /// Answer to a claim.
    Claimed {
        /// New (with the token) or duplicate.
        claim: Claim,
    },
    /// Answer to a complete.
    Completed {
        /// The completed record.
        record: Record,
    },
    /// Answer to a release.
    Released,
    /// Answer to an extend.
    Extended {
        /// New lease end.
        lease_expires_at_ms: u64,
    },
    /// Answer to a mark.
    Marked {
        /// New or duplicate.
        mark: Mark,
    },
    /// Answer to a get.
    Found {
        /// The record, if a live one exists.
        record: Option<Record>,
    },
    /// Answer to a forget.
    Forgotten {
        /// Whether a live record was deleted.
        deleted: bool,
    },
    /// A refusal that decided nothing: `lease_lost`, `fingerprint_mismatch`, `invalid_request`.
    Refused {
        /// The API.md error code.
        code: String,
    },
}

impl HAnswer {
    /// Translates a store's answer; a store error is an unknown outcome, never a failure.
    pub fn from_result(r: &Result<Outcome, GateError>) -> Self {
        match r {
            Ok(Outcome::Claimed(claim)) => HAnswer::Claimed {
                claim: claim.clone(),
            },
            Ok(Outcome::Completed(record)) => HAnswer::Completed {
                record: record.clone(),
            },
            Ok(Outcome::Released) => HAnswer::Released,
            Ok(Outcome::Extended {
                lease_expires_at_ms,
            }) => HAnswer::Extended {
                lease_expires_at_ms: *lease_expires_at_ms,
            },
            Ok(Outcome::Marked(mark)) => HAnswer::Marked { mark: mark.clone() },
            Ok(Outcome::Found(record)) => HAnswer::Found {
                record: record.clone(),
            },
            Ok(Outcome::Forgotten(deleted)) => HAnswer::Forgotten { deleted: *deleted },
            Err(GateError::Store(e)) => HAnswer::Unknown {
                why: format!("store error: {e}"),
            },
            Err(e) => HAnswer::Refused {
                code: e.code().to_owned(),
            },
        }
    }

    /// True for an unknown outcome.
    pub fn is_unknown(&self) -> bool {
        matches!(self, HAnswer::Unknown { .. })
    }

    /// Every record this answer shows (for time hints).
    pub fn records(&self) -> Vec<&Record> {
        match self {
            HAnswer::Claimed {
                claim: Claim::Duplicate { record },
            }
            | HAnswer::Completed { record }
            | HAnswer::Marked {
                mark: Mark::New { record } | Mark::Duplicate { record },
            }
            | HAnswer::Found {
                record: Some(record),
            } => vec![record],
            _ => vec![],
        }
    }
}

/// One completed (or abandoned) call in a history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Which client (process or task) called; for reports.
    pub client: String,
    /// The record's namespace.
    pub namespace: String,
    /// The record's key.
    pub key: String,
    /// What was asked.
    pub op: HOp,
    /// Wall-clock ns when the call was sent.
    pub call_ns: u64,
    /// Wall-clock ns when the answer arrived; `None` when none did (then the answer is unknown).
    pub return_ns: Option<u64>,
    /// What the client was told.
    pub answer: HAnswer,
}

impl Event {
    /// The (namespace, key) this event touches, as one string for grouping.
    pub fn key_id(&self) -> (String, String) {
        (self.namespace.clone(), self.key.clone())
    }
}

/// What happens to one recorded call (to make unknown outcomes of both kinds on purpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Sent and answered.
    Deliver,
    /// Sent and decided, but the answer is dropped.
    LoseAnswer,
    /// Never sent.
    NeverSent,
}

/// Records every call made through it into a shared history. Clones share the history.
#[derive(Clone)]
pub struct Recorder {
    store: Arc<dyn Store>,
    events: Arc<Mutex<Vec<Event>>>,
    /// A call that takes longer than this is abandoned and recorded as unknown.
    timeout: Option<Duration>,
    calls_total: Arc<AtomicU64>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("store", &self.store.describe())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Recorder {
    /// A recorder over `store`; `timeout` abandons slow calls (recorded as unknown).
    pub fn new(store: Arc<dyn Store>, timeout: Option<Duration>) -> Self {
        Self {
            store,
            events: Arc::new(Mutex::new(Vec::new())),
            timeout,
            calls_total: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Sends `op` and records it. Invalid namespaces or keys are recorded as refused.
    pub async fn call(&self, client: &str, namespace: &str, key: &str, op: HOp) -> HAnswer {
        self.call_with(client, namespace, key, op, Fate::Deliver)
            .await
    }

    /// Like [`Recorder::call`], but the answer may be lost on the way back (`LoseAnswer`: the
    /// op took effect, the client is told nothing) or the call never sent (`NeverSent`); both
    /// are recorded as unknown, as a timeout would be. The caller gets what it was told.
    pub async fn call_with(
        &self,
        client: &str,
        namespace: &str,
        key: &str,
        op: HOp,
        fate: Fate,
    ) -> HAnswer {
        self.calls_total.fetch_add(1, Ordering::Relaxed);
        let call_ns = wall_ns();
        if fate == Fate::NeverSent {
            let answer = HAnswer::Unknown {
                why: "never sent".into(),
            };
            self.push(Event {
                client: client.to_owned(),
                namespace: namespace.to_owned(),
                key: key.to_owned(),
                op,
                call_ns,
                return_ns: None,
                answer: answer.clone(),
            });
            return answer;
        }
        // The identity is checked first, then the op, as every face does.
        let checked = RecordId::new(namespace, key)
            .and_then(|id| Ok((id, ValidOp::try_from(op.to_wire_op())?)));
        let result = match checked {
            Err(e) => Err(GateError::Invalid(e)),
            Ok((id, wire_op)) => {
                let fut = self.store.apply(id, wire_op);
                match self.timeout {
                    None => fut.await,
                    Some(d) => match tokio::time::timeout(d, fut).await {
                        Ok(r) => r,
                        Err(_) => Err(GateError::Store(StoreError::Unavailable(
                            "client timeout".into(),
                        ))),
                    },
                }
            }
        };
        let mut answer = HAnswer::from_result(&result);
        if fate == Fate::LoseAnswer {
            answer = HAnswer::Unknown {
                why: "answer lost".into(),
            };
        }
        let return_ns = (!answer.is_unknown()).then(wall_ns);
        self.push(Event {
            client: client.to_owned(),
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            op,
            call_ns,
            return_ns,
            answer: answer.clone(),
        });
        answer
    }

    /// Adds an event recorded elsewhere (a call abandoned before it was sent, for instance).
    pub fn push(&self, event: Event) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// The history so far.
    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Calls made so far.
    pub fn calls_total(&self) -> u64 {
        self.calls_total.load(Ordering::Relaxed)
    }
}
