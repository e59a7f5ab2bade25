//! Inbound QoS 2 flows of a persistent session across a restart of the real server (graceful and
//! kill -9): the packet ids awaiting PUBREL are kept, so a PUBREL sent after the restart gets
//! PUBCOMP Success (not 0x92), and a PUBLISH re-sent with DUP after the restart is not routed again.
//!
//! The client is raw MQTT 5 (rumqttc's packet encoder over a socket): rumqttc's client would send
//! PUBREL by itself and never re-send a PUBLISH with DUP on demand.

use crate::common;

use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::{Packet, PubCompReason, PubRecReason, PubRel, Publish};
use rumqttc::v5::mqttbytes::QoS;

use common::mqtt::Raw;
use common::Server;

/// Hang guard for every wait in this file, not a performance claim.
const WAIT: Duration = Duration::from_secs(30);
const TOPIC: &str = "qos2/restart";
const SESSION_EXPIRY_SECS: u32 = 3600;

/// Connects with a persistent session; returns the client and CONNACK's Session Present.
async fn connect(addr: std::net::SocketAddr, id: &str, clean_start: bool) -> (Raw, bool) {
    Raw::connect(addr, id, clean_start, SESSION_EXPIRY_SECS)
        .await
        .accepted()
}

/// A QoS 2 PUBLISH with the packet id and DUP flag the test chooses, not waiting for PUBREC.
async fn publish(client: &mut Raw, payload: &'static str, pkid: u16, dup: bool) {
    let mut p = Publish::new(TOPIC, QoS::ExactlyOnce, payload, None);
    p.pkid = pkid;
    p.dup = dup;
    client.send(Packet::Publish(p)).await;
}

async fn expect_pubrec(client: &mut Raw, pkid: u16) {
    match client.recv().await {
        Packet::PubRec(r) => {
            assert_eq!(r.pkid, pkid);
            assert_eq!(r.reason, PubRecReason::Success);
        }
        other => panic!("expected PUBREC {pkid}, got {other:?}"),
    }
}

/// PUBREL, and the reason code of the PUBCOMP it gets.
async fn release(client: &mut Raw, pkid: u16) -> PubCompReason {
    client.send(Packet::PubRel(PubRel::new(pkid, None))).await;
    match client.recv().await {
        Packet::PubComp(c) if c.pkid == pkid => c.reason,
        other => panic!("expected PUBCOMP {pkid}, got {other:?}"),
    }
}

async fn qos2_ids_survive(mut server: Server, restart: impl FnOnce(&mut Server)) {
    let (mut sub, _) = connect(server.addr, "q2-sub", true).await;
    sub.subscribe(TOPIC, QoS::ExactlyOnce).await;
    sub.disconnect().await;

    let (mut publisher, _) = connect(server.addr, "q2-pub", true).await;
    publish(&mut publisher, "released after", 1, false).await;
    expect_pubrec(&mut publisher, 1).await;
    // Its PUBREC arrives too, but the test plays a client that lost it: it re-sends the PUBLISH.
    publish(&mut publisher, "retried after", 2, false).await;
    expect_pubrec(&mut publisher, 2).await;
    drop(publisher);
    tokio::task::block_in_place(|| restart(&mut server));

    let (mut publisher, present) = connect(server.addr, "q2-pub", false).await;
    assert!(present, "Session Present after the restart");
    assert_eq!(
        release(&mut publisher, 1).await,
        PubCompReason::Success,
        "PUBREL after the restart completes the flow"
    );
    publish(&mut publisher, "retried after", 2, true).await;
    expect_pubrec(&mut publisher, 2).await;
    assert_eq!(release(&mut publisher, 2).await, PubCompReason::Success);

    let (mut sub, present) = connect(server.addr, "q2-sub", false).await;
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
                .block_on(async { connect(server.addr, "snapshot-poke", true).await });
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
