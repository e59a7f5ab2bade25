//! One task per client connection: handshake, then a loop that reads and handles packets, drains
//! the session queue into a write buffer, sends service acknowledgements, enforces keep-alive and
//! obeys control requests (takeover, disconnect, shutdown). Writes are batched: everything produced
//! in one loop turn is flushed with one `write_all`.

mod elsewhere;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use bytestring::ByteString;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::auth::{ConnectAttempt, Identity, Principal, Refusal};
use crate::auth_failures::Verdict;
use crate::codec::{
    self, reason, AckKind, Codec, ConnAck, ConnectInfo, InPublish, Inbound, OutPublish, Probe,
    SubRequest, Version, Violation,
};
use crate::inbound::TopicAliases;
use crate::limits::{ConnectionPermit, RefusalSlot, Refused};
use crate::mailbox;
use crate::message::{Message, PublishProperties, QoS};
use crate::metrics;
use crate::persist::{Durable, JournalError};
use crate::registry::{Attach, Control, Owner, WillOnEnd};
use crate::service::publish_once_landed;
use crate::service::{ClientEvent, Inner, ServiceRequest};
use crate::session::{Delivery, Emit, Phase, SessionHandle, SubscriptionOptions};
use crate::topic::{self, TopicNameProblem};
use crate::transport::{self, Peer, PeerName, Stream};
use crate::will::Will;

/// Control requests a connection can have queued (takeover requests from racing reconnects,
/// service disconnects); more are refused and the sender falls back (forced takeover).
const CONTROL_CHANNEL_CAPACITY: u16 = 4;
/// Largest CONNECT read from a socket refused by the connection limits (to learn its version).
const REFUSED_CONNECT_MAX_BYTES: u32 = 64 * 1024;

/// Why a connection ended.
enum End {
    /// Socket closed or failed without DISCONNECT: abnormal, the will is published.
    Closed,
    /// The client sent DISCONNECT; 0x04 asks for the will.
    ClientDisconnect {
        will: WillOnEnd,
    },
    Violation(Violation),
    KeepAliveTimeout,
    /// The socket took no write batch within the slow-consumer timeout; the write buffer may end
    /// mid-packet, so nothing more is sent.
    SlowConsumer,
    TakenOver(Option<oneshot::Sender<()>>),
    Kicked {
        reason_code: u8,
        reason_string: Option<String>,
        will: WillOnEnd,
    },
    Shutdown,
    /// CONNACK refused the session after attaching it (its state could not be made durable).
    Refused,
}

/// A reply the connection owes and sends once something outside it is done: a service acknowledged
/// a claimed-topic publish, or the journal made a change durable.
enum Deferred {
    Ack {
        packet_id: u16,
        kind: AckKind,
        code: u8,
    },
    /// The PUBACK/PUBREC of a publish that waited for durability, holding back this client's own
    /// deliveries from `hold` on (see [`Connection::delivery_holds`]).
    DurableAck {
        packet_id: u16,
        kind: AckKind,
        code: u8,
        hold: u64,
    },
    SubAck {
        packet_id: u16,
        codes: Vec<u8>,
        /// Retained messages to deliver once the subscription is acknowledged.
        retained: Vec<Delivery>,
    },
    UnsubAck {
        packet_id: u16,
        codes: Vec<u8>,
    },
    /// A PUBCOMP or failed PUBREC that hands an inbound QoS 2 packet id back to the client, now
    /// that the id's release is durable.
    Released {
        packet_id: u16,
        kind: AckKind,
        code: u8,
    },
}

type Pending = Pin<Box<dyn Future<Output = Deferred> + Send>>;

/// The replies a connection owes. Created on first use: most idle connections never owe one, and
/// an empty `FuturesUnordered` already holds two allocations (about 200 bytes).
#[derive(Default)]
struct Replies(Option<FuturesUnordered<Pending>>);

impl Replies {
    fn push(&mut self, reply: Pending) {
        self.0.get_or_insert_with(FuturesUnordered::new).push(reply);
    }

    fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(FuturesUnordered::is_empty)
    }

    /// The next reply ready; `None` if none is owed.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Deferred>> {
        match &mut self.0 {
            Some(replies) => replies.poll_next_unpin(cx),
            None => Poll::Ready(None),
        }
    }
}

/// Resolves once every change in `durable` is durable: `Ok` or the reason one is not.
async fn all_durable(durable: Vec<Durable>) -> Result<(), JournalError> {
    for d in durable {
        d.await?;
    }
    Ok(())
}

/// The PUBACK/PUBREC of a publish, once its service acknowledged it (dropped unacked = 0x80) and
/// `journalled` (the packet id of a QoS 2 publish, in a persistent session) is durable.
fn service_ack(
    packet_id: u16,
    kind: AckKind,
    rx: oneshot::Receiver<u8>,
    journalled: Option<Durable>,
) -> Pending {
    Box::pin(async move {
        let mut code = rx.await.unwrap_or(reason::UNSPECIFIED);
        if let Some(durable) = journalled.filter(|_| code < reason::UNSPECIFIED) {
            if let Err(error) = durable.await {
                tracing::error!(%error, "publish not acknowledged");
                code = reason::UNSPECIFIED;
            }
        }
        Deferred::Ack {
            packet_id,
            kind,
            code,
        }
    })
}

/// The PUBACK/PUBREC of a publish, once what it changed is durable (0x80 if it cannot be).
fn durable_ack(packet_id: u16, kind: AckKind, durable: Vec<Durable>, hold: u64) -> Pending {
    Box::pin(async move {
        let code = match all_durable(durable).await {
            Ok(()) => reason::SUCCESS,
            Err(error) => {
                tracing::error!(%error, "publish not acknowledged");
                reason::UNSPECIFIED
            }
        };
        Deferred::DurableAck {
            packet_id,
            kind,
            code,
            hold,
        }
    })
}

/// The PUBCOMP (or failed PUBREC) of an inbound QoS 2 packet id, once its release is durable.
fn released_ack(packet_id: u16, kind: AckKind, code: u8, durable: Durable) -> Pending {
    Box::pin(async move {
        if let Err(error) = durable.await {
            // Nothing better to answer: PUBCOMP has no failure code, and withholding it would
            // leave the client's flow hanging on a connection it cannot retry on.
            tracing::error!(%error, packet_id, "release of an inbound QoS 2 packet id not durable");
        }
        Deferred::Released {
            packet_id,
            kind,
            code,
        }
    })
}

/// The retained messages matching each of `wanted` (a filter and its granted QoS), as
/// deliveries to a new subscription.
fn retained_for(
    router: &crate::router::Router,
    wanted: &[(String, QoS)],
    subscription_id: Option<u32>,
    now: std::time::Instant,
) -> Vec<Delivery> {
    let mut retained = Vec::new();
    for (filter, qos) in wanted {
        for r in router.retained_matching(filter, now) {
            retained.push(Delivery {
                qos: r.message.qos.min(*qos),
                message: r.message,
                retain: true,
                subscription_ids: subscription_id.into_iter().collect(),
                received_at: r.received_at,
                seq: 0,
            });
        }
    }
    retained
}

