//! Accept loop and graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::connection;
use crate::limits::Refused;
use crate::service::{Broker, Inner};

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
                Ok((stream, peer)) => match broker.inner.connections.admit(peer.ip()) {
                    Ok(permit) => {
                        tracing::debug!(%peer, "connection accepted");
                        let run = connection::run(stream, peer, broker.inner.clone(), cancel.clone());
                        tracker.spawn(async move {
                            run.await;
                            drop(permit);
                        });
                    }
                    Err(refused) => refuse(stream, peer, refused, &broker.inner, &tracker),
                },
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

/// A socket over the connection limits: answered with CONNACK 0x97 if a refusal slot is free (a
/// well-behaved client learns why), else closed at once (a flood costs nothing).
fn refuse(
    stream: TcpStream,
    peer: SocketAddr,
    refused: Refused,
    inner: &Arc<Inner>,
    tracker: &TaskTracker,
) {
    if inner.connections.first_refusal() {
        tracing::warn!(%peer, open = inner.connections.open(), "refusing connections: {}", refused.why());
    } else {
        tracing::debug!(%peer, "connection refused: {}", refused.why());
    }
    if let Some(slot) = inner.connections.begin_refusal() {
        tracker.spawn(connection::refuse_over_limit(
            stream,
            inner.clone(),
            refused,
            slot,
        ));
    }
}
