//! The plain MQTT 5 clients of the integration tests: [`Client`] on rumqttc's event loop (it
//! acknowledges and pings by itself; what it sees comes in order), and [`Raw`], rumqttc's packet
//! codec over a socket, for a test that decides itself when to acknowledge, re-sends with DUP or
//! reads Session Present and reason codes packet by packet.

use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, Connect, ConnectProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode,
    Filter, LastWill, LastWillProperties, Packet, PingReq, PubAck, PubAckReason, PubComp, PubRec,
    PubRecReason, PubRel, Publish, Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, MqttOptions, StateError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::state::WAIT;

/// What a [`Client`] saw, in order.
#[derive(Debug)]
pub enum Seen {
    Publish(Box<Publish>),
    PubAck(PubAckReason),
    PubRec,
    SubAck,
    Disconnect(DisconnectReasonCode),
    Closed,
}

/// How a [`Client`] connects.
pub struct Options {
    /// Keeps its session for an hour (clean start off).
    pub persistent: bool,
    pub will: Option<LastWill>,
    /// Hang guard of every wait, not a performance claim.
    pub wait: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            persistent: false,
            will: None,
            wait: WAIT,
        }
    }
}

/// An MQTT client on rumqttc's event loop that reports what it sees: publishes, PUBACK reason
/// codes, the server's DISCONNECT.
pub struct Client {
    pub client: AsyncClient,
    seen: mpsc::UnboundedReceiver<Seen>,
    /// Seen while waiting for something else, kept in order for whoever asks for it.
    skipped: VecDeque<Seen>,
    task: tokio::task::JoinHandle<()>,
    wait: Duration,
}

impl Client {
    /// Connects; a `persistent` client keeps its session for an hour (clean start off).
    pub async fn connect(addr: SocketAddr, id: &str, persistent: bool) -> Client {
        let options = Options {
            persistent,
            ..Options::default()
        };
        Client::connect_with(addr, id, options).await
    }

