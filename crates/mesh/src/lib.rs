//! mqstate-mesh: the brokers of a cluster as one broker (decision 0044). It implements the
//! broker's peers port ([`mqstate_broker::Peers`]) over the cluster transport
//! (`Request::Mesh`), and answers the other nodes' batches as the node's
//! [`mqstate_cluster::MeshHandler`].
//!
//! * Each node keeps one ordered stream to every other member ([`peer`]): a sender task sends
//!   one [`wire::Batch`] at a time and waits for its answer, so what one node sends another —
//!   route changes, publishes, client-id claims — arrives in the order it was queued (order per
//!   publisher and topic holds across nodes).
//! * Routes ([`table`]): the filters this node's sessions hold, counted; the first subscription
//!   to a filter sends `Added` to every live member, the last one gone `Removed`. A receiver that
//!   does not follow a sender's stream (it restarted, or a batch got lost) answers `Resync`, and
//!   the sender starts its next batch with every route it holds, the retained clears it
//!   remembers and its retained messages (the later of a message and a clear wins, decision 0057).
//! * Members come from the control plane ([`mqstate_cluster::ClusterNode::members`]); a member
//!   the control plane counts down, or that did not answer, is skipped: nothing is queued for it
//!   and nobody waits for it, and it gets a resync when it answers again.
//! * A publish on this node: the broker asks [`Peers::plan`] (which nodes have a matching route,
//!   and which node serves each matching shared group this time, round robin over the nodes
//!   holding members), fans out locally, then [`Peers::forward`] queues one copy per target.

pub mod table;
pub mod wire;

mod inbound;
mod peer;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mqstate_broker::{Broker, Forward, GroupKey, PeerId, Peers, Plan, Settled};
use mqstate_cluster::{ClusterNode, NodeId};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::peer::Outbox;
use crate::table::Tables;
use crate::wire::{Item, Route, WireMessage, WirePublish};

/// How long one batch may take to be answered (the receiver may wait for fsync, or for a
/// connection it takes over to detach, up to the broker's takeover timeout).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(8);
/// How long a SUBACK, PUBACK or CONNACK waits at most for the other nodes.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often membership is read from the control plane.
const MEMBERSHIP_PERIOD: Duration = Duration::from_millis(250);

