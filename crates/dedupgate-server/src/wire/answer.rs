//! Success bodies (API.md's table) written from an outcome, the common claim answer by hand.

use dedupgate_core::{Claim, Lease, Outcome};

use crate::problem::Problem;

/// Writes an outcome's success body (API.md's table) to `out`. `Found(None)` is 404 `not_found`.
pub fn write_outcome(out: &mut Vec<u8>, outcome: &Outcome) -> Result<(), Problem> {
    use serde_json::to_writer;
    let written = match outcome {
        Outcome::Claimed(Claim::New(lease)) => {
            write_new_lease(out, lease);
            Ok(())
        }
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
            out.extend_from_slice(b"{\"lease_expires_at_ms\":");
            write_u64(out, *lease_expires_at_ms);
            out.push(b'}');
            Ok(())
        }
        Outcome::Marked(mark) => to_writer(&mut *out, mark),
        Outcome::Found(Some(record)) => to_writer(&mut *out, record),
        Outcome::Found(None) => return Err(Problem::not_found("no live record for this key")),
        Outcome::Forgotten(deleted) => {
            out.extend_from_slice(if *deleted {
                b"{\"deleted\":true}"
            } else {
                b"{\"deleted\":false}"
            });
            Ok(())
        }
    };
    written.map_err(|e| Problem::unavailable(format!("could not render the answer: {e}")))
}

/// `Claim::New` as serde writes it (`{"outcome":"new","token",…}`), without serde's per-byte
/// escaping: the answer to most claims, so it is written by hand.
fn write_new_lease(out: &mut Vec<u8>, lease: &Lease) {
    out.extend_from_slice(b"{\"outcome\":\"new\",\"token\":");
    write_str(out, lease.token.as_str());
    out.extend_from_slice(b",\"fence\":");
    write_u64(out, lease.fence);
    out.extend_from_slice(b",\"lease_expires_at_ms\":");
    write_u64(out, lease.lease_expires_at_ms);
    out.extend_from_slice(b",\"expires_at_ms\":");
    write_u64(out, lease.expires_at_ms);
    out.push(b'}');
}

/// A JSON string: copied as is when nothing needs escaping (generated tokens are hex), else
/// escaped by serde_json.
fn write_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("writing a str to a Vec never fails");
    }
}

fn write_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::Token;

    #[test]
    fn hand_written_answers_match_serde() {
        for token in [
            "5b012bf606e8fc464c616b292bfa03c5",
            "quote\"back\\slash\u{1}é",
        ] {
            for fence in [0, 7, u64::MAX] {
                let claim = Claim::New(Lease {
                    token: Token::new(token),
                    fence,
                    lease_expires_at_ms: 1_764_000_030_000,
                    expires_at_ms: 10,
                });
                let mut out = Vec::new();
                write_outcome(&mut out, &Outcome::Claimed(claim.clone())).unwrap();
                assert_eq!(out, serde_json::to_vec(&claim).unwrap());
            }
        }
        let mut out = Vec::new();
        write_outcome(
            &mut out,
            &Outcome::Extended {
                lease_expires_at_ms: 123,
            },
        )
        .unwrap();
        write_outcome(&mut out, &Outcome::Forgotten(false)).unwrap();
        assert_eq!(out, br#"{"lease_expires_at_ms":123}{"deleted":false}"#);
    }
}
