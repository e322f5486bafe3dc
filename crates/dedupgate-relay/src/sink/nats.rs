//! NATS JetStream sink: publishes with `Nats-Msg-Id` set to the gate key, so the stream's own
//! duplicate window drops a copy too, and waits for the stream's PubAck.
//!
//! A NATS header block is text lines, so a header value must not hold CR or LF: one that did
//! would end its header and start another (header injection). A key with either cannot be the
//! `Nats-Msg-Id` and is refused ([`SinkError::Refused`]: the relay dead-letters the message);
//! other header values (a dead letter's reason and key) are written with [`header_safe`].

use async_nats::jetstream;
use async_trait::async_trait;

use super::{Outgoing, Sink, SinkError};

pub struct NatsSink {
    name: String,
    subject: String,
    js: jetstream::Context,
}

impl NatsSink {
    pub async fn connect(server: &str, subject: &str) -> Result<Self, SinkError> {
        let name = format!("{server}/{subject}");
        let client = async_nats::connect(server)
            .await
            .map_err(|e| SinkError::Open {
                sink: name.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            name,
            subject: subject.to_owned(),
            js: jetstream::new(client),
        })
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let Outgoing {
            key,
            payload,
            headers,
            ..
        } = out;
        let failed = |reason: String| SinkError::Send {
            sink: self.name.clone(),
            reason,
        };
        if key.contains(['\r', '\n']) {
            return Err(SinkError::Refused {
                sink: self.name.clone(),
                reason: "the key holds a line break (CR or LF), which a NATS header (Nats-Msg-Id) cannot carry".into(),
            });
        }
        let mut map = async_nats::HeaderMap::new();
        // A dead letter whose key could not be made (or is refused above) goes without an id.
        if !key.is_empty() {
            map.insert(async_nats::header::NATS_MESSAGE_ID, key);
        }
        for (name, value) in headers {
            map.insert(name.as_str(), header_safe(&String::from_utf8_lossy(value)));
        }
        self.js
            .publish_with_headers(
                self.subject.clone(),
                map,
                bytes::Bytes::copy_from_slice(payload),
            )
            .await
            .map_err(|e| failed(e.to_string()))?
            .await
            .map_err(|e| failed(e.to_string()))?;
        Ok(())
    }
}

/// `value` with each CR written as `\r` and each LF as `\n` (two characters each), so it stays
/// one header value; anything else is kept as it is.
pub(crate) fn header_safe(value: &str) -> String {
    value.replace('\r', "\\r").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_keep_to_one_line() {
        assert_eq!(header_safe("plain"), "plain");
        assert_eq!(header_safe("a\r\nInjected: 1\n"), "a\\r\\nInjected: 1\\n");
    }
}
