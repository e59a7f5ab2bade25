//! Several control-plane nodes in one process over the in-memory transport: formation, leader
//! loss, failure detection through leases, re-entry at the tail, membership changes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use mqstate_cluster::identity::ClusterId;
use mqstate_cluster::sim::{mem_addr as addr, mem_node, quick_config, state_of};
use mqstate_cluster::transport::mem::MemNetwork;
use mqstate_cluster::transport::{AdminRequest, Request, Response};
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

/// Every one of `founders`, in order.
async fn start_all(net: &MemNetwork, root: &Path, founders: &[NodeId]) -> Vec<ClusterNode> {
    let mut nodes = Vec::new();
    for &id in founders {
        nodes.push(start(net, root, id, founders).await);
    }
    nodes
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
    let mut nodes = start_all(&net, dir.path(), &founders).await;
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

/// A follower cut off while the leader snapshots and purges past it is brought back by a snapshot
/// (installed by openraft on the follower, the log purged after it: decision 0073), is crashed and
/// restarted on what it then holds, and catches up again; every node, the leader included, goes on
/// applying (a leader whose follower reported a log below what it had acknowledged stops in a debug
/// build: "follower log reversion is not allowed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_brought_back_by_a_snapshot_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new();
    let founders = [1, 2, 3];
    let start_snapshotting = |id: NodeId| {
        let mut config = quick_config(
            id,
            addr(id),
            peers(&founders),
            dir.path().join(format!("n{id}")),
            PARTITIONS,
        );
        // A snapshot every 10 entries, 1 kept after it: a follower 50 behind needs the snapshot.
        config.snapshot_every = 10;
        mem_node(&net, config)
    };
    let mut nodes = Vec::new();
    for id in founders {
        nodes.push(start_snapshotting(id).await);
    }
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "one leader, three members up, the map created", |s| {
        s.leader.is_some() && s.members.iter().all(|m| m.state == "up") && settled(s)
    })
    .await;
    let leader = nodes[0].status().leader.unwrap();
    let follower = founders.into_iter().find(|&id| id != leader).unwrap();
    let at = |id: NodeId| founders.iter().position(|&n| n == id).unwrap();
    for other in founders.into_iter().filter(|&id| id != follower) {
        net.cut(&addr(follower), &addr(other));
    }
    let behind = nodes[at(follower)].status().applied_index.unwrap_or(0);
    let others: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id() != follower).collect();
    eventually(
        &others,
        "the others 50 entries past the cut-off follower",
        |s| s.applied_index.is_some_and(|a| a > behind + 50),
    )
    .await;
    net.heal_all();
    let reached = |nodes: &[ClusterNode]| {
        nodes
            .iter()
            .filter_map(|n| n.status().applied_index)
            .max()
            .unwrap_or(0)
    };
    let target = reached(&nodes);
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "the follower caught up, everyone up", |s| {
        s.applied_index.is_some_and(|a| a >= target)
            && s.members.iter().all(|m| m.state == "up")
            && settled(s)
    })
    .await;

    let node = nodes.remove(at(follower));
    crash(&net, node).await;
    nodes.insert(at(follower), start_snapshotting(follower).await);
    let target = reached(&nodes) + 20;
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "every node applying again after the restart", |s| {
        s.applied_index.is_some_and(|a| a >= target)
            && s.members.iter().all(|m| m.state == "up")
            && settled(s)
    })
    .await;
}

