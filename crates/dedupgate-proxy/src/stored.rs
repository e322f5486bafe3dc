//! The stored form of a response: what `complete` saves as the record's result and what a
//! replay is rebuilt from. Plain form:
//! `{"v":1,"status":201,"headers":[["content-type","application/json"]],"body":"<base64>"}`;
//! sealed form: `{"v":1,"sealed":"A256GCM","nonce":"…","ct":"…"}` whose plaintext is the plain form.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::IdempotencyConfig;
use crate::error::StoredError;
use crate::headers::{is_hop_by_hop, IDEMPOTENT_REPLAYED};
use crate::seal::{Sealer, ALGORITHM};

/// Format version written into every stored response.
const VERSION: u64 = 1;

/// RFC 2965's cookie header (obsoleted by RFC 6265, still sent by old servers): it carries
/// session secrets as `set-cookie` does, so it is dropped unless allowed, as `set-cookie` is.
const SET_COOKIE2: &str = "set-cookie2";

/// A final response as kept for replay: status, the storable headers in order, and the body.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    /// Status code.
    pub status: StatusCode,
    /// Headers minus hop-by-hop, `content-length` (recomputed on replay), `set-cookie` (and
    /// the obsolete `set-cookie2`) and the configured deny list (unless allowed).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, exactly as the upstream sent it (after transfer decoding).
    pub body: Bytes,
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum StoredValue {
    Text(String),
    Bytes { b64: String },
}

#[derive(Serialize, Deserialize)]
struct Plain {
    v: u64,
    status: u16,
    headers: Vec<(String, StoredValue)>,
    body: String,
}

#[derive(Serialize, Deserialize)]
struct Sealed {
    v: u64,
    sealed: String,
    nonce: String,
    ct: String,
}

impl StoredResponse {
    /// Keeps what may be stored of an upstream response under `config`.
    pub fn new(
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
        config: &IdempotencyConfig,
    ) -> Self {
        let connection_named: Vec<String> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .collect();
        let headers = headers
            .iter()
            .filter(|(n, _)| {
                let allowed = config.allow_headers.contains(*n);
                let denied = *n == header::SET_COOKIE
                    || n.as_str() == SET_COOKIE2
                    || config.deny_headers.contains(*n);
                !is_hop_by_hop(n)
                    && *n != header::CONTENT_LENGTH
                    && *n != IDEMPOTENT_REPLAYED
                    && !connection_named.iter().any(|c| c == n.as_str())
                    && (allowed || !denied)
            })
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        Self {
            status,
            headers,
            body,
        }
    }

