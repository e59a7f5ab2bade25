//! The load generator's own MQTT 5 client for plain TCP: rumqttc 0.24 never sets TCP_NODELAY, and with
//! request/response traffic its Nagle delay meets the peer's delayed ACK and stalls requests ~40 ms,
//! so the client, not the server, would be measured (`docs/decisions/0013-bench-client.md`).
//!
//! A connection is a socket with `TCP_NODELAY`, a reader task and a writer task. Packets are encoded and
//! decoded with rumqttc's public codec (`mqttbytes::v5`), never by hand. Senders encode straight into
//! one shared outbox; the writer hands everything queued since its last wake-up to one `write_all`. The
//! reader decodes every whole packet in its buffer, releases our QoS 1 window on PUBACK and queues
//! PUBLISHes for [`Incoming::recv`], which acknowledges QoS 1 ones as the application takes them — so
//! the server's own flow control bounds what waits unread. The writer sends PINGREQ when the connection
//! has been quiet for most of the keep-alive. A DISCONNECT from the server, a malformed packet or a
//! closed socket ends the connection with an error that both halves report.
//!
//! Only what the benchmark needs: clean start, QoS 0 and 1, one SUBSCRIBE during the handshake.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    check, ConnAck, Connect, ConnectProperties, ConnectReturnCode, Disconnect,
    DisconnectReasonCode, Filter, Login, Packet, PingReq, PubAck, Publish, PublishProperties,
    Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::{Error as CodecError, QoS};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Largest packet we accept (advertised in CONNECT): the MQTT maximum, since values may be large.
pub const MAX_PACKET_BYTES: u32 = crate::client::connection::MAX_PACKET_BYTES;
/// Bytes queued for the writer beyond which senders wait: bounds memory when the socket is slower
/// than the producers (QoS 0 publishers have no other limit).
const OUTBOX_HIGH_WATER_BYTES: usize = 1 << 20;
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
    /// Subscribed (and acknowledged) before [`connect`] returns.
    pub filters: Vec<Filter>,
}

/// Connects to `addr` with `TCP_NODELAY`, sends CONNECT and SUBSCRIBE, and waits for their
/// acknowledgements, all within `timeout`.
pub async fn connect(addr: &str, options: Options, timeout: Duration) -> Result<Link, String> {
    let open = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("setting TCP_NODELAY: {e}"))?;
        let (reader, writer) = stream.into_split();
        start(reader, writer, options).await
    };
    tokio::time::timeout(timeout, open)
        .await
        .unwrap_or_else(|_| Err(format!("no CONNACK/SUBACK within {} s", timeout.as_secs())))
}

/// The two halves of a connection: clone the sender freely; one task owns the incoming side.
pub struct Link {
    pub sender: Sender,
    pub incoming: Incoming,
}

/// Runs the handshake on an established byte stream, then starts the reader and writer tasks.
pub async fn start<R, W>(mut reader: R, mut writer: W, options: Options) -> Result<Link, String>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = BytesMut::with_capacity(READ_CHUNK_BYTES);
    let connack = handshake_connect(&mut reader, &mut writer, &mut buf, &options).await?;
    let (queue, rx) = mpsc::unbounded_channel();
    if !options.filters.is_empty() {
        let filters = options.filters.clone();
        for early in handshake_subscribe(&mut reader, &mut writer, &mut buf, filters).await? {
            // Handed out first, and acknowledged when taken like every other PUBLISH.
            let _ = queue.send(Ok(early));
        }
    }
    let properties = connack.properties.as_ref();
    let receive_maximum = properties
        .and_then(|p| p.receive_max)
        .unwrap_or(DEFAULT_RECEIVE_MAXIMUM);
    let window = options.max_inflight.min(receive_maximum).max(1);
    let keep_alive = properties
        .and_then(|p| p.server_keep_alive)
        .map_or(options.keep_alive, |s| Duration::from_secs(u64::from(s)));
    let shared = Arc::new(Shared::new(window));
    let read_task = tokio::spawn(read_loop(reader, buf, Arc::clone(&shared), queue));
    let write_task = tokio::spawn(write_loop(writer, Arc::clone(&shared), keep_alive));
    let tasks = Arc::new(Tasks {
        read: Mutex::new(Some(read_task)),
        write: Mutex::new(Some(write_task)),
    });
    Ok(Link {
        sender: Sender {
            shared: Arc::clone(&shared),
            tasks: Arc::clone(&tasks),
        },
        incoming: Incoming {
            rx,
            sender: Sender { shared, tasks },
        },
    })
}

