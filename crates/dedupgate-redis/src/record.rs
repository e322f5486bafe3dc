//! A stored record's bytes: the MessagePack array of 11 that `decide.lua` keeps under a record's
//! key, written ([`encode_entry`]) and read ([`decode_record`]) from Rust; and the record and
//! answer of a new claim or mark, taken from [`dedupgate_core::decide`] ([`decide_absent`]).
//!
//! The layout is the script's `enc`: `{state, fence, token, fingerprint, owner, created_at_ms,
//! expires_at_ms, lease_expires_at_ms, completed_at_ms, result_json, ttl_ms}` with `false` for
//! none, state `i`, `c` or `r` (a fence-keeping tombstone). Beside [`dedupgate_core::decide`]'s
//! entry the script keeps two call nonces that no answer shows: a mark's in the token slot and
//! a release's in a tombstone's result slot (see `decide.lua`). A record written before ttl_ms
//! was kept has 10 elements.

use dedupgate_core::{decide, Change, Entry, EntryState, Op, Outcome, Token};

use crate::store::Prepared;

/// MessagePack's `false`: the script's "none".
const FALSE: u8 = 0xc2;

/// Why stored bytes are not a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the stored record cannot be read: {0}")]
pub struct UnreadableRecord(&'static str);

/// [`decide`] on a claim or mark of a key that does not exist, at `now_ms` on Redis's clock: the
/// entry to store, as the script stores it, and the answer. So the rules for a new key are
/// written once in Rust (`decide.lua` restates them): the fast path writes this entry, and a
/// script's short reply (`1`, `2`: "the key did not exist") is answered with this answer. A
/// mark's entry keeps the call's token as the script's nonce, so a resent call knows its own.
/// `None` for other ops, and for a claim without its call token.
pub(crate) fn decide_absent(p: &Prepared, now_ms: u64) -> Option<(Entry, Outcome)> {
    let is_mark = match *p.op {
        Op::Claim { .. } if p.token.is_some() => false,
        Op::Mark { .. } => true,
        _ => return None,
    };
    let decision = decide(&p.id, p.op.clone(), None, now_ms, || {
        p.token
            .clone()
            .expect("a claim's call token, checked above")
    });
    let (Ok(answer), Change::Put(mut entry)) = (decision.answer, decision.change) else {
        return None;
    };
    if is_mark {
        entry.token = p.token.clone();
    }
    Some((entry, answer))
}

/// Writes `entry` to `out` (cleared first) byte for byte as `decide.lua`'s `enc` packs it with
/// Redis's cmsgpack: the shortest integer and string headers, `false` for none.
pub(crate) fn encode_entry(entry: &Entry, out: &mut Vec<u8>) {
    out.clear();
    out.push(0x9b);
    text(
        out,
        match entry.state {
            EntryState::InProgress => b"i",
            EntryState::Completed => b"c",
            EntryState::Released => b"r",
        },
    );
    int(out, entry.fence);
    opt_text(out, entry.token.as_ref().map(Token::as_str));
    opt_text(out, entry.fingerprint.as_deref());
    opt_text(out, entry.owner.as_deref());
    int(out, entry.created_at_ms);
    int(out, entry.expires_at_ms);
    opt_int(out, entry.lease_expires_at_ms);
    opt_int(out, entry.completed_at_ms);
    match &entry.result {
        Some(v) => text(out, v.to_string().as_bytes()),
        None => out.push(FALSE),
    }
    opt_int(out, entry.ttl_ms);
}

fn text(out: &mut Vec<u8>, s: &[u8]) {
    // cmsgpack's string headers: fixstr below 32 bytes, then str8, str16, str32.
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s);
}

fn opt_text(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => text(out, s.as_bytes()),
        None => out.push(FALSE),
    }
}

