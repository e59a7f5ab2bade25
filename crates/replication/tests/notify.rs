//! KEYNOTIFY across nodes under faults (issues #18 and #16): three control-plane nodes in one
//! process over the in-memory transport, each with its [`Notifier`]; a committed change of an
//! observed key reaches the observing node, in order, after
//!
//! * the observing node was cut off from the head while the change was handed over
//!   (robustness seed 400),
//! * the observing node was silent longer than the heads used to remember its interest
//!   (seed 403, a `SIGSTOP`),
//! * the head restarted and knew nobody's interest yet (seeds 401 and 410–412, `kill -9`),
//! * the head that committed a change died before handing it over, or was cut off from the
//!   observing node and lost its headship before its outbox drained, and the next head's change
//!   came first (seeds 160109, 160126, 619: decision 0061): the observing node holds the newer
//!   change back and gets the missing one from a replica's trail,
//! * the observing node started observing a key while an older change of it was still in some
//!   head's outbox (seed 160097): it starts from the key's committed version.
//!
//! Each waits on a condition with a generous bound, never on a fixed time.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use mqstate_chain::{Record, Row, Version};
use mqstate_cluster::sim::{eventually, mem_addr as addr, mem_node, quick_config};
use mqstate_cluster::transport::mem::MemNetwork;
use mqstate_cluster::transport::BoxFuture;
use mqstate_cluster::{ClusterNode, DataHandler, NodeId, Status};
use mqstate_protocol::Hlc;
use mqstate_replication::notify::{Notifier, Sink};
use mqstate_replication::wire::{decode, encode, Committed, DataRequest};
use mqstate_store::{Change, Delta};
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

/// What a node's observers were handed, in order; and the catch-ups of single observers.
#[derive(Default)]
struct Seen(Mutex<Vec<Committed>>, Mutex<Vec<(Arc<str>, Vec<String>)>>);

impl Sink for Seen {
    fn deliver(&self, changes: Vec<Committed>, done: oneshot::Sender<()>) {
        self.0.lock().unwrap().extend(changes);
        let _ = done.send(());
    }

    fn catch_up(&self, observer: Arc<str>, key: Vec<u8>, changes: Vec<Committed>) {
        assert!(changes.iter().all(|c| c.key == key));
        let versions = changes.into_iter().map(|c| c.version).collect();
        self.1.lock().unwrap().push((observer, versions));
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

    /// Node 2 watches `key`; returns once nodes 1 and 3, the heads in these tests, know its
    /// interest.
    async fn observe(&self, key: &[u8]) {
        self.notifiers[1].watch(key.to_vec(), true).await;
        eventually("the heads know the observer's interest", || {
            self.notifiers[0].is_observed(key) && self.notifiers[2].is_observed(key)
        })
        .await;
    }

    /// [`Cluster::observe`] `k`, then node 1's change 1 of it reaches node 2.
    async fn observe_change_1(&self) {
        self.observe(b"k").await;
        self.notifiers[0].publish(change(b"k", 1)).await;
        eventually("the observer got change 1", || {
            self.seen[1].versions(b"k") == [version(1)]
        })
        .await;
    }
}

fn change(key: &[u8], n: u64) -> Committed {
    Committed {
        key: key.to_vec(),
        version: format!("{:015}:00000:1", 1_700_000_000_000 + n),
        value: Some(format!("v{n}").into_bytes()),
        prev: None,
    }
}

/// Change `n` of `key`, which replaced change `prev`.
fn after(key: &[u8], n: u64, prev: u64) -> Committed {
    Committed {
        prev: Some(version(prev)),
        ..change(key, n)
    }
}

/// The chain row of change `n` of `key`, as a replica persists it.
fn row(key: &[u8], n: u64) -> Record {
    let delta = Delta::Put {
        key: Bytes::copy_from_slice(key),
        value: Bytes::from(format!("v{n}")),
        version: Hlc::new(1_700_000_000_000 + n, 0, Arc::from("1")),
        fencing_token: None,
        expires_at_ms: None,
    };
    Record::Row {
        key: key.to_vec(),
        row: Row {
            value: Some(Change::Key(delta).encode().unwrap()),
            version: Version {
                wall_ms: n,
                counter: 0,
                node: 1,
            },
            view: 1,
            locked: false,
        },
    }
}

/// Node `i`'s replica persisted changes `ns` of `key` (its driver's notes).
fn persisted(cluster: &Cluster, i: usize, key: &[u8], ns: &[u64]) {
    let records: Vec<Record> = ns.iter().map(|&n| row(key, n)).collect();
    let partition = 0; // which one does not matter to the trail's walk
    cluster.notifiers[i]
        .trail_notes()
        .note(partition, &records, 1_700_000_000_000);
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
    head.publish(after(b"k", 2, 1)).await;
    cluster.net.heal_all();
    head.publish(after(b"k", 3, 2)).await;

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

/// Seeds 160109, 160126: the head committed change 2 and died before handing it over; the next
/// head's change 3 (which replaced 2) reaches the observing node first. The observing node holds 3
/// back, gets 2 from a surviving replica's trail, and delivers both in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_lost_with_its_head_comes_from_a_replica() {
    let cluster = Cluster::start().await;
    cluster.observe_change_1().await;
    let new_head = &cluster.notifiers[2];
    let seen = &cluster.seen[1];

    // Change 2 went through the chain (every replica persisted it), and its head died before
    // handing it over: nobody publishes it.
    persisted(&cluster, 2, b"k", &[1, 2]);
    cluster.net.cut(&addr(1), &addr(2));
    cluster.net.cut(&addr(1), &addr(3));
    new_head.publish(after(b"k", 3, 2)).await;

    eventually("the observer got every change", || {
        seen.versions(b"k").len() == 3
    })
    .await;
    assert_eq!(seen.versions(b"k"), [version(1), version(2), version(3)]);
}

/// Seed 619: two heads in turn. The old head was cut off from the observing node with change 2
/// in its outbox and lost its headship; the new head's change 3 arrives first. Change 2 is
/// fetched from the new head's trail, and the old head's copy, once the link heals, is not
/// delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_heads_undelivered_change_is_not_skipped() {
    let cluster = Cluster::start().await;
    cluster.observe_change_1().await;
    let (old_head, new_head) = (&cluster.notifiers[0], &cluster.notifiers[2]);
    let seen = &cluster.seen[1];

