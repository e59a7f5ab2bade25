//! KEYNOTIFY observers with persistent sessions on a cluster (issue 16, decision 0054): a
//! client's registrations are kept with its replicated session, so they follow it to another
//! node — when it moves, and when its node is killed — without registering again; changes made
//! while it was away from a live node are queued in its session like any QoS 1 message.
//!
//! The observer is a plain MQTT 5 client (rumqttc) so the test sees exactly what the server
//! sends: the official SDKs drop their observations when their connection drops and observe
//! again (`cluster_failover` covers that path).

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::cluster::{formed_cluster, AGREEMENT_TIMEOUT};
use common::state::{set_note, StateClient, OK};

/// A hang guard for the whole test, not a performance claim: three processes on a loaded machine.
const TEST_BOUND: Duration = Duration::from_secs(300);

/// A state-store client with a persistent session (clean start off, an hour's expiry) on `addr`,
/// connecting again while the cluster fails over (bounded).
async fn connect_observer(addr: SocketAddr, id: &str) -> StateClient {
    let started = Instant::now();
    loop {
        match StateClient::try_connect_persistent(addr, id).await {
            Ok(observer) => return observer,
            Err(e) => {
                assert!(
                    started.elapsed() < AGREEMENT_TIMEOUT,
                    "{id} could not connect to {addr}: {e}"
                );
                eprintln!("{id}: connect to {addr} failed ({e}); again");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// The payload of the observer's next notification.
async fn next_note(observer: &mut StateClient, seen: &mut Vec<Bytes>) -> Bytes {
    loop {
        let note = observer.next_notification(AGREEMENT_TIMEOUT).await.payload;
        // QoS 1 is at least once: a notification the dead node had sent, but whose send it had
        // not yet written to the session's row, goes out again from the session's new node —
        // without DUP, since the row says "queued". A payload seen before is that redelivery
        // (every value this test writes is distinct).
        if seen.contains(&note) {
            eprintln!("a notification delivered again after a move: {note:?}");
            continue;
        }
        seen.push(note.clone());
        return note;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_keep_their_registrations_across_nodes_and_node_death() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let (n1, n2, n3) = (
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    );
    let key: &[u8] = b"obs/k";
    tokio::time::timeout(TEST_BOUND, async {
        let mut seen = Vec::new();
        let mut writer = StateClient::connect(n3, "obs-writer").await;

        // Registered on node 2, notified of a write through node 3.
        let mut observer = connect_observer(n2, "obs-1").await;
        assert!(!observer.session_present);
        assert_eq!(&observer.request(&[b"KEYNOTIFY", key]).await[..], OK);
        assert_eq!(&writer.request(&[b"SET", key, b"a"]).await[..], OK);
        assert_eq!(next_note(&mut observer, &mut seen).await, set_note(b"a"));

        // Away from a live node: the change is queued in its session, and the registration
        // moves with the session to node 1.
        observer.disconnect().await;
        assert_eq!(&writer.request(&[b"SET", key, b"b"]).await[..], OK);
        let mut observer = connect_observer(n1, "obs-1").await;
        assert!(observer.session_present, "the session moved to node 1");
        assert_eq!(
            next_note(&mut observer, &mut seen).await,
            set_note(b"b"),
            "the change made while it was away"
        );
        assert_eq!(&writer.request(&[b"SET", key, b"c"]).await[..], OK);
        assert_eq!(
            next_note(&mut observer, &mut seen).await,
            set_note(b"c"),
            "registered on node 1 without a KEYNOTIFY there"
        );

        // Its node dies: it reconnects to node 2, registered there, and writes through node 3
        // reach it.
        nodes[0].server.kill9();
        drop(observer);
        let mut observer = connect_observer(n2, "obs-1").await;
        assert!(observer.session_present, "the session survived node 1");
        assert_eq!(&writer.request(&[b"SET", key, b"d"]).await[..], OK);
        assert_eq!(
            next_note(&mut observer, &mut seen).await,
            set_note(b"d"),
            "registered on node 2 without a KEYNOTIFY there"
        );
        // The registration still ends with KEYNOTIFY STOP.
        assert_eq!(
            &observer.request(&[b"KEYNOTIFY", key, b"STOP"]).await[..],
            OK
        );
        assert_eq!(&writer.request(&[b"SET", key, b"e"]).await[..], OK);
        assert_eq!(&observer.request(&[b"GET", key]).await[..], b"$1\r\ne\r\n");
        while let Some(extra) = observer.received_notification() {
            if seen.contains(&extra.payload) {
                continue;
            }
            panic!(
                "a notification after KEYNOTIFY STOP: {:?} {:?}",
                extra.payload, extra.properties
            );
        }
    })
    .await
    .expect("test exceeded its time bound");
}