/// Packet ids of our QoS 1 publishes: a free list, and which ids await their PUBACK.
struct PacketIds {
    free: Vec<u16>,
    in_flight: Vec<bool>,
}

/// What the connection's tasks and handles share.
struct Shared {
    outbox: Mutex<Outbox>,
    wake_writer: Notify,
    /// Signalled whenever the outbox shrinks or the connection fails.
    space: Notify,
    /// One permit per free slot of the outgoing QoS 1 window; closed when the connection fails.
    window: Semaphore,
    ids: Mutex<PacketIds>,
}

#[derive(Default)]
struct Outbox {
    bytes: BytesMut,
    /// DISCONNECT is queued: the writer flushes, shuts the socket down and stops.
    closing: bool,
    /// Why the connection ended, once it has.
    failed: Option<String>,
}

impl Shared {
    fn new(window: u16) -> Shared {
        Shared {
            outbox: Mutex::default(),
            wake_writer: Notify::new(),
            space: Notify::new(),
            window: Semaphore::new(usize::from(window)),
            ids: Mutex::new(PacketIds {
                free: (1..=window).rev().collect(),
                in_flight: vec![false; usize::from(window) + 1],
            }),
        }
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the first reason the connection ended and wakes everyone who waits on it.
    fn fail(&self, reason: String) {
        self.outbox().failed.get_or_insert(reason);
        self.window.close();
        self.space.notify_waiters();
        self.wake_writer.notify_one();
    }

    fn failure(&self) -> String {
        self.outbox()
            .failed
            .clone()
            .unwrap_or_else(|| "connection closed".into())
    }

    fn take_id(&self) -> u16 {
        let mut ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        // A window permit is held, so a free id exists.
        let id = ids.free.pop().unwrap_or(0);
        if let Some(slot) = ids.in_flight.get_mut(usize::from(id)) {
            *slot = true;
        }
        id
    }

    /// Frees the id a PUBACK names; an error if it was not in flight (the server is confused).
    fn release(&self, pkid: u16) -> Result<(), String> {
        let mut ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        match ids.in_flight.get_mut(usize::from(pkid)) {
            Some(slot) if *slot => {
                *slot = false;
                ids.free.push(pkid);
                drop(ids);
                self.window.add_permits(1);
                Ok(())
            }
            _ => Err(format!(
                "server sent PUBACK for packet id {pkid}, which is not in flight"
            )),
        }
    }

    /// Encodes one packet into the outbox, waiting while the outbox is over its high-water mark.
    async fn enqueue(&self, packet: &Packet) -> Result<(), String> {
        loop {
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            {
                let mut outbox = self.outbox();
                if let Some(reason) = &outbox.failed {
                    return Err(reason.clone());
                }
                if outbox.closing {
                    return Err("connection is closing".into());
                }
                if outbox.bytes.len() < OUTBOX_HIGH_WATER_BYTES {
                    packet
                        .write(&mut outbox.bytes)
                        .map_err(|e| format!("encoding {}: {e}", packet_name(packet)))?;
                    drop(outbox);
                    self.wake_writer.notify_one();
                    return Ok(());
                }
            }
            space.await;
        }
    }
}

/// The reader and writer tasks, stopped when the last handle of the connection goes away.
struct Tasks {
    read: Mutex<Option<JoinHandle<()>>>,
    write: Mutex<Option<JoinHandle<()>>>,
}

impl Tasks {
    /// Waits for a task to end; afterwards there is nothing left to abort.
    async fn join(slot: &Mutex<Option<JoinHandle<()>>>) {
        let task = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for slot in [&self.read, &self.write] {
            if let Some(task) = slot.lock().unwrap_or_else(PoisonError::into_inner).take() {
                task.abort();
            }
        }
    }
}

#[derive(Clone)]
pub struct Sender {
    shared: Arc<Shared>,
    tasks: Arc<Tasks>,
}

impl Sender {
    /// Queues a PUBLISH; for QoS 1, first waits for a free slot in the outgoing window.
    pub async fn publish(
        &self,
        topic: &str,
        qos: QoS,
        payload: Bytes,
        properties: Option<PublishProperties>,
    ) -> Result<(), String> {
        let mut publish = Publish::new(topic, qos, payload, properties);
        if qos != QoS::AtMostOnce {
            match self.shared.window.acquire().await {
                // Given back by the reader when the PUBACK arrives.
                Ok(permit) => permit.forget(),
                Err(_) => return Err(self.shared.failure()),
            }
            publish.pkid = self.shared.take_id();
        }
        self.shared.enqueue(&Packet::Publish(publish)).await
    }