    cluster.net.cut(&addr(1), &addr(2));
    old_head.publish(after(b"k", 2, 1)).await;
    persisted(&cluster, 2, b"k", &[1, 2]);
    new_head.publish(after(b"k", 3, 2)).await;
    eventually("the observer got changes 2 and 3", || {
        seen.versions(b"k").len() == 3
    })
    .await;
    cluster.net.heal_all();
    new_head.publish(after(b"k", 4, 3)).await;
    eventually("the observer got change 4", || {
        seen.versions(b"k").len() >= 4
    })
    .await;
    // The old head's outbox drains (its copy of 2 is acknowledged, not delivered).
    eventually("the old head's outbox drained", || {
        old_head.undelivered() == 0
    })
    .await;
    assert_eq!(
        seen.versions(b"k"),
        [version(1), version(2), version(3), version(4)]
    );
}

/// No replica holds the missing change (it was written while its key was not observed, or the
/// replicas restarted): the held change is delivered anyway once the hold is over — bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_change_goes_out_without_what_nobody_holds() {
    let cluster = Cluster::start().await;
    cluster.observe(b"k").await;
    let head = &cluster.notifiers[0];
    head.publish(change(b"k", 1)).await;
    head.publish(after(b"k", 3, 2)).await;
    head.publish(after(b"k", 4, 3)).await;
    let seen = &cluster.seen[1];
    eventually("the observer got 3 and 4 after the hold", || {
        seen.versions(b"k").len() == 3
    })
    .await;
    assert_eq!(seen.versions(b"k"), [version(1), version(3), version(4)]);
}

/// Seed 160097: a node starts observing a key while an older change of it is still on its way
/// (an old head's outbox): it starts from the key's committed version, so the older change is
/// not delivered after newer ones the observer may have seen on another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starts_observing_at_the_committed_version() {
    let cluster = Cluster::start().await;
    let (head, observer) = (&cluster.notifiers[0], &cluster.notifiers[1]);
    let start = async { Some(version(5)) };
    observer.observe(b"k".to_vec(), start).await;
    head.publish(after(b"k", 3, 2)).await;
    head.publish(after(b"k", 5, 4)).await;
    head.publish(after(b"k", 6, 5)).await;
    let seen = &cluster.seen[1];
    eventually("the observer got change 6", || {
        !seen.versions(b"k").is_empty()
    })
    .await;
    assert_eq!(seen.versions(b"k"), [version(6)]);
}

/// Decision 0065: a session taken over here from a node that died owes its client the changes
/// of its keys after its cursor (the last one queued into it there). They come from the
/// replicas' trails, up to the last change delivered here (later ones reach it live).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_moved_here_catches_up_from_its_cursor() {
    let cluster = Cluster::start().await;
    let observer = &cluster.notifiers[1];
    // Changes 1–5 went through the chain while the session's node was dead.
    persisted(&cluster, 2, b"k", &[1, 2, 3, 4, 5]);
    assert_eq!(observer.position(b"k"), None, "not observed here");
    observer
        .observe(b"k".to_vec(), async { Some(version(5)) })
        .await;
    assert_eq!(observer.position(b"k"), Some(version(5)));
    let caught = || std::mem::take(&mut *cluster.seen[1].1.lock().unwrap());
    let versions = |ns: &[u64]| ns.iter().map(|&n| version(n)).collect::<Vec<_>>();

    observer
        .catch_up("o".into(), b"k".to_vec(), Some(version(2)))
        .await;
    assert_eq!(caught(), [("o".into(), versions(&[3, 4, 5]))]);
    // Observed from before the key had a row: every change.
    observer
        .catch_up("o".into(), b"k".to_vec(), Some(String::new()))
        .await;
    assert_eq!(caught(), [("o".into(), versions(&[1, 2, 3, 4, 5]))]);
    // Nothing owed: the cursor is where this node stands, or is not known.
    observer
        .catch_up("o".into(), b"k".to_vec(), Some(version(5)))
        .await;
    observer.catch_up("o".into(), b"k".to_vec(), None).await;
    assert_eq!(
        caught(),
        [("o".into(), Vec::new()), ("o".into(), Vec::new())]
    );
    // A cursor no replica noted (change 0 was written while nobody observed the key): every
    // replica's changes start after it, with nothing before, so they are all owed.
    observer
        .catch_up("o".into(), b"k".to_vec(), Some(version(0)))
        .await;
    assert_eq!(caught(), [("o".into(), versions(&[1, 2, 3, 4, 5]))]);
}
