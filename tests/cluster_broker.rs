//! One broker across three real `mqstate serve` processes (decision 0044): a publisher on node 1
//! reaches subscribers on nodes 2 and 3 at QoS 0/1/2 and in order; a retained message published
//! on node 3 reaches a later subscriber on node 2; a shared group with members on nodes 2 and 3
//! gets each message once; the will of a client on node 1 reaches node 3; No Local holds for the
//! copies forwarded to other nodes; a client id connecting on node 2 takes over its connection
//! on node 1 (DISCONNECT 0x8E); a publish matched only on another node is not answered 0x10.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::cluster::{start_founders, Node};
use common::free_addr;
use common::mqtt::{payload, topic, Client, Options, Seen};
use rumqttc::v5::mqttbytes::v5::{DisconnectReasonCode, Filter, LastWill};
use rumqttc::v5::mqttbytes::QoS;

/// Generous: the machine running the tests may be loaded.
const WAIT: Duration = Duration::from_secs(90);

/// The three founding nodes on fresh addresses, and the addresses of their MQTT listeners.
fn founders(root: &std::path::Path) -> (Vec<Node>, Vec<SocketAddr>) {
    let cluster: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let nodes = start_founders(root, &cluster);
    let addrs = nodes.iter().map(|n| n.server.addr).collect();
    (nodes, addrs)
}

async fn connect(addr: SocketAddr, id: &str) -> Client {
    connect_with(addr, id, None).await
}

async fn connect_with(addr: SocketAddr, id: &str, will: Option<LastWill>) -> Client {
    let options = Options {
        will,
        wait: WAIT,
        ..Options::default()
    };
    Client::connect_with(addr, id, options).await
}

/// Waits until a publish on every node reaches a subscriber on every other node: the nodes found
/// each other (a cluster forms in the background after the listeners open).
async fn until_meshed(addrs: &[SocketAddr]) {
    let mut subs = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let mut c = connect(*addr, &format!("probe-sub-{i}")).await;
        c.subscribe_filter(Filter::new("probe/#", QoS::AtMostOnce))
            .await;
        subs.push(c);
    }
    let mut pubs = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        pubs.push(connect(*addr, &format!("probe-pub-{i}")).await);
    }
    let started = Instant::now();
    let mut heard: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); addrs.len()];
    while heard.iter().any(|h| h.len() < addrs.len()) {
        assert!(started.elapsed() < WAIT, "nodes not meshed: {heard:?}");
        for (i, p) in pubs.iter_mut().enumerate() {
            p.publish_acked(&format!("probe/{i}"), QoS::AtMostOnce, false, "")
                .await;
        }
        for (j, s) in subs.iter_mut().enumerate() {
            let until = tokio::time::Instant::now() + Duration::from_millis(200);
            while let Some(seen) = s.next_before(until).await {
                if let Seen::Publish(p) = seen {
                    if let Some(from) = topic(&p).strip_prefix("probe/") {
                        heard[j].extend(from.parse::<usize>().ok());
                    }
                }
            }
        }
    }
    println!("meshed after {:?}", started.elapsed());
}

#[test]
fn one_broker_across_three_nodes() {
    let root = tempfile::tempdir().expect("temp dir");
    let (nodes, addrs) = founders(root.path());
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        until_meshed(&addrs).await;
        qos_and_order(&addrs).await;
        retained_from_another_node(&addrs).await;
        shared_group_over_two_nodes(&addrs).await;
        will_reaches_another_node(&addrs).await;
        no_local_across_nodes(&addrs).await;
        takeover_across_nodes(&addrs).await;
    });
    drop(nodes);
}

/// Publisher on node 1, subscribers on nodes 2 and 3: every QoS, the subscriber's QoS the lower
/// one, and 20 QoS 1 messages in the order published.
async fn qos_and_order(addrs: &[SocketAddr]) {
    let mut subs = Vec::new();
    for (i, addr) in addrs[1..].iter().enumerate() {
        let mut c = connect(*addr, &format!("q-sub-{i}")).await;
        c.subscribe_filter(Filter::new("q/#", QoS::ExactlyOnce))
            .await;
        subs.push(c);
    }
    let mut publisher = connect(addrs[0], "q-pub").await;
    publisher
        .publish_acked("q/0", QoS::AtMostOnce, false, "zero")
        .await;
    publisher
        .publish_acked("q/1", QoS::AtLeastOnce, false, "one")
        .await;
    publisher
        .publish_acked("q/2", QoS::ExactlyOnce, false, "two")
        .await;
    for i in 0..20 {
        publisher
            .publish_acked("q/order", QoS::AtLeastOnce, false, &i.to_string())
            .await;
    }
    for sub in &mut subs {
        let mut got = BTreeMap::new();
        for _ in 0..3 {
            let p = sub.publish_msg("q/0..2").await;
            got.insert(topic(&p), (payload(&p), p.qos));
        }
        assert_eq!(got["q/0"], ("zero".into(), QoS::AtMostOnce));
        assert_eq!(got["q/1"], ("one".into(), QoS::AtLeastOnce));
        assert_eq!(got["q/2"], ("two".into(), QoS::ExactlyOnce));
        for i in 0..20 {
            let p = sub.publish_msg("q/order").await;
            assert_eq!(payload(&p), i.to_string(), "in the order published");
        }
    }
}

