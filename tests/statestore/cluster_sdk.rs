//! The official AIO SDK against each node of a 3-node cluster (the state store on chains, issue
//! 15): what the single-node SDK tests check — every command, conditions, fencing tokens, expiry
//! with its DELETE notification, KEYNOTIFY, the leased lock — passes through every node, with
//! the observer and the writer on different nodes; SCAN pages over every partition; a retried
//! request gets its first reply through another node.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use azure_iot_operations_services::leased_lock::{self, lease, lock};
use azure_iot_operations_services::state_store::{
    Operation, ServiceError, SetCondition, SetOptions,
};
use bytes::Bytes;
use common::cluster::{eventually, formed_cluster, ids, placement};
use common::sdk::{
    bounded, hlc_order, next_notification, service_error, token_at, with_condition, within,
    SdkClient, REQUEST_TIMEOUT,
};
use common::state::{hlc_now, parse_scan, StateClient};

/// A hang guard for the whole test, not a performance claim: three processes on a loaded machine.
const TEST_BOUND: Duration = Duration::from_secs(300);

fn key(node: u64, name: &str) -> Vec<u8> {
    format!("n{node}/{name}").into_bytes()
}

/// SET/GET/DEL/VDEL and the SET conditions through the client's node.
async fn commands(c: &SdkClient, node: u64) {
    let k = key(node, "k");
    let set = c.set(&k, b"v", SetOptions::default()).await;
    assert!(set.response);
    let got = c.get(&k).await;
    assert_eq!(got.response.as_deref(), Some(&b"v"[..]));
    assert_eq!(got.version, set.version, "GET answers the SET's version");
    let again = c.set(&k, b"v2", SetOptions::default()).await;
    assert!(hlc_order(again.version.as_ref().unwrap()) > hlc_order(set.version.as_ref().unwrap()));
    assert!(
        !c.set(&k, b"x", with_condition(SetCondition::OnlyIfDoesNotExist))
            .await
            .response
    );
    assert!(
        c.set(
            &k,
            b"v2",
            with_condition(SetCondition::OnlyIfEqualOrDoesNotExist)
        )
        .await
        .response
    );
    assert!(
        !c.set(
            &k,
            b"x",
            with_condition(SetCondition::OnlyIfEqualOrDoesNotExist)
        )
        .await
        .response
    );
    assert_eq!(c.vdel(&k, b"other").await, -1);
    assert_eq!(c.vdel(&k, b"v2").await, 1);
    assert_eq!(c.get(&k).await.response, None);
    assert_eq!(c.del(&k, None).await.unwrap().response, 0);
    assert!(
        c.set(&k, b"n", with_condition(SetCondition::OnlyIfDoesNotExist))
            .await
            .response
    );
    assert_eq!(c.del(&k, None).await.unwrap().response, 1);
}

/// A fenced key through the client's node: lower tokens refused, a delete needs the token.
async fn fencing(c: &SdkClient, node: u64) {
    let k = key(node, "fenced");
    let t1 = token_at(1_000, 0);
    let t2 = token_at(2_000, 0);
    assert!(
        c.set_fenced(&k, b"a", Some(t2.clone()), SetOptions::default())
            .await
            .unwrap()
            .response
    );
    let err = c
        .set_fenced(&k, b"b", Some(t1), SetOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
        "{err:?}"
    );
    let err = c.del(&k, None).await.unwrap_err();
    assert!(
        matches!(service_error(&err), ServiceError::MissingFencingToken),
        "{err:?}"
    );
    assert_eq!(c.del(&k, Some(t2)).await.unwrap().response, 1);
}

