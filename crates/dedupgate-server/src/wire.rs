//! Translation between API.md's JSON and the core's [`Op`] and [`Outcome`]; nothing is decided here.
//!
//! Policy for request bodies: unknown fields are ignored (so newer clients can talk to older
//! servers); a known field of the wrong type, malformed JSON, a missing required field or an
//! out-of-range value is 400 `invalid_request`; a `result` larger than the configured limit is
//! 413 `payload_too_large`. Every check happens before the store is called, so a refused request
//! never changes anything.

use dedupgate_core::{Defaults, Op, Outcome, RecordId, Token};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::config::Limits;
use crate::problem::Problem;

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

#[derive(Deserialize)]
struct ClaimReq {
    namespace: String,
    key: String,
    ttl_ms: Option<u64>,
    lease_ms: Option<u64>,
    fingerprint: Option<String>,
    owner: Option<String>,
}

#[derive(Deserialize)]
struct CompleteReq {
    namespace: String,
    key: String,
    token: String,
    result: Option<Value>,
    ttl_ms: Option<u64>,
}

#[derive(Deserialize)]
struct ReleaseReq {
    namespace: String,
    key: String,
    token: String,
}

#[derive(Deserialize)]
struct ExtendReq {
    namespace: String,
    key: String,
    token: String,
    lease_ms: u64,
}

#[derive(Deserialize)]
struct MarkReq {
    namespace: String,
    key: String,
    ttl_ms: Option<u64>,
    fingerprint: Option<String>,
    result: Option<Value>,
}

/// The identity fields of `GET`/`DELETE /v1/record` (query string) and of batch get/forget.
#[derive(Deserialize)]
pub struct RecordReq {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
}

/// A parsed, validated request: ready for the store.
#[derive(Debug)]
pub struct Parsed {
    /// Which operation.
    pub kind: OpKind,
    /// The record it acts on.
    pub id: RecordId,
    /// The operation, defaults applied.
    pub op: Op,
}

fn json_problem(e: serde_json::Error) -> Problem {
    Problem::invalid(format!("malformed request: {e}"))
}

/// Parses the body of a single-op route.
pub fn parse_body(
    kind: OpKind,
    body: &[u8],
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = parse_from(kind, &mut de, defaults, limits)?;
    de.end().map_err(json_problem)?;
    Ok(parsed)
}

/// Parses one item of a batch: `{"op": NAME, …fields of NAME}`. Items stay raw text until here
/// (no `Value` tree), so a 10,000-op batch is parsed in one pass per item plus a scan for `op`.
pub fn parse_item(
    item: &RawValue,
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    #[derive(Deserialize)]
    struct Tag {
        op: Option<Value>,
    }
    let tag: Tag = serde_json::from_str(item.get())
        .map_err(|_| Problem::invalid("a batch op must be a JSON object with an `op` field"))?;
    let kind = match tag.op {
        Some(Value::String(name)) => OpKind::from_name(&name).ok_or_else(|| {
            Problem::invalid(format!(
                "unknown op {name:?}: use claim, complete, release, extend, mark, get or forget"
            ))
        })?,
        Some(_) => return Err(Problem::invalid("op must be a string")),
        None => return Err(Problem::invalid("missing field `op`")),
    };
    let mut de = serde_json::Deserializer::from_str(item.get());
    parse_from(kind, &mut de, defaults, limits)
}

