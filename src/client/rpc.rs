//! The raw MQTT 5 request path (rumqttc v5): the AIO RPC envelope on top of plain PUBLISHes, used by
//! `scan` (not in SDK 1.3.0), by `bench` (pipelined, for throughput) and by `bench --responder`.
//!
//! A request is a QoS 1 PUBLISH of a RESP payload to the invoke topic, carrying a response topic,
//! correlation data and the `__srcId`/`__ts`/`__protVer` user properties (spec §1); the reply comes back
//! on the response topic with the correlation data echoed and `__stat` = 200.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_protocol::{encode_request, Hlc, HybridClock, Reply};
use rumqttc::v5::mqttbytes::v5::{
    ConnectReturnCode, Filter, Packet, Publish, PublishProperties, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::sync::mpsc;

use super::connection::ConnectionArgs;
use super::error::CliError;

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
/// The only protocol version spoken.
pub const PROTOCOL_VERSION_VALUE: &str = "1.0";
/// `__stat` of an RPC that reached the state store.
pub const STATUS_OK: &str = "200";
/// Content type of requests and replies.
pub const CONTENT_TYPE: &str = "application/octet-stream";
/// Channel capacity between a raw client and its event loop task.
pub const EVENT_CHANNEL_CAPACITY: usize = 64;

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

/// A connected rumqttc client whose subscriptions are acknowledged.
pub struct Connected {
    pub client: AsyncClient,
    pub eventloop: EventLoop,
}

/// Connects, waits for CONNACK, subscribes to `filters` and waits for their SUBACK, all within `timeout`.
pub async fn open(
    options: MqttOptions,
    filters: Vec<Filter>,
    channel_capacity: usize,
    timeout: Duration,
) -> Result<Connected, CliError> {
    let (host, port) = options.broker_address();
    let addr = format!("{host}:{port}");
    let (client, mut eventloop) = AsyncClient::new(options, channel_capacity);
    let connect_error = |reason: String| CliError::Connect {
        addr: addr.clone(),
        reason,
    };
    let handshake = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    if ack.code != ConnectReturnCode::Success {
                        return Err(connect_error(format!("broker refused: {:?}", ack.code)));
                    }
                    break;
                }
                Ok(_) => {}
                Err(e) => return Err(connect_error(e.to_string())),
            }
        }
        if filters.is_empty() {
            return Ok(());
        }
        let wanted: Vec<String> = filters.iter().map(|f| f.path.clone()).collect();
        client
            .subscribe_many(filters)
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    if let Some(code) = ack
                        .return_codes
                        .iter()
                        .find(|c| !matches!(c, SubscribeReasonCode::Success(_)))
                    {
                        return Err(connect_error(format!(
                            "subscription to {wanted:?} refused: {code:?}"
                        )));
                    }
                    return Ok(());
                }
                // No request is out yet, so no PUBLISH now can be a reply we wait for.
                Ok(_) => {}
                Err(e) => return Err(connect_error(e.to_string())),
            }
        }
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(Ok(())) => Ok(Connected { client, eventloop }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(connect_error(format!(
            "no CONNACK/SUBACK within {} s",
            timeout.as_secs()
        ))),
    }
}

/// A sequential raw state-store client (one request at a time), for commands the SDK lacks.
pub struct RawClient {
    client: AsyncClient,
    client_id: String,
    response_topic: String,
    clock: HybridClock,
    next_seq: u64,
    replies: mpsc::Receiver<Result<Publish, String>>,
    addr: String,
    timeout: Duration,
    pump: tokio::task::JoinHandle<()>,
}

impl RawClient {
    pub async fn connect(conn: &ConnectionArgs) -> Result<RawClient, CliError> {
        let client_id = conn.client_id("mqstate");
        let response_topic = response_topic(&client_id);
        let filters = vec![Filter::new(response_topic.as_str(), QoS::AtLeastOnce)];
        let connected = open(
            conn.mqtt_options(&client_id)?,
            filters,
            EVENT_CHANNEL_CAPACITY,
            conn.timeout(),
        )
        .await?;
        let (tx, replies) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        let mut eventloop = connected.eventloop;
        let topic = response_topic.clone();
        let pump = tokio::spawn(async move {
            loop {
                let item = match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p)))
                        if p.topic.as_ref() == topic.as_bytes() =>
                    {
                        Ok(p)
                    }
                    Ok(Event::Incoming(Packet::Disconnect(d))) => {
                        Err(format!("broker sent DISCONNECT {:?}", d.reason_code))
                    }
                    Ok(_) => continue,
                    Err(e) => Err(e.to_string()),
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    return;
                }
            }
        });
        Ok(RawClient {
            client: connected.client,
            clock: client_clock(&client_id),
            client_id,
            response_topic,
            next_seq: 0,
            replies,
            addr: conn.addr(),
            timeout: conn.timeout(),
            pump,
        })
    }

    /// Sends one request and waits for its reply payload (replies to older, abandoned requests are skipped).
    pub async fn request(&mut self, args: &[Bytes]) -> Result<Bytes, CliError> {
        let command =
            String::from_utf8_lossy(args.first().map_or(&b""[..], |a| a.as_ref())).into_owned();
        self.next_seq += 1;
        let correlation = correlation(self.next_seq);
        let ts = self.clock.now(now_ms());
        let properties = request_properties(
            &self.client_id,
            &self.response_topic,
            correlation.clone(),
            &ts,
            None,
            self.timeout,
        );
        self.client
            .publish_with_properties(
                INVOKE_TOPIC,
                QoS::AtLeastOnce,
                false,
                encode_request(args),
                properties,
            )
            .await
            .map_err(|e| CliError::ConnectionLost {
                addr: self.addr.clone(),
                reason: e.to_string(),
            })?;
        let wait = async {
            loop {
                match self.replies.recv().await {
                    Some(Ok(p)) => {
                        let props = p.properties.as_ref();
                        if props.and_then(|p| p.correlation_data.as_ref()) != Some(&correlation) {
                            continue;
                        }
                        return check_status(&command, props).map(|()| p.payload.clone());
                    }
                    Some(Err(reason)) => {
                        return Err(CliError::ConnectionLost {
                            addr: self.addr.clone(),
                            reason,
                        })
                    }
                    None => {
                        return Err(CliError::ConnectionLost {
                            addr: self.addr.clone(),
                            reason: "event loop stopped".into(),
                        })
                    }
                }
            }
        };
        match tokio::time::timeout(self.timeout, wait).await {
            Ok(result) => result,
            Err(_) => Err(CliError::Timeout {
                command,
                timeout_s: self.timeout.as_secs(),
            }),
        }
    }

    /// Sends DISCONNECT (session expiry 0, so the broker forgets the session) and stops the event loop.
    pub async fn close(self) {
        let _ = self.client.disconnect().await;
        // The pump ends when the connection closes; give it the reply timeout at most.
        let _ = tokio::time::timeout(self.timeout, self.pump).await;
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