    /// The record result to store. `aad` binds a sealed form to its record.
    pub fn to_result(&self, sealer: Option<&Sealer>, aad: &[u8]) -> Value {
        let plain = Plain {
            v: VERSION,
            status: self.status.as_u16(),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| {
                    let value = match v.to_str() {
                        Ok(s) => StoredValue::Text(s.to_owned()),
                        Err(_) => StoredValue::Bytes {
                            b64: B64.encode(v.as_bytes()),
                        },
                    };
                    (n.as_str().to_owned(), value)
                })
                .collect(),
            body: B64.encode(&self.body),
        };
        match sealer {
            None => serde_json::to_value(plain).expect("a stored response always serializes"),
            Some(s) => {
                let text = serde_json::to_vec(&plain).expect("a stored response always serializes");
                let (nonce, ct) = s.seal(&text, aad);
                serde_json::to_value(Sealed {
                    v: VERSION,
                    sealed: ALGORITHM.to_owned(),
                    nonce,
                    ct,
                })
                .expect("a sealed response always serializes")
            }
        }
    }

    /// Reads a record result back. A sealed result needs the sealer that made it.
    pub fn from_result(
        value: &Value,
        sealer: Option<&Sealer>,
        aad: &[u8],
    ) -> Result<Self, StoredError> {
        let plain: Plain = if value.get("sealed").is_some() {
            let sealed =
                Sealed::deserialize(value).map_err(|e| StoredError::Malformed(e.to_string()))?;
            if sealed.sealed != ALGORITHM {
                return Err(StoredError::Sealed(format!(
                    "unknown algorithm {:?}",
                    sealed.sealed
                )));
            }
            let sealer = sealer.ok_or_else(|| {
                StoredError::Sealed("the response is encrypted and no key is configured".into())
            })?;
            let text = sealer.open(&sealed.nonce, &sealed.ct, aad)?;
            serde_json::from_slice(&text).map_err(|e| StoredError::Malformed(e.to_string()))?
        } else {
            // Deserialized from the borrowed value: a replay copies the stored response once.
            Plain::deserialize(value).map_err(|e| StoredError::Malformed(e.to_string()))?
        };
        if plain.v != VERSION {
            return Err(StoredError::Malformed(format!(
                "unknown format version {}",
                plain.v
            )));
        }
        let status = StatusCode::from_u16(plain.status)
            .map_err(|_| StoredError::Malformed(format!("bad status {}", plain.status)))?;
        let headers = plain
            .headers
            .into_iter()
            .map(|(n, v)| {
                let name = HeaderName::from_bytes(n.as_bytes())
                    .map_err(|_| StoredError::Malformed(format!("bad header name {n:?}")))?;
                let value = match v {
                    StoredValue::Text(s) => HeaderValue::from_str(&s),
                    StoredValue::Bytes { b64 } => HeaderValue::from_bytes(
                        &B64.decode(b64)
                            .map_err(|e| StoredError::Malformed(e.to_string()))?,
                    ),
                }
                .map_err(|_| StoredError::Malformed(format!("bad value of header {n:?}")))?;
                Ok((name, value))
            })
            .collect::<Result<_, StoredError>>()?;
        let body = B64
            .decode(plain.body)
            .map_err(|e| StoredError::Malformed(format!("body: {e}")))?;
        Ok(Self {
            status,
            headers,
            body: Bytes::from(body),
        })
    }

    /// The response to send; `replayed` adds `Idempotent-Replayed: true`.
    pub fn to_response<B: From<Bytes>>(&self, replayed: bool) -> Response<B> {
        let mut res = Response::new(B::from(self.body.clone()));
        *res.status_mut() = self.status;
        let h = res.headers_mut();
        for (n, v) in &self.headers {
            h.append(n.clone(), v.clone());
        }
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(self.body.len()));
        if replayed {
            h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(config: &IdempotencyConfig) -> StoredResponse {
        let mut h = HeaderMap::new();
        h.append("content-type", HeaderValue::from_static("application/json"));
        h.append("set-cookie", HeaderValue::from_static("session=secret"));
        h.append(
            "set-cookie2",
            HeaderValue::from_static("old=secret; Version=1"),
        );
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.append("x-bin", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
        h.append("connection", HeaderValue::from_static("x-conn"));
        h.append("x-conn", HeaderValue::from_static("gone"));
        h.append("transfer-encoding", HeaderValue::from_static("chunked"));
        h.append("content-length", HeaderValue::from_static("3"));
        StoredResponse::new(
            StatusCode::CREATED,
            &h,
            Bytes::from_static(b"\x00\x01{"),
            config,
        )
    }

    #[test]
    fn filters_and_round_trips() {
        let config = IdempotencyConfig::default();
        let s = sample(&config);
        let names: Vec<&str> = s.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "x-a", "x-a", "x-bin"]);
        let v = s.to_result(None, b"aad");
        assert_eq!(StoredResponse::from_result(&v, None, b"aad").unwrap(), s);

        let sealer = Sealer::new(&[7; 32]);
        let sealed = s.to_result(Some(&sealer), b"aad");
        assert!(!sealed.to_string().contains("application/json"));
        assert_eq!(
            StoredResponse::from_result(&sealed, Some(&sealer), b"aad").unwrap(),
            s
        );
        assert!(StoredResponse::from_result(&sealed, None, b"aad").is_err());
        assert!(StoredResponse::from_result(&sealed, Some(&sealer), b"other").is_err());
        assert!(StoredResponse::from_result(&serde_json::json!({"v": 1}), None, b"").is_err());
    }

    #[test]
    fn allow_list_keeps_set_cookie_and_deny_list_drops() {
        let mut config = IdempotencyConfig::default();
        config.allow_headers.insert(header::SET_COOKIE);
        config.deny_headers.insert(HeaderName::from_static("x-a"));
        let s = sample(&config);
        let names: Vec<&str> = s.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "set-cookie", "x-bin"]);
    }
}
