//! Endpoints by URL: `http://host:port/path` and `https://…` (a JSON batch per POST),
//! `mqtt://host:port/topic` and `mqtts://…` (one QoS 1 PUBLISH per record).

use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;

use crate::dial::Dialer;
use crate::http::HttpEndpoint;
use crate::mqtt::MqttEndpoint;
use crate::record::Record;

/// Why an endpoint did not acknowledge (everything).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error(
        "invalid endpoint {0:?}: expected http(s)://host:port/path or mqtt(s)://host:port/topic"
    )]
    InvalidUrl(String),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("{0}")]
    Io(String),
    #[error("the endpoint answered {0}")]
    Rejected(String),
    #[error("no acknowledgement within {0:?}")]
    Timeout(Duration),
    #[error("TLS endpoint {url:?} unusable: {reason}")]
    Tls { url: String, reason: String },
}

/// The outcome of one push: the first `acknowledged` records were acknowledged, in order.
#[derive(Debug)]
pub struct Pushed {
    pub acknowledged: usize,
    /// Why the rest were not.
    pub error: Option<EndpointError>,
}

/// A connection (or the means to make one) to one endpoint.
pub enum Endpoint {
    Http(HttpEndpoint),
    Mqtt(MqttEndpoint),
}

/// How an endpoint connects.
#[derive(Clone)]
pub struct Options {
    /// Names the MQTT connection.
    pub client_id: String,
    /// How long a push may take to be acknowledged.
    pub timeout: Duration,
    /// The TLS configuration of `https` and `mqtts` endpoints (`crate::tls::client_config`).
    pub tls: Option<Arc<ClientConfig>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http,
    Mqtt,
}

/// A URL taken apart.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    protocol: Protocol,
    tls: bool,
    /// `host:port`, the default port filled in.
    authority: String,
    host: String,
    /// The HTTP path, or the MQTT topic.
    path: String,
}

impl Target {
    fn parse(url: &str) -> Result<Target, EndpointError> {
        let invalid = || EndpointError::InvalidUrl(url.to_owned());
        let (scheme, rest) = url.split_once("://").ok_or_else(invalid)?;
        let (protocol, tls, default_port) = match scheme {
            "http" => (Protocol::Http, false, 80),
            "https" => (Protocol::Http, true, 443),
            "mqtt" => (Protocol::Mqtt, false, 1883),
            "mqtts" => (Protocol::Mqtt, true, 8883),
            _ => return Err(invalid()),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(invalid());
        }
        // `host`, `host:port`, `[v6]` or `[v6]:port`.
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (host, after) = v6.split_once(']').ok_or_else(invalid)?;
                (host, after.strip_prefix(':'))
            }
            None => match authority.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            },
        };
        let port = match port {
            Some(port) => port.parse::<u16>().map_err(|_| invalid())?,
            None => default_port,
        };
        if host.is_empty() {
            return Err(invalid());
        }
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let path = match protocol {
            Protocol::Http => path.to_owned(),
            Protocol::Mqtt => {
                let topic = path.trim_start_matches('/');
                if topic.is_empty() || topic.contains(['+', '#']) {
                    return Err(invalid());
                }
                topic.to_owned()
            }
        };
        Ok(Target {
            protocol,
            tls,
            authority,
            host: host.to_owned(),
            path,
        })
    }
}

/// Checks a URL without connecting.
pub fn validate(url: &str) -> Result<(), EndpointError> {
    Target::parse(url).map(|_| ())
}

/// Whether a URL needs TLS (`https`, `mqtts`).
pub fn uses_tls(url: &str) -> bool {
    Target::parse(url).is_ok_and(|t| t.tls)
}

impl Endpoint {
    /// An endpoint for `url`; a TLS one needs `options.tls`.
    pub fn new(url: &str, options: &Options) -> Result<Endpoint, EndpointError> {
        let target = Target::parse(url)?;
        let tls = match (target.tls, &options.tls) {
            (false, _) => None,
            (true, Some(config)) => Some(Arc::clone(config)),
            (true, None) => {
                return Err(EndpointError::Tls {
                    url: url.to_owned(),
                    reason: "no TLS configuration".into(),
                })
            }
        };
        let dialer = Dialer::new(target.authority, target.host, tls);
        Ok(match target.protocol {
            Protocol::Http => {
                Endpoint::Http(HttpEndpoint::new(dialer, target.path, options.timeout))
            }
            Protocol::Mqtt => Endpoint::Mqtt(MqttEndpoint::new(
                dialer,
                target.path,
                options.client_id.clone(),
                options.timeout,
            )),
        })
    }

    /// Pushes `records` in order; reports how many were acknowledged.
    pub async fn push(&mut self, records: &[Record]) -> Pushed {
        match self {
            Endpoint::Http(http) => http.push(records).await,
            Endpoint::Mqtt(mqtt) => mqtt.push(records).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert!(validate("http://127.0.0.1:8080/hook").is_ok());
        assert!(validate("http://example").is_ok());
        assert!(validate("mqtt://127.0.0.1:1883/changes/all").is_ok());
        assert!(validate("https://example/hook").is_ok());
        assert!(validate("mqtts://[::1]:8883/t").is_ok());
        for bad in [
            "",
            "ftp://x/",
            "http://",
            "mqtt://h:1/",
            "mqtt://h:1/a/#",
            "http://u@h/",
            "http://h:port/",
            "http://h:70000/",
            "https://:443/",
            "mqtts://[::1/t",
        ] {
            assert!(validate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn default_ports_and_hosts() {
        let t = Target::parse("https://example.org/hook?x=1").unwrap();
        assert_eq!(
            (
                t.protocol,
                t.tls,
                t.authority.as_str(),
                t.host.as_str(),
                t.path.as_str()
            ),
            (
                Protocol::Http,
                true,
                "example.org:443",
                "example.org",
                "/hook?x=1"
            )
        );
        let t = Target::parse("mqtts://[::1]/a/b").unwrap();
        assert_eq!(
            (t.authority.as_str(), t.host.as_str(), t.path.as_str()),
            ("[::1]:8883", "::1", "a/b")
        );
        assert_eq!(Target::parse("http://h").unwrap().authority, "h:80");
        assert_eq!(Target::parse("mqtt://h/t").unwrap().authority, "h:1883");
        assert!(uses_tls("mqtts://h/t") && !uses_tls("mqtt://h/t"));
    }

    #[test]
    fn a_tls_endpoint_needs_a_tls_configuration() {
        let options = Options {
            client_id: "c".into(),
            timeout: Duration::from_secs(1),
            tls: None,
        };
        assert!(matches!(
            Endpoint::new("https://h/", &options),
            Err(EndpointError::Tls { .. })
        ));
        assert!(Endpoint::new("http://h/", &options).is_ok());
    }
}