    pub async fn connect_with(addr: SocketAddr, id: &str, opts: Options) -> Client {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_keep_alive(Duration::from_secs(30));
        options.set_clean_start(!opts.persistent);
        if opts.persistent {
            options.set_connect_properties(ConnectProperties {
                session_expiry_interval: Some(3600),
                ..ConnectProperties::new()
            });
        }
        if let Some(will) = opts.will {
            options.set_last_will(will);
        }
        let (client, mut eventloop) = AsyncClient::new(options, 256);
        let (tx, seen) = mpsc::unbounded_channel();
        let (connected_tx, mut connected) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let seen = match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        let _ = connected_tx.send(Ok(()));
                        continue;
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => Seen::Publish(Box::new(p)),
                    Ok(Event::Incoming(Packet::PubAck(a))) => Seen::PubAck(a.reason),
                    Ok(Event::Incoming(Packet::PubRec(_))) => Seen::PubRec,
                    Ok(Event::Incoming(Packet::SubAck(_))) => Seen::SubAck,
                    Ok(Event::Incoming(Packet::Disconnect(d))) => Seen::Disconnect(d.reason_code),
                    Ok(_) => continue,
                    // rumqttc reports a failed PUBACK as an error and reconnects on the next poll
                    // (a publisher's session is not persistent, so nothing is lost by that).
                    Err(ConnectionError::MqttState(StateError::PubAckFail { reason })) => {
                        Seen::PubAck(reason)
                    }
                    // rumqttc reports the server's DISCONNECT as an error.
                    Err(ConnectionError::MqttState(StateError::ServerDisconnect {
                        reason_code,
                        ..
                    })) => {
                        let _ = tx.send(Seen::Disconnect(reason_code));
                        let _ = tx.send(Seen::Closed);
                        return;
                    }
                    Err(error) => {
                        // Says why, if it happens before CONNACK (a test then fails with it).
                        let _ = connected_tx.send(Err(format!("{error:?}")));
                        let _ = tx.send(Seen::Closed);
                        return;
                    }
                };
                if tx.send(seen).is_err() {
                    return;
                }
            }
        });
        let connected = tokio::time::timeout(opts.wait, connected.recv())
            .await
            .expect("CONNACK in time")
            .expect("the event loop reports CONNACK or its error");
        if let Err(error) = connected {
            panic!("{id}: the connection ended before CONNACK: {error}");
        }
        Client {
            client,
            seen,
            skipped: VecDeque::new(),
            task,
            wait: opts.wait,
        }
    }

    /// The next thing seen that `pick` takes; the others stay for a later call.
    pub async fn next<T>(&mut self, what: &str, mut pick: impl FnMut(&Seen) -> Option<T>) -> T {
        if let Some(i) = self.skipped.iter().position(|s| pick(s).is_some()) {
            let seen = self.skipped.remove(i).expect("found at i");
            return pick(&seen).expect("picked before");
        }
        let wait = self.wait;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let seen = tokio::time::timeout_at(deadline, self.seen.recv())
                .await
                .unwrap_or_else(|_| panic!("not within {wait:?}: {what}"))
                .unwrap_or_else(|| panic!("connection gone while waiting for {what}"));
            match pick(&seen) {
                Some(value) => return value,
                None => self.skipped.push_back(seen),
            }
        }
    }

    /// The next thing seen, if one comes before `deadline`.
    pub async fn next_before(&mut self, deadline: tokio::time::Instant) -> Option<Seen> {
        if let Some(seen) = self.skipped.pop_front() {
            return Some(seen);
        }
        tokio::time::timeout_at(deadline, self.seen.recv())
            .await
            .ok()
            .flatten()
    }

    /// The next PUBLISH received.
    pub async fn publish_msg(&mut self, what: &str) -> Publish {
        self.next(what, |s| match s {
            Seen::Publish(p) => Some((**p).clone()),
            _ => None,
        })
        .await
    }

    /// The payload of the next PUBLISH received.
    pub async fn next_message(&mut self) -> Bytes {
        self.publish_msg("a queued message").await.payload
    }

    /// Subscribes to `topic` at QoS 1.
    pub async fn subscribe(&mut self, topic: &str) {
        self.subscribe_filter(Filter::new(topic, QoS::AtLeastOnce))
            .await
    }

    pub async fn subscribe_filter(&mut self, filter: Filter) {
        self.client
            .subscribe_many([filter])
            .await
            .expect("queue SUBSCRIBE");
        self.next("SUBACK", |s| matches!(s, Seen::SubAck).then_some(()))
            .await;
    }

    /// Publishes at QoS 1 and returns the PUBACK's reason.
    pub async fn publish(&mut self, topic: &str, payload: Bytes) -> PubAckReason {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
            .expect("queue PUBLISH");
        self.next_puback().await
    }

    /// Publishes at `qos` and waits for the acknowledgement, which must be a success.
    pub async fn publish_acked(&mut self, topic: &str, qos: QoS, retain: bool, payload: &str) {
        self.client
            .publish(topic, qos, retain, payload.as_bytes().to_vec())
            .await
            .expect("queue PUBLISH");
        match qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                let reason = self.next_puback().await;
                assert_eq!(reason, PubAckReason::Success, "PUBACK of {topic}");
            }
            QoS::ExactlyOnce => {
                self.next("PUBREC", |s| matches!(s, Seen::PubRec).then_some(()))
                    .await
            }
        }
    }

    async fn next_puback(&mut self) -> PubAckReason {
        self.next("PUBACK", |s| match s {
            Seen::PubAck(r) => Some(*r),
            _ => None,
        })
        .await
    }

    /// Drops the connection without DISCONNECT: the socket closes, the will goes.
    pub fn abort(self) {
        self.task.abort();
    }
}

/// The topic of `p` as text.
/// A will's properties: published `delay` seconds after the connection is lost.
pub fn will_after(delay: u32) -> LastWillProperties {
    LastWillProperties {
        delay_interval: Some(delay),
        payload_format_indicator: None,
        message_expiry_interval: None,
        content_type: None,
        response_topic: None,
        correlation_data: None,
        user_properties: Vec::new(),
    }
}

/// The will of `id`: "gone" on `will/<id>`, QoS 1, after `delay` seconds.
pub fn will_of(id: &str, delay: u32) -> Option<LastWill> {
    Some(LastWill::new(
        format!("will/{id}"),
        Bytes::from_static(b"gone"),
        QoS::AtLeastOnce,
        false,
        Some(will_after(delay)),
    ))
}

pub fn topic(p: &Publish) -> String {
    String::from_utf8_lossy(&p.topic).into_owned()
}

/// The payload of `p` as text.
pub fn payload(p: &Publish) -> String {
    String::from_utf8_lossy(&p.payload).into_owned()
}

/// Hang guard of every packet a [`Raw`] client waits for, not a performance claim.
pub const RAW_WAIT: Duration = Duration::from_secs(60);

/// Raw MQTT 5: rumqttc's packet codec over a socket. Nothing is acknowledged unless the test
/// does it.
pub struct Raw {
    stream: TcpStream,
    buf: BytesMut,
    next_pkid: u16,
}

/// What CONNACK said.
pub enum Connected {
    Accepted { client: Raw, session_present: bool },
    Refused(ConnectReturnCode),
}

