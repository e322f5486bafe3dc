//! JSON-line sinks: standard output (flushed) and an append-only file (fsync'd), each confirming
//! a message only once it is written through.

use std::path::Path;

use async_trait::async_trait;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::{json_line, Outgoing, Sink, SinkError};

/// JSON lines on standard output, flushed before confirming.
pub struct StdoutSink {
    out: Mutex<tokio::io::Stdout>,
}

impl StdoutSink {
    pub fn new() -> Self {
        Self {
            out: Mutex::new(tokio::io::stdout()),
        }
    }
}

#[async_trait]
impl Sink for StdoutSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let Outgoing {
            key,
            payload,
            headers,
            ..
        } = out;
        let mut line = json_line(key, payload, headers);
        line.push('\n');
        let mut out = self.out.lock().await;
        let written = async {
            out.write_all(line.as_bytes()).await?;
            out.flush().await
        };
        written.await.map_err(|e| SinkError::Send {
            sink: "stdout:".into(),
            reason: e.to_string(),
        })
    }
}

/// JSON lines appended to a file; each line is fsync'd (`fdatasync`) before it is confirmed,
/// so a confirmed message survives a crash of the machine. A failed write is cut back off the
/// file, so the retry's line is not preceded by a fragment.
pub struct FileSink {
    name: String,
    file: Mutex<tokio::fs::File>,
}

impl FileSink {
    pub async fn open(path: &Path) -> Result<Self, SinkError> {
        let name = format!("file:{}", path.display());
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await
            .map_err(|e| SinkError::Open {
                sink: name.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            name,
            file: Mutex::new(file),
        })
    }
}

#[async_trait]
impl Sink for FileSink {
    async fn send(&self, out: Outgoing<'_>) -> Result<(), SinkError> {
        let Outgoing {
            key,
            payload,
            headers,
            ..
        } = out;
        let mut line = json_line(key, payload, headers);
        line.push('\n');
        // One writer at a time: a line is never interleaved with another.
        let mut file = self.file.lock().await;
        let failed = |e: std::io::Error| SinkError::Send {
            sink: self.name.clone(),
            reason: e.to_string(),
        };
        let before = file.metadata().await.map_err(failed)?.len();
        let written = async {
            file.write_all(line.as_bytes()).await?;
            file.flush().await?;
            file.sync_data().await
        };
        if let Err(e) = written.await {
            // A part of the line may be written: cut it off, so the retry's line is whole.
            if let Err(cut) = file.set_len(before).await {
                tracing::warn!(error = %cut, sink = %self.name, "relay: a partly written line could not be cut off");
            }
            return Err(failed(e));
        }
        Ok(())
    }
}
