//! The JSON Lines fast path: a reader thread cuts the inputs into chunks of whole lines, a
//! keying thread computes each line's key digest (parse, canonical key, SHA-256), and the
//! caller's thread consumes keyed chunks in input order. Bounded channels of a few chunks keep
//! memory at a few megabytes however large the input, and the stages overlap on two cores.

use std::io::Read;
use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use anyhow::Context;

use super::input::{Input, Position};
use super::keyspec::{KeySpec, Reject, Scratch};

/// Bytes per chunk: large enough to amortize the hand-offs, small enough to stay in cache-ish.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Chunks in flight between two stages.
pub const CHANNEL_CHUNKS: usize = 4;

/// Whole lines of one input.
pub struct Chunk {
    /// Name of the input.
    pub file: Arc<str>,
    /// 1-based number of the chunk's first line in its input.
    pub first_line: u64,
    /// Bytes read from all inputs up to the end of this chunk (for the progress bar).
    pub bytes_read_total: u64,
    /// The lines, each ending in `\n` (the last input's last line may lack it).
    pub data: Vec<u8>,
}

/// One non-blank line of a chunk and its key.
pub struct KeyedLine {
    /// The line's bytes within the chunk, without its line ending.
    pub span: Range<usize>,
    /// 1-based line number in its input.
    pub line: u64,
    /// The key digest, or why there is none.
    pub key: Result<[u8; 32], Reject>,
    /// The rendered key, for a template (a ledger stores it as the key).
    pub text: Option<String>,
}

/// A chunk with its keyed lines.
pub struct KeyedChunk {
    /// The chunk.
    pub chunk: Chunk,
    /// Its non-blank lines in order.
    pub lines: Vec<KeyedLine>,
}

impl KeyedChunk {
    /// Where a line of this chunk is.
    pub fn position(&self, line: &KeyedLine) -> Position {
        Position {
            file: self.chunk.file.to_string(),
            line: line.line,
        }
    }
}

/// Reads `inputs` and keys every line on two threads, calling `consume` with each keyed chunk
/// in input order. Stops at the first error of any stage.
pub fn for_each_keyed_chunk(
    inputs: Vec<Input>,
    spec: &KeySpec,
    now_ms: i64,
    mut consume: impl FnMut(KeyedChunk) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let (chunk_tx, chunk_rx) = sync_channel::<anyhow::Result<Chunk>>(CHANNEL_CHUNKS);
    let (keyed_tx, keyed_rx) = sync_channel::<KeyedChunk>(CHANNEL_CHUNKS);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            if let Err(e) = read_chunks(inputs, |c| chunk_tx.send(Ok(c)).is_ok()) {
                let _ = chunk_tx.send(Err(e));
            }
        });
        let keyer = scope.spawn(move || -> anyhow::Result<()> {
            key_chunks(chunk_rx, spec, now_ms, |k| keyed_tx.send(k).is_ok())
        });
        let consumed = consume_all(&keyed_rx, &mut consume);
        // Dropping the receiver stops the keyer (and through it the reader) early on error.
        drop(keyed_rx);
        let keyed = keyer
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("keying thread panicked")));
        consumed.and(keyed)
    })
}

fn consume_all(
    rx: &Receiver<KeyedChunk>,
    consume: &mut impl FnMut(KeyedChunk) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    for keyed in rx.iter() {
        consume(keyed)?;
    }
    Ok(())
}

fn key_chunks(
    rx: Receiver<anyhow::Result<Chunk>>,
    spec: &KeySpec,
    now_ms: i64,
    mut send: impl FnMut(KeyedChunk) -> bool,
) -> anyhow::Result<()> {
    let mut scratch = Scratch::default();
    for chunk in rx.iter() {
        let chunk = chunk?;
        let mut lines = Vec::with_capacity(chunk.data.len() / 64 + 1);
        let mut start = 0;
        let mut line_no = chunk.first_line;
        let data = &chunk.data;
        while start < data.len() {
            let end = memchr::memchr(b'\n', &data[start..]).map_or(data.len(), |i| start + i);
            let mut trimmed = end;
            while trimmed > start && data[trimmed - 1] == b'\r' {
                trimmed -= 1;
            }
            let line = &data[start..trimmed];
            if !line.iter().all(|b| matches!(b, b' ' | b'\t')) {
                let key = spec.digest_json(line, now_ms, &mut scratch);
                let text = match spec {
                    KeySpec::Template(_) if key.is_ok() => Some(scratch.text.clone()),
                    _ => None,
                };
                lines.push(KeyedLine {
                    span: start..trimmed,
                    line: line_no,
                    key,
                    text,
                });
            }
            line_no += 1;
            start = end + 1;
        }
        if !send(KeyedChunk { chunk, lines }) {
            break;
        }
    }
    Ok(())
}

/// Cuts the inputs into chunks of whole lines.
fn read_chunks(inputs: Vec<Input>, mut send: impl FnMut(Chunk) -> bool) -> anyhow::Result<()> {
    let mut total = 0u64;
    for input in inputs {
        let name: Arc<str> = input.name().into();
        let mut reader = input.open()?;
        let mut carry: Vec<u8> = Vec::new();
        let mut next_line = 1u64;
        loop {
            let mut data = std::mem::take(&mut carry);
            let filled_from = data.len();
            data.resize(filled_from + CHUNK_BYTES, 0);
            let mut filled = filled_from;
            // Fill the chunk (reads may return less than asked).
            while filled < data.len() {
                let n = reader
                    .read(&mut data[filled..])
                    .with_context(|| format!("reading {name}"))?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            total += (filled - filled_from) as u64;
            let at_end = filled < data.len();
            data.truncate(filled);
            if !at_end {
                // Keep the partial last line for the next chunk.
                match memchr::memrchr(b'\n', &data) {
                    Some(i) => carry = data.split_off(i + 1),
                    None => {
                        // A line longer than a chunk: read on until its end.
                        carry = data;
                        continue;
                    }
                }
            }
            if data.is_empty() {
                break;
            }
            let lines = memchr::memchr_iter(b'\n', &data).count() as u64
                + u64::from(data.last() != Some(&b'\n'));
            let chunk = Chunk {
                file: name.clone(),
                first_line: next_line,
                bytes_read_total: total,
                data,
            };
            next_line += lines;
            if !send(chunk) {
                return Ok(());
            }
            if at_end {
                break;
            }
        }
    }
    Ok(())
}
