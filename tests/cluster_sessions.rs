//! Persistent sessions on the chains of a three-node cluster (issue 16, decision 0047),
//! on real `mqstate serve` processes with a raw MQTT 5 client (rumqttc's packet codec over a
//! socket, so the test decides when to acknowledge and sees Session Present and reason codes):
//!
//! * a persistent subscriber (QoS 1 and 2) leaves node 1, messages are published on node 2 (routed
//!   to node 1, which holds the session, and stored on the session's chain), node 1 is killed with `kill -9`, the subscriber reconnects to node 3: Session Present, every
//!   message, the one left in flight again with DUP, its subscriptions in force; with two nodes
//!   down its partition has no head, and a reconnect is refused with 0x88 (retry), never given
//!   a fresh session;
//! * a session moves between live nodes: the old node's copy is fenced and dropped, and moving
//!   back takes the row (with what was queued meanwhile), not the stale copy;
//! * a clean start discards the session everywhere; a clean session is not replicated.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, Connect, ConnectProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode,
    Filter, Packet, PingReq, PubAck, PubAckReason, PubComp, PubRec, PubRecReason, PubRel, Publish,
    Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::cluster::{agreed, eventually, start_founders, Node};
use common::free_addr;

/// Hang guard for one packet, not a performance claim.
const WAIT: Duration = Duration::from_secs(60);
/// How long a reconnect may keep being refused retryably (fail-over included) before the test
/// gives up: generous, the machine is shared.
const RECONNECT_WITHIN: Duration = Duration::from_secs(120);

struct Raw {
    stream: TcpStream,
    buf: BytesMut,
    next_pkid: u16,
}

/// What CONNACK said.
enum Connected {
    Accepted { client: Raw, session_present: bool },
    Refused(ConnectReturnCode),
}

impl Raw {
    async fn connect(addr: SocketAddr, id: &str, clean_start: bool, expiry: u32) -> Connected {
        Raw::connect_with(addr, id, clean_start, expiry, None).await
    }

