//! MQTT over WebSocket (MQTT 5 §6): the upgrade, which must negotiate the subprotocol `mqtt`, and a
//! byte-stream view of the binary frames. A frame may carry part of a packet or several packets, so
//! the frames are just a byte stream to the connection; text frames are a protocol error.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::config::BrokerConfig;

/// The only WebSocket subprotocol MQTT defines.
const SUBPROTOCOL: &str = "mqtt";

/// Upgrades an HTTP connection to WebSocket, requiring the client to offer subprotocol `mqtt`.
pub(crate) async fn accept<S>(stream: S, config: &BrokerConfig) -> io::Result<WsStream<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // A frame holds one packet, part of one or a few; twice the largest packet bounds what one
    // frame can make us buffer.
    let max = usize::try_from(config.max_packet_size)
        .unwrap_or(usize::MAX)
        .saturating_mul(2);
    let ws_config = WebSocketConfig::default()
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    let ws = tokio_tungstenite::accept_hdr_async_with_config(stream, negotiate, Some(ws_config))
        .await
        .map_err(io::Error::other)?;
    Ok(WsStream {
        ws,
        pending: Bytes::new(),
    })
}

// The signature is tungstenite's handshake callback's.
#[allow(clippy::result_large_err)]
fn negotiate(request: &Request, mut response: Response) -> Result<Response, ErrorResponse> {
    let offered = request
        .headers()
        .get_all("Sec-WebSocket-Protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL);
    if !offered {
        let mut refusal = ErrorResponse::new(Some(
            "MQTT over WebSocket needs the subprotocol `mqtt` (Sec-WebSocket-Protocol: mqtt)"
                .into(),
        ));
        *refusal.status_mut() = StatusCode::BAD_REQUEST;
        return Err(refusal);
    }
    response.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    Ok(response)
}

/// The MQTT bytes carried in a WebSocket's binary frames.
pub(crate) struct WsStream<S> {
    ws: WebSocketStream<S>,
    /// The unread rest of the last binary frame.
    pending: Bytes,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.pending.is_empty() {
            match ready!(Pin::new(&mut this.ws).poll_next(cx)) {
                // Closed (tungstenite answers a Close frame itself): end of stream.
                None | Some(Ok(Message::Close(_))) => return Poll::Ready(Ok(())),
                Some(Ok(Message::Binary(frame))) => this.pending = frame,
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text frame on MQTT over WebSocket (MQTT 5 §6.0.0-1: binary frames only)",
                    )))
                }
                // Pings are answered by tungstenite; pongs and raw frames carry no MQTT bytes.
                Some(Ok(_)) => {}
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
            }
        }
        let n = buf.remaining().min(this.pending.len());
        buf.put_slice(&this.pending.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let ws = &mut self.ws;
        ready!(Pin::new(&mut *ws).poll_ready(cx)).map_err(io::Error::other)?;
        Pin::new(&mut *ws)
            .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(io::Error::other)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws)
            .poll_flush(cx)
            .map_err(io::Error::other)
    }

    /// Starts the close handshake.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws)
            .poll_close(cx)
            .map_err(io::Error::other)
    }
}
