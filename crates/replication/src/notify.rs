//! KEYNOTIFY across nodes (decision 0046): registrations stay where the observer is
//! connected (session state, in that node's state machine); what crosses nodes is *interest* —
//! the set of keys some client of a node observes — and *committed changes* of those keys.
//!
//! * Interest: a node whose observed keys change sends the whole set, with a growing generation,
//!   to every member, and answers the KEYNOTIFY only once they acknowledged it (or the bounded wait
//!   passed), so a write executed at any head after the reply is notified. Every second the set is
//!   sent again, so a member that restarted or missed it learns it.
//! * Changes: a partition's head, once a write is committed (phase 2 done, `Written`), hands the
//!   change to every node with interest in its key — itself directly, others through one ordered
//!   queue per peer — and waits (bounded) for their acknowledgement before the writer's reply goes
//!   out. An observing node delivers a change only if its version is above the last one it
//!   delivered for the key: never twice, never out of order.
//! * Fail-over: a new head takes over the writes its predecessor had not completed (the rows it
//!   holds locked) and, once repair committed them, notifies them; a retried request answered from
//!   the row (the duplicate check) notifies its change again. Versions make both harmless.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use mqstate_cluster::transport::{Request, Response};
use mqstate_cluster::ClusterNode;
use mqstate_protocol::Hlc;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::wire::{decode, encode, Committed, DataRequest, DataResponse};

/// How long a node waits for the other members to take its interest, or a head for an observing
/// node to take a change, before going on without them (a member down has no observers).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a node sends its interest again to every member.
pub const INTEREST_EVERY: Duration = Duration::from_secs(1);
/// A member's interest not heard again for this long is forgotten: the member is down (its
/// observers with it), and writes must not wait for it.
pub const INTEREST_TTL: Duration = Duration::from_secs(5);
/// Changes sent to one peer in one message, at most.
const BATCH: usize = 256;

/// Where the changes for this node's observers go: the state-store service.
pub trait Sink: Send + Sync + 'static {
    /// Queues `changes` (in order) for this node's observers; `done` is signalled once they are
    /// queued ahead of any reply the service releases afterwards.
    fn deliver(&self, changes: Vec<Committed>, done: oneshot::Sender<()>);
}

/// Interest of this node.
struct Local {
    generation: u64,
    /// Keys observed here, each with the last version delivered for it.
    keys: HashMap<Vec<u8>, Option<Hlc>>,
}

/// Another member's interest: its generation, the keys observed there, when it was last heard.
type Interest = (u64, BTreeSet<Vec<u8>>, Instant);

/// A change on its way to a peer, and who waits for its acknowledgement.
type Outgoing = (Committed, oneshot::Sender<()>);

/// The notification side of a node's data plane.
pub struct Notifier {
    node: Arc<ClusterNode>,
    local: Mutex<Local>,
    /// Other members' interest: generation and keys.
    remote: Mutex<HashMap<u64, Interest>>,
    sink: OnceLock<Arc<dyn Sink>>,
    peers: Mutex<HashMap<u64, mpsc::UnboundedSender<Outgoing>>>,
}