/// Replaces success codes with 0x80 when the change they acknowledge did not become durable.
fn fail_codes(codes: &mut [u8], result: Result<(), JournalError>) -> bool {
    if let Err(error) = result {
        tracing::error!(%error, "subscription change not acknowledged");
        for code in codes.iter_mut().filter(|c| **c < reason::UNSPECIFIED) {
            *code = reason::UNSPECIFIED;
        }
        return false;
    }
    true
}

/// A connection's task: `opening` (its TLS/WebSocket handshake, CONNECT, the session: [`open`],
/// boxed by the caller), then MQTT until it closes. The permit counts it against the connection
/// limits until then.
///
/// An idle connection's cost is mostly the size of this future, which is the largest state any of
/// its awaits needs: the opening and the ending are boxed, so they take memory only while they
/// run and the parked state is `serve`'s (see "Idle connections" in `docs/benchmarks.md`). This
/// future is spawned as is: wrapped in another `async` block it would be stored twice (once as the
/// block's capture, once as what the block awaits). It is an `async` block, not an `async fn`,
/// so its arguments are captured once, not also copied into locals; tokio's task is 112 bytes
/// more, and in the 896-byte allocation class while this stays within 784
/// (`server::tests::a_connection_task_stays_small`).
#[allow(clippy::manual_async_fn)] // on purpose: see above
pub(crate) fn run(
    opening: Pin<Box<impl Future<Output = Option<(Connection, Link)>> + Send>>,
    permit: ConnectionPermit,
) -> impl Future<Output = ()> + Send {
    async move {
        // Held until the task ends (mentioned, so that the block captures it).
        let _ = &permit;
        let Some((mut conn, mut link)) = opening.await else {
            return;
        };
        let end = conn.serve(&mut link).await;
        Box::pin(conn.finish(end, &mut link.stream)).await;
    }
}

/// What connects a connection's task to its client and to the broker while it serves. One value,
/// passed by one reference: an `async fn` stores each of its parameters twice.
pub(crate) struct Link {
    stream: Stream,
    control: mailbox::Receiver<Control>,
    shutdown: CancellationToken,
}

/// Runs the listener's handshake (`upgrade`), reads CONNECT, authenticates, attaches the session
/// and queues CONNACK. `None` if the connection ended here (refused, timed out, shut down).
pub(crate) async fn open(
    upgrade: impl Future<Output = Option<(Stream, Peer)>> + Send,
    inner: Arc<Inner>,
    shutdown: CancellationToken,
) -> Option<(Connection, Link)> {
    let inner = &inner;
    let (stream, peer) = upgrade.await?;
    let mut stream = stream;
    let mut rbuf = BytesMut::new();
    let handshake = tokio::select! {
        r = tokio::time::timeout(inner.config.connect_timeout, read_connect(&mut stream, &mut rbuf, inner.config.max_packet_size)) => r,
        _ = shutdown.cancelled() => return None,
    };
    let (codec, connect) = match handshake {
        Err(_) => {
            tracing::debug!(%peer, "no CONNECT within the connect timeout; closing");
            return None;
        }
        Ok(Err((reply, why))) => {
            if !reply.is_empty() {
                let _ = tokio::time::timeout(
                    inner.config.close_timeout,
                    transport::send(&mut stream, &reply),
                )
                .await;
            }
            tracing::info!(%peer, why, "handshake refused");
            return None;
        }
        Ok(Ok(c)) => c,
    };
    let mut conn = Connection::establish(codec, *connect, rbuf, inner, &mut stream, peer).await?;
    let (control_tx, control_rx) = mailbox::channel(CONTROL_CHANNEL_CAPACITY);
    if !conn.attach(control_tx).await {
        conn.finish(End::Refused, &mut stream).await;
        return None;
    }
    Some((
        conn,
        Link {
            stream,
            control: control_rx,
            shutdown,
        },
    ))
}

/// Answers a socket refused by the connection limits: reads its CONNECT (briefly, and only up to a
/// small size) to learn its protocol version, then sends CONNACK 0x97 Quota exceeded.
pub(crate) async fn refuse_over_limit(
    stream: tokio::net::TcpStream,
    inner: Arc<Inner>,
    refused: Refused,
    _slot: RefusalSlot,
) {
    let mut stream = Stream::Tcp(stream);
    let mut rbuf = BytesMut::new();
    let close_timeout = inner.config.close_timeout;
    let read = read_connect(&mut stream, &mut rbuf, REFUSED_CONNECT_MAX_BYTES);
    match tokio::time::timeout(close_timeout, read).await {
        Ok(Ok((mut codec, _))) => {
            refuse(
                &mut codec,
                &mut stream,
                close_timeout,
                reason::QUOTA_EXCEEDED,
                Some(refused.why()),
            )
            .await
        }
        Ok(Err((reply, _))) if !reply.is_empty() => {
            let _ = tokio::time::timeout(close_timeout, transport::send(&mut stream, &reply)).await;
        }
        _ => {}
    }
}

/// Reads until the first packet (which must be CONNECT) is decoded. `Err` carries the bytes to send
/// before closing (a refusing CONNACK, or nothing).
async fn read_connect(
    rd: &mut Stream,
    rbuf: &mut BytesMut,
    max_packet_size: u32,
) -> Result<(Codec, Box<ConnectInfo>), (BytesMut, &'static str)> {
    let mut codec: Option<Codec> = None;
    loop {
        if codec.is_none() {
            match codec::probe(rbuf) {
                Probe::Incomplete => {}
                Probe::NotMqtt => return Err((BytesMut::new(), "not an MQTT CONNECT")),
                Probe::UnsupportedLevel(level) => {
                    let reply = BytesMut::from(codec::unsupported_level_connack(level));
                    return Err((reply, "unsupported MQTT protocol level"));
                }
                Probe::Mqtt(v) => codec = Some(Codec::new(v, max_packet_size)),
            }
        }
        if let Some(c) = codec.as_mut() {
            match c.decode(rbuf) {
                Ok(Some(Inbound::Connect(connect))) => {
                    let Some(codec) = codec else {
                        return Err((BytesMut::new(), "no codec"));
                    };
                    return Ok((codec, connect));
                }
                Ok(Some(_)) => return Err((BytesMut::new(), "the first packet is not a CONNECT")),
                Ok(None) => {}
                Err(v) => {
                    let mut reply = BytesMut::new();
                    if c.version() == Version::V5 || v.code == reason::CLIENT_ID_NOT_VALID {
                        c.refuse_connack(v.code, Some(v.reason), &mut reply);
                    }
                    return Err((reply, v.reason));
                }
            }
        }
        match transport::read_some(rd, rbuf).await {
            Ok(0) | Err(_) => return Err((BytesMut::new(), "closed before its CONNECT")),
            Ok(_) => {}
        }
    }
}

