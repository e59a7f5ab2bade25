//! A retried request is never run twice (issue #15, decision 0050): across a restart from a
//! compacted chain log (one node, a chain of one, its data plane stopped and started again on the
//! same chain log, as a restarted process's is), and across a change of head after a request that
//! wrote no row (three nodes, one chain). Over the in-memory transport.

use std::path::Path;
use std::sync::Arc;

use mqstate_clock::SharedClock;
use mqstate_cluster::sim::{eventually, mem_addr as addr, mem_node, quick_config};
use mqstate_cluster::transport::mem::MemNetwork;
use mqstate_cluster::ClusterNode;
use mqstate_protocol::{encode_request, RequestLimits};
use mqstate_replication::head::{HeadConfig, KeyReply, KeyRequest};
use mqstate_replication::log::ChainLog;
use mqstate_replication::wire::Routed;
use mqstate_replication::{Replication, Running};
use mqstate_store::StoreConfig;
use mqstate_wal::WalOptions;

/// The data plane of `node` on the chain log in `dir`; compacted after every turn that logged
/// anything when `compact`.
fn start(node: &Arc<ClusterNode>, dir: &Path, clock: &SharedClock, compact: bool) -> Running {
    let (log, restored) =
        ChainLog::open(dir, WalOptions::default(), clock.now_ms()).expect("the chain log opens");
    let log = if compact { log.snapshot_every(1) } else { log };
    let head = HeadConfig {
        store: StoreConfig {
            node_id: "mqstate".into(),
            limits: Default::default(),
        },
        limits: RequestLimits::default(),
        node: 1,
    };
    Replication::start(Arc::clone(node), log, restored, head, Arc::clone(clock))
}

/// A request of `client` with correlation data `correlation`, sent now and valid for a minute.
fn request(client: &str, correlation: &[u8], args: &[&str]) -> KeyRequest {
    let now_ms = mqstate_clock::system().now_ms();
    let routed = Routed {
        client_id: client.into(),
        correlation: correlation.to_vec(),
        key: args[1].as_bytes().to_vec(),
        payload: encode_request(args).to_vec(),
        ts: Some(format!("{now_ms}:0:{client}")),
        fencing_token: None,
        expiry_ms: 60_000,
        deadline_ms: 0,
    };
    KeyRequest::from_wire(routed, &RequestLimits::default()).expect("a valid request")
}

async fn execute(running: &Running, request: KeyRequest) -> KeyReply {
    running.replication.execute(request).await
}

/// A write's row replaced by another client's write, then folded into a snapshot of the chain log
/// that holds only each key's last row: after a restart, a retry of the first write got executed
/// again and overwrote the other client's value. The snapshot now carries the remembered requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_restart_from_a_snapshot_gets_its_first_reply() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let net = MemNetwork::new();
    let founders = [(1, addr(1))].into();
    let config = quick_config(1, addr(1), founders, root.path().join("cluster"), 2);
    let node = Arc::new(mem_node(&net, config).await);
    let clock = mqstate_clock::system();
    let data = root.path().join("data");

    // No snapshot yet: both rows are in the log.
    let running = start(&node, &data, &clock, false);
    let from_a = request("a", b"1", &["SET", "k", "from-a"]);
    let first = execute(&running, from_a.clone()).await;
    assert_eq!(&first.payload[..], b"+OK\r\n", "{first:?}");
    let other = execute(&running, request("b", b"1", &["SET", "k", "from-b"])).await;
    assert_eq!(&other.payload[..], b"+OK\r\n", "{other:?}");
    running.stop().await;

    // Started again with compaction: the next write's turn snapshots everything logged so far
    // (both rows above, of which the snapshot keeps b's), and stopping waits for the snapshot.
    let running = start(&node, &data, &clock, true);
    let unrelated = execute(&running, request("c", b"1", &["SET", "j", "v"])).await;
    assert_eq!(&unrelated.payload[..], b"+OK\r\n", "{unrelated:?}");
    running.stop().await;
    assert!(
        data.join("chains").join("mqstate.snapshot").exists(),
        "the chain log was snapshotted"
    );

    // a's retry after the restart: its first reply, and b's value stays.
    let running = start(&node, &data, &clock, false);
    let retry = execute(&running, from_a).await;
    assert_eq!(retry, first, "a retry gets its first reply (its __ts too)");
    let read = execute(&running, request("r", b"1", &["GET", "k"])).await;
    assert_eq!(
        &read.payload[..],
        b"$6\r\nfrom-b\r\n",
        "a's retry must not run again over b's write"
    );
    running.stop().await;
}

/// A request answered without a row (a SET NX that found the key) by head A, then A cut off and
/// replaced by B, and the key deleted: a late copy of the request reaching B ran there and set the
/// key, since only A knew the request. The head now answers only once the request's note is
/// on every member of the chain (decision 0050, its last amendment); B gives the first reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_a_request_that_wrote_nothing_does_not_run_at_the_next_head() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let net = MemNetwork::new();
    let founders: std::collections::BTreeMap<u64, String> =
        [1, 2, 3].map(|id| (id, addr(id))).into();
    let clock = mqstate_clock::system();
    let mut nodes = Vec::new();
    for id in 1..=3 {
        let dir = root.path().join(format!("n{id}"));
        let config = quick_config(id, addr(id), founders.clone(), dir.join("cluster"), 1);
        nodes.push(Arc::new(mem_node(&net, config).await));
    }
    let chain_of_three = || {
        nodes[0]
            .partition(0)
            .is_some_and(|p| p.chain.len() == 3 && p.read_view.len() == 3)
    };
    eventually("partition 0 on a chain of three", chain_of_three).await;
    let mut running = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let dir = root.path().join(format!("n{}", i + 1)).join("data");
        running.push(start(node, &dir, &clock, false));
    }
    let head = |node: &ClusterNode| {
        let p = node.partition(0)?;
        p.chain.into_iter().find(|n| p.read_view.contains(n))
    };
    let a = head(&nodes[0]).expect("partition 0 has a head");
    let a_index = usize::try_from(a - 1).expect("a node id");

    let set = execute(&running[a_index], request("x", b"1", &["SET", "k", "v"])).await;
    assert_eq!(&set.payload[..], b"+OK\r\n", "{set:?}");
    let from_b = request("b", b"1", &["SET", "k", "w", "NX"]);
    let first = execute(&running[a_index], from_b.clone()).await;
    assert_eq!(&first.payload[..], b":-1\r\n", "the key is set: {first:?}");

    // A is cut off; the chain goes on without it.
    for other in (1..=3).filter(|&n| n != a) {
        net.cut(&addr(a), &addr(other));
    }
    let b_index = (0..3).find(|&i| i != a_index).expect("another node");
    let b_node = Arc::clone(&nodes[b_index]);
    eventually("a new head", || head(&b_node).is_some_and(|h| h != a)).await;
    let b = head(&b_node).expect("a head");
    let b_index = usize::try_from(b - 1).expect("a node id");
    let del = execute(&running[b_index], request("x", b"2", &["DEL", "k"])).await;
    assert_eq!(&del.payload[..], b":1\r\n", "{del:?}");

    // The late copy of b's SET NX, at the new head: its first reply, and the key stays deleted.
    let late = execute(&running[b_index], from_b).await;
    assert_eq!(late, first, "the late copy gets the first reply");
    let read = execute(&running[b_index], request("r", b"1", &["GET", "k"])).await;
    assert_eq!(
        &read.payload[..],
        b"$-1\r\n",
        "the late copy must not run again and set the key"
    );
    for r in running {
        r.stop().await;
    }
}
