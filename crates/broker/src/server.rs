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
use crate::transport::{Acceptor, Peer, Stream, Transport};

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
                        // Boxed: the handshake's state is large and must not stay in every
                        // connection's task.
                        let upgrade = upgrade(stream, peer, acceptor.clone(), broker.inner.clone(), cancel.clone());
                        let opening = Box::pin(connection::open(upgrade, broker.inner.clone(), cancel.clone()));
                        tracker.spawn(connection::run(opening, permit));
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

/// Serves plain MQTT (no TLS, no WebSocket) on the byte streams `accept` hands over, until it
/// fails: for connections that are not tokio's TCP, such as those of a simulated network
/// (`crates/statestore/tests/turmoil_sim.rs`, decision 0067). The connection limits apply as on a
/// listener (a connection over them is closed at once); there is no graceful shutdown: the caller
/// drops the runtime, as a crashed process would.
pub async fn serve_streams<S, A>(mut accept: impl FnMut() -> A, broker: Broker)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    A: Future<Output = std::io::Result<(S, SocketAddr)>>,
{
    let cancel = CancellationToken::new();
    loop {
        let (stream, addr) = match accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; no more connections");
                return;
            }
        };
        let Ok(permit) = broker.inner.connections.admit(addr.ip()) else {
            tracing::debug!(peer = %addr, "connection refused: over the connection limits");
            continue;
        };
        crate::metrics::connection_accepted();
        let peer = Peer {
            addr,
            transport: Transport::Tcp,
            cert_identity: None,
            identity_is_client_id: false,
        };
        let upgraded = std::future::ready(Some((Stream::Other(Box::new(stream)), peer)));
        let opening = Box::pin(connection::open(
            upgraded,
            broker.inner.clone(),
            cancel.clone(),
        ));
        tokio::spawn(connection::run(opening, permit));
    }
}

/// Runs the listener's handshake (in the connection's own task, so a slow client never holds up
/// the accept loop; bounded by the connect timeout). `None` if it failed (logged here).
async fn upgrade(
    tcp: TcpStream,
    addr: SocketAddr,
    acceptor: Acceptor,
    inner: Arc<Inner>,
    cancel: CancellationToken,
) -> Option<(Stream, Peer)> {
    let upgraded = tokio::select! {
        r = tokio::time::timeout(inner.config.connect_timeout, acceptor.upgrade(tcp, addr, &inner.config)) => r,
        _ = cancel.cancelled() => return None,
    };
    let transport = acceptor.transport().scheme();
    match upgraded {
        Ok(Ok(upgraded)) => return Some(upgraded),
        // Port probes and health checks close without a word: not worth an info line.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!(peer = %addr, transport, "closed during the handshake")
        }
        Ok(Err(e)) => tracing::info!(peer = %addr, transport, error = %e, "handshake failed"),
        Err(_) => {
            tracing::info!(peer = %addr, transport, "handshake not done within the connect timeout")
        }
    }
    None
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

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::config::BrokerConfig;

    /// Polls a future and notes when it is dropped.
    struct DropProbe<F>(Pin<Box<F>>, Arc<AtomicBool>);

    impl<F: Future> Future for DropProbe<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            self.0.as_mut().poll(cx)
        }
    }

    impl<F> Drop for DropProbe<F> {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    /// The handshake's (boxed) state must not stay with every connection once it is up.
    #[tokio::test]
    async fn the_handshake_is_freed_once_connected() {
        let broker = Broker::new(BrokerConfig::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, addr) = listener.accept().await.unwrap();
        let permit = broker.inner.connections.admit(addr.ip()).unwrap();
        let cancel = CancellationToken::new();
        let dropped = Arc::new(AtomicBool::new(false));
        let handshake = upgrade(
            tcp,
            addr,
            Acceptor::Tcp,
            broker.inner.clone(),
            cancel.clone(),
        );
        let probe = DropProbe(Box::pin(handshake), dropped.clone());
        let opening = connection::open(probe, broker.inner.clone(), cancel.clone());
        let task = tokio::spawn(connection::run(Box::pin(opening), permit));
        // MQTT 3.1.1 CONNECT, client id "a"; CONNACK accepted.
        client
            .write_all(b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01a")
            .await
            .unwrap();
        let mut connack = [0u8; 4];
        client.read_exact(&mut connack).await.unwrap();
        assert_eq!(connack, [0x20, 2, 0, 0]);
        assert!(dropped.load(Ordering::SeqCst));
        cancel.cancel();
        task.await.unwrap();
    }

    /// Bytes of a connection's task (its future): with the session, most of what an idle
    /// connection costs (see "Idle connections" in `docs/benchmarks.md`).
    #[tokio::test]
    async fn a_connection_task_stays_small() {
        let broker = Broker::new(BrokerConfig::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, addr) = listener.accept().await.unwrap();
        let permit = broker.inner.connections.admit(addr.ip()).unwrap();
        let cancel = CancellationToken::new();
        let upgrade = upgrade(
            tcp,
            addr,
            Acceptor::Tcp,
            broker.inner.clone(),
            cancel.clone(),
        );
        let opening = connection::open(upgrade, broker.inner.clone(), cancel);
        let task = connection::run(Box::pin(opening), permit);
        let size = std::mem::size_of_val(&task);
        drop(client);
        // Debug build: 2,973 bytes when the task wrapped this future in another `async` block
        // (stored twice), 1,104 once spawned as is, 968 with what is under way boxed, 840 with
        // the waits polled in place, 752 with `run` and `serve` as `async` blocks (arguments
        // stored once), TCP streams inline and the peer's name only. tokio's task adds 112 bytes:
        // up to 784 it is in jemalloc's 896-byte class, above in the 1,024-byte one.
        assert!(size <= 784, "the connection task grew to {size} bytes");
    }
}
