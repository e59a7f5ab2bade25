//! The state-store request path over our own MQTT 5 client: the AIO RPC envelope on top of plain
//! PUBLISHes, used by every CLI command ([`RawClient`]), by `bench` (pipelined, for throughput) and by
//! `bench --responder`. The official AIO SDK speaks the same envelope; `tests/statestore/statestore_sdk.rs` proves
//! our server against it.
//!
//! A request is a QoS 1 PUBLISH of a RESP payload to the invoke topic, carrying a response topic,
//! correlation data and the `__srcId`/`__ts`/`__protVer` user properties (spec §1); the reply comes back
//! on the response topic with the correlation data echoed and `__stat` = 200.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::VecDeque;

use bytes::Bytes;
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_protocol::{encode_request, Hlc, HybridClock, Reply};
use rumqttc::v5::mqttbytes::v5::{Filter, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;

use super::connection::ConnectionArgs;
use super::dial::{Connection, Dialer};
use super::error::CliError;
use super::wire;

/// Request property: the sender's client id.
pub const SOURCE_ID: &str = "__srcId";
/// Request and response property: the sender's HLC.
pub const TIMESTAMP: &str = "__ts";
/// Request and response property: protocol version.
pub const PROTOCOL_VERSION: &str = "__protVer";
/// Write property: the fencing token.
pub const FENCING_TOKEN: &str = "__ft";
/// Response property: the RPC status; `200` on every state-store reply.
pub const STATUS: &str = "__stat";
/// Request property asking AIO to persist a key (what the AIO SDK sends for `persist: true`).
pub const PERSIST: &str = "aio-persistence";
/// The only protocol version spoken.
pub const PROTOCOL_VERSION_VALUE: &str = "1.0";
/// `__stat` of an RPC that reached the state store.
pub const STATUS_OK: &str = "200";
/// Content type of requests and replies.
pub const CONTENT_TYPE: &str = "application/octet-stream";

/// The response topic of a raw client: under `clients/<id>/` like the SDKs, never under the state
/// store's own `clients/statestore/…` prefix (which gets the client disconnected).
pub fn response_topic(client_id: &str) -> String {
    format!("clients/{client_id}/mqstate/response")
}

/// Correlation data for the `seq`-th request of a connection: 16 bytes like the SDKs send.
pub fn correlation(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&u128::from(seq).to_be_bytes())
}

/// Inverse of [`correlation`]; `None` for data this process did not produce.
pub fn correlation_seq(data: &[u8]) -> Option<u64> {
    let bytes: [u8; 16] = data.try_into().ok()?;
    u64::try_from(u128::from_be_bytes(bytes)).ok()
}

/// A client's clock for `__ts`. HLC node ids may not contain `:`, client ids may.
pub fn client_clock(client_id: &str) -> HybridClock {
    let node: String = client_id
        .chars()
        .map(|c| if c == ':' { '_' } else { c })
        .collect();
    let node = if node.is_empty() {
        "mqstate".to_owned()
    } else {
        node
    };
    HybridClock::new(
        Arc::from(node),
        mqstate_protocol::hlc::DEFAULT_MAX_CLOCK_DRIFT_MS,
    )
    .unwrap_or_else(|_| {
        HybridClock::new(
            Arc::from("mqstate"),
            mqstate_protocol::hlc::DEFAULT_MAX_CLOCK_DRIFT_MS,
        )
        .unwrap_or_else(|_| unreachable!("`mqstate` is a valid node id"))
    })
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The properties of one request PUBLISH.
pub fn request_properties(
    client_id: &str,
    response_topic: &str,
    correlation: Bytes,
    ts: &Hlc,
    fencing: Option<&Hlc>,
    timeout: Duration,
) -> PublishProperties {
    let mut user_properties = vec![
        (SOURCE_ID.to_owned(), client_id.to_owned()),
        (TIMESTAMP.to_owned(), ts.to_string()),
        (
            PROTOCOL_VERSION.to_owned(),
            PROTOCOL_VERSION_VALUE.to_owned(),
        ),
    ];
    if let Some(token) = fencing {
        user_properties.push((FENCING_TOKEN.to_owned(), token.to_string()));
    }
    PublishProperties {
        response_topic: Some(response_topic.to_owned()),
        correlation_data: Some(correlation),
        user_properties,
        content_type: Some(CONTENT_TYPE.to_owned()),
        message_expiry_interval: Some(u32::try_from(timeout.as_secs().max(1)).unwrap_or(u32::MAX)),
        ..PublishProperties::default()
    }
}

/// The value of a user property, if present.
pub fn user_property<'a>(properties: Option<&'a PublishProperties>, name: &str) -> Option<&'a str> {
    properties?
        .user_properties
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A reply: its payload and the server's `__ts` (the key's version on SET and GET hits).
#[derive(Debug)]
pub struct Response {
    pub payload: Bytes,
    pub ts: Option<String>,
}

