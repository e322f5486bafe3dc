//! Key layout. Each record lives under one Redis key, `PREFIX:{TAG}:r:NAMESPACE\0KEY`
//! (MessagePack), which outlives the record's expiry by `fence_keep_ms` so that its fence is
//! still known after the record expired.
//!
//! `TAG` is 16 lowercase hex digits of SHA-256(namespace, NUL, key). Keys may hold any bytes,
//! braces and NUL included, so they never go inside the braces: the hash tag is always
//! well-formed, and the exact namespace and key follow it (a namespace never holds NUL, so
//! `NAMESPACE\0KEY` is unambiguous).

use dedupgate_core::RecordId;
use sha2::{Digest, Sha256};

/// Slots in a Redis Cluster.
pub const CLUSTER_SLOTS: u16 = 16_384;

/// The key of one record, and its cluster slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordKeys {
    /// The record itself.
    pub record: Vec<u8>,
    /// The cluster slot of the key (CRC16 of the hash tag, mod 16384).
    pub slot: u16,
}

/// Builds the key of `id` under `prefix` (a validated `[A-Za-z0-9._:-]+`).
pub fn record_keys(prefix: &str, id: &RecordId) -> RecordKeys {
    let mut h = Sha256::new();
    h.update(id.namespace.as_str().as_bytes());
    h.update([0u8]);
    h.update(id.key.as_str().as_bytes());
    let mut tag = [0u8; 16];
    hex::encode_to_slice(&h.finalize()[..8], &mut tag).expect("16 digits for 8 bytes");
    let tail_len = id.namespace.as_str().len() + 1 + id.key.as_str().len();
    let mut record = Vec::with_capacity(prefix.len() + tag.len() + 6 + tail_len);
    record.extend_from_slice(prefix.as_bytes());
    record.extend_from_slice(b":{");
    record.extend_from_slice(&tag);
    record.extend_from_slice(b"}:r:");
    record.extend_from_slice(id.namespace.as_str().as_bytes());
    record.push(0);
    record.extend_from_slice(id.key.as_str().as_bytes());
    RecordKeys {
        record,
        slot: crc16_xmodem(&tag) % CLUSTER_SLOTS,
    }
}

/// The slot Redis Cluster gives a key: CRC16 (XMODEM) of its hash tag (or the whole key when it
/// has no well-formed tag), mod 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16_xmodem(tagged.unwrap_or(key)) % CLUSTER_SLOTS
}

/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with.
fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_redis_reference_values() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(
            key_slot(b"foo{}{bar}"),
            crc16_xmodem(b"foo{}{bar}") % CLUSTER_SLOTS
        );
    }

    #[test]
    fn the_key_layout_is_pinned() {
        // Records already stored live under this layout: a change would make them invisible
        // (and their keys duplicates no more). The tag is python3's
        // hashlib.sha256(b"orders\x00evt-1").hexdigest()[:16].
        let k = record_keys("dg", &RecordId::new("orders", "evt-1").unwrap());
        assert_eq!(k.record, b"dg:{6b8bf10c074abd39}:r:orders\0evt-1");
        assert_eq!(k.slot, key_slot(b"6b8bf10c074abd39"));
    }

    #[test]
    fn braces_and_nul_in_keys_never_break_the_tag() {
        for key in ["plain", "{", "}", "{x}", "a\0b", "}{", "🦀 {tag}"] {
            let id = RecordId::new("ns", key).unwrap();
            let k = record_keys("dg", &id);
            assert_eq!(key_slot(&k.record), k.slot, "{key:?}");
            assert!(k.record.ends_with(key.as_bytes()));
        }
        let a = record_keys("dg", &RecordId::new("ns", "a\0b").unwrap());
        let b = record_keys("dg", &RecordId::new("ns", "a\0c").unwrap());
        assert_ne!(a.record, b.record);
    }
}
