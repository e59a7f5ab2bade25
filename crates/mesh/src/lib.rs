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
//! * A QoS 1/2 publish that matches a route of a node that just died (or whose copy did not reach
//!   its target) is held: its acknowledgement waits until that node's sessions were adopted, then
//!   it goes again to the sessions put back since it arrived, here and on every live node with a
//!   matching route ([`wire::Item::Redeliver`], decision 0057 "Held publishes"), and each shared
//!   group that node was to serve goes to that node again if it answers again (it may have taken
//!   the copy in: decision 0066), else to one live member (a group held only by nodes down
//!   lately is planned for them, so held too); a node missed again holds it again (decision 0062).

pub mod table;
pub mod wire;

mod inbound;
mod peer;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mqstate_broker::{Broker, Forward, GroupKey, PeerId, Peers, Plan, PublishId, Settled};
use mqstate_cluster::{ClusterNode, NodeId};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

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
/// After a node's lease lapsed, how long until its orphaned sessions are adopted and the
/// adopter's routes reached the others: two rounds of the sessions' `ADOPT_EVERY` (1 s).
const ADOPTION_SLACK: Duration = Duration::from_secs(2);
/// How much earlier than a held publish's receipt a session put back counts as one that may
/// have missed it: a bound on a batch's transit (a call not answered within it failed).
const REDELIVERY_MARGIN: Duration = CALL_TIMEOUT;
/// After a node starts, how long a new subscription's retained messages wait at most for every
/// live member's resync (decision 0072).
const RETAINED_WAIT: Duration = SETTLE_TIMEOUT;

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
    /// From a node's going down until its persistent sessions live on another node (lease +
    /// clock factor + [`ADOPTION_SLACK`]): a QoS 1/2 publish that matched its routes meanwhile
    /// is held and delivered again after (decision 0057).
    adoption_window: Duration,
    /// The next number a forwarded publish gets (decision 0066).
    next_seq: AtomicU64,
    /// When this run of the mesh started: from [`RETAINED_WAIT`] after it on, retained messages
    /// are served without waiting for the others' resyncs.
    started: Instant,
    /// Every live member's resync was taken in once: this node's retained set holds what the
    /// cluster cleared and replaced while it was away (decision 0072). Never false again.
    retained_ready: AtomicBool,
    /// Told `true` when `retained_ready` is set, for the subscriptions waiting for it.
    retained_ready_tx: watch::Sender<bool>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    tables: Tables,
    /// One outbox (and sender task) per other member.
    outboxes: BTreeMap<NodeId, Outbox>,
    /// Per sender: its incarnation and the next batch number expected.
    inbound: HashMap<NodeId, (u64, u64)>,
    /// Membership was read once: the outboxes name every other member.
    members_known: bool,
    /// The senders whose resync this run took in (their retained messages and clears adopted
    /// and durable here).
    resynced_from: HashSet<NodeId>,
}

