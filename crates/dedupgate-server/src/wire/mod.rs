//! Translation between API.md's JSON and the core's operations and outcomes; nothing is decided
//! here. This module names the operations ([`OpKind`]) and holds the last step every request
//! shares: its identity and its [`dedupgate_core::ValidOp`] made by the core ([`record_id`],
//! `valid_op`), so a single-op body and a batch item are checked alike.
//!
//! Policy for request bodies: unknown fields are ignored (so newer clients can talk to older
//! servers); a known field of the wrong type, malformed JSON, a missing required field or an
//! out-of-range value is 400 `invalid_request`; a `result` larger than the configured limit is
//! 413 `payload_too_large`. Every check happens before the store is called, so a refused request
//! never changes anything.
//!
//! - `fields`: one field typed from its JSON text (durations, strings), with API.md's words.
//! - `body`: the body of a single-op route.
//! - `batch`: a batch body and its items.
//! - `query`: the query string of `GET`/`DELETE /v1/record`.
//! - `answer`: success bodies written from an outcome.

mod answer;
mod batch;
mod body;
mod fields;
mod query;

use dedupgate_core::{Defaults, Op, RecordId, Request, ValidOp};

use crate::config::Limits;
use crate::problem::Problem;

pub use answer::write_outcome;
pub use batch::{parse_batch, parse_batch_item, parse_item, BatchItem};
pub use body::parse_body;
pub use query::{record_query, RecordReq};

/// The operations of API.md, as routes and as batch `op` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// `POST /v1/claim`, `"op":"claim"`.
    Claim,
    /// `POST /v1/complete`.
    Complete,
    /// `POST /v1/release`.
    Release,
    /// `POST /v1/extend`.
    Extend,
    /// `POST /v1/mark`.
    Mark,
    /// `GET /v1/record`.
    Get,
    /// `DELETE /v1/record` (admin).
    Forget,
}

impl OpKind {
    /// The batch `op` name and metrics label.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Claim => "claim",
            OpKind::Complete => "complete",
            OpKind::Release => "release",
            OpKind::Extend => "extend",
            OpKind::Mark => "mark",
            OpKind::Get => "get",
            OpKind::Forget => "forget",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "claim" => OpKind::Claim,
            "complete" => OpKind::Complete,
            "release" => OpKind::Release,
            "extend" => OpKind::Extend,
            "mark" => OpKind::Mark,
            "get" => OpKind::Get,
            "forget" => OpKind::Forget,
            _ => return None,
        })
    }

    /// True for operations only an admin token may run.
    pub fn admin(self) -> bool {
        self == OpKind::Forget
    }
}

/// A parsed, validated request: ready for the store.
#[derive(Debug)]
pub struct Parsed {
    /// Which operation.
    pub kind: OpKind,
    /// The record it acts on.
    pub id: RecordId,
    /// The operation, defaults applied and checked by the core.
    pub op: ValidOp,
}

/// Validates an identity against the contract and the configured (possibly lower) limits.
pub fn record_id(namespace: String, key: String, limits: &Limits) -> Result<RecordId, Problem> {
    if namespace.len() > limits.namespace_bytes_max {
        return Err(Problem::invalid(format!(
            "namespace: must be at most {} bytes, got {}",
            limits.namespace_bytes_max,
            namespace.len()
        )));
    }
    if key.len() > limits.key_bytes_max {
        return Err(Problem::invalid(format!(
            "key: must be at most {} bytes, got {}",
            limits.key_bytes_max,
            key.len()
        )));
    }
    RecordId::new(namespace, key).map_err(|e| Problem::invalid(e.to_string()))
}

/// The operation `request` asks for, built (defaults applied, fields checked) by the core, then
/// held to the configured result size, so a refused op never reaches the store.
fn valid_op(request: Request, defaults: &Defaults, limits: &Limits) -> Result<ValidOp, Problem> {
    let op =
        ValidOp::from_request(request, *defaults).map_err(|e| Problem::invalid(e.to_string()))?;
    let result = match &*op {
        Op::Complete { result, .. } | Op::Mark { result, .. } => result.as_ref(),
        _ => None,
    };
    if let Some(value) = result {
        let mut counter = ByteCounter(0);
        serde_json::to_writer(&mut counter, value).map_err(fields::json_problem)?;
        if counter.0 > limits.result_bytes_max {
            return Err(Problem::too_large(format!(
                "result: must be at most {} bytes of JSON, got {}",
                limits.result_bytes_max, counter.0
            )));
        }
    }
    Ok(op)
}

struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
