//! Connection flags shared by every CLI command and `bench`, with the AIO environment variables as
//! defaults (the same ones the AIO SDKs read). [`super::dial`] turns them into a connection.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;

use super::error::CliError;

/// Default broker host (a local `mqstate serve`).
pub const DEFAULT_HOST: &str = "127.0.0.1";
/// Default broker port (MQTT over TCP).
pub const DEFAULT_PORT: u16 = 1883;
/// Default for `--timeout`: how long to wait for the broker to accept the connection and for each reply.
pub const DEFAULT_TIMEOUT_S: u64 = 10;
/// MQTT keep-alive of every connection the tools open.
pub const KEEP_ALIVE: Duration = Duration::from_secs(60);
/// Largest packet our client accepts: the MQTT maximum, since values may be large (spec §2) and
/// rumqttc's own default is only 10 KiB.
pub const MAX_PACKET_BYTES: u32 = 268_435_455;

#[derive(clap::Args, Debug, Clone)]
pub struct ConnectionArgs {
    /// Broker host name or address.
    #[arg(long, env = "AIO_BROKER_HOSTNAME", default_value = DEFAULT_HOST)]
    pub host: String,
    /// Broker TCP port.
    #[arg(long, env = "AIO_BROKER_TCP_PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Connect with TLS (`--tls` or `--tls=false`).
    #[arg(long, env = "AIO_MQTT_USE_TLS", value_parser = BoolishValueParser::new(),
          num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub tls: bool,
    /// PEM file of the CA that signed the broker's certificate.
    #[arg(long, env = "AIO_TLS_CA_FILE", value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate (X.509 authentication); needs --key.
    #[arg(
        long,
        env = "AIO_TLS_CERT_FILE",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(
        long = "key",
        env = "AIO_TLS_KEY_FILE",
        value_name = "FILE",
        requires = "cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// MQTT user name.
    #[arg(long, env = "AIO_MQTT_USERNAME")]
    pub username: Option<String>,
    /// File holding the MQTT password (never pass secrets as arguments).
    #[arg(long, env = "AIO_MQTT_PASSWORD_FILE", value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// MQTT client id (default: `mqstate-<random>`).
    #[arg(long, env = "AIO_MQTT_CLIENT_ID")]
    pub client_id: Option<String>,
    /// Seconds to wait for the connection and for each reply.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_TIMEOUT_S,
          value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    pub timeout: u64,
}

impl ConnectionArgs {
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout)
    }

    /// The configured client id, or a fresh random one (so two CLI runs never steal each other's session).
    pub fn client_id(&self, prefix: &str) -> String {
        match &self.client_id {
            Some(id) => id.clone(),
            None => format!("{prefix}-{:016x}", rand::random::<u64>()),
        }
    }

    /// User name and password (read from `--password-file`) of a raw MQTT connection, if a user is given.
    pub fn credentials(&self) -> Result<Option<(String, String)>, CliError> {
        let Some(username) = &self.username else {
            return Ok(None);
        };
        let password = match &self.password_file {
            Some(path) => read_password(path)?,
            None => String::new(),
        };
        Ok(Some((username.clone(), password)))
    }
}

fn read_file(path: &PathBuf, flag: &str) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Input {
        what: format!("{flag} {}", path.display()),
        source,
    })
}

/// The password is the file's first line: editors and `echo` leave a trailing newline that is not part of it.
fn read_password(path: &PathBuf) -> Result<String, CliError> {
    let bytes = read_file(path, "--password-file")?;
    let text = String::from_utf8(bytes).map_err(|_| {
        CliError::usage(
            "--password-file",
            format!("{} is not UTF-8 text", path.display()),
        )
    })?;
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        conn: ConnectionArgs,
    }

    #[test]
    fn defaults_are_a_local_plain_broker() {
        let probe = Probe::try_parse_from(["probe"]).unwrap();
        // The AIO variables are not set in the test environment, so the defaults apply.
        if std::env::var_os("AIO_BROKER_HOSTNAME").is_none() {
            assert_eq!(probe.conn.addr(), "127.0.0.1:1883");
        }
        if std::env::var_os("AIO_MQTT_USE_TLS").is_none() {
            assert!(!probe.conn.tls);
        }
    }

    #[test]
    fn tls_flag_takes_an_optional_boolean() {
        let on = Probe::try_parse_from(["probe", "--tls"]).unwrap();
        assert!(on.conn.tls);
        let off = Probe::try_parse_from(["probe", "--tls=false"]).unwrap();
        assert!(!off.conn.tls);
    }

    #[test]
    fn cert_needs_key() {
        assert!(Probe::try_parse_from(["probe", "--cert", "c.pem"]).is_err());
        assert!(Probe::try_parse_from(["probe", "--cert", "c.pem", "--key", "k.pem"]).is_ok());
    }

    #[test]
    fn password_is_the_first_line_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "s3cret\n").unwrap();
        assert_eq!(read_password(&path).unwrap(), "s3cret");
    }

    #[test]
    fn generated_client_ids_differ() {
        let conn = Probe::try_parse_from(["probe"]).unwrap().conn;
        if conn.client_id.is_none() {
            assert_ne!(conn.client_id("mqstate"), conn.client_id("mqstate"));
        }
    }
}