/// The DISCONNECT for a PUBLISH whose topic name is not one.
fn publish_topic_violation(problem: TopicNameProblem) -> Violation {
    match problem {
        TopicNameProblem::Empty => Violation::new(reason::PROTOCOL_ERROR, "PUBLISH topic is empty"),
        TopicNameProblem::Nul => {
            Violation::new(reason::MALFORMED, "PUBLISH topic contains U+0000 (NUL)")
        }
        TopicNameProblem::Wildcard => {
            Violation::new(reason::TOPIC_NAME_INVALID, "PUBLISH topic has wildcards")
        }
    }
}

/// The DISCONNECT (or refusing CONNACK, for a will) for a Response Topic that is not a topic name
/// (MQTT-3.3.2-14: no wildcards).
fn response_topic_violation(problem: TopicNameProblem) -> Violation {
    match problem {
        TopicNameProblem::Empty => {
            Violation::new(reason::PROTOCOL_ERROR, "Response Topic is empty")
        }
        TopicNameProblem::Nul => {
            Violation::new(reason::MALFORMED, "Response Topic contains U+0000 (NUL)")
        }
        TopicNameProblem::Wildcard => {
            Violation::new(reason::PROTOCOL_ERROR, "Response Topic has wildcards")
        }
    }
}

/// Whether a payload announced as UTF-8 (Payload Format Indicator 1) is UTF-8.
fn payload_format_valid(properties: &PublishProperties, payload: &[u8]) -> bool {
    !properties.payload_is_utf8 || std::str::from_utf8(payload).is_ok()
}

/// Writes a refusing CONNACK (the connection closes after it).
async fn refuse(
    codec: &mut Codec,
    wr: &mut Stream,
    close_timeout: Duration,
    code: u8,
    why: Option<&str>,
) {
    let mut out = BytesMut::new();
    codec.refuse_connack(code, why, &mut out);
    let _ = tokio::time::timeout(close_timeout, transport::send(wr, &out)).await;
}

/// Asks the authenticator (on a blocking thread: password hashes are slow on purpose) unless the
/// source address has failed too often; counts failures. `Err` is the CONNACK reason code.
async fn authenticate(
    inner: &Arc<Inner>,
    connect: &ConnectInfo,
    client_id: &Arc<str>,
    peer: &Peer,
) -> Result<Identity, u8> {
    let ip = peer.addr.ip();
    if let Verdict::Limited { first } = inner.auth_failures.check(ip, inner.clock.now()) {
        if first {
            tracing::warn!(address = %ip, "too many failed authentications from this address; refusing its CONNECTs until the limit refills");
        } else {
            tracing::debug!(address = %ip, %client_id, "CONNECT refused: address rate-limited after failed authentications");
        }
        return Err(Refusal::NotAuthorized.reason_code());
    }
    let attempt = ConnectAttempt {
        client_id: client_id.clone(),
        username: connect.username.as_deref().map(Arc::from),
        password: connect.password.clone(),
        auth_method: connect.auth_method.as_deref().map(Arc::from),
        auth_data: connect.auth_data.clone(),
        peer: peer.addr,
        cert_identity: peer.cert_identity.clone(),
    };
    let authenticator = inner.security.authenticator.clone();
    let authenticated = if authenticator.blocks() {
        // The permit goes with the work: it is held until the authenticator returns, even if this
        // connection gives up waiting. The semaphore is never closed, so `Err` cannot happen.
        let slot = inner.auth_slots.clone().acquire_owned().await.ok();
        let authenticate = move || {
            let _slot = slot;
            authenticator.authenticate(&attempt)
        };
        tokio::task::spawn_blocking(authenticate).await
    } else {
        Ok(authenticator.authenticate(&attempt))
    };
    match authenticated {
        Ok(Ok(identity)) => Ok(identity),
        Ok(Err(refusal)) => {
            inner.auth_failures.record_failure(ip, inner.clock.now());
            let code = refusal.reason_code();
            tracing::info!(%peer, %client_id, reason_code = format_args!("{code:#04x}"), "CONNECT refused: authentication failed");
            Err(code)
        }
        Err(e) => {
            tracing::error!(%peer, %client_id, "authenticator failed: {e}; refusing the CONNECT");
            Err(Refusal::NotAuthorized.reason_code())
        }
    }
}

pub(crate) struct Connection {
    inner: Arc<Inner>,
    conn_id: u64,
    codec: Codec,
    client_id: Arc<str>,
    /// What of CONNECT is still needed once connected (all of it would stay in every connection).
    connect: Requested,
    assigned_id: bool,
    session: Option<Arc<SessionHandle>>,
    session_present: bool,
    rbuf: BytesMut,
    out: BytesMut,
    /// Unacknowledged QoS 1/2 towards the client: its Receive Maximum capped by our `max_inflight`.
    send_window: u16,
    client_max_packet: u32,
    keep_alive: Option<Duration>,
    /// The keep-alive CONNACK tells an MQTT 5 client to use (when `server_keep_alive_secs` is set).
    server_keep_alive: Option<u16>,
    session_expiry_secs: u32,
    aliases: TopicAliases,
    /// Made on first use and dropped once all of it is done (see [`Underway`]).
    underway: Option<Box<Underway>>,
    /// Boxed: most connections have none, and inline it would cost every one.
    will: Option<Box<Will>>,
    /// Only its name: the rest of what the listener knew was used by CONNECT.
    peer: PeerName,
    /// Who the client authenticated as.
    identity: Identity,
}

/// What a connection has under way with its client, besides the session: replies it owes, a
/// publish waiting for a service, acks held back. An idle connection has none of it, so it is
/// boxed, made on first use and dropped when done: inline, it would cost every connection 150 bytes.
#[derive(Default)]
struct Underway {
    /// Replies waiting for a service or for durability.
    pending: Replies,
    inbound_qos1_pending: usize,
    /// QoS 2 packet ids whose PUBREC waits for a service or for durability.
    qos2_awaiting_service: BTreeSet<u16>,
    /// A claimed-topic publish waiting for room in its service's inbox. While set, the connection
    /// reads nothing more from the socket (back-pressure) but still writes acks and deliveries.
    stalled: Option<Box<Stalled>>,
    /// Service acknowledgements held back while this client's own queue is full (see
    /// [`Connection::on_ack_ready`]), in the order they resolved.
    held_acks: VecDeque<(u16, AckKind, u8)>,
    /// For each of this client's publishes whose acknowledgement waits for durability: the first
    /// sequence number its own session's queue could have given the client's own copy (with a
    /// count, for publishes that share one). Queued messages from the smallest on are not sent
    /// until that acknowledgement is written: a client subscribed to what it publishes gets its
    /// PUBACK before its copy, as from a broker that acknowledges at once. Clients (paho's
    /// interop tests among them) that wait for the copy and then disconnect would otherwise lose
    /// the PUBACK with the connection and re-send the publish on the next one.
    delivery_holds: BTreeMap<u64, usize>,
}

impl Underway {
    fn is_done(&self) -> bool {
        self.pending.is_empty()
            && self.inbound_qos1_pending == 0
            && self.qos2_awaiting_service.is_empty()
            && self.stalled.is_none()
            && self.held_acks.is_empty()
            && self.delivery_holds.is_empty()
    }

