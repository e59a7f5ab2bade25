//! The registrations of sessions taken over on a cluster node (decision 0065), and a KEYNOTIFY's
//! wait for its key's watch, against the real state-store service with a router standing in for
//! the other nodes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use mqstate_broker::{Broker, BrokerConfig};
use mqstate_cli::rpc;
use mqstate_cli::wire::{self, Conn, Turn};
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_protocol::Hlc;
use mqstate_statestore::router::{
    ClusterChanges, KeepFuture, KeyRouter, RestoredObserver, RestoredObservers, RoutedReply,
    RoutedRequest, Router, RouterFuture, ScanFuture, ScanRequest,
};
use mqstate_statestore::service::{self, ServiceConfig};
use mqstate_store::{Limits, StoreConfig};
use mqstate_wal::WalOptions;
use rumqttc::v5::mqttbytes::v5::Filter;
use rumqttc::v5::mqttbytes::QoS;
use tokio::sync::{mpsc, oneshot};

type Gate = (oneshot::Sender<()>, oneshot::Receiver<()>);

/// The other nodes: the first watch is held until the test opens it; every other call resolves
/// at once.
struct OtherNodes {
    restored: Mutex<Option<RestoredObservers>>,
    changes: Mutex<Option<ClusterChanges>>,
    first_watch: Mutex<Option<Gate>>,
}

impl KeyRouter for OtherNodes {
    fn execute(&self, _: RoutedRequest) -> RouterFuture<'_> {
        Box::pin(async {
            RoutedReply {
                payload: Bytes::from_static(b"-ERR no partition in this test\r\n"),
                ts: None,
            }
        })
    }

    fn scan(&self, _: ScanRequest) -> ScanFuture<'_> {
        Box::pin(async { Err("no partition in this test".to_owned()) })
    }

    fn watch(&self, _: Bytes, _: bool) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        let gate = self.first_watch.lock().unwrap().take();
        Box::pin(async move {
            if let Some((entered, open)) = gate {
                let _ = entered.send(());
                let _ = open.await;
            }
        })
    }

    fn take_changes(&self) -> Option<ClusterChanges> {
        self.changes.lock().unwrap().take()
    }

    fn keep_observed(&self, _: &str, _: Vec<Bytes>) -> KeepFuture<'_> {
        Box::pin(async { Ok(()) })
    }

    fn take_restored(&self) -> Option<RestoredObservers> {
        self.restored.lock().unwrap().take()
    }

    fn catch_up(
        &self,
        _: Arc<str>,
        _: Bytes,
        _: Option<String>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
}

/// A node's state-store service on a broker, with [`OtherNodes`] as its router.
struct Node {
    _dir: tempfile::TempDir,
    broker: Broker,
    /// Registrations of sessions taken over here.
    restored: mpsc::UnboundedSender<RestoredObserver>,
    /// No change ever comes; the channel stays open with the node.
    _changes: mpsc::UnboundedSender<mqstate_statestore::router::ClusterChange>,
    /// The first watch was sent: it is held until `open`.
    entered: oneshot::Receiver<()>,
    open: oneshot::Sender<()>,
}

fn node() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        node_id: "mqstate".into(),
        limits: Limits::default(),
    };
    let broker = Broker::builder(BrokerConfig::default()).build();
    let (recovered, _) = mqstate_statestore::recovery::recover(
        dir.path(),
        WalOptions::default(),
        store,
        broker.clock().now_ms(),
    )
    .unwrap();
    let inbox = broker.claim_topic(INVOKE_TOPIC).unwrap();
    let (restored, restored_rx) = mpsc::unbounded_channel();
    let (changes, changes_rx) = mpsc::unbounded_channel();
    let (entered_tx, entered) = oneshot::channel();
    let (open, open_rx) = oneshot::channel();
    let router = OtherNodes {
        restored: Mutex::new(Some(restored_rx)),
        changes: Mutex::new(Some(changes_rx)),
        first_watch: Mutex::new(Some((entered_tx, open_rx))),
    };
    let config = ServiceConfig {
        router: Some(Router(Arc::new(router))),
        ..ServiceConfig::default()
    };
    tokio::spawn(service::run(
        broker.clone(),
        inbox,
        recovered,
        config,
        std::future::pending(),
    ));
    Node {
        _dir: dir,
        broker,
        restored,
        _changes: changes,
        entered,
        open,
    }
}

fn restore(
    to: &mpsc::UnboundedSender<RestoredObserver>,
    client_id: &str,
    key: &'static [u8],
) -> oneshot::Receiver<()> {
    let (done, wait) = oneshot::channel();
    to.send(RestoredObserver {
        client_id: client_id.into(),
        keys: vec![(Bytes::from_static(key), None)],
        done,
    })
    .unwrap();
    wait
}

