//! Our own MQTT 5 client, used by the CLI and the load generator: rumqttc 0.24 never sets TCP_NODELAY,
//! and with request/response traffic its Nagle delay meets the peer's delayed ACK and stalls requests
//! ~40 ms, so the client, not the server, would be measured (`docs/decisions/0013-bench-client.md`);
//! and the CLI must see a refused CONNECT as it is, not as a reconnect loop.
//!
//! One task owns one connection ([`Conn`]) and drives it in turns: [`Conn::read`] waits for bytes,
//! [`Conn::next`] decodes every whole packet (a PUBACK frees its slot of our QoS 1 window on the spot,
//! a PUBLISH is handed out), the task queues what it owes and what it wants to send next
//! ([`Conn::acknowledge`], [`Conn::publish`]) into one write buffer, and [`Conn::flush`] sends the
//! whole turn with one write — the PUBACK of a reply leaves with the next request. The load generator
//! shares the server's cores, so there are no tasks, locks or wake-ups between the socket and the
//! workload: each would be CPU taken from the server being measured.
//!
//! Packets are encoded and decoded with rumqttc's public codec (`mqttbytes::v5`), never by hand. A
//! DISCONNECT from the server, a malformed packet, a PUBACK for nothing in flight or a closed socket
//! is an error naming it. [`Conn::read`] also returns every [`TICK`], so a task blocked on a silent
//! server still sees its deadlines, and sends PINGREQ once the connection has been quiet for most of the
//! keep-alive.
//!
//! Only what the tools need: QoS 0 and 1, one SUBSCRIBE right after the CONNACK; a clean start with
//! session expiry 0 (nothing is left on the server after DISCONNECT or a lost connection) for the
//! CLI and the load generator, a persistent session for the simulations' KEYNOTIFY observers.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    check, ConnAck, Connect, ConnectProperties, ConnectReturnCode, Disconnect,
    DisconnectReasonCode, Filter, LastWill, Login, Packet, PingReq, PubAck, PubAckReason, Publish,
    PublishProperties, Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::{Error as CodecError, QoS};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Interval, MissedTickBehavior};

/// Largest packet we accept (advertised in CONNECT): the MQTT maximum, since values may be large.
pub const MAX_PACKET_BYTES: u32 = super::connection::MAX_PACKET_BYTES;
/// How often [`Conn::read`] returns without input: the granularity of keep-alive and of the
/// callers' deadlines, coarse enough to cost nothing next to the traffic.
pub const TICK: Duration = Duration::from_millis(100);
/// Bytes the reader asks the socket for at a time.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// The packet id of the handshake's SUBSCRIBE (free again before any PUBLISH is sent).
const SUBSCRIBE_PKID: u16 = 1;
/// Receive Maximum when the server's CONNACK does not state one (MQTT 5 §3.2.2.3.3).
const DEFAULT_RECEIVE_MAXIMUM: u16 = u16::MAX;
/// First byte of every DISCONNECT (type 14, no flags).
const DISCONNECT_BYTE1: u8 = 0xE0;

pub struct Options {
    pub client_id: String,
    pub keep_alive: Duration,
    pub login: Option<Login>,
    /// Our own cap on outgoing QoS 1 publishes awaiting PUBACK; the server's Receive Maximum may lower it.
    pub max_inflight: u16,
    /// `None`: a clean start with session expiry 0. `Some(expiry)`: a session that outlives the
    /// connection by `expiry` seconds, resumed if the server has it ([`Conn::session_present`]).
    pub resume: Option<u32>,
    /// The will the CONNECT carries (the cluster simulation's will clients; the tools send none).
    pub will: Option<LastWill>,
}

/// Why [`Conn::start`] failed: the server refused the CONNECT, or anything else went wrong.
#[derive(Debug)]
pub enum StartError {
    Refused {
        code: ConnectReturnCode,
        reason: Option<String>,
    },
    Failed(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Refused { code, reason } => {
                write!(f, "broker refused the connection: {code:?}")?;
                match reason {
                    Some(r) => write!(f, " ({r})"),
                    None => Ok(()),
                }
            }
            StartError::Failed(why) => f.write_str(why),
        }
    }
}

impl From<String> for StartError {
    fn from(why: String) -> Self {
        StartError::Failed(why)
    }
}

/// What [`Conn::read`] waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Bytes arrived: [`Conn::next`] has packets to decode (or part of one).
    Input,
    /// A [`TICK`] passed without input.
    Tick,
}