fn int(out: &mut Vec<u8>, n: u64) {
    // cmsgpack's unsigned integers: the shortest of fixint, uint8/16/32/64.
    if n <= 0x7f {
        out.push(n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[0xcc, n as u8]);
    } else if n <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn opt_int(out: &mut Vec<u8>, n: Option<u64>) {
    match n {
        Some(n) => int(out, n),
        None => out.push(FALSE),
    }
}

/// Reads a record's stored bytes (a `GET` of its key) as the entry [`dedupgate_core::decide`]
/// would hold. The token slot is read as stored (for a mark, the call's nonce); a tombstone's
/// result slot holds a release's nonce, not a result, and reads as none. For tools and tests
/// that look at what the script wrote.
pub fn decode_record(raw: &[u8]) -> Result<Entry, UnreadableRecord> {
    let mut r = Reader { raw, at: 0 };
    let len = match r.byte()? {
        b @ 0x90..=0x9f => usize::from(b & 0x0f),
        _ => return Err(UnreadableRecord("not an array")),
    };
    if len != 10 && len != 11 {
        return Err(UnreadableRecord("not 10 or 11 fields"));
    }
    let state = match r.text()?.ok_or(UnreadableRecord("no state"))? {
        "i" => EntryState::InProgress,
        "c" => EntryState::Completed,
        "r" => EntryState::Released,
        _ => return Err(UnreadableRecord("unknown state")),
    };
    let number = |n: Option<u64>, what| n.ok_or(UnreadableRecord(what));
    let fence = number(r.int()?, "no fence")?;
    let token = r.text()?.map(Token::new);
    let fingerprint = r.text()?.map(str::to_owned);
    let owner = r.text()?.map(str::to_owned);
    let created_at_ms = number(r.int()?, "no creation time")?;
    let expires_at_ms = number(r.int()?, "no expiry")?;
    let lease_expires_at_ms = r.int()?;
    let completed_at_ms = r.int()?;
    let result = match r.text()? {
        Some(_) if state == EntryState::Released => None,
        Some(json) => {
            Some(serde_json::from_str(json).map_err(|_| UnreadableRecord("result not JSON"))?)
        }
        None => None,
    };
    let ttl_ms = if len == 11 { r.int()? } else { None };
    if r.at != raw.len() {
        return Err(UnreadableRecord("bytes after the record"));
    }
    Ok(Entry {
        state,
        fence,
        token,
        fingerprint,
        owner,
        created_at_ms,
        expires_at_ms,
        lease_expires_at_ms,
        completed_at_ms,
        result,
        ttl_ms,
    })
}

/// A cursor over a record's bytes.
struct Reader<'a> {
    raw: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], UnreadableRecord> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.raw.len());
        let end = end.ok_or(UnreadableRecord("cut short"))?;
        let bytes = &self.raw[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, UnreadableRecord> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, UnreadableRecord> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// A string, or `None` for `false`.
    fn text(&mut self) -> Result<Option<&'a str>, UnreadableRecord> {
        let n = match self.byte()? {
            FALSE => return Ok(None),
            b @ 0xa0..=0xbf => usize::from(b & 0x1f),
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => return Err(UnreadableRecord("a text field is not a string")),
        };
        std::str::from_utf8(self.take(n)?)
            .map(Some)
            .map_err(|_| UnreadableRecord("a text field is not UTF-8"))
    }

    /// An unsigned integer, or `None` for `false`. A whole double (how cmsgpack packs a Lua
    /// number it cannot hold as an integer) is read too.
    fn int(&mut self) -> Result<Option<u64>, UnreadableRecord> {
        let n = match self.byte()? {
            FALSE => return Ok(None),
            b @ 0x00..=0x7f => u64::from(b),
            0xcc => self.be(1)?,
            0xcd => self.be(2)?,
            0xce => self.be(4)?,
            0xcf => self.be(8)?,
            0xcb => {
                let f = f64::from_bits(self.be(8)?);
                if f.fract() != 0.0 || !(0.0..=9.007_199_254_740_992e15).contains(&f) {
                    return Err(UnreadableRecord("a number is not a whole non-negative one"));
                }
                f as u64
            }
            _ => return Err(UnreadableRecord("a number field is not a number")),
        };
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: EntryState) -> Entry {
        Entry {
            state,
            fence: 1_764_000_000_000_000,
            token: Some(Token::new("0123456789abcdef0123456789abcdef")),
            fingerprint: Some("f".repeat(40)),
            owner: None,
            created_at_ms: 1_764_000_000_000,
            expires_at_ms: 1_764_000_060_000,
            lease_expires_at_ms: Some(1_764_000_030_000),
            completed_at_ms: None,
            result: None,
            ttl_ms: Some(60_000),
        }
    }

    #[test]
    fn an_encoded_entry_reads_back_as_itself() {
        let claimed = entry(EntryState::InProgress);
        let done = Entry {
            state: EntryState::Completed,
            lease_expires_at_ms: None,
            completed_at_ms: Some(1_764_000_001_000),
            result: Some(serde_json::json!({"id": "x".repeat(300), "n": 7})),
            ttl_ms: None,
            ..claimed.clone()
        };
        let mut out = Vec::new();
        for e in [claimed, done] {
            encode_entry(&e, &mut out);
            assert_eq!(decode_record(&out), Ok(e));
        }
    }

    #[test]
    fn a_tombstones_release_nonce_is_no_result() {
        let mut tomb = entry(EntryState::Released);
        tomb.lease_expires_at_ms = None;
        tomb.ttl_ms = None;
        tomb.result = Some(serde_json::json!("0123456789abcdef0123456789abcdef"));
        let mut out = Vec::new();
        encode_entry(&tomb, &mut out);
        tomb.result = None;
        assert_eq!(decode_record(&out), Ok(tomb));
    }

    #[test]
    fn a_record_of_ten_reads_without_a_ttl_and_garbage_is_refused() {
        let mut out = Vec::new();
        encode_entry(&entry(EntryState::InProgress), &mut out);
        let mut ten = out.clone();
        ten[0] = 0x9a;
        ten.truncate(ten.len() - 3); // 60_000 is a uint16: 3 bytes
        assert_eq!(decode_record(&ten).map(|e| e.ttl_ms), Ok(None));
        assert!(decode_record(&out[..out.len() - 1]).is_err());
        assert!(decode_record(b"\x93abc").is_err());
        assert!(decode_record(b"").is_err());
    }
}