/// The observer on one node, the writer on another: every change once, in order, with its
/// version; the expiry delete too.
async fn notifications(observer: &SdkClient, writer: &SdkClient, node: u64) {
    let k = key(node, "watched");
    let mut observation = observer.observe(&k).await;
    let set = writer.set(&k, b"v1", SetOptions::default()).await;
    let n = next_notification(&mut observation).await;
    assert_eq!(n.key, k);
    assert_eq!(n.operation, Operation::Set(b"v1".to_vec()));
    assert_eq!(Some(&n.version), set.version.as_ref());
    // Not applied: nothing notified.
    assert!(
        !writer
            .set(&k, b"x", with_condition(SetCondition::OnlyIfDoesNotExist))
            .await
            .response
    );
    assert_eq!(writer.del(&k, None).await.unwrap().response, 1);
    assert_eq!(
        next_notification(&mut observation).await.operation,
        Operation::Del
    );
    // The observer's own write, through its node.
    let own = observer.set(&k, b"v2", SetOptions::default()).await;
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Set(b"v2".to_vec()));
    assert_eq!(Some(&n.version), own.version.as_ref());
    // Expiry at the partition's head, through the chain: a DELETE with a newer version. No reads
    // meanwhile: only the expiry can delete it.
    let expiring = SetOptions {
        expires: Some(Duration::from_millis(300)),
        ..SetOptions::default()
    };
    let set = writer.set(&k, b"v3", expiring).await;
    assert_eq!(
        next_notification(&mut observation).await.operation,
        Operation::Set(b"v3".to_vec())
    );
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Del, "the expiry's DELETE");
    assert!(hlc_order(&n.version) > hlc_order(set.version.as_ref().unwrap()));
    assert_eq!(writer.get(&k).await.response, None);
    // The last change, so that any doubled or reordered notification before it would have shown.
    writer.set(&k, b"end", SetOptions::default()).await;
    assert_eq!(
        next_notification(&mut observation).await.operation,
        Operation::Set(b"end".to_vec())
    );
    let stopped = within(
        "unobserve",
        observer.store.unobserve(k.clone(), REQUEST_TIMEOUT),
    )
    .await
    .unwrap();
    assert!(stopped.response);
}

/// The leased lock with the holders on different nodes: B waits (observing the lock's key on its
/// node) while A, on another node, holds it, writes fenced and releases.
async fn locks(a: &SdkClient, b: &SdkClient, node: u64) {
    let name = key(node, "lock");
    let resource = key(node, "resource");
    let lock_a =
        lock::Client::new(a.store.clone(), name.clone(), a.id.as_bytes().to_vec()).unwrap();
    let lock_b =
        lock::Client::new(b.store.clone(), name.clone(), b.id.as_bytes().to_vec()).unwrap();
    let token_a = within(
        "lock A",
        lock_a.lock(Duration::from_secs(10), REQUEST_TIMEOUT, None),
    )
    .await
    .unwrap();
    let probe =
        lease::Client::new(b.store.clone(), name.clone(), b.id.as_bytes().to_vec()).unwrap();
    let err = within(
        "probe",
        probe.acquire(Duration::from_secs(10), REQUEST_TIMEOUT, None),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err.kind(), leased_lock::ErrorKind::LeaseAlreadyHeld),
        "{err:?}"
    );
    let waiter = tokio::spawn(async move {
        let token = lock_b
            .lock(Duration::from_secs(10), REQUEST_TIMEOUT, None)
            .await;
        (lock_b, token)
    });
    let renewed = within(
        "renew A",
        lock_a.lock(Duration::from_secs(10), REQUEST_TIMEOUT, None),
    )
    .await
    .unwrap();
    assert!(
        hlc_order(&renewed) > hlc_order(&token_a),
        "a renewal's token is newer"
    );
    assert!(
        a.set_fenced(
            &resource,
            b"from-a",
            Some(renewed.clone()),
            SetOptions::default()
        )
        .await
        .unwrap()
        .response
    );
    let err = a
        .set_fenced(&resource, b"stale", Some(token_a), SetOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
        "{err:?}"
    );
    within("unlock A", lock_a.unlock(REQUEST_TIMEOUT))
        .await
        .unwrap();
    let (lock_b, token_b) = within("B acquires after A released", waiter).await.unwrap();
    let token_b = token_b.unwrap();
    assert!(hlc_order(&token_b) > hlc_order(&renewed));
    assert!(
        b.set_fenced(&resource, b"from-b", Some(token_b), SetOptions::default())
            .await
            .unwrap()
            .response
    );
    within("unlock B", lock_b.unlock(REQUEST_TIMEOUT))
        .await
        .unwrap();
    assert_eq!(a.get(&name).await.response, None);
    assert_eq!(
        a.get(&resource).await.response.as_deref(),
        Some(&b"from-b"[..])
    );
}