/// The MQTT 5 reason code of a PUBACK. rumqttc's enum has no discriminants, so `as u8` would give
/// its position (NotAuthorized = 4), and no refusal would ever reach 0x80.
fn puback_code(reason: PubAckReason) -> u8 {
    match reason {
        PubAckReason::Success => 0x00,
        PubAckReason::NoMatchingSubscribers => 0x10,
        PubAckReason::UnspecifiedError => 0x80,
        PubAckReason::ImplementationSpecificError => 0x83,
        PubAckReason::NotAuthorized => 0x87,
        PubAckReason::TopicNameInvalid => 0x90,
        PubAckReason::PacketIdentifierInUse => 0x91,
        PubAckReason::QuotaExceeded => 0x97,
        PubAckReason::PayloadFormatInvalid => 0x99,
    }
}

/// Packet ids of our QoS 1 publishes: a free list, and which ids await their PUBACK.
struct PacketIds {
    free: Vec<u16>,
    in_flight: Vec<bool>,
}

impl PacketIds {
    fn new(window: u16) -> PacketIds {
        PacketIds {
            free: (1..=window).rev().collect(),
            in_flight: vec![false; usize::from(window) + 1],
        }
    }

    fn take(&mut self) -> Option<u16> {
        let id = self.free.pop()?;
        self.in_flight[usize::from(id)] = true;
        Some(id)
    }

    /// Frees the id a PUBACK names; an error if it was not in flight (the server is confused).
    fn release(&mut self, pkid: u16) -> Result<(), String> {
        match self.in_flight.get_mut(usize::from(pkid)) {
            Some(slot) if *slot => {
                *slot = false;
                self.free.push(pkid);
                Ok(())
            }
            _ => Err(format!(
                "server sent PUBACK for packet id {pkid}, which is not in flight"
            )),
        }
    }
}

/// One MQTT connection, owned and driven by one task.
pub struct Conn<S> {
    stream: S,
    read_buf: BytesMut,
    write_buf: BytesMut,
    ids: PacketIds,
    /// PUBLISHes that arrived before the SUBACK, handed out first.
    early: VecDeque<Publish>,
    /// The reason code of the last PUBACK that refused a publish (≥ 0x80), until taken.
    refused: Option<u8>,
    tick: Interval,
    /// PINGREQ once nothing has been written for this long (none when the keep-alive is 0).
    quiet_limit: Option<Duration>,
    last_write: Instant,
    /// The client id the server uses for us, if it differs from the one we sent (an empty one, or an
    /// identity imposed by a client certificate).
    assigned_client_id: Option<String>,
    /// The largest packet the server accepts (CONNACK Maximum Packet Size), if it set one.
    server_max_packet: Option<u32>,
    /// CONNACK's Session Present.
    session_present: bool,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// Sends CONNECT on an established byte stream and waits for the CONNACK.
    pub async fn start(mut stream: S, options: Options) -> Result<Conn<S>, StartError> {
        let mut read_buf = BytesMut::with_capacity(READ_CHUNK_BYTES);
        let connack = handshake_connect(&mut stream, &mut read_buf, &options).await?;
        let properties = connack.properties.as_ref();
        let receive_maximum = properties
            .and_then(|p| p.receive_max)
            .unwrap_or(DEFAULT_RECEIVE_MAXIMUM);
        let window = options.max_inflight.min(receive_maximum).max(1);
        let keep_alive = properties
            .and_then(|p| p.server_keep_alive)
            .map_or(options.keep_alive, |s| Duration::from_secs(u64::from(s)));
        let mut tick = tokio::time::interval_at(Instant::now() + TICK, TICK);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ok(Conn {
            stream,
            read_buf,
            write_buf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            ids: PacketIds::new(window),
            tick,
            quiet_limit: (keep_alive > Duration::ZERO).then(|| keep_alive * 3 / 4),
            last_write: Instant::now(),
            assigned_client_id: properties.and_then(|p| p.assigned_client_identifier.clone()),
            server_max_packet: properties.and_then(|p| p.max_packet_size),
            early: VecDeque::new(),
            refused: None,
            session_present: connack.session_present,
        })
    }

