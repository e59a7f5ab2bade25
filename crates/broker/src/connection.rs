//! One task per client connection: handshake, then a loop that reads and handles packets, drains
//! the session queue into a write buffer, sends service acknowledgements, enforces keep-alive and
//! obeys control requests (takeover, disconnect, shutdown). Writes are batched: everything produced
//! in one loop turn is flushed with one `write_all`.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use bytestring::ByteString;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::codec::{
    self, reason, AckKind, Codec, ConnAck, ConnectInfo, InPublish, Inbound, OutPublish, Probe,
    SubRequest, Version, Violation,
};
use crate::inbound::TopicAliases;
use crate::message::{Message, QoS};
use crate::metrics;
use crate::registry::{Attach, Control, Owner};
use crate::service::{ClientEvent, Inner, ServiceRequest};
use crate::session::{Delivery, Emit, Phase, SessionHandle, SubscriptionOptions};
use crate::topic;
use crate::will::Will;

/// Control requests a connection can have queued (takeover requests from racing reconnects,
/// service disconnects); more are refused and the sender falls back (forced takeover).
const CONTROL_CHANNEL_CAPACITY: usize = 4;
/// Bytes reserved for one socket read. Reserved only when the socket is readable, and released
/// when the connection goes idle, so idle connections hold no read buffer.
const READ_CHUNK_BYTES: usize = 4096;
/// Prefix of identifiers assigned to clients that connect with an empty one.
const ASSIGNED_ID_PREFIX: &str = "mqs-";

/// Why a connection ended.
enum End {
    /// Socket closed or failed without DISCONNECT: abnormal, the will is published.
    Closed,
    /// The client sent DISCONNECT; 0x04 asks for the will.
    ClientDisconnect {
        publish_will: bool,
    },
    Violation(Violation),
    KeepAliveTimeout,
    TakenOver(Option<oneshot::Sender<()>>),
    Kicked {
        reason_code: u8,
        reason_string: Option<String>,
    },
    Shutdown,
}

/// Resolves when a service acknowledges a claimed-topic publish (dropped unacked = 0x80).
struct AckWait {
    packet_id: u16,
    kind: AckKind,
    rx: oneshot::Receiver<u8>,
}

impl Future for AckWait {
    type Output = (u16, AckKind, u8);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        Pin::new(&mut this.rx)
            .poll(cx)
            .map(|r| (this.packet_id, this.kind, r.unwrap_or(reason::UNSPECIFIED)))
    }
}

/// Serves one accepted socket until it closes.
pub(crate) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    inner: Arc<Inner>,
    shutdown: CancellationToken,
) {
    // Latency over packet count: acks and small publishes should not wait for Nagle.
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let mut rbuf = BytesMut::new();
    let handshake = tokio::select! {
        r = tokio::time::timeout(inner.config.connect_timeout, read_connect(&mut rd, &mut rbuf, &inner)) => r,
        _ = shutdown.cancelled() => return,
    };
    let (codec, connect) = match handshake {
        Err(_) => {
            tracing::debug!(%peer, "no CONNECT within the connect timeout; closing");
            return;
        }
        Ok(Err(reply)) => {
            if !reply.is_empty() {
                let _ =
                    tokio::time::timeout(inner.config.close_timeout, wr.write_all(&reply)).await;
            }
            tracing::debug!(%peer, "handshake refused");
            return;
        }
        Ok(Ok(c)) => c,
    };
    let Some(mut conn) = Connection::establish(codec, *connect, rbuf, &inner, &mut wr, peer).await
    else {
        return;
    };
    let (control_tx, control_rx) = mpsc::channel(CONTROL_CHANNEL_CAPACITY);
    if !conn.attach(control_tx).await {
        return;
    }
    let end = conn.serve(&mut rd, &mut wr, control_rx, &shutdown).await;
    conn.finish(end, &mut wr).await;
}

