//! Opening one bench connection: TCP with TCP_NODELAY (so the figures are the server's, not Nagle's),
//! TLS over it with `--tls` (rustls, trusting `--ca`, presenting `--cert`/`--key` if given), then the
//! MQTT handshake of our own [`wire`] client (`docs/decisions/0013-bench-client.md`).

use std::sync::Arc;

use rumqttc::v5::mqttbytes::v5::{Filter, Login};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;

use super::wire;
use crate::client::connection::{ConnectionArgs, KEEP_ALIVE};
use crate::client::error::CliError;

/// The byte stream under a bench connection.
pub type Transport = Either<TcpStream, TlsStream<TcpStream>>;
/// One bench connection, driven by the one task that owns it.
pub type Connection = wire::Conn<Transport>;

/// What every connection of a run shares: where to connect and how.
pub struct Dialer {
    addr: String,
    host: String,
    timeout: std::time::Duration,
    login: Option<Login>,
    tls: Option<TlsConnector>,
}

impl Dialer {
    /// Reads credentials and TLS files once for the whole run.
    pub fn new(conn: &ConnectionArgs) -> Result<Dialer, CliError> {
        Ok(Dialer {
            addr: conn.addr(),
            host: conn.host.clone(),
            timeout: conn.timeout(),
            login: conn
                .credentials()?
                .map(|(user, password)| Login::new(user, password)),
            tls: conn
                .tls
                .then(|| tls_config(conn).map(TlsConnector::from))
                .transpose()?,
        })
    }

    /// Opens a connection for `client_id`, subscribed to `filters`, with at most `max_inflight` of our
    /// QoS 1 publishes awaiting PUBACK (fewer if the server's Receive Maximum says so).
    pub async fn open(
        &self,
        client_id: &str,
        filters: Vec<Filter>,
        max_inflight: u16,
    ) -> Result<Connection, CliError> {
        let options = wire::Options {
            client_id: client_id.to_owned(),
            keep_alive: KEEP_ALIVE,
            login: self.login.clone(),
            max_inflight,
            filters,
        };
        let opening = async {
            let stream = TcpStream::connect(&self.addr)
                .await
                .map_err(|e| e.to_string())?;
            stream
                .set_nodelay(true)
                .map_err(|e| format!("setting TCP_NODELAY: {e}"))?;
            let transport = match &self.tls {
                None => Either::Left(stream),
                Some(connector) => {
                    let name = ServerName::try_from(self.host.clone())
                        .map_err(|e| format!("--host {} as a TLS server name: {e}", self.host))?;
                    let tls = connector
                        .connect(name, stream)
                        .await
                        .map_err(|e| format!("TLS handshake: {e}"))?;
                    Either::Right(tls)
                }
            };
            wire::Conn::start(transport, options).await
        };
        tokio::time::timeout(self.timeout, opening)
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "no CONNACK/SUBACK within {} s",
                    self.timeout.as_secs()
                ))
            })
            .map_err(|reason| CliError::Connect {
                addr: self.addr.clone(),
                reason,
            })
    }
}

/// A rustls client configuration trusting `--ca`, with `--cert`/`--key` as the client identity if given.
fn tls_config(conn: &ConnectionArgs) -> Result<Arc<ClientConfig>, CliError> {
    let ca = conn.ca.as_ref().ok_or_else(|| {
        CliError::usage(
            "--tls",
            "bench needs the broker's CA certificate: pass --ca FILE (or AIO_TLS_CA_FILE)",
        )
    })?;
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca, "--ca")? {
        roots
            .add(cert)
            .map_err(|e| CliError::usage("--ca", format!("not a usable CA certificate: {e}")))?;
    }
    // Explicit provider: no reliance on a process-wide default being installed.
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CliError::usage("--tls", e.to_string()))?
        .with_root_certificates(roots);
    let config = match (&conn.cert, &conn.tls_key) {
        (Some(cert), Some(key)) => {
            let key = PrivateKeyDer::from_pem_slice(&read(key, "--key")?)
                .map_err(|e| CliError::usage("--key", format!("no usable PEM private key: {e}")))?;
            builder
                .with_client_auth_cert(read_certs(cert, "--cert")?, key)
                .map_err(|e| CliError::usage("--key", format!("does not fit --cert: {e}")))?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

fn read(path: &std::path::Path, flag: &str) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Input {
        what: format!("{flag} {}", path.display()),
        source,
    })
}

fn read_certs(
    path: &std::path::Path,
    flag: &str,
) -> Result<Vec<CertificateDer<'static>>, CliError> {
    let certs = CertificateDer::pem_slice_iter(&read(path, flag)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CliError::usage(flag, format!("{}: invalid PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(CliError::usage(
            flag,
            format!("{}: no PEM CERTIFICATE in it", path.display()),
        ));
    }
    Ok(certs)
}