    /// `receive_max`: how many QoS 1/2 messages the server may have in flight to us.
    async fn connect_with(
        addr: SocketAddr,
        id: &str,
        clean_start: bool,
        expiry: u32,
        receive_max: Option<u16>,
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
        c.send(Packet::Connect(connect, None, None)).await;
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

    async fn send(&mut self, packet: Packet) {
        let mut out = BytesMut::new();
        packet.write(&mut out).expect("encode");
        self.stream.write_all(&out).await.expect("write");
    }

    async fn recv(&mut self) -> Packet {
        tokio::time::timeout(WAIT, async {
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

    fn pkid(&mut self) -> u16 {
        let id = self.next_pkid;
        self.next_pkid = self.next_pkid.wrapping_add(1).max(1);
        id
    }

    async fn subscribe(&mut self, filter: &str, qos: QoS) {
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
    async fn publish(&mut self, topic: &str, qos: QoS, payload: &str) -> u8 {
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
    async fn receive_all(&mut self, want: &BTreeSet<String>) -> Received {
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

    /// The next PUBLISH, not acknowledged (it stays in flight).
    async fn next_publish(&mut self) -> Publish {
        match self.recv().await {
            Packet::Publish(p) => p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    /// Nothing is queued for this client (PINGRESP comes before any PUBLISH).
    async fn nothing_queued(&mut self) -> Vec<String> {
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

    async fn disconnect(mut self) {
        self.send(Packet::Disconnect(Disconnect::new(
            DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(WAIT, self.stream.read_to_end(&mut rest)).await;
    }
}

/// What [`Raw::receive_all`] got: every payload in order, and those that came with DUP.
struct Received {
    received: Vec<String>,
    dups: Vec<String>,
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

/// Connects as a client should: retrying while the server refuses retryably (0x88 while the
/// session's partition is between heads, 0x89), within [`RECONNECT_WITHIN`].
async fn accepted(addr: SocketAddr, id: &str, clean_start: bool, expiry: u32) -> (Raw, bool) {
    let started = Instant::now();
    loop {
        match Raw::connect(addr, id, clean_start, expiry).await {
            Connected::Accepted {
                client,
                session_present,
            } => return (client, session_present),
            Connected::Refused(
                code @ (ConnectReturnCode::ServerUnavailable | ConnectReturnCode::ServerBusy),
            ) => {
                assert!(
                    started.elapsed() < RECONNECT_WITHIN,
                    "{id} still refused ({code:?}) after {RECONNECT_WITHIN:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Connected::Refused(code) => panic!("{id}: CONNECT refused with {code:?}"),
        }
    }
}

/// Three founding nodes that agree on a settled partition map.
fn cluster(root: &std::path::Path) -> Vec<Node> {
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let nodes = start_founders(root, &addrs);
    let refs: Vec<&Node> = nodes.iter().collect();
    let (_, formed_in) = eventually("three nodes agree", || agreed(&refs, &[1, 2, 3]));
    eprintln!("cluster formed in {formed_in:?}");
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_session_survives_kill_9_of_its_node() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| cluster(root.path()));
    let [n1, n2, n3] = [
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    ];

    let (mut sub, present) = accepted(n1, "survivor", false, 3600).await;
    assert!(!present, "a new session");
    sub.subscribe("s/q1", QoS::AtLeastOnce).await;
    sub.subscribe("s/q2", QoS::ExactlyOnce).await;
    sub.disconnect().await;

    // Published on another node than the session's: routed there, acknowledged once stored.
    let (mut publisher, _) = accepted(n2, "publisher-2", true, 0).await;
    let mut want = BTreeSet::new();
    for i in 0..8 {
        let (topic, qos) = if i % 2 == 0 {
            ("s/q1", QoS::AtLeastOnce)
        } else {
            ("s/q2", QoS::ExactlyOnce)
        };
        let payload = format!("m{i}");
        assert_eq!(
            publisher.publish(topic, qos, &payload).await,
            0x00,
            "{payload} acknowledged"
        );
        want.insert(payload);
    }
    // The subscriber comes back to node 1 and leaves the first message in flight (unacknowledged;
    // with a Receive Maximum of 1 the others stay queued).
    let (mut sub, present) = match Raw::connect_with(n1, "survivor", false, 3600, Some(1)).await {
        Connected::Accepted {
            client,
            session_present,
        } => (client, session_present),
        Connected::Refused(code) => panic!("refused with {code:?}"),
    };
    assert!(present);
    let in_flight = sub.next_publish().await;
    let in_flight = String::from_utf8(in_flight.payload.to_vec()).unwrap();
    drop(sub);
    // Queued while it is away again (the disconnect reached node 1 or not: either way).
    for i in 8..10 {
        let payload = format!("m{i}");
        assert_eq!(
            publisher.publish("s/q2", QoS::ExactlyOnce, &payload).await,
            0x00
        );
        want.insert(payload);
    }
    drop(publisher);

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    let killed = Instant::now();
    let (mut sub, present) = accepted(n3, "survivor", false, 3600).await;
    eprintln!(
        "reconnected to node 3 {:?} after kill -9 of node 1",
        killed.elapsed()
    );
    assert!(present, "Session Present = 1 on node 3");
    let Received { received, dups } = sub.receive_all(&want).await;
    eprintln!("received on node 3: {received:?}, with DUP: {dups:?}");
    assert!(
        dups.iter().all(|d| *d == in_flight),
        "only the message left in flight comes again with DUP: {dups:?} (in flight: {in_flight})"
    );
    // Its subscriptions are in force on node 3.
    let (mut publisher, _) = accepted(n3, "publisher-3", true, 0).await;
    assert_eq!(
        publisher.publish("s/q2", QoS::ExactlyOnce, "after").await,
        0x00
    );
    sub.receive_all(&BTreeSet::from(["after".to_owned()])).await;
    drop(publisher);
    sub.disconnect().await;

    // Two nodes down: no quorum, no head for the session's partition. A reconnect is refused
    // with 0x88 (retry), never answered with a fresh session.
    tokio::task::block_in_place(|| nodes[1].server.kill9());
    let started = Instant::now();
    loop {
        match Raw::connect(n3, "survivor", false, 3600).await {
            Connected::Refused(ConnectReturnCode::ServerUnavailable) => break,
            Connected::Accepted {
                client,
                session_present,
            } => {
                assert!(session_present, "never a fresh session for one that exists");
                client.disconnect().await;
            }
            Connected::Refused(code) => panic!("refused with {code:?}, not 0x88"),
        }
        assert!(
            started.elapsed() < RECONNECT_WITHIN,
            "never refused with 0x88"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moves_between_live_nodes_and_a_clean_start_discards_it() {
    let root = tempfile::tempdir().unwrap();
    let nodes = tokio::task::block_in_place(|| cluster(root.path()));
    let [n1, n2, n3] = [
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    ];

    let (mut sub, present) = accepted(n1, "mover", false, 3600).await;
    assert!(!present);
    sub.subscribe("m/t", QoS::AtLeastOnce).await;
    sub.disconnect().await;

    // It moves to node 2: Session Present, the subscription in force there.
    let (mut sub, present) = accepted(n2, "mover", false, 3600).await;
    assert!(present, "the session moved to node 2");
    let (mut publisher2, _) = accepted(n2, "publisher-2", true, 0).await;
    assert_eq!(
        publisher2.publish("m/t", QoS::AtLeastOnce, "on-2").await,
        0x00
    );
    sub.receive_all(&BTreeSet::from(["on-2".to_owned()])).await;
    sub.disconnect().await;

    // Node 1 dropped its copy when node 2 claimed the client id: a publish on node 1 is routed
    // to the session on node 2 and queued there (acknowledged once stored), as is one on node 2.
    let (mut publisher1, _) = accepted(n1, "publisher-1", true, 0).await;
    assert_eq!(
        publisher1.publish("m/t", QoS::AtLeastOnce, "on-1").await,
        0x00,
        "routed to the session's node 2 and stored there"
    );
    assert_eq!(
        publisher2
            .publish("m/t", QoS::AtLeastOnce, "queued-2")
            .await,
        0x00
    );

    // Back to node 1: it takes the row, with what node 2 queued, not an old copy of its own.
    let (mut sub, present) = accepted(n1, "mover", false, 3600).await;
    assert!(present);
    let want = BTreeSet::from(["on-1".to_owned(), "queued-2".to_owned()]);
    let got = sub.receive_all(&want).await;
    assert_eq!(
        got.received,
        ["on-1", "queued-2"],
        "the row's queue, in order, each once"
    );
    assert_eq!(sub.nothing_queued().await, Vec::<String>::new());
    sub.disconnect().await;

    // A clean start on node 3 discards the session everywhere.
    let (sub, present) = accepted(n3, "mover", true, 3600).await;
    assert!(!present, "clean start");
    sub.disconnect().await;
    let (sub, present) = accepted(n2, "mover", false, 3600).await;
    assert!(
        present,
        "the clean-start session (expiry > 0) is the one that exists now"
    );
    sub.disconnect().await;
    let (sub, present) = accepted(n2, "mover", true, 0).await;
    assert!(!present);
    sub.disconnect().await;
    let (mut sub, present) = accepted(n1, "mover", false, 3600).await;
    assert!(
        !present,
        "a clean session is not replicated: nothing to restore"
    );
    assert_eq!(sub.nothing_queued().await, Vec::<String>::new());
    sub.disconnect().await;
}
