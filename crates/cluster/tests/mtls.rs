//! Mutual TLS between nodes, with certificates made here: real nodes on loopback TCP. Two nodes
//! whose certificates the cluster CA signed form the cluster; a third, listed as a founder but
//! holding a certificate from another CA, cannot talk to them either way, nor can a node without
//! TLS, and each refusal is logged naming the peer.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mqstate_cluster::sim::{eventually, quick_config, state_of};
use mqstate_cluster::transport::socket::TokioTcp;
use mqstate_cluster::transport::tcp::{serve_with, TcpTransport};
use mqstate_cluster::transport::tls::NodeTls;
use mqstate_cluster::transport::{Request, Response, Transport, TransportError};
use mqstate_cluster::{ClusterNode, NodeId};
use mqstate_testcerts::Ca;
use tokio::net::TcpListener;

/// A node's TLS: a certificate for 127.0.0.1 (server and client use) `ca` signed, trusting
/// `trusted`.
fn node_tls(ca: &Ca, node: NodeId, trusted: &Ca) -> NodeTls {
    let leaf = ca.node_leaf(&format!("mqstate node {node}"));
    NodeTls::new(
        vec![leaf.der.clone()],
        leaf.key(),
        vec![trusted.der.clone()],
    )
    .unwrap()
}

/// Log lines, for the assertions on what a refusal says.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

async fn start(
    root: &Path,
    id: NodeId,
    listener: TcpListener,
    peers: &BTreeMap<NodeId, String>,
    tls: NodeTls,
) -> ClusterNode {
    let dir = root.join(format!("n{id}"));
    let config = quick_config(id, peers[&id].clone(), peers.clone(), dir, 4);
    let transport = TcpTransport::over(Arc::new(TokioTcp), Some(tls.clone()));
    let node = ClusterNode::start(config, Arc::new(transport))
        .await
        .expect("node starts");
    tokio::spawn(serve_with(
        listener,
        Some(tls),
        node.handler(),
        std::future::pending(),
    ));
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_certificate_from_another_ca_cannot_join_or_talk() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_env_filter("mqstate_cluster=info")
        .init();

    let cluster_ca = Ca::new("mqstate cluster CA");
    let other_ca = Ca::new("someone else's CA");
    let dir = tempfile::tempdir().unwrap();
    let mut listeners = BTreeMap::new();
    for id in [1, 2, 3] {
        listeners.insert(id, TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let peers: BTreeMap<NodeId, String> = listeners
        .iter()
        .map(|(&id, l)| (id, l.local_addr().unwrap().to_string()))
        .collect();
    let mut listeners = listeners.into_iter();
    let (_, l1) = listeners.next().unwrap();
    let (_, l2) = listeners.next().unwrap();
    let (_, l3) = listeners.next().unwrap();
    // Node 3 is listed as a founder but its certificate (and the CA it trusts) is another's.
    let intruder_tls = node_tls(&other_ca, 3, &other_ca);
    let n1 = start(
        dir.path(),
        1,
        l1,
        &peers,
        node_tls(&cluster_ca, 1, &cluster_ca),
    )
    .await;
    let n2 = start(
        dir.path(),
        2,
        l2,
        &peers,
        node_tls(&cluster_ca, 2, &cluster_ca),
    )
    .await;
    let n3 = start(dir.path(), 3, l3, &peers, intruder_tls.clone()).await;

    // The two good nodes are a majority of the three listed: they form the cluster over mTLS,
    // and the third is a member that never renews its lease: down.
    eventually("nodes 1 and 2 agree on a leader, node 3 is down", || {
        let (s1, s2) = (n1.status(), n2.status());
        s1.leader.is_some()
            && s1.leader == s2.leader
            && s1.partition_count == 4
            && state_of(&s1, 3) == Some("down")
            && state_of(&s2, 3) == Some("down")
    })
    .await;
    let leader = n1.status().leader;
    assert!(matches!(leader, Some(1 | 2)), "{leader:?}");

    // Node 3 learnt nothing: no leader, no partition map.
    let s3 = n3.status();
    assert_eq!(s3.leader, None, "{s3:?}");
    assert_eq!(s3.partition_count, 0, "{s3:?}");

    // Either way the handshake fails: the intruder dialling a good node, a good node dialling
    // the intruder, and a node without TLS dialling a good node.
    let ask = |transport: TcpTransport, addr: String| async move {
        transport
            .call(&addr, Request::Hello, Duration::from_secs(5))
            .await
    };
    let intruder = TcpTransport::over(Arc::new(TokioTcp), Some(intruder_tls));
    let err = ask(intruder, peers[&1].clone()).await.unwrap_err();
    assert!(
        matches!(&err, TransportError::Unreachable { reason, .. } if reason.contains("TLS handshake failed")),
        "{err}"
    );
    let good = TcpTransport::over(
        Arc::new(TokioTcp),
        Some(node_tls(&cluster_ca, 9, &cluster_ca)),
    );
    let err = ask(good, peers[&3].clone()).await.unwrap_err();
    assert!(
        matches!(&err, TransportError::Unreachable { reason, .. } if reason.contains("UnknownIssuer")),
        "{err}"
    );
    let plain = TcpTransport::new();
    let answer = ask(plain, peers[&1].clone()).await;
    assert!(answer.is_err(), "a node without TLS got {answer:?}");
    // A certificate from the cluster CA is let in.
    let good = TcpTransport::over(
        Arc::new(TokioTcp),
        Some(node_tls(&cluster_ca, 9, &cluster_ca)),
    );
    let answer = ask(good, peers[&1].clone()).await.unwrap();
    assert!(
        matches!(
            answer,
            Response::Hello {
                node_id: 1,
                initialized: true,
                cluster: Some(_),
            }
        ),
        "{answer:?}"
    );

    // The refusals are logged naming the peer, on both sides.
    let logs = logs.text();
    assert!(
        logs.contains("refusing a cluster connection from 127.0.0.1:")
            && logs.contains("TLS handshake failed"),
        "{logs}"
    );
    assert!(
        logs.contains(&format!("cannot talk to the node at {}", peers[&3])),
        "{logs}"
    );

    for node in [n1, n2, n3] {
        node.shutdown().await;
    }
}
