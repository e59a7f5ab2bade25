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
use crate::transport::Acceptor;

/// Pause after a failed accept (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// A bound socket and what runs on its connections before MQTT (TLS, WebSocket).
pub struct Listener {
    pub tcp: TcpListener,
    pub acceptor: Acceptor,
}

/// A plain TCP listener.
impl From<TcpListener> for Listener {
    fn from(tcp: TcpListener) -> Self {
        Listener {
            tcp,
            acceptor: Acceptor::Tcp,
        }
    }
}

/// Serves MQTT on `listener` until `shutdown` completes; then stops accepting, sends every client of
/// this listener DISCONNECT 0x8B (server shutting down) and waits (bounded by twice the configured
/// close timeout) for their connections to close. Call once per listener, sharing one `broker`.
pub async fn serve(
    listener: impl Into<Listener>,
    broker: Broker,
    shutdown: impl Future<Output = ()>,
) {
    let Listener { tcp, acceptor } = listener.into();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(shutdown);
    if let Ok(addr) = tcp.local_addr() {
        tracing::info!(%addr, transport = acceptor.transport().scheme(), "MQTT listener started");
    }
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => match broker.inner.connections.admit(peer.ip()) {
                    Ok(permit) => {
                        tracing::debug!(%peer, "connection accepted");
                        crate::metrics::connection_accepted();
                        let run = upgrade_and_run(stream, peer, acceptor.clone(), broker.inner.clone(), cancel.clone());
                        tracker.spawn(async move {
                            run.await;
                            drop(permit);
                        });
                    }
                    Err(refused) => refuse(stream, peer, &acceptor, refused, &broker.inner, &tracker),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            }
        }
    }
    drop(tcp);
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

/// Runs the listener's handshake (in the connection's own task, so a slow client never holds up
/// the accept loop; bounded by the connect timeout), then the MQTT connection.
async fn upgrade_and_run(
    tcp: TcpStream,
    addr: SocketAddr,
    acceptor: Acceptor,
    inner: Arc<Inner>,
    cancel: CancellationToken,
) {
    // Boxed: the handshake's state is large and must not stay in every connection's task.
    let upgrade = Box::pin(acceptor.upgrade(tcp, addr, &inner.config));
    let upgraded = tokio::select! {
        r = tokio::time::timeout(inner.config.connect_timeout, upgrade) => r,
        _ = cancel.cancelled() => return,
    };
    let transport = acceptor.transport().scheme();
    match upgraded {
        Ok(Ok((stream, peer))) => connection::run(stream, peer, inner, cancel).await,
        // Port probes and health checks close without a word: not worth an info line.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!(peer = %addr, transport, "closed during the handshake")
        }
        Ok(Err(e)) => tracing::info!(peer = %addr, transport, error = %e, "handshake failed"),
        Err(_) => {
            tracing::info!(peer = %addr, transport, "handshake not done within the connect timeout")
        }
    }
}

/// A socket over the connection limits. On a plain TCP listener it is answered with CONNACK 0x97 if a
/// refusal slot is free (a well-behaved client learns why); otherwise (no slot, or a listener whose
/// handshake would have to run first) it is closed at once, so a flood costs nothing.
fn refuse(
    stream: TcpStream,
    peer: SocketAddr,
    acceptor: &Acceptor,
    refused: Refused,
    inner: &Arc<Inner>,
    tracker: &TaskTracker,
) {
    if inner.connections.first_refusal() {
        tracing::warn!(%peer, open = inner.connections.open(), "refusing connections: {}", refused.why());
    } else {
        tracing::debug!(%peer, "connection refused: {}", refused.why());
    }
    if !matches!(acceptor, Acceptor::Tcp) {
        return;
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
