//! Inbound QoS 2 flows of a persistent session across a restart of the real server (graceful and
//! kill -9): the packet ids awaiting PUBREL are kept, so a PUBREL sent after the restart gets
//! PUBCOMP Success (not 0x92), and a PUBLISH re-sent with DUP after the restart is not routed again.
//!
//! The client is raw MQTT 5 (rumqttc's packet encoder over a socket): rumqttc's client would send
//! PUBREL by itself and never re-send a PUBLISH with DUP on demand.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use rumqttc::v5::mqttbytes::v5::{
    Connect, ConnectProperties, Disconnect, DisconnectReasonCode, Filter, Packet, PingReq,
    PubCompReason, PubRecReason, PubRel, Publish, Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::Server;

/// Hang guard for every wait in this file, not a performance claim.
const WAIT: Duration = Duration::from_secs(30);
const TOPIC: &str = "qos2/restart";
const SESSION_EXPIRY_SECS: u32 = 3600;

struct Raw {
    stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    /// Connects with a persistent session; returns the client and CONNACK's Session Present.
    async fn connect(addr: SocketAddr, id: &str, clean_start: bool) -> (Raw, bool) {
        let mut properties = ConnectProperties::new();
        properties.session_expiry_interval = Some(SESSION_EXPIRY_SECS);
        let connect = Connect {
            keep_alive: 60,
            client_id: id.to_owned(),
            clean_start,
            properties: Some(properties),
        };
        let mut c = Raw {
            stream: TcpStream::connect(addr).await.unwrap(),
            buf: BytesMut::new(),
        };
        c.send(Packet::Connect(connect, None, None)).await;
        match c.recv().await {
            Packet::ConnAck(ack) => (c, ack.session_present),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    async fn send(&mut self, packet: Packet) {
        let mut out = BytesMut::new();
        packet.write(&mut out).unwrap();
        self.stream.write_all(&out).await.unwrap();
    }

    async fn recv(&mut self) -> Incoming {
        tokio::time::timeout(WAIT, async {
            loop {
                match Packet::read(&mut self.buf, None) {
                    Ok(p) => return p,
                    Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => {}
                    Err(e) => panic!("undecodable packet from the server: {e}"),
                }
                let n = self.stream.read_buf(&mut self.buf).await.unwrap();
                assert!(n > 0, "the server closed the connection");
            }
        })
        .await
        .expect("no packet within the guard time")
    }

    async fn publish(&mut self, payload: &'static str, pkid: u16, dup: bool) {
        let mut p = Publish::new(TOPIC, QoS::ExactlyOnce, payload, None);
        p.pkid = pkid;
        p.dup = dup;
        self.send(Packet::Publish(p)).await;
    }

    async fn expect_pubrec(&mut self, pkid: u16) {
        match self.recv().await {
            Packet::PubRec(r) => {
                assert_eq!(r.pkid, pkid);
                assert_eq!(r.reason, PubRecReason::Success);
            }
            other => panic!("expected PUBREC {pkid}, got {other:?}"),
        }
    }

    /// PUBREL, and the reason code of the PUBCOMP it gets.
    async fn release(&mut self, pkid: u16) -> PubCompReason {
        self.send(Packet::PubRel(PubRel::new(pkid, None))).await;
        match self.recv().await {
            Packet::PubComp(c) if c.pkid == pkid => c.reason,
            other => panic!("expected PUBCOMP {pkid}, got {other:?}"),
        }
    }

    /// Payloads of the PUBLISHes received before the PINGRESP.
    async fn publishes_until_pong(&mut self) -> Vec<String> {
        self.send(Packet::PingReq(PingReq)).await;
        let mut got = Vec::new();
        loop {
            match self.recv().await {
                Packet::PingResp(_) => return got,
                Packet::Publish(p) => got.push(String::from_utf8(p.payload.to_vec()).unwrap()),
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

async fn qos2_ids_survive(mut server: Server, restart: impl FnOnce(&mut Server)) {
    let (mut sub, _) = Raw::connect(server.addr, "q2-sub", true).await;
    let mut subscribe = Subscribe::new(Filter::new(TOPIC, QoS::ExactlyOnce), None);
    subscribe.pkid = 1;
    sub.send(Packet::Subscribe(subscribe)).await;
    match sub.recv().await {
        Packet::SubAck(ack) => assert_eq!(
            ack.return_codes,
            vec![SubscribeReasonCode::Success(QoS::ExactlyOnce)]
        ),
        other => panic!("expected SUBACK, got {other:?}"),
    }
    sub.disconnect().await;

    let (mut publisher, _) = Raw::connect(server.addr, "q2-pub", true).await;
    publisher.publish("released after", 1, false).await;
    publisher.expect_pubrec(1).await;
    // Its PUBREC arrives too, but the test plays a client that lost it: it re-sends the PUBLISH.
    publisher.publish("retried after", 2, false).await;
    publisher.expect_pubrec(2).await;
    drop(publisher);
    tokio::task::block_in_place(|| restart(&mut server));

    let (mut publisher, present) = Raw::connect(server.addr, "q2-pub", false).await;
    assert!(present, "Session Present after the restart");
    assert_eq!(
        publisher.release(1).await,
        PubCompReason::Success,
        "PUBREL after the restart completes the flow"
    );
    publisher.publish("retried after", 2, true).await;
    publisher.expect_pubrec(2).await;
    assert_eq!(publisher.release(2).await, PubCompReason::Success);

    let (mut sub, present) = Raw::connect(server.addr, "q2-sub", false).await;
    assert!(present);
    assert_eq!(
        sub.publishes_until_pong().await,
        vec!["released after", "retried after"],
        "each message exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_qos2_ids_survive_a_graceful_restart() {
    qos2_ids_survive(Server::start(), |server| {
        assert!(server.stop().success(), "graceful stop");
        server.restart();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_qos2_ids_survive_kill9() {
    qos2_ids_survive(Server::start(), |server| {
        server.kill9();
        server.restart();
    })
    .await;
}

/// With a 1-byte threshold the session log starts a snapshot after a record whenever none is
/// running: records are made (a persistent session connects) until `data inspect` shows both ids
/// in the snapshot, then kill -9, and the restart reads them from the snapshot image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_qos2_ids_survive_kill9_in_a_snapshot() {
    let server = Server::start_with(&["--snapshot-threshold-bytes", "1"]);
    qos2_ids_survive(server, |server| {
        let deadline = std::time::Instant::now() + WAIT;
        while snapshot_qos2_ids(server.data_dir()) != Some(2) {
            assert!(
                std::time::Instant::now() < deadline,
                "no session snapshot with both ids"
            );
            tokio::runtime::Handle::current()
                .block_on(async { Raw::connect(server.addr, "snapshot-poke", true).await });
            std::thread::sleep(Duration::from_millis(50));
        }
        server.kill9();
        server.restart();
    })
    .await;
}

/// The inbound QoS 2 ids the session snapshot holds, as `mqstate data inspect --json` counts them.
fn snapshot_qos2_ids(dir: &std::path::Path) -> Option<u64> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["data", "inspect", "--json"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "inspect: {out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["sessions"]["snapshot"]["inbound_qos2_packet_ids"].as_u64()
}