    /// Subscribes to `filters` and waits for the SUBACK (PUBLISHes that arrive first are kept for
    /// [`Conn::next`]). Only before the first QoS 1 [`Conn::publish`]: the SUBSCRIBE's packet id is
    /// fixed.
    pub async fn subscribe(&mut self, filters: Vec<Filter>) -> Result<(), String> {
        debug_assert!(
            self.ids.in_flight.iter().all(|busy| !busy),
            "subscribe runs before any QoS 1 publish"
        );
        self.flush().await?;
        let early = handshake_subscribe(&mut self.stream, &mut self.read_buf, filters).await?;
        self.early.extend(early);
        Ok(())
    }

    /// The client id the server assigned or imposed, when it is not the one we asked for.
    pub fn assigned_client_id(&self) -> Option<&str> {
        self.assigned_client_id.as_deref()
    }

    /// Whether the server resumed a session it kept (CONNACK's Session Present).
    pub fn session_present(&self) -> bool {
        self.session_present
    }

    /// The server's Maximum Packet Size, if it announced one.
    pub fn server_max_packet(&self) -> Option<u32> {
        self.server_max_packet
    }

    /// Whether a QoS 1 [`Conn::publish`] may go out now (a slot of the window is free).
    pub fn window_open(&self) -> bool {
        !self.ids.free.is_empty()
    }

    /// Queues a PUBLISH for the next [`Conn::flush`]; a QoS 1 one takes a slot of the window, which
    /// must be open, and its packet id is set. By reference, so a caller can reuse one PUBLISH.
    pub fn publish(&mut self, publish: &mut Publish) -> Result<(), String> {
        if publish.qos != QoS::AtMostOnce {
            publish.pkid = self
                .ids
                .take()
                .ok_or("no free slot in the QoS 1 window (the caller checks window_open)")?;
        }
        publish
            .write(&mut self.write_buf)
            .map_err(|e| format!("encoding PUBLISH: {e}"))?;
        Ok(())
    }

    /// Queues the PUBACK a QoS 1 PUBLISH from [`Conn::next`] is owed (nothing for QoS 0). Owed, not
    /// automatic: a task that is not ready to take more can hold it back, and the server's flow control
    /// then holds further PUBLISHes back in the server.
    pub fn acknowledge(&mut self, publish: &Publish) -> Result<(), String> {
        if publish.qos == QoS::AtMostOnce {
            return Ok(());
        }
        PubAck::new(publish.pkid, None)
            .write(&mut self.write_buf)
            .map_err(|e| format!("encoding PUBACK: {e}"))?;
        Ok(())
    }

    /// The next PUBLISH among the bytes read so far, handling PUBACKs and PINGRESPs on the way;
    /// `None` once only part of a packet (or nothing) is left.
    // Not `Iterator::next`: a step over the bytes read so far that can fail, and `None` means "read
    // more", not "finished".
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Publish>, String> {
        if let Some(early) = self.early.pop_front() {
            return Ok(Some(early));
        }
        loop {
            let packet = decode(&mut self.read_buf)
                .map_err(|e| format!("malformed packet from the server: {e}"))?;
            match packet {
                None => return Ok(None),
                Some(Packet::Publish(publish)) => return Ok(Some(publish)),
                Some(Packet::PubAck(ack)) => {
                    self.ids.release(ack.pkid)?;
                    let code = puback_code(ack.reason);
                    if code >= 0x80 {
                        self.refused = Some(code);
                    }
                }
                Some(Packet::PingResp(_)) => {}
                Some(Packet::Disconnect(d)) => return Err(disconnected(&d)),
                Some(other) => {
                    tracing::debug!(packet = packet_name(&other), "MQTT client ignores packet");
                }
            }
        }
    }

    /// The reason code of a PUBACK that refused one of our publishes since the last call, if any.
    pub fn take_refusal(&mut self) -> Option<u8> {
        self.refused.take()
    }

    /// Sends everything queued since the last flush, in one write.
    pub async fn flush(&mut self) -> Result<(), String> {
        if self.write_buf.is_empty() {
            return Ok(());
        }
        let written = async {
            self.stream.write_all(&self.write_buf).await?;
            // A no-op on TCP; TLS may hold records back until flushed.
            self.stream.flush().await
        };
        written.await.map_err(|e| format!("writing: {e}"))?;
        self.write_buf.clear();
        self.last_write = Instant::now();
        Ok(())
    }

