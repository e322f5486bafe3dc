//! Errors as types. A duplicate is an outcome, not an error; these are the answers that are not.

use std::borrow::Cow;

/// A request the gate refuses before deciding anything: it never changes stored state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidInput {
    /// The offending field.
    pub field: Cow<'static, str>,
    /// Why it was refused.
    pub reason: String,
}

impl InvalidInput {
    /// An invalid `field` with its reason.
    pub fn new(field: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// The store could not decide: nothing was decided, the caller may retry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store cannot be reached or written right now (a lost connection, a failed fsync, a
    /// store that failed closed and has not yet reopened). Whether the operation took effect is
    /// unknown only for operations sent before the failure was seen; retrying is safe.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store holds data it cannot read. Nothing is changed; an operator must look.
    #[error("store data is corrupt: {0}")]
    Corrupt(String),
    /// The store refused to open or to run as configured (wrong format version, bad settings).
    #[error("store misconfigured: {0}")]
    Config(String),
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`], keeping its message chain.
    pub fn unavailable(err: impl std::fmt::Display) -> Self {
        Self::Unavailable(err.to_string())
    }
}

/// Why an operation got no success answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GateError {
    /// The request is malformed; nothing was changed.
    #[error("invalid request: {0}")]
    Invalid(InvalidInput),
    /// The token is not the current holder's (released, taken over, expired or never issued).
    #[error("lease lost: the token is not the current holder's")]
    LeaseLost,
    /// The key exists with a different fingerprint: key reuse with another payload.
    #[error("fingerprint mismatch: the key exists with a different payload")]
    FingerprintMismatch,
    /// The store could not decide.
    #[error(transparent)]
    Store(#[from] StoreError),
}

// By hand rather than `#[from]`: the message already holds the cause, so it is not also the
// error's source (a report walking the sources would say it twice).
impl From<InvalidInput> for GateError {
    fn from(e: InvalidInput) -> Self {
        GateError::Invalid(e)
    }
}

impl GateError {
    /// The stable machine code of API.md.
    pub fn code(&self) -> &'static str {
        match self {
            GateError::Invalid(_) => "invalid_request",
            GateError::LeaseLost => "lease_lost",
            GateError::FingerprintMismatch => "fingerprint_mismatch",
            GateError::Store(_) => "unavailable",
        }
    }

    /// The HTTP status API.md gives the code.
    pub fn http_status(&self) -> u16 {
        match self {
            GateError::Invalid(_) => 400,
            GateError::LeaseLost => 409,
            GateError::FingerprintMismatch => 422,
            GateError::Store(_) => 503,
        }
    }
}

/// `e` and its sources, joined with `: ` on one line: for logs and messages where only text
/// can go (a `Box<dyn Error>`, a store's "unavailable" detail). The error types of this
/// workspace never also return as their source a cause their message already holds, so each
/// cause appears once.
pub fn chain_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// Found by an adversarial run: errors whose message held their cause and also returned it
    /// as their source were printed with the cause twice by reports that walk the sources.
    #[test]
    fn a_cause_in_the_message_is_not_also_the_source() {
        let invalid = GateError::from(InvalidInput::new("key", "is empty"));
        assert_eq!(invalid.to_string(), "invalid request: key: is empty");
        assert!(invalid.source().is_none());
        let template = crate::keys::KeyTemplate::parse("x-{now|window:0s}").unwrap_err();
        assert!(template.to_string().contains("is zero"), "{template}");
        assert!(template.source().is_none());
    }
}
