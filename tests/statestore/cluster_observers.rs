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
use common::cluster::{agreed, eventually, start_founders, Node, AGREEMENT_TIMEOUT};
use common::free_addr;
use common::state::{hlc_now, request_properties, StateClient, INVOKE_TOPIC, OK, WAIT};
use rumqttc::v5::mqttbytes::v5::{ConnectProperties, Packet, Publish};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use rumqttc::Outgoing;
use tokio::sync::mpsc;

/// A hang guard for the whole test, not a performance claim: three processes on a loaded machine.
const TEST_BOUND: Duration = Duration::from_secs(300);

static CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The payload of a SET notification of `value`.
fn set_note(value: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n${}\r\n",
        value.len()
    )
    .into_bytes();
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
    out
}

/// A state-store client with a persistent session (clean start off, an hour's expiry) that
/// keeps the notifications it receives apart from its replies.
struct Observer {
    client: AsyncClient,
    session_present: bool,
    replies: mpsc::UnboundedReceiver<Publish>,
    notes: mpsc::UnboundedReceiver<Publish>,
    response_topic: String,
    correlation: u64,
}

impl Observer {
    /// Connects to `addr`; `Err` with the reason if the connection ends before CONNACK (a node
    /// still failing over answers 0x88 Server unavailable).
    async fn try_connect(addr: SocketAddr, id: &str) -> Result<Observer, String> {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_keep_alive(Duration::from_secs(30));
        options.set_clean_start(false);
        options.set_connect_properties(ConnectProperties {
            session_expiry_interval: Some(3600),
            ..ConnectProperties::new()
        });
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (reply_tx, replies) = mpsc::unbounded_channel();
        let (note_tx, notes) = mpsc::unbounded_channel();
        let (connected_tx, mut connected) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        let _ = connected_tx.send(Ok(ack.session_present));
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let to = if p.topic.windows(16).any(|w| w == b"/command/notify/") {
                            &note_tx
                        } else {
                            &reply_tx
                        };
                        let _ = to.send(p);
                    }
                    // Left (`leave`): stop here, or rumqttc would connect again.
                    Ok(Event::Outgoing(Outgoing::Disconnect)) => return,
                    Ok(_) => {}
                    Err(e) => {
                        let _ = connected_tx.send(Err(format!("{e:?}")));
                        return;
                    }
                }
            }
        });
        let session_present = tokio::time::timeout(WAIT, connected.recv())
            .await
            .map_err(|_| "no CONNACK in time".to_owned())?
            .ok_or("the event loop ended")??;
        let response_topic = format!("clients/{id}/statestore/response");
        let observer = Observer {
            client,
            session_present,
            replies,
            notes,
            response_topic,
            // Never reused across connections: a request with a client's earlier correlation
            // data is a retry, answered with the earlier reply.
            correlation: CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32,
        };
        if !session_present {
            observer
                .client
                .subscribe(observer.response_topic.clone(), QoS::AtLeastOnce)
                .await
                .unwrap();
        }
        Ok(observer)
    }

    /// Connects, trying again while the cluster fails over (bounded).
    async fn connect(addr: SocketAddr, id: &str) -> Observer {
        let started = Instant::now();
        loop {
            match Observer::try_connect(addr, id).await {
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

    async fn request(&mut self, args: &[&[u8]]) -> Bytes {
        self.correlation += 1;
        let correlation = Bytes::from(self.correlation.to_be_bytes().to_vec());
        let properties = request_properties(&self.response_topic, &correlation, hlc_now());
        self.client
            .publish_with_properties(
                INVOKE_TOPIC,
                QoS::AtLeastOnce,
                false,
                mqstate_protocol::encode_request(args),
                properties,
            )
            .await
            .unwrap();
        loop {
            let reply = tokio::time::timeout(WAIT, self.replies.recv())
                .await
                .expect("a reply in time")
                .expect("connection alive until the reply");
            let props = reply.properties.clone().unwrap_or_default();
            if props.correlation_data.as_ref() == Some(&correlation) {
                return reply.payload;
            }
        }
    }

    /// The next notification's payload. One sent again (DUP: in flight when the node holding
    /// the session died, as QoS 1 allows) is skipped.
    async fn next_note(&mut self) -> Bytes {
        loop {
            let note = tokio::time::timeout(AGREEMENT_TIMEOUT, self.notes.recv())
                .await
                .expect("a notification in time")
                .expect("connection alive");
            if !note.dup {
                return note.payload;
            }
            eprintln!("a notification sent again: {:?}", note.payload);
        }
    }

    /// Leaves, keeping the session (its expiry is an hour).
    async fn leave(self) {
        self.client.disconnect().await.unwrap();
        // The event loop sends DISCONNECT and ends; give it the chance before dropping.
        let mut notes = self.notes;
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while notes.recv().await.is_some() {}
        })
        .await;
    }
}

fn three_nodes(root: &std::path::Path) -> Vec<Node> {
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let nodes = start_founders(root, &addrs);
    let refs: Vec<&Node> = nodes.iter().collect();
    tokio::task::block_in_place(|| eventually("three nodes agree", || agreed(&refs, &[1, 2, 3])));
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_keep_their_registrations_across_nodes_and_node_death() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = three_nodes(root.path());
    let (n1, n2, n3) = (
        nodes[0].server.addr,
        nodes[1].server.addr,
        nodes[2].server.addr,
    );
    let key: &[u8] = b"obs/k";
    tokio::time::timeout(TEST_BOUND, async {
        let mut writer = StateClient::connect(n3, "obs-writer").await;

        // Registered on node 2, notified of a write through node 3.
        let mut observer = Observer::connect(n2, "obs-1").await;
        assert!(!observer.session_present);
        assert_eq!(&observer.request(&[b"KEYNOTIFY", key]).await[..], OK);
        assert_eq!(&writer.request(&[b"SET", key, b"a"]).await[..], OK);
        assert_eq!(observer.next_note().await, set_note(b"a"));

        // Away from a live node: the change is queued in its session, and the registration
        // moves with the session to node 1.
        observer.leave().await;
        assert_eq!(&writer.request(&[b"SET", key, b"b"]).await[..], OK);
        let mut observer = Observer::connect(n1, "obs-1").await;
        assert!(observer.session_present, "the session moved to node 1");
        assert_eq!(
            observer.next_note().await,
            set_note(b"b"),
            "the change made while it was away"
        );
        assert_eq!(&writer.request(&[b"SET", key, b"c"]).await[..], OK);
        assert_eq!(
            observer.next_note().await,
            set_note(b"c"),
            "registered on node 1 without a KEYNOTIFY there"
        );

        // Its node dies: it reconnects to node 2, registered there, and writes through node 3
        // reach it.
        nodes[0].server.kill9();
        drop(observer);
        let mut observer = Observer::connect(n2, "obs-1").await;
        assert!(observer.session_present, "the session survived node 1");
        assert_eq!(&writer.request(&[b"SET", key, b"d"]).await[..], OK);
        assert_eq!(
            observer.next_note().await,
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
        if let Ok(extra) = observer.notes.try_recv() {
            panic!(
                "a notification after KEYNOTIFY STOP: {:?} {:?}",
                extra.payload, extra.properties
            );
        }
    })
    .await
    .expect("test exceeded its time bound");
}
