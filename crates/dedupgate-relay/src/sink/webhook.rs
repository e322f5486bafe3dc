//! HTTP webhook sink: each message is POSTed with `Idempotency-Key` (the gate key) and
//! `Dedupgate-Fence` (the gate's fencing token), so the receiver can dedup and refuse a stale
//! holder on its side too.
//!
//! - 2xx confirms.
//! - 408, 429, 5xx and transport errors (no answer, a timeout) are asked again here, with
//!   jittered exponential backoff and `Retry-After` (seconds) honoured, within
//!   [`RETRY_BUDGET`]; then [`SinkError::Send`], and the relay's own retry and `max_attempts`
//!   take over. The budget stays well below a broker's redelivery timeouts (JetStream's ack
//!   wait), so a message in hand is not redelivered while the sink still waits.
//! - Any other status (a 4xx, a 3xx not followed) is [`SinkError::Refused`]: the same request
//!   would be refused alike, so the relay dead-letters it at once, with the status and the
//!   start of the body in the reason.

use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::StatusCode;

use super::{Outgoing, Sink, SinkError};

/// The header that carries the gate key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header that carries the gate's fencing token (forwards only, never dead letters).
pub const FENCE_HEADER: &str = "dedupgate-fence";

/// One request's bound, connect to the end of the body: a receiver that hangs is a failed
/// attempt, not a stuck delivery.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts per send (the first included).
const ATTEMPTS_MAX: u32 = 4;
/// The first backoff; each next one doubles, jittered to 50–100% so that many deliveries that
/// failed together do not come back together.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// The longest single wait, `Retry-After` included.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The whole of a send's waits: a wait that would pass it ends the send instead.
const RETRY_BUDGET: Duration = Duration::from_secs(15);
/// Bytes of a refusal's body quoted in the reason.
const BODY_QUOTED_BYTES_MAX: usize = 200;

pub struct WebhookSink {
    name: String,
    url: reqwest::Url,
    client: reqwest::Client,
}

impl WebhookSink {
    pub fn new(url: &str, name: String) -> Result<Self, SinkError> {
        let open = |reason: String| SinkError::Open {
            sink: name.clone(),
            reason,
        };
        let url = reqwest::Url::parse(url).map_err(|e| open(e.to_string()))?;
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .tcp_nodelay(true)
            // A redirect would replay the POST elsewhere: a 3xx is a refusal, not followed.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| open(e.to_string()))?;
        Ok(Self { name, url, client })
    }

    fn headers(&self, out: &Outgoing<'_>) -> Result<HeaderMap, SinkError> {
        let mut headers = HeaderMap::new();
        let is_json = serde_json::from_slice::<serde::de::IgnoredAny>(out.payload).is_ok();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static(if is_json {
                "application/json"
            } else {
                "application/octet-stream"
            }),
        );
        if !out.key.is_empty() {
            let key = HeaderValue::from_str(out.key).map_err(|_| SinkError::Refused {
                sink: self.name.clone(),
                reason: "the key holds a control character (a line break, say), which an HTTP header (Idempotency-Key) cannot carry".into(),
            })?;
            headers.insert(IDEMPOTENCY_KEY, key);
        }
        if let Some(fence) = out.fence {
            headers.insert(FENCE_HEADER, HeaderValue::from(fence));
        }
        for (name, value) in out.headers {
            // The relay's own headers (a dead letter's reason, route, key): names are fixed,
            // values are made one header line.
            let Ok(name) = HeaderName::from_bytes(name.as_bytes()) else {
                continue;
            };
            if let Ok(value) = HeaderValue::from_bytes(&header_safe(value)) {
                headers.insert(name, value);
            }
        }
        Ok(headers)
    }

    /// One attempt: Ok, or whether it may be asked again (with the receiver's `Retry-After`).
    async fn attempt(&self, out: &Outgoing<'_>, headers: HeaderMap) -> Result<(), Failed> {
        let response = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .body(out.payload.to_vec())
            .send()
            .await
            .map_err(|e| Failed::Again {
                reason: transport_reason(&e),
                retry_after: None,
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = response.bytes().await.unwrap_or_default();
        let quoted = String::from_utf8_lossy(&body[..body.len().min(BODY_QUOTED_BYTES_MAX)])
            .trim()
            .to_owned();
        let reason = if quoted.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {quoted}")
        };
        if retriable(status) {
            Err(Failed::Again {
                reason,
                retry_after,
            })
        } else {
            Err(Failed::Refused(reason))
        }
    }
}

