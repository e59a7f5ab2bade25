//! Sessions whose node died are adopted (issue 16, decision 0054 "Orphaned sessions"), on three
//! real `mqstate serve` processes with a raw MQTT 5 client (Session Present and reason codes
//! packet by packet). Node 1 is killed with `kill -9` while four persistent sessions are
//! connected to it:
//!
//! * the wills of its clients — one without a delay, one with — reach a subscriber on node 2
//!   (the head of each session's partition adopts it once node 1's lease lapsed, and publishes the
//!   will that the row kept since CONNECT);
//! * a session with a short expiry expires on its adopter: a reconnect finds no session
//!   (Session Present = 0);
//! * a session with a long expiry, once adopted, has what is published for it meanwhile queued
//!   (each QoS 1 publish acknowledged 0x00), and its client reconnecting to node 3 gets it with
//!   Session Present = 1.
//!
//! (Without adoption, no will comes, the short session is resumed with Session Present = 1, and
//! what was published after node 1's death matched nothing and is not delivered.)

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, LastWill, LastWillProperties, Packet, PubAck};
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::formed_cluster;
use common::mqtt::{Connected, Raw};

/// Hang guard of every wait (fail-over, adoption, expiry): generous, the machine is shared.
const WAIT: Duration = Duration::from_secs(120);

/// Connects as a client should: retrying while the server refuses retryably (0x88 while the
/// session's partition is between heads, 0x89), within [`WAIT`].
async fn accepted(
    addr: SocketAddr,
    id: &str,
    clean_start: bool,
    expiry: u32,
    will: Option<LastWill>,
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
                    started.elapsed() < WAIT,
                    "{id} still refused ({code:?}) after {WAIT:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Connected::Refused(code) => panic!("{id}: CONNECT refused with {code:?}"),
        }
    }
}

/// The will of `id`: on `will/<id>`, QoS 1, after `delay` seconds.
fn will_of(id: &str, delay: u32) -> Option<LastWill> {
    let properties = LastWillProperties {
        delay_interval: Some(delay),
        payload_format_indicator: None,
        message_expiry_interval: None,
        content_type: None,
        response_topic: None,
        correlation_data: None,
        user_properties: Vec::new(),
    };
    Some(LastWill::new(
        format!("will/{id}"),
        Bytes::from_static(b"gone"),
        QoS::AtLeastOnce,
        false,
        Some(properties),
    ))
}

/// Waits for the next will published to `watcher` (acknowledged); its topic.
async fn next_will(watcher: &mut Raw) -> String {
    loop {
        match watcher.recv().await {
            Packet::Publish(p) => {
                if p.qos == QoS::AtLeastOnce {
                    watcher
                        .send(Packet::PubAck(PubAck::new(p.pkid, None)))
                        .await;
                }
                return String::from_utf8_lossy(&p.topic).into_owned();
            }
            Packet::PingResp(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_of_a_dead_node_are_adopted_with_wills_expiry_and_queues() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let [n1, n2, n3] = [
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    ];

    let (mut watcher, _) = accepted(n2, "will-watcher", true, 0, None).await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;

    // Four persistent sessions connected to node 1 when it dies.
    let (at_once, _) = accepted(n1, "will-now", false, 3600, will_of("will-now", 0)).await;
    let (delayed, _) = accepted(n1, "will-later", false, 3600, will_of("will-later", 2)).await;
    // Its will (delay 1 s) tells when it was adopted.
    let (mut long, present) =
        accepted(n1, "orphan-long", false, 3600, will_of("orphan-long", 1)).await;
    assert!(!present);
    long.subscribe("o/long", QoS::AtLeastOnce).await;
    // Expires 5 s after its adoption; its will (delay above the expiry) goes with it.
    let (short, _) = accepted(n1, "orphan-short", false, 5, will_of("orphan-short", 3600)).await;

    let (mut publisher, _) = accepted(n2, "orphan-publisher", true, 0, None).await;
    assert_eq!(
        publisher
            .publish("o/long", QoS::AtLeastOnce, "before")
            .await,
        0x00,
        "routed to the session on node 1 and stored in its row"
    );

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop((at_once, delayed, long, short));
    let killed = Instant::now();

    let mut wills = BTreeSet::new();
    let mut want = BTreeSet::from(["before".to_owned()]);
    let everyone: BTreeSet<String> = ["will-now", "will-later", "orphan-long", "orphan-short"]
        .iter()
        .map(|id| format!("will/{id}"))
        .collect();
    while wills != everyone {
        assert!(
            killed.elapsed() < WAIT,
            "wills after {WAIT:?}: {wills:?}, not {everyone:?}"
        );
        let will = next_will(&mut watcher).await;
        eprintln!("{will} {:?} after kill -9 of node 1", killed.elapsed());
        if will == "will/orphan-long" {
            // Adopted: what is published for it from now on is queued for it.
            for i in 0..3 {
                let payload = format!("after-adoption-{i}");
                assert_eq!(
                    publisher
                        .publish("o/long", QoS::AtLeastOnce, &payload)
                        .await,
                    0x00
                );
                want.insert(payload);
            }
        }
        wills.insert(will);
    }

    // The short session expired on its adopter.
    let (short, present) = accepted(n3, "orphan-short", false, 5, None).await;
    assert!(!present, "the short session expired: Session Present = 0");
    short.disconnect().await;

    // The long one comes back on node 3 with everything queued for it.
    let (mut long, present) = accepted(n3, "orphan-long", false, 3600, None).await;
    assert!(present, "Session Present = 1 after adoption");
    let received = long.receive_all(&want).await;
    eprintln!("received on node 3: {:?}", received.received);
    long.disconnect().await;
    drop((publisher, watcher));
}
