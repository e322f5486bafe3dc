//! Running the service: [`serve`] answers HTTP/1.1 and HTTP/2 (h2c, prior knowledge) with
//! keep-alive on one listener, runs the sweeper beside it, and shuts down gracefully.
//!
//! Connections are served by hyper directly with [`AppState::handle`] as the service, not
//! through `axum::serve` and a router: no boxed, cloned route service, no request extensions
//! and no boxed request body per request.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::app::AppState;

/// Longest a request head may take to arrive.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long to wait after an accept error that is not about one connection (no file
/// descriptors left, no memory): retrying at once would spin.
const ACCEPT_PAUSE_MS: u64 = 1_000;

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
/// requests finish (idle keep-alive connections are closed), stops the sweeper and returns.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let sweeper = tokio::spawn(sweep_loop(state.clone(), stop_rx.clone()));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // Answers are small: one buffer and one write(2) per answer instead of a writev(2)
        // of the head and the body.
        .writev(false)
        // A client that trickles its request head holds a connection (a file descriptor) for
        // at most this long; without a timer hyper applies no header timeout at all.
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let builder = Arc::new(builder);
    let mut shutdown = std::pin::pin!(shutdown);
    // Every connection task holds a clone of `done_rx`; `done_tx.closed()` resolves once all
    // of them have ended.
    let (done_tx, done_rx) = watch::channel(());
    // Set before `stop_tx` sends: connections read it without a lock on every wake-up.
    let stopping = Arc::new(AtomicBool::new(false));
    // If this future is dropped instead of shut down, the flag is set before `stop_tx` (declared
    // earlier, so dropped later) wakes the connections: they still shut down gracefully and
    // let go of the state (and with it the store and its directory lock).
    let _stop_on_drop = StopOnDrop(stopping.clone());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.as_mut() => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::error!(cause = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(ACCEPT_PAUSE_MS)).await;
                continue;
            }
        };
        tokio::spawn(connection(
            tcp,
            state.clone(),
            builder.clone(),
            stop_rx.clone(),
            stopping.clone(),
            done_rx.clone(),
        ));
    }
    drop(listener);
    drop(done_rx);
    stopping.store(true, Ordering::Release);
    let _ = stop_tx.send(true);
    done_tx.closed().await;
    let _ = sweeper.await;
    Ok(())
}

/// Sets the shared `stopping` flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Serves one connection until the client closes it or, after shutdown began, until its
/// in-flight requests are answered.
async fn connection(
    tcp: TcpStream,
    state: Arc<AppState>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    stop: watch::Receiver<bool>,
    stopping: Arc<AtomicBool>,
    _done: watch::Receiver<()>,
) {
    // Small answers on keep-alive connections: do not let Nagle hold them back.
    let _ = tcp.set_nodelay(true);
    let service = service_fn(move |request: hyper::Request<Incoming>| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(state.handle(request).await) }
    });
    let conn = builder.serve_connection(TokioIo::new(tcp), service);
    let served = Served::new(conn, |conn| conn.graceful_shutdown(), stop, stopping);
    if let Err(e) = served.await {
        tracing::trace!(cause = %e, "connection ended with an error");
    }
}

/// A connection that starts its graceful shutdown when the server stops. It is polled on
/// every wake-up of its task (twice per request or more): rather than polling a watch
/// receiver each time (a lock), the stop signal's future is polled once, to register the
/// task's waker, and after that the `stopping` flag is read.
struct Served<C, F> {
    conn: Pin<Box<C>>,
    shutdown: F,
    stop: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    stop_registered: bool,
    stopping: Arc<AtomicBool>,
}

impl<C: Future, F: FnMut(Pin<&mut C>) + Unpin> Served<C, F> {
    fn new(
        conn: C,
        shutdown: F,
        mut stop: watch::Receiver<bool>,
        stopping: Arc<AtomicBool>,
    ) -> Self {
        let stop = async move {
            while !*stop.borrow_and_update() {
                if stop.changed().await.is_err() {
                    return;
                }
            }
        };
        Self {
            conn: Box::pin(conn),
            shutdown,
            stop: Some(Box::pin(stop)),
            stop_registered: false,
            stopping,
        }
    }
}

impl<C: Future, F: FnMut(Pin<&mut C>) + Unpin> Future for Served<C, F> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = self.get_mut();
        if let Some(stop) = this.stop.as_mut() {
            let stopped = if this.stop_registered {
                this.stopping.load(Ordering::Acquire)
            } else {
                this.stop_registered = true;
                stop.as_mut().poll(cx).is_ready() || this.stopping.load(Ordering::Acquire)
            };
            if stopped {
                this.stop = None;
                (this.shutdown)(this.conn.as_mut());
            }
        }
        this.conn.as_mut().poll(cx)
    }
}

/// Accept errors about one connection (it went away before it was accepted): skip it.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Removes expired records in bounded batches: a full batch is followed at once by another, a
/// partial one by a pause of `sweep_interval_ms`. A store that sweeps itself (the embedded
/// store's own sweeper) is left to it, so each store has one sweeper; its own count still
/// reaches `swept_total` through its stats.
async fn sweep_loop(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    if state.store().sweeps_itself() {
        return;
    }
    let config = state.config();
    let pause = Duration::from_millis(config.sweep_interval_ms.max(1));
    let batch_max = config.sweep_batch_max.max(1);
    loop {
        let full = match state.store().sweep_expired(batch_max).await {
            Ok(n) => {
                state.metrics().swept(n);
                n as usize >= batch_max
            }
            Err(e) => {
                tracing::warn!(cause = %e, "sweeping expired records failed");
                false
            }
        };
        let wait = if full { Duration::ZERO } else { pause };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
    }
}