/// In flight at once on a CLI connection: one request, and PUBACKs of earlier ones that trail their
/// replies (the server sends the reply first).
pub const CLI_INFLIGHT: u16 = 16;

/// One state-store request of `client_id` on an open [`wire::Conn`] subscribed to its response
/// topic, as the simulations' clients send it: correlation data [`correlation`]`(seq)`, `ts` as
/// its `__ts`, `fencing` as its `__ft`, `expiry` as its message expiry. Waits for the reply with that correlation data,
/// acknowledging every PUBLISH on the way (late replies to earlier requests are skipped).
/// `Ok(Err(code))`: the broker refused the PUBLISH (its PUBACK's reason code); `Err`: the
/// connection failed. Not bounded in time: the caller bounds it.
pub async fn exchange<S>(
    conn: &mut wire::Conn<S>,
    client_id: &str,
    seq: u64,
    payload: Bytes,
    ts: &Hlc,
    fencing: Option<&Hlc>,
    expiry: Duration,
) -> Result<Result<Publish, u8>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let correlation = correlation(seq);
    let properties = request_properties(
        client_id,
        &response_topic(client_id),
        correlation.clone(),
        ts,
        fencing,
        expiry,
    );
    let mut publish = wire::publish(
        &Bytes::from_static(INVOKE_TOPIC.as_bytes()),
        QoS::AtLeastOnce,
        payload,
        Some(properties),
    );
    while !conn.window_open() {
        // The previous request's PUBACK is still owed: wait for it.
        conn.read().await?;
        while let Some(p) = conn.next()? {
            conn.acknowledge(&p)?;
        }
        conn.flush().await?;
    }
    conn.publish(&mut publish)?;
    conn.flush().await?;
    loop {
        if let wire::Turn::Input = conn.read().await? {
            while let Some(p) = conn.next()? {
                conn.acknowledge(&p)?;
                let properties = p.properties.as_ref();
                if properties.and_then(|p| p.correlation_data.as_ref()) != Some(&correlation) {
                    // A late reply to an earlier request of this client.
                    continue;
                }
                conn.flush().await?;
                return Ok(Ok(p));
            }
        }
        if let Some(code) = conn.take_refusal() {
            return Ok(Err(code));
        }
        conn.flush().await?;
    }
}

/// A sequential state-store client (one request at a time) over our own MQTT 5 client ([`wire`]):
/// the CLI's path to any AIO-compatible broker.
pub struct RawClient {
    link: Connection,
    client_id: String,
    response_topic: String,
    invoke: Bytes,
    clock: HybridClock,
    addr: String,
    timeout: Duration,
    /// PUBLISHes that are not replies (key notifications), oldest first.
    others: VecDeque<Publish>,
}

