//! The registrations of sessions taken over on a cluster node (decision 0065), against the real
//! state-store service with a router standing in for the other nodes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use mqstate_broker::{Broker, BrokerConfig};
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_statestore::router::{
    ClusterChanges, KeepFuture, KeyRouter, RestoredObserver, RestoredObservers, RoutedReply,
    RoutedRequest, Router, RouterFuture, ScanFuture, ScanRequest,
};
use mqstate_statestore::service::{self, ServiceConfig};
use mqstate_store::{Limits, StoreConfig};
use mqstate_wal::WalOptions;
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
    let (_changes, changes_rx) = mpsc::unbounded_channel();
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
    // The adoption's restore: `k` is newly observed here, its watch on its way.
    let adoption = restore(&restored, "c", b"k");
    entered.await.unwrap();
    // The CONNECT's restore of the same key, then another client's of another key: the service
    // takes them in order, and the latter's is done once the former's was handled.
    let mut connect = restore(&restored, "c", b"k");
    restore(&restored, "d", b"other").await.unwrap();
    assert!(
        matches!(connect.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "the CONNECT's registrations in force before the other nodes know of the key"
    );
    open.send(()).unwrap();
    connect.await.unwrap();
    adoption.await.unwrap();
}
