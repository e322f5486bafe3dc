//! The on-disk encodings of ids, entries and expiry-index keys.
//!
//! An entry is a compact, versioned binary row (not JSON: a claim's path should not pay for a
//! text encoder). Decoding is strict: any byte string that is not exactly what [`encode_entry`]
//! writes — unknown version, unknown state or flag bits, truncation, trailing bytes, invalid
//! UTF-8 or JSON — is an error, never "absent", so corruption is reported instead of turning a
//! duplicate into a new claim.
//!
//! Entry layout, version 1 (integers little-endian):
//!
//! ```text
//! u8  encoding version (= 1)
//! u8  state: 0 in_progress, 1 completed, 2 released
//! u8  flags: bit0 token, bit1 fingerprint, bit2 owner, bit3 lease_expires_at_ms,
//!            bit4 completed_at_ms, bit5 result, bit6 ttl_ms
//! u64 fence, u64 created_at_ms, u64 expires_at_ms
//! [u64 lease_expires_at_ms] [u64 completed_at_ms] [u64 ttl_ms] (when flagged)
//! [u16 len + token] [u16 len + fingerprint] [u16 len + owner] (when flagged, UTF-8)
//! [u32 len + result as JSON text]                           (when flagged)
//! ```
//!
//! An id is `u32 big-endian FNV-1a hash of the rest, u8 namespace length, namespace bytes, key
//! bytes` (a namespace is at most 128 bytes).
//! An expiry-index record maps `u64 big-endian bucket, u64 big-endian sequence` to the ids one
//! commit wrote that expire in that bucket (see [`expiry_key`]), so byte order is time order.

use dedupgate_core::{Entry, EntryState, RecordId, Token};

/// Version of the entry encoding written by this build.
pub const ENTRY_ENCODING_V1: u8 = 1;

const FLAG_TOKEN: u8 = 1 << 0;
const FLAG_FINGERPRINT: u8 = 1 << 1;
const FLAG_OWNER: u8 = 1 << 2;
const FLAG_LEASE: u8 = 1 << 3;
const FLAG_COMPLETED: u8 = 1 << 4;
const FLAG_RESULT: u8 = 1 << 5;
/// Only an in-progress entry carries its claim's ttl (a complete, a release and a forget all
/// drop it), so a build that reads only bits 0-5 still reads every completed or released record.
const FLAG_TTL: u8 = 1 << 6;
const FLAGS_KNOWN: u8 = (1 << 7) - 1;

/// Why stored bytes could not be read as an entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable entry: {0}")]
pub struct DecodeError(pub String);

fn bad(reason: impl Into<String>) -> DecodeError {
    DecodeError(reason.into())
}

/// Appends the id's storage key to `out` (cleared first).
///
/// The key starts with a 32-bit FNV-1a hash of the rest. Ids of one namespace share their first
/// bytes, and the engine's memtable compares keys by a 4-byte inline prefix before it falls back
/// to `memcmp`: with the hash in front almost every comparison ends at the prefix, which made a
/// claim's memtable lookups and inserts about twice as cheap. The hash is part of the format: it
/// must never change without a new [`crate::FORMAT_VERSION`].
pub fn encode_id(id: &RecordId, out: &mut Vec<u8>) {
    let ns = id.namespace.as_str().as_bytes();
    let key = id.key.as_str().as_bytes();
    out.clear();
    out.reserve(ID_HASH_LEN + 1 + ns.len() + key.len());
    out.extend_from_slice(&[0; ID_HASH_LEN]);
    // A namespace is at most 128 bytes, so its length fits one byte.
    out.push(ns.len() as u8);
    out.extend_from_slice(ns);
    out.extend_from_slice(key);
    let hash = fnv1a32(&out[ID_HASH_LEN..]);
    out[..ID_HASH_LEN].copy_from_slice(&hash.to_be_bytes());
}

/// Bytes of hash in front of every id's storage key.
pub const ID_HASH_LEN: usize = 4;

/// 32-bit FNV-1a: tiny, stable across builds and platforms, and enough to spread keys.
fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Expiry-index records hold the ids of one commit whose entries expire in one bucket of this
/// many ms (expiry rounded up), so a batch of claims adds one index record, not one per claim.
pub const EXPIRY_BUCKET_MS: u64 = 1_000;

/// Most ids one expiry-index record holds, so one record is a bounded amount of sweep work.
pub const EXPIRY_RECORD_IDS_MAX: usize = 512;

/// The bucket an entry expiring at `expires_at_ms` is indexed under: the end of its bucket, so
/// every entry in a record has expired once the clock reaches the record's bucket.
pub fn expiry_bucket(expires_at_ms: u64) -> u64 {
    expires_at_ms
        .div_ceil(EXPIRY_BUCKET_MS)
        .saturating_mul(EXPIRY_BUCKET_MS)
}