fn parse_from<'de, D>(
    kind: OpKind,
    de: D,
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem>
where
    D: serde::Deserializer<'de, Error = serde_json::Error>,
{
    let (namespace, key, op) = match kind {
        OpKind::Claim => {
            let r = ClaimReq::deserialize(de).map_err(json_problem)?;
            let op = Op::Claim {
                ttl_ms: r.ttl_ms.unwrap_or(defaults.ttl_ms),
                lease_ms: r.lease_ms.unwrap_or(defaults.lease_ms),
                fingerprint: r.fingerprint,
                owner: r.owner,
            };
            (r.namespace, r.key, op)
        }
        OpKind::Complete => {
            let r = CompleteReq::deserialize(de).map_err(json_problem)?;
            let op = Op::Complete {
                token: Token::new(r.token),
                result: r.result,
                ttl_ms: r.ttl_ms,
            };
            (r.namespace, r.key, op)
        }
        OpKind::Release => {
            let r = ReleaseReq::deserialize(de).map_err(json_problem)?;
            let op = Op::Release {
                token: Token::new(r.token),
            };
            (r.namespace, r.key, op)
        }
        OpKind::Extend => {
            let r = ExtendReq::deserialize(de).map_err(json_problem)?;
            let op = Op::Extend {
                token: Token::new(r.token),
                lease_ms: r.lease_ms,
            };
            (r.namespace, r.key, op)
        }
        OpKind::Mark => {
            let r = MarkReq::deserialize(de).map_err(json_problem)?;
            let op = Op::Mark {
                ttl_ms: r.ttl_ms.unwrap_or(defaults.ttl_ms),
                fingerprint: r.fingerprint,
                result: r.result,
            };
            (r.namespace, r.key, op)
        }
        OpKind::Get | OpKind::Forget => {
            let r = RecordReq::deserialize(de).map_err(json_problem)?;
            let op = if kind == OpKind::Get {
                Op::Get
            } else {
                Op::Forget
            };
            (r.namespace, r.key, op)
        }
    };
    let id = record_id(namespace, key, limits)?;
    check_op(&op, limits)?;
    Ok(Parsed { kind, id, op })
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

fn check_op(op: &Op, limits: &Limits) -> Result<(), Problem> {
    // The core's own checks (durations, tags, token), so a refused op never reaches the store.
    op.validate().map_err(|e| Problem::invalid(e.to_string()))?;
    let result = match op {
        Op::Complete { result, .. } | Op::Mark { result, .. } => result.as_ref(),
        _ => None,
    };
    if let Some(value) = result {
        let mut counter = ByteCounter(0);
        serde_json::to_writer(&mut counter, value).map_err(json_problem)?;
        if counter.0 > limits.result_bytes_max {
            return Err(Problem::too_large(format!(
                "result: must be at most {} bytes of JSON, got {}",
                limits.result_bytes_max, counter.0
            )));
        }
    }
    Ok(())
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

/// Writes an outcome's success body (API.md's table) to `out`. `Found(None)` is 404 `not_found`.
pub fn write_outcome(out: &mut Vec<u8>, outcome: &Outcome) -> Result<(), Problem> {
    use serde_json::to_writer;
    let written = match outcome {
        Outcome::Claimed(claim) => to_writer(&mut *out, claim),
        Outcome::Completed(record) => {
            out.extend_from_slice(b"{\"record\":");
            to_writer(&mut *out, record).map(|()| out.push(b'}'))
        }
        Outcome::Released => {
            out.extend_from_slice(b"{\"released\":true}");
            Ok(())
        }
        Outcome::Extended {
            lease_expires_at_ms,
        } => {
            out.extend_from_slice(
                format!("{{\"lease_expires_at_ms\":{lease_expires_at_ms}}}").as_bytes(),
            );
            Ok(())
        }
        Outcome::Marked(mark) => to_writer(&mut *out, mark),
        Outcome::Found(Some(record)) => to_writer(&mut *out, record),
        Outcome::Found(None) => return Err(Problem::not_found("no live record for this key")),
        Outcome::Forgotten(deleted) => {
            out.extend_from_slice(format!("{{\"deleted\":{deleted}}}").as_bytes());
            Ok(())
        }
    };
    written.map_err(|e| Problem::unavailable(format!("could not render the answer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kind: OpKind, body: &str) -> Result<Parsed, Problem> {
        parse_body(
            kind,
            body.as_bytes(),
            &Defaults::default(),
            &Limits::default(),
        )
    }

    #[test]
    fn claim_defaults_and_unknown_fields() {
        let p = parse(
            OpKind::Claim,
            r#"{"namespace":"n","key":"k","extra":[1,2]}"#,
        )
        .unwrap();
        assert_eq!(
            p.op,
            Op::Claim {
                ttl_ms: Defaults::default().ttl_ms,
                lease_ms: Defaults::default().lease_ms,
                fingerprint: None,
                owner: None
            }
        );
    }

    #[test]
    fn bad_bodies_are_400() {
        for body in [
            "",
            "{",
            "[]",
            r#"{"namespace":"n"}"#,
            r#"{"namespace":"n","key":""}"#,
            r#"{"namespace":"n n","key":"k"}"#,
            r#"{"namespace":"n","key":5}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":0}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":-1}"#,
            r#"{"namespace":"n","key":"k","lease_ms":1.5}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":"5"}"#,
            r#"{"namespace":"n","key":"k"} trailing"#,
        ] {
            let p = parse(OpKind::Claim, body).unwrap_err();
            assert_eq!((p.status, p.code), (400, "invalid_request"), "{body}");
        }
    }

    #[test]
    fn big_results_are_413() {
        let big = "x".repeat(Limits::default().result_bytes_max);
        let body = format!(r#"{{"namespace":"n","key":"k","result":"{big}"}}"#);
        assert_eq!(parse(OpKind::Mark, &body).unwrap_err().status, 413);
    }

    #[test]
    fn batch_items() {
        let d = Defaults::default();
        let l = Limits::default();
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let ok = serde_json::json!({"op":"release","namespace":"n","key":"k","token":"t"});
        assert_eq!(parse_item(&raw(ok), &d, &l).unwrap().kind, OpKind::Release);
        for bad in [
            serde_json::json!({"op":"explode","namespace":"n","key":"k"}),
            serde_json::json!({"namespace":"n","key":"k"}),
            serde_json::json!(7),
            serde_json::json!({"op":"extend","namespace":"n","key":"k","token":"t"}),
        ] {
            assert_eq!(parse_item(&raw(bad), &d, &l).unwrap_err().status, 400);
        }
    }
}
