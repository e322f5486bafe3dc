//! What a worker consumes: one delivery of one event and the ordering it is processed in, shared
//! by the worker, the faces it delivers through ([`crate::cron`], [`crate::proxyface`]) and the
//! oracle that judges them.

use serde::{Deserialize, Serialize};

/// Which ordering a delivery is processed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryMode {
    /// Claim, effect, complete.
    Retriable,
    /// Mark, effect.
    Idempotent,
}

/// One delivery of one event.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Delivery {
    /// Ordering.
    pub mode: DeliveryMode,
    /// Namespace (one per ordering, so the two never share a key).
    pub namespace: String,
    /// The event id.
    pub key: String,
}
