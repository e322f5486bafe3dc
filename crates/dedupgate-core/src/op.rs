//! Operations a face asks of the gate, and the outcomes it gets back.

use serde::{Deserialize, Serialize};

use crate::error::InvalidInput;
use crate::model::{check_tag, Record, Token};

/// Default record retention (API.md): 24 h.
pub const DEFAULT_TTL_MS: u64 = 24 * 60 * 60 * 1000;
/// Default lease (API.md): 30 s.
pub const DEFAULT_LEASE_MS: u64 = 30 * 1000;
/// Longest ttl or lease accepted: ten years. Bounded so `now + ttl` can never overflow.
pub const DURATION_MS_MAX: u64 = 10 * 365 * 24 * 60 * 60 * 1000;

/// One operation on one record. Durations are resolved (defaults applied) before a store sees it.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Take the key under a lease (retriable ordering), or learn it is a duplicate.
    Claim {
        /// How long the record is kept.
        ttl_ms: u64,
        /// How long the claim is held before another worker may take over.
        lease_ms: u64,
        /// Payload hash; a different non-null one on an existing key is a mismatch.
        fingerprint: Option<String>,
        /// Claimer id; the same owner re-claiming an in_progress key gets its claim back.
        owner: Option<String>,
    },
    /// Finish a claim and store its result.
    Complete {
        /// The holder's token.
        token: Token,
        /// Stored and replayed to duplicates.
        result: Option<serde_json::Value>,
        /// New retention from now; when absent the claim's expiry stands.
        ttl_ms: Option<u64>,
    },
    /// Give the key back so the next claim runs again.
    Release {
        /// The holder's token.
        token: Token,
    },
    /// Renew the lease.
    Extend {
        /// The holder's token.
        token: Token,
        /// New lease from now.
        lease_ms: u64,
    },
    /// Set the key as completed before processing (idempotent ordering).
    Mark {
        /// How long the record is kept.
        ttl_ms: u64,
        /// Payload hash.
        fingerprint: Option<String>,
        /// Stored and replayed to duplicates.
        result: Option<serde_json::Value>,
    },
    /// Read the record.
    Get,
    /// Delete the record (an operator's tool).
    Forget,
}

fn check_duration(field: &'static str, ms: u64) -> Result<(), InvalidInput> {
    if ms == 0 || ms > DURATION_MS_MAX {
        return Err(InvalidInput::new(
            field,
            format!("must be 1..={DURATION_MS_MAX} ms, got {ms}"),
        ));
    }
    Ok(())
}

impl Op {
    /// Checks the fields a store cannot check for itself. Only [`crate::ValidOp`]'s builders
    /// call it: a store takes a `ValidOp`, so a bad request never reaches one.
    pub(crate) fn validate(&self) -> Result<(), InvalidInput> {
        match self {
            Op::Claim {
                ttl_ms,
                lease_ms,
                fingerprint,
                owner,
            } => {
                check_duration("ttl_ms", *ttl_ms)?;
                check_duration("lease_ms", *lease_ms)?;
                check_tag("fingerprint", fingerprint)?;
                check_tag("owner", owner)
            }
            Op::Complete { token, ttl_ms, .. } => {
                check_token(token)?;
                ttl_ms.map_or(Ok(()), |t| check_duration("ttl_ms", t))
            }
            Op::Release { token } => check_token(token),
            Op::Extend { token, lease_ms } => {
                check_token(token)?;
                check_duration("lease_ms", *lease_ms)
            }
            Op::Mark {
                ttl_ms,
                fingerprint,
                ..
            } => {
                check_duration("ttl_ms", *ttl_ms)?;
                check_tag("fingerprint", fingerprint)
            }
            Op::Get | Op::Forget => Ok(()),
        }
    }

    /// True when the operation may change the store (and so must be durable before it is answered).
    pub fn writes(&self) -> bool {
        !matches!(self, Op::Get)
    }

    /// Short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Claim { .. } => "claim",
            Op::Complete { .. } => "complete",
            Op::Release { .. } => "release",
            Op::Extend { .. } => "extend",
            Op::Mark { .. } => "mark",
            Op::Get => "get",
            Op::Forget => "forget",
        }
    }
}

fn check_token(token: &Token) -> Result<(), InvalidInput> {
    if token.as_str().is_empty() || token.as_str().len() > 256 {
        return Err(InvalidInput::new("token", "must be 1..=256 bytes"));
    }
    Ok(())
}

/// The answer to a claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Claim {
    /// The caller holds the key: process, then complete or release.
    New(Lease),
    /// Someone else holds or finished it.
    Duplicate {
        /// The stored record (with its result when completed). Never the token.
        record: Record,
    },
}

/// What the holder of a new claim gets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    /// The holder's secret for complete/release/extend.
    pub token: Token,
    /// Pass downstream so stale workers can be rejected.
    pub fence: u64,
    /// When another worker may take over.
    pub lease_expires_at_ms: u64,
    /// When the record is forgotten.
    pub expires_at_ms: u64,
}

/// The answer to a mark.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Mark {
    /// The key was free and is now completed: the caller may process.
    New {
        /// The new record.
        record: Record,
    },
    /// The key was already claimed or completed: skip.
    Duplicate {
        /// The stored record.
        record: Record,
    },
}

/// What an operation produced when the gate could decide and said yes (duplicates included).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Answer to [`Op::Claim`].
    Claimed(Claim),
    /// Answer to [`Op::Complete`]: the completed record.
    Completed(Record),
    /// Answer to [`Op::Release`].
    Released,
    /// Answer to [`Op::Extend`].
    Extended {
        /// The new lease end.
        lease_expires_at_ms: u64,
    },
    /// Answer to [`Op::Mark`].
    Marked(Mark),
    /// Answer to [`Op::Get`].
    Found(Option<Record>),
    /// Answer to [`Op::Forget`]: whether a live record was deleted.
    Forgotten(bool),
}

impl Outcome {
    /// A stable label for metrics: new, duplicate_completed, duplicate_in_progress, or the op.
    pub fn label(&self) -> &'static str {
        use crate::model::State;
        let dup = |r: &Record| match r.state {
            State::Completed => "duplicate_completed",
            State::InProgress => "duplicate_in_progress",
        };
        match self {
            Outcome::Claimed(Claim::New(_)) | Outcome::Marked(Mark::New { .. }) => "new",
            Outcome::Claimed(Claim::Duplicate { record })
            | Outcome::Marked(Mark::Duplicate { record }) => dup(record),
            Outcome::Completed(_) => "completed",
            Outcome::Released => "released",
            Outcome::Extended { .. } => "extended",
            Outcome::Found(_) => "found",
            Outcome::Forgotten(_) => "forgotten",
        }
    }
}
