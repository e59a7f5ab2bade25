//! Frames over byte streams: TCP from the operating system, or turmoil's simulated TCP in the
//! simulation ([`super::socket`]), optionally inside mutual TLS ([`super::tls`]). A caller keeps
//! idle connections per address and reuses them; one request is in flight per connection. The
//! server runs one task per accepted connection.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};

use super::socket::{Accept, BoxStream, Connect, TokioTcp};
use super::tls::NodeTls;
use super::{
    decode_body, encode_frame, BoxFuture, Handler, Request, Response, Transport, TransportError,
    MAX_FRAME_BYTES,
};

/// Idle connections kept per peer. One request is in flight per connection, and a state-store
/// request forwarded to a partition's head holds its connection for the whole execution there, so
/// a node forwarding tens of requests at once keeps as many to reuse rather than opening (and the
/// peer accepting) a connection per request.
const IDLE_PER_PEER: usize = 64;

/// A connection with its read buffer: a frame's length and body (and often the next frame) come
/// in one read from the socket, not one each.
type Buffered = BufReader<BoxStream>;

/// The stream side of [`Transport`].
pub struct TcpTransport {
    connect: Arc<dyn Connect>,
    tls: Option<NodeTls>,
    /// Ordered: dropping the transport closes the connections in address order (each close is a
    /// message; deterministic under simulation).
    idle: Mutex<BTreeMap<String, Vec<Buffered>>>,
    refusals: Refusals,
}

impl Default for TcpTransport {
    fn default() -> Self {
        TcpTransport::new()
    }
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Plain TCP through tokio.
    pub fn new() -> TcpTransport {
        TcpTransport::over(Arc::new(TokioTcp), None)
    }

    /// Over any [`Connect`], inside mutual TLS when `tls` is given.
    pub fn over(connect: Arc<dyn Connect>, tls: Option<NodeTls>) -> TcpTransport {
        TcpTransport {
            connect,
            tls,
            idle: Mutex::default(),
            refusals: Refusals::default(),
        }
    }

    fn take_idle(&self, addr: &str) -> Option<Buffered> {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(addr)
            .and_then(Vec::pop)
    }

    fn put_idle(&self, addr: &str, stream: Buffered) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(addr.to_owned()).or_default();
        if list.len() < IDLE_PER_PEER {
            list.push(stream);
        }
    }

    async fn exchange(stream: &mut Buffered, frame: &[u8]) -> Result<Response, std::io::Error> {
        stream.write_all(frame).await?;
        stream.flush().await?;
        read_frame(stream).await
    }

    /// A new connection to `addr`, through the TLS handshake when configured.
    async fn open(&self, addr: &str) -> Result<BoxStream, TransportError> {
        let unreachable = |e: std::io::Error| TransportError::Unreachable {
            addr: addr.to_owned(),
            reason: e.to_string(),
        };
        let stream = self.connect.connect(addr).await.map_err(unreachable)?;
        let Some(tls) = &self.tls else {
            return Ok(stream);
        };
        match tls.connect(addr, stream).await {
            Ok(stream) => {
                self.refusals.clear(addr);
                Ok(stream)
            }
            Err(e) => {
                let reason = format!("TLS handshake failed: {e}");
                self.refusals.report(addr, &reason, || {
                    tracing::warn!(
                        peer = addr,
                        "cannot talk to the node at {addr}: {reason} (its certificate must be signed by cluster_tls_ca and name the host it is dialled at)"
                    );
                });
                Err(TransportError::Unreachable {
                    addr: addr.to_owned(),
                    reason,
                })
            }
        }
    }

    async fn call_inner(&self, addr: &str, frame: Vec<u8>) -> Result<Response, TransportError> {
        // A reused connection may have been closed by a restarted peer: one retry on a fresh one.
        if let Some(mut stream) = self.take_idle(addr) {
            if let Ok(response) = Self::exchange(&mut stream, &frame).await {
                self.put_idle(addr, stream);
                return Ok(response);
            }
        }
        let mut stream = BufReader::new(self.open(addr).await?);
        let response = Self::exchange(&mut stream, &frame)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidData => TransportError::Frame {
                    addr: addr.to_owned(),
                    reason: e.to_string(),
                },
                _ => TransportError::Unreachable {
                    addr: addr.to_owned(),
                    reason: e.to_string(),
                },
            })?;
        self.put_idle(addr, stream);
        Ok(response)
    }
}

/// Refusals already logged, per peer: a peer that keeps failing the same way is logged once (at
/// warn) until it succeeds or fails differently, not at every Raft heartbeat.
#[derive(Debug, Default)]
struct Refusals(Mutex<BTreeMap<String, String>>);

