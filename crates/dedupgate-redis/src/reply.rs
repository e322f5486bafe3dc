//! Reading Redis's replies: a script reply into the op's outcome, a record's fields, numbers,
//! text and `TIME`, and an error reply into a store error.

use dedupgate_core::{
    Claim, GateError, Lease, Mark, Op, Outcome, Record, RecordId, State, StoreError, Token,
};
use redis::Value;

use crate::record::decide_absent;
use crate::store::Prepared;

/// A `TIME` reply (seconds and microseconds, as text) in ms.
pub(crate) fn time_ms(v: &Value) -> Option<u64> {
    match v {
        Value::Array(parts) if parts.len() == 2 => {
            Some(number(&parts[0])? * 1000 + number(&parts[1])? / 1000)
        }
        _ => None,
    }
}

pub(crate) fn server_error(e: redis::ServerError) -> StoreError {
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

/// A time or fence: an integer reply (or, from older scripts, its decimal text).
pub(crate) fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Turns one op's script reply into its outcome. `now` is the call's time on Redis's clock (the
/// reply's first item), from which the short answers for a key that did not exist are rebuilt.
pub(crate) fn decode(p: &Prepared, now: Option<u64>, v: Value) -> Result<Outcome, GateError> {
    let (id, op) = (&p.id, p.op.as_op());
    let corrupt =
        |what: &str| GateError::Store(StoreError::Corrupt(format!("script reply: {what}")));
    let items = match v {
        Value::Array(items) => items,
        Value::Int(short) => {
            // The key did not exist: the script decided as `decide` does for a new key.
            let now = now.ok_or_else(|| corrupt("no time"))?;
            let expected = match op {
                Op::Claim { .. } => 1,
                Op::Mark { .. } => 2,
                _ => 0,
            };
            return match decide_absent(p, now) {
                Some((_, answer)) if short == expected => Ok(answer),
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
pub(crate) fn parse_record(id: &RecordId, f: &[Value]) -> Option<Record> {
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
