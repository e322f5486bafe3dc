//! NATS JetStream sink: publishes with `Nats-Msg-Id` set to the gate key, so the stream's own
//! duplicate window drops a copy too, and waits for the stream's PubAck.

use async_nats::jetstream;
use async_trait::async_trait;

use super::{Header, Sink, SinkError};

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
    async fn send(&self, key: &str, payload: &[u8], headers: &[Header]) -> Result<(), SinkError> {
        let failed = |reason: String| SinkError::Send {
            sink: self.name.clone(),
            reason,
        };
        let mut map = async_nats::HeaderMap::new();
        map.insert(async_nats::header::NATS_MESSAGE_ID, key);
        for (name, value) in headers {
            map.insert(name.as_str(), String::from_utf8_lossy(value).as_ref());
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