    /// Waits for bytes from the server or the next [`TICK`], whichever is first. On a tick of a quiet
    /// connection a PINGREQ is queued: callers flush after every turn.
    pub async fn read(&mut self) -> Result<Turn, String> {
        self.read_buf.reserve(READ_CHUNK_BYTES);
        tokio::select! {
            biased;
            read = self.stream.read_buf(&mut self.read_buf) => match read {
                Ok(0) => Err("connection closed by the server".into()),
                Ok(_) => Ok(Turn::Input),
                Err(e) => Err(format!("reading: {e}")),
            },
            _ = self.tick.tick() => {
                if self.quiet_limit.is_some_and(|quiet| self.last_write.elapsed() >= quiet) {
                    PingReq::write(&mut self.write_buf)
                        .map_err(|e| format!("encoding PINGREQ: {e}"))?;
                }
                Ok(Turn::Tick)
            }
        }
    }

    /// Sends DISCONNECT (normal, session expiry 0) after everything queued, shuts our side down, then
    /// waits for the server to close its side. Closing the socket earlier, with PUBACKs still unread,
    /// would send a reset that can make the server drop our last PUBLISHes.
    pub async fn disconnect(mut self) -> Result<(), String> {
        Disconnect::new(DisconnectReasonCode::NormalDisconnection)
            .write(&mut self.write_buf)
            .map_err(|e| format!("encoding DISCONNECT: {e}"))?;
        self.flush().await?;
        self.stream
            .shutdown()
            .await
            .map_err(|e| format!("closing: {e}"))?;
        loop {
            self.read_buf.clear();
            match self.stream.read_buf(&mut self.read_buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(format!("reading: {e}")),
            }
        }
    }
}

/// A PUBLISH to `topic` (shared, not copied) with `payload`, for [`Conn::publish`].
pub fn publish(
    topic: &Bytes,
    qos: QoS,
    payload: Bytes,
    properties: Option<PublishProperties>,
) -> Publish {
    Publish {
        dup: false,
        qos,
        retain: false,
        topic: topic.clone(),
        pkid: 0,
        payload,
        properties,
    }
}