    /// The next reply ready; `None` if none is owed.
    fn poll_reply(
        underway: &mut Option<Box<Underway>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Deferred>> {
        match underway {
            Some(u) => u.pending.poll_next(cx),
            None => Poll::Ready(None),
        }
    }
}

/// The CONNECT fields a connection consults after CONNACK.
struct Requested {
    clean_start: bool,
    /// Session Expiry Interval as requested (`None`: MQTT 3.1.1 or not given).
    session_expiry_secs: Option<u32>,
    /// Boxed `str`, not the codec's 32-byte `ByteString`: kept in every connection.
    auth_method: Option<Box<str>>,
}

struct Stalled {
    inbox: mpsc::Sender<ServiceRequest>,
    request: ServiceRequest,
}

impl Connection {
    /// Validates and authenticates CONNECT; on refusal writes the CONNACK and returns `None`.
    async fn establish(
        mut codec: Codec,
        connect: ConnectInfo,
        rbuf: BytesMut,
        inner: &Arc<Inner>,
        wr: &mut Stream,
        peer: Peer,
    ) -> Option<Self> {
        let cfg = &inner.config;
        let imposed_id = peer.imposed_client_id();
        let refusal = if imposed_id.is_err() {
            Some((
                reason::NOT_AUTHORIZED,
                "this listener takes the client id from the client certificate; present one",
            ))
        } else if connect.client_id.len() > cfg.max_client_id_len {
            Some((reason::CLIENT_ID_NOT_VALID, "client id too long"))
        } else if connect
            .will
            .as_ref()
            .is_some_and(|w| !topic::is_valid_topic_name(&w.message.topic))
        {
            Some((reason::TOPIC_NAME_INVALID, "invalid will topic"))
        } else if connect
            .will
            .as_ref()
            .is_some_and(|w| !cfg.topic_within_limits(&w.message.topic))
        {
            Some((
                reason::TOPIC_NAME_INVALID,
                "will topic longer or deeper than the server allows",
            ))
        } else if codec.version() == Version::V3
            && cfg
                .server_keep_alive_secs
                .is_some_and(|max| connect.keep_alive == 0 || connect.keep_alive > max)
        {
            // MQTT 3.1.1 has no Server Keep Alive to lower it with; Mosquitto refuses the same way.
            Some((
                reason::CLIENT_ID_NOT_VALID,
                "keep-alive 0 or longer than the server's maximum (server_keep_alive)",
            ))
        } else if let Some(v) = connect.will.as_ref().and_then(|w| {
            let response_topic = w.message.properties.response_topic.as_deref()?;
            topic::topic_name_problem(response_topic).map(response_topic_violation)
        }) {
            Some((v.code, v.reason))
        } else if connect
            .will
            .as_ref()
            .is_some_and(|w| !payload_format_valid(&w.message.properties, &w.message.payload))
        {
            Some((
                reason::PAYLOAD_FORMAT_INVALID,
                "will payload is not UTF-8 although its Payload Format Indicator says so",
            ))
        } else {
            None
        };
        if let Some((code, why)) = refusal {
            refuse(&mut codec, wr, cfg.close_timeout, code, Some(why)).await;
            tracing::debug!(%peer, client_id = %connect.client_id, why, "CONNECT refused");
            return None;
        }
        // An imposed id that differs from the requested one is announced like an assigned one.
        let (client_id, assigned_id): (Arc<str>, bool) = match imposed_id {
            Ok(Some(id)) => (id.clone(), **id != *connect.client_id),
            _ if connect.client_id.is_empty() => (inner.client_ids.next(), true),
            _ => (Arc::from(&*connect.client_id), false),
        };
        // Authentication failures get no reason string: nothing that helps guessing.
        let identity = match authenticate(inner, &connect, &client_id, &peer).await {
            Ok(identity) => identity,
            Err(code) => {
                refuse(&mut codec, wr, cfg.close_timeout, code, None).await;
                return None;
            }
        };
        if let Some(will) = &connect.will {
            let who = Principal {
                client_id: &client_id,
                identity: &identity,
            };
            if !inner
                .security
                .authorizer
                .may_publish(who, &will.message.topic)
            {
                tracing::info!(%peer, %client_id, topic = %will.message.topic, "CONNECT refused: the will topic is not authorized");
                refuse(
                    &mut codec,
                    wr,
                    cfg.close_timeout,
                    reason::NOT_AUTHORIZED,
                    None,
                )
                .await;
                return None;
            }
        }
        let session_expiry_secs = match connect.session_expiry_secs {
            Some(requested) => requested.min(cfg.session_expiry_max_secs),
            // MQTT 3.1.1: a persistent session lives as long as we allow.
            None if connect.clean_start => 0,
            None => cfg.session_expiry_max_secs,
        };
        // Within `server_keep_alive_secs` (checked above for MQTT 3.1.1 clients, which cannot be
        // told another value): a longer or disabled (0) keep-alive becomes the maximum.
        let keep_alive_secs = match cfg.server_keep_alive_secs {
            Some(max) if connect.keep_alive == 0 || connect.keep_alive > max => max,
            _ => connect.keep_alive,
        };
        // The registry caps the will delay at the session expiry when the connection ends.
        let will = connect.will.map(Box::new);
        Some(Self {
            conn_id: inner.next_conn_id(),
            inner: inner.clone(),
            send_window: connect.receive_maximum.min(cfg.max_inflight).max(1),
            client_max_packet: connect.max_packet_size,
            keep_alive: cfg.keep_alive_deadline(keep_alive_secs),
            server_keep_alive: cfg.server_keep_alive_secs.map(|_| keep_alive_secs),
            aliases: TopicAliases::new(cfg.topic_alias_maximum),
            codec,
            client_id,
            assigned_id,
            session: None,
            session_present: false,
            rbuf,
            out: BytesMut::new(),
            session_expiry_secs,
            underway: None,
            will,
            peer: peer.name(),
            identity,
            connect: Requested {
                clean_start: connect.clean_start,
                session_expiry_secs: connect.session_expiry_secs,
                auth_method: connect.auth_method.as_deref().map(Box::from),
            },
        })
    }

    fn underway(&mut self) -> &mut Underway {
        self.underway.get_or_insert_with(Box::default)
    }

    fn is_stalled(&self) -> bool {
        self.underway.as_ref().is_some_and(|u| u.stalled.is_some())
    }

    fn has_held_acks(&self) -> bool {
        self.underway
            .as_ref()
            .is_some_and(|u| !u.held_acks.is_empty())
    }

    fn principal(&self) -> Principal<'_> {
        Principal {
            client_id: &self.client_id,
            identity: &self.identity,
        }
    }

    fn session(&self) -> &Arc<SessionHandle> {
        // `attach` sets it before anything else runs.
        self.session
            .as_ref()
            .unwrap_or_else(|| unreachable!("session used before attach"))
    }

