//! `/ready` on a cluster node (decision 0041): 503 with the reason while the node is not a member,
//! 200 once it is a member caught up in its partitions, and after a restart 200 only when the
//! status agrees it is back in the read view of every chain it is in.

use std::net::SocketAddr;

use serde_json::Value;

use super::{cli, eventually, start_node, status};
use crate::common::{free_addr, http_get};

/// The partitions whose chain holds `id` but whose read view does not, in `status`.
fn catching_up(status: &Value, id: u64) -> Option<Vec<u64>> {
    let has = |list: &Value| {
        list.as_array()
            .is_some_and(|ids| ids.iter().any(|n| n.as_u64() == Some(id)))
    };
    let partitions = status["partitions"].as_array()?;
    Some(
        partitions
            .iter()
            .filter(|p| has(&p["chain"]) && !has(&p["read_view"]))
            .filter_map(|p| p["id"].as_u64())
            .collect(),
    )
}

#[test]
fn ready_on_a_cluster_node_means_a_member_caught_up() {
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let metrics: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    let start = |id: u64| {
        let endpoint = metrics[id as usize - 1].to_string();
        start_node(
            root.path(),
            id,
            addrs[id as usize - 1],
            &["--peers", &peers, "--metrics-listen", &endpoint],
        )
    };

    // Alone, node 1 cannot form the cluster (no majority): listening, but not ready, and it says why.
    let first = start(1);
    let (code, body) = http_get(metrics[0], "/ready");
    assert_eq!(
        (code, body.as_str()),
        (
            503,
            "not ready: not a member of a cluster (not formed yet, or waiting to be added)\n"
        )
    );
    assert_eq!(http_get(metrics[0], "/health").0, 200);

    let mut nodes = [first, start(2), start(3)];
    let (_, formed) = eventually("every node ready", || {
        metrics
            .iter()
            .all(|&m| http_get(m, "/ready").0 == 200)
            .then_some(())
    });
    println!("three fresh nodes ready in {formed:?}");

    // Node 3 stops; keys are written without it; it comes back and must be copied them.
    nodes[2].server.stop();
    // Until the control plane takes node 3 out of its chains, writes to them are refused as
    // retryable; a client retries.
    for i in 0..40 {
        let key = format!("ready/{i}");
        eventually("a SET without node 3", || {
            cli(nodes[0].server.port(), &["set", &key, "v"])
                .status
                .success()
                .then_some(())
        });
    }
    nodes[2].server.restart();
    let (body, back) = eventually("node 3 ready again", || {
        let (code, body) = http_get(metrics[2], "/ready");
        (code == 200).then_some(body)
    });
    assert_eq!(body, "ready\n");
    println!("node 3 ready again {back:?} after its restart");
    // Ready means caught up: no partition still has it in its chain but not in its read view.
    let seen = status(&nodes[2]).expect("node 3's status");
    assert_eq!(catching_up(&seen, 3), Some(vec![]), "{seen}");
    assert!(
        seen["partitions"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["read_view"]
                .as_array()
                .is_some_and(|ids| ids.iter().any(|n| n.as_u64() == Some(3))))),
        "node 3 is back in read views: {seen}"
    );
    let out = cli(nodes[2].server.port(), &["get", "ready/39"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "v");
}
