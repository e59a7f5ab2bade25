//! The chain log compacted (issue 15): three real processes with a tiny snapshot threshold; a
//! node whose chain log was snapshotted and purged is killed with `kill -9` and restarted, takes
//! its place in the chains again, and — once the node that wrote everything is killed too, so that
//! it heads partitions — serves every key written before and after its restart.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{free_addr, Server};
use serde_json::Value;

/// Generous: the machine running the tests may be loaded.
const TIMEOUT: Duration = Duration::from_secs(120);

fn cli(port: u16, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(args)
        .args(["--port", &port.to_string(), "--timeout", "5"])
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .output()
        .expect("run mqstate")
}

fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "not within {TIMEOUT:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn status(port: u16) -> Option<Value> {
    let out = cli(port, &["cluster", "status", "--json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// Every partition settled (no change pending), each chain exactly `members` in some order and
/// every replica readable (caught up).
fn settled(port: u16, members: &[u64]) -> Option<()> {
    let s = status(port)?;
    let partitions = s["partitions"].as_array()?;
    let ok = !partitions.is_empty()
        && partitions.iter().all(|p| {
            let mut chain = ids(&p["chain"]);
            chain.sort_unstable();
            p["pending"] == false && chain == members && ids(&p["read_view"]).len() == members.len()
        });
    ok.then_some(())
}

fn set(port: u16, key: &str, value: &str) {
    eventually(&format!("SET {key} through port {port}"), || {
        cli(port, &["set", key, value])
            .status
            .success()
            .then_some(())
    });
}

fn start(root: &Path, id: u64, addr: SocketAddr, peers: &str) -> Server {
    Server::start_in(
        &root.join(format!("n{id}")),
        &[
            "--node-id",
            &id.to_string(),
            "--cluster-listen",
            &addr.to_string(),
            "--peers",
            peers,
            "--snapshot-threshold-bytes",
            "4096",
        ],
        &[],
    )
}

#[test]
fn a_node_restarted_from_its_chain_snapshot_and_tail_is_caught_up_and_serves_as_head() {
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    let mut nodes: Vec<Server> = (1..=3)
        .map(|id| start(root.path(), id, addrs[id as usize - 1], &peers))
        .collect();
    let port = |nodes: &[Server], id: u64| nodes[id as usize - 1].port();
    eventually("three nodes settled", || {
        settled(port(&nodes, 1), &[1, 2, 3])
    });

    for i in 0..120 {
        set(port(&nodes, 1), &format!("k{i:03}"), &format!("before-{i}"));
    }
    let snapshot = root
        .path()
        .join("n2")
        .join("chains")
        .join("mqstate.snapshot");
    eventually("node 2's chain log snapshotted", || {
        snapshot.exists().then_some(())
    });

    nodes[1].kill9();
    nodes[1].restart();
    eventually("node 2 back in every chain, caught up", || {
        settled(port(&nodes, 1), &[1, 2, 3])
    });
    for i in 120..160 {
        set(port(&nodes, 3), &format!("k{i:03}"), &format!("after-{i}"));
    }

    // Node 1 gone: node 2 heads the partitions whose chain it was next in, from its own rows.
    nodes[0].kill9();
    eventually("node 1 out of every chain", || {
        settled(port(&nodes, 3), &[2, 3])
    });
    let heads = status(port(&nodes, 2)).unwrap()["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| ids(&p["read_view"]).first() == Some(&2))
        .count();
    assert!(heads > 0, "node 2 heads some partitions");
    for i in 0..160 {
        let key = format!("k{i:03}");
        let want = if i < 120 { "before" } else { "after" };
        let got = eventually(&format!("GET {key}"), || {
            let out = cli(port(&nodes, 2), &["get", &key]);
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        });
        assert_eq!(got, format!("{want}-{i}"), "{key}");
    }
}
