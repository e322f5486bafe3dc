//! RFC 9457 problem responses with API.md's stable `code`s, plus the proxy's own:
//! `request_in_progress` (409), `request_timeout` (408), `bad_gateway` (502),
//! `gateway_timeout` (504) and `stored_response_unreadable` (500).

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

/// A problem JSON response.
pub fn problem<B: From<Bytes>>(
    status: StatusCode,
    code: &str,
    detail: impl std::fmt::Display,
) -> Response<B> {
    let title = status.canonical_reason().unwrap_or("error");
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "code": code,
        "detail": detail.to_string(),
    });
    let bytes = Bytes::from(serde_json::to_vec(&body).expect("a problem always serializes"));
    let mut res = Response::new(B::from(bytes.clone()));
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    res
}