/// Robustness seed 920 (with the adopter's back-off of seed 946): a restarted node's adopter
/// restored a client's observed keys, and the client's CONNECT took the session over meanwhile
/// and restored them again. The second restore found the keys observed (by the first) and was
/// done at once, while the other nodes did not know yet that this node observes them: the
/// client got its CONNACK and caught up, and the changes committed before the first restore's
/// watch arrived reached neither.
#[tokio::test]
async fn a_restore_of_a_key_whose_watch_is_on_its_way_waits_for_it() {
    let node = node();
    let (restored, entered, open) = (&node.restored, node.entered, node.open);
    // The adoption's restore: `k` is newly observed here, its watch on its way.
    let adoption = restore(restored, "c", b"k");
    entered.await.unwrap();
    // The CONNECT's restore of the same key, then another client's of another key: the service
    // takes them in order, and the latter's is done once the former's was handled.
    let mut connect = restore(restored, "c", b"k");
    restore(restored, "d", b"other").await.unwrap();
    assert!(
        matches!(connect.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "the CONNECT's registrations in force before the other nodes know of the key"
    );
    open.send(()).unwrap();
    connect.await.unwrap();
    adoption.await.unwrap();
}

/// An MQTT 5 client of `broker` (served on a loopback port), subscribed to its response topic.
async fn client(broker: &Broker, id: &str) -> Conn<tokio::net::TcpStream> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let broker = broker.clone();
    tokio::spawn(async move { mqstate_broker::serve_streams(|| listener.accept(), broker).await });
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let options = wire::Options {
        client_id: id.to_owned(),
        keep_alive: Duration::from_secs(30),
        login: None,
        max_inflight: 8,
        resume: None,
        will: None,
    };
    let mut conn = Conn::start(stream, options).await.unwrap();
    let topic = rpc::response_topic(id);
    conn.subscribe(vec![Filter::new(topic, QoS::AtLeastOnce)])
        .await
        .unwrap();
    conn
}

/// Sends `command` as a state-store request of `id` with correlation data `seq`, without waiting
/// for its reply.
async fn send(conn: &mut Conn<tokio::net::TcpStream>, id: &str, seq: u64, command: &[&str]) {
    let ts = Hlc {
        wall_ms: rpc::now_ms(),
        counter: 0,
        node_id: id.into(),
    };
    let properties = rpc::request_properties(
        id,
        &rpc::response_topic(id),
        rpc::correlation(seq),
        &ts,
        None,
        Duration::from_secs(30),
    );
    let mut publish = wire::publish(
        &Bytes::from_static(INVOKE_TOPIC.as_bytes()),
        QoS::AtLeastOnce,
        mqstate_protocol::encode_request(command),
        Some(properties),
    );
    conn.publish(&mut publish).unwrap();
    conn.flush().await.unwrap();
}

/// The correlation `seq` and payload of the next reply `conn` gets.
async fn next_reply(conn: &mut Conn<tokio::net::TcpStream>) -> (u64, Bytes) {
    loop {
        if let Turn::Input = conn.read().await.unwrap() {
            if let Some(p) = conn.next().unwrap() {
                conn.acknowledge(&p).unwrap();
                conn.flush().await.unwrap();
                let correlation = p
                    .properties
                    .as_ref()
                    .and_then(|p| p.correlation_data.as_ref());
                let seq = correlation.and_then(|c| rpc::correlation_seq(c)).unwrap();
                return (seq, p.payload.clone());
            }
        }
        conn.flush().await.unwrap();
    }
}

/// Issue 16: a KEYNOTIFY of a key observed here already, by a registration whose watch was still
/// on its way to the other nodes, was answered at once: the client took its registration for in
/// force while the key's changes still passed this node by. Its reply now waits for that watch.
/// (The client's next request, a GET of another key answered at once, is answered first.)
#[tokio::test]
async fn a_keynotify_of_a_key_whose_watch_is_on_its_way_waits_for_it() {
    let node = node();
    let (broker, restored, entered, open) = (&node.broker, &node.restored, node.entered, node.open);
    // An adoption's restore: `k` is newly observed here, its watch on its way.
    let adoption = restore(restored, "c", b"k");
    entered.await.unwrap();

    let mut b = client(broker, "b").await;
    send(&mut b, "b", 1, &["KEYNOTIFY", "k"]).await;
    send(&mut b, "b", 2, &["GET", "other"]).await;
    let (first, _) = next_reply(&mut b).await;
    assert_eq!(
        first, 2,
        "the KEYNOTIFY was answered before the other nodes knew of the key"
    );
    open.send(()).unwrap();
    let (second, payload) = next_reply(&mut b).await;
    assert_eq!((second, &payload[..]), (1, &b"+OK\r\n"[..]));
    adoption.await.unwrap();
}
