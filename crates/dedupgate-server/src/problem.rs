//! RFC 9457 problem JSON with API.md's stable `code`: the one shape of every error answer.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dedupgate_core::{GateError, StoreError};
use serde::Serialize;

/// Seconds a 503 asks the caller to wait before retrying.
pub const RETRY_AFTER_S: u32 = 1;

/// The `type` of the 404 for a path the API does not have. Its code is `not_found` like a
/// missing record's, so this is how a client tells a wrong base URL (every `GET /v1/record`
/// would look like "no record") from a key with no record.
pub const NO_SUCH_ROUTE_TYPE: &str = "urn:dedupgate:problem:no-such-route";

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// `about:blank` (the `code` says what happened), except [`NO_SUCH_ROUTE_TYPE`].
    #[serde(rename = "type")]
    pub type_: &'static str,
    /// Short human summary of the code.
    pub title: &'static str,
    /// The HTTP status.
    pub status: u16,
    /// API.md's stable machine code.
    pub code: &'static str,
    /// What exactly was wrong.
    pub detail: String,
}

impl Problem {
    fn new(
        status: u16,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            type_: "about:blank",
            title,
            status,
            code,
            detail: detail.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(detail: impl Into<String>) -> Self {
        Self::new(400, "invalid_request", "invalid request", detail)
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(401, "unauthorized", "unauthorized", detail)
    }

    /// 403 `forbidden`.
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(403, "forbidden", "forbidden", detail)
    }

    /// 404 `not_found`.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(404, "not_found", "not found", detail)
    }

    /// 404 `not_found` for a path the API does not have (type [`NO_SUCH_ROUTE_TYPE`]).
    pub fn no_such_route(detail: impl Into<String>) -> Self {
        Self {
            type_: NO_SUCH_ROUTE_TYPE,
            ..Self::not_found(detail)
        }
    }

    /// 405 with code `invalid_request` (API.md has no code of its own for a wrong method).
    pub fn method_not_allowed(detail: impl Into<String>) -> Self {
        Self::new(405, "invalid_request", "method not allowed", detail)
    }

    /// 413 `payload_too_large`.
    pub fn too_large(detail: impl Into<String>) -> Self {
        Self::new(413, "payload_too_large", "payload too large", detail)
    }

    /// 503 `unavailable`: nothing was decided, retry after [`RETRY_AFTER_S`].
    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(503, "unavailable", "unavailable", detail)
    }

    /// The problem for a refusal or failure of the core.
    pub fn from_gate(err: &GateError) -> Self {
        let detail = err.to_string();
        match err {
            GateError::Invalid(_) => Self::invalid(detail),
            GateError::LeaseLost => Self::new(409, err.code(), "lease lost", detail),
            GateError::FingerprintMismatch => {
                Self::new(422, err.code(), "fingerprint mismatch", detail)
            }
            GateError::Store(StoreError::Unavailable(_)) => Self::unavailable(detail),
            _ => Self::new(
                err.http_status(),
                err.code(),
                "unavailable",
                // Corrupt or misconfigured stores also answer `unavailable`: nothing was decided.
                detail,
            ),
        }
    }

    /// Serialized as JSON.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a problem always serializes")
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, self.to_json_bytes()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        if status == StatusCode::UNAUTHORIZED {
            // One refused request per connection: a caller without a token cannot keep a
            // connection sending bodies the server reads and drops.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response.extensions_mut().insert(ProblemCode(self.code));
        response
    }
}

/// Response extension naming the problem's code, read by the metrics layer.
#[derive(Clone, Copy, Debug)]
pub struct ProblemCode(pub &'static str);
