//! Several control-plane nodes in one process over the in-memory transport: formation, leader
//! loss, failure detection through leases, re-entry at the tail, membership changes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use mqstate_cluster::sim::{mem_addr as addr, mem_node, quick_config, state_of};
use mqstate_cluster::transport::mem::MemNetwork;
use mqstate_cluster::{ClusterNode, NodeId, Status};

const PARTITIONS: u32 = 6;

fn peers(ids: &[NodeId]) -> BTreeMap<NodeId, String> {
    ids.iter().map(|&id| (id, addr(id))).collect()
}

async fn start(net: &MemNetwork, root: &Path, id: NodeId, founders: &[NodeId]) -> ClusterNode {
    let dir = root.join(format!("n{id}"));
    mem_node(
        net,
        quick_config(id, addr(id), peers(founders), dir, PARTITIONS),
    )
    .await
}

async fn crash(net: &MemNetwork, node: ClusterNode) {
    net.unregister(&addr(node.id()));
    node.shutdown().await;
}

/// Polls `check` over every node's status until it holds for all, or panics after `limit`.
async fn eventually(nodes: &[&ClusterNode], what: &str, check: impl Fn(&Status) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if nodes.iter().all(|n| check(&n.status())) {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            let statuses: Vec<Status> = nodes.iter().map(|n| n.status()).collect();
            panic!("not within 30 s: {what}\n{statuses:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn settled(status: &Status) -> bool {
    status.partitions.len() == PARTITIONS as usize
        && status
            .partitions
            .iter()
            .all(|p| !p.pending && p.read_view == p.write_view)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_survive_the_leader_and_change_membership() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new();
    let founders = [1, 2, 3];
    let mut nodes = Vec::new();
    for id in founders {
        nodes.push(start(&net, dir.path(), id, &founders).await);
    }
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "one leader, three members up, the map created", |s| {
        s.leader.is_some()
            && s.members.len() == 3
            && s.members.iter().all(|m| m.state == "up")
            && settled(s)
    })
    .await;
    let first = nodes[0].status();
    for node in &nodes[1..] {
        let other = node.status();
        assert_eq!(other.leader, first.leader);
        assert_eq!(other.members, first.members);
        assert_eq!(other.partitions, first.partitions);
    }
    let heads: Vec<NodeId> = first.partitions.iter().map(|p| p.chain[0]).collect();
    assert_eq!(heads, [1, 2, 3, 1, 2, 3], "heads rotate over the nodes");
    assert!(first.partitions.iter().all(|p| p.chain.len() == 3));
    let placement = nodes[1].partition_of("sensor/1").unwrap();
    assert_eq!(
        placement.partition,
        mqstate_cluster::partition::partition_of(b"sensor/1", PARTITIONS)
    );
    // Every partition is acted on by its chain, under one view.
    tokio::time::sleep(Duration::from_millis(400)).await;
    for node in &nodes {
        assert_eq!(node.acting_view(0), Some(1), "node {}", node.id());
    }

    // The leader crashes: the others elect a new one, detect the loss through its lease and take
    // it out of every chain.
    let old = first.leader.unwrap();
    let index = nodes.iter().position(|n| n.id() == old).unwrap();
    crash(&net, nodes.remove(index)).await;
    let rest: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(
        &rest,
        "a new leader, the old one down and out of the chains",
        |s| {
            s.leader.is_some_and(|l| l != old)
                && state_of(s, old) == Some("down")
                && settled(s)
                && s.partitions
                    .iter()
                    .all(|p| !p.chain.contains(&old) && p.chain.len() == 2)
        },
    )
    .await;

    // It restarts with its data: back up, re-entering chains at the tail.
    nodes.push(start(&net, dir.path(), old, &founders).await);
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "the old leader is back at the tails", |s| {
        state_of(s, old) == Some("up")
            && settled(s)
            && s.partitions.iter().all(|p| p.chain.len() == 3)
    })
    .await;
    let back = nodes[0].status();
    for p in &back.partitions {
        assert_eq!(p.chain.last(), Some(&old), "re-entered at the tail: {p:?}");
    }

    // A fourth node joins, then node 2 leaves.
    nodes.push(start(&net, dir.path(), 4, &[]).await);
    nodes[0].add_node(4, addr(4)).await.expect("add node 4");
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "node 4 is a voter and up", |s| {
        s.members
            .iter()
            .any(|m| m.id == 4 && m.voter && m.state == "up")
            && settled(s)
    })
    .await;
    let survivor = nodes.iter().find(|n| n.id() != 2).unwrap();
    survivor.remove_node(2).await.expect("remove node 2");
    let index = nodes.iter().position(|n| n.id() == 2).unwrap();
    crash(&net, nodes.remove(index)).await;
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "node 2 is gone from members and chains", |s| {
        s.members.iter().all(|m| m.id != 2)
            && s.members.len() == 3
            && settled(s)
            && s.partitions.iter().all(|p| !p.chain.contains(&2))
    })
    .await;
    for node in nodes {
        node.shutdown().await;
    }
}