    /// Attaches to the session (taking it over if needed), sends CONNACK and re-sends what was in
    /// flight. Returns `false` if the connection must close.
    async fn attach(&mut self, control: mailbox::Sender<Control>) -> bool {
        if let Some(claimed) = self
            .inner
            .router
            .peers()
            .and_then(|p| p.claim(&self.client_id))
        {
            // Another node's connection with this client id is taken over first (decision 0044).
            claimed.await;
        }
        let deadline = self.inner.clock.tokio_now() + self.inner.config.takeover_timeout;
        // A cluster node: the session may live on another node (decision 0047). A copy this
        // CONNECT creates or takes in gets `copy`.
        let copy = self.inner.registry.new_copy();
        let Some(resume) = self.locate_elsewhere(deadline, copy).await else {
            return false;
        };
        let (handle, session_present, effects, durable) = loop {
            let owner = Owner {
                conn_id: self.conn_id,
                control: control.clone(),
            };
            let force = self.inner.clock.tokio_now() >= deadline;
            match self.inner.registry.attach(
                &self.client_id,
                self.connect.clean_start,
                self.session_expiry_secs,
                owner,
                force,
                resume,
            ) {
                Attach::Attached {
                    handle,
                    session_present,
                    effects,
                    durable,
                } => break (handle, session_present, effects, durable),
                Attach::Wait(done) => {
                    tracing::debug!(client_id = %self.client_id, "taking over session from a live connection");
                    let _ = tokio::time::timeout_at(deadline, done).await;
                }
                // The copy located or taken in for this CONNECT was dropped before it attached
                // (it expired, or another node's claim of the client id dropped it). A fresh
                // session in its place would answer Session Present 0 for a session that may
                // exist (robustness seed 500764's shape) and overwrite its row: refuse,
                // retryably; the retry locates it again.
                Attach::Vanished => {
                    tracing::warn!(client_id = %self.client_id, "CONNECT refused: the session located for it was dropped before it attached");
                    self.codec.refuse_connack(
                        reason::SERVER_BUSY,
                        Some("the session moved while this connection took it; retry"),
                        &mut self.out,
                    );
                    return false;
                }
            }
        };
        // The will is kept with a persistent session while the client is connected, so that it
        // is published even if this node dies (decision 0054).
        let will_kept = {
            let mut session = handle.lock();
            session.set_will(self.will.as_deref());
            session.commit()
        };
        self.inner.apply(effects);
        self.session = Some(handle);
        self.session_present = session_present;
        if let Err(error) = all_durable(durable.into_iter().chain(will_kept).collect()).await {
            // The session exists in memory only: refuse rather than promise what a crash loses.
            tracing::error!(client_id = %self.client_id, %error, "CONNECT refused");
            if !session_present {
                // Made by this CONNECT: it goes with it, or the retry would resume it.
                if let Some(ended) = self
                    .inner
                    .registry
                    .discard_refused(&self.client_id, self.conn_id)
                {
                    self.inner.apply(crate::registry::Effects {
                        ended: vec![ended],
                        ..Default::default()
                    });
                }
            }
            self.codec.refuse_connack(
                reason::UNSPECIFIED,
                Some("session state could not be stored"),
                &mut self.out,
            );
            return false;
        }

        let cfg = &self.inner.config;
        let requested_expiry = self.connect.session_expiry_secs;
        let ack = ConnAck {
            session_present,
            session_expiry_secs: requested_expiry
                .filter(|r| *r != self.session_expiry_secs)
                .map(|_| self.session_expiry_secs),
            receive_maximum: cfg.receive_maximum,
            max_packet_size: cfg.max_packet_size,
            assigned_client_id: self.assigned_id.then(|| ByteString::from(&*self.client_id)),
            topic_alias_maximum: cfg.topic_alias_maximum,
            server_keep_alive: self.server_keep_alive,
            shared_subscriptions: cfg.shared_subscriptions,
            auth_method: self.connect.auth_method.as_deref().map(ByteString::from),
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

    /// On a resumed session, everything in flight goes again: PUBLISH with DUP, or PUBREL — in the
    /// order the messages were first sent (MQTT 5 §4.6), which is their `seq`, not their packet
    /// ids: those start again at 1 in a session put back on another node while the ones it
    /// brought stay in flight, and wrap. By packet id, an observer got a change queued after the
    /// move before an older one that was in flight across it (cluster simulation seeds 24, 133).
    fn resend_inflight(&mut self) {
        let session = self.session().clone();
        let mut state = session.lock();
        let now = self.inner.clock.now();
        let mut too_large = Vec::new();
        let mut in_order: Vec<_> = state.inflight.iter().collect();
        in_order.sort_by_key(|(_, inflight)| inflight.delivery.seq);
        for (&packet_id, inflight) in in_order {
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
            state.drop_inflight(id);
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
        let before_seq = self
            .underway
            .as_ref()
            .and_then(|u| u.delivery_holds.keys().next().copied());
        session
            .lock()
            .pump(self.inner.clock.now(), self.send_window, before_seq, |p| {
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
            session.wake.notify();
        }
    }

    /// Serves the connection until it ends. An `async` block, not an `async fn`: the two
    /// references are captured once, not also copied into locals (this is the parked state).
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn serve<'a>(&'a mut self, link: &'a mut Link) -> impl Future<Output = End> + Send + 'a {
        async move {
            let session = self.session().clone();
            // When the keep-alive expires; the timer below may be set earlier (it is moved on only
            // when it fires, not at every packet, to spare the timer wheel).
            let mut keep_alive_at = self.keep_alive.map(|d| self.inner.clock.tokio_now() + d);
            let keep_alive = tokio::time::sleep_until(
                keep_alive_at.unwrap_or_else(|| self.inner.clock.tokio_now()),
            );
            tokio::pin!(keep_alive);
            // Packets that arrived together with CONNECT.
            if let Err(end) = self.handle_buffered() {
                return end;
            }
            loop {
                if self.has_held_acks() {
                    self.release_held_acks();
                }
                if !self.out.is_empty() {
                    let slow = self.inner.config.slow_consumer_timeout;
                    match tokio::time::timeout(slow, transport::send(&mut link.stream, &self.out))
                        .await
                    {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => return End::Closed,
                        Err(_) => return End::SlowConsumer,
                    }
                    // Released once drained, like the read buffer below: an idle connection holds no
                    // buffer, and one more allocation per write or read is cheap next to its system call.
                    self.out = BytesMut::new();
                }
                if self.rbuf.is_empty() {
                    // Its storage is mostly shared with the packets decoded from it: kept, it would
                    // hold a second allocation too.
                    self.rbuf = BytesMut::new();
                }
                if self.underway.as_ref().is_some_and(|u| u.is_done()) {
                    self.underway = None;
                }
                let stalled_inbox = self
                    .underway
                    .as_ref()
                    .and_then(|u| u.stalled.as_ref())
                    .map(|s| s.inbox.clone());
                let inbox_room = async {
                    match &stalled_inbox {
                        // Boxed: only a stalled connection needs its state.
                        Some(inbox) => Box::pin(inbox.reserve()).await,
                        None => std::future::pending().await,
                    }
                };
                // What the connection waits on is polled in place (`poll_fn`), not held as futures:
                // this wait is the state every idle connection parks in.
                tokio::select! {
                    biased;
                    _ = link.shutdown.cancelled() => return End::Shutdown,
                    ctl = poll_fn(|cx| link.control.poll_recv(cx)) => match ctl {
                        Some(Control::TakeOver { done }) => return End::TakenOver(Some(done)),
                        Some(Control::Disconnect { reason_code, reason_string, will }) => {
                            return End::Kicked { reason_code, reason_string, will }
                        }
                        // The registry dropped our channel: the session was taken by force.
                        None => return End::TakenOver(None),
                    },
                    Some(deferred) = poll_fn(|cx| Underway::poll_reply(&mut self.underway, cx)), if self.underway.as_ref().is_some_and(|u| !u.pending.is_empty()) => {
                        self.on_deferred(deferred);
                    }
                    room = inbox_room => {
                        let stalled = self.underway.as_mut().and_then(|u| u.stalled.take());
                        // (A closed inbox drops the request: its ack resolves as 0x80.)
                        if let (Ok(permit), Some(stalled)) = (room, stalled) {
                            permit.send(stalled.request);
                        }
                        if let Err(end) = self.handle_buffered() {
                            return end;
                        }
                    }
                    read = poll_fn(|cx| transport::poll_read_some(&mut link.stream, &mut self.rbuf, cx)), if !self.is_stalled() => match read {
                        Ok(0) | Err(_) => return End::Closed,
                        Ok(_) => {
                            if let Some(d) = self.keep_alive {
                                keep_alive_at = Some(self.inner.clock.tokio_now() + d);
                            }
                            if let Err(end) = self.handle_buffered() {
                                return end;
                            }
                        }
                    },
                    _ = poll_fn(|cx| session.wake.poll_wait(cx)) => self.pump(),
                    _ = &mut keep_alive, if keep_alive_at.is_some() => match keep_alive_at {
                        Some(at) if at > self.inner.clock.tokio_now() => keep_alive.as_mut().reset(at),
                        _ => return End::KeepAliveTimeout,
                    },
                }
                self.gather_ready(&session);
            }
        }
    }

    /// Takes in whatever else is ready right now, so that it leaves in the same write: a service
    /// acknowledges a request and publishes its reply at about the same moment, and one `send` for
    /// both halves the system calls of a request/response exchange.
    fn gather_ready(&mut self, session: &SessionHandle) {
        use futures::FutureExt;
        while let Some(Some(deferred)) =
            poll_fn(|cx| Underway::poll_reply(&mut self.underway, cx)).now_or_never()
        {
            self.on_deferred(deferred);
        }
        if session.wake.take() {
            self.pump();
        }
    }

    /// Handles the complete packets in the read buffer, stopping early under back-pressure.
    fn handle_buffered(&mut self) -> Result<(), End> {
        while !self.is_stalled() {
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
                self.release_qos2(packet_id, AckKind::Complete, |known| {
                    if known {
                        reason::SUCCESS
                    } else {
                        reason::PACKET_ID_NOT_FOUND
                    }
                });
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
                    self.session()
                        .lock()
                        .set_expiry(self.session_expiry_secs, &*self.inner.clock);
                }
                return Err(End::ClientDisconnect {
                    will: if code == reason::DISCONNECT_WITH_WILL {
                        WillOnEnd::Publish
                    } else {
                        WillOnEnd::Skip
                    },
                });
            }
            Inbound::Connect(_) => {
                return Err(End::Violation(Violation::new(
                    reason::PROTOCOL_ERROR,
                    "second CONNECT",
                )));
            }
            Inbound::Auth if self.connect.auth_method.is_some() => {
                return Err(End::Violation(Violation::new(
                    reason::NOT_AUTHORIZED,
                    "re-authentication is not supported; reconnect with fresh credentials",
                )));
            }
            Inbound::Auth => {
                return Err(End::Violation(Violation::new(
                    reason::PROTOCOL_ERROR,
                    "AUTH without an authentication method",
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
        if let Some(problem) = topic::topic_name_problem(&topic) {
            return Err(End::Violation(publish_topic_violation(problem)));
        }
        if !self.inner.config.topic_within_limits(&topic) {
            return Err(End::Violation(Violation::new(
                reason::TOPIC_NAME_INVALID,
                "PUBLISH topic longer or deeper than the server allows",
            )));
        }
        if let Some(problem) = p
            .properties
            .response_topic
            .as_deref()
            .and_then(topic::topic_name_problem)
        {
            return Err(End::Violation(response_topic_violation(problem)));
        }
        let packet_id = p.packet_id.unwrap_or(0);
        if !payload_format_valid(&p.properties, &p.payload) {
            tracing::debug!(client_id = %self.client_id, %topic, "PUBLISH refused: Payload Format Indicator 1 but the payload is not UTF-8");
            // As for an unauthorized publish: QoS 0 has no acknowledgement to refuse with.
            let kind = match p.qos {
                QoS::AtMostOnce => return Ok(()),
                QoS::AtLeastOnce => AckKind::Acknowledge,
                QoS::ExactlyOnce => AckKind::Received,
            };
            self.codec.ack(
                kind,
                packet_id,
                reason::PAYLOAD_FORMAT_INVALID,
                &mut self.out,
            );
            return Ok(());
        }
        if !self
            .inner
            .security
            .authorizer
            .may_publish(self.principal(), &topic)
        {
            tracing::debug!(client_id = %self.client_id, %topic, "PUBLISH not authorized");
            // QoS 0 has no acknowledgement to refuse with: the message is dropped.
            let kind = match p.qos {
                QoS::AtMostOnce => return Ok(()),
                QoS::AtLeastOnce => AckKind::Acknowledge,
                QoS::ExactlyOnce => AckKind::Received,
            };
            self.codec
                .ack(kind, packet_id, reason::NOT_AUTHORIZED, &mut self.out);
            return Ok(());
        }
        if p.qos != QoS::AtMostOnce {
            let qos1 = self.underway.as_ref().map_or(0, |u| u.inbound_qos1_pending);
            let in_use = qos1 + self.session().lock().inbound_qos2.len();
            if in_use >= usize::from(self.inner.config.receive_maximum) {
                return Err(End::Violation(Violation::new(
                    reason::RECEIVE_MAXIMUM_EXCEEDED,
                    "more unacknowledged QoS 1/2 publishes than the Receive Maximum",
                )));
            }
        }
        if p.qos == QoS::ExactlyOnce && self.session().lock().inbound_qos2.contains(&packet_id) {
            // A retry of a QoS 2 message we already have: never route it twice.
            let awaiting = self
                .underway
                .as_ref()
                .is_some_and(|u| u.qos2_awaiting_service.contains(&packet_id));
            if !awaiting {
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
            let (request, ack) = ServiceRequest::new(
                self.client_id.clone(),
                self.identity.clone(),
                message,
                p.dup,
            );
            match inbox.try_send(request) {
                Ok(()) => {}
                // Back-pressure: stop reading until the inbox has room.
                Err(mpsc::error::TrySendError::Full(request)) => {
                    self.underway().stalled = Some(Box::new(Stalled { inbox, request }))
                }
                // The service is gone: the dropped request resolves its ack as 0x80.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
            let kind = match p.qos {
                QoS::AtMostOnce => return Ok(()),
                QoS::AtLeastOnce => {
                    self.underway().inbound_qos1_pending += 1;
                    AckKind::Acknowledge
                }
                QoS::ExactlyOnce => {
                    self.underway().qos2_awaiting_service.insert(packet_id);
                    AckKind::Received
                }
            };
            let journalled = (p.qos == QoS::ExactlyOnce)
                .then(|| self.receive_qos2(packet_id))
                .flatten();
            self.underway()
                .pending
                .push(service_ack(packet_id, kind, ack, journalled));
            return Ok(());
        }
        // Whatever the own session queues from here on may be this publish's own copy.
        let hold = self.session().lock().next_seq;
        let mut durable = self
            .inner
            .router
            .route(message, Some(&self.client_id))
            .durable;
        if p.qos == QoS::ExactlyOnce {
            // Recorded after the deliveries, so the log never holds the id without them: a retry
            // after a restart is only taken for a duplicate when the original's deliveries survived.
            durable.extend(self.receive_qos2(packet_id));
        }
        if p.qos != QoS::AtMostOnce && !durable.is_empty() {
            // It changed durable state: acknowledge once that is on disk.
            let kind = if p.qos == QoS::AtLeastOnce {
                self.underway().inbound_qos1_pending += 1;
                AckKind::Acknowledge
            } else {
                self.underway().qos2_awaiting_service.insert(packet_id);
                AckKind::Received
            };
            let underway = self.underway();
            *underway.delivery_holds.entry(hold).or_default() += 1;
            underway
                .pending
                .push(durable_ack(packet_id, kind, durable, hold));
            return Ok(());
        }
        match p.qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => self.codec.ack(
                AckKind::Acknowledge,
                packet_id,
                reason::SUCCESS,
                &mut self.out,
            ),
            QoS::ExactlyOnce => {
                self.codec
                    .ack(AckKind::Received, packet_id, reason::SUCCESS, &mut self.out)
            }
        }
        Ok(())
    }

    /// Takes in an inbound QoS 2 packet id; returns when that is durable if the session is
    /// persistent.
    fn receive_qos2(&self, packet_id: u16) -> Option<Durable> {
        let mut session = self.session().lock();
        session.receive_qos2(packet_id);
        session.commit()
    }

    /// Releases an inbound QoS 2 packet id and sends the `kind` ack that tells the client (with the
    /// code `code` picks from whether the id was in use). In a persistent session the ack waits
    /// until the release is durable: the client reuses the id once it has the ack, and a release
    /// lost in a crash would bring the id back at restart, so that the next publish with it, if
    /// retried after the restart, would be taken for a retry of the old one and never routed.
    fn release_qos2(&mut self, packet_id: u16, kind: AckKind, code: impl FnOnce(bool) -> u8) {
        let (code, durable) = {
            let mut session = self.session().lock();
            let known = session.release_qos2(packet_id);
            (code(known), session.commit())
        };
        match durable {
            Some(durable) => self
                .underway()
                .pending
                .push(released_ack(packet_id, kind, code, durable)),
            None => self.codec.ack(kind, packet_id, code, &mut self.out),
        }
    }

    fn on_deferred(&mut self, deferred: Deferred) {
        match deferred {
            Deferred::Ack {
                packet_id,
                kind,
                code,
            } => self.on_ack_ready(packet_id, kind, code),
            Deferred::DurableAck {
                packet_id,
                kind,
                code,
                hold,
            } => {
                self.on_ack_ready(packet_id, kind, code);
                // Released once the ack is written (or held for a full queue: then the copy need
                // not wait for it, and must not, or neither would ever leave).
                if let Some(holds) = self.underway.as_mut().map(|u| &mut u.delivery_holds) {
                    if let Some(count) = holds.get_mut(&hold) {
                        *count -= 1;
                        if *count == 0 {
                            holds.remove(&hold);
                        }
                    }
                }
                self.pump();
            }
            Deferred::SubAck {
                packet_id,
                codes,
                retained,
            } => self.send_suback(packet_id, codes, retained),
            Deferred::UnsubAck { packet_id, codes } => {
                self.codec.unsuback(packet_id, codes, &mut self.out)
            }
            Deferred::Released {
                packet_id,
                kind,
                code,
            } => self.codec.ack(kind, packet_id, code, &mut self.out),
        }
    }

    /// A PUBACK/PUBREC is ready. It is held while the client's own queue is full: the client then
    /// cannot send more than its Receive Maximum of publishes, so the replies a service owes it stay
    /// within the service headroom of its queue instead of being dropped (a client that pipelines
    /// requests without reading its replies is slowed down, not failed). Decision 0010.
    fn on_ack_ready(&mut self, packet_id: u16, kind: AckKind, code: u8) {
        if self.has_held_acks() || self.own_queue_full() {
            self.underway().held_acks.push_back((packet_id, kind, code));
            return;
        }
        self.send_ack(packet_id, kind, code);
    }

    fn own_queue_full(&self) -> bool {
        self.session().lock().queue.len() >= self.inner.config.max_queued_messages
    }

    /// Sends held acks, in order, while the client's queue has room.
    fn release_held_acks(&mut self) {
        while self.has_held_acks() && !self.own_queue_full() {
            if let Some((packet_id, kind, code)) = self.underway().held_acks.pop_front() {
                self.send_ack(packet_id, kind, code);
            }
        }
    }

    fn send_ack(&mut self, packet_id: u16, kind: AckKind, code: u8) {
        match kind {
            AckKind::Acknowledge => {
                let underway = self.underway();
                debug_assert!(underway.inbound_qos1_pending > 0);
                underway.inbound_qos1_pending = underway.inbound_qos1_pending.saturating_sub(1);
            }
            AckKind::Received => {
                self.underway().qos2_awaiting_service.remove(&packet_id);
                if code >= reason::UNSPECIFIED {
                    // A failed PUBREC ends the QoS 2 flow: no PUBREL will come.
                    self.release_qos2(packet_id, kind, |_| code);
                    return;
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
        let now = self.inner.clock.now();
        let mut codes = Vec::with_capacity(filters.len());
        // The filters whose retained messages go out after the SUBACK, with their QoS.
        let mut wanted: Vec<(String, QoS)> = Vec::new();
        let mut durable = Vec::new();
        for (raw, req) in filters {
            let Some(filter) = topic::parse_filter(&raw) else {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            };
            if !self.inner.config.topic_within_limits(filter.filter) {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            }
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
            if !self
                .inner
                .security
                .authorizer
                .may_subscribe(self.principal(), filter.filter)
            {
                tracing::debug!(client_id = %self.client_id, filter = %raw, "SUBSCRIBE not authorized");
                codes.push(reason::NOT_AUTHORIZED);
                continue;
            }
            let max_subscriptions = self.inner.config.max_subscriptions_per_session;
            if max_subscriptions > 0 {
                let state = session.lock();
                if state.subscriptions.len() >= max_subscriptions
                    && !state.subscriptions.contains_key(&raw)
                {
                    drop(state);
                    tracing::debug!(client_id = %self.client_id, filter = %raw, "SUBSCRIBE refused: the session holds the most subscriptions allowed");
                    codes.push(reason::QUOTA_EXCEEDED);
                    continue;
                }
            }
            let options = SubscriptionOptions {
                qos: req.qos,
                no_local: req.no_local,
                retain_as_published: req.retain_as_published,
                retain_handling: req.retain_handling,
                subscription_id,
            };
            let (is_new, settled) = self.inner.router.subscribe(&session, filter, options);
            let mut state = session.lock();
            state.subscribe(raw.clone(), options);
            durable.extend(state.commit());
            if let Some(settled) = settled {
                // In force cluster-wide before the SUBACK (decision 0044).
                durable.push(Box::pin(async move {
                    settled.await;
                    Ok(())
                }));
            }
            drop(state);
            // Shared subscriptions never get retained messages.
            let send_retained = filter.group.is_none()
                && (req.retain_handling == 0 || (req.retain_handling == 1 && is_new));
            if send_retained {
                wanted.push((filter.filter.to_owned(), req.qos));
            }
            codes.push(req.qos as u8);
        }
        // A cluster node that just started waits for the others' retained sets before it
        // collects them, so that it does not serve a message cleared while it was away
        // (decision 0072). Only this SUBSCRIBE's SUBACK and retained messages wait: the
        // connection goes on reading and writing meanwhile.
        let ready = match wanted.is_empty() {
            true => None,
            false => self
                .inner
                .router
                .peers()
                .and_then(|peers| peers.retained_ready()),
        };
        match ready {
            None => {
                let retained = retained_for(&self.inner.router, &wanted, subscription_id, now);
                if durable.is_empty() {
                    self.send_suback(packet_id, codes, retained);
                } else {
                    self.underway().pending.push(Box::pin(async move {
                        let mut codes = codes;
                        let ok = fail_codes(&mut codes, all_durable(durable).await);
                        Deferred::SubAck {
                            packet_id,
                            codes,
                            retained: if ok { retained } else { Vec::new() },
                        }
                    }));
                }
            }
            Some(ready) => {
                let inner = Arc::clone(&self.inner);
                self.underway().pending.push(Box::pin(async move {
                    let mut codes = codes;
                    let ok = fail_codes(&mut codes, all_durable(durable).await);
                    ready.await;
                    let retained = match ok {
                        true => {
                            retained_for(&inner.router, &wanted, subscription_id, inner.clock.now())
                        }
                        false => Vec::new(),
                    };
                    Deferred::SubAck {
                        packet_id,
                        codes,
                        retained,
                    }
                }));
            }
        }
        Ok(())
    }

    fn send_suback(&mut self, packet_id: u16, codes: Vec<u8>, retained: Vec<Delivery>) {
        self.codec.suback(packet_id, codes, &mut self.out);
        let session = self.session().clone();
        for d in retained {
            let limit = self.inner.router.queue_limit(Some(&session.client_id));
            session.deliver(d, limit, None);
        }
    }

    fn on_unsubscribe(&mut self, packet_id: u16, filters: Vec<ByteString>) {
        let session = self.session().clone();
        let mut durable = Vec::new();
        let codes: Vec<u8> = filters
            .iter()
            .map(|raw| {
                let Some(filter) = topic::parse_filter(raw) else {
                    return reason::TOPIC_FILTER_INVALID;
                };
                let mut state = session.lock();
                let existed = state.unsubscribe(raw);
                durable.extend(state.commit());
                drop(state);
                self.inner.router.unsubscribe(&self.client_id, filter);
                if existed {
                    reason::SUCCESS
                } else {
                    reason::NO_SUBSCRIPTION_EXISTED
                }
            })
            .collect();
        if durable.is_empty() {
            self.codec.unsuback(packet_id, codes, &mut self.out);
        } else {
            self.underway().pending.push(Box::pin(async move {
                let mut codes = codes;
                fail_codes(&mut codes, all_durable(durable).await);
                Deferred::UnsubAck { packet_id, codes }
            }));
        }
    }

    /// Sends DISCONNECT if the end calls for one, closes, detaches from the session and publishes
    /// or arms the will.
    async fn finish(mut self, end: End, wr: &mut Stream) {
        let (disconnect, will_on_end, takeover_done, why): (
            Option<(u8, Option<String>)>,
            WillOnEnd,
            _,
            &str,
        ) = match end {
            End::Closed => (None, WillOnEnd::Publish, None, "connection lost"),
            End::ClientDisconnect { will } => (None, will, None, "client disconnected"),
            End::Violation(v) => (
                Some((v.code, Some(v.reason.to_owned()))),
                WillOnEnd::Publish,
                None,
                v.reason,
            ),
            End::KeepAliveTimeout => (
                Some((reason::KEEP_ALIVE_TIMEOUT, None)),
                WillOnEnd::Publish,
                None,
                "keep-alive timeout",
            ),
            End::SlowConsumer => {
                self.out.clear();
                (
                    None,
                    WillOnEnd::Publish,
                    None,
                    "slow consumer: the socket took no write within the slow-consumer timeout",
                )
            }
            End::TakenOver(done) => (
                Some((reason::SESSION_TAKEN_OVER, None)),
                WillOnEnd::Publish,
                done,
                "session taken over",
            ),
            End::Kicked {
                reason_code,
                reason_string,
                will,
            } => (
                Some((reason_code, reason_string)),
                will,
                None,
                "disconnected by a service",
            ),
            End::Shutdown => (
                Some((reason::SERVER_SHUTTING_DOWN, None)),
                WillOnEnd::Publish,
                None,
                "server shutting down",
            ),
            End::Refused => (
                None,
                WillOnEnd::Skip,
                None,
                "session state could not be stored",
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
        let will = match will_on_end {
            WillOnEnd::Skip => None,
            WillOnEnd::Publish | WillOnEnd::OnceLanded => self.will.take().map(|w| *w),
        };
        let mut effects = self
            .inner
            .registry
            .detach(&self.client_id, self.conn_id, will);
        self.inner.emit(ClientEvent::Disconnected {
            client_id: self.client_id.clone(),
        });
        if will_on_end == WillOnEnd::OnceLanded && !effects.wills.is_empty() {
            let wills = std::mem::take(&mut effects.wills);
            tokio::spawn(publish_once_landed(
                self.inner.clone(),
                self.client_id.clone(),
                wills,
            ));
        }
        self.inner.apply(effects);
        if let Some(done) = takeover_done {
            let _ = done.send(());
        }
        tracing::info!(client_id = %self.client_id, peer = %self.peer, reason = why, "client disconnected");
        metrics::client_disconnected();
    }
}
