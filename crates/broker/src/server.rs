//! Accept loop and graceful shutdown.

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::connection;
use crate::service::Broker;

/// Pause after a failed accept (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// Serves MQTT on `listener` until `shutdown` completes; then stops accepting, sends every client of
/// this listener DISCONNECT 0x8B (server shutting down) and waits (bounded by twice the configured
/// close timeout) for their connections to close. Call once per listener, sharing one `broker`.
pub async fn serve(listener: TcpListener, broker: Broker, shutdown: impl Future<Output = ()>) {
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(shutdown);
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "MQTT listener started");
    }
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tracing::debug!(%peer, "connection accepted");
                    crate::metrics::connection_accepted();
                    tracker.spawn(connection::run(stream, peer, broker.inner.clone(), cancel.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            }
        }
    }
    drop(listener);
    cancel.cancel();
    tracker.close();
    let grace = broker.config().close_timeout * 2;
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            remaining = tracker.len(),
            "connections still open after the shutdown grace period"
        );
    }
}
