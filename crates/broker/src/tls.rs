//! TLS for listeners (rustls; TLS 1.2 and 1.3): the certificate and key files, optional client
//! certificates (mTLS) and the identity taken from them, and reloading the files without touching
//! established connections.
//!
//! A [`Tls`] is shared by every listener that uses it. Each handshake takes the configuration that
//! is current when it starts; [`Tls::reload`] swaps in a new one only if the new files load, so a
//! bad or half-written pair is reported and the old one stays in use.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::SystemTime;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use x509_parser::extensions::GeneralName;

use crate::error::BrokerError;
use crate::transport::Peer;

/// Whether clients must present a certificate signed by the client CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// The handshake fails without a valid client certificate.
    Required,
    /// Clients may connect without a certificate (and authenticate otherwise); one that is
    /// presented must be valid.
    Optional,
}

/// Which part of a client certificate is the client's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentitySource {
    /// The subject's common name (CN).
    Subject,
    /// The first DNS or URI subject alternative name.
    San,
}

/// What a TLS listener is configured with.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM certificate chain, server certificate first.
    pub cert: PathBuf,
    /// PEM private key of the certificate (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificate(s) that sign client certificates; enables mTLS.
    pub client_ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    pub identity: IdentitySource,
    /// Use the certificate identity as the MQTT client id (announced in CONNACK when it differs).
    pub identity_is_client_id: bool,
}

/// A reloadable TLS server configuration, cheap to clone.
#[derive(Clone)]
pub struct Tls {
    inner: Arc<Inner>,
}

struct Inner {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
    /// Modification stamps of the files at the last load attempt.
    seen: Mutex<Vec<Stamp>>,
}

type Stamp = Option<(SystemTime, u64)>;

impl Tls {
    /// Loads the files; the error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Tls, BrokerError> {
        let seen = stamps(&files);
        let config = build(&files)?;
        Ok(Tls {
            inner: Arc::new(Inner {
                files,
                current: RwLock::new(Arc::new(config)),
                seen: Mutex::new(seen),
            }),
        })
    }

    pub fn files(&self) -> &TlsFiles {
        &self.inner.files
    }

    /// Loads the files again. New handshakes use the new configuration; on error the previous
    /// one stays in use.
    pub fn reload(&self) -> Result<(), BrokerError> {
        *self
            .inner
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = stamps(&self.inner.files);
        let config = Arc::new(build(&self.inner.files)?);
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = config;
        Ok(())
    }

    /// Reloads if a file's modification time or size changed since the last load attempt;
    /// `None` if nothing changed.
    pub fn reload_if_changed(&self) -> Option<Result<(), BrokerError>> {
        let now = stamps(&self.inner.files);
        let changed = *self
            .inner
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            != now;
        changed.then(|| self.reload())
    }

    /// Runs the server side of the handshake and records the client's certificate identity.
    pub(crate) async fn accept(
        &self,
        tcp: TcpStream,
        peer: &mut Peer,
    ) -> io::Result<TlsStream<TcpStream>> {
        let config = self
            .inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let stream = TlsAcceptor::from(config).accept(tcp).await?;
        let files = &self.inner.files;
        peer.identity_is_client_id = files.identity_is_client_id;
        peer.cert_identity = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(|cert| identity(cert, files.identity))
            .map(Arc::from);
        Ok(stream)
    }
}

fn stamps(files: &TlsFiles) -> Vec<Stamp> {
    [
        Some(&files.cert),
        Some(&files.key),
        files.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(|path| {
        let meta = std::fs::metadata(path).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    })
    .collect()
}

fn build(files: &TlsFiles) -> Result<ServerConfig, BrokerError> {
    // Explicit provider: no reliance on a process-wide default being installed.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| error(&files.cert, e))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => builder.with_client_cert_verifier(client_verifier(ca, files, provider)?),
    };
    let certs = read_certs(&files.cert)?;
    let key = read_key(&files.key)?;
    builder.with_single_cert(certs, key).map_err(|e| {
        error(
            &files.key,
            format!("does not fit the certificate {}: {e}", files.cert.display()),
        )
    })
}

fn client_verifier(
    ca: &Path,
    files: &TlsFiles,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, BrokerError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca)? {
        roots
            .add(cert)
            .map_err(|e| error(ca, format!("not a usable CA certificate: {e}")))?;
    }
    let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
    let builder = match files.client_auth {
        ClientAuth::Required => builder,
        ClientAuth::Optional => builder.allow_unauthenticated(),
    };
    builder.build().map_err(|e| error(ca, e))
}

fn read(path: &Path) -> Result<Vec<u8>, BrokerError> {
    std::fs::read(path).map_err(|e| error(path, e))
}

/// The PEM private key in `path` (PKCS#8, PKCS#1 or SEC1); the error names the file. Also what
/// the cluster's node-to-node TLS loads its key with.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, BrokerError> {
    PrivateKeyDer::from_pem_slice(&read(path)?)
        .map_err(|e| error(path, format!("no usable PEM private key: {e}")))
}

/// The PEM certificates in `path`, at least one; the error names the file. Also what the
/// cluster's node-to-node TLS loads its certificates with.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, BrokerError> {
    let certs = CertificateDer::pem_slice_iter(&read(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(path, format!("invalid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(error(path, "no PEM CERTIFICATE in it"));
    }
    Ok(certs)
}

fn error(path: &Path, reason: impl ToString) -> BrokerError {
    BrokerError::Tls {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The identity in a (verified) client certificate, if it has one of the configured kind.
fn identity(der: &CertificateDer<'_>, source: IdentitySource) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    match source {
        IdentitySource::Subject => cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_owned),
        IdentitySource::San => cert
            .subject_alternative_name()
            .ok()
            .flatten()?
            .value
            .general_names
            .iter()
            .find_map(|name| match name {
                GeneralName::DNSName(s) | GeneralName::URI(s) => Some((*s).to_owned()),
                _ => None,
            }),
    }
    .filter(|id| !id.is_empty())
}
