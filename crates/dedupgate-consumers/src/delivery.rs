//! One delivery as the broker counts it ([`Attempt`]) and as the handler sees it ([`Message`]).

use serde::de::DeserializeOwned;

/// Which delivery of a message this is, as far as the broker says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first delivery, `n` for the `n`-th; `None` when the broker says only that it
    /// delivered the message before.
    pub number: Option<u32>,
    /// True when the broker delivered the message before.
    pub redelivered: bool,
}

impl Attempt {
    /// The first delivery.
    pub const FIRST: Attempt = Attempt {
        number: Some(1),
        redelivered: false,
    };

    /// The `n`-th delivery (a count of 0 is taken for 1).
    pub fn nth(n: u32) -> Self {
        let n = n.max(1);
        Self {
            number: Some(n),
            redelivered: n > 1,
        }
    }

    /// From a redelivered flag alone: the first delivery when false, an uncounted one when true.
    pub fn from_redelivered(redelivered: bool) -> Self {
        if redelivered {
            Self {
                number: None,
                redelivered: true,
            }
        } else {
            Self::FIRST
        }
    }
}

/// One delivery as the handler sees it.
#[derive(Clone, Debug)]
pub struct Message {
    /// The dedup key.
    pub key: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// True when the broker says this is a redelivery.
    pub redelivered: bool,
    /// Which delivery this is (1 = the first), when the broker counts them.
    pub attempt: Option<u32>,
    /// The gate's fencing token for this run (the claim's, or the mark's): it grows with each
    /// new claim of the key, so a destination that keeps the highest it applied can refuse a
    /// stale holder's late write.
    pub fence: u64,
}

impl Message {
    /// The payload parsed as JSON.
    pub fn json<V: DeserializeOwned>(&self) -> Result<V, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}