/// Reads until the first packet (which must be CONNECT) is decoded. `Err` carries the bytes to send
/// before closing (a refusing CONNACK, or nothing).
async fn read_connect(
    rd: &mut OwnedReadHalf,
    rbuf: &mut BytesMut,
    inner: &Inner,
) -> Result<(Codec, Box<ConnectInfo>), BytesMut> {
    let mut codec: Option<Codec> = None;
    loop {
        if codec.is_none() {
            match codec::probe(rbuf) {
                Probe::Incomplete => {}
                Probe::NotMqtt => return Err(BytesMut::new()),
                Probe::UnsupportedLevel(level) => {
                    return Err(BytesMut::from(codec::unsupported_level_connack(level)))
                }
                Probe::Mqtt(v) => codec = Some(Codec::new(v, inner.config.max_packet_size)),
            }
        }
        if let Some(c) = codec.as_mut() {
            match c.decode(rbuf) {
                Ok(Some(Inbound::Connect(connect))) => {
                    let Some(codec) = codec else {
                        return Err(BytesMut::new());
                    };
                    return Ok((codec, connect));
                }
                Ok(Some(_)) => return Err(BytesMut::new()),
                Ok(None) => {}
                Err(v) => {
                    let mut reply = BytesMut::new();
                    if c.version() == Version::V5 || v.code == reason::CLIENT_ID_NOT_VALID {
                        c.connack(
                            ConnAck {
                                reason: v.code,
                                ..ConnAck::default()
                            },
                            &mut reply,
                        );
                    }
                    return Err(reply);
                }
            }
        }
        rbuf.reserve(READ_CHUNK_BYTES);
        match tokio::io::AsyncReadExt::read_buf(rd, rbuf).await {
            Ok(0) | Err(_) => return Err(BytesMut::new()),
            Ok(_) => {}
        }
    }
}

struct Connection {
    inner: Arc<Inner>,
    conn_id: u64,
    codec: Codec,
    client_id: Arc<str>,
    connect: ConnectInfo,
    assigned_id: bool,
    session: Option<Arc<SessionHandle>>,
    session_present: bool,
    rbuf: BytesMut,
    out: BytesMut,
    /// Unacknowledged QoS 1/2 towards the client: its Receive Maximum capped by our `max_inflight`.
    send_window: u16,
    client_max_packet: u32,
    keep_alive: Option<Duration>,
    session_expiry_secs: u32,
    aliases: TopicAliases,
    pending_acks: FuturesUnordered<AckWait>,
    inbound_qos1_pending: usize,
    /// QoS 2 packet ids handed to a service and not yet acknowledged by it.
    qos2_awaiting_service: BTreeSet<u16>,
    will: Option<Will>,
    peer: SocketAddr,
    /// A claimed-topic publish waiting for room in its service's inbox. While set, the connection
    /// reads nothing more from the socket (back-pressure) but still writes acks and deliveries.
    stalled: Option<Stalled>,
}

struct Stalled {
    inbox: mpsc::Sender<ServiceRequest>,
    request: ServiceRequest,
}

