//! A retried request is never run twice (issue #15, decision 0050) across a restart from a
//! compacted chain log: one node (a chain of one) over the in-memory transport, its data plane
//! stopped and started again on the same chain log, as a restarted process's is.

use std::path::Path;
use std::sync::Arc;

use mqstate_clock::SharedClock;
use mqstate_cluster::sim::{mem_addr as addr, mem_node, quick_config};
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
