//! Opening one connection for the CLI or the load generator: the host name resolved, TCP with
//! TCP_NODELAY (so bench figures are the server's, not Nagle's), TLS over it with `--tls` (rustls,
//! trusting `--ca`, presenting `--cert`/`--key` if given), then the MQTT handshake of our own [`wire`]
//! client (`docs/decisions/0013-bench-client.md`).
//!
//! One attempt, never a retry: each way it can fail (unknown host, nothing listening, an untrusted
//! certificate, a refused CONNECT) is reported at once as a [`CliError::Connect`] naming the cause and
//! the fix. Retrying a refused password would only spend the address's failed-login allowance.

use std::sync::Arc;
use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Filter, Login};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;

use super::connection::{ConnectionArgs, KEEP_ALIVE};
use super::error::CliError;
use super::wire::{self, StartError};

/// The fix for a TLS refusal by the broker.
const CLIENT_CERT_FIX: &str = "it may require a client certificate: pass --cert and --key (or AIO_TLS_CERT_FILE, AIO_TLS_KEY_FILE) signed by a CA it trusts";

/// The byte stream under a connection.
pub type Transport = Either<TcpStream, TlsStream<TcpStream>>;
/// One connection, driven by the one task that owns it.
pub type Connection = wire::Conn<Transport>;

/// What every connection of a run shares: where to connect and how.
pub struct Dialer {
    addr: String,
    host: String,
    port: u16,
    timeout: Duration,
    login: Option<Login>,
    tls: Option<TlsConnector>,
    ca: Option<String>,
}

impl Dialer {
    /// Reads credentials and TLS files once for the whole run.
    pub fn new(conn: &ConnectionArgs) -> Result<Dialer, CliError> {
        Ok(Dialer {
            addr: conn.addr(),
            host: conn.host.clone(),
            port: conn.port,
            timeout: conn.timeout(),
            login: conn
                .credentials()?
                .map(|(user, password)| Login::new(user, password)),
            tls: conn
                .tls
                .then(|| tls_config(conn).map(TlsConnector::from))
                .transpose()?,
            ca: conn.ca.as_ref().map(|p| p.display().to_string()),
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
        let mut link = self.connect(client_id, max_inflight).await?;
        if !filters.is_empty() {
            tokio::time::timeout(self.timeout, link.subscribe(filters))
                .await
                .unwrap_or_else(|_| Err(format!("no SUBACK within {} s", self.timeout.as_secs())))
                .map_err(|reason| self.failed(reason, "check the broker's log and ACL"))?;
        }
        Ok(link)
    }

    /// Opens a connection for `client_id` (CONNECT and CONNACK only), so that the caller can subscribe
    /// under the client id the server assigned ([`wire::Conn::assigned_client_id`]).
    pub async fn connect(
        &self,
        client_id: &str,
        max_inflight: u16,
    ) -> Result<Connection, CliError> {
        let options = wire::Options {
            client_id: client_id.to_owned(),
            keep_alive: KEEP_ALIVE,
            login: self.login.clone(),
            max_inflight,
            resume: None,
            will: None,
        };
        let opening = async {
            let transport = self.transport().await?;
            wire::Conn::start(transport, options)
                .await
                .map_err(|e| self.start_error(e))
        };
        match tokio::time::timeout(self.timeout, opening).await {
            Ok(result) => result,
            Err(_) => Err(self.failed(
                format!("no CONNACK within {} s", self.timeout.as_secs()),
                "is it an MQTT broker, and does it need --tls? Raise --timeout if it is only slow",
            )),
        }
    }

    async fn transport(&self) -> Result<Transport, CliError> {
        let stream = self.tcp().await?;
        stream
            .set_nodelay(true)
            .map_err(|e| self.failed(format!("setting TCP_NODELAY: {e}"), "retry"))?;
        let Some(connector) = &self.tls else {
            return Ok(Either::Left(stream));
        };
        let name = ServerName::try_from(self.host.clone()).map_err(|e| {
            CliError::usage("--host", format!("{} as a TLS server name: {e}", self.host))
        })?;
        match connector.connect(name, stream).await {
            Ok(tls) => Ok(Either::Right(tls)),
            Err(e) => Err(self.tls_error(&e)),
        }
    }

    async fn tcp(&self) -> Result<TcpStream, CliError> {
        let addrs: Vec<_> = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| {
                self.failed(
                    format!("unknown host {:?} ({e})", self.host),
                    "check the name in --host (or AIO_BROKER_HOSTNAME)",
                )
            })?
            .collect();
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => return Ok(stream),
                Err(e) => last = Some(e),
            }
        }
        let Some(e) = last else {
            return Err(self.failed(
                format!("host {:?} has no address", self.host),
                "check the name in --host (or AIO_BROKER_HOSTNAME)",
            ));
        };
        Err(match e.kind() {
            std::io::ErrorKind::ConnectionRefused => self.failed(
                "connection refused: nothing listens there".into(),
                "is the broker running? Set --host/--port (or AIO_BROKER_HOSTNAME/AIO_BROKER_TCP_PORT)",
            ),
            _ => self.failed(
                e.to_string(),
                "check --host/--port (or AIO_BROKER_HOSTNAME/AIO_BROKER_TCP_PORT) and the network",
            ),
        })
    }

    fn failed(&self, reason: String, fix: &str) -> CliError {
        CliError::Connect {
            addr: self.addr.clone(),
            reason,
            fix: fix.to_owned(),
        }
    }

    fn start_error(&self, error: StartError) -> CliError {
        match error {
            StartError::Refused { code, reason } => {
                let (what, fix) = refusal(code);
                // Not a transient failure: retrying a refused password only spends the address's
                // failed-login allowance.
                CliError::Refused {
                    addr: self.addr.clone(),
                    reason: match reason {
                        Some(r) => format!("{what} ({r})"),
                        None => what.to_owned(),
                    },
                    fix: fix.to_owned(),
                }
            }
            StartError::Failed(why) if self.tls.is_none() && why.contains("closed") => self.failed(
                why,
                "if this port expects TLS, pass --tls and --ca (or AIO_MQTT_USE_TLS, AIO_TLS_CA_FILE)",
            ),
            // TLS 1.3: the server checks our certificate after the client's side of the handshake
            // is done, so its refusal arrives as an alert on the first read.
            StartError::Failed(why) if self.tls.is_some() && why.contains("alert") => {
                self.failed(format!("the broker ended the TLS session ({why})"), CLIENT_CERT_FIX)
            }
            StartError::Failed(why) => self.failed(why, "check that --host/--port is an MQTT 5 broker"),
        }
    }

    fn tls_error(&self, e: &std::io::Error) -> CliError {
        let ca = self.ca.as_deref().unwrap_or("--ca");
        let rustls_error = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match rustls_error {
            Some(rustls::Error::InvalidCertificate(cert)) => {
                use rustls::CertificateError as C;
                match cert {
                    C::NotValidForName | C::NotValidForNameContext { .. } => self.failed(
                        format!("the broker's TLS certificate is not valid for {:?}", self.host),
                        "connect with a name the certificate holds (--host), or have the certificate reissued",
                    ),
                    C::Expired | C::ExpiredContext { .. } => self.failed(
                        "the broker's TLS certificate has expired".into(),
                        "renew the broker's certificate (it reloads on SIGHUP)",
                    ),
                    other => self.failed(
                        format!("the broker's TLS certificate is not trusted ({other:?})"),
                        &format!(
                            "pass the CA that signed it: {ca} does not (--ca, or AIO_TLS_CA_FILE)"
                        ),
                    ),
                }
            }
            Some(rustls::Error::AlertReceived(alert)) => self.failed(
                format!("the broker refused the TLS handshake ({alert:?})"),
                CLIENT_CERT_FIX,
            ),
            Some(rustls::Error::InvalidMessage(_)) => self.failed(
                format!("TLS handshake: {e}"),
                "this port does not speak TLS: drop --tls, or use the broker's TLS port",
            ),
            _ => self.failed(
                format!("TLS handshake: {e}"),
                "check --tls, --ca and the port",
            ),
        }
    }
}

