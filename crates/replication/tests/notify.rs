//! KEYNOTIFY across nodes under faults (issues #18 and #16): three control-plane nodes in one
//! process over the in-memory transport, each with its [`Notifier`]; a committed change of an
//! observed key reaches the observing node, in order, after
//!
//! * the observing node was cut off from the head while the change was handed over
//!   (robustness seed 400),
//! * the observing node was silent longer than the heads used to remember its interest
//!   (seed 403, a `SIGSTOP`),
//! * the head restarted and knew nobody's interest yet (seeds 401 and 410–412, `kill -9`).
//!
//! Each waits on a condition with a generous bound, never on a fixed time.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mqstate_cluster::sim::{eventually, mem_addr as addr, mem_node, quick_config};
use mqstate_cluster::transport::mem::MemNetwork;
use mqstate_cluster::transport::BoxFuture;
use mqstate_cluster::{ClusterNode, DataHandler, NodeId, Status};
use mqstate_replication::notify::{Notifier, Sink};
use mqstate_replication::wire::{decode, encode, Committed, DataRequest};
use tokio::sync::oneshot;

async fn start(net: &MemNetwork, root: &Path, id: NodeId) -> ClusterNode {
    let founders = [1, 2, 3].map(|id| (id, addr(id))).into();
    let config = quick_config(id, addr(id), founders, root.join(format!("n{id}")), 3);
    mem_node(net, config).await
}

/// The notifier a node's data requests go to; replaced when the node's data plane "restarts".
#[derive(Default)]
struct Plane(Mutex<Option<Arc<Notifier>>>);

impl Plane {
    fn set(&self, notifier: Arc<Notifier>) {
        *self.0.lock().unwrap() = Some(notifier);
    }
}

impl DataHandler for Plane {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>> {
        let notifier = self.0.lock().unwrap().clone();
        Box::pin(async move {
            let notifier = notifier.expect("a notifier is attached");
            let request = decode::<DataRequest>(&request).expect("a data request");
            let response = notifier
                .handle(request)
                .await
                .expect("a notification request");
            encode(&response)
        })
    }
}

/// What a node's observers were handed, in order.
#[derive(Default)]
struct Seen(Mutex<Vec<Committed>>);

impl Sink for Seen {
    fn deliver(&self, changes: Vec<Committed>, done: oneshot::Sender<()>) {
        self.0.lock().unwrap().extend(changes);
        let _ = done.send(());
    }
}

impl Seen {
    fn versions(&self, key: &[u8]) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.key == key)
            .map(|c| c.version.clone())
            .collect()
    }
}

struct Cluster {
    net: MemNetwork,
    nodes: Vec<Arc<ClusterNode>>,
    planes: Vec<Arc<Plane>>,
    notifiers: Vec<Arc<Notifier>>,
    seen: Vec<Arc<Seen>>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let net = MemNetwork::new();
        let mut cluster = Cluster {
            net,
            nodes: Vec::new(),
            planes: Vec::new(),
            notifiers: Vec::new(),
            seen: Vec::new(),
            _dir: dir,
        };
        for id in 1..=3 {
            let node = start(&cluster.net, cluster._dir.path(), id).await;
            let plane = Arc::new(Plane::default());
            node.set_data_handler(Arc::clone(&plane) as Arc<dyn DataHandler>);
            cluster.nodes.push(Arc::new(node));
            cluster.planes.push(plane);
        }
        let nodes: Vec<&ClusterNode> = cluster.nodes.iter().map(|n| &**n).collect();
        eventually("three members up", || {
            nodes.iter().all(|n| {
                let s: Status = n.status();
                s.members.len() == 3 && s.members.iter().all(|m| m.state == "up")
            })
        })
        .await;
        for i in 0..3 {
            let (notifier, seen) = cluster.notifier(i);
            cluster.notifiers.push(notifier);
            cluster.seen.push(seen);
        }
        cluster
    }

    /// A fresh notifier for node `i` (index), as a new process of the node has.
    fn notifier(&self, i: usize) -> (Arc<Notifier>, Arc<Seen>) {
        let node = Arc::clone(&self.nodes[i]);
        let start_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let notifier = Arc::new(Notifier::new(node, start_ms));
        let seen = Arc::new(Seen::default());
        notifier.set_sink(Arc::clone(&seen) as Arc<dyn Sink>);
        self.planes[i].set(Arc::clone(&notifier));
        (notifier, seen)
    }

    /// Node 2 watches `key`; returns once node 1, the head in these tests, knows its interest.
    async fn observe(&self, key: &[u8]) {
        self.notifiers[1].watch(key.to_vec(), true).await;
        eventually("the head knows the observer's interest", || {
            self.notifiers[0].is_observed(key)
        })
        .await;
    }
}

fn change(key: &[u8], n: u64) -> Committed {
    Committed {
        key: key.to_vec(),
        version: format!("{:015}:00000:1", 1_700_000_000_000 + n),
        value: Some(format!("v{n}").into_bytes()),
    }
}

fn version(n: u64) -> String {
    change(b"", n).version
}

/// Seed 400: the observing node was cut off from the head while the head handed a change over.
/// The head keeps it and hands it over once the link is back, before the changes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_the_observing_node_could_not_take_reaches_it_after_the_heal() {
    let cluster = Cluster::start().await;
    cluster.observe(b"k").await;
    let head = &cluster.notifiers[0];

    cluster.net.cut(&addr(1), &addr(2));
    // Resolves after the bounded wait: the writer's reply does not wait for the cut-off node.
    head.publish(change(b"k", 1)).await;
    head.publish(change(b"k", 2)).await;
    cluster.net.heal_all();
    head.publish(change(b"k", 3)).await;

    let seen = &cluster.seen[1];
    eventually("the observer got every change", || {
        seen.versions(b"k").len() == 3
    })
    .await;
    assert_eq!(seen.versions(b"k"), [version(1), version(2), version(3)]);
}

/// Seed 403: the observing node was paused longer than the heads remembered its interest (5 s
/// since last heard); it is still a member, so its interest still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_member_keeps_its_interest() {
    let cluster = Cluster::start().await;
    cluster.observe(b"k").await;
    let head = &cluster.notifiers[0];
    // No resend of the interest in the meantime (the node's background task is not running
    // here): as when the node was stopped and resumed.
    tokio::time::sleep(Duration::from_secs(6)).await;

    head.publish(change(b"k", 1)).await;
    let seen = &cluster.seen[1];
    eventually("the observer got the change", || {
        seen.versions(b"k") == [version(1)]
    })
    .await;
}

/// Seeds 401, 410–412: the head's process restarted (a fresh notifier on the same node) and
/// executed a write before any member resent its interest. The change still reaches the
/// observing node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_head_notifies_before_hearing_the_members_again() {
    let cluster = Cluster::start().await;
    cluster.observe(b"k").await;

    let (restarted, _) = cluster.notifier(0);
    assert!(
        restarted.is_observed(b"k"),
        "a head that has not heard a member yet counts the key as observed"
    );
    restarted.publish(change(b"k", 1)).await;
    let seen = &cluster.seen[1];
    eventually("the observer got the change", || {
        seen.versions(b"k") == [version(1)]
    })
    .await;

    // Its first round of sending its own interest brings every member's back: from then on only
    // the keys observed somewhere count.
    restarted.send_interest().await;
    assert!(restarted.is_observed(b"k"));
    assert!(!restarted.is_observed(b"unobserved"));
}
