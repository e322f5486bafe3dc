//! Arbitrary bytes as a stored entry of the embedded store: they decode to an entry or to an
//! error (never to "absent", never a panic), and a decoded entry encodes and decodes to itself.
#![no_main]

use dedupgate_embedded::codec::{decode_entry, encode_entry, expiry_ids, split_expiry_key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = split_expiry_key(data);
    let _ = expiry_ids(data);
    if let Ok(entry) = decode_entry(data) {
        let mut again = Vec::new();
        encode_entry(&entry, &mut again);
        assert_eq!(decode_entry(&again).ok(), Some(entry));
    }
});
