//! [`Permanence`]: whether a handler's failure would come back alike on every delivery of the
//! message, so that retrying it only holds the message (and, on Kafka, its partition) in place.
//! The gate rejects such a failure at once (see [`Handled::Failed`](crate::Handled::Failed)),
//! whatever the failure retry policy would allow.

use std::convert::Infallible;

/// Says whether a handler's error is permanent: the same message would fail alike however
/// often it is retried (a sink that cannot carry it, a payload the handler can never accept).
///
/// Every handler's error type implements it. The common ones below are never permanent; a
/// handler's own error type says which of its failures are.
pub trait Permanence {
    /// True when retrying the message cannot succeed.
    fn is_permanent(&self) -> bool;
}

/// Never permanent: a failure carried only as text says nothing about retrying.
macro_rules! transient {
    ($($t:ty),* $(,)?) => {
        $(impl Permanence for $t {
            fn is_permanent(&self) -> bool {
                false
            }
        })*
    };
}

transient!(
    String,
    &str,
    std::io::Error,
    serde_json::Error,
    Box<dyn std::error::Error>,
    Box<dyn std::error::Error + Send + Sync>,
);

impl Permanence for Infallible {
    fn is_permanent(&self) -> bool {
        match *self {}
    }
}