/// The key of an expiry-index record: `u64 big-endian bucket, u64 big-endian sequence`, so byte
/// order is time order and records of one bucket differ by the writer's sequence number.
pub fn expiry_key(bucket_ms: u64, seq: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&bucket_ms.to_be_bytes());
    k[8..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// The bucket of an expiry-index key.
pub fn split_expiry_key(key: &[u8]) -> Result<u64, DecodeError> {
    let k: &[u8; 16] = key
        .try_into()
        .map_err(|_| bad(format!("expiry key of {} bytes, not 16", key.len())))?;
    let at: [u8; 8] = k[..8].try_into().expect("16 bytes");
    Ok(u64::from_be_bytes(at))
}

/// Appends one id's storage key to an expiry-index record: `u16 little-endian length, bytes`.
pub fn push_expiry_id(record: &mut Vec<u8>, id_bytes: &[u8]) {
    // An id is at most 4 + 1 + 128 + the core's key limit (well under 64 KiB).
    let len = u16::try_from(id_bytes.len()).expect("ids are shorter than 64 KiB");
    record.extend_from_slice(&len.to_le_bytes());
    record.extend_from_slice(id_bytes);
}

/// The ids of an expiry-index record, in order; an error when the record is not exactly a
/// sequence of length-prefixed ids.
pub fn expiry_ids(mut record: &[u8]) -> Result<Vec<&[u8]>, DecodeError> {
    let mut ids = Vec::new();
    while !record.is_empty() {
        if record.len() < 2 {
            return Err(bad("expiry record ends inside a length"));
        }
        let len = usize::from(u16::from_le_bytes([record[0], record[1]]));
        let rest = &record[2..];
        if len == 0 || rest.len() < len {
            return Err(bad("expiry record holds a truncated or empty id"));
        }
        ids.push(&rest[..len]);
        record = &rest[len..];
    }
    Ok(ids)
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    // Tokens, fingerprints and owners are validated to at most 256 bytes by the core.
    let len = u16::try_from(s.len()).expect("tags are at most 256 bytes");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Writes `entry` into `out` (cleared first).
pub fn encode_entry(entry: &Entry, out: &mut Vec<u8>) {
    out.clear();
    let state = match entry.state {
        EntryState::InProgress => 0u8,
        EntryState::Completed => 1,
        EntryState::Released => 2,
    };
    let mut flags = 0u8;
    for (present, bit) in [
        (entry.token.is_some(), FLAG_TOKEN),
        (entry.fingerprint.is_some(), FLAG_FINGERPRINT),
        (entry.owner.is_some(), FLAG_OWNER),
        (entry.lease_expires_at_ms.is_some(), FLAG_LEASE),
        (entry.completed_at_ms.is_some(), FLAG_COMPLETED),
        (entry.result.is_some(), FLAG_RESULT),
        (entry.ttl_ms.is_some(), FLAG_TTL),
    ] {
        if present {
            flags |= bit;
        }
    }
    out.extend_from_slice(&[ENTRY_ENCODING_V1, state, flags]);
    for v in [entry.fence, entry.created_at_ms, entry.expires_at_ms] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for v in [
        entry.lease_expires_at_ms,
        entry.completed_at_ms,
        entry.ttl_ms,
    ]
    .into_iter()
    .flatten()
    {
        out.extend_from_slice(&v.to_le_bytes());
    }
    if let Some(t) = &entry.token {
        put_str16(out, t.as_str());
    }
    if let Some(f) = &entry.fingerprint {
        put_str16(out, f);
    }
    if let Some(o) = &entry.owner {
        put_str16(out, o);
    }
    if let Some(r) = &entry.result {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        serde_json::to_writer(&mut *out, r).expect("a JSON value always serializes");
        let len = u32::try_from(out.len() - at - 4).expect("results are far below 4 GiB");
        out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < n {
            return Err(bad(format!("truncated at {what}")));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn str16(&mut self, what: &str) -> Result<String, DecodeError> {
        let len = u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes"));
        let b = self.take(len as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad(format!("{what} is not UTF-8")))
    }
}

/// Reads an entry written by [`encode_entry`]; anything else is a [`DecodeError`].
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, DecodeError> {
    let mut r = Reader { rest: bytes };
    let version = r.u8("version")?;
    if version != ENTRY_ENCODING_V1 {
        return Err(bad(format!(
            "entry encoding version {version}; this build reads {ENTRY_ENCODING_V1}"
        )));
    }
    let state = match r.u8("state")? {
        0 => EntryState::InProgress,
        1 => EntryState::Completed,
        2 => EntryState::Released,
        other => return Err(bad(format!("unknown state {other}"))),
    };
    let flags = r.u8("flags")?;
    if flags & !FLAGS_KNOWN != 0 {
        return Err(bad(format!("unknown flags {flags:#04x}")));
    }
    let has = |bit: u8| flags & bit != 0;
    let fence = r.u64("fence")?;
    let created_at_ms = r.u64("created_at_ms")?;
    let expires_at_ms = r.u64("expires_at_ms")?;
    let lease_expires_at_ms = if has(FLAG_LEASE) {
        Some(r.u64("lease_expires_at_ms")?)
    } else {
        None
    };
    let completed_at_ms = if has(FLAG_COMPLETED) {
        Some(r.u64("completed_at_ms")?)
    } else {
        None
    };
    let ttl_ms = if has(FLAG_TTL) {
        Some(r.u64("ttl_ms")?)
    } else {
        None
    };
    let token = if has(FLAG_TOKEN) {
        Some(Token::new(r.str16("token")?))
    } else {
        None
    };
    let fingerprint = if has(FLAG_FINGERPRINT) {
        Some(r.str16("fingerprint")?)
    } else {
        None
    };
    let owner = if has(FLAG_OWNER) {
        Some(r.str16("owner")?)
    } else {
        None
    };
    let result = if has(FLAG_RESULT) {
        let len = u32::from_le_bytes(r.take(4, "result length")?.try_into().expect("4 bytes"));
        let text = r.take(len as usize, "result")?;
        Some(serde_json::from_slice(text).map_err(|e| bad(format!("result is not JSON: {e}")))?)
    } else {
        None
    };
    if !r.rest.is_empty() {
        return Err(bad(format!("{} trailing bytes", r.rest.len())));
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    fn full() -> Entry {
        Entry {
            state: EntryState::Completed,
            fence: u64::MAX - 3,
            token: Some(Token::new("t0ken")),
            fingerprint: Some("fp".into()),
            owner: Some("wörker-7".into()),
            created_at_ms: 1,
            expires_at_ms: 2,
            lease_expires_at_ms: Some(3),
            completed_at_ms: Some(4),
            ttl_ms: Some(5),
            result: Some(
                json!({"a": [1, 2.5, "x", null, true], "big": 123456789012345678901234567890u128}),
            ),
        }
    }

    fn bare() -> Entry {
        Entry {
            state: EntryState::Released,
            fence: 9,
            token: None,
            fingerprint: None,
            owner: None,
            created_at_ms: 5,
            expires_at_ms: 6,
            lease_expires_at_ms: None,
            completed_at_ms: None,
            result: None,
            ttl_ms: None,
        }
    }

    #[test]
    fn entries_round_trip() {
        let mut buf = Vec::new();
        for e in [full(), bare()] {
            encode_entry(&e, &mut buf);
            assert_eq!(decode_entry(&buf).unwrap(), e);
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let mut buf = Vec::new();
        encode_entry(&full(), &mut buf);
        for n in 0..buf.len() {
            assert!(
                decode_entry(&buf[..n]).is_err(),
                "prefix of {n} bytes decoded"
            );
        }
        buf.push(0);
        assert!(decode_entry(&buf).is_err());
    }

    #[test]
    fn random_bytes_never_panic_and_mutations_never_decode_to_a_different_valid_version() {
        let seed: u64 = rand::thread_rng().gen();
        eprintln!("codec fuzz seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut good = Vec::new();
        encode_entry(&full(), &mut good);
        for _ in 0..20_000 {
            let len = rng.gen_range(0..64);
            let junk: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let _ = decode_entry(&junk);
            let mut m = good.clone();
            let i = rng.gen_range(0..m.len());
            m[i] = rng.gen();
            // A flipped byte may still decode (e.g. inside a number), but never panics.
            let _ = decode_entry(&m);
        }
        let mut unknown_version = good.clone();
        unknown_version[0] = 2;
        assert!(decode_entry(&unknown_version).is_err());
        let mut unknown_flag = good.clone();
        unknown_flag[2] |= 0x80;
        assert!(decode_entry(&unknown_flag).is_err());
    }

    #[test]
    fn expiry_keys_sort_by_time_and_records_round_trip() {
        let (a, b) = (expiry_key(255_000, u64::MAX), expiry_key(256_000, 0));
        assert!(a < b);
        assert_eq!(split_expiry_key(&b).unwrap(), 256_000);
        assert!(split_expiry_key(b"short").is_err());
        assert_eq!(expiry_bucket(1), 1_000);
        assert_eq!(expiry_bucket(1_000), 1_000);
        assert_eq!(expiry_bucket(1_001), 2_000);
        let mut record = Vec::new();
        push_expiry_id(&mut record, b"\x01\x02\x03\x04\x01nkey");
        push_expiry_id(&mut record, b"x");
        assert_eq!(
            expiry_ids(&record).unwrap(),
            vec![&b"\x01\x02\x03\x04\x01nkey"[..], &b"x"[..]]
        );
        for cut in 1..record.len() {
            if cut != 11 {
                assert!(expiry_ids(&record[..cut]).is_err(), "cut at {cut}");
            }
        }
        assert!(expiry_ids(&[0, 0]).is_err());
    }
}
