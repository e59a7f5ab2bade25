//! A minimal raw MQTT 5 state-store client: one request at a time, every wait bounded.
//!
//! Kept apart from the bench client on purpose: the suite needs persistent sessions, Session Present
//! and per-request deadlines, and nothing of the bench's throughput machinery. Packets are encoded and
//! decoded with rumqttc's public codec (`mqttbytes::v5`), never by hand.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    check, Connect, ConnectProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode, Filter,
    Packet, PubAck, Publish, PublishProperties, Subscribe,
};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout_at, Instant};

pub const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
const MAX_PACKET_BYTES: usize = 1 << 20;
/// First byte of every DISCONNECT (type 14, no flags).
const DISCONNECT_BYTE1: u8 = 0xE0;

/// A state-store reply: payload and `__ts`.
#[derive(Debug, Clone)]
pub struct Reply {
    pub payload: Bytes,
    pub ts: Option<String>,
}

/// A key notification as received.
#[derive(Debug, Clone)]
pub struct Notification {
    pub topic: String,
    pub payload: Bytes,
    pub ts: Option<String>,
}

pub struct Client {
    stream: TcpStream,
    buf: BytesMut,
    response_topic: String,
    next_pkid: u16,
    /// This process's start, so correlation data differs from an earlier driver's too.
    correlation_base: u64,
    /// Notifications that arrived while waiting for a reply.
    pub notifications: Vec<Notification>,
}

/// How to connect.
pub struct Options<'a> {
    pub client_id: &'a str,
    /// `false` with a session expiry: a persistent session that outlives the connection.
    pub clean_start: bool,
    pub session_expiry_secs: u32,
}

impl Client {
    /// CONNECT and SUBSCRIBE to our response topic; returns the client and Session Present.
    pub async fn connect(
        addr: SocketAddr,
        options: Options<'_>,
        deadline: Instant,
    ) -> Result<(Client, bool), String> {
        let stream = timeout_at(deadline, TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("nodelay: {e}"))?;
        let response_topic = format!("clients/{}/robustness/response", options.client_id);
        let mut client = Client {
            stream,
            buf: BytesMut::with_capacity(16 * 1024),
            response_topic,
            next_pkid: 1,
            correlation_base: *PROCESS_START_US,
            notifications: Vec::new(),
        };
        let connect = Connect {
            keep_alive: 30,
            client_id: options.client_id.to_owned(),
            clean_start: options.clean_start,
            properties: Some(ConnectProperties {
                session_expiry_interval: Some(options.session_expiry_secs),
                max_packet_size: Some(MAX_PACKET_BYTES as u32),
                ..ConnectProperties::new()
            }),
        };
        client
            .send(&Packet::Connect(connect, None, None), deadline)
            .await?;
        let session_present = match client.read_packet(deadline).await? {
            Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => ack.session_present,
            Packet::ConnAck(ack) => return Err(format!("CONNACK refused: {:?}", ack.code)),
            other => return Err(format!("expected CONNACK, got {other:?}")),
        };
        let mut subscribe = Subscribe::new(
            Filter::new(client.response_topic.clone(), QoS::AtLeastOnce),
            None,
        );
        subscribe.pkid = client.take_pkid();
        client.send(&Packet::Subscribe(subscribe), deadline).await?;
        loop {
            match client.read_packet(deadline).await? {
                Packet::SubAck(_) => break,
                Packet::Publish(p) => client.take_publish(p, deadline).await?,
                _ => {}
            }
        }
        Ok((client, session_present))
    }

    fn take_pkid(&mut self) -> u16 {
        let id = self.next_pkid;
        self.next_pkid = if id == u16::MAX { 1 } else { id + 1 };
        id
    }

    /// One request; `Err` means the outcome is unknown (timeout or connection lost).
    pub async fn request(
        &mut self,
        args: &[&[u8]],
        ts: &str,
        fencing_token: Option<&str>,
        deadline: Instant,
    ) -> Result<Reply, String> {
        let mut user_properties = vec![("__ts".to_owned(), ts.to_owned())];
        if let Some(ft) = fencing_token {
            user_properties.push(("__ft".to_owned(), ft.to_owned()));
        }
        let payload = mqstate_protocol::encode_request(args);
        let (payload, props) = self
            .call(INVOKE_TOPIC, payload, user_properties, deadline)
            .await?;
        Ok(Reply {
            payload,
            ts: user_property(&props, "__ts"),
        })
    }

