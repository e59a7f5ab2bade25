//! What a connection runs over and what the broker knows of the client before CONNECT.
//!
//! A connection sees one kind of stream whatever the listener ([`Stream`]: TCP, TLS, WebSocket over
//! either), so there is one code path for all transports. The [`Acceptor`] of a listener turns an
//! accepted TCP socket into that stream (TLS handshake, WebSocket upgrade) and fills in the [`Peer`].

use std::fmt;
use std::future::poll_fn;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::config::BrokerConfig;
use crate::tls::Tls;
use crate::websocket;

/// Bytes taken from the stream per read. They pass through a stack buffer, so this costs no memory
/// while a connection waits.
const READ_CHUNK_BYTES: usize = 4096;

/// A byte stream a connection can run over.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Not split into halves: a connection reads and writes in turn, never at once, and a split stream
/// costs every connection a shared allocation and a lock. Plain TCP is held inline: most
/// connections are, and boxed it would cost each one an allocation (see "Idle connections" in
/// `docs/benchmarks.md`).
pub(crate) enum Stream {
    Tcp(TcpStream),
    /// TLS, WebSocket: their state is large, and only these connections pay for it.
    Other(Box<dyn Io>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Other(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Other(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Other(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Other(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Other(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Other(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// How a client reached the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Tls,
    /// WebSocket (subprotocol `mqtt`) over plain TCP.
    Ws,
    /// WebSocket over TLS.
    Wss,
}

impl Transport {
    pub fn scheme(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Tls => "tls",
            Transport::Ws => "ws",
            Transport::Wss => "wss",
        }
    }
}

/// What the broker knows of a client before it reads CONNECT.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    pub transport: Transport,
    /// The identity in the client certificate the TLS handshake verified (subject CN or first
    /// DNS/URI SAN, as the listener is configured); `None` without mTLS or without a certificate.
    pub cert_identity: Option<Arc<str>>,
    /// Listener option: the client id is the certificate identity, whatever CONNECT asks for.
    pub identity_is_client_id: bool,
}

impl Peer {
    /// The client id the listener imposes, if any. `Err` when it imposes the certificate identity
    /// but the client presented no certificate that carries one.
    pub(crate) fn imposed_client_id(&self) -> Result<Option<&Arc<str>>, NoIdentity> {
        match (self.identity_is_client_id, &self.cert_identity) {
            (false, _) => Ok(None),
            (true, Some(id)) => Ok(Some(id)),
            (true, None) => Err(NoIdentity),
        }
    }
}

/// The listener takes client ids from certificates and the client has none with an identity.
#[derive(Debug)]
pub(crate) struct NoIdentity;

impl Peer {
    /// What a connection keeps of its peer once connected: how to name it in the logs.
    pub(crate) fn name(&self) -> PeerName {
        PeerName {
            addr: self.addr,
            transport: self.transport,
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.name().fmt(f)
    }
}

/// A peer's transport and address, as the logs name it (`tcp://127.0.0.1:5000`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerName {
    addr: SocketAddr,
    transport: Transport,
}

impl fmt::Display for PeerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.transport.scheme(), self.addr)
    }
}

/// What a listener does with an accepted socket before MQTT starts.
#[derive(Clone)]
pub enum Acceptor {
    Tcp,
    Tls(Tls),
    Ws,
    Wss(Tls),
}

impl Acceptor {
    pub fn transport(&self) -> Transport {
        match self {
            Acceptor::Tcp => Transport::Tcp,
            Acceptor::Tls(_) => Transport::Tls,
            Acceptor::Ws => Transport::Ws,
            Acceptor::Wss(_) => Transport::Wss,
        }
    }

    /// Runs the TLS handshake and/or WebSocket upgrade. The caller bounds it in time.
    pub(crate) async fn upgrade(
        &self,
        tcp: TcpStream,
        addr: SocketAddr,
        config: &BrokerConfig,
    ) -> io::Result<(Stream, Peer)> {
        // Latency over packet count: acks and small publishes should not wait for Nagle.
        let _ = tcp.set_nodelay(true);
        let mut peer = Peer {
            addr,
            transport: self.transport(),
            cert_identity: None,
            identity_is_client_id: false,
        };
        // The TLS and WebSocket handshakes are boxed: inline, their ~10 KB of state would be
        // allocated for every plain TCP connection's handshake too (freed once connected, but
        // a burst of connections leaves it behind as dirty allocator pages).
        let stream: Stream = match self {
            Acceptor::Tcp => Stream::Tcp(tcp),
            Acceptor::Tls(tls) => {
                Stream::Other(Box::new(Box::pin(tls.accept(tcp, &mut peer)).await?))
            }
            Acceptor::Ws => {
                Stream::Other(Box::new(Box::pin(websocket::accept(tcp, config)).await?))
            }
            Acceptor::Wss(tls) => {
                let tls_stream = Box::pin(tls.accept(tcp, &mut peer)).await?;
                Stream::Other(Box::new(
                    Box::pin(websocket::accept(tls_stream, config)).await?,
                ))
            }
        };
        Ok((stream, peer))
    }
}

/// Reads what is available and appends it to `buf`; `Ok(0)` is the end of the stream. The bytes
/// pass through a stack buffer that exists only during one poll, so a connection waiting for input
/// holds no read buffer. Cancel-safe: when it does not complete, nothing was read.
pub(crate) async fn read_some(rd: &mut Stream, buf: &mut BytesMut) -> io::Result<usize> {
    poll_fn(|cx| poll_read_some(rd, buf, cx)).await
}

/// [`read_some`] as a poll, for a connection that waits on it without holding a future.
pub(crate) fn poll_read_some(
    rd: &mut Stream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    let mut chunk = [MaybeUninit::<u8>::uninit(); READ_CHUNK_BYTES];
    let mut chunk = ReadBuf::uninit(&mut chunk);
    ready!(Pin::new(&mut *rd).poll_read(cx, &mut chunk))?;
    buf.extend_from_slice(chunk.filled());
    Poll::Ready(Ok(chunk.filled().len()))
}

/// Writes all of `bytes` and flushes: TLS and WebSocket streams buffer until flushed.
pub(crate) async fn send(wr: &mut Stream, bytes: &[u8]) -> io::Result<()> {
    wr.write_all(bytes).await?;
    wr.flush().await
}