impl Connection {
    /// Validates CONNECT; on refusal writes the CONNACK and returns `None`.
    async fn establish(
        mut codec: Codec,
        connect: ConnectInfo,
        rbuf: BytesMut,
        inner: &Arc<Inner>,
        wr: &mut OwnedWriteHalf,
        peer: SocketAddr,
    ) -> Option<Self> {
        let cfg = &inner.config;
        let refusal = if connect.client_id.len() > cfg.max_client_id_len {
            Some((reason::CLIENT_ID_NOT_VALID, "client id too long"))
        } else if connect
            .will
            .as_ref()
            .is_some_and(|w| !topic::is_valid_topic_name(&w.message.topic))
        {
            Some((reason::TOPIC_NAME_INVALID, "invalid will topic"))
        } else {
            None
        };
        if let Some((code, why)) = refusal {
            let mut out = BytesMut::new();
            codec.connack(
                ConnAck {
                    reason: code,
                    reason_string: Some(why.into()),
                    ..ConnAck::default()
                },
                &mut out,
            );
            let _ = tokio::time::timeout(cfg.close_timeout, wr.write_all(&out)).await;
            tracing::debug!(%peer, client_id = %connect.client_id, why, "CONNECT refused");
            return None;
        }
        let assigned_id = connect.client_id.is_empty();
        let client_id: Arc<str> = if assigned_id {
            format!("{ASSIGNED_ID_PREFIX}{:016x}", rand::random::<u64>()).into()
        } else {
            Arc::from(&*connect.client_id)
        };
        let session_expiry_secs = match connect.session_expiry_secs {
            Some(requested) => requested.min(cfg.session_expiry_max_secs),
            // MQTT 3.1.1: a persistent session lives as long as we allow.
            None if connect.clean_start => 0,
            None => cfg.session_expiry_max_secs,
        };
        // Only MQTT 5 clients can learn a Server Keep Alive from CONNACK.
        let keep_alive_secs = match codec.version() {
            Version::V5 => cfg.server_keep_alive_secs.unwrap_or(connect.keep_alive),
            Version::V3 => connect.keep_alive,
        };
        // The registry caps the will delay at the session expiry when the connection ends.
        let will = connect.will.clone();
        Some(Self {
            conn_id: inner.next_conn_id(),
            inner: inner.clone(),
            send_window: connect.receive_maximum.min(cfg.max_inflight).max(1),
            client_max_packet: connect.max_packet_size,
            keep_alive: cfg.keep_alive_deadline(keep_alive_secs),
            aliases: TopicAliases::new(cfg.topic_alias_maximum),
            codec,
            client_id,
            assigned_id,
            session: None,
            session_present: false,
            rbuf,
            out: BytesMut::new(),
            session_expiry_secs,
            pending_acks: FuturesUnordered::new(),
            inbound_qos1_pending: 0,
            qos2_awaiting_service: BTreeSet::new(),
            will,
            peer,
            connect,
            stalled: None,
        })
    }

    fn session(&self) -> &Arc<SessionHandle> {
        // `attach` sets it before anything else runs.
        self.session
            .as_ref()
            .unwrap_or_else(|| unreachable!("session used before attach"))
    }

    /// Attaches to the session (taking it over if needed), sends CONNACK and re-sends what was in
    /// flight. Returns `false` if the connection must close.
    async fn attach(&mut self, control: mpsc::Sender<Control>) -> bool {
        let deadline = Instant::now() + self.inner.config.takeover_timeout;
        let (handle, session_present, effects) = loop {
            let owner = Owner {
                conn_id: self.conn_id,
                control: control.clone(),
            };
            let force = Instant::now() >= deadline;
            match self.inner.registry.attach(
                &self.client_id,
                self.connect.clean_start,
                self.session_expiry_secs,
                owner,
                force,
            ) {
                Attach::Attached {
                    handle,
                    session_present,
                    effects,
                } => break (handle, session_present, effects),
                Attach::Wait(done) => {
                    tracing::debug!(client_id = %self.client_id, "taking over session from a live connection");
                    let _ = tokio::time::timeout_at(deadline, done).await;
                }
            }
        };
        self.inner.apply(effects);
        self.session = Some(handle);
        self.session_present = session_present;

        let cfg = &self.inner.config;
        let requested_expiry = self.connect.session_expiry_secs;
        let ack = ConnAck {
            session_present,
            reason: reason::SUCCESS,
            session_expiry_secs: requested_expiry
                .filter(|r| *r != self.session_expiry_secs)
                .map(|_| self.session_expiry_secs),
            receive_maximum: cfg.receive_maximum,
            max_packet_size: cfg.max_packet_size,
            assigned_client_id: self.assigned_id.then(|| ByteString::from(&*self.client_id)),
            topic_alias_maximum: cfg.topic_alias_maximum,
            server_keep_alive: cfg.server_keep_alive_secs,
            shared_subscriptions: cfg.shared_subscriptions,
            reason_string: None,
        };
        self.codec.connack(ack, &mut self.out);
        tracing::info!(client_id = %self.client_id, peer = %self.peer, session_present, version = ?self.codec.version(), "client connected");
        metrics::client_connected();
        self.inner.emit(ClientEvent::Connected {
            client_id: self.client_id.clone(),
        });
        self.resend_inflight();
        self.pump();
        true
    }

