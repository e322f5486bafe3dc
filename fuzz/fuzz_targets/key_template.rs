//! Arbitrary templates rendered against arbitrary JSON events: parse and render answer or
//! refuse with an error, never panic; a rendered key is rendered the same way twice.
#![no_main]

use dedupgate_core::keys::KeyTemplate;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // "template\nevent JSON"
    let (template, event) = text.split_once('\n').unwrap_or((text, "{}"));
    let Ok(t) = KeyTemplate::parse(template) else {
        return;
    };
    let Ok(event) = serde_json::from_str::<serde_json::Value>(event) else {
        return;
    };
    let now_ms = 1_764_000_000_000;
    if let Ok(key) = t.render(&event, now_ms) {
        assert_eq!(Ok(key), t.render(&event, now_ms));
    }
});
