//! Deterministic ids, two ways: from a parsed record (`canonical_key`) and straight from the
//! JSON line (`RawObject`). Whenever both answer they must agree, and neither may panic.
#![no_main]

use dedupgate_core::keys::{canonical_key, KeyFields, RawObject};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // "field,field\nJSON line"
    let (fields, line) = text.split_once('\n').unwrap_or(("a,b", text));
    let Ok(fields) = KeyFields::parse(fields) else {
        return;
    };
    let from_value = serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .map(|v| canonical_key(&v, &fields));
    let from_raw = RawObject::parse(line).ok().map(|raw| {
        let mut out = String::new();
        raw.write_canonical_key(&fields, &mut out).map(|()| out)
    });
    if let (Some(Ok(a)), Some(Ok(b))) = (&from_value, &from_raw) {
        assert_eq!(a, b, "the two canonical forms disagree for {line:?}");
    }
});