/// A retained message published (and acknowledged) on node 3 before anyone subscribes reaches a
/// subscriber on node 2; its clear on node 1 clears it on node 2 too.
async fn retained_from_another_node(addrs: &[SocketAddr]) {
    let mut publisher = connect(addrs[2], "r-pub").await;
    publisher
        .publish_acked("r/x", QoS::AtLeastOnce, true, "kept")
        .await;
    let mut sub = connect(addrs[1], "r-sub").await;
    sub.subscribe_filter(Filter::new("r/#", QoS::AtLeastOnce))
        .await;
    let p = sub.publish_msg("the retained message").await;
    assert_eq!(
        (topic(&p), payload(&p), p.retain),
        ("r/x".into(), "kept".into(), true)
    );
    drop(sub);

    let mut clearer = connect(addrs[0], "r-clear").await;
    clearer
        .publish_acked("r/x", QoS::AtLeastOnce, true, "")
        .await;
    clearer
        .publish_acked("r/y", QoS::AtLeastOnce, true, "other")
        .await;
    let mut sub = connect(addrs[1], "r-sub-2").await;
    sub.subscribe_filter(Filter::new("r/#", QoS::AtLeastOnce))
        .await;
    let p = sub.publish_msg("the retained messages left").await;
    assert_eq!(
        (topic(&p), payload(&p)),
        ("r/y".into(), "other".into()),
        "r/x was cleared on every node"
    );
}

/// Members of one shared group on nodes 2 and 3: 20 messages from node 1 reach the group once
/// each, and both nodes serve it.
async fn shared_group_over_two_nodes(addrs: &[SocketAddr]) {
    let mut members = Vec::new();
    for (i, addr) in addrs[1..].iter().enumerate() {
        let mut c = connect(*addr, &format!("s-member-{i}")).await;
        c.subscribe_filter(Filter::new("$share/g/s/#", QoS::AtLeastOnce))
            .await;
        // Not shared: the end marker reaches both, after everything published before it.
        c.subscribe_filter(Filter::new("s-end", QoS::AtLeastOnce))
            .await;
        members.push(c);
    }
    let mut publisher = connect(addrs[0], "s-pub").await;
    for i in 0..20 {
        publisher
            .publish_acked(&format!("s/{i}"), QoS::AtLeastOnce, false, &i.to_string())
            .await;
    }
    publisher
        .publish_acked("s-end", QoS::AtLeastOnce, false, "")
        .await;
    let mut all = Vec::new();
    for m in &mut members {
        let mut mine = Vec::new();
        loop {
            let p = m.publish_msg("shared messages, then the end marker").await;
            if topic(&p) == "s-end" {
                break;
            }
            mine.push(payload(&p));
        }
        assert!(!mine.is_empty(), "both nodes' members served the group");
        all.extend(mine);
    }
    all.sort_by_key(|p| p.parse::<u32>().unwrap_or(u32::MAX));
    let expected: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    assert_eq!(all, expected, "each message once across the cluster");
}

/// The will of a client on node 1 whose connection drops reaches a subscriber on node 3.
async fn will_reaches_another_node(addrs: &[SocketAddr]) {
    let mut sub = connect(addrs[2], "w-sub").await;
    sub.subscribe_filter(Filter::new("w/#", QoS::AtLeastOnce))
        .await;
    let will = LastWill::new("w/gone", "bye", QoS::AtLeastOnce, false, None);
    let dying = connect_with(addrs[0], "w-client", Some(will)).await;
    // Dropped without DISCONNECT: the socket closes, the will goes.
    dying.abort();
    let p = sub.publish_msg("the will").await;
    assert_eq!((topic(&p), payload(&p)), ("w/gone".into(), "bye".into()));
}

