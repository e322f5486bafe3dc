//! How a request becomes a record: the `Idempotency-Key` header is read and checked, the key is
//! scoped to the caller, method and path, and the request is fingerprinted.
//!
//! Every hash input is length-prefixed, so no two different tuples hash the same bytes.

use http::{HeaderMap, Method};
use sha2::{Digest, Sha256};

use crate::config::IDEMPOTENCY_KEY_CHARS_MAX;
use crate::headers::IDEMPOTENCY_KEY;

/// Why an `Idempotency-Key` header was refused (each answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// More than one header line.
    #[error("more than one Idempotency-Key header")]
    Repeated,
    /// Empty after trimming and unquoting.
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// Longer than [`IDEMPOTENCY_KEY_CHARS_MAX`] characters.
    #[error("the Idempotency-Key is {0} characters long; at most 255 are accepted")]
    TooLong(usize),
    /// Not UTF-8, or a quoted string with a bad escape.
    #[error("the Idempotency-Key is not valid text")]
    Malformed,
}

/// Reads the key. Accepts a bare token (Stripe's practice) or a structured-field string
/// (`"…"`, the IETF draft's form); both spell the same key.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let text = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyError::Malformed)?;
    let text = text.trim();
    let key = if text.len() >= 2 && text.starts_with('"') && text.ends_with('"') {
        unquote(&text[1..text.len() - 1])?
    } else {
        text.to_owned()
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    let chars = key.chars().count();
    if chars > IDEMPOTENCY_KEY_CHARS_MAX {
        return Err(KeyError::TooLong(chars));
    }
    Ok(Some(key))
}

fn unquote(inner: &str) -> Result<String, KeyError> {
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(KeyError::Malformed),
            },
            '"' => return Err(KeyError::Malformed),
            c => out.push(c),
        }
    }
    Ok(out)
}

fn feed(h: &mut Sha256, part: &[u8]) {
    h.update((part.len() as u64).to_be_bytes());
    h.update(part);
}

/// The caller's scope: SHA-256 of the scope header's value, or of nothing for anonymous callers.
pub fn caller_scope(scope_value: Option<&[u8]>) -> [u8; 32] {
    let mut h = Sha256::new();
    match scope_value {
        Some(v) => {
            h.update([1u8]);
            feed(&mut h, v);
        }
        None => h.update([0u8]),
    }
    h.finalize().into()
}

/// The record key: hex SHA-256 of (scope, method, path, key). Hashing keeps the caller's secret
/// (their `Authorization`) out of the store and bounds the key at 64 bytes.
pub fn record_key(scope: &[u8; 32], method: &Method, path: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"dedupgate-proxy/key/v1");
    feed(&mut h, scope);
    feed(&mut h, method.as_str().as_bytes());
    feed(&mut h, path.as_bytes());
    feed(&mut h, key.as_bytes());
    hex::encode(h.finalize())
}

/// The fingerprint: hex SHA-256 of method, path (with query) and body.
pub fn fingerprint(method: &Method, path_and_query: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"dedupgate-proxy/fingerprint/v1");
    feed(&mut h, method.as_str().as_bytes());
    feed(&mut h, path_and_query.as_bytes());
    feed(&mut h, body);
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key_of(values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(v).unwrap());
        }
        idempotency_key(&h)
    }

    #[test]
    fn reads_keys() {
        assert_eq!(key_of(&[]), Ok(None));
        assert_eq!(key_of(&[b"abc"]), Ok(Some("abc".into())));
        assert_eq!(key_of(&[b"\"abc\""]), Ok(Some("abc".into())));
        assert_eq!(key_of(&[b"\"a\\\"b\""]), Ok(Some("a\"b".into())));
        assert_eq!(key_of(&[b"\"a\\nb\""]), Err(KeyError::Malformed));
        assert_eq!(key_of(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(key_of(&[b"a", b"b"]), Err(KeyError::Repeated));
        assert_eq!(key_of(&[b"\xff"]), Err(KeyError::Malformed));
        assert_eq!(
            key_of(&["k".repeat(255).as_bytes()])
                .unwrap()
                .unwrap()
                .len(),
            255
        );
        assert_eq!(
            key_of(&["k".repeat(256).as_bytes()]),
            Err(KeyError::TooLong(256))
        );
    }

    #[test]
    fn keys_are_scoped() {
        let a = caller_scope(Some(b"Bearer a"));
        let b = caller_scope(Some(b"Bearer b"));
        let anon = caller_scope(None);
        let k = |s, m: Method, p| record_key(s, &m, p, "k1");
        assert_ne!(k(&a, Method::POST, "/x"), k(&b, Method::POST, "/x"));
        assert_ne!(k(&a, Method::POST, "/x"), k(&anon, Method::POST, "/x"));
        assert_ne!(k(&a, Method::POST, "/x"), k(&a, Method::PATCH, "/x"));
        assert_ne!(k(&a, Method::POST, "/x"), k(&a, Method::POST, "/y"));
        assert_eq!(k(&a, Method::POST, "/x"), k(&a, Method::POST, "/x"));
        assert_eq!(k(&a, Method::POST, "/x").len(), 64);
        assert_ne!(caller_scope(Some(b"")), anon);
        assert_ne!(
            fingerprint(&Method::POST, "/x", b"1"),
            fingerprint(&Method::POST, "/x", b"2")
        );
        assert_ne!(
            fingerprint(&Method::POST, "/x1", b""),
            fingerprint(&Method::POST, "/x", b"1")
        );
    }
}
