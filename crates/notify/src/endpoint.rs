//! Endpoints by URL: `http://host:port/path` (a JSON batch per POST) and `mqtt://host:port/topic`
//! (one QoS 1 PUBLISH per record). TLS endpoints are not supported yet.

use std::time::Duration;

use crate::http::HttpEndpoint;
use crate::mqtt::MqttEndpoint;
use crate::record::Record;

/// Why an endpoint did not acknowledge (everything).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("invalid endpoint {0:?}: expected http://host:port/path or mqtt://host:port/topic")]
    InvalidUrl(String),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("{0}")]
    Io(String),
    #[error("the endpoint answered {0}")]
    Rejected(String),
    #[error("no acknowledgement within {0:?}")]
    Timeout(Duration),
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

/// `host:port` and the rest of a URL after `scheme://`.
fn split(url: &str, scheme: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix(scheme)?.strip_prefix("://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    Some((authority.to_owned(), path.to_owned()))
}

/// Checks a URL without connecting.
pub fn validate(url: &str) -> Result<(), EndpointError> {
    Endpoint::new(url, "check", Duration::from_secs(1)).map(|_| ())
}

impl Endpoint {
    /// An endpoint for `url`; `client_id` names the MQTT connection.
    pub fn new(url: &str, client_id: &str, timeout: Duration) -> Result<Endpoint, EndpointError> {
        let invalid = || EndpointError::InvalidUrl(url.to_owned());
        if let Some((authority, path)) = split(url, "http") {
            let authority = if authority.contains(':') {
                authority
            } else {
                format!("{authority}:80")
            };
            return Ok(Endpoint::Http(HttpEndpoint::new(authority, path, timeout)));
        }
        if let Some((authority, path)) = split(url, "mqtt") {
            let topic = path.trim_start_matches('/');
            if topic.is_empty() || topic.contains(['+', '#']) {
                return Err(invalid());
            }
            let authority = if authority.contains(':') {
                authority
            } else {
                format!("{authority}:1883")
            };
            return Ok(Endpoint::Mqtt(MqttEndpoint::new(
                authority,
                topic.to_owned(),
                client_id.to_owned(),
                timeout,
            )));
        }
        Err(invalid())
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
        for bad in [
            "",
            "ftp://x/",
            "http://",
            "mqtt://h:1/",
            "mqtt://h:1/a/#",
            "http://u@h/",
        ] {
            assert!(validate(bad).is_err(), "{bad}");
        }
    }
}