    /// Queues DISCONNECT (normal, session expiry 0), waits until the writer has flushed everything and
    /// shut its side down, then until the server closes its side. Closing the socket earlier, with
    /// PUBACKs still unread, would send a reset that can make the server drop our last PUBLISHes.
    pub async fn disconnect(&self) {
        let disconnect =
            Packet::Disconnect(Disconnect::new(DisconnectReasonCode::NormalDisconnection));
        if self.shared.enqueue(&disconnect).await.is_ok() {
            self.shared.outbox().closing = true;
            self.shared.wake_writer.notify_one();
        }
        Tasks::join(&self.tasks.write).await;
        Tasks::join(&self.tasks.read).await;
    }
}

/// PUBLISHes from the server, in order.
pub struct Incoming {
    rx: mpsc::UnboundedReceiver<Result<Publish, String>>,
    sender: Sender,
}

impl Incoming {
    /// The next PUBLISH (QoS 1 ones are acknowledged now), or why the connection ended.
    pub async fn recv(&mut self) -> Result<Publish, String> {
        match self.rx.recv().await {
            Some(Ok(publish)) => {
                if publish.qos == QoS::AtLeastOnce {
                    let ack = Packet::PubAck(PubAck::new(publish.pkid, None));
                    self.sender.shared.enqueue(&ack).await?;
                }
                Ok(publish)
            }
            Some(Err(reason)) => Err(reason),
            None => Err(self.sender.shared.failure()),
        }
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

/// Reads until one whole packet is decoded.
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

async fn handshake_connect<R, W>(
    reader: &mut R,
    writer: &mut W,
    buf: &mut BytesMut,
    options: &Options,
) -> Result<ConnAck, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let connect = Connect {
        keep_alive: u16::try_from(options.keep_alive.as_secs()).unwrap_or(u16::MAX),
        client_id: options.client_id.clone(),
        clean_start: true,
        properties: Some(ConnectProperties {
            max_packet_size: Some(MAX_PACKET_BYTES),
            ..ConnectProperties::new()
        }),
    };
    let packet = Packet::Connect(connect, None, options.login.clone());
    writer
        .write_all(&encode(&packet)?)
        .await
        .map_err(|e| format!("sending CONNECT: {e}"))?;
    match read_packet(reader, buf).await? {
        Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => Ok(ack),
        Packet::ConnAck(ack) => Err(format!("broker refused: {:?}", ack.code)),
        Packet::Disconnect(d) => Err(disconnected(&d)),
        other => Err(format!("expected CONNACK, got {}", packet_name(&other))),
    }
}

/// Subscribes and waits for the SUBACK; PUBLISHes that arrive first are returned, unacknowledged.
async fn handshake_subscribe<R, W>(
    reader: &mut R,
    writer: &mut W,
    buf: &mut BytesMut,
    filters: Vec<Filter>,
) -> Result<Vec<Publish>, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let wanted: Vec<String> = filters.iter().map(|f| f.path.clone()).collect();
    let mut subscribe = Subscribe::new_many(filters, None);
    subscribe.pkid = SUBSCRIBE_PKID;
    writer
        .write_all(&encode(&Packet::Subscribe(subscribe))?)
        .await
        .map_err(|e| format!("sending SUBSCRIBE: {e}"))?;
    let mut early = Vec::new();
    loop {
        match read_packet(reader, buf).await? {
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
            Packet::Publish(publish) => early.push(publish),
            Packet::Disconnect(d) => return Err(disconnected(&d)),
            _ => {}
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut reader: R,
    mut buf: BytesMut,
    shared: Arc<Shared>,
    queue: mpsc::UnboundedSender<Result<Publish, String>>,
) {
    let reason = loop {
        let packet = match read_packet(&mut reader, &mut buf).await {
            Ok(packet) => packet,
            Err(reason) => break reason,
        };
        match packet {
            // The receiver may be gone (a publisher never reads); the connection still runs.
            Packet::Publish(publish) => drop(queue.send(Ok(publish))),
            Packet::PubAck(ack) => {
                if let Err(reason) = shared.release(ack.pkid) {
                    break reason;
                }
            }
            Packet::PingResp(_) => {}
            Packet::Disconnect(d) => break disconnected(&d),
            other => {
                tracing::debug!(packet = packet_name(&other), "bench client ignores packet");
            }
        }
    };
    shared.fail(reason.clone());
    let _ = queue.send(Err(reason));
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    shared: Arc<Shared>,
    keep_alive: Duration,
) {
    // PINGREQ once the connection has been quiet for three quarters of the keep-alive.
    let quiet_limit = keep_alive * 3 / 4;
    let mut last_write = Instant::now();
    loop {
        let (chunk, closing) = {
            let mut outbox = shared.outbox();
            if outbox.failed.is_some() {
                return;
            }
            (outbox.bytes.split(), outbox.closing)
        };
        if chunk.is_empty() {
            if closing {
                let _ = writer.shutdown().await;
                return;
            }
            let ping_due = keep_alive > Duration::ZERO;
            tokio::select! {
                () = shared.wake_writer.notified() => continue,
                () = tokio::time::sleep_until(last_write + quiet_limit), if ping_due => {
                    if let Err(reason) = shared.enqueue(&Packet::PingReq(PingReq)).await {
                        shared.fail(reason);
                    }
                    continue;
                }
            }
        }
        if let Err(e) = writer.write_all(&chunk).await {
            shared.fail(format!("writing: {e}"));
            return;
        }
        last_write = Instant::now();
        shared.space.notify_waiters();
    }
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

    fn publish(topic: &str, qos: QoS, pkid: u16, payload: &'static [u8]) -> Publish {
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

    fn options(max_inflight: u16, filters: Vec<Filter>) -> Options {
        Options {
            client_id: "wire-test".into(),
            keep_alive: Duration::from_secs(60),
            login: None,
            max_inflight,
            filters,
        }
    }

    /// The broker's side of an in-memory connection, decoding what the client sends.
    struct FakeBroker {
        reader: ReadHalf<DuplexStream>,
        writer: WriteHalf<DuplexStream>,
        buf: BytesMut,
    }

    impl FakeBroker {
        async fn next(&mut self) -> Packet {
            read_packet(&mut self.reader, &mut self.buf).await.unwrap()
        }

        async fn send(&mut self, bytes: &[u8]) {
            self.writer.write_all(bytes).await.unwrap();
            self.writer.flush().await.unwrap();
        }
    }

    /// Starts a client against a fake broker that answers CONNECT with `ack` sent one byte at a time.
    async fn connected(ack: Packet, opts: Options) -> (Link, FakeBroker) {
        let (client_end, broker_end) = tokio::io::duplex(1 << 16);
        let (r, w) = tokio::io::split(broker_end);
        let mut broker = FakeBroker {
            reader: r,
            writer: w,
            buf: BytesMut::new(),
        };
        let (cr, cw) = tokio::io::split(client_end);
        let has_filters = !opts.filters.is_empty();
        let client = tokio::spawn(start(cr, cw, opts));
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

    #[test]
    fn decode_waits_for_a_whole_packet_and_keeps_the_rest() {
        let first = bytes_of(&Packet::Publish(publish(
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
        let (mut link, mut broker) = connected(connack(None), options(8, vec![filter])).await;
        // Three PUBLISHes in one write, the third cut in half and finished by a later write.
        let mut wire = BytesMut::new();
        for (i, payload) in [&b"p1"[..], b"p2", b"p3"].into_iter().enumerate() {
            let p = Publish::new("t/x", QoS::AtLeastOnce, Bytes::from(payload), None);
            let p = Publish {
                pkid: 10 + i as u16,
                ..p
            };
            wire.extend_from_slice(&bytes_of(&Packet::Publish(p)));
        }
        let cut = wire.len() - 3;
        broker.send(&wire[..cut]).await;
        let first = link.incoming.recv().await.unwrap();
        let second = link.incoming.recv().await.unwrap();
        broker.send(&wire[cut..]).await;
        let third = link.incoming.recv().await.unwrap();
        assert_eq!(
            [&first.payload[..], &second.payload[..], &third.payload[..]],
            [b"p1", b"p2", b"p3"]
        );
        // Each QoS 1 PUBLISH taken is acknowledged with its own packet id.
        for pkid in 10..13 {
            let Packet::PubAck(ack) = broker.next().await else {
                panic!("expected PUBACK")
            };
            assert_eq!(ack.pkid, pkid);
        }
    }

    #[tokio::test]
    async fn the_servers_receive_maximum_caps_publishes_in_flight() {
        let (link, mut broker) = connected(connack(Some(1)), options(8, Vec::new())).await;
        let sender = link.sender.clone();
        let publishing = tokio::spawn(async move {
            for _ in 0..2 {
                sender
                    .publish("req", QoS::AtLeastOnce, Bytes::from_static(b"x"), None)
                    .await
                    .unwrap();
            }
        });
        let Packet::Publish(first) = broker.next().await else {
            panic!("expected PUBLISH")
        };
        // The second PUBLISH waits for the first one's PUBACK.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!publishing.is_finished());
        assert!(broker.buf.is_empty());
        broker
            .send(&bytes_of(&Packet::PubAck(PubAck::new(first.pkid, None))))
            .await;
        let Packet::Publish(second) = broker.next().await else {
            panic!("expected PUBLISH")
        };
        assert_eq!(second.pkid, first.pkid, "the freed packet id is reused");
        publishing.await.unwrap();
    }

    #[tokio::test]
    async fn a_server_disconnect_fails_both_halves_loudly() {
        let (mut link, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        let disconnect = Disconnect::new(DisconnectReasonCode::SessionTakenOver);
        broker
            .send(&bytes_of(&Packet::Disconnect(disconnect)))
            .await;
        let err = link.incoming.recv().await.unwrap_err();
        assert!(err.contains("DISCONNECT SessionTakenOver"), "{err}");
        let err = link
            .sender
            .publish("t", QoS::AtMostOnce, Bytes::new(), None)
            .await
            .unwrap_err();
        assert!(err.contains("DISCONNECT"), "{err}");
    }

    #[tokio::test]
    async fn a_puback_for_an_unknown_id_ends_the_connection() {
        let (mut link, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        broker
            .send(&bytes_of(&Packet::PubAck(PubAck::new(42, None))))
            .await;
        let err = link.incoming.recv().await.unwrap_err();
        assert!(err.contains("packet id 42"), "{err}");
    }

    #[tokio::test]
    async fn disconnect_flushes_queued_publishes_then_waits_for_the_server_to_close() {
        let (link, mut broker) = connected(connack(None), options(8, Vec::new())).await;
        for _ in 0..3 {
            link.sender
                .publish("t", QoS::AtMostOnce, Bytes::from_static(b"q0"), None)
                .await
                .unwrap();
        }
        let sender = link.sender.clone();
        let disconnecting = tokio::spawn(async move { sender.disconnect().await });
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
            .unwrap();
    }
}
