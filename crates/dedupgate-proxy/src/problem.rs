//! The proxy's own error responses, in the [`ErrorFormat`] a route asks for: RFC 9457 problem
//! JSON with API.md's stable `code`s (the default), plus the proxy's own codes
//! (`request_in_progress` 409, `request_timeout` 408, `bad_gateway` 502, `gateway_timeout` 504,
//! `response_too_large` 502, `stored_response_unreadable` 500); or Stripe's error object, so that
//! the SDK of a Stripe-shaped API reads them as it reads that API's own errors.

use std::str::FromStr;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use serde::Deserialize;

/// How the proxy words the errors it answers itself (the upstream's responses pass unchanged).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFormat {
    /// RFC 9457 problem JSON (`application/problem+json`) with API.md's codes and statuses.
    #[default]
    Problem,
    /// Stripe's `{"error":{"type","code","message"}}` with Stripe's statuses: another payload
    /// under a used key is 400 `idempotency_error`, a key still in flight 409 `idempotency_error`
    /// (`idempotency_key_in_use`), any other refused request 400 `invalid_request_error`, the
    /// proxy's or the store's failures `api_error` with their 5xx status. Stripe's SDKs raise
    /// their own error classes for these (stripe-python: `IdempotencyError`,
    /// `InvalidRequestError`, `APIError`) where problem JSON makes them fail to parse.
    Stripe,
}

impl FromStr for ErrorFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "problem" => Ok(Self::Problem),
            "stripe" => Ok(Self::Stripe),
            other => Err(format!(
                "unknown error format {other:?}: expected problem or stripe"
            )),
        }
    }
}

impl ErrorFormat {
    /// The error response in this format; `status` and `code` are the problem JSON ones.
    pub fn response<B: From<Bytes>>(
        self,
        status: StatusCode,
        code: &str,
        detail: impl std::fmt::Display,
    ) -> Response<B> {
        match self {
            Self::Problem => problem(status, code, detail),
            Self::Stripe => stripe(status, code, detail),
        }
    }
}

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
    json_response(status, "application/problem+json", &body)
}

/// Stripe's error object for a problem of `status` and `code` (see [`ErrorFormat::Stripe`]).
fn stripe<B: From<Bytes>>(
    status: StatusCode,
    code: &str,
    detail: impl std::fmt::Display,
) -> Response<B> {
    let (status, kind, code) = match code {
        // Stripe answers these without a `code`.
        "fingerprint_mismatch" => (StatusCode::BAD_REQUEST, "idempotency_error", None),
        "request_in_progress" => (
            StatusCode::CONFLICT,
            "idempotency_error",
            Some("idempotency_key_in_use"),
        ),
        _ if status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED => {
            (status, "api_error", Some(code))
        }
        // 408, 413, 501 (a transfer coding) included: Stripe refuses a request with 400, and
        // its SDKs raise InvalidRequestError only for 400 and 404.
        _ => (StatusCode::BAD_REQUEST, "invalid_request_error", Some(code)),
    };
    let mut error = serde_json::json!({
        "type": kind,
        "message": detail.to_string(),
    });
    if let Some(code) = code {
        error["code"] = code.into();
    }
    json_response(
        status,
        "application/json",
        &serde_json::json!({ "error": error }),
    )
}

fn json_response<B: From<Bytes>>(
    status: StatusCode,
    content_type: &'static str,
    body: &serde_json::Value,
) -> Response<B> {
    let bytes = Bytes::from(serde_json::to_vec(body).expect("an error body always serializes"));
    let mut res = Response::new(B::from(bytes.clone()));
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(res: Response<Bytes>) -> (StatusCode, String, serde_json::Value) {
        let ct = res.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_owned();
        let status = res.status();
        (status, ct, serde_json::from_slice(res.body()).unwrap())
    }

    #[test]
    fn stripe_statuses_and_types() {
        let f = ErrorFormat::Stripe;
        let (s, ct, b) = body(f.response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "fingerprint_mismatch",
            "x",
        ));
        assert_eq!(
            (s, ct.as_str()),
            (StatusCode::BAD_REQUEST, "application/json")
        );
        assert_eq!(
            b,
            serde_json::json!({"error": {"type": "idempotency_error", "message": "x"}})
        );
        let (s, _, b) = body(f.response(StatusCode::CONFLICT, "request_in_progress", "y"));
        assert_eq!(s, StatusCode::CONFLICT);
        assert_eq!(b["error"]["type"], "idempotency_error");
        assert_eq!(b["error"]["code"], "idempotency_key_in_use");
        for (status, code) in [
            (StatusCode::BAD_REQUEST, "invalid_request"),
            (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            (StatusCode::NOT_IMPLEMENTED, "invalid_request"),
        ] {
            let (s, _, b) = body(f.response(status, code, "z"));
            assert_eq!(s, StatusCode::BAD_REQUEST, "{code}");
            assert_eq!(b["error"]["type"], "invalid_request_error");
            assert_eq!(b["error"]["code"], code);
        }
        for (status, code) in [
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            (StatusCode::BAD_GATEWAY, "bad_gateway"),
            (StatusCode::GATEWAY_TIMEOUT, "gateway_timeout"),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored_response_unreadable",
            ),
        ] {
            let (s, _, b) = body(f.response(status, code, "z"));
            assert_eq!(s, status);
            assert_eq!(b["error"]["type"], "api_error");
            assert_eq!(b["error"]["code"], code);
        }
    }

    #[test]
    fn problem_is_the_default() {
        let (s, ct, b) = body(ErrorFormat::default().response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "fingerprint_mismatch",
            "x",
        ));
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(ct, "application/problem+json");
        assert_eq!(b["code"], "fingerprint_mismatch");
        assert_eq!(b["status"], 422);
        assert_eq!("stripe".parse::<ErrorFormat>(), Ok(ErrorFormat::Stripe));
        assert!("Stripe".parse::<ErrorFormat>().is_err());
    }
}
