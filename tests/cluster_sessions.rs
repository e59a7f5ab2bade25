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
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::ConnectReturnCode;
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::{accepted, three_nodes, FAILOVER_WAIT};
use common::mqtt::{Connected, Raw, Received};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_session_survives_kill_9_of_its_node() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();

    let (mut sub, present) = accepted(n1, "survivor", false, 3600, None).await;
    assert!(!present, "a new session");
    sub.subscribe("s/q1", QoS::AtLeastOnce).await;
    sub.subscribe("s/q2", QoS::ExactlyOnce).await;
    sub.disconnect().await;

    // Published on another node than the session's: routed there, acknowledged once stored.
    let (mut publisher, _) = accepted(n2, "publisher-2", true, 0, None).await;
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
    let (mut sub, present) = accepted(n3, "survivor", false, 3600, None).await;
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
    let (mut publisher, _) = accepted(n3, "publisher-3", true, 0, None).await;
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
        assert!(started.elapsed() < FAILOVER_WAIT, "never refused with 0x88");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moves_between_live_nodes_and_a_clean_start_discards_it() {
    let (_root, _nodes, [n1, n2, n3]) = three_nodes();

    let (mut sub, present) = accepted(n1, "mover", false, 3600, None).await;
    assert!(!present);
    sub.subscribe("m/t", QoS::AtLeastOnce).await;
    sub.disconnect().await;

    // It moves to node 2: Session Present, the subscription in force there.
    let (mut sub, present) = accepted(n2, "mover", false, 3600, None).await;
    assert!(present, "the session moved to node 2");
    let (mut publisher2, _) = accepted(n2, "publisher-2", true, 0, None).await;
    assert_eq!(
        publisher2.publish("m/t", QoS::AtLeastOnce, "on-2").await,
        0x00
    );
    sub.receive_all(&BTreeSet::from(["on-2".to_owned()])).await;
    sub.disconnect().await;

    // Node 1 dropped its copy when node 2 claimed the client id: a publish on node 1 is routed
    // to the session on node 2 and queued there (acknowledged once stored), as is one on node 2.
    let (mut publisher1, _) = accepted(n1, "publisher-1", true, 0, None).await;
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
    let (mut sub, present) = accepted(n1, "mover", false, 3600, None).await;
    assert!(present);
    let want = BTreeSet::from(["on-1".to_owned(), "queued-2".to_owned()]);
    let got = sub.receive_all(&want).await;
    assert_eq!(
        got.received,
        ["on-1", "queued-2"],
        "the row's queue, in order, each once"
    );
    assert_eq!(sub.publishes_until_pong().await, Vec::<String>::new());
    sub.disconnect().await;

    // A clean start on node 3 discards the session everywhere.
    let (sub, present) = accepted(n3, "mover", true, 3600, None).await;
    assert!(!present, "clean start");
    sub.disconnect().await;
    let (sub, present) = accepted(n2, "mover", false, 3600, None).await;
    assert!(
        present,
        "the clean-start session (expiry > 0) is the one that exists now"
    );
    sub.disconnect().await;
    let (sub, present) = accepted(n2, "mover", true, 0, None).await;
    assert!(!present);
    sub.disconnect().await;
    let (mut sub, present) = accepted(n1, "mover", false, 3600, None).await;
    assert!(
        !present,
        "a clean session is not replicated: nothing to restore"
    );
    assert_eq!(sub.publishes_until_pong().await, Vec::<String>::new());
    sub.disconnect().await;
}