    /// A request/reply call on `topic` (the state store's invoke topic, the notification admin
    /// topic): the reply's payload and properties.
    pub async fn call(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        user_properties: Vec<(String, String)>,
        deadline: Instant,
    ) -> Result<(Bytes, PublishProperties), String> {
        // Unique across connections: the server replays its cached reply to a repeated
        // (client id, correlation data), and a reconnecting client keeps its id.
        let mut correlation = BytesMut::with_capacity(16);
        correlation.extend_from_slice(&self.correlation_base.to_be_bytes());
        correlation.extend_from_slice(
            &NEXT_CORRELATION
                .fetch_add(1, Ordering::Relaxed)
                .to_be_bytes(),
        );
        let correlation = correlation.freeze();
        let properties = PublishProperties {
            response_topic: Some(self.response_topic.clone()),
            correlation_data: Some(correlation.clone()),
            user_properties,
            ..PublishProperties::default()
        };
        let mut publish = Publish::new(topic, QoS::AtLeastOnce, payload, Some(properties));
        publish.pkid = self.take_pkid();
        self.send(&Packet::Publish(publish), deadline).await?;
        loop {
            let Packet::Publish(p) = self.read_packet(deadline).await? else {
                continue;
            };
            let props = p.properties.clone().unwrap_or_default();
            let is_reply = p.topic.as_ref() == self.response_topic.as_bytes()
                && props.correlation_data.as_ref() == Some(&correlation);
            if is_reply {
                self.ack(&p, deadline).await?;
                return Ok((p.payload, props));
            }
            self.take_publish(p, deadline).await?;
        }
    }

    /// Waits for the next notification until `deadline` (`Ok(None)` when none came).
    pub async fn next_notification(
        &mut self,
        deadline: Instant,
    ) -> Result<Option<Notification>, String> {
        loop {
            if !self.notifications.is_empty() {
                return Ok(Some(self.notifications.remove(0)));
            }
            match self.read_packet(deadline).await {
                Ok(Packet::Publish(p)) => self.take_publish(p, deadline).await?,
                Ok(_) => {}
                Err(e) if e == TIMED_OUT => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// A PUBLISH that is not our reply: a notification (kept) or a stale reply (dropped).
    async fn take_publish(&mut self, p: Publish, deadline: Instant) -> Result<(), String> {
        self.ack(&p, deadline).await?;
        let topic = String::from_utf8_lossy(&p.topic).into_owned();
        if topic.contains("/command/notify/") {
            let props = p.properties.unwrap_or_default();
            self.notifications.push(Notification {
                topic,
                payload: p.payload,
                ts: user_property(&props, "__ts"),
            });
        }
        Ok(())
    }

    async fn ack(&mut self, p: &Publish, deadline: Instant) -> Result<(), String> {
        if p.qos == QoS::AtMostOnce {
            return Ok(());
        }
        self.send(&Packet::PubAck(PubAck::new(p.pkid, None)), deadline)
            .await
    }

    /// DISCONNECT (normal) and close; errors do not matter any more.
    pub async fn disconnect(mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let packet = Packet::Disconnect(Disconnect::new(DisconnectReasonCode::NormalDisconnection));
        let _ = self.send(&packet, deadline).await;
        let _ = self.stream.shutdown().await;
    }

    async fn send(&mut self, packet: &Packet, deadline: Instant) -> Result<(), String> {
        let mut out = BytesMut::new();
        packet
            .write(&mut out)
            .map_err(|e| format!("encoding: {e}"))?;
        timeout_at(deadline, self.stream.write_all(&out))
            .await
            .map_err(|_| TIMED_OUT.to_owned())?
            .map_err(|e| format!("writing: {e}"))
    }

    async fn read_packet(&mut self, deadline: Instant) -> Result<Packet, String> {
        loop {
            if let Some(packet) = decode(&mut self.buf)? {
                if let Packet::Disconnect(d) = &packet {
                    return Err(format!("server sent DISCONNECT {:?}", d.reason_code));
                }
                return Ok(packet);
            }
            self.buf.reserve(16 * 1024);
            match timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Err(_) => return Err(TIMED_OUT.to_owned()),
                Ok(Ok(0)) => return Err("connection closed by the server".to_owned()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("reading: {e}")),
            }
        }
    }
}

pub const TIMED_OUT: &str = "timed out";

static NEXT_CORRELATION: AtomicU64 = AtomicU64::new(0);
static PROCESS_START_US: std::sync::LazyLock<u64> =
    std::sync::LazyLock::new(crate::history::now_us);

fn user_property(props: &PublishProperties, name: &str) -> Option<String> {
    props
        .user_properties
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

/// The next whole packet at the front of `buf`, or `None` until more bytes arrive.
fn decode(buf: &mut BytesMut) -> Result<Option<Packet>, String> {
    use rumqttc::v5::mqttbytes::Error as CodecError;
    let header = match check(buf.iter(), Some(MAX_PACKET_BYTES)) {
        Ok(header) => header,
        Err(CodecError::InsufficientBytes(_)) => return Ok(None),
        Err(e) => return Err(format!("malformed packet: {e}")),
    };
    // rumqttc 0.24 rejects a DISCONNECT without properties, which MQTT 5 allows.
    if buf[0] == DISCONNECT_BYTE1 && header.frame_length() <= 3 {
        let frame = buf.split_to(header.frame_length());
        let reason = match frame.get(2) {
            Some(&code) => DisconnectReasonCode::try_from(code)
                .map_err(|e| format!("malformed DISCONNECT: {e}"))?,
            None => DisconnectReasonCode::NormalDisconnection,
        };
        return Ok(Some(Packet::Disconnect(Disconnect::new(reason))));
    }
    Packet::read(buf, Some(MAX_PACKET_BYTES))
        .map(Some)
        .map_err(|e| format!("malformed packet: {e}"))
}
