//! Three `mqstate serve` processes founding a cluster on loopback, and what tests ask of them
//! through `mqstate cluster`: status, placement, agreement. Conditions are polled with a generous
//! bound, never assumed after a fixed sleep.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Server;

/// Generous: the machine running the tests may be loaded.
pub const AGREEMENT_TIMEOUT: Duration = Duration::from_secs(90);

pub struct Node {
    pub id: u64,
    pub cluster_addr: SocketAddr,
    pub server: Server,
}

/// Nodes 1, 2 and 3 founding a cluster on the first three of `addrs`, with `extra` serve flags.
pub fn start_founders(root: &Path, addrs: &[SocketAddr], extra: &[&str]) -> Vec<Node> {
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    (1..=3)
        .map(|id| {
            let id_text = id.to_string();
            let listen = addrs[id as usize - 1].to_string();
            let mut args = vec![
                "--node-id",
                &id_text,
                "--cluster-listen",
                &listen,
                "--peers",
                &peers,
            ];
            args.extend_from_slice(extra);
            let server = Server::start_in(&root.join(format!("n{id}")), &args, &[]);
            Node {
                id,
                cluster_addr: addrs[id as usize - 1],
                server,
            }
        })
        .collect()
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

pub fn status(port: u16) -> Option<Value> {
    let out = cli(port, &["cluster", "status", "--json"]);
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
    let statuses: Vec<Value> = ports.iter().map(|&p| status(p)).collect::<Option<_>>()?;
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

pub fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> (T, Duration) {
    let started = Instant::now();
    loop {
        if let Some(value) = check() {
            return (value, started.elapsed());
        }
        assert!(
            started.elapsed() < AGREEMENT_TIMEOUT,
            "not within {AGREEMENT_TIMEOUT:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
