//! One broker across three real `mqstate serve` processes (decision 0044): a publisher on node 1
//! reaches subscribers on nodes 2 and 3 at QoS 0/1/2 and in order; a retained message published
//! on node 3 reaches a later subscriber on node 2; a shared group with members on nodes 2 and 3
//! gets each message once; the will of a client on node 1 reaches node 3; No Local holds for the
//! copies forwarded to other nodes; a client id connecting on node 2 takes over its connection
//! on node 1 (DISCONNECT 0x8E); a publish matched only on another node is not answered 0x10.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{free_addr, Server};
use rumqttc::v5::mqttbytes::v5::{
    ConnectProperties, DisconnectReasonCode, Filter, LastWill, Packet, PubAckReason, Publish,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, MqttOptions, StateError};
use tokio::sync::mpsc;

/// Generous: the machine running the tests may be loaded.
const WAIT: Duration = Duration::from_secs(90);

fn start_founders(root: &Path) -> Vec<Server> {
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    (1..=3u64)
        .map(|id| {
            let listen = addrs[id as usize - 1].to_string();
            let args = [
                "--node-id",
                &id.to_string(),
                "--cluster-listen",
                &listen,
                "--peers",
                &peers,
            ];
            Server::start_in(&root.join(format!("n{id}")), &args, &[])
        })
        .collect()
}

/// What a client saw, in order.
#[derive(Debug)]
enum Seen {
    Publish(Box<Publish>),
    PubAck(PubAckReason),
    PubRec,
    SubAck,
    Disconnect(DisconnectReasonCode),
    Closed,
}

struct Client {
    client: AsyncClient,
    seen: mpsc::UnboundedReceiver<Seen>,
    task: tokio::task::JoinHandle<()>,
}

struct Options {
    persistent: bool,
    will: Option<LastWill>,
}

impl Client {
    async fn connect(addr: SocketAddr, id: &str) -> Client {
        Client::connect_with(
            addr,
            id,
            Options {
                persistent: false,
                will: None,
            },
        )
        .await
    }

    async fn connect_with(addr: SocketAddr, id: &str, opts: Options) -> Client {
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
        let connected = tokio::time::timeout(WAIT, connected.recv())
            .await
            .expect("CONNACK in time")
            .expect("the event loop reports CONNACK or its error");
        if let Err(error) = connected {
            panic!("{id}: the connection ended before CONNACK: {error}");
        }
        Client { client, seen, task }
    }

    /// The next thing seen that `pick` takes, skipping the others.
    async fn next<T>(&mut self, what: &str, mut pick: impl FnMut(Seen) -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen = tokio::time::timeout_at(deadline, self.seen.recv())
                .await
                .unwrap_or_else(|_| panic!("not within {WAIT:?}: {what}"))
                .unwrap_or_else(|| panic!("connection gone while waiting for {what}"));
            if let Some(value) = pick(seen) {
                return value;
            }
        }
    }

    async fn publish_msg(&mut self, what: &str) -> Publish {
        self.next(what, |s| match s {
            Seen::Publish(p) => Some(*p),
            _ => None,
        })
        .await
    }

    async fn subscribe(&mut self, filter: Filter) {
        self.client
            .subscribe_many([filter])
            .await
            .expect("queue SUBSCRIBE");
        self.next("SUBACK", |s| matches!(s, Seen::SubAck).then_some(()))
            .await;
    }

    async fn publish(&mut self, topic: &str, qos: QoS, retain: bool, payload: &str) {
        self.client
            .publish(topic, qos, retain, payload.as_bytes().to_vec())
            .await
            .expect("queue PUBLISH");
        match qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                let reason = self
                    .next("PUBACK", |s| match s {
                        Seen::PubAck(r) => Some(r),
                        _ => None,
                    })
                    .await;
                assert_eq!(reason, PubAckReason::Success, "PUBACK of {topic}");
            }
            QoS::ExactlyOnce => {
                self.next("PUBREC", |s| matches!(s, Seen::PubRec).then_some(()))
                    .await
            }
        }
    }
}

fn topic(p: &Publish) -> String {
    String::from_utf8_lossy(&p.topic).into_owned()
}

fn payload(p: &Publish) -> String {
    String::from_utf8_lossy(&p.payload).into_owned()
}