/// What a CONNACK reason code means for a CLI user, and what to do about it.
fn refusal(code: ConnectReturnCode) -> (&'static str, &'static str) {
    use ConnectReturnCode as R;
    match code {
        R::BadUserNamePassword => (
            "wrong user name or password",
            "check --username and the first line of --password-file (or AIO_MQTT_USERNAME, AIO_MQTT_PASSWORD_FILE); the CLI does not retry, so it cannot lock out your address",
        ),
        R::NotAuthorized => (
            "not authorized",
            "the broker wants credentials (--username and --password-file, or a client certificate with --cert/--key), does not allow this client, or is limiting failed logins from this address (wait and retry)",
        ),
        R::ClientIdentifierNotValid => (
            "client id not accepted",
            "pass another --client-id (or unset AIO_MQTT_CLIENT_ID)",
        ),
        R::UnsupportedProtocolVersion => (
            "MQTT 5 not supported",
            "the CLI needs an MQTT 5 broker",
        ),
        R::BadAuthenticationMethod => (
            "authentication method not supported",
            "use a user name and password or a client certificate",
        ),
        R::QuotaExceeded | R::ConnectionRateExceeded | R::ServerBusy => (
            "the broker is at a connection limit",
            "retry later, or raise the broker's limits (max_connections, max_connections_per_address)",
        ),
        R::ServerUnavailable | R::UseAnotherServer | R::ServerMoved => (
            "the broker is not available",
            "connect to another broker (--host/--port)",
        ),
        R::Banned => ("this client is banned", "ask the broker's operator"),
        _ => ("refused", "check the broker's log"),
    }
}

/// A rustls client configuration trusting `--ca`, with `--cert`/`--key` as the client identity if given.
fn tls_config(conn: &ConnectionArgs) -> Result<Arc<ClientConfig>, CliError> {
    let ca = conn.ca.as_ref().ok_or_else(|| {
        CliError::usage(
            "--tls",
            "pass the broker's CA certificate with --ca FILE (or AIO_TLS_CA_FILE)",
        )
    })?;
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca, "--ca")? {
        roots
            .add(cert)
            .map_err(|e| CliError::usage("--ca", format!("not a usable CA certificate: {e}")))?;
    }
    // Explicit provider: no reliance on a process-wide default being installed.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_names_a_fix() {
        for code in [
            ConnectReturnCode::BadUserNamePassword,
            ConnectReturnCode::NotAuthorized,
            ConnectReturnCode::ClientIdentifierNotValid,
            ConnectReturnCode::QuotaExceeded,
            ConnectReturnCode::UnspecifiedError,
        ] {
            let (what, fix) = refusal(code);
            assert!(!what.is_empty() && !fix.is_empty(), "{code:?}");
        }
        assert!(refusal(ConnectReturnCode::BadUserNamePassword)
            .1
            .contains("--password-file"));
    }
}
