//! A cluster of real `mqstate serve` processes on loopback: the three founding nodes, the CLI's
//! `cluster status` and `partition-of`, waiting (bounded) for a condition, and raw MQTT clients
//! across a node's failure (connecting through a fail-over, retained sets, publishers).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{LastWill, Packet, PingReq, Publish};
use rumqttc::v5::mqttbytes::QoS;
use serde_json::Value;

use super::mqtt::Raw;
use super::Server;

/// Generous: the machine running the tests may be loaded. Timings are measured and printed, not
/// asserted.
pub const AGREEMENT_TIMEOUT: Duration = Duration::from_secs(90);

pub struct Node {
    pub id: u64,
    pub cluster_addr: SocketAddr,
    pub server: Server,
}

/// Nodes 1, 2 and 3 founding a cluster on the first three of `addrs`.
pub fn start_founders(root: &Path, addrs: &[SocketAddr]) -> Vec<Node> {
    start_founders_with(root, addrs, &[], |_| Vec::new())
}

/// Nodes 1, 2 and 3 founding a cluster on the first three of `addrs`, each with the extra `serve`
/// flags `args` and the environment `env(id)`.
pub fn start_founders_with(
    root: &Path,
    addrs: &[SocketAddr],
    args: &[&str],
    env: impl Fn(u64) -> Vec<(String, String)>,
) -> Vec<Node> {
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    let mut membership = vec!["--peers", &peers];
    membership.extend_from_slice(args);
    (1..=3)
        .map(|id| {
            let env = env(id);
            let env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            start_node_with(root, id, addrs[id as usize - 1], &membership, &env)
        })
        .collect()
}

/// The three founding nodes on fresh addresses, once they agree on a leader, the members and a
/// settled partition map.
pub fn formed_cluster(root: &Path) -> Vec<Node> {
    let addrs: Vec<SocketAddr> = (0..3).map(|_| super::free_addr()).collect();
    let nodes = start_founders(root, &addrs);
    let refs: Vec<&Node> = nodes.iter().collect();
    let (_, formed_in) = eventually("three nodes agree", || agreed(&refs, &[1, 2, 3]));
    eprintln!("cluster formed in {formed_in:?}");
    nodes
}

/// [`formed_cluster`] for an async test (a multi-threaded runtime), in a fresh directory: the
/// directory (keep it), the nodes and their MQTT addresses.
pub fn three_nodes() -> (tempfile::TempDir, Vec<Node>, [SocketAddr; 3]) {
    let root = tempfile::tempdir().expect("a temporary directory");
    let nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let addrs = [
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    ];
    (root, nodes, addrs)
}

pub fn start_node(root: &Path, id: u64, cluster_addr: SocketAddr, membership: &[&str]) -> Node {
    start_node_with(root, id, cluster_addr, membership, &[])
}

/// Node `id` in `root/n<id>`, its cluster listener on `cluster_addr`, with the extra `serve` flags
/// `args` (membership first) and environment `env`.
pub fn start_node_with(
    root: &Path,
    id: u64,
    cluster_addr: SocketAddr,
    args: &[&str],
    env: &[(&str, &str)],
) -> Node {
    let id_text = id.to_string();
    let listen = cluster_addr.to_string();
    let mut all = vec!["--node-id", &id_text, "--cluster-listen", &listen];
    all.extend_from_slice(args);
    let server = Server::start_in(&root.join(format!("n{id}")), &all, env);
    Node {
        id,
        cluster_addr,
        server,
    }
}

pub fn cli(port: u16, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(args)
        .args(["--port", &port.to_string(), "--timeout", "5"])
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .output()
        .expect("run mqstate")
}

pub fn status(node: &Node) -> Option<Value> {
    status_at(node.server.port())
}

