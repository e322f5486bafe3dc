//! [`ProxyBody`]: the one body type of the proxy server, streaming or buffered, and
//! [`IdleTimeout`], which fails a body whose source stalls.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};

use crate::BoxError;

/// A request or response body in the proxy: a stream from a connection, or bytes in memory.
pub struct ProxyBody(UnsyncBoxBody<Bytes, BoxError>);

impl std::fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ProxyBody")
            .field(&self.0.size_hint())
            .finish()
    }
}

impl ProxyBody {
    /// Wraps any body.
    pub fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(body.map_err(Into::into).boxed_unsync())
    }

    /// No bytes.
    pub fn empty() -> Self {
        Self::new(Empty::new())
    }
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        Self::new(Full::new(b))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// The source of a body went silent for longer than allowed.
#[derive(Debug, thiserror::Error)]
#[error("no data from the upstream for {0:?}")]
pub struct IdleTimeoutError(pub Duration);

/// Fails a body when its source produces nothing for `idle`. The timer is checked only while
/// the source has nothing ready, so a slow reader is never mistaken for a stalled source.
pub struct IdleTimeout<B> {
    inner: B,
    idle: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl<B> IdleTimeout<B> {
    /// Wraps `inner`.
    pub fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl<B> Body for IdleTimeout<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                let deadline = tokio::time::Instant::now() + this.idle;
                this.sleep.as_mut().reset(deadline);
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(IdleTimeoutError(this.idle))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