/// No Local with the copies of a publish on other nodes: a client on node 2 with a No Local
/// subscription publishes; a subscriber on node 3 gets it (forwarded), the publisher does not,
/// and the next message it gets is one another client published on node 1. (A client id is one
/// session cluster-wide: the same client cannot also be connected elsewhere, so nothing else of
/// No Local crosses nodes.)
async fn no_local_across_nodes(addrs: &[SocketAddr]) {
    let mut me = connect(addrs[1], "nl-me").await;
    let mut filter = Filter::new("nl/#", QoS::AtLeastOnce);
    filter.nolocal = true;
    me.subscribe_filter(filter).await;
    let mut witness = connect(addrs[2], "nl-witness").await;
    witness
        .subscribe_filter(Filter::new("nl/#", QoS::AtLeastOnce))
        .await;

    me.publish_acked("nl/mine", QoS::AtLeastOnce, false, "x")
        .await;
    let p = witness.publish_msg("nl/mine on node 3").await;
    assert_eq!(topic(&p), "nl/mine");

    let mut other = connect(addrs[0], "nl-other").await;
    other
        .publish_acked("nl/end", QoS::AtLeastOnce, false, "")
        .await;
    let p = me.publish_msg("the next message on node 2").await;
    assert_eq!(
        topic(&p),
        "nl/end",
        "its own nl/mine was not delivered to it (No Local)"
    );
}

/// A client id connected on node 1 connects on node 2: node 1's connection gets DISCONNECT 0x8E.
async fn takeover_across_nodes(addrs: &[SocketAddr]) {
    let mut first = connect(addrs[0], "tk").await;
    let _second = connect(addrs[1], "tk").await;
    let code = first
        .next("DISCONNECT on node 1", |s| match s {
            Seen::Disconnect(code) => Some(*code),
            _ => None,
        })
        .await;
    assert_eq!(code, DisconnectReasonCode::SessionTakenOver);
}

/// Node 3 is killed with SIGKILL: publishes on node 1 go on (node 3 skipped); a retained message
/// published meanwhile reaches a subscriber on node 3 once it is back (the resync's retained set),
/// and node 3, restarted with empty route tables, learns the routes of node 1's subscriber that
/// never resubscribed.
#[test]
fn a_node_back_from_kill_9_gets_routes_and_retained_messages_again() {
    let root = tempfile::tempdir().expect("temp dir");
    let (mut nodes, addrs) = founders(root.path());
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut listener = runtime.block_on(async {
        until_meshed(&addrs).await;
        let mut listener = connect(addrs[0], "back-sub").await;
        listener
            .subscribe_filter(Filter::new("back/#", QoS::AtLeastOnce))
            .await;
        listener
    });
    nodes[2].server.kill9();
    runtime.block_on(async {
        let mut publisher = connect(addrs[0], "kept-pub").await;
        publisher
            .publish_acked("kept/x", QoS::AtLeastOnce, true, "while away")
            .await;
    });
    nodes[2].server.restart();
    runtime.block_on(async {
        let started = Instant::now();
        // Retained: a new subscriber on node 3 until the resync brought it.
        let mut attempt = 0;
        loop {
            assert!(
                started.elapsed() < WAIT,
                "node 3 never got the retained message"
            );
            attempt += 1;
            let mut sub = connect(addrs[2], &format!("kept-sub-{attempt}")).await;
            sub.subscribe_filter(Filter::new("kept/#", QoS::AtLeastOnce))
                .await;
            let until = tokio::time::Instant::now() + Duration::from_millis(500);
            let got = tokio::time::timeout_at(until, sub.publish_msg("retained")).await;
            if let Ok(p) = got {
                assert_eq!(
                    (topic(&p), payload(&p)),
                    ("kept/x".into(), "while away".into())
                );
                break;
            }
        }
        // Routes: node 1's subscriber, subscribed before node 3 restarted.
        let mut publisher = connect(addrs[2], "back-pub").await;
        loop {
            assert!(
                started.elapsed() < WAIT,
                "node 3 never learned node 1's routes"
            );
            publisher
                .publish_acked("back/3", QoS::AtMostOnce, false, "")
                .await;
            let until = tokio::time::Instant::now() + Duration::from_millis(300);
            if let Ok(p) = tokio::time::timeout_at(until, listener.publish_msg("back/3")).await {
                assert_eq!(topic(&p), "back/3");
                break;
            }
        }
        println!("node 3 back in the mesh after {:?}", started.elapsed());
    });
    drop(nodes);
}
