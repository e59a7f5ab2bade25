//! The chain log compacted (issue 15): three real processes with a tiny snapshot threshold; a
//! node whose chain log was snapshotted and purged is killed with `kill -9` and restarted, takes
//! its place in the chains again, and — once the node that wrote everything is killed too, so that
//! it heads partitions — serves every key written before and after its restart.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::cluster::{cli, eventually_within, ids, start_founders_with, status_at, Node};
use common::free_addr;

/// Generous: the machine running the tests may be loaded.
const TIMEOUT: Duration = Duration::from_secs(120);

fn eventually<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    eventually_within(TIMEOUT, what, check).0
}

/// Every partition settled (no change pending), each chain exactly `members` in some order and
/// every replica readable (caught up).
fn settled(port: u16, members: &[u64]) -> Option<()> {
    let s = status_at(port)?;
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

#[test]
fn a_node_restarted_from_its_chain_snapshot_and_tail_is_caught_up_and_serves_as_head() {
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let mut nodes = start_founders_with(
        root.path(),
        &addrs,
        &["--snapshot-threshold-bytes", "4096"],
        |_| Vec::new(),
    );
    let port = |nodes: &[Node], id: u64| nodes[id as usize - 1].server.port();
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

    nodes[1].server.kill9();
    nodes[1].server.restart();
    eventually("node 2 back in every chain, caught up", || {
        settled(port(&nodes, 1), &[1, 2, 3])
    });
    for i in 120..160 {
        set(port(&nodes, 3), &format!("k{i:03}"), &format!("after-{i}"));
    }

    // Node 1 gone: node 2 heads the partitions whose chain it was next in, from its own rows.
    nodes[0].server.kill9();
    eventually("node 1 out of every chain", || {
        settled(port(&nodes, 3), &[2, 3])
    });
    let heads = status_at(port(&nodes, 2)).unwrap()["partitions"]
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
