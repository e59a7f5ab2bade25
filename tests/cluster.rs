//! Real `mqstate serve` processes on loopback forming a cluster: status agrees on every node, the
//! leader is killed with SIGKILL and replaced, restarts and rejoins, a fourth node is added and
//! another removed, and all of them restarted together keep the configuration. The state store
//! on the chains, with the official AIO SDK: a write through one node is read with its version
//! on the others, NX and VDEL hold through a node that is not the head, and an acknowledged write
//! survives `kill -9` of its chain's head.

mod common;

/// `/ready` on a cluster node (`tests/cluster/ready.rs`).
#[path = "cluster/ready.rs"]
mod ready;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Instant;

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::{SetCondition, SetOptions};
use common::cluster::{
    agreed, cli, eventually, formed_cluster, ids, member_state, placement, start_founders,
    start_node, status, Node,
};
use common::sdk::SdkClient;
use common::{free_addr, Server};
use mqstate_testcerts::Ca;
use serde_json::Value;

#[test]
fn three_processes_form_a_cluster_survive_kill_9_and_change_membership() {
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<SocketAddr> = (0..4).map(|_| free_addr()).collect();
    let mut nodes = start_founders(root.path(), &addrs);

    let refs: Vec<&Node> = nodes.iter().collect();
    let (leader, formed_in) = eventually("three nodes agree on a leader and members", || {
        agreed(&refs, &[1, 2, 3])
    });
    eprintln!("cluster formed and agreed in {formed_in:?}; leader {leader}");
    let s = status(&nodes[1]).unwrap();
    assert_eq!(s["node_id"], 2);
    assert!(s["term"].as_u64().unwrap() >= 1);
    let partitions = s["partitions"].as_array().unwrap();
    assert_eq!(partitions.len(), 64);
    for p in partitions {
        assert_eq!(p["chain"].as_array().unwrap().len(), 3);
        assert_eq!(p["read_view"], p["write_view"]);
        assert!(p["view"].as_u64().unwrap() >= 1);
    }

    // The human table and partition-of.
    let table = cli(nodes[0].server.port(), &["cluster", "status"]);
    assert!(table.status.success());
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains(&format!("leader {leader}")), "{table}");
    for node in &nodes {
        assert!(table.contains(&node.cluster_addr.to_string()), "{table}");
    }
    let placed = cli(
        nodes[2].server.port(),
        &["cluster", "partition-of", "sensor/1", "--json"],
    );
    assert!(placed.status.success());
    let placed: Value = serde_json::from_slice(&placed.stdout).unwrap();
    assert_eq!(
        placed["partition"].as_u64(),
        Some(u64::from(mqstate_cluster::partition::partition_of(
            b"sensor/1",
            64
        )))
    );
    assert_eq!(placed["chain"].as_array().unwrap().len(), 3);

    // kill -9 the leader: the other two elect a new one and take the old one out of its chains.
    let index = nodes.iter().position(|n| n.id == leader).unwrap();
    nodes[index].server.kill9();
    let killed_at = Instant::now();
    let rest: Vec<&Node> = nodes.iter().filter(|n| n.id != leader).collect();
    let (new_leader, _) = eventually("a new leader after kill -9", || {
        let statuses: Vec<Value> = rest.iter().map(|n| status(n)).collect::<Option<_>>()?;
        let first = statuses[0]["leader"].as_u64()?;
        (first != leader && statuses.iter().all(|s| s["leader"].as_u64() == Some(first)))
            .then_some(first)
    });
    eprintln!(
        "new leader {new_leader} seen by both survivors {:?} after kill -9 of leader {leader} (default settings)",
        killed_at.elapsed()
    );
    eventually("the killed leader is down and out of every chain", || {
        rest.iter()
            .all(|n| {
                status(n).is_some_and(|s| {
                    member_state(&s, leader).as_deref() == Some("down")
                        && s["partitions"].as_array().is_some_and(|ps| {
                            ps.iter().all(|p| {
                                p["pending"] == false
                                    && !p["chain"].as_array().is_some_and(|c| {
                                        c.iter().any(|id| id.as_u64() == Some(leader))
                                    })
                            })
                        })
                })
            })
            .then_some(())
    });
    eprintln!(
        "old leader taken out of its chains {:?} after the kill",
        killed_at.elapsed()
    );

    // The old leader restarts on its data and rejoins.
    nodes[index].server.restart();
    let refs: Vec<&Node> = nodes.iter().collect();
    let (_, rejoined_in) = eventually("the old leader rejoined", || agreed(&refs, &[1, 2, 3]));
    eprintln!("old leader rejoined in {rejoined_in:?}");

    // A fourth node, started with --join, is added; then node 2 (or 3, if 2 leads) is removed.
    nodes.push(start_node(root.path(), 4, addrs[3], &["--join"]));
    let added = cli(
        nodes[0].server.port(),
        &["cluster", "add-node", "4", &addrs[3].to_string()],
    );
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let refs: Vec<&Node> = nodes.iter().collect();
    eventually("four members agree", || agreed(&refs, &[1, 2, 3, 4]));
    let current = status(&nodes[0]).unwrap()["leader"].as_u64().unwrap();
    let gone = if current == 2 { 3 } else { 2 };
    let asked = nodes.iter().find(|n| n.id != gone).unwrap();
    let removed = cli(
        asked.server.port(),
        &["cluster", "remove-node", &gone.to_string()],
    );
    assert!(
        removed.status.success(),
        "{}",
        String::from_utf8_lossy(&removed.stderr)
    );
    let index = nodes.iter().position(|n| n.id == gone).unwrap();
    nodes.remove(index).server.stop();
    let remaining: Vec<u64> = nodes.iter().map(|n| n.id).collect();
    let refs: Vec<&Node> = nodes.iter().collect();
    eventually("the removed node is gone everywhere", || {
        agreed(&refs, &remaining)
    });

    // All of them restarted together keep the configuration.
    for node in &mut nodes {
        node.server.stop();
    }
    for node in &mut nodes {
        node.server.restart();
    }
    let refs: Vec<&Node> = nodes.iter().collect();
    let (_, back_in) = eventually("the same configuration after a full restart", || {
        agreed(&refs, &remaining)
    });
    eprintln!("full restart agreed again in {back_in:?}");
}