impl RawClient {
    /// Connects (one attempt), then subscribes to the response topic under the client id the server
    /// uses for us: the one we sent, or the one it imposed (a certificate identity with
    /// `use_identity_as_client_id`) and announced in the CONNACK.
    pub async fn connect(conn: &ConnectionArgs) -> Result<RawClient, CliError> {
        let dialer = Dialer::new(conn)?;
        let requested = conn.client_id("mqstate");
        let mut link = dialer.connect(&requested, CLI_INFLIGHT).await?;
        let client_id = link.assigned_client_id().map_or(requested, str::to_owned);
        let response_topic = response_topic(&client_id);
        let filters = vec![Filter::new(response_topic.as_str(), QoS::AtLeastOnce)];
        let subscribed = tokio::time::timeout(conn.timeout(), link.subscribe(filters))
            .await
            .unwrap_or_else(|_| Err(format!("no SUBACK within {} s", conn.timeout)));
        if let Err(reason) = subscribed {
            return Err(CliError::Connect {
                addr: conn.addr(),
                reason: format!("subscribing to the response topic {response_topic}: {reason}"),
                fix: "the broker's ACL must let this client subscribe to clients/<client id>/#"
                    .into(),
            });
        }
        Ok(RawClient {
            link,
            clock: client_clock(&client_id),
            client_id,
            response_topic,
            invoke: Bytes::from_static(INVOKE_TOPIC.as_bytes()),
            addr: conn.addr(),
            timeout: conn.timeout(),
            others: VecDeque::new(),
        })
    }

