//! The peers port: how the broker takes part in a cluster of brokers without knowing how the
//! other nodes are reached (decision 0044; implemented by `mqstate-mesh`).
//!
//! CONTRACT (called by the broker; implemented outside it):
//!
//! * [`Peers::subscribed`] / [`Peers::unsubscribed`] — one subscription on this node to a filter
//!   (in a shared group) came or went, offline persistent sessions' included (they stay in the
//!   trie until the session ends). Called under the trie's write lock, in the trie's order, so
//!   the implementation sees the same sequence the trie went through; it must neither block nor
//!   call back into the broker. It counts them: one filter held by many sessions is one route.
//!   `subscribed` may return a [`Settled`] the SUBACK waits for (the other nodes know the route).
//! * [`Peers::plan`] — for one publish on this node: which other nodes get a copy, and which of
//!   this node's shared groups another node serves this time (each message goes to one member of
//!   a group cluster-wide). [`Peers::forward`] then hands the copies over, after the local fan-out,
//!   in the order the publishes were routed; its [`Settled`] resolves once every target accepted
//!   the message into its sessions' queues (or was skipped as unreachable), and a QoS 1/2
//!   publisher's PUBACK/PUBREC waits for it.
//! * [`Peers::plan`] numbers a publish it plans for other nodes ([`PublishId`]); the copies and a
//!   redelivery carry the number, and a session that took a QoS 2 publish in skips it when it
//!   comes again, for [`Peers::redelivered_within`] (decision 0066).
//! * [`Peers::claim`] — a client id is connecting here: any other node's connection with it gets
//!   DISCONNECT 0x8E. Awaited before the CONNACK.
//! * [`Peers::retained_ready`] — `None` once the retained store took in what the other nodes
//!   hold (their resyncs after this node started: what was cleared or replaced while it was
//!   away); until then what a client's new subscription waits for before it collects its
//!   retained messages (decision 0072). Nothing else waits for it.
//! * What comes from the other nodes enters through [`crate::Broker::accept_forwarded`] (fan-out
//!   with this node's trie and only the shared groups the origin assigned here, never forwarded
//!   again), [`crate::Broker::adopt_retained`] and [`crate::Broker::take_over_here`].
//!
//! Without a cluster no port is attached and none of this runs: the local publish path reads one
//! empty `OnceLock` (decision 0044).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::message::Message;

/// Resolves when the other nodes took something in (or were skipped as unreachable).
pub type Settled = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A node of the cluster, as the implementation numbers them.
pub type PeerId = u64;

/// A shared group: its topic filter (without `$share/<group>/`) and its name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    pub filter: Arc<str>,
    pub group: Arc<str>,
}

impl GroupKey {
    pub fn is(&self, filter: &str, group: &str) -> bool {
        &*self.filter == filter && &*self.group == group
    }
}

/// The number a node gives a publish it forwards: unique in the cluster (its node, the run of
/// that node, a sequence within the run). A session that took a QoS 2 publish in remembers its
/// number for as long as the publish may be given again, so that a redelivery skips it
/// (decision 0066).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PublishId {
    pub node: u64,
    pub incarnation: u64,
    pub seq: u64,
}

/// Where one publish goes besides this node's own non-shared subscribers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Each other node that gets a copy, with the shared groups it serves for this message.
    pub targets: Vec<(PeerId, Vec<GroupKey>)>,
    /// Shared groups this node has members of that another node serves for this message.
    pub elsewhere: Vec<GroupKey>,
    /// The publish's number, when it has targets (it may then be held and given again).
    pub id: Option<PublishId>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty() && self.elsewhere.is_empty()
    }
}

/// One publish handed to other nodes.
pub struct Forward<'a> {
    pub message: &'a Arc<Message>,
    /// The publishing client (for No Local on the receiving node); `None` for a service or a will.
    pub origin: Option<&'a str>,
    /// Whether the caller waits for the targets to accept it (QoS 1/2).
    pub acknowledged: bool,
    /// Its number, from the [`Plan`].
    pub id: Option<PublishId>,
}

/// The other nodes of a cluster, as the broker uses them. See the module docs for the contract.
pub trait Peers: Send + Sync + 'static {
    fn subscribed(&self, filter: &str, group: Option<&str>) -> Option<Settled>;
    fn unsubscribed(&self, filter: &str, group: Option<&str>);
    fn plan(&self, topic: &str, retain: bool) -> Plan;
    fn forward(
        &self,
        targets: Vec<(PeerId, Vec<GroupKey>)>,
        forward: Forward<'_>,
    ) -> Option<Settled>;
    fn claim(&self, client_id: &str) -> Option<Settled>;
    fn retained_ready(&self) -> Option<Settled>;
    /// How long after a session took a numbered publish in it may be given again: the session
    /// remembers the number that long.
    fn redelivered_within(&self) -> std::time::Duration;
}

impl crate::Broker {
    /// Attaches the other nodes of a cluster (call once, when the cluster node starts): from now
    /// on subscriptions are told to `peers` and publishes planned with it. What this node holds
    /// already is told at once. Returns `false` (and changes nothing) if peers were attached.
    pub fn attach_peers(&self, peers: Arc<dyn Peers>) -> bool {
        self.inner.router.attach_peers(peers)
    }