    /// On a resumed session, everything in flight goes again: PUBLISH with DUP, or PUBREL.
    fn resend_inflight(&mut self) {
        let session = self.session().clone();
        let mut state = session.lock();
        let now = std::time::Instant::now();
        let mut too_large = Vec::new();
        for (&packet_id, inflight) in &state.inflight {
            match inflight.phase {
                Phase::AwaitPubComp => {
                    self.codec
                        .ack(AckKind::Release, packet_id, reason::SUCCESS, &mut self.out)
                }
                Phase::AwaitPubAck | Phase::AwaitPubRec => {
                    let d = &inflight.delivery;
                    let expiry_secs =
                        d.message
                            .properties
                            .message_expiry_interval
                            .map(|interval| {
                                let elapsed =
                                    now.saturating_duration_since(d.received_at).as_secs();
                                interval
                                    .saturating_sub(u32::try_from(elapsed).unwrap_or(u32::MAX))
                                    .max(1)
                            });
                    let p = OutPublish {
                        message: &d.message,
                        qos: d.qos,
                        retain: d.retain,
                        dup: true,
                        packet_id: Some(packet_id),
                        subscription_ids: &d.subscription_ids,
                        expiry_secs,
                    };
                    if !self
                        .codec
                        .publish(&p, self.client_max_packet, &mut self.out)
                    {
                        too_large.push(packet_id);
                    }
                }
            }
        }
        for id in too_large {
            state.inflight.remove(&id);
            state.dropped_too_large += 1;
        }
    }

    /// Moves queued messages into the write buffer, up to the send window and the batch size.
    fn pump(&mut self) {
        let session = self.session().clone();
        let budget = self.inner.config.write_batch_bytes;
        let max_packet = self.client_max_packet;
        let codec = &self.codec;
        let out = &mut self.out;
        let mut full = false;
        let mut sent = metrics::SentByQos::default();
        session
            .lock()
            .pump(std::time::Instant::now(), self.send_window, |p| {
                if out.len() >= budget {
                    full = true;
                    return None;
                }
                Some(if codec.publish(p, max_packet, out) {
                    sent.add(p.qos);
                    Emit::Sent
                } else {
                    Emit::TooLarge
                })
            });
        sent.report();
        if full {
            // Continue after this batch is flushed.
            session.wake.notify_one();
        }
    }