impl Refusals {
    fn report(&self, peer: &str, reason: &str, log: impl FnOnce()) {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if seen.get(peer).map(String::as_str) != Some(reason) {
            seen.insert(peer.to_owned(), reason.to_owned());
            log();
        } else {
            tracing::debug!(peer, "cluster connection refused again: {reason}");
        }
    }

    fn clear(&self, peer: &str) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(peer);
    }
}

impl Transport for TcpTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Request,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>> {
        Box::pin(async move {
            let frame = encode_frame(&request).map_err(|e| TransportError::Frame {
                addr: addr.to_owned(),
                reason: format!("cannot encode the request: {e}"),
            })?;
            match tokio::time::timeout(timeout, self.call_inner(addr, frame)).await {
                Ok(result) => result,
                Err(_) => Err(TransportError::Timeout {
                    addr: addr.to_owned(),
                    timeout,
                }),
            }
        })
    }
}

/// Reads one frame and decodes it; a length beyond [`MAX_FRAME_BYTES`] or a body that does not
/// decode is `InvalidData`.
pub async fn read_frame<T: DeserializeOwned>(
    stream: &mut (impl AsyncRead + Unpin + ?Sized),
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES}"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    decode_body(&body).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame does not decode: {e}"),
        )
    })
}

/// Answers requests on `listener` until `shutdown` completes, in plain text.
pub async fn serve(
    listener: impl Accept,
    handler: Arc<dyn Handler>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, None, handler, shutdown).await;
}

/// Answers requests on `listener` until `shutdown` completes; with `tls`, only peers whose
/// certificate the cluster CA signed get past the handshake.
pub async fn serve_with(
    mut listener: impl Accept,
    tls: Option<NodeTls>,
    handler: Arc<dyn Handler>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let refusals = Arc::new(Refusals::default());
    loop {
        let accepted = tokio::select! {
            biased; // deterministic under simulation
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let handler = Arc::clone(&handler);
                let tls = tls.clone();
                let refusals = Arc::clone(&refusals);
                tokio::spawn(async move {
                    let stream = match tls {
                        None => stream,
                        Some(tls) => match tls.accept(stream).await {
                            Ok(stream) => stream,
                            Err(e) => {
                                // Keyed by host: each attempt comes from a new port.
                                let host = peer.rsplit_once(':').map_or(&*peer, |(h, _)| h);
                                let reason = e.to_string();
                                refusals.report(host, &reason, || {
                                    tracing::warn!(
                                        %peer,
                                        "refusing a cluster connection from {peer}: TLS handshake failed: {reason} (a node needs a certificate signed by cluster_tls_ca)"
                                    );
                                });
                                return;
                            }
                        },
                    };
                    if let Err(e) = serve_connection(stream, &peer, handler).await {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof {
                            tracing::debug!(%peer, "cluster connection closed: {e}");
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!("cannot accept a cluster connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve_connection(
    stream: BoxStream,
    peer: &str,
    handler: Arc<dyn Handler>,
) -> std::io::Result<()> {
    let mut stream = BufReader::new(stream);
    loop {
        let request: Request = match read_frame(&mut stream).await {
            Ok(request) => request,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                tracing::warn!(
                    %peer,
                    "refusing a cluster connection from {peer}: {e} (a node with mutual TLS configured, or not a node?)"
                );
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let response = handler.handle(request).await;
        let frame = encode_frame(&response)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
        stream.write_all(&frame).await?;
        stream.flush().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    struct Echo;

    impl Handler for Echo {
        fn handle(&self, request: Request) -> BoxFuture<'_, Response> {
            Box::pin(async move {
                match request {
                    Request::Hello => Response::Hello {
                        node_id: 7,
                        initialized: true,
                        cluster: None,
                    },
                    _ => Response::Failed("unexpected".into()),
                }
            })
        }
    }

    #[tokio::test]
    async fn requests_get_responses_and_oversized_frames_are_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(serve(listener, Arc::new(Echo), std::future::pending()));
        let transport = TcpTransport::new();
        for _ in 0..3 {
            let response = transport
                .call(&addr, Request::Hello, Duration::from_secs(5))
                .await
                .unwrap();
            assert!(matches!(
                response,
                Response::Hello {
                    node_id: 7,
                    initialized: true,
                    ..
                }
            ));
        }
        // A frame claiming more than the limit closes the connection without an answer.
        let mut raw = TcpStream::connect(&addr).await.unwrap();
        raw.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(raw.read(&mut buf).await.unwrap(), 0);
        // Nobody listening: unreachable, not a hang.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = closed.local_addr().unwrap().to_string();
        drop(closed);
        let err = transport
            .call(&dead, Request::Hello, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Unreachable { .. }), "{err}");
        server.abort();
    }
}