enum Failed {
    Again {
        reason: String,
        retry_after: Option<Duration>,
    },
    Refused(String),
}

/// 408, 429 and 5xx: the receiver may answer otherwise later.
fn retriable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// reqwest's error with its causes (its own text alone says "error sending request").
fn transport_reason(e: &reqwest::Error) -> String {
    let mut reason = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        reason.push_str(": ");
        reason.push_str(&c.to_string());
        cause = c.source();
    }
    reason
}

/// `value` as one header line: CR and LF written as `\r` and `\n`, other control bytes dropped.
fn header_safe(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len());
    for &b in value {
        match b {
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\t' | 0x20..=0x7e | 0x80..=0xff => out.push(b),
            _ => {}
        }
    }
    out
}

/// The wait before attempt `attempt + 1` (from 1): the receiver's `Retry-After` when it gave
/// one, else the doubled backoff jittered to 50–100%; never over [`BACKOFF_MAX`].
fn backoff(attempt: u32, retry_after: Option<Duration>) -> Duration {
    let wait = match retry_after {
        Some(wait) => wait,
        None => {
            let full = BACKOFF_FIRST.saturating_mul(1 << (attempt - 1).min(16));
            full.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
        }
    };
    wait.min(BACKOFF_MAX)
}

#[async_trait]
impl Sink for WebhookSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let headers = self.headers(&out)?;
        let mut waited = Duration::ZERO;
        let mut attempt = 1;
        loop {
            let (reason, retry_after) = match self.attempt(&out, headers.clone()).await {
                Ok(()) => return Ok(()),
                Err(Failed::Refused(reason)) => {
                    return Err(SinkError::Refused {
                        sink: self.name.clone(),
                        reason,
                    })
                }
                Err(Failed::Again {
                    reason,
                    retry_after,
                }) => (reason, retry_after),
            };
            let wait = backoff(attempt, retry_after);
            if attempt >= ATTEMPTS_MAX || waited + wait > RETRY_BUDGET {
                return Err(SinkError::Send {
                    sink: self.name.clone(),
                    reason: format!("{reason} (after {attempt} attempts)"),
                });
            }
            tracing::debug!(sink = %self.name, attempt, ?wait, %reason, "relay: webhook asked again");
            tokio::time::sleep(wait).await;
            waited += wait;
            attempt += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_jittered_and_honours_retry_after_up_to_its_bound() {
        for _ in 0..100 {
            let first = backoff(1, None);
            assert!(
                first >= BACKOFF_FIRST / 2 && first <= BACKOFF_FIRST,
                "{first:?}"
            );
            let third = backoff(3, None);
            assert!(
                third >= BACKOFF_FIRST * 2 && third <= BACKOFF_FIRST * 4,
                "{third:?}"
            );
            assert_eq!(backoff(40, None), BACKOFF_MAX);
        }
        assert_eq!(
            backoff(1, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(backoff(1, Some(Duration::from_secs(3600))), BACKOFF_MAX);
    }

    #[test]
    fn statuses_sort_into_retried_and_refused() {
        for s in [408, 429, 500, 502, 503] {
            assert!(retriable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [301, 400, 401, 404, 409, 422] {
            assert!(!retriable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn header_values_keep_to_one_line() {
        assert_eq!(header_safe(b"a\r\nB: 1\x00"), b"a\\r\\nB: 1".to_vec());
    }
}
