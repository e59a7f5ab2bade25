//! Crashes at the chain protocol's failpoints (`crates/replication/src/failpoint.rs`), armed with
//! `MQSTATE_FAILPOINT=<name>@<marker>` on every node and fired on one by creating its marker: after
//! phase 1 on the head only, between phase 1 at the tail and phase 2, in the middle of a recovery
//! copy. After the crashed node restarts and is back in every read view, no acknowledged write is
//! lost and the interrupted write either completed or was never acknowledged.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::SetOptions;
use common::cluster::{chain_of, eventually, settled, start_founders_with, Node};
use common::free_addr;
use common::sdk::{SdkClient, REQUEST_TIMEOUT};

type Version = (std::time::SystemTime, u64, String);

fn version(v: Option<&HybridLogicalClock>) -> Version {
    let v = v.expect("a version (__ts)");
    (v.timestamp, v.counter, v.node_id.clone())
}

fn marker(root: &Path, id: u64) -> PathBuf {
    root.join(format!("n{id}.armed"))
}

/// Three founders, each armed at `failpoint` once its marker file exists.
fn founders(root: &Path, failpoint: &str) -> Vec<Node> {
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    start_founders_with(root, &addrs, &[], |id| {
        let spec = format!("{failpoint}@{}", marker(root, id).display());
        vec![("MQSTATE_FAILPOINT".to_owned(), spec)]
    })
}

/// Waits (bounded) until `node` stopped accepting connections: it crashed at the failpoint.
fn crashed(node: &mut Node) {
    let started = Instant::now();
    while TcpStream::connect_timeout(&node.server.addr, Duration::from_millis(200)).is_ok() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "node {} did not crash at its failpoint",
            node.id
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = node.server.wait_exit();
    assert!(
        !status.success(),
        "node {} exited by itself: {status}",
        node.id
    );
}