    /// The client id the server knows us by (key notifications are addressed to it).
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Sends one request and waits for its reply (replies to older, abandoned requests are skipped;
    /// other PUBLISHes are kept for [`RawClient::notification`]). A request larger than the server's
    /// Maximum Packet Size is refused here, before anything is sent.
    pub async fn request(
        &mut self,
        args: &[Bytes],
        fencing: Option<&Hlc>,
    ) -> Result<Response, CliError> {
        self.request_with(args, fencing, &[]).await
    }

    /// [`RawClient::request`] with extra user properties (such as [`PERSIST`]).
    pub async fn request_with(
        &mut self,
        args: &[Bytes],
        fencing: Option<&Hlc>,
        extra: &[(&str, &str)],
    ) -> Result<Response, CliError> {
        let command =
            String::from_utf8_lossy(args.first().map_or(&b""[..], |a| a.as_ref())).into_owned();
        // Random, like the SDKs' UUIDs: the server deduplicates by (client id, correlation data),
        // and with a certificate identity every CLI call has the same client id.
        let correlation = Bytes::copy_from_slice(&rand::random::<u128>().to_be_bytes());
        let ts = self.clock.now(now_ms());
        let mut properties = request_properties(
            &self.client_id,
            &self.response_topic,
            correlation.clone(),
            &ts,
            fencing,
            self.timeout,
        );
        properties.user_properties.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let mut publish = wire::publish(
            &self.invoke,
            QoS::AtLeastOnce,
            encode_request(args),
            Some(properties),
        );
        if let Some(max) = self.link.server_max_packet() {
            let size = publish.size();
            if size > max as usize {
                return Err(CliError::TooLarge { command, size, max });
            }
        }
        let timeout = self.timeout;
        let exchange = async {
            while !self.link.window_open() {
                let other = self.next_publish().await?;
                self.keep(other);
            }
            self.link.publish(&mut publish).map_err(|e| self.lost(e))?;
            self.link.flush().await.map_err(|e| self.lost(e))?;
            loop {
                let p = self.next_publish().await?;
                if p.topic.as_ref() != self.response_topic.as_bytes() {
                    self.keep(p);
                    continue;
                }
                let props = p.properties.as_ref();
                if props.and_then(|p| p.correlation_data.as_ref()) != Some(&correlation) {
                    continue;
                }
                check_status(&command, props)?;
                let ts = user_property(props, TIMESTAMP).map(str::to_owned);
                if let Some(seen) = ts.as_deref().and_then(|t| Hlc::parse(t).ok()) {
                    self.clock.observe(&seen);
                }
                return Ok(Response {
                    payload: p.payload.clone(),
                    ts,
                });
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(CliError::Timeout {
                command,
                timeout_s: timeout.as_secs(),
            }),
        }
    }

    /// Sends one JSON request to an admin topic (`mqstate topic`, `mqstate cluster`) and returns its
    /// reply's payload. The broker's refusal (a failed PUBACK, e.g. 0x87 without admin rights) is
    /// reported as such, not as a timeout.
    pub async fn call(
        &mut self,
        topic: &str,
        payload: Bytes,
        command: &str,
    ) -> Result<Bytes, CliError> {
        let correlation = Bytes::copy_from_slice(&rand::random::<u128>().to_be_bytes());
        let properties = PublishProperties {
            response_topic: Some(self.response_topic.clone()),
            correlation_data: Some(correlation.clone()),
            content_type: Some("application/json".into()),
            message_expiry_interval: Some(
                u32::try_from(self.timeout.as_secs()).unwrap_or(u32::MAX),
            ),
            ..PublishProperties::default()
        };
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let mut publish = wire::publish(&topic, QoS::AtLeastOnce, payload, Some(properties));
        let timeout = self.timeout;
        let exchange = async {
            self.link.publish(&mut publish).map_err(|e| self.lost(e))?;
            self.link.flush().await.map_err(|e| self.lost(e))?;
            loop {
                let p = self.next_publish_or_refusal(command).await?;
                let ours = p.topic.as_ref() == self.response_topic.as_bytes()
                    && p.properties
                        .as_ref()
                        .and_then(|p| p.correlation_data.as_ref())
                        == Some(&correlation);
                if ours {
                    return Ok(p.payload.clone());
                }
                self.keep(p);
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(CliError::Timeout {
                command: command.to_owned(),
                timeout_s: timeout.as_secs(),
            }),
        }
    }

    /// [`RawClient::next_publish`], failing as soon as a PUBACK refuses our request.
    async fn next_publish_or_refusal(&mut self, command: &str) -> Result<Publish, CliError> {
        loop {
            if let Some(p) = self.link.next().map_err(|e| self.lost(e))? {
                self.link.acknowledge(&p).map_err(|e| self.lost(e))?;
                return Ok(p);
            }
            // Every packet read so far is handled: a refusing PUBACK among them is final.
            if let Some(code) = self.link.take_refusal() {
                return Err(CliError::Admin {
                    command: command.to_owned(),
                    text: format!(
                        "the broker refused the request (reason code 0x{code:02X}); \
                         with an ACL, admin commands need write access to their admin topic"
                    ),
                });
            }
            self.link.flush().await.map_err(|e| self.lost(e))?;
            self.link.read().await.map_err(|e| self.lost(e))?;
        }
    }

    /// The next PUBLISH that is not a reply (a key notification), acknowledged; waits as long as it
    /// takes, answering keep-alive meanwhile. An error when the connection ends.
    pub async fn notification(&mut self) -> Result<Publish, CliError> {
        loop {
            if let Some(p) = self.others.pop_front() {
                return Ok(p);
            }
            let p = self.next_publish().await?;
            // A reply nobody waits for any more (its request timed out) is dropped.
            if p.topic.as_ref() != self.response_topic.as_bytes() {
                return Ok(p);
            }
        }
    }

    /// Sends DISCONNECT (the session expires with the connection: nothing is left on the server) and
    /// waits, at most the reply timeout, for the server to close.
    pub async fn close(self) {
        let _ = tokio::time::timeout(self.timeout, self.link.disconnect()).await;
    }

    fn keep(&mut self, p: Publish) {
        if p.topic.as_ref() != self.response_topic.as_bytes() {
            self.others.push_back(p);
        }
    }

    /// The next PUBLISH from the server, its PUBACK queued (it leaves with the next write).
    async fn next_publish(&mut self) -> Result<Publish, CliError> {
        loop {
            if let Some(p) = self.link.next().map_err(|e| self.lost(e))? {
                self.link.acknowledge(&p).map_err(|e| self.lost(e))?;
                return Ok(p);
            }
            self.link.flush().await.map_err(|e| self.lost(e))?;
            self.link.read().await.map_err(|e| self.lost(e))?;
        }
    }

    fn lost(&self, reason: String) -> CliError {
        CliError::ConnectionLost {
            addr: self.addr.clone(),
            reason,
        }
    }
}

/// Fails unless the reply carries `__stat` = 200 (spec §1: required on every state-store reply).
fn check_status(command: &str, properties: Option<&PublishProperties>) -> Result<(), CliError> {
    match user_property(properties, STATUS) {
        Some(STATUS_OK) => Ok(()),
        Some(other) => Err(CliError::Protocol {
            command: command.to_owned(),
            detail: format!(
                "status {other}{}",
                user_property(properties, "__stMsg").map_or(String::new(), |m| format!(" ({m})"))
            ),
        }),
        None => Err(CliError::Protocol {
            command: command.to_owned(),
            detail: "no __stat property".into(),
        }),
    }
}

/// Parses a reply payload for `command`, turning `-ERR` into [`CliError::Service`].
pub fn parse_reply(command: &str, payload: &Bytes) -> Result<Reply, CliError> {
    match Reply::parse(payload) {
        Ok(Reply::Error(kind)) => {
            let text = kind.as_str().to_owned();
            Err(CliError::Service {
                command: command.to_owned(),
                condition: super::error::is_fencing_rejection(&text),
                text,
            })
        }
        Ok(reply) => Ok(reply),
        Err(e) => match payload.strip_prefix(b"-ERR ") {
            Some(text) => {
                let text = String::from_utf8_lossy(text).trim_end().to_owned();
                Err(CliError::Service {
                    command: command.to_owned(),
                    condition: super::error::is_fencing_rejection(&text),
                    text,
                })
            }
            None => Err(CliError::Protocol {
                command: command.to_owned(),
                detail: e.to_string(),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correlation_round_trips_and_is_16_bytes() {
        let c = correlation(42);
        assert_eq!(c.len(), 16);
        assert_eq!(correlation_seq(&c), Some(42));
        assert_eq!(correlation_seq(b"short"), None);
    }

    #[test]
    fn response_topic_is_not_under_the_state_store_prefix() {
        let topic = response_topic("abc");
        assert!(!mqstate_protocol::topic::is_forbidden_response_topic(
            &topic, "abc"
        ));
        assert_ne!(topic, INVOKE_TOPIC);
    }

    #[test]
    fn request_properties_carry_the_envelope() {
        let mut clock = client_clock("cli:1");
        let ts = clock.now(1_700_000_000_000);
        let props = request_properties(
            "cli:1",
            "r/t",
            correlation(7),
            &ts,
            Some(&ts),
            Duration::from_secs(3),
        );
        assert_eq!(props.response_topic.as_deref(), Some("r/t"));
        assert_eq!(props.correlation_data, Some(correlation(7)));
        assert_eq!(props.message_expiry_interval, Some(3));
        assert_eq!(user_property(Some(&props), SOURCE_ID), Some("cli:1"));
        assert_eq!(user_property(Some(&props), PROTOCOL_VERSION), Some("1.0"));
        let ts_text = user_property(Some(&props), TIMESTAMP).unwrap();
        assert!(ts_text.starts_with("001700000000000:"), "{ts_text}");
        assert!(ts_text.ends_with(":cli_1"), "{ts_text}");
        assert_eq!(user_property(Some(&props), FENCING_TOKEN), Some(ts_text));
    }

    #[test]
    fn status_must_be_200() {
        let mut props = PublishProperties::default();
        assert!(check_status("GET", Some(&props)).is_err());
        props.user_properties.push((STATUS.into(), "400".into()));
        assert!(check_status("GET", Some(&props)).is_err());
        props.user_properties[0].1 = "200".into();
        assert!(check_status("GET", Some(&props)).is_ok());
    }

    #[test]
    fn err_replies_become_service_errors() {
        let err = parse_reply(
            "SET",
            &Bytes::from_static(b"-ERR the quota has been exceeded\r\n"),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CliError::Service {
                    condition: false,
                    ..
                }
            ),
            "{err:?}"
        );
        let unknown =
            parse_reply("SET", &Bytes::from_static(b"-ERR something new\r\n")).unwrap_err();
        assert!(unknown.to_string().contains("something new"));
        assert_eq!(
            parse_reply("SET", &Bytes::from_static(b"+OK\r\n")).unwrap(),
            Reply::Ok
        );
        assert!(matches!(
            parse_reply("SET", &Bytes::from_static(b"garbage")),
            Err(CliError::Protocol { .. })
        ));
    }
}