    /// Fans out a publish another node forwarded: this node's subscribers with its own options
    /// and subscription identifiers, No Local against `origin`, of its shared groups only
    /// `groups`; a retained one updates the retained store. `age` is how long ago the origin
    /// received it (message expiry counts from then); `id` its number. Resolves when what it
    /// changed is durable.
    pub fn accept_forwarded(
        &self,
        message: Message,
        origin: Option<&str>,
        age: std::time::Duration,
        groups: &[GroupKey],
        id: Option<PublishId>,
    ) -> Vec<crate::Durable> {
        let received = self.received_ago(age);
        self.inner
            .router
            .route_forwarded(message, origin, received, groups, id)
            .durable
    }

    /// Fans out again a publish held while a node that had a subscriber of it died: to the
    /// non-shared subscriptions of sessions put back on this node (adopted, handed over) within
    /// the last `put_back_within` only — the others had it the first time (decision 0057) — and
    /// to one member of each of `groups`, shared groups the node that failed was to serve
    /// (decision 0062). A session that took the publish numbered `id` in already (at QoS 2) is
    /// skipped (decision 0066). `age`: how long ago the origin received it. Resolves when what it
    /// changed is durable.
    pub fn accept_redelivered(
        &self,
        message: Message,
        origin: Option<&str>,
        age: std::time::Duration,
        put_back_within: std::time::Duration,
        groups: &[GroupKey],
        id: Option<PublishId>,
    ) -> Vec<crate::Durable> {
        let received = self.received_ago(age);
        let now = self.inner.clock.now();
        let since = now.checked_sub(put_back_within).unwrap_or(now);
        self.inner
            .router
            .route_redelivered(message, origin, received, since, groups, id)
            .durable
    }

    /// Those of `groups` (shared groups) a member of which here took the publish numbered `id`
    /// in (decision 0066): a held publish's group that goes again to this node is skipped here.
    pub fn groups_that_took(&self, groups: &[GroupKey], id: PublishId) -> Vec<GroupKey> {
        self.inner.router.groups_that_took(groups, id)
    }

    /// Takes in a retained message another node holds — or, with an empty payload, a clear it
    /// remembers — if it is newer than what this node holds or cleared on its topic (the later
    /// one wins, decision 0057). `age`: how long ago that node received it.
    pub fn adopt_retained(
        &self,
        message: Message,
        age: std::time::Duration,
    ) -> Option<crate::Durable> {
        let received = self.received_ago(age);
        self.inner
            .router
            .adopt_retained(Arc::new(message), received)
    }

    /// What a node that rejoins must learn of the retained store here: the clears this node
    /// remembers (as empty retained messages, first), then every retained message that has not
    /// expired, each with how long ago it was received or made. [`Broker::adopt_retained`] takes
    /// both.
    pub fn retained_messages(&self) -> Vec<(Arc<Message>, std::time::Duration)> {
        let now = self.inner.clock.now();
        let router = &self.inner.router;
        let clears = router.retained_clears().into_iter().map(|(topic, at)| {
            let clear = Message {
                topic,
                payload: bytes::Bytes::new(),
                qos: crate::QoS::AtMostOnce,
                retain: true,
                properties: Default::default(),
            };
            (Arc::new(clear), now.saturating_duration_since(at))
        });
        let messages = router
            .retained_all(now)
            .into_iter()
            .map(|r| (r.message, now.saturating_duration_since(r.received_at)));
        clears.chain(messages).collect()
    }

    /// Another node took `client_id` over: its connection here, if any, gets DISCONNECT 0x8E as
    /// on a local takeover. Resolves once it detached (or the takeover timeout passed).
    ///
    /// Where sessions live elsewhere too (replicated, decision 0047), this node's copy is then
    /// dropped: the claiming node reads the session from its replicas, and a copy kept here would
    /// keep its subscriptions routed to this node, whose next write of it would be fenced (a
    /// publisher answered 0x80 for a session that had moved). The copy's writes land before this
    /// resolves (bounded by the takeover timeout), so the claiming node reads the session as it
    /// was left here; a delayed will pending here goes with the copy, and a clean start's
    /// claimer publishes it.
    pub async fn take_over_here(&self, client_id: &str) {
        // The copy the claim makes obsolete is the one held now: one that a CONNECT here puts
        // in meanwhile (it claimed the client id back) is not dropped.
        let copy = self.inner.registry.copy_of(client_id);
        let (done, wait) = tokio::sync::oneshot::channel();
        let control = crate::registry::Control::TakeOver { done };
        if self.inner.registry.send_control(client_id, None, control) {
            let _ = tokio::time::timeout(self.inner.config.takeover_timeout, wait).await;
        }
        if let Some(source) = &self.inner.elsewhere {
            if let Some(copy) = copy {
                self.forget_session(client_id, copy);
            }
            // What was recorded here of the session (its client's leaving, a delayed will that
            // came due) lands in its row before the claim is answered: the claiming node reads
            // the row next, and decides from it whether a delayed will this copy held is still
            // pending (a clean start publishes it, decision 0063). Dropped first, the copy
            // records nothing more meanwhile.
            let landed = source.landed(client_id);
            let _ = tokio::time::timeout(self.inner.config.takeover_timeout, landed).await;
        }
    }

    fn received_ago(&self, age: std::time::Duration) -> (std::time::Instant, u64) {
        let (now, now_ms) = (self.inner.clock.now(), self.inner.clock.now_ms());
        let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        (
            now.checked_sub(age).unwrap_or(now),
            now_ms.saturating_sub(age_ms),
        )
    }
}