/// `mqstate data inspect`, given the crashed node's chain log directory itself, shows it as a
/// chain log: the key's rows, and the rows of the writer's session (a sessions replica) decoded as
/// sessions. Read as a state-store log, each record would be flagged undecodable.
fn inspect_chain_log(data_dir: &Path, key: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["data", "inspect"])
        .arg(data_dir.join("chains"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "inspect: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(shown.starts_with("\nchain log: "), "{shown}");
    assert!(
        shown.contains(&format!("row \"{key}\" version ")),
        "{shown}"
    );
    assert!(!shown.contains("UNDECODABLE"), "{shown}");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The key holds `acked` (value, version) if the interrupted write was never acknowledged and
/// `interrupted` is `None`; with `interrupted` acknowledged, exactly it; unacknowledged, either.
fn check_key(
    runtime: &tokio::runtime::Runtime,
    ports: &[u16],
    key: &[u8],
    before: &(Vec<u8>, Version),
    attempted: &[u8],
    interrupted: Option<Version>,
) {
    runtime.block_on(async {
        for (n, &port) in ports.iter().enumerate() {
            let reader = SdkClient::connect(port, &format!("fp-reader-{n}")).await;
            let got = reader.get(key).await;
            let value = got.response.expect("the key is there");
            let read = version(got.version.as_ref());
            match &interrupted {
                Some(acked) => {
                    assert_eq!(value, attempted, "the acknowledged write");
                    assert_eq!(&read, acked, "its version");
                }
                None if value == before.0 => {
                    assert_eq!(read, before.1, "the earlier write's version")
                }
                None => assert_eq!(value, attempted, "the interrupted write, completed"),
            }
            assert!(read >= before.1, "the version went backwards");
            reader.shutdown().await;
        }
    });
}

/// Crashes the node at `position` of a key's chain while it carries a SET sent through `via`,
/// restarts it, and checks the key.
fn crash_during_a_write(failpoint: &str, position: usize, via: usize) {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = founders(root.path(), failpoint);
    let ports: Vec<u16> = nodes.iter().map(|n| n.server.port()).collect();
    eventually("three nodes settle", || settled(&ports, 3));
    let key = "fp/key";
    let (chain, _) = eventually("the key's chain", || {
        chain_of(ports[0], key).filter(|c| c.len() == 3)
    });
    let victim = chain[position];
    let port_of = |id: u64| ports[id as usize - 1];
    let runtime = runtime();
    let client = runtime.block_on(SdkClient::connect(port_of(chain[via]), "fp-writer"));
    let first = runtime.block_on(client.set(key.as_bytes(), b"v1", SetOptions::default()));
    assert!(first.response);
    let before = (b"v1".to_vec(), version(first.version.as_ref()));

    std::fs::write(marker(root.path(), victim), b"").unwrap();
    let store = client.store.clone();
    let interrupted = runtime.spawn(async move {
        store
            .set(
                key.as_bytes().to_vec(),
                b"v2".to_vec(),
                REQUEST_TIMEOUT,
                None,
                SetOptions::default(),
            )
            .await
    });
    let index = nodes.iter().position(|n| n.id == victim).unwrap();
    crashed(&mut nodes[index]);
    eprintln!("{failpoint}: node {victim} (position {position} of {chain:?}) crashed");
    let outcome = runtime.block_on(interrupted).unwrap();
    let acked = match outcome {
        Ok(reply) if reply.response => Some(version(reply.version.as_ref())),
        other => {
            eprintln!("{failpoint}: the interrupted SET was not acknowledged: {other:?}");
            None
        }
    };
    runtime.block_on(client.shutdown());
    inspect_chain_log(nodes[index].server.data_dir(), key);
    std::fs::remove_file(marker(root.path(), victim)).unwrap();
    nodes[index].server.restart();
    eventually("the crashed node is back in every read view", || {
        settled(&ports, 3)
    });
    check_key(&runtime, &ports, key.as_bytes(), &before, b"v2", acked);
}

#[test]
fn a_head_crashing_after_phase_1_loses_no_acknowledged_write() {
    crash_during_a_write(
        mqstate_replication::failpoint::CHAIN_HEAD_AFTER_PREPARE,
        0,
        1,
    );
}

#[test]
fn a_tail_crashing_between_phase_1_and_phase_2_loses_no_acknowledged_write() {
    crash_during_a_write(
        mqstate_replication::failpoint::CHAIN_TAIL_BEFORE_COMMIT,
        2,
        0,
    );
}

#[test]
fn a_replica_crashing_in_the_middle_of_its_recovery_copy_catches_up_after_restart() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = founders(root.path(), mqstate_replication::failpoint::CHAIN_MID_COPY);
    let ports: Vec<u16> = nodes.iter().map(|n| n.server.port()).collect();
    eventually("three nodes settle", || settled(&ports, 3));
    let runtime = runtime();
    // Node 3 misses writes, then is copied when it comes back.
    nodes[2].server.kill9();
    let written: Vec<(String, Version)> = runtime.block_on(async {
        let client = SdkClient::connect(ports[0], "fp-copy-writer").await;
        let mut written = Vec::new();
        for i in 0..40 {
            let key = format!("fp/copy/{i}");
            let set = client
                .set(key.as_bytes(), key.as_bytes(), SetOptions::default())
                .await;
            assert!(set.response);
            written.push((key, version(set.version.as_ref())));
        }
        client.shutdown().await;
        written
    });
    std::fs::write(marker(root.path(), 3), b"").unwrap();
    nodes[2].server.restart();
    crashed(&mut nodes[2]);
    eprintln!("chain-mid-copy: node 3 crashed while being copied");
    std::fs::remove_file(marker(root.path(), 3)).unwrap();
    nodes[2].server.restart();
    eventually("node 3 copied and back in every read view", || {
        settled(&ports, 3)
    });
    runtime.block_on(async {
        for (n, &port) in ports.iter().enumerate() {
            let reader = SdkClient::connect(port, &format!("fp-copy-reader-{n}")).await;
            for (key, acked) in &written {
                let got = reader.get(key.as_bytes()).await;
                assert_eq!(got.response.as_deref(), Some(key.as_bytes()), "{key}");
                assert_eq!(&version(got.version.as_ref()), acked, "{key}");
            }
            reader.shutdown().await;
        }
    });
}
