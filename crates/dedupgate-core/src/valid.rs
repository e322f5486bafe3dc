//! The one way in: a request's options and the [`Defaults`] become a [`ValidOp`], the only form
//! of an operation a [`crate::Store`] or [`crate::decide()`] takes.
//!
//! Every face (the HTTP service, [`crate::Gate`], the CLI, the consumers, the proxy) builds its
//! operations here, so defaults are applied in one place and a request is validated once: a
//! store, and `decide`, never check again, because a [`ValidOp`] that failed a check cannot
//! exist.

use std::ops::Deref;

use crate::error::InvalidInput;
use crate::model::Token;
use crate::op::{Op, DEFAULT_LEASE_MS, DEFAULT_TTL_MS};

/// Durations used when a request does not give its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Defaults {
    /// Record retention.
    pub ttl_ms: u64,
    /// Claim lease.
    pub lease_ms: u64,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            ttl_ms: DEFAULT_TTL_MS,
            lease_ms: DEFAULT_LEASE_MS,
        }
    }
}

/// Options of a claim; `None` takes the default.
#[derive(Clone, Debug, Default)]
pub struct ClaimOptions {
    /// Record retention.
    pub ttl_ms: Option<u64>,
    /// Lease.
    pub lease_ms: Option<u64>,
    /// Payload hash.
    pub fingerprint: Option<String>,
    /// Claimer id (lets a worker whose answer was lost claim again safely).
    pub owner: Option<String>,
}

/// Options of a mark; `None` takes the default.
#[derive(Clone, Debug, Default)]
pub struct MarkOptions {
    /// Record retention.
    pub ttl_ms: Option<u64>,
    /// Payload hash.
    pub fingerprint: Option<String>,
    /// Stored and replayed to duplicates.
    pub result: Option<serde_json::Value>,
}

/// Options of a complete.
#[derive(Clone, Debug, Default)]
pub struct CompleteOptions {
    /// Stored and replayed to duplicates.
    pub result: Option<serde_json::Value>,
    /// New retention from now; when absent the claim's expiry stands (there is no default).
    pub ttl_ms: Option<u64>,
}

/// What a face read from a request, before the core checks it: one variant per operation,
/// holding that operation's options. [`ValidOp::from_request`] turns it into an operation.
#[derive(Clone, Debug)]
pub enum Request {
    /// A claim.
    Claim(ClaimOptions),
    /// A complete by the holder of `token`.
    Complete {
        /// The holder's token.
        token: Token,
        /// Result and ttl.
        opts: CompleteOptions,
    },
    /// A release by the holder of `token`.
    Release {
        /// The holder's token.
        token: Token,
    },
    /// A lease renewal by the holder of `token`.
    Extend {
        /// The holder's token.
        token: Token,
        /// New lease from now.
        lease_ms: u64,
    },
    /// A mark.
    Mark(MarkOptions),
    /// A read.
    Get,
    /// A delete.
    Forget,
}

/// An [`Op`] whose defaults are applied and whose fields passed every check a store cannot make
/// for itself. Named for what it guarantees: the field is private, so the builders below (and
/// [`TryFrom<Op>`]) are the only ways to make one, and each of them validates. It derefs to the
/// [`Op`] it wraps, so reading it costs nothing and it is never copied on the way to a store.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidOp(Op);

impl ValidOp {
    /// The operation `request` asks for, `defaults` filling what it leaves out.
    pub fn from_request(request: Request, defaults: Defaults) -> Result<Self, InvalidInput> {
        match request {
            Request::Claim(opts) => Self::claim(opts, defaults),
            Request::Complete { token, opts } => Self::complete(token, opts),
            Request::Release { token } => Self::release(token),
            Request::Extend { token, lease_ms } => Self::extend(token, lease_ms),
            Request::Mark(opts) => Self::mark(opts, defaults),
            Request::Get => Ok(Self::get()),
            Request::Forget => Ok(Self::forget()),
        }
    }

    /// A claim with `defaults` for the durations `opts` leaves out.
    pub fn claim(opts: ClaimOptions, defaults: Defaults) -> Result<Self, InvalidInput> {
        Self::check(Op::Claim {
            ttl_ms: opts.ttl_ms.unwrap_or(defaults.ttl_ms),
            lease_ms: opts.lease_ms.unwrap_or(defaults.lease_ms),
            fingerprint: opts.fingerprint,
            owner: opts.owner,
        })
    }

