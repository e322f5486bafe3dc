//! [`FramingGuard`]: refuses request smuggling at the byte level.
//!
//! hyper resolves a request that carries both `Content-Length` and `Transfer-Encoding` by
//! dropping the length (RFC 9112 §6.1), so the service never sees the ambiguity. A proxy should
//! refuse such a request outright, because a server behind or in front of it may have framed it
//! the other way. The guard follows HTTP/1 message framing on the connection's incoming bytes
//! and, when a request head carries both headers, inserts a marker header that the server
//! answers with 400 (hyper then closes the connection, as it does for every such request).
//! Anything it cannot follow (a malformed head, a CONNECT tunnel) it passes through untouched and
//! stops looking: hyper's own parser then refuses or handles it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The header the guard inserts into an ambiguously framed request head.
pub const AMBIGUOUS_FRAMING: &str = "x-dedupgate-ambiguous-framing";
/// Longest request head followed, in bytes (hyper's own default limit is about 400 KiB).
const HEAD_BYTES_MAX: usize = 512 * 1024;
/// Longest chunk-size or trailer line followed, in bytes.
const LINE_BYTES_MAX: usize = 8 * 1024;
/// Most header lines parsed in one head (hyper's default is 100).
const HEADERS_MAX: usize = 128;
const READ_BYTES: usize = 16 * 1024;

#[derive(Debug)]
enum Framing {
    /// Collecting a request head until the blank line.
    Head,
    /// Inside a body of known length: this many bytes remain.
    Fixed(u64),
    /// Reading a chunk-size line.
    ChunkSize,
    /// Inside chunk data: this many bytes remain, then CRLF.
    ChunkData(u64),
    /// The CRLF after chunk data: this many bytes remain.
    ChunkEnd(u8),
    /// Reading trailer lines until the empty one.
    Trailers,
    /// No longer following: bytes pass untouched.
    Off,
}

/// Wraps a connection's I/O; see the module docs.
pub struct FramingGuard<T> {
    inner: T,
    state: Framing,
    /// Bytes of an unfinished head or line.
    pending: Vec<u8>,
    /// Processed bytes not yet handed to the reader.
    out: Vec<u8>,
    out_pos: usize,
    scratch: Box<[u8]>,
    /// In a head: the bytes since the last LF are empty (or a lone CR).
    line_start: bool,
    line_cr: bool,
}