impl State {
    /// Whether every member this node counts live (up, answering) has resynced it since it
    /// started. A member that stops being live is not waited for: its clears come with its
    /// resync when it answers again.
    fn every_live_member_resynced(&self) -> bool {
        self.members_known
            && self
                .outboxes
                .iter()
                .all(|(id, outbox)| !outbox.is_live() || self.resynced_from.contains(id))
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks whether the retained set is ready (after a resync taken in, or a membership read
    /// that may have counted a member down), and if so tells the waiting subscriptions.
    fn note_retained_ready(&self, state: &State) {
        if self.retained_ready.load(Ordering::Acquire) || !state.every_live_member_resynced() {
            return;
        }
        self.retained_ready.store(true, Ordering::Release);
        self.retained_ready_tx.send_replace(true);
        tracing::info!(
            after = ?self.started.elapsed(),
            "mesh: every live member resynced this node; retained messages are served"
        );
    }
}

impl Mesh {
    /// Attaches the mesh to `broker` and `node`, and starts following membership.
    pub fn start(node: Arc<ClusterNode>, broker: Broker, incarnation: u64) -> Mesh {
        let map = node.map_config();
        let adoption_window =
            Duration::from_millis(map.lease_ms.saturating_add(map.clock_factor_ms))
                + ADOPTION_SLACK;
        let shared = Arc::new(Shared {
            me: node.id(),
            incarnation,
            adoption_window,
            next_seq: AtomicU64::new(0),
            started: Instant::now(),
            retained_ready: AtomicBool::new(false),
            retained_ready_tx: watch::Sender::new(false),
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
            // A read naming no member (a node that never joined, or whose control plane has not
            // loaded its membership yet) waits for nobody: a node that is to join gets its
            // retained messages with the resyncs later, and waiting for a membership that may
            // never come would hold its SUBSCRIBEs the whole cap.
            state.members_known = true;
            shared.note_retained_ready(state);
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

/// How often a held publish is held again at most: a target that fails while it is given again
/// (a second failure in the window) holds it once more, until that node's sessions were adopted.
const MAX_HOLDS: u32 = 3;

/// Targets a copy did not reach, each with the shared groups it was to serve.
type Missed = Vec<(NodeId, Vec<GroupKey>)>;
/// Copies under way: the target, its groups, and what resolves once it took the copy in.
type Waits = Vec<(NodeId, Vec<GroupKey>, oneshot::Receiver<()>)>;

/// A QoS 1/2 publish this node forwarded: its publisher's PUBACK/PUBREC waits until every
/// target took it in or, for a target that did not (it died, or was down lately), until that
/// node's sessions were adopted elsewhere and the publish was given again — to the sessions put
/// back since it arrived, and each shared group the target was to serve to that target again if
/// it answers again, else to another holder (decisions 0057, 0062, 0066). A target that fails
/// then holds it again, [`MAX_HOLDS`] times at most.
struct Held {
    shared: Arc<Shared>,
    message: Arc<mqstate_broker::Message>,
    origin: Option<String>,
    received: Instant,
    id: Option<PublishId>,
}

impl Held {
    async fn settle(self, waits: Waits, missed: Missed) {
        let window = self.shared.adoption_window;
        let settle = async {
            let (mut waits, mut missed) = (waits, missed);
            for holds in 0.. {
                for (node, groups, wait) in waits.drain(..) {
                    if wait.await.is_err() {
                        missed.push((node, groups));
                    }
                }
                if missed.is_empty() {
                    return;
                }
                if holds == MAX_HOLDS {
                    tracing::warn!(
                        topic = %self.message.topic,
                        "mesh: a held publish still missed a node after {MAX_HOLDS} holds; going on"
                    );
                    return;
                }
                let until = {
                    let state = self.shared.lock();
                    missed
                        .iter()
                        .filter_map(|(node, _)| state.outboxes.get(node).and_then(|o| o.last_down))
                        .map(|down| down + window)
                        .max()
                };
                if let Some(until) = until {
                    tokio::time::sleep_until(until).await;
                }
                let again = std::mem::take(&mut missed);
                (waits, missed) = self.redeliver(&again).await;
            }
        };
        let bound = settle_bound(window);
        if tokio::time::timeout(bound, settle).await.is_err() {
            tracing::warn!("mesh: other nodes did not answer within {bound:?}; going on");
        }
    }

    /// Gives the message again, here and to every node with a matching non-shared route, to the
    /// sessions put back since (a little before) it arrived — the adopted ones — and each group
    /// a node `missed_before` was to serve to one holder: that node if it answers again, else
    /// another, live ones first. What it could not hand over, and what to wait for, go back to
    /// [`Held::settle`].
    async fn redeliver(&self, missed_before: &Missed) -> (Waits, Missed) {
        let age = self.received.elapsed();
        let within = age + REDELIVERY_MARGIN;
        let within_ms = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
        let topic = &*self.message.topic;
        let (mut waits, mut missed) = (Vec::new(), Vec::new());
        let took_here = match self.id {
            Some(id) => {
                let groups: Vec<GroupKey> = missed_before
                    .iter()
                    .flat_map(|(_, groups)| groups.iter().cloned())
                    .collect();
                self.shared.broker.groups_that_took(&groups, id)
            }
            None => Vec::new(),
        };
        let here = {
            let mut state = self.shared.lock();
            let state = &mut *state;
            let (live, down) = state.live_and_down(self.shared.adoption_window);
            let replan = state
                .tables
                .replan(topic, missed_before, &took_here, &live, &down);
            if !replan.unserved.is_empty() {
                tracing::warn!(
                    %topic,
                    groups = ?replan.unserved,
                    "mesh: a held publish's shared groups have no member left on any node"
                );
            }
            for (node, groups) in replan.targets {
                let Some(outbox) = state.outboxes.get_mut(&node).filter(|o| o.is_live()) else {
                    missed.push((node, groups));
                    continue;
                };
                let item = Item::Redeliver {
                    publish: WirePublish {
                        message: WireMessage::from_message(&self.message, age),
                        origin: self.origin.clone(),
                        groups: wire_groups(&groups),
                        id: self.id,
                    },
                    put_back_within_ms: within_ms,
                };
                if let Some(wait) = outbox.push(Some(item), true) {
                    waits.push((node, groups, wait));
                }
            }
            replan.here
        };
        let durable = self.shared.broker.accept_redelivered(
            (*self.message).clone(),
            self.origin.as_deref(),
            age,
            within,
            &here,
            self.id,
        );
        for durable in durable {
            if let Err(error) = durable.await {
                tracing::error!(%error, "mesh: a redelivered message is not durable here");
            }
        }
        (waits, missed)
    }
}

/// How long a held publish is held at most, from its receipt until its acknowledgement.
fn settle_bound(window: Duration) -> Duration {
    SETTLE_TIMEOUT + (window + CALL_TIMEOUT) * MAX_HOLDS
}

fn wire_groups(groups: &[GroupKey]) -> Vec<(String, String)> {
    groups
        .iter()
        .map(|k| (k.filter.to_string(), k.group.to_string()))
        .collect()
}

impl State {
    /// The live other nodes, and those not live that stopped being live less than `window`
    /// ago (their sessions may not have been adopted yet).
    fn live_and_down(&self, window: Duration) -> (Vec<NodeId>, Vec<NodeId>) {
        let mut live = Vec::new();
        let mut down = Vec::new();
        for (&id, outbox) in &self.outboxes {
            if outbox.is_live() {
                live.push(id);
            } else if outbox.last_down.is_some_and(|t| t.elapsed() < window) {
                down.push(id);
            }
        }
        (live, down)
    }
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
        // Nodes gone down lately whose sessions may not have been adopted yet: a publish matching
        // their routes is planned for them too, and `forward` holds it (if acknowledged).
        let (live, down) = state.live_and_down(self.0.adoption_window);
        if live.is_empty() && down.is_empty() {
            return Plan::default();
        }
        let mut plan = state.tables.plan(topic, retain, &live, &down);
        if !plan.targets.is_empty() {
            plan.id = Some(PublishId {
                node: self.0.me,
                incarnation: self.0.incarnation,
                seq: self.0.next_seq.fetch_add(1, Ordering::Relaxed),
            });
        }
        plan
    }

    fn forward(
        &self,
        targets: Vec<(PeerId, Vec<GroupKey>)>,
        forward: Forward<'_>,
    ) -> Option<Settled> {
        let received = Instant::now();
        let message = WireMessage::from_message(forward.message, Duration::ZERO);
        let origin = forward.origin.map(str::to_owned);
        let mut state = self.0.lock();
        let mut waits = Vec::new();
        // Nodes a copy did not reach (a QoS 1/2 publish only: the others are not held).
        let mut missed = Vec::new();
        for (node, groups) in targets {
            let Some(outbox) = state.outboxes.get_mut(&node).filter(|o| o.is_live()) else {
                if forward.acknowledged {
                    missed.push((node, groups));
                }
                continue;
            };
            let item = Item::Publish(WirePublish {
                message: message.clone(),
                origin: origin.clone(),
                groups: wire_groups(&groups),
                id: forward.id,
            });
            if let Some(wait) = outbox.push(Some(item), forward.acknowledged) {
                waits.push((node, groups, wait));
            }
        }
        drop(state);
        if !forward.acknowledged {
            return None;
        }
        let held = Held {
            shared: Arc::clone(&self.0),
            message: Arc::clone(forward.message),
            origin,
            received,
            id: forward.id,
        };
        Some(Box::pin(held.settle(waits, missed)))
    }

    fn claim(&self, client_id: &str) -> Option<Settled> {
        self.to_all_live(|| Some(Item::Claim(client_id.to_owned())))
    }

    fn retained_ready(&self) -> Option<Settled> {
        let shared = &self.0;
        if shared.retained_ready.load(Ordering::Acquire) {
            return None;
        }
        let mut ready = shared.retained_ready_tx.subscribe();
        let until = shared.started + RETAINED_WAIT;
        Some(Box::pin(async move {
            if tokio::time::timeout_at(until, ready.wait_for(|ready| *ready))
                .await
                .is_err()
            {
                tracing::warn!(
                    "mesh: not every live member resynced this node within {RETAINED_WAIT:?} of its start; serving its retained messages as they are"
                );
            }
        }))
    }

    /// A publish is given again within its settle bound of its receipt at the origin; a session
    /// takes it in after that receipt. The transit of the redelivery and the clocks' difference
    /// (the number's time is the taker's wall clock, compared by the next node's) are within
    /// one more window and call.
    fn redelivered_within(&self) -> Duration {
        let window = self.0.adoption_window;
        settle_bound(window) + window + CALL_TIMEOUT
    }
}