/// `mqstate cluster status --json` through the node listening for MQTT on `port`.
pub fn status_at(port: u16) -> Option<Value> {
    let out = cli(port, &["cluster", "status", "--json"]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

pub fn member_ids(status: &Value) -> Vec<u64> {
    status["members"]
        .as_array()
        .map(|members| members.iter().filter_map(|m| m["id"].as_u64()).collect())
        .unwrap_or_default()
}

pub fn member_state(status: &Value, id: u64) -> Option<String> {
    status["members"]
        .as_array()?
        .iter()
        .find(|m| m["id"].as_u64() == Some(id))
        .and_then(|m| m["state"].as_str().map(str::to_owned))
}

/// Every node reports the same leader and the same members (`expected`, all up), and a settled
/// partition map (no pending view).
pub fn agreed(nodes: &[&Node], expected: &[u64]) -> Option<u64> {
    let statuses: Vec<Value> = nodes.iter().map(|n| status(n)).collect::<Option<_>>()?;
    let leader = statuses[0]["leader"].as_u64()?;
    for s in &statuses {
        if s["leader"].as_u64() != Some(leader) || member_ids(s) != expected {
            return None;
        }
        if expected
            .iter()
            .any(|&id| member_state(s, id).as_deref() != Some("up"))
        {
            return None;
        }
        let partitions = s["partitions"].as_array()?;
        if partitions.is_empty() || partitions.iter().any(|p| p["pending"] != false) {
            return None;
        }
        if s["partitions"] != statuses[0]["partitions"] {
            return None;
        }
    }
    Some(leader)
}

pub fn eventually<T>(what: &str, check: impl FnMut() -> Option<T>) -> (T, Duration) {
    eventually_within(AGREEMENT_TIMEOUT, what, check)
}

/// `check` polled until it gives a value, for at most `within`; the value and how long it took.
pub fn eventually_within<T>(
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> Option<T>,
) -> (T, Duration) {
    let started = Instant::now();
    loop {
        if let Some(value) = check() {
            return (value, started.elapsed());
        }
        assert!(started.elapsed() < within, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn placement(node: &Node, key: &str) -> Option<Value> {
    let out = cli(
        node.server.port(),
        &["cluster", "partition-of", key, "--json"],
    );
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

pub fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// The chain (head first) of `key`'s partition, as the node at `port` sees it.
pub fn chain_of(port: u16, key: &str) -> Option<Vec<u64>> {
    let out = cli(port, &["cluster", "partition-of", key, "--json"]);
    if !out.status.success() {
        return None;
    }
    let placed: Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(ids(&placed["chain"]))
}

/// Every node at `ports` names the same leader and the same settled map, in which every partition's
/// chain is `full` nodes long and its read view is the whole chain: every replica caught up.
pub fn settled(ports: &[u16], full: usize) -> Option<u64> {
    let statuses: Vec<Value> = ports.iter().map(|&p| status_at(p)).collect::<Option<_>>()?;
    let leader = statuses[0]["leader"].as_u64()?;
    for s in &statuses {
        if s["leader"].as_u64() != Some(leader) || s["partitions"] != statuses[0]["partitions"] {
            return None;
        }
        let partitions = s["partitions"].as_array()?;
        let whole = |p: &Value| {
            p["pending"] == false
                && ids(&p["chain"]).len() == full
                && ids(&p["read_view"]) == ids(&p["chain"])
        };
        if partitions.is_empty() || !partitions.iter().all(whole) {
            return None;
        }
    }
    Some(leader)
}

/// Hang guard of every wait across a node's failure (fail-over, adoption, settling a dead node's
/// rows, expiry): generous, the machine is shared.
pub const FAILOVER_WAIT: Duration = Duration::from_secs(120);

/// [`Raw::accept_within`] [`FAILOVER_WAIT`]: connects, retrying while the server refuses retryably.
pub async fn accepted(
    addr: SocketAddr,
    id: &str,
    clean_start: bool,
    expiry: u32,
    will: Option<LastWill>,
) -> (Raw, bool) {
    Raw::accept_within(addr, id, clean_start, expiry, will, FAILOVER_WAIT).await
}

/// A client `id` on `addr` that hears every will of [`will_of`](super::mqtt::will_of) (`will/#`,
/// QoS 1; [`Raw::next_topic`] takes the next).
pub async fn will_watcher(addr: SocketAddr, id: &str) -> Raw {
    let (mut watcher, _) = accepted(addr, id, true, 0, None).await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;
    watcher
}

/// Asserts that `watcher` (a [`will_watcher`]) hears no more wills: a marker published on `will/`
/// from a new client on `addr` is the next topic it hears. `why` names what a failure means.
pub async fn no_more_wills(watcher: &mut Raw, addr: SocketAddr, marker_client: &str, why: &str) {
    let (mut publisher, _) = accepted(addr, marker_client, true, 0, None).await;
    assert_eq!(
        publisher
            .publish("will/zz-marker", QoS::AtLeastOnce, "m")
            .await,
        0x00
    );
    assert_eq!(watcher.next_topic().await, "will/zz-marker", "{why}");
    drop(publisher);
}

/// `id`'s persistent session back on `addr` once adopted (Session Present = 1), within
/// [`FAILOVER_WAIT`] of `since`.
pub async fn adopted(addr: SocketAddr, id: &str, since: Instant) -> Raw {
    loop {
        assert!(
            since.elapsed() < FAILOVER_WAIT,
            "{id} not adopted after {FAILOVER_WAIT:?}"
        );
        let (client, present) = accepted(addr, id, false, 3600, None).await;
        if present {
            return client;
        }
        client.disconnect().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The retained messages a new subscriber `id` to `r/#` on `addr` gets: topic → payload (they
/// come in topic order, before the answer to a ping sent after the SUBACK).
pub async fn retained_at(addr: SocketAddr, id: &str) -> BTreeMap<String, String> {
    let (mut c, _) = accepted(addr, id, true, 0, None).await;
    c.subscribe("r/#", QoS::AtMostOnce).await;
    c.send(Packet::PingReq(PingReq)).await;
    let mut got = BTreeMap::new();
    loop {
        match c.recv().await {
            Packet::PingResp(_) => break,
            Packet::Publish(p) => {
                got.insert(
                    String::from_utf8_lossy(&p.topic).into_owned(),
                    String::from_utf8_lossy(&p.payload).into_owned(),
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    c.disconnect().await;
    got
}

/// `publisher` retains `messages` (topic, payload) again until a subscriber on `addr` gets
/// exactly those: the nodes' mesh forms in the background.
pub async fn retain_until_held(publisher: &mut Raw, messages: &[(&str, &str)], addr: SocketAddr) {
    let want: BTreeMap<String, String> = messages
        .iter()
        .map(|(topic, payload)| (topic.to_string(), payload.to_string()))
        .collect();
    let started = Instant::now();
    for attempt in 0.. {
        for (topic, payload) in messages {
            publisher.retain(topic, payload).await;
        }
        if retained_at(addr, &format!("r-before-{attempt}")).await == want {
            return;
        }
        assert!(
            started.elapsed() < FAILOVER_WAIT,
            "{addr} never got the retained messages {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until a subscriber on `addr`, a node just restarted, gets the marker `r/zz-marker` (last
/// in topic order: it took in the others' retained sets), and asserts it gets `expected`.
pub async fn retained_after_restart(addr: SocketAddr, expected: &BTreeMap<String, String>) {
    let restarted = Instant::now();
    for attempt in 0.. {
        let got = retained_at(addr, &format!("r-after-{attempt}")).await;
        if got.contains_key("r/zz-marker") {
            assert_eq!(&got, expected, "{addr} after its restart");
            eprintln!(
                "{addr} learned the retained set {:?} after its restart",
                restarted.elapsed()
            );
            return;
        }
        assert!(
            restarted.elapsed() < FAILOVER_WAIT,
            "{addr} never learned the retained set: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Publishes on `probe` (QoS 0) from `publisher` until a subscriber on `addr` hears it: `addr`'s
/// route reached the publisher's node, after whatever `addr`'s node sent it before. The
/// subscriber, kept by the caller.
pub async fn route_heard(publisher: &mut Raw, addr: SocketAddr) -> Raw {
    let (mut probe, _) = accepted(addr, "r-probe", true, 0, None).await;
    probe.subscribe("probe", QoS::AtMostOnce).await;
    let started = Instant::now();
    loop {
        let mut p = Publish::new("probe", QoS::AtMostOnce, Bytes::from_static(b"p"), None);
        p.pkid = 0;
        publisher.send(Packet::Publish(p)).await;
        let heard = tokio::time::timeout(Duration::from_millis(300), probe.recv()).await;
        if let Ok(Packet::Publish(_)) = heard {
            return probe;
        }
        assert!(
            started.elapsed() < FAILOVER_WAIT,
            "the route of {addr} never reached the publisher's node"
        );
    }
}

/// What one publisher of [`publish_for_a_while`] did.
struct Published {
    client: Raw,
    count: usize,
    /// Acknowledged 0x00 (PUBACK, or PUBREC then PUBCOMP).
    ok: Vec<String>,
    /// Answered 0x10 (no matching subscribers).
    no_match: usize,
}

/// Publishes `<prefix>0`, `<prefix>1`, … on `topic` at `qos`, each awaiting its
/// acknowledgement, until 5 s after `since` (at least `at_least`).
async fn publish_sequence(
    mut client: Raw,
    topic: &'static str,
    qos: QoS,
    prefix: String,
    since: Instant,
    at_least: usize,
) -> Published {
    let (mut ok, mut no_match, mut count) = (Vec::new(), 0, 0);
    while since.elapsed() < Duration::from_secs(5) || count < at_least {
        assert!(
            since.elapsed() < FAILOVER_WAIT,
            "publishing for {FAILOVER_WAIT:?}"
        );
        let payload = format!("{prefix}{count}");
        let code = client.publish(topic, qos, &payload).await;
        match code {
            0x00 => ok.push(payload),
            0x10 => no_match += 1,
            other => panic!("acknowledgement of {payload}: reason {other:#04x}"),
        }
        count += 1;
    }
    Published {
        client,
        count,
        ok,
        no_match,
    }
}

/// The `clients` (the first one now, the others 0.25 s apart) publishing `p<k>-<n>` to `topic` at
/// `qos` for ~5 s after `since` (each at least `at_least` messages); every payload acknowledged
/// 0x00, and a client.
pub async fn publish_for_a_while(
    clients: Vec<Raw>,
    topic: &'static str,
    qos: QoS,
    since: Instant,
    at_least: usize,
) -> (BTreeSet<String>, Raw) {
    let mut tasks = Vec::new();
    for (k, client) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(publish_sequence(
            client,
            topic,
            qos,
            format!("p{k}-"),
            since,
            at_least,
        )));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (mut acked, mut published, mut no_match, mut client) = (BTreeSet::new(), 0, 0, None);
    for task in tasks {
        let p = task.await.expect("publisher task");
        published += p.count;
        no_match += p.no_match;
        acked.extend(p.ok);
        client.get_or_insert(p.client);
    }
    eprintln!(
        "{published} published in {:?}: {} acknowledged 0x00, {no_match} answered 0x10",
        since.elapsed(),
        acked.len()
    );
    (acked, client.expect("a publisher"))
}

/// Asserts every acknowledged payload is among those received.
pub fn nothing_lost(acked: &BTreeSet<String>, received: &[String]) {
    let got: BTreeSet<&String> = received.iter().collect();
    let lost: Vec<&String> = acked.iter().filter(|p| !got.contains(p)).collect();
    eprintln!(
        "received {} messages ({} copies) of {} acknowledged",
        got.len(),
        received.len(),
        acked.len()
    );
    assert!(
        lost.is_empty(),
        "{} acknowledged 0x00 and lost, among them {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
}