#[test]
fn a_single_node_says_it_is_not_a_cluster() {
    let server = Server::start();
    let out = cli(server.port(), &["cluster", "status"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("single node"), "{err}");
}

fn hlc(version: Option<&HybridLogicalClock>) -> (std::time::SystemTime, u64, String) {
    let version = version.expect("a version (__ts) on the reply");
    (version.timestamp, version.counter, version.node_id.clone())
}

#[test]
fn the_state_store_on_chains_reads_everywhere_and_survives_kill_9_of_a_head() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = formed_cluster(root.path());

    let key = "chain/k1";
    let (placed, _) = eventually("the key's chain", || placement(&nodes[0], key));
    let chain = ids(&placed["chain"]);
    assert_eq!(chain.len(), 3, "{placed}");
    let head = chain[0];
    let others: Vec<u64> = chain[1..].to_vec();
    let port = |id: u64| nodes[id as usize - 1].server.port();
    let (writer_port, reader_ports) = (port(others[0]), [port(head), port(others[1])]);
    let survivor_port = port(others[1]);

    // Writes on chains do not feed notification queues yet: a topic is refused, not created to
    // stay silent.
    let topic = cli(
        writer_port,
        &[
            "topic",
            "create",
            "t",
            "--endpoint",
            "http://127.0.0.1:9/hook",
            "--keys",
            "*",
        ],
    );
    assert!(!topic.status.success());
    let said = String::from_utf8_lossy(&topic.stderr);
    assert!(said.contains("not available on a cluster node"), "{said}");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let written = runtime.block_on(async {
        // SET through a node that is not the head: forwarded, executed at the head, replicated.
        let writer = SdkClient::connect(writer_port, "chain-writer").await;
        let set = writer
            .set(key.as_bytes(), b"v1", SetOptions::default())
            .await;
        assert!(set.response);
        let written = hlc(set.version.as_ref());
        for (i, port) in reader_ports.into_iter().enumerate() {
            let reader = SdkClient::connect(port, &format!("chain-reader-{i}")).await;
            let got = reader.get(key.as_bytes()).await;
            assert_eq!(got.response.as_deref(), Some(b"v1".as_slice()));
            assert_eq!(hlc(got.version.as_ref()), written, "the SET's version");
            reader.shutdown().await;
        }

        // NX and VDEL semantics through the non-head node.
        let nx = SetOptions {
            set_condition: SetCondition::OnlyIfDoesNotExist,
            ..SetOptions::default()
        };
        let other = b"chain/nx";
        assert!(writer.set(other, b"first", nx.clone()).await.response);
        assert!(!writer.set(other, b"second", nx.clone()).await.response);
        assert_eq!(
            writer.vdel(other, b"second").await,
            -1,
            "VDEL of another value"
        );
        assert_eq!(
            writer.get(other).await.response.as_deref(),
            Some(b"first".as_slice())
        );
        assert_eq!(writer.vdel(other, b"first").await, 1);
        assert_eq!(writer.get(other).await.response, None);
        assert!(
            writer.set(other, b"third", nx).await.response,
            "NX after VDEL"
        );
        writer.shutdown().await;
        written
    });

    // kill -9 the head of the key's chain once the write was acknowledged; once the control plane
    // published a view without it, a survivor answers the value with the same version.
    let index = nodes.iter().position(|n| n.id == head).unwrap();
    nodes[index].server.kill9();
    let survivor = nodes.iter().find(|n| n.id == others[1]).unwrap();
    let (new_chain, _) = eventually("a view of the key's chain without the killed head", || {
        let placed = placement(survivor, key)?;
        let chain = ids(&placed["chain"]);
        (!chain.is_empty() && !chain.contains(&head)).then_some(chain)
    });
    eprintln!("chain of {key} after kill -9 of head {head}: {new_chain:?}");
    runtime.block_on(async {
        let reader = SdkClient::connect(survivor_port, "chain-after-kill").await;
        let got = reader.get(key.as_bytes()).await;
        assert_eq!(got.response.as_deref(), Some(b"v1".as_slice()));
        assert_eq!(
            hlc(got.version.as_ref()),
            written,
            "the acknowledged version"
        );
        let other = reader.get(b"chain/nx").await;
        assert_eq!(other.response.as_deref(), Some(b"third".as_slice()));
        reader.shutdown().await;
    });
}