    /// A complete by the holder of `token`.
    pub fn complete(token: Token, opts: CompleteOptions) -> Result<Self, InvalidInput> {
        Self::check(Op::Complete {
            token,
            result: opts.result,
            ttl_ms: opts.ttl_ms,
        })
    }

    /// A release by the holder of `token`.
    pub fn release(token: Token) -> Result<Self, InvalidInput> {
        Self::check(Op::Release { token })
    }

    /// A renewal of the lease of `token`'s holder for `lease_ms` from now. The lease is always
    /// named: renewing by a default the holder may not know would be a guess.
    pub fn extend(token: Token, lease_ms: u64) -> Result<Self, InvalidInput> {
        Self::check(Op::Extend { token, lease_ms })
    }

    /// A mark with `defaults` for the ttl `opts` leaves out.
    pub fn mark(opts: MarkOptions, defaults: Defaults) -> Result<Self, InvalidInput> {
        Self::check(Op::Mark {
            ttl_ms: opts.ttl_ms.unwrap_or(defaults.ttl_ms),
            fingerprint: opts.fingerprint,
            result: opts.result,
        })
    }

    /// A read of the record: nothing to check.
    pub fn get() -> Self {
        Self(Op::Get)
    }

    /// A delete of the record: nothing to check.
    pub fn forget() -> Self {
        Self(Op::Forget)
    }

    /// The operation.
    pub fn as_op(&self) -> &Op {
        &self.0
    }

    /// The operation, owned (a store that moves its fields into the record it writes).
    pub fn into_op(self) -> Op {
        self.0
    }

    fn check(op: Op) -> Result<Self, InvalidInput> {
        op.validate()?;
        Ok(Self(op))
    }
}

/// For an operation whose durations are already resolved (a replayed history, a decoded
/// request of a harness): the same checks as the builders.
impl TryFrom<Op> for ValidOp {
    type Error = InvalidInput;

    fn try_from(op: Op) -> Result<Self, InvalidInput> {
        Self::check(op)
    }
}

impl Deref for ValidOp {
    type Target = Op;

    fn deref(&self) -> &Op {
        &self.0
    }
}

impl From<ValidOp> for Op {
    fn from(op: ValidOp) -> Op {
        op.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::DURATION_MS_MAX;

    #[test]
    fn defaults_fill_only_what_the_request_leaves_out() {
        let defaults = Defaults {
            ttl_ms: 7,
            lease_ms: 3,
        };
        let op = ValidOp::claim(
            ClaimOptions {
                lease_ms: Some(5),
                ..Default::default()
            },
            defaults,
        )
        .unwrap();
        assert_eq!(
            *op,
            Op::Claim {
                ttl_ms: 7,
                lease_ms: 5,
                fingerprint: None,
                owner: None
            }
        );
        let op = ValidOp::mark(MarkOptions::default(), defaults).unwrap();
        assert!(matches!(*op, Op::Mark { ttl_ms: 7, .. }));
    }

    /// Moved from `decide`, which no longer checks: an invalid op cannot be built, so it can
    /// neither change a record nor reach a store.
    #[test]
    fn an_invalid_op_cannot_be_built() {
        let op = Op::Claim {
            ttl_ms: 0,
            lease_ms: 1,
            fingerprint: None,
            owner: None,
        };
        assert!(ValidOp::try_from(op).is_err());
        let err = ValidOp::claim(
            ClaimOptions {
                ttl_ms: Some(0),
                lease_ms: Some(0),
                ..Default::default()
            },
            Defaults::default(),
        )
        .unwrap_err();
        assert_eq!(err.field, "ttl_ms", "the first bad field is named");
        let err = ValidOp::claim(
            ClaimOptions {
                lease_ms: Some(DURATION_MS_MAX + 1),
                fingerprint: Some(String::new()),
                ..Default::default()
            },
            Defaults::default(),
        )
        .unwrap_err();
        assert_eq!(err.field, "lease_ms");
        assert!(ValidOp::extend(Token::new(""), 10).is_err());
        assert!(ValidOp::extend(Token::new("t"), 0).is_err());
        assert!(ValidOp::release(Token::new("")).is_err());
        assert!(ValidOp::complete(
            Token::new("t"),
            CompleteOptions {
                ttl_ms: Some(0),
                ..Default::default()
            }
        )
        .is_err());
        assert!(ValidOp::mark(
            MarkOptions {
                fingerprint: Some("f".repeat(1_000)),
                ..Default::default()
            },
            Defaults::default()
        )
        .is_err());
    }
}