impl<T> FramingGuard<T> {
    /// Guards `inner`.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            state: Framing::Head,
            pending: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            scratch: vec![0; READ_BYTES].into_boxed_slice(),
            line_start: true,
            line_cr: false,
        }
    }

    /// Processes newly read bytes into `out`.
    fn feed(&mut self, mut input: &[u8]) {
        while !input.is_empty() {
            match self.state {
                Framing::Off => {
                    self.out.extend_from_slice(input);
                    return;
                }
                Framing::Fixed(n) | Framing::ChunkData(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(input.len());
                    self.out.extend_from_slice(&input[..take]);
                    input = &input[take..];
                    let left = n - take as u64;
                    self.state = match (&self.state, left) {
                        (Framing::Fixed(_), 0) => Framing::Head,
                        (Framing::Fixed(_), l) => Framing::Fixed(l),
                        (_, 0) => Framing::ChunkEnd(2),
                        (_, l) => Framing::ChunkData(l),
                    };
                }
                Framing::ChunkEnd(k) => {
                    let take = usize::from(k).min(input.len());
                    self.out.extend_from_slice(&input[..take]);
                    input = &input[take..];
                    let left = k - take as u8;
                    self.state = if left == 0 {
                        Framing::ChunkSize
                    } else {
                        Framing::ChunkEnd(left)
                    };
                }
                Framing::Head => {
                    // Find the empty line that ends the head (CRLF or bare LF endings).
                    let mut end = None;
                    for (i, &b) in input.iter().enumerate() {
                        match b {
                            b'\n' if self.line_start => {
                                end = Some(i);
                                break;
                            }
                            b'\n' => {
                                self.line_start = true;
                                self.line_cr = false;
                            }
                            b'\r' if self.line_start && !self.line_cr => self.line_cr = true,
                            _ => {
                                self.line_start = false;
                                self.line_cr = false;
                            }
                        }
                    }
                    match end {
                        Some(i) => {
                            self.pending.extend_from_slice(&input[..=i]);
                            input = &input[i + 1..];
                            let head = std::mem::take(&mut self.pending);
                            self.line_start = true;
                            self.line_cr = false;
                            self.head(&head);
                        }
                        None => {
                            self.pending.extend_from_slice(input);
                            input = &[];
                            if self.pending.len() > HEAD_BYTES_MAX {
                                self.give_up();
                            }
                        }
                    }
                }
                Framing::ChunkSize | Framing::Trailers => {
                    let Some(i) = find(input, b"\n") else {
                        self.pending.extend_from_slice(input);
                        if self.pending.len() > LINE_BYTES_MAX {
                            self.give_up();
                        }
                        return;
                    };
                    self.pending.extend_from_slice(&input[..=i]);
                    input = &input[i + 1..];
                    let line = std::mem::take(&mut self.pending);
                    self.out.extend_from_slice(&line);
                    let text = line.strip_suffix(b"\n").unwrap_or(&line);
                    let text = text.strip_suffix(b"\r").unwrap_or(text);
                    self.state = match self.state {
                        Framing::ChunkSize => match chunk_size(text) {
                            Some(0) => Framing::Trailers,
                            Some(n) => Framing::ChunkData(n),
                            None => Framing::Off,
                        },
                        _ if text.is_empty() => Framing::Head,
                        _ => Framing::Trailers,
                    };
                }
            }
        }
    }

    /// Stops following: pending bytes go out as they are.
    fn give_up(&mut self) {
        self.out.append(&mut self.pending);
        self.state = Framing::Off;
    }

    /// Judges one complete head and emits it (with the marker when ambiguous).
    fn head(&mut self, head: &[u8]) {
        if head.iter().all(|&b| b == b'\r' || b == b'\n') {
            // An empty line before a request line is allowed (RFC 9112 §2.2); hyper skips it.
            self.out.extend_from_slice(head);
            return;
        }
        let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
        let mut req = httparse::Request::new(&mut headers);
        if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) {
            // hyper refuses it too and closes the connection.
            self.out.extend_from_slice(head);
            self.state = Framing::Off;
            return;
        }
        let mut te: Option<&[u8]> = None;
        let mut cl: Option<&[u8]> = None;
        // A tunnel's bytes are not HTTP messages. (Upgrade is hop-by-hop and stripped before
        // forwarding, so no other request can switch protocols.)
        let tunnel = req.method == Some("CONNECT");
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("transfer-encoding") {
                te = Some(h.value);
            } else if h.name.eq_ignore_ascii_case("content-length") {
                cl = Some(h.value);
            }
        }
        if te.is_some() && cl.is_some() {
            // Insert the marker after the request line; hyper answers nothing else on this
            // connection afterwards, so there is nothing more to follow.
            let line_end = find(head, b"\n").map_or(head.len(), |i| i + 1);
            self.out.extend_from_slice(&head[..line_end]);
            self.out.extend_from_slice(AMBIGUOUS_FRAMING.as_bytes());
            self.out.extend_from_slice(b": 1\r\n");
            self.out.extend_from_slice(&head[line_end..]);
            self.state = Framing::Off;
            return;
        }
        self.out.extend_from_slice(head);
        self.state = if tunnel {
            Framing::Off
        } else if let Some(te) = te {
            let chunked = te
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            if chunked {
                Framing::ChunkSize
            } else {
                Framing::Off
            }
        } else if let Some(cl) = cl {
            match std::str::from_utf8(cl)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                Some(0) => Framing::Head,
                Some(n) => Framing::Fixed(n),
                None => Framing::Off,
            }
        } else {
            Framing::Head
        };
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn chunk_size(line: &[u8]) -> Option<u64> {
    let size = line.split(|&b| b == b';').next()?.trim_ascii();
    if size.is_empty() || size.len() > 16 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(size).ok()?, 16).ok()
}

impl<T: AsyncRead + Unpin> AsyncRead for FramingGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_pos < this.out.len() {
                let n = (this.out.len() - this.out_pos).min(buf.remaining());
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if matches!(this.state, Framing::Off) && this.pending.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    if n == 0 {
                        // End of input: hand over an unfinished head so hyper reports it.
                        if this.pending.is_empty() {
                            return Poll::Ready(Ok(()));
                        }
                        this.give_up();
                        continue;
                    }
                    // Feed from the scratch buffer without copying it: lend it out meanwhile.
                    let scratch = std::mem::take(&mut this.scratch);
                    this.feed(&scratch[..n]);
                    this.scratch = scratch;
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FramingGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> Vec<u8> {
        let mut g = FramingGuard::new(());
        for c in chunks {
            g.feed(c);
        }
        g.out
    }

    #[test]
    fn clean_requests_pass_untouched_in_any_split() {
        let stream: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\nGET /c HTTP/1.1\r\nHost: x\r\n\r\n";
        for split in 0..stream.len() {
            let out = run(&[&stream[..split], &stream[split..]]);
            assert_eq!(out, stream, "split at {split}");
        }
        let bytewise: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(run(&bytewise), stream);
    }

    #[test]
    fn ambiguous_head_gets_the_marker_even_after_a_clean_request() {
        let stream: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let out = run(&[stream]);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches(AMBIGUOUS_FRAMING).count(), 1);
        assert!(text.contains("POST /b HTTP/1.1\r\nx-dedupgate-ambiguous-framing: 1\r\nHost: x"));
    }

    #[test]
    fn body_that_looks_like_a_head_is_not_judged() {
        let body = b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut stream =
            format!("POST /a HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
        stream.extend_from_slice(body);
        assert_eq!(run(&[&stream]), stream);
    }
}
