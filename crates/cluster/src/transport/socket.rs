//! The port the frame transport reaches the network through: something that opens a byte stream
//! to an address, and something that accepts them. Production plugs in tokio's TCP
//! ([`TokioTcp`], [`tokio::net::TcpListener`]); the deterministic simulation plugs in turmoil's
//! simulated TCP. Everything above (TLS, frames, pooling) is the same code on both.

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};

use super::BoxFuture;

/// A connected byte stream.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

pub type BoxStream = Box<dyn Stream>;

/// Opens streams to other nodes' cluster addresses (`HOST:PORT`).
pub trait Connect: Send + Sync + 'static {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>>;
}

impl<T: Connect + ?Sized> Connect for Arc<T> {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>> {
        (**self).connect(addr)
    }
}

/// Accepts streams from other nodes; the peer is named for log lines.
pub trait Accept: Send + 'static {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>>;
}

/// The operating system's TCP, through tokio.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioTcp;

impl Connect for TokioTcp {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>> {
        Box::pin(async move {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            let _ = stream.set_nodelay(true);
            Ok(Box::new(stream) as BoxStream)
        })
    }
}

impl Accept for tokio::net::TcpListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            let (stream, peer) = tokio::net::TcpListener::accept(self).await?;
            let _ = stream.set_nodelay(true);
            Ok((Box::new(stream) as BoxStream, peer.to_string()))
        })
    }
}
