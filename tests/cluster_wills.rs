//! One broker across nodes when a node dies (issue 16, decision 0060), on three real
//! `mqstate serve` processes with a raw MQTT 5 client:
//!
//! * the will of a **clean** session (session expiry 0) whose node is killed with `kill -9` is
//!   published, once, by the node that settles the dead node's rows — as one node publishes it
//!   when the connection ends; a client that disconnected normally has no will published;
//! * a retained message cleared while a node was down does not come back when that node rejoins
//!   after every node that saw the clear restarted (the clear is durable).
//!
//! (Before: the clean session's will died with its node — no row held it; and a restarted node
//! forgot the clears it had seen, so the rejoining node's stale copy came back everywhere.)

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, LastWill, LastWillProperties, Packet, PubAck};
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::formed_cluster;
use common::mqtt::{Connected, Raw};

/// Hang guard of every wait (fail-over, settling a dead node's rows): generous, the machine is
/// shared.
const WAIT: Duration = Duration::from_secs(120);

/// Connects, retrying while the server refuses retryably (0x88 while the session's partition is
/// between heads, 0x89), within [`WAIT`].
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

/// The topic of the next message `watcher` gets (acknowledged).
async fn next_topic(watcher: &mut Raw) -> String {
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
async fn the_will_of_a_clean_session_on_a_dead_node_is_published_once() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let [n1, n2, n3] = [
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    ];

    let (mut watcher, _) = accepted(n2, "will-watcher", true, 0, None).await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;

    // A clean client that leaves normally: its will is deleted with it (on one node too).
    let (quiet, _) = accepted(n1, "clean-quiet", true, 0, will_of("clean-quiet", 0)).await;
    quiet.disconnect().await;
    // Clean sessions connected to node 1 when it dies; a clean session ends with its connection,
    // so a will delay does not hold its will back (as on one node).
    let (at_once, present) = accepted(n1, "clean-now", true, 0, will_of("clean-now", 0)).await;
    assert!(!present);
    let (delayed, _) = accepted(n1, "clean-delay", true, 0, will_of("clean-delay", 3600)).await;
    // MQTT 5 Clean Start 0 with expiry 0: a clean session too.
    let (resumed, _) = accepted(n1, "clean-resume", false, 0, will_of("clean-resume", 0)).await;
    // Without a will: nothing kept, nothing published.
    let (plain, _) = accepted(n1, "clean-plain", true, 0, None).await;

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop((at_once, delayed, resumed, plain));
    let killed = Instant::now();

    let everyone: BTreeSet<String> = ["clean-now", "clean-delay", "clean-resume"]
        .iter()
        .map(|id| format!("will/{id}"))
        .collect();
    let mut wills = BTreeSet::new();
    while wills != everyone {
        assert!(
            killed.elapsed() < WAIT,
            "wills after {WAIT:?}: {wills:?}, not {everyone:?}"
        );
        let will = next_topic(&mut watcher).await;
        eprintln!("{will} {:?} after kill -9 of node 1", killed.elapsed());
        assert!(
            everyone.contains(&will),
            "{will}: not the will of a client connected when node 1 died"
        );
        assert!(wills.insert(will.clone()), "{will} published twice");
    }

    // The rows are settled: a client id of node 1 reconnecting elsewhere has no session and
    // no will of the old connection comes again; a marker published after that comes next.
    let (again, present) = accepted(n3, "clean-resume", false, 0, None).await;
    assert!(!present, "a clean session ended with its node");
    again.disconnect().await;
    let (mut publisher, _) = accepted(n3, "will-marker", true, 0, None).await;
    assert_eq!(
        publisher
            .publish("will/zz-marker", QoS::AtLeastOnce, "m")
            .await,
        0x00
    );
    assert_eq!(
        next_topic(&mut watcher).await,
        "will/zz-marker",
        "no will published twice or for a client that left normally"
    );
    drop((publisher, watcher));
}
