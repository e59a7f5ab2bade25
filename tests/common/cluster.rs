//! A cluster of real `mqstate serve` processes on loopback: the three founding nodes, the CLI's
//! `cluster status` and `partition-of`, and waiting (bounded) for a condition.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

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
