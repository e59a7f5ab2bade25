//! Mutual TLS between nodes (rustls): every node has a certificate signed by the cluster's CA and
//! presents it both when it dials and when it is dialled; a peer without one, or with one from
//! another CA, is refused during the handshake. The dialled side's certificate must also name the
//! host of the address it was dialled at (`--peers` entry), as HTTPS does.
//!
//! PEM files are read by the caller (the server reuses the MQTT listeners' loading); this module
//! takes the parsed certificates and key.

use std::io;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::socket::BoxStream;

/// This node's certificate and key, and the CA its peers' certificates must chain to.
#[derive(Clone)]
pub struct NodeTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeTls")
    }
}

impl NodeTls {
    /// `chain`: this node's certificate first; `ca`: the certificates that sign every node's.
    /// The error says what does not fit.
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        ca: Vec<CertificateDer<'static>>,
    ) -> Result<NodeTls, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for cert in ca {
            roots
                .add(cert)
                .map_err(|e| format!("not a usable CA certificate: {e}"))?;
        }
        if roots.is_empty() {
            return Err("no CA certificate".into());
        }
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| format!("cannot verify peers with this CA: {e}"))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| format!("the key does not fit the certificate: {e}"))?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("the key does not fit the certificate: {e}"))?;
        Ok(NodeTls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// The dialling side's handshake with the node at `addr` (`HOST:PORT`).
    pub async fn connect(&self, addr: &str, stream: BoxStream) -> io::Result<BoxStream> {
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(host, _)| host)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = ServerName::try_from(host.to_owned()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{host:?} is not a name a certificate can hold: {e}"),
            )
        })?;
        let stream = self.connector.connect(name, stream).await?;
        Ok(Box::new(stream))
    }

    /// The dialled side's handshake.
    pub async fn accept(&self, stream: BoxStream) -> io::Result<BoxStream> {
        let stream = self.acceptor.accept(stream).await?;
        Ok(Box::new(stream))
    }
}