/// The next whole packet at the front of `buf`, or `None` until more bytes arrive.
fn decode(buf: &mut BytesMut) -> Result<Option<Packet>, CodecError> {
    // Framing first: only a missing tail of the frame means "wait"; once the frame is whole, any
    // error (including a field that runs past the frame) is a malformed packet.
    let header = match check(buf.iter(), Some(MAX_PACKET_BYTES as usize)) {
        Ok(header) => header,
        Err(CodecError::InsufficientBytes(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    // rumqttc 0.24 rejects a DISCONNECT without properties: remaining length 0 (reason "normal") or 1
    // (the reason code alone), both valid (MQTT 5 §3.14.2.1).
    if buf[0] == DISCONNECT_BYTE1 && header.frame_length() <= 3 {
        let frame = buf.split_to(header.frame_length());
        let reason = match frame.get(2) {
            Some(&code) => DisconnectReasonCode::try_from(code)?,
            None => DisconnectReasonCode::NormalDisconnection,
        };
        return Ok(Some(Packet::Disconnect(Disconnect::new(reason))));
    }
    Packet::read(buf, Some(MAX_PACKET_BYTES as usize)).map(Some)
}

/// Reads until one whole packet is decoded (the handshake, before the connection runs in turns).
async fn read_packet<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
) -> Result<Packet, String> {
    loop {
        if let Some(packet) =
            decode(buf).map_err(|e| format!("malformed packet from the server: {e}"))?
        {
            return Ok(packet);
        }
        buf.reserve(READ_CHUNK_BYTES);
        match reader.read_buf(buf).await {
            Ok(0) => return Err("connection closed by the server".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading: {e}")),
        }
    }
}

fn encode(packet: &Packet) -> Result<BytesMut, String> {
    let mut out = BytesMut::new();
    packet
        .write(&mut out)
        .map_err(|e| format!("encoding {}: {e}", packet_name(packet)))?;
    Ok(out)
}

fn disconnected(d: &Disconnect) -> String {
    let reason = d
        .properties
        .as_ref()
        .and_then(|p| p.reason_string.as_deref())
        .map_or(String::new(), |r| format!(" ({r})"));
    format!("server sent DISCONNECT {:?}{reason}", d.reason_code)
}

async fn handshake_connect<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    options: &Options,
) -> Result<ConnAck, StartError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let connect = Connect {
        keep_alive: u16::try_from(options.keep_alive.as_secs()).unwrap_or(u16::MAX),
        client_id: options.client_id.clone(),
        clean_start: options.resume.is_none(),
        properties: Some(ConnectProperties {
            session_expiry_interval: options.resume,
            max_packet_size: Some(MAX_PACKET_BYTES),
            ..ConnectProperties::new()
        }),
    };
    let packet = Packet::Connect(connect, options.will.clone(), options.login.clone());
    send(stream, &encode(&packet)?)
        .await
        .map_err(|e| format!("sending CONNECT: {e}"))?;
    match read_packet(stream, buf).await? {
        Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => Ok(ack),
        Packet::ConnAck(ack) => Err(StartError::Refused {
            code: ack.code,
            reason: ack.properties.and_then(|p| p.reason_string),
        }),
        Packet::Disconnect(d) => Err(disconnected(&d).into()),
        other => Err(format!("expected CONNACK, got {}", packet_name(&other)).into()),
    }
}

/// Subscribes and waits for the SUBACK; PUBLISHes that arrive first are returned, unacknowledged.
async fn handshake_subscribe<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    filters: Vec<Filter>,
) -> Result<VecDeque<Publish>, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let wanted: Vec<String> = filters.iter().map(|f| f.path.clone()).collect();
    let mut subscribe = Subscribe::new_many(filters, None);
    subscribe.pkid = SUBSCRIBE_PKID;
    send(stream, &encode(&Packet::Subscribe(subscribe))?)
        .await
        .map_err(|e| format!("sending SUBSCRIBE: {e}"))?;
    let mut early = VecDeque::new();
    loop {
        match read_packet(stream, buf).await? {
            Packet::SubAck(ack) => {
                if let Some(code) = ack
                    .return_codes
                    .iter()
                    .find(|c| !matches!(c, SubscribeReasonCode::Success(_)))
                {
                    return Err(format!("subscription to {wanted:?} refused: {code:?}"));
                }
                return Ok(early);
            }
            Packet::Publish(publish) => early.push_back(publish),
            Packet::Disconnect(d) => return Err(disconnected(&d)),
            _ => {}
        }
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

fn packet_name(packet: &Packet) -> &'static str {
    match packet {
        Packet::Connect(..) => "CONNECT",
        Packet::ConnAck(_) => "CONNACK",
        Packet::Publish(_) => "PUBLISH",
        Packet::PubAck(_) => "PUBACK",
        Packet::PingReq(_) => "PINGREQ",
        Packet::PingResp(_) => "PINGRESP",
        Packet::Subscribe(_) => "SUBSCRIBE",
        Packet::SubAck(_) => "SUBACK",
        Packet::PubRec(_) => "PUBREC",
        Packet::PubRel(_) => "PUBREL",
        Packet::PubComp(_) => "PUBCOMP",
        Packet::Unsubscribe(_) => "UNSUBSCRIBE",
        Packet::UnsubAck(_) => "UNSUBACK",
        Packet::Disconnect(_) => "DISCONNECT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::v5::mqttbytes::v5::{ConnAckProperties, SubAck};
    use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

    fn bytes_of(packet: &Packet) -> BytesMut {
        encode(packet).unwrap()
    }

    fn publish_with_id(topic: &str, qos: QoS, pkid: u16, payload: &'static [u8]) -> Publish {
        let mut p = Publish::new(topic, qos, Bytes::from_static(payload), None);
        p.pkid = pkid;
        p
    }

    fn connack(receive_max: Option<u16>) -> Packet {
        let properties = receive_max.map(|r| ConnAckProperties {
            session_expiry_interval: None,
            receive_max: Some(r),
            max_qos: None,
            retain_available: None,
            max_packet_size: None,
            assigned_client_identifier: None,
            topic_alias_max: None,
            reason_string: None,
            user_properties: Vec::new(),
            wildcard_subscription_available: None,
            subscription_identifiers_available: None,
            shared_subscription_available: None,
            server_keep_alive: None,
            response_information: None,
            server_reference: None,
            authentication_method: None,
            authentication_data: None,
        });
        Packet::ConnAck(ConnAck {
            session_present: false,
            code: ConnectReturnCode::Success,
            properties,
        })
    }

    /// Client options, and the filters [`connected`] subscribes to after the CONNACK.
    fn options(max_inflight: u16, filters: Vec<Filter>) -> (Options, Vec<Filter>) {
        let options = Options {
            client_id: "wire-test".into(),
            keep_alive: Duration::from_secs(60),
            login: None,
            max_inflight,
            resume: None,
            will: None,
        };
        (options, filters)
    }

    /// The broker's side of an in-memory connection, decoding what the client sends.
    struct FakeBroker {
        reader: ReadHalf<DuplexStream>,
        writer: WriteHalf<DuplexStream>,
        buf: BytesMut,
    }

    impl FakeBroker {
        /// The client's end of an in-memory connection, and the fake broker at the other.
        fn pair() -> (DuplexStream, FakeBroker) {
            let (client_end, broker_end) = tokio::io::duplex(1 << 16);
            let (reader, writer) = tokio::io::split(broker_end);
            let broker = FakeBroker {
                reader,
                writer,
                buf: BytesMut::new(),
            };
            (client_end, broker)
        }

        async fn next(&mut self) -> Packet {
            read_packet(&mut self.reader, &mut self.buf).await.unwrap()
        }

        async fn send(&mut self, bytes: &[u8]) {
            self.writer.write_all(bytes).await.unwrap();
            self.writer.flush().await.unwrap();
        }
    }

    /// Starts a client against a fake broker that answers CONNECT with `ack` sent one byte at a time.
    async fn connected(
        ack: Packet,
        (opts, filters): (Options, Vec<Filter>),
    ) -> (Conn<DuplexStream>, FakeBroker) {
        let (client_end, mut broker) = FakeBroker::pair();
        let has_filters = !filters.is_empty();
        let client = tokio::spawn(async move {
            let mut conn = Conn::start(client_end, opts).await?;
            if !filters.is_empty() {
                conn.subscribe(filters).await?;
            }
            Ok::<_, StartError>(conn)
        });
        assert!(matches!(broker.next().await, Packet::Connect(..)));
        // CONNACK split across reads: every byte is its own write.
        for byte in bytes_of(&ack).iter() {
            broker.send(&[*byte]).await;
            tokio::task::yield_now().await;
        }
        if has_filters {
            let Packet::Subscribe(sub) = broker.next().await else {
                panic!("expected SUBSCRIBE")
            };
            let suback = Packet::SubAck(SubAck {
                pkid: sub.pkid,
                return_codes: vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)],
                properties: None,
            });
            broker.send(&bytes_of(&suback)).await;
        }
        (client.await.unwrap().unwrap(), broker)
    }

    /// Reads until [`Conn::next`] yields a PUBLISH (or fails), as a connection's task does.
    async fn next_publish(conn: &mut Conn<DuplexStream>) -> Result<Publish, String> {
        loop {
            if let Some(publish) = conn.next()? {
                return Ok(publish);
            }
            conn.read().await?;
        }
    }

    #[test]
    fn decode_waits_for_a_whole_packet_and_keeps_the_rest() {
        let first = bytes_of(&Packet::Publish(publish_with_id(
            "a/b",
            QoS::AtLeastOnce,
            7,
            b"one",
        )));
        let second = bytes_of(&Packet::PubAck(PubAck::new(9, None)));
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&first);
        wire.extend_from_slice(&second);

        // Every split point of the first packet: nothing is decoded and nothing is consumed.
        for cut in 0..first.len() {
            let mut partial = BytesMut::from(&wire[..cut]);
            assert!(decode(&mut partial).unwrap().is_none(), "cut at {cut}");
            assert_eq!(partial.len(), cut);
        }
        // Both packets in one read come out in order, leaving nothing behind.
        let Some(Packet::Publish(p)) = decode(&mut wire).unwrap() else {
            panic!("expected PUBLISH")
        };
        assert_eq!(
            (p.pkid, &p.payload[..], &p.topic[..]),
            (7, &b"one"[..], &b"a/b"[..])
        );
        let Some(Packet::PubAck(ack)) = decode(&mut wire).unwrap() else {
            panic!("expected PUBACK")
        };
        assert_eq!(ack.pkid, 9);
        assert!(wire.is_empty());
        assert!(decode(&mut wire).unwrap().is_none());
    }

    #[test]
    fn disconnects_without_properties_decode() {
        // Remaining length 0: reason "normal"; remaining length 1: the reason code alone.
        let mut wire = BytesMut::from(&[0xE0, 0x00, 0xE0, 0x01, 0x8E, 0xD0][..]);
        let Some(Packet::Disconnect(d)) = decode(&mut wire).unwrap() else {
            panic!("expected DISCONNECT")
        };
        assert_eq!(d.reason_code, DisconnectReasonCode::NormalDisconnection);
        let Some(Packet::Disconnect(d)) = decode(&mut wire).unwrap() else {
            panic!("expected DISCONNECT")
        };
        assert_eq!(d.reason_code, DisconnectReasonCode::SessionTakenOver);
        assert_eq!(&wire[..], &[0xD0]);
    }

    #[test]
    fn a_field_running_past_its_frame_is_malformed_not_incomplete() {
        // A PUBACK whose remaining length (1) cannot hold its packet id: waiting would hang forever.
        let mut wire = BytesMut::from(&[0x40, 0x01, 0x00][..]);
        assert!(decode(&mut wire).is_err());
    }

    #[test]
    fn garbage_is_a_decode_error() {
        let mut wire = BytesMut::from(&[0x00, 0x00][..]);
        assert!(decode(&mut wire).is_err());
    }

    #[tokio::test]
    async fn packets_split_across_reads_and_batched_in_one_read_all_arrive() {
        let filter = Filter::new("t/#", QoS::AtLeastOnce);
        let (mut conn, mut broker) = connected(connack(None), options(8, vec![filter])).await;
        // Three PUBLISHes in one write, the third cut in half and finished by a later write.
        let mut wire = BytesMut::new();
        for (i, payload) in [&b"p1"[..], b"p2", b"p3"].into_iter().enumerate() {
            let p = publish_with_id("t/x", QoS::AtLeastOnce, 10 + i as u16, payload);
            wire.extend_from_slice(&bytes_of(&Packet::Publish(p)));
        }
        let cut = wire.len() - 3;
        broker.send(&wire[..cut]).await;
        let first = next_publish(&mut conn).await.unwrap();
        let second = next_publish(&mut conn).await.unwrap();
        // The rest of the third is not here yet: nothing more to decode.
        assert!(conn.next().unwrap().is_none());
        broker.send(&wire[cut..]).await;
        let third = next_publish(&mut conn).await.unwrap();
        assert_eq!(
            [&first.payload[..], &second.payload[..], &third.payload[..]],
            [b"p1", b"p2", b"p3"]
        );
        // Each QoS 1 PUBLISH acknowledged is acknowledged with its own packet id, all in one write.
        for publish in [&first, &second, &third] {
            conn.acknowledge(publish).unwrap();
        }
        conn.flush().await.unwrap();
        for pkid in 10..13 {
            let Packet::PubAck(ack) = broker.next().await else {
                panic!("expected PUBACK")
            };
            assert_eq!(ack.pkid, pkid);
        }
    }

    #[tokio::test]
    async fn the_servers_receive_maximum_caps_publishes_in_flight() {
        let (mut conn, mut broker) = connected(connack(Some(1)), options(8, Vec::new())).await;
        let topic = Bytes::from_static(b"req");
        let request = || publish(&topic, QoS::AtLeastOnce, Bytes::from_static(b"x"), None);
        assert!(conn.window_open());
        conn.publish(&mut request()).unwrap();
        conn.flush().await.unwrap();
        let Packet::Publish(first) = broker.next().await else {
            panic!("expected PUBLISH")
        };
        // The window of one is full until the PUBACK arrives.
        assert!(!conn.window_open());
        assert!(conn.publish(&mut request()).is_err());
        broker
            .send(&bytes_of(&Packet::PubAck(PubAck::new(first.pkid, None))))
            .await;
        while !conn.window_open() {
            conn.read().await.unwrap();
            assert!(conn.next().unwrap().is_none());
        }
        conn.publish(&mut request()).unwrap();
        conn.flush().await.unwrap();
        let Packet::Publish(second) = broker.next().await else {
            panic!("expected PUBLISH")
        };
        assert_eq!(second.pkid, first.pkid, "the freed packet id is reused");
    }

    #[tokio::test]
    async fn a_reply_puback_and_the_next_request_leave_in_one_write() {
        let filter = Filter::new("resp", QoS::AtLeastOnce);
        let (mut conn, mut broker) = connected(connack(None), options(8, vec![filter])).await;
        let reply = publish_with_id("resp", QoS::AtLeastOnce, 5, b"+OK");
        broker.send(&bytes_of(&Packet::Publish(reply))).await;
        let got = next_publish(&mut conn).await.unwrap();
        conn.acknowledge(&got).unwrap();
        let topic = Bytes::from_static(b"req");
        conn.publish(&mut publish(&topic, QoS::AtLeastOnce, Bytes::new(), None))
            .unwrap();
        conn.flush().await.unwrap();
        // One read on the broker's side holds both packets.
        let mut chunk = BytesMut::with_capacity(1024);
        broker.reader.read_buf(&mut chunk).await.unwrap();
        assert!(matches!(decode(&mut chunk), Ok(Some(Packet::PubAck(a))) if a.pkid == 5));
        assert!(matches!(decode(&mut chunk), Ok(Some(Packet::Publish(_)))));
        assert!(chunk.is_empty());
    }

    #[tokio::test]
    async fn a_server_disconnect_fails_loudly() {
        let (mut conn, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        let disconnect = Disconnect::new(DisconnectReasonCode::SessionTakenOver);
        broker
            .send(&bytes_of(&Packet::Disconnect(disconnect)))
            .await;
        let err = next_publish(&mut conn).await.unwrap_err();
        assert!(err.contains("DISCONNECT SessionTakenOver"), "{err}");
    }

    #[tokio::test]
    async fn a_closed_socket_fails_loudly() {
        let (mut conn, broker) = connected(connack(None), options(8, Vec::new())).await;
        drop(broker);
        let err = next_publish(&mut conn).await.unwrap_err();
        assert!(err.contains("closed by the server"), "{err}");
    }

    #[tokio::test]
    async fn a_puback_for_an_unknown_id_ends_the_connection() {
        let (mut conn, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        broker
            .send(&bytes_of(&Packet::PubAck(PubAck::new(42, None))))
            .await;
        let err = next_publish(&mut conn).await.unwrap_err();
        assert!(err.contains("packet id 42"), "{err}");
    }

    /// A resumed session: no clean start, the session expiry asked for, and the CONNACK's Session
    /// Present reported; without `resume`, a clean start with no expiry (the CLI's).
    #[tokio::test]
    async fn resume_asks_for_the_session_and_reports_whether_it_was_there() {
        for (resume, present) in [(Some(3_600), true), (None, false)] {
            let (client_end, mut broker) = FakeBroker::pair();
            let (opts, _) = options(8, Vec::new());
            let client = tokio::spawn(Conn::start(client_end, Options { resume, ..opts }));
            let Packet::Connect(connect, ..) = broker.next().await else {
                panic!("expected CONNECT")
            };
            assert_eq!(connect.clean_start, resume.is_none());
            assert_eq!(
                connect.properties.and_then(|p| p.session_expiry_interval),
                resume
            );
            let ack = Packet::ConnAck(ConnAck {
                session_present: present,
                code: ConnectReturnCode::Success,
                properties: None,
            });
            broker.send(&bytes_of(&ack)).await;
            let conn = client.await.unwrap().unwrap();
            assert_eq!(conn.session_present(), present);
        }
    }

    #[tokio::test]
    async fn a_quiet_connection_sends_pingreq() {
        let (opts, filters) = options(8, Vec::new());
        let opts = (
            Options {
                keep_alive: Duration::from_secs(1),
                ..opts
            },
            filters,
        );
        let (mut conn, mut broker) = connected(connack(None), opts).await;
        // Keep-alive 1 s: quiet for 0.75 s, then a PINGREQ goes out with the next flush.
        loop {
            assert_eq!(conn.read().await.unwrap(), Turn::Tick);
            conn.flush().await.unwrap();
            if conn.last_write.elapsed() < TICK {
                break;
            }
        }
        assert!(matches!(broker.next().await, Packet::PingReq(_)));
    }

    #[tokio::test]
    async fn disconnect_flushes_queued_publishes_then_waits_for_the_server_to_close() {
        let (mut conn, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        let topic = Bytes::from_static(b"t");
        for _ in 0..3 {
            conn.publish(&mut publish(
                &topic,
                QoS::AtMostOnce,
                Bytes::from_static(b"q0"),
                None,
            ))
            .unwrap();
        }
        let disconnecting = tokio::spawn(conn.disconnect());
        for _ in 0..3 {
            assert!(matches!(broker.next().await, Packet::Publish(_)));
        }
        assert!(matches!(broker.next().await, Packet::Disconnect(_)));
        // Still open from the server's side: the client waits rather than resetting the socket.
        tokio::task::yield_now().await;
        assert!(!disconnecting.is_finished());
        broker.writer.shutdown().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), disconnecting)
            .await
            .expect("disconnect returns once the server closes")
            .unwrap()
            .unwrap();
    }
}