impl Connected {
    /// The client and Session Present; a refusal fails the test.
    pub fn accepted(self) -> (Raw, bool) {
        match self {
            Connected::Accepted {
                client,
                session_present,
            } => (client, session_present),
            Connected::Refused(code) => panic!("CONNECT refused with {code:?}"),
        }
    }
}

/// What [`Raw::receive_all`] got: every payload in order, and those that came with DUP.
pub struct Received {
    pub received: Vec<String>,
    pub dups: Vec<String>,
}

impl Raw {
    /// Connects with the session expiry interval `expiry` (seconds).
    pub async fn connect(addr: SocketAddr, id: &str, clean_start: bool, expiry: u32) -> Connected {
        Raw::connect_with(addr, id, clean_start, expiry, None).await
    }

    /// `receive_max`: how many QoS 1/2 messages the server may have in flight to us.
    pub async fn connect_with(
        addr: SocketAddr,
        id: &str,
        clean_start: bool,
        expiry: u32,
        receive_max: Option<u16>,
    ) -> Connected {
        Raw::connect_will(addr, id, clean_start, expiry, receive_max, None).await
    }

    /// [`Raw::connect_with`] with a will.
    pub async fn connect_will(
        addr: SocketAddr,
        id: &str,
        clean_start: bool,
        expiry: u32,
        receive_max: Option<u16>,
        will: Option<LastWill>,
    ) -> Connected {
        let mut properties = ConnectProperties::new();
        properties.session_expiry_interval = Some(expiry);
        properties.receive_maximum = receive_max;
        let connect = Connect {
            keep_alive: 60,
            client_id: id.to_owned(),
            clean_start,
            properties: Some(properties),
        };
        let mut c = Raw {
            stream: TcpStream::connect(addr).await.expect("connect"),
            buf: BytesMut::new(),
            next_pkid: 1,
        };
        c.send(Packet::Connect(connect, will, None)).await;
        match c.recv().await {
            Packet::ConnAck(ConnAck {
                session_present,
                code: ConnectReturnCode::Success,
                ..
            }) => Connected::Accepted {
                client: c,
                session_present,
            },
            Packet::ConnAck(ack) => Connected::Refused(ack.code),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    /// Connects as a client should: retrying while the server refuses retryably (0x88 while the
    /// session's partition is between heads, as during a fail-over; 0x89), for at most `bound`.
    /// The client and Session Present; panics on any other refusal.
    pub async fn accept_within(
        addr: SocketAddr,
        id: &str,
        clean_start: bool,
        expiry: u32,
        will: Option<LastWill>,
        bound: Duration,
    ) -> (Raw, bool) {
        let started = Instant::now();
        loop {
            match Raw::connect_will(addr, id, clean_start, expiry, None, will.clone()).await {
                Connected::Accepted {
                    client,
                    session_present,
                } => return (client, session_present),
                Connected::Refused(
                    code @ (ConnectReturnCode::ServerUnavailable | ConnectReturnCode::ServerBusy),
                ) => {
                    assert!(
                        started.elapsed() < bound,
                        "{id} still refused ({code:?}) after {bound:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Connected::Refused(code) => panic!("{id}: CONNECT refused with {code:?}"),
            }
        }
    }

    pub async fn send(&mut self, packet: Packet) {
        let mut out = BytesMut::new();
        packet.write(&mut out).expect("encode");
        self.stream.write_all(&out).await.expect("write");
    }

    pub async fn recv(&mut self) -> Packet {
        tokio::time::timeout(RAW_WAIT, async {
            loop {
                match Packet::read(&mut self.buf, None) {
                    Ok(p) => return p,
                    Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => {}
                    Err(e) => panic!("undecodable packet from the server: {e}"),
                }
                let n = self.stream.read_buf(&mut self.buf).await.expect("read");
                assert!(n > 0, "the server closed the connection");
            }
        })
        .await
        .expect("no packet within the guard time")
    }

    /// The next packet id (1, 2, …; never 0).
    pub fn pkid(&mut self) -> u16 {
        let id = self.next_pkid;
        self.next_pkid = self.next_pkid.wrapping_add(1).max(1);
        id
    }

    /// Subscribes and checks SUBACK grants `qos`.
    pub async fn subscribe(&mut self, filter: &str, qos: QoS) {
        let mut subscribe = Subscribe::new(Filter::new(filter, qos), None);
        subscribe.pkid = self.pkid();
        self.send(Packet::Subscribe(subscribe)).await;
        match self.recv().await {
            Packet::SubAck(ack) => {
                assert_eq!(ack.return_codes, vec![SubscribeReasonCode::Success(qos)])
            }
            other => panic!("expected SUBACK, got {other:?}"),
        }
    }

    /// Publishes and completes the flow; returns the PUBACK/PUBREC reason as a byte.
    pub async fn publish(&mut self, topic: &str, qos: QoS, payload: &str) -> u8 {
        let mut p = Publish::new(topic, qos, Bytes::from(payload.to_owned()), None);
        p.pkid = self.pkid();
        let pkid = p.pkid;
        self.send(Packet::Publish(p)).await;
        match (qos, self.recv().await) {
            (QoS::AtLeastOnce, Packet::PubAck(ack)) if ack.pkid == pkid => puback_code(ack.reason),
            (QoS::ExactlyOnce, Packet::PubRec(rec)) if rec.pkid == pkid => {
                let code = pubrec_code(rec.reason);
                self.send(Packet::PubRel(PubRel::new(pkid, None))).await;
                match self.recv().await {
                    Packet::PubComp(c) if c.pkid == pkid => code,
                    other => panic!("expected PUBCOMP {pkid}, got {other:?}"),
                }
            }
            (_, other) => panic!("expected the acknowledgement of {pkid}, got {other:?}"),
        }
    }

    /// Receives until every payload of `want` came (acknowledging each, QoS 2 to PUBCOMP).
    pub async fn receive_all(&mut self, want: &BTreeSet<String>) -> Received {
        let mut got = BTreeSet::new();
        let mut received = Vec::new();
        let mut dups = Vec::new();
        while !want.is_subset(&got) {
            match self.recv().await {
                Packet::Publish(p) => {
                    let payload = String::from_utf8(p.payload.to_vec()).expect("UTF-8 payload");
                    if p.dup {
                        dups.push(payload.clone());
                    }
                    match p.qos {
                        QoS::AtLeastOnce => {
                            self.send(Packet::PubAck(PubAck::new(p.pkid, None))).await
                        }
                        QoS::ExactlyOnce => {
                            self.send(Packet::PubRec(PubRec::new(p.pkid, None))).await
                        }
                        QoS::AtMostOnce => {}
                    }
                    received.push(payload.clone());
                    got.insert(payload);
                }
                Packet::PubRel(rel) => {
                    self.send(Packet::PubComp(PubComp::new(rel.pkid, None)))
                        .await
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        Received { received, dups }
    }

    /// Publishes `payload` retained at QoS 1 (empty: clears the topic) and waits for the PUBACK.
    pub async fn retain(&mut self, topic: &str, payload: &str) {
        let mut p = Publish::new(
            topic,
            QoS::AtLeastOnce,
            Bytes::from(payload.to_owned()),
            None,
        );
        p.retain = true;
        p.pkid = self.pkid();
        let pkid = p.pkid;
        self.send(Packet::Publish(p)).await;
        match self.recv().await {
            Packet::PubAck(ack) if ack.pkid == pkid => {}
            other => panic!("expected PUBACK {pkid}, got {other:?}"),
        }
    }

    /// The topic of the next PUBLISH (acknowledged at QoS 1); PINGRESPs are passed over.
    pub async fn next_topic(&mut self) -> String {
        loop {
            match self.recv().await {
                Packet::Publish(p) => {
                    if p.qos == QoS::AtLeastOnce {
                        self.send(Packet::PubAck(PubAck::new(p.pkid, None))).await;
                    }
                    return String::from_utf8_lossy(&p.topic).into_owned();
                }
                Packet::PingResp(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// The next PUBLISH, not acknowledged (it stays in flight).
    pub async fn next_publish(&mut self) -> Publish {
        match self.recv().await {
            Packet::Publish(p) => p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    /// The payloads of the PUBLISHes that come before the PINGRESP: what was queued for this
    /// client (not acknowledged).
    pub async fn publishes_until_pong(&mut self) -> Vec<String> {
        self.send(Packet::PingReq(PingReq)).await;
        let mut got = Vec::new();
        loop {
            match self.recv().await {
                Packet::PingResp(_) => return got,
                Packet::Publish(p) => got.push(String::from_utf8_lossy(&p.payload).into_owned()),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// DISCONNECT (normal), then waits for the server to close the socket.
    pub async fn disconnect(mut self) {
        self.send(Packet::Disconnect(Disconnect::new(
            DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(RAW_WAIT, self.stream.read_to_end(&mut rest)).await;
    }
}

fn puback_code(reason: PubAckReason) -> u8 {
    match reason {
        PubAckReason::Success => 0x00,
        PubAckReason::NoMatchingSubscribers => 0x10,
        PubAckReason::UnspecifiedError => 0x80,
        _ => 0xff,
    }
}

fn pubrec_code(reason: PubRecReason) -> u8 {
    match reason {
        PubRecReason::Success => 0x00,
        PubRecReason::NoMatchingSubscribers => 0x10,
        PubRecReason::UnspecifiedError => 0x80,
        _ => 0xff,
    }
}