    async fn serve(
        &mut self,
        rd: &mut OwnedReadHalf,
        wr: &mut OwnedWriteHalf,
        mut control: mpsc::Receiver<Control>,
        shutdown: &CancellationToken,
    ) -> End {
        let session = self.session().clone();
        let mut keep_alive_at = self.keep_alive.map(|d| Instant::now() + d);
        // Packets that arrived together with CONNECT.
        if let Err(end) = self.handle_buffered() {
            return end;
        }
        loop {
            if !self.out.is_empty() {
                if wr.write_all(&self.out).await.is_err() {
                    return End::Closed;
                }
                self.out.clear();
                if self.out.capacity() > self.inner.config.idle_buffer_bytes {
                    self.out = BytesMut::new();
                }
            }
            if self.rbuf.is_empty() && self.rbuf.capacity() > self.inner.config.idle_buffer_bytes {
                self.rbuf = BytesMut::new();
            }
            let keep_alive = async {
                match keep_alive_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let stalled_inbox = self.stalled.as_ref().map(|s| s.inbox.clone());
            let inbox_room = async {
                match &stalled_inbox {
                    Some(inbox) => inbox.reserve().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return End::Shutdown,
                ctl = control.recv() => match ctl {
                    Some(Control::TakeOver { done }) => return End::TakenOver(Some(done)),
                    Some(Control::Disconnect { reason_code, reason_string }) => {
                        return End::Kicked { reason_code, reason_string }
                    }
                    // The registry dropped our channel: the session was taken by force.
                    None => return End::TakenOver(None),
                },
                Some((packet_id, kind, code)) = self.pending_acks.next(), if !self.pending_acks.is_empty() => {
                    self.on_service_ack(packet_id, kind, code);
                }
                room = inbox_room => {
                    if let (Ok(permit), Some(stalled)) = (room, self.stalled.take()) {
                        permit.send(stalled.request);
                    }
                    // (A closed inbox drops the request: its ack resolves as 0x80.)
                    self.stalled = None;
                    if let Err(end) = self.handle_buffered() {
                        return end;
                    }
                }
                readable = rd.readable(), if self.stalled.is_none() => {
                    if readable.is_err() {
                        return End::Closed;
                    }
                    self.rbuf.reserve(READ_CHUNK_BYTES);
                    match rd.try_read_buf(&mut self.rbuf) {
                        Ok(0) => return End::Closed,
                        Ok(_) => {
                            if let Some(d) = self.keep_alive {
                                keep_alive_at = Some(Instant::now() + d);
                            }
                            if let Err(end) = self.handle_buffered() {
                                return end;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => return End::Closed,
                    }
                }
                _ = session.wake.notified() => self.pump(),
                _ = keep_alive => return End::KeepAliveTimeout,
            }
        }
    }

    /// Handles the complete packets in the read buffer, stopping early under back-pressure.
    fn handle_buffered(&mut self) -> Result<(), End> {
        while self.stalled.is_none() {
            let Some(packet) = self.codec.decode(&mut self.rbuf).map_err(End::Violation)? else {
                break;
            };
            self.handle(packet)?;
        }
        Ok(())
    }

    fn handle(&mut self, packet: Inbound) -> Result<(), End> {
        match packet {
            Inbound::Publish(p) => self.on_publish(p)?,
            Inbound::PubAck { packet_id } => {
                if self.session().lock().on_puback(packet_id) {
                    self.pump();
                }
            }
            Inbound::PubRec {
                packet_id,
                reason: code,
            } => {
                let outcome = self.session().lock().on_pubrec(packet_id, code);
                match outcome {
                    Some(true) => {
                        self.codec
                            .ack(AckKind::Release, packet_id, reason::SUCCESS, &mut self.out)
                    }
                    Some(false) => self.pump(),
                    None => self.codec.ack(
                        AckKind::Release,
                        packet_id,
                        reason::PACKET_ID_NOT_FOUND,
                        &mut self.out,
                    ),
                }
            }
            Inbound::PubRel { packet_id } => {
                let known = self.session().lock().inbound_qos2.remove(&packet_id);
                let code = if known {
                    reason::SUCCESS
                } else {
                    reason::PACKET_ID_NOT_FOUND
                };
                self.codec
                    .ack(AckKind::Complete, packet_id, code, &mut self.out);
            }
            Inbound::PubComp { packet_id } => {
                if self.session().lock().on_pubcomp(packet_id) {
                    self.pump();
                }
            }
            Inbound::Subscribe {
                packet_id,
                subscription_id,
                filters,
            } => self.on_subscribe(packet_id, subscription_id, filters)?,
            Inbound::Unsubscribe { packet_id, filters } => self.on_unsubscribe(packet_id, filters),
            Inbound::PingReq => self.codec.pingresp(&mut self.out),
            Inbound::Disconnect {
                reason: code,
                session_expiry_secs,
            } => {
                if let Some(expiry) = session_expiry_secs {
                    if self.connect.session_expiry_secs == Some(0) && expiry != 0 {
                        return Err(End::Violation(Violation::new(
                            reason::PROTOCOL_ERROR,
                            "DISCONNECT sets a session expiry after CONNECT set 0",
                        )));
                    }
                    self.session_expiry_secs =
                        expiry.min(self.inner.config.session_expiry_max_secs);
                    self.session().lock().expiry_interval_secs = self.session_expiry_secs;
                }
                return Err(End::ClientDisconnect {
                    publish_will: code == reason::DISCONNECT_WITH_WILL,
                });
            }
            Inbound::Connect(_) => {
                return Err(End::Violation(Violation::new(
                    reason::PROTOCOL_ERROR,
                    "second CONNECT",
                )));
            }
            Inbound::Unexpected(why) => {
                return Err(End::Violation(Violation::new(reason::PROTOCOL_ERROR, why)))
            }
        }
        Ok(())
    }

    fn on_publish(&mut self, p: InPublish) -> Result<(), End> {
        let topic = self
            .aliases
            .resolve(p.topic, p.topic_alias)
            .map_err(End::Violation)?;
        if !topic::is_valid_topic_name(&topic) {
            return Err(End::Violation(Violation::new(
                reason::TOPIC_NAME_INVALID,
                "PUBLISH topic has wildcards",
            )));
        }
        let packet_id = p.packet_id.unwrap_or(0);
        if p.qos != QoS::AtMostOnce {
            let in_use = self.inbound_qos1_pending + self.session().lock().inbound_qos2.len();
            if in_use >= usize::from(self.inner.config.receive_maximum) {
                return Err(End::Violation(Violation::new(
                    reason::RECEIVE_MAXIMUM_EXCEEDED,
                    "more unacknowledged QoS 1/2 publishes than the Receive Maximum",
                )));
            }
        }
        if p.qos == QoS::ExactlyOnce && self.session().lock().inbound_qos2.contains(&packet_id) {
            // A retry of a QoS 2 message we already have: never route it twice.
            if !self.qos2_awaiting_service.contains(&packet_id) {
                self.codec
                    .ack(AckKind::Received, packet_id, reason::SUCCESS, &mut self.out);
            }
            return Ok(());
        }
        metrics::message_received(p.qos);
        let message = Message {
            topic,
            payload: p.payload,
            qos: p.qos,
            retain: p.retain,
            properties: p.properties,
        };
        if let Some(inbox) = self.inner.claim_for(&message.topic) {
            let (request, ack) = ServiceRequest::new(self.client_id.clone(), message, p.dup);
            match inbox.try_send(request) {
                Ok(()) => {}
                // Back-pressure: stop reading until the inbox has room.
                Err(mpsc::error::TrySendError::Full(request)) => {
                    self.stalled = Some(Stalled { inbox, request })
                }
                // The service is gone: the dropped request resolves its ack as 0x80.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
            let kind = match p.qos {
                QoS::AtMostOnce => return Ok(()),
                QoS::AtLeastOnce => {
                    self.inbound_qos1_pending += 1;
                    AckKind::Acknowledge
                }
                QoS::ExactlyOnce => {
                    self.session().lock().inbound_qos2.insert(packet_id);
                    self.qos2_awaiting_service.insert(packet_id);
                    AckKind::Received
                }
            };
            self.pending_acks.push(AckWait {
                packet_id,
                kind,
                rx: ack,
            });
            return Ok(());
        }
        self.inner.router.route(message, Some(&self.client_id));
        match p.qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => self.codec.ack(
                AckKind::Acknowledge,
                packet_id,
                reason::SUCCESS,
                &mut self.out,
            ),
            QoS::ExactlyOnce => {
                self.session().lock().inbound_qos2.insert(packet_id);
                self.codec
                    .ack(AckKind::Received, packet_id, reason::SUCCESS, &mut self.out);
            }
        }
        Ok(())
    }

    fn on_service_ack(&mut self, packet_id: u16, kind: AckKind, code: u8) {
        match kind {
            AckKind::Acknowledge => {
                debug_assert!(self.inbound_qos1_pending > 0);
                self.inbound_qos1_pending = self.inbound_qos1_pending.saturating_sub(1);
            }
            AckKind::Received => {
                self.qos2_awaiting_service.remove(&packet_id);
                if code >= reason::UNSPECIFIED {
                    // A failed PUBREC ends the QoS 2 flow: no PUBREL will come.
                    self.session().lock().inbound_qos2.remove(&packet_id);
                }
            }
            AckKind::Release | AckKind::Complete => {
                debug_assert!(false, "services only ack PUBLISH")
            }
        }
        self.codec.ack(kind, packet_id, code, &mut self.out);
    }

    fn on_subscribe(
        &mut self,
        packet_id: u16,
        subscription_id: Option<u32>,
        filters: Vec<(ByteString, SubRequest)>,
    ) -> Result<(), End> {
        let session = self.session().clone();
        let now = std::time::Instant::now();
        let mut codes = Vec::with_capacity(filters.len());
        let mut retained = Vec::new();
        for (raw, req) in filters {
            let Some(filter) = topic::parse_filter(&raw) else {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            };
            if filter.group.is_some() {
                if !self.inner.config.shared_subscriptions {
                    codes.push(reason::SHARED_SUBSCRIPTIONS_NOT_SUPPORTED);
                    continue;
                }
                if req.no_local {
                    return Err(End::Violation(Violation::new(
                        reason::PROTOCOL_ERROR,
                        "No Local set on a shared subscription",
                    )));
                }
            }
            let options = SubscriptionOptions {
                qos: req.qos,
                no_local: req.no_local,
                retain_as_published: req.retain_as_published,
                retain_handling: req.retain_handling,
                subscription_id,
            };
            let is_new = self.inner.router.subscribe(&session, filter, options);
            session.lock().subscriptions.insert(raw.clone(), options);
            // Shared subscriptions never get retained messages.
            let send_retained = filter.group.is_none()
                && (req.retain_handling == 0 || (req.retain_handling == 1 && is_new));
            if send_retained {
                for r in self.inner.router.retained_matching(filter.filter, now) {
                    retained.push(Delivery {
                        qos: r.message.qos.min(req.qos),
                        message: r.message,
                        retain: true,
                        subscription_ids: subscription_id.into_iter().collect(),
                        received_at: r.received_at,
                    });
                }
            }
            codes.push(req.qos as u8);
        }
        self.codec.suback(packet_id, codes, &mut self.out);
        for d in retained {
            session.deliver(d, self.inner.config.max_queued_messages);
        }
        Ok(())
    }

    fn on_unsubscribe(&mut self, packet_id: u16, filters: Vec<ByteString>) {
        let session = self.session().clone();
        let codes = filters
            .iter()
            .map(|raw| {
                let Some(filter) = topic::parse_filter(raw) else {
                    return reason::TOPIC_FILTER_INVALID;
                };
                let existed = session.lock().subscriptions.remove(raw).is_some();
                self.inner.router.unsubscribe(&self.client_id, filter);
                if existed {
                    reason::SUCCESS
                } else {
                    reason::NO_SUBSCRIPTION_EXISTED
                }
            })
            .collect();
        self.codec.unsuback(packet_id, codes, &mut self.out);
    }

    /// Sends DISCONNECT if the end calls for one, closes, detaches from the session and publishes
    /// or arms the will.
    async fn finish(mut self, end: End, wr: &mut OwnedWriteHalf) {
        let (disconnect, publish_will, takeover_done, why): (
            Option<(u8, Option<String>)>,
            bool,
            _,
            &str,
        ) = match end {
            End::Closed => (None, true, None, "connection lost"),
            End::ClientDisconnect { publish_will } => {
                (None, publish_will, None, "client disconnected")
            }
            End::Violation(v) => (
                Some((v.code, Some(v.reason.to_owned()))),
                true,
                None,
                v.reason,
            ),
            End::KeepAliveTimeout => (
                Some((reason::KEEP_ALIVE_TIMEOUT, None)),
                true,
                None,
                "keep-alive timeout",
            ),
            End::TakenOver(done) => (
                Some((reason::SESSION_TAKEN_OVER, None)),
                true,
                done,
                "session taken over",
            ),
            End::Kicked {
                reason_code,
                reason_string,
            } => (
                Some((reason_code, reason_string)),
                true,
                None,
                "disconnected by a service",
            ),
            End::Shutdown => (
                Some((reason::SERVER_SHUTTING_DOWN, None)),
                true,
                None,
                "server shutting down",
            ),
        };
        if let Some((code, reason_string)) = disconnect {
            self.codec
                .disconnect(code, reason_string.as_deref(), &mut self.out);
        }
        let close_timeout = self.inner.config.close_timeout;
        let _ = tokio::time::timeout(close_timeout, async {
            if !self.out.is_empty() {
                wr.write_all(&self.out).await?;
            }
            wr.shutdown().await
        })
        .await;
        let will = if publish_will { self.will.take() } else { None };
        let effects = self.inner.registry.detach(
            &self.client_id,
            self.conn_id,
            will,
            std::time::Instant::now(),
        );
        self.inner.emit(ClientEvent::Disconnected {
            client_id: self.client_id.clone(),
        });
        self.inner.apply(effects);
        if let Some(done) = takeover_done {
            let _ = done.send(());
        }
        tracing::info!(client_id = %self.client_id, peer = %self.peer, reason = why, "client disconnected");
        metrics::client_disconnected();
    }
}