/// Writes `<name>.pem`, `<name>.key` (a node certificate `ca` signs) and `<name>-ca.pem` (the CA it
/// trusts: `ca`) into `dir`; returns the serve flags that use them.
fn node_flags(ca: &Ca, dir: &Path, name: &str) -> Vec<String> {
    let leaf = ca.node_leaf(name);
    let write = |file: &str, text: &str| {
        let path = dir.join(file);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    vec![
        "--cluster-tls-cert".into(),
        write(&format!("{name}.pem"), &leaf.pem),
        "--cluster-tls-key".into(),
        write(&format!("{name}.key"), &leaf.key_pem),
        "--cluster-tls-ca".into(),
        write(&format!("{name}-ca.pem"), &ca.pem),
    ]
}

#[test]
fn nodes_with_mutual_tls_form_a_cluster_that_a_node_of_another_ca_cannot_join() {
    let root = tempfile::tempdir().unwrap();
    let cluster_ca = Ca::new("mqstate cluster CA");
    let other_ca = Ca::new("another CA");
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let peers = format!("1={},2={},3={}", addrs[0], addrs[1], addrs[2]);
    let mut nodes = Vec::new();
    for (i, &addr) in addrs.iter().enumerate() {
        let id = i as u64 + 1;
        // Node 3 is a listed founder, but its certificate is from another CA.
        let ca = if id == 3 { &other_ca } else { &cluster_ca };
        let tls = node_flags(ca, root.path(), &format!("node{id}"));
        let mut membership: Vec<&str> = vec!["--peers", &peers];
        membership.extend(tls.iter().map(String::as_str));
        nodes.push(start_node(root.path(), id, addr, &membership));
    }
    // Nodes 1 and 2 are a majority of the three: they form the cluster over mutual TLS, and
    // see node 3 as a member that is down.
    let (leader, took) = eventually("nodes 1 and 2 agree, node 3 down", || {
        let s1 = status(&nodes[0])?;
        let s2 = status(&nodes[1])?;
        let leader = s1["leader"].as_u64()?;
        (s2["leader"].as_u64() == Some(leader)
            && member_state(&s1, 3).as_deref() == Some("down")
            && member_state(&s2, 3).as_deref() == Some("down"))
        .then_some(leader)
    });
    assert!(leader == 1 || leader == 2, "leader {leader}");
    println!("mutual TLS: two of three nodes formed the cluster in {took:?}");
    // Node 3 never got in: no leader, no partition map.
    let s3 = status(&nodes[2]).expect("node 3 answers cluster status");
    assert_eq!(s3["leader"], Value::Null, "{s3}");
    assert_eq!(s3["partitions"].as_array().map(Vec::len), Some(0), "{s3}");
    for node in &mut nodes {
        node.server.stop();
    }
}

#[test]
fn plain_node_traffic_beyond_loopback_is_refused_at_start() {
    let listen = format!("0.0.0.0:{}", free_addr().port());
    let peers = format!("1={listen}");
    let (stderr, status) = common::serve_stderr(
        &[
            "--node-id",
            "1",
            "--cluster-listen",
            &listen,
            "--peers",
            &peers,
        ],
        &[],
        "cluster node started",
    );
    assert!(
        status.is_some_and(|s| !s.success()),
        "started anyway: {stderr}"
    );
    assert!(
        stderr.contains("cluster_tls_cert") && stderr.contains("cluster_plaintext"),
        "{stderr}"
    );
}
