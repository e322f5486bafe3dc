//! Running the service: [`serve`] answers HTTP/1.1 and HTTP/2 (h2c, prior knowledge) with
//! keep-alive on one listener, runs the sweeper beside it, and shuts down gracefully.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::{router, AppState};

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
/// requests finish (idle keep-alive connections are closed), stops the sweeper and returns.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let sweeper = tokio::spawn(sweep_loop(state.clone(), stop_rx));
    // Small answers on keep-alive connections: do not let Nagle hold them back.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let served = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await;
    let _ = stop_tx.send(true);
    let _ = sweeper.await;
    served
}

/// Removes expired records in bounded batches: a full batch is followed at once by another, a
/// partial one by a pause of `sweep_interval_ms`.
async fn sweep_loop(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
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
