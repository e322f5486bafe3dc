//! The body of a single-op route (`POST /v1/claim`, …), read by serde into the fields its op
//! takes and made a request for the core.

use std::marker::PhantomData;

use dedupgate_core::{ClaimOptions, CompleteOptions, Defaults, MarkOptions, Request, Token};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::fields::{duration, json_problem, must_be_object, required_duration};
use super::query::RecordReq;
use super::{record_id, valid_op, OpKind, Parsed};
use crate::config::Limits;
use crate::problem::Problem;

/// The type of each field a body may carry, written once for every route. Durations are kept
/// as raw JSON and read by [`duration`], which takes integral floats and words its own errors;
/// `null` reaches it as `None`, the same as an absent field. The names are [`super::BatchItem`]'s.
macro_rules! field_type {
    (namespace) => { String };
    (key) => { String };
    (token) => { String };
    (ttl_ms) => { Option<&'a RawValue> };
    (lease_ms) => { Option<&'a RawValue> };
    (fingerprint) => { Option<String> };
    (owner) => { Option<String> };
    (result) => { Option<Value> };
}

/// Declares the body of a single-op route by the fields its op takes, in the order serde names
/// a missing one; a field the op does not take is ignored like any unknown field.
macro_rules! body {
    ($name:ident { $($field:ident),+ $(,)? }) => {
        #[derive(Deserialize)]
        #[serde(bound(deserialize = "'de: 'a"))]
        struct $name<'a> {
            $($field: field_type!($field),)+
            #[serde(skip)]
            _raw: PhantomData<&'a RawValue>,
        }
    };
}

body!(ClaimReq {
    namespace,
    key,
    ttl_ms,
    lease_ms,
    fingerprint,
    owner
});
body!(CompleteReq {
    namespace,
    key,
    token,
    result,
    ttl_ms
});
body!(ReleaseReq {
    namespace,
    key,
    token
});
body!(ExtendReq {
    namespace,
    key,
    token,
    lease_ms
});
body!(MarkReq {
    namespace,
    key,
    ttl_ms,
    fingerprint,
    result
});

/// Parses the body of a single-op route.
pub fn parse_body(
    kind: OpKind,
    body: &[u8],
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    must_be_object(body, "{\"namespace\":…,\"key\":…}")?;
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = parse_from(kind, &mut de, defaults, limits)?;
    de.end().map_err(json_problem)?;
    Ok(parsed)
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
    let (namespace, key, request) = match kind {
        OpKind::Claim => {
            let r = ClaimReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Claim(ClaimOptions {
                ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                lease_ms: duration(r.lease_ms.map(RawValue::get), "lease_ms")?,
                fingerprint: r.fingerprint,
                owner: r.owner,
            });
            (r.namespace, r.key, request)
        }
        OpKind::Complete => {
            let r = CompleteReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Complete {
                token: Token::new(r.token),
                opts: CompleteOptions {
                    result: r.result,
                    ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                },
            };
            (r.namespace, r.key, request)
        }
        OpKind::Release => {
            let r = ReleaseReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Release {
                token: Token::new(r.token),
            };
            (r.namespace, r.key, request)
        }
        OpKind::Extend => {
            let r = ExtendReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Extend {
                token: Token::new(r.token),
                lease_ms: required_duration(r.lease_ms.map(RawValue::get), "lease_ms")?,
            };
            (r.namespace, r.key, request)
        }
        OpKind::Mark => {
            let r = MarkReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Mark(MarkOptions {
                ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                fingerprint: r.fingerprint,
                result: r.result,
            });
            (r.namespace, r.key, request)
        }
        OpKind::Get | OpKind::Forget => {
            let r = RecordReq::deserialize(de).map_err(json_problem)?;
            let request = if kind == OpKind::Get {
                Request::Get
            } else {
                Request::Forget
            };
            (r.namespace, r.key, request)
        }
    };
    let id = record_id(namespace, key, limits)?;
    let op = valid_op(request, defaults, limits)?;
    Ok(Parsed { kind, id, op })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::Op;

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
            *p.op,
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
}