impl Notifier {
    /// `start_ms`: this process's start (wall time), so its generations are above those of the
    /// node's previous runs.
    pub fn new(node: Arc<ClusterNode>, start_ms: u64) -> Notifier {
        Notifier {
            node,
            local: Mutex::new(Local {
                generation: start_ms.saturating_mul(1_000_000),
                keys: HashMap::new(),
            }),
            remote: Mutex::new(HashMap::new()),
            sink: OnceLock::new(),
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// Connects this node's observers; only the first call counts.
    pub fn set_sink(&self, sink: Arc<dyn Sink>) {
        if self.sink.set(sink).is_err() {
            tracing::warn!("a notification sink is already attached; the second one is ignored");
        }
    }

    /// `key` is observed here now (`true`) or no longer (`false`). Resolves once the other
    /// members took the new set, or [`ACK_TIMEOUT`] passed.
    pub async fn watch(&self, key: Vec<u8>, observed: bool) {
        let changed = {
            let mut local = lock(&self.local);
            let changed = if observed {
                local.keys.insert(key, None).is_none()
            } else {
                local.keys.remove(&key).is_some()
            };
            if changed {
                local.generation += 1;
            }
            changed
        };
        if changed {
            self.send_interest().await;
        }
    }

    /// Sends this node's interest to every other member, waiting for them (bounded).
    pub async fn send_interest(&self) {
        let (generation, keys) = {
            let local = lock(&self.local);
            let mut keys: Vec<Vec<u8>> = local.keys.keys().cloned().collect();
            keys.sort();
            (local.generation, keys)
        };
        let frame = encode(&DataRequest::Interest {
            node: self.node.id(),
            generation,
            keys,
        });
        let mut calls = JoinSet::new();
        for member in self.node.status().members {
            if member.id == self.node.id() {
                continue;
            }
            let Some(addr) = self.node.addr_of(member.id) else {
                continue;
            };
            let transport = self.node.transport();
            let frame = frame.clone();
            calls.spawn(async move {
                if let Err(e) = transport
                    .call(&addr, Request::Data(frame), ACK_TIMEOUT)
                    .await
                {
                    tracing::debug!(to = member.id, "observed keys not delivered: {e}");
                }
            });
        }
        while calls.join_next().await.is_some() {}
    }

    /// Another member's interest.
    pub fn receive_interest(&self, node: u64, generation: u64, keys: Vec<Vec<u8>>) {
        let mut remote = lock(&self.remote);
        let now = Instant::now();
        let entry = remote
            .entry(node)
            .or_insert_with(|| (0, BTreeSet::new(), now));
        if generation > entry.0 {
            *entry = (generation, keys.into_iter().collect(), now);
        } else if generation == entry.0 {
            entry.2 = now;
        }
    }

    /// Whether any node (this one included) observes `key`.
    pub fn is_observed(&self, key: &[u8]) -> bool {
        let now = Instant::now();
        lock(&self.local).keys.contains_key(key)
            || lock(&self.remote)
                .values()
                .any(|interest| fresh(interest, now) && interest.1.contains(key))
    }

    /// Notifies every node observing the key of a committed change; resolves once they took it
    /// (bounded by [`ACK_TIMEOUT`]).
    pub async fn publish(&self, change: Committed) {
        let here = lock(&self.local).keys.contains_key(&change.key);
        let now = Instant::now();
        let others: Vec<u64> = lock(&self.remote)
            .iter()
            .filter(|(node, interest)| {
                **node != self.node.id() && fresh(interest, now) && interest.1.contains(&change.key)
            })
            .map(|(&node, _)| node)
            .collect();
        let mut acks = Vec::with_capacity(others.len() + 1);
        for node in others {
            let (tx, rx) = oneshot::channel();
            if self.queue_for(node).send((change.clone(), tx)).is_ok() {
                acks.push(rx);
            }
        }
        if here {
            if let Some(done) = self.deliver_here(vec![change]) {
                acks.push(done);
            }
        }
        let _ = tokio::time::timeout(ACK_TIMEOUT, async {
            for ack in acks {
                let _ = ack.await;
            }
        })
        .await;
    }

    /// Hands the changes of keys observed here whose version is above the last delivered to the
    /// sink, in order; the receiver resolves once they are queued.
    pub fn deliver_here(&self, changes: Vec<Committed>) -> Option<oneshot::Receiver<()>> {
        let sink = self.sink.get()?;
        let (tx, rx) = oneshot::channel();
        // The check, the update and the hand-over under one lock: two heads' (or two tasks')
        // changes of one key reach the sink in version order.
        let mut local = lock(&self.local);
        let fresh: Vec<Committed> = changes
            .into_iter()
            .filter(|change| {
                let Some(last) = local.keys.get_mut(&change.key) else {
                    return false;
                };
                let Ok(version) = Hlc::parse(&change.version) else {
                    tracing::error!(version = %change.version, "a notification with a damaged version dropped");
                    return false;
                };
                if last.as_ref().is_some_and(|last| *last >= version) {
                    return false;
                }
                *last = Some(version);
                true
            })
            .collect();
        if fresh.is_empty() {
            return None;
        }
        sink.deliver(fresh, tx);
        drop(local);
        Some(rx)
    }

    fn queue_for(&self, node: u64) -> mpsc::UnboundedSender<Outgoing> {
        let mut peers = lock(&self.peers);
        if let Some(tx) = peers.get(&node).filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_to(Arc::clone(&self.node), node, rx));
        peers.insert(node, tx.clone());
        tx
    }
}

/// One peer's queue: batches sent in order, each acknowledged before the next.
async fn send_to(node: Arc<ClusterNode>, to: u64, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (changes, acks): (Vec<Committed>, Vec<oneshot::Sender<()>>) = batch.into_iter().unzip();
        let Some(addr) = node.addr_of(to) else {
            tracing::debug!(to, "notifications for a node that is no member dropped");
            continue;
        };
        let frame = encode(&DataRequest::Notify(changes));
        match node
            .transport()
            .call(&addr, Request::Data(frame), ACK_TIMEOUT)
            .await
        {
            Ok(Response::Data(bytes)) => match decode::<DataResponse>(&bytes) {
                Ok(DataResponse::Received) => {}
                other => tracing::warn!(to, "notifications answered {other:?}"),
            },
            Ok(other) => tracing::warn!(to, "notifications answered {other:?}"),
            // Its clients are gone with it if it is down; if it is slow, they miss the change
            // (counted by the log line, not retried: a later change of the key supersedes it).
            Err(e) => tracing::warn!(to, "notifications not delivered: {e}"),
        }
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

fn fresh(interest: &Interest, now: Instant) -> bool {
    now.saturating_duration_since(interest.2) < INTEREST_TTL
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