/// A node of another cluster that takes a dead member's address (a reused IP, a parallel test
/// cluster's port) is refused by the cluster, and refuses it: each keeps its own members and log
/// (decision 0075). Without a cluster id on the wire the leader's AppendEntries made the stranger
/// its follower, or tripped openraft's "follower log reversion is not allowed".
/// A founder whose directory kept another cluster's id but lost its Raft state does not found a
/// cluster under that id. Nodes 2 and 3 are listed founders started as joiners, so node 1 alone
/// would found it (it sees two empty peers): before this rule, it initialized Raft under the old
/// id and the joiners adopted that id from its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_founder_with_another_clusters_id_and_no_raft_state_founds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new();
    let leftover = dir.path().join("n1");
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(leftover.join("cluster-id"), "00000000000000aa\n").unwrap();
    let founders = [1, 2, 3];
    let mut nodes = Vec::new();
    for id in [2, 3] {
        let mut config = quick_config(
            id,
            addr(id),
            peers(&founders),
            dir.path().join(format!("n{id}")),
            PARTITIONS,
        );
        config.join = true;
        nodes.push(mem_node(&net, config).await);
    }
    nodes.push(start(&net, dir.path(), 1, &founders).await);
    // Node 1's bootstrap sees both peers empty at once; give it several of its retries.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for node in &nodes {
        let s = node.status();
        assert!(
            s.members.is_empty() && s.leader.is_none(),
            "no cluster formed: {s:#?}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(leftover.join("cluster-id")).unwrap(),
        "00000000000000aa\n",
        "the kept id is left for the operator"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_at_a_dead_members_address_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let net = MemNetwork::new();
    // The stranger: node 3 of a cluster of its own (it alone), formed and stopped.
    let elsewhere = dir.path().join("elsewhere");
    let stranger = start(&net, &elsewhere, 3, &[3]).await;
    eventually(&[&stranger], "the stranger leads its own cluster", |s| {
        s.leader == Some(3) && settled(s)
    })
    .await;
    crash(&net, stranger).await;

    let founders = [1, 2, 3];
    let mut nodes = start_all(&net, dir.path(), &founders).await;
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "one leader, three members up", |s| {
        s.leader.is_some() && s.members.iter().all(|m| m.state == "up") && settled(s)
    })
    .await;
    // A new term (above the stranger's): its leader crashes and comes back.
    let leader = nodes[0].status().leader.unwrap();
    let index = nodes.iter().position(|n| n.id() == leader).unwrap();
    crash(&net, nodes.remove(index)).await;
    let rest: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&rest, "another leader", |s| {
        s.leader.is_some_and(|l| l != leader)
    })
    .await;
    nodes.push(start(&net, dir.path(), leader, &founders).await);
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&all, "a leader again, every member up", |s| {
        s.leader.is_some() && s.members.iter().all(|m| m.state == "up") && settled(s)
    })
    .await;
    let index = nodes.iter().position(|n| n.id() == 3).unwrap();
    crash(&net, nodes.remove(index)).await;
    let rest: Vec<&ClusterNode> = nodes.iter().collect();
    eventually(&rest, "node 3 down", |s| {
        s.leader.is_some() && state_of(s, 3) == Some("down")
    })
    .await;

    // The stranger comes up at node 3's address with its own data.
    let stranger = start(&net, &elsewhere, 3, &[3]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let own = stranger.status();
    assert_eq!(
        own.members.iter().map(|m| m.id).collect::<Vec<_>>(),
        [3],
        "the stranger kept its own cluster: {own:#?}"
    );
    assert_eq!(own.leader, Some(3));
    for node in &nodes {
        let s = node.status();
        assert!(s.leader.is_some_and(|l| l != 3), "{s:#?}");
        assert_eq!(state_of(&s, 3), Some("down"), "the stranger is not node 3");
    }
    // Another cluster's membership change, or a request naming no cluster, is refused too; a Hello
    // is answered with the cluster's id.
    let handler = nodes[0].handler();
    let theirs = own_id(&stranger).await;
    let stamped = |request| Request::OfCluster {
        cluster: theirs,
        request: Box::new(request),
    };
    for request in [
        stamped(Request::Admin(AdminRequest::RemoveNode { id: 2 })),
        Request::Propose(mqstate_cluster::control::Command::Renew {
            node: 3,
            seen_epoch: 0,
            now_ms: 0,
        }),
    ] {
        match handler.handle(request).await {
            Response::Failed(why) => assert!(why.contains("this node belongs to cluster"), "{why}"),
            other => panic!("not refused: {other:?}"),
        }
    }
    match handler.handle(stamped(Request::Hello)).await {
        Response::Hello { cluster, .. } => {
            assert!(cluster.is_some() && cluster != Some(theirs))
        }
        other => panic!("{other:?}"),
    }
    stranger.shutdown().await;
    for node in nodes {
        node.shutdown().await;
    }
}

/// The cluster id `node` answers a Hello with.
async fn own_id(node: &ClusterNode) -> ClusterId {
    match node.handler().handle(Request::Hello).await {
        Response::Hello {
            cluster: Some(id), ..
        } => id,
        other => panic!("no cluster id: {other:?}"),
    }
}
