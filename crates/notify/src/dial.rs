//! Connecting to an endpoint: TCP with Nagle off, then TLS for `https` and `mqtts`.

use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::endpoint::EndpointError;

/// A connection to an endpoint, plain or TLS.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> Io for T {}
pub(crate) type Stream = Box<dyn Io>;

/// Where and how to connect.
pub(crate) struct Dialer {
    /// `host:port`.
    pub(crate) authority: String,
    /// The name the server's certificate must carry (a DNS name or an IP address).
    host: String,
    tls: Option<Arc<ClientConfig>>,
}

impl Dialer {
    pub(crate) fn new(authority: String, host: String, tls: Option<Arc<ClientConfig>>) -> Dialer {
        Dialer {
            authority,
            host,
            tls,
        }
    }

    fn error(&self, reason: String) -> EndpointError {
        EndpointError::Connect {
            addr: self.authority.clone(),
            reason,
        }
    }

    pub(crate) async fn connect(&self) -> Result<Stream, EndpointError> {
        let tcp = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| self.error(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let Some(config) = &self.tls else {
            return Ok(Box::new(tcp));
        };
        let name = ServerName::try_from(self.host.clone())
            .map_err(|e| self.error(format!("{:?} is no TLS server name: {e}", self.host)))?;
        let tls = TlsConnector::from(Arc::clone(config))
            .connect(name, tcp)
            .await
            .map_err(|e| self.error(format!("TLS: {e}")))?;
        Ok(Box::new(tls))
    }
}