/// SCAN through the node at `addr`: every page, each key once, in order.
async fn scan_all(addr: SocketAddr, id: &str, glob: &[u8]) -> Vec<Vec<u8>> {
    let mut wire = StateClient::connect(addr, id).await;
    let mut keys = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    for _ in 0..100 {
        let reply = match &token {
            None => wire.request(&[b"SCAN", glob]).await,
            Some(t) => wire.request(&[b"SCAN", glob, t]).await,
        };
        let (page, next) = parse_scan(&reply);
        keys.extend(page);
        match next {
            Some(t) => token = Some(t),
            None => return keys,
        }
    }
    panic!("SCAN did not end within 100 pages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_state_store_through_every_node_of_three() {
    let root = tempfile::tempdir().unwrap();
    let nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    bounded(TEST_BOUND, async {
        let clients: Vec<SdkClient> = {
            let mut clients = Vec::new();
            for node in &nodes {
                clients.push(
                    SdkClient::connect(node.server.port(), &format!("cl-sdk-{}", node.id)).await,
                );
            }
            clients
        };
        for (i, node) in nodes.iter().enumerate() {
            let here = &clients[i];
            let next = &clients[(i + 1) % clients.len()];
            commands(here, node.id).await;
            fencing(here, node.id).await;
            notifications(here, next, node.id).await;
            locks(here, next, node.id).await;
        }

        // SCAN: keys written through different nodes, spread over the partitions, paged from any
        // node; deleted and expired keys are not answered.
        let mut written = Vec::new();
        for i in 0..150u32 {
            let k = format!("scan/{i:03}").into_bytes();
            let c = &clients[i as usize % clients.len()];
            c.set(&k, b"v", SetOptions::default()).await;
            written.push(k);
        }
        clients[0].del(b"scan/007", None).await.unwrap();
        let expiring = SetOptions {
            expires: Some(Duration::from_millis(1)),
            ..SetOptions::default()
        };
        clients[1].set(b"scan/999", b"gone", expiring).await;
        written.retain(|k| k.as_slice() != b"scan/007");
        for node in &nodes {
            let keys = scan_all(node.server.addr, &format!("cl-scan-{}", node.id), b"scan/*").await;
            assert_eq!(keys, written, "SCAN through node {}", node.id);
        }

        // A retry (same client id, same correlation data) through another node, whose own
        // duplicate cache never saw it (as after a fail-over): the head answers it from the row
        // it made, the first reply, not a second execution.
        let mut first_try = StateClient::connect(nodes[0].server.addr, "cl-retry").await;
        let correlation = Bytes::from_static(b"retry-1");
        let (first, ts) = first_try
            .request_as(&[b"SET", b"retry/k", b"a", b"NX"], &correlation, hlc_now())
            .await;
        assert_eq!(&first[..], b"+OK\r\n");
        let mut retry = StateClient::connect(nodes[1].server.addr, "cl-retry").await;
        let (again, again_ts) = retry
            .request_as(&[b"SET", b"retry/k", b"a", b"NX"], &correlation, hlc_now())
            .await;
        assert_eq!(&again[..], b"+OK\r\n", "the first reply, not NX's -1");
        assert_eq!(again_ts, ts);

        // The same retry after another write replaced the row it made (robustness seeds 7112,
        // 60003: a paused head's front end re-sent its request seconds later): still its first
        // reply, and no second execution over the later write.
        let mut other = StateClient::connect(nodes[1].server.addr, "cl-other").await;
        let (set_b, _) = other
            .request_as(
                &[b"SET", b"retry/k", b"b"],
                &Bytes::from_static(b"other-1"),
                hlc_now(),
            )
            .await;
        assert_eq!(&set_b[..], b"+OK\r\n");
        let mut late = StateClient::connect(nodes[2].server.addr, "cl-retry").await;
        let (late_reply, late_ts) = late
            .request_as(&[b"SET", b"retry/k", b"a", b"NX"], &correlation, hlc_now())
            .await;
        assert_eq!(&late_reply[..], b"+OK\r\n", "the first reply, not NX's -1");
        assert_eq!(late_ts, ts);
        let (value, _) = other
            .request_as(
                &[b"GET", b"retry/k"],
                &Bytes::from_static(b"other-2"),
                hlc_now(),
            )
            .await;
        assert_eq!(&value[..], b"$1\r\nb\r\n", "the later write stands");

        for c in clients {
            c.shutdown().await;
        }
    })
    .await;
}

/// `kill -9` of a key's head: the new head takes over its expiry (the DELETE reaches an observer
/// on another node), and a request retried through another node after the fail-over gets its
/// first reply from the row the old head wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_head_takes_over_expiry_and_answers_retries() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let k = b"failover/k";
    let chain = tokio::task::block_in_place(|| {
        eventually("the key's chain", || {
            placement(&nodes[0], "failover/k").map(|p| ids(&p["chain"]))
        })
        .0
    });
    let head = chain[0];
    let index = |id: u64| nodes.iter().position(|n| n.id == id).unwrap();
    let (a, b) = (index(chain[1]), index(chain[2]));
    let (port_a, port_b) = (nodes[a].server.port(), nodes[b].server.port());
    let (addr_a, addr_b) = (nodes[a].server.addr, nodes[b].server.addr);

    let (observer, writer, mut observation, set, first) = bounded(TEST_BOUND, async {
        let observer = SdkClient::connect(port_a, "fo-observer").await;
        let writer = SdkClient::connect(port_b, "fo-writer").await;
        let mut observation = observer.observe(k).await;
        let expiring = SetOptions {
            expires: Some(Duration::from_secs(3)),
            ..SetOptions::default()
        };
        let set = writer.set(k, b"v", expiring).await;
        assert!(set.response);
        assert_eq!(
            next_notification(&mut observation).await.operation,
            Operation::Set(b"v".to_vec())
        );
        let mut wire = StateClient::connect(addr_a, "fo-retry").await;
        let first = wire
            .request_as(
                &[b"SET", b"failover/k2", b"a", b"NX"],
                &Bytes::from_static(b"fo-1"),
                hlc_now(),
            )
            .await;
        assert_eq!(&first.0[..], b"+OK\r\n");
        (observer, writer, observation, set, first)
    })
    .await;

    let k2_chain = tokio::task::block_in_place(|| {
        eventually("the retried key's chain", || {
            placement(&nodes[a], "failover/k2").map(|p| ids(&p["chain"]))
        })
        .0
    });
    let killed = index(head);
    nodes[killed].server.kill9();
    tokio::task::block_in_place(|| {
        eventually("a view of the key's chain without the killed head", || {
            let chain = placement(&nodes[a], "failover/k").map(|p| ids(&p["chain"]))?;
            (!chain.is_empty() && !chain.contains(&head)).then_some(())
        })
    });

    bounded(TEST_BOUND, async move {
        // The expiry's DELETE, from the new head (the old one is gone), to the observer's node.
        let n = tokio::time::timeout(
            common::cluster::AGREEMENT_TIMEOUT,
            observation.recv_notification(),
        )
        .await
        .expect("the expiry's DELETE after the fail-over")
        .expect("notification channel open")
        .0;
        assert_eq!(n.operation, Operation::Del);
        assert!(hlc_order(&n.version) > hlc_order(set.version.as_ref().unwrap()));
        assert_eq!(writer.get(k).await.response, None);

        // The retry through the other survivor: the first reply, not NX's -1. Its key's head
        // may have been the killed node too (then this is the new head's duplicate check).
        eprintln!("failover/k2 chain before the kill: {k2_chain:?}, killed {head}");
        let mut retry = StateClient::connect(addr_b, "fo-retry").await;
        let again = retry
            .request_as(
                &[b"SET", b"failover/k2", b"a", b"NX"],
                &Bytes::from_static(b"fo-1"),
                hlc_now(),
            )
            .await;
        assert_eq!(again, first, "the first reply and its __ts");
        observer.shutdown().await;
        writer.shutdown().await;
    })
    .await;
}