/// The mesh of one node.
pub struct Mesh {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

struct Shared {
    me: NodeId,
    /// This run of the node: a receiver that sees a new one knows the sender restarted.
    incarnation: u64,
    broker: Broker,
    node: Arc<ClusterNode>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    tables: Tables,
    /// One outbox (and sender task) per other member.
    outboxes: BTreeMap<NodeId, Outbox>,
    /// Per sender: its incarnation and the next batch number expected.
    inbound: HashMap<NodeId, (u64, u64)>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Mesh {
    /// Attaches the mesh to `broker` and `node`, and starts following membership.
    pub fn start(node: Arc<ClusterNode>, broker: Broker, incarnation: u64) -> Mesh {
        let shared = Arc::new(Shared {
            me: node.id(),
            incarnation,
            broker: broker.clone(),
            node: Arc::clone(&node),
            state: Mutex::default(),
        });
        node.set_mesh_handler(Arc::new(inbound::Inbound(Arc::clone(&shared))));
        if !broker.attach_peers(Arc::new(Port(Arc::clone(&shared)))) {
            tracing::warn!("the broker has peers attached already; this mesh stays idle");
        }
        let tasks = vec![tokio::spawn(follow_membership(Arc::clone(&shared)))];
        Mesh { shared, tasks }
    }

    pub async fn stop(self) {
        for task in &self.tasks {
            task.abort();
        }
        let outboxes = std::mem::take(&mut self.shared.lock().outboxes);
        for (_, outbox) in outboxes {
            outbox.task.abort();
        }
    }
}

/// Reads the members from the control plane: starts an outbox for a new member, forgets a
/// removed one, and marks the ones the control plane counts down as not live.
async fn follow_membership(shared: Arc<Shared>) {
    loop {
        let members = shared.node.members();
        {
            let mut state = shared.lock();
            let state = &mut *state;
            let ids: Vec<NodeId> = members.iter().map(|m| m.0).collect();
            let gone: Vec<NodeId> = state
                .outboxes
                .keys()
                .copied()
                .filter(|id| !ids.contains(id))
                .collect();
            for id in gone {
                if let Some(outbox) = state.outboxes.remove(&id) {
                    outbox.task.abort();
                }
                state.tables.forget(id);
                state.inbound.remove(&id);
                tracing::info!(node = id, "mesh: node left the cluster");
            }
            for (id, addr, up) in members {
                if id == shared.me {
                    continue;
                }
                match state.outboxes.get_mut(&id) {
                    Some(outbox) => {
                        outbox.addr = addr;
                        outbox.set_member_up(up);
                    }
                    None => {
                        let outbox = Outbox::start(Arc::clone(&shared), id, addr, up);
                        state.outboxes.insert(id, outbox);
                    }
                }
            }
        }
        tokio::time::sleep(MEMBERSHIP_PERIOD).await;
    }
}

/// Waits for every receiver (a dropped sender counts as a node skipped), within
/// [`SETTLE_TIMEOUT`].
fn settled(waits: Vec<oneshot::Receiver<()>>) -> Option<Settled> {
    if waits.is_empty() {
        return None;
    }
    Some(Box::pin(async move {
        let all = async {
            for wait in waits {
                let _ = wait.await;
            }
        };
        if tokio::time::timeout(SETTLE_TIMEOUT, all).await.is_err() {
            tracing::warn!("mesh: other nodes did not answer within {SETTLE_TIMEOUT:?}; going on");
        }
    }))
}

/// The broker's peers port.
struct Port(Arc<Shared>);

impl Port {
    /// Queues `item` (made per target) for every live member, with a wait for each.
    fn to_all_live(&self, mut item: impl FnMut() -> Option<Item>) -> Option<Settled> {
        let mut state = self.0.lock();
        let mut waits = Vec::new();
        for outbox in state.outboxes.values_mut().filter(|o| o.is_live()) {
            waits.push(outbox.push(item(), true));
        }
        settled(waits.into_iter().flatten().collect())
    }
}

impl Peers for Port {
    fn subscribed(&self, filter: &str, group: Option<&str>) -> Option<Settled> {
        let route = Route::new(filter, group);
        let mut state = self.0.lock();
        if !state.tables.local_added(route.clone()) {
            return None;
        }
        drop(state);
        self.to_all_live(|| Some(Item::Added(route.clone())))
    }

    fn unsubscribed(&self, filter: &str, group: Option<&str>) {
        let route = Route::new(filter, group);
        let mut state = self.0.lock();
        if !state.tables.local_removed(&route) {
            return;
        }
        for outbox in state.outboxes.values_mut().filter(|o| o.is_live()) {
            drop(outbox.push(Some(Item::Removed(route.clone())), false));
        }
    }

    fn plan(&self, topic: &str, retain: bool) -> Plan {
        let mut state = self.0.lock();
        let state = &mut *state;
        let live: Vec<NodeId> = state
            .outboxes
            .iter()
            .filter(|(_, o)| o.is_live())
            .map(|(&id, _)| id)
            .collect();
        if live.is_empty() {
            return Plan::default();
        }
        state.tables.plan(topic, retain, &live)
    }

    fn forward(
        &self,
        targets: Vec<(PeerId, Vec<GroupKey>)>,
        forward: Forward<'_>,
    ) -> Option<Settled> {
        let message = WireMessage::from_message(forward.message, Duration::ZERO);
        let origin = forward.origin.map(str::to_owned);
        let mut state = self.0.lock();
        let mut waits = Vec::new();
        for (node, groups) in targets {
            let Some(outbox) = state.outboxes.get_mut(&node).filter(|o| o.is_live()) else {
                continue;
            };
            let item = Item::Publish(WirePublish {
                message: message.clone(),
                origin: origin.clone(),
                groups: groups
                    .iter()
                    .map(|k| (k.filter.to_string(), k.group.to_string()))
                    .collect(),
            });
            waits.extend(outbox.push(Some(item), forward.acknowledged));
        }
        settled(waits)
    }

    fn claim(&self, client_id: &str) -> Option<Settled> {
        self.to_all_live(|| Some(Item::Claim(client_id.to_owned())))
    }
}