/// Waits until a publish on every node reaches a subscriber on every other node: the nodes found
/// each other (a cluster forms in the background after the listeners open).
async fn until_meshed(addrs: &[SocketAddr]) {
    let mut subs = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let mut c = Client::connect(*addr, &format!("probe-sub-{i}")).await;
        c.subscribe(Filter::new("probe/#", QoS::AtMostOnce)).await;
        subs.push(c);
    }
    let mut pubs = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        pubs.push(Client::connect(*addr, &format!("probe-pub-{i}")).await);
    }
    let started = Instant::now();
    let mut heard: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); addrs.len()];
    while heard.iter().any(|h| h.len() < addrs.len()) {
        assert!(started.elapsed() < WAIT, "nodes not meshed: {heard:?}");
        for (i, p) in pubs.iter_mut().enumerate() {
            p.publish(&format!("probe/{i}"), QoS::AtMostOnce, false, "")
                .await;
        }
        for (j, s) in subs.iter_mut().enumerate() {
            let until = tokio::time::Instant::now() + Duration::from_millis(200);
            while let Ok(Some(seen)) = tokio::time::timeout_at(until, s.seen.recv()).await {
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
    let nodes = start_founders(root.path());
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
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
        let mut c = Client::connect(*addr, &format!("q-sub-{i}")).await;
        c.subscribe(Filter::new("q/#", QoS::ExactlyOnce)).await;
        subs.push(c);
    }
    let mut publisher = Client::connect(addrs[0], "q-pub").await;
    publisher
        .publish("q/0", QoS::AtMostOnce, false, "zero")
        .await;
    publisher
        .publish("q/1", QoS::AtLeastOnce, false, "one")
        .await;
    publisher
        .publish("q/2", QoS::ExactlyOnce, false, "two")
        .await;
    for i in 0..20 {
        publisher
            .publish("q/order", QoS::AtLeastOnce, false, &i.to_string())
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
    let mut publisher = Client::connect(addrs[2], "r-pub").await;
    publisher
        .publish("r/x", QoS::AtLeastOnce, true, "kept")
        .await;
    let mut sub = Client::connect(addrs[1], "r-sub").await;
    sub.subscribe(Filter::new("r/#", QoS::AtLeastOnce)).await;
    let p = sub.publish_msg("the retained message").await;
    assert_eq!(
        (topic(&p), payload(&p), p.retain),
        ("r/x".into(), "kept".into(), true)
    );
    drop(sub);

    let mut clearer = Client::connect(addrs[0], "r-clear").await;
    clearer.publish("r/x", QoS::AtLeastOnce, true, "").await;
    clearer
        .publish("r/y", QoS::AtLeastOnce, true, "other")
        .await;
    let mut sub = Client::connect(addrs[1], "r-sub-2").await;
    sub.subscribe(Filter::new("r/#", QoS::AtLeastOnce)).await;
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
        let mut c = Client::connect(*addr, &format!("s-member-{i}")).await;
        c.subscribe(Filter::new("$share/g/s/#", QoS::AtLeastOnce))
            .await;
        // Not shared: the end marker reaches both, after everything published before it.
        c.subscribe(Filter::new("s-end", QoS::AtLeastOnce)).await;
        members.push(c);
    }
    let mut publisher = Client::connect(addrs[0], "s-pub").await;
    for i in 0..20 {
        publisher
            .publish(&format!("s/{i}"), QoS::AtLeastOnce, false, &i.to_string())
            .await;
    }
    publisher
        .publish("s-end", QoS::AtLeastOnce, false, "")
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
    let mut sub = Client::connect(addrs[2], "w-sub").await;
    sub.subscribe(Filter::new("w/#", QoS::AtLeastOnce)).await;
    let will = LastWill::new("w/gone", "bye", QoS::AtLeastOnce, false, None);
    let dying = Client::connect_with(
        addrs[0],
        "w-client",
        Options {
            persistent: false,
            will: Some(will),
        },
    )
    .await;
    // Dropped without DISCONNECT: the socket closes, the will goes.
    dying.task.abort();
    drop(dying);
    let p = sub.publish_msg("the will").await;
    assert_eq!((topic(&p), payload(&p)), ("w/gone".into(), "bye".into()));
}

/// No Local with the copies of a publish on other nodes: a client on node 2 with a No Local
/// subscription publishes; a subscriber on node 3 gets it (forwarded), the publisher does not,
/// and the next message it gets is one another client published on node 1. (A client id is one
/// session cluster-wide: the same client cannot also be connected elsewhere, so nothing else of
/// No Local crosses nodes.)
async fn no_local_across_nodes(addrs: &[SocketAddr]) {
    let mut me = Client::connect(addrs[1], "nl-me").await;
    let mut filter = Filter::new("nl/#", QoS::AtLeastOnce);
    filter.nolocal = true;
    me.subscribe(filter).await;
    let mut witness = Client::connect(addrs[2], "nl-witness").await;
    witness
        .subscribe(Filter::new("nl/#", QoS::AtLeastOnce))
        .await;

    me.publish("nl/mine", QoS::AtLeastOnce, false, "x").await;
    let p = witness.publish_msg("nl/mine on node 3").await;
    assert_eq!(topic(&p), "nl/mine");

    let mut other = Client::connect(addrs[0], "nl-other").await;
    other.publish("nl/end", QoS::AtLeastOnce, false, "").await;
    let p = me.publish_msg("the next message on node 2").await;
    assert_eq!(
        topic(&p),
        "nl/end",
        "its own nl/mine was not delivered to it (No Local)"
    );
}

/// A client id connected on node 1 connects on node 2: node 1's connection gets DISCONNECT 0x8E.
async fn takeover_across_nodes(addrs: &[SocketAddr]) {
    let mut first = Client::connect(addrs[0], "tk").await;
    let _second = Client::connect(addrs[1], "tk").await;
    let code = first
        .next("DISCONNECT on node 1", |s| match s {
            Seen::Disconnect(code) => Some(code),
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
    let mut nodes = start_founders(root.path());
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut listener = runtime.block_on(async {
        until_meshed(&addrs).await;
        let mut listener = Client::connect(addrs[0], "back-sub").await;
        listener
            .subscribe(Filter::new("back/#", QoS::AtLeastOnce))
            .await;
        listener
    });
    nodes[2].kill9();
    runtime.block_on(async {
        let mut publisher = Client::connect(addrs[0], "kept-pub").await;
        publisher
            .publish("kept/x", QoS::AtLeastOnce, true, "while away")
            .await;
    });
    nodes[2].restart();
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
            let mut sub = Client::connect(addrs[2], &format!("kept-sub-{attempt}")).await;
            sub.subscribe(Filter::new("kept/#", QoS::AtLeastOnce)).await;
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
        let mut publisher = Client::connect(addrs[2], "back-pub").await;
        loop {
            assert!(
                started.elapsed() < WAIT,
                "node 3 never learned node 1's routes"
            );
            publisher
                .publish("back/3", QoS::AtMostOnce, false, "")
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
