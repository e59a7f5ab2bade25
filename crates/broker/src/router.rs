//! Routing: the subscription trie and the retained store, and fan-out of one message into the
//! queues of the sessions it matches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use crate::message::{Message, QoS};
use mqstate_clock::SharedClock;

use crate::peers::{Forward, GroupKey, Peers, PublishId, Settled};
use crate::trie::Shared;

use crate::persist::{wall, Durable, SessionChange, SessionJournal};
use crate::queue::QueueLimit;
use crate::retained::{Retained, RetainedStore};
use crate::session::{Delivery, SessionHandle, SubscriptionOptions};
use crate::topic::ParsedFilter;
use crate::trie::Trie;

/// What the trie stores per subscription.
pub(crate) struct Subscriber {
    options: SubscriptionOptions,
    session: Arc<SessionHandle>,
}

/// One session's share of a message, merged over its matching subscriptions.
struct Target {
    session: Arc<SessionHandle>,
    shared: bool,
    qos: QoS,
    retain_as_published: bool,
    subscription_ids: Vec<u32>,
    /// A redelivered QoS 2 publish's shared group: every member of it here. The group is
    /// skipped if any of them took the publish in (the trie's turn may pick another one).
    members: Vec<Arc<SessionHandle>>,
}

pub(crate) struct Router {
    trie: RwLock<Trie<Subscriber>>,
    retained: Mutex<RetainedStore>,
    limit: QueueLimit,
    /// Queue limit for messages published by services (see [`Router::new`]).
    service_limit: QueueLimit,
    journal: Option<Arc<dyn SessionJournal>>,
    /// When a message was received (its expiry counts from then).
    clock: SharedClock,
    /// The other nodes of a cluster; never set on a single node (decision 0044).
    peers: OnceLock<Arc<dyn Peers>>,
    /// In a cluster, when each session was last put back on this node (adopted, handed over):
    /// a publish held for a node that died goes again only to these (decision 0057).
    put_back: Mutex<HashMap<Arc<str>, Instant>>,
}

/// How long the instant a session was put back is kept (a publish is redelivered within
/// the mesh's settle bound, well under this).
const PUT_BACK_MEMORY: std::time::Duration = std::time::Duration::from_secs(120);

/// Which shared groups a fan-out serves.
#[derive(Clone, Copy)]
enum Scope<'a> {
    /// Every group that matches (no cluster, or no other node holds a matching group).
    All,
    /// A publish on this node: all but these, which other nodes serve this time.
    AllBut(&'a [GroupKey]),
    /// A publish forwarded by another node: only these, which it assigned to this node.
    Only(&'a [GroupKey]),
    /// A publish redelivered: of the non-shared subscriptions only those of sessions put back
    /// here since then, and of the shared groups only these (a node that failed was to serve).
    Redelivered(Instant, &'a [GroupKey]),
}

impl Scope<'_> {
    fn serves(self, shared: Shared<'_>) -> bool {
        match (self, shared) {
            (_, None) | (Scope::All, _) => true,
            (Scope::AllBut(elsewhere), Some((f, g))) => !elsewhere.iter().any(|k| k.is(f, g)),
            (Scope::Only(mine) | Scope::Redelivered(_, mine), Some((f, g))) => {
                mine.iter().any(|k| k.is(f, g))
            }
        }
    }
}

/// What routing one message did.
pub(crate) struct Routed {
    /// Sessions the message was offered to.
    pub offered: usize,
    /// When each durable change it caused (retained store, persistent session queues) is durable.
    pub durable: Vec<Durable>,
}

impl Router {
    /// Client publishes may fill a session queue up to `limit`. Service publishes (replies to a
    /// client's own requests) may use `service_headroom` more messages, and are not bounded by bytes:
    /// the connection stops acknowledging service requests while its queue holds `limit.messages`,
    /// so a client has at most its Receive Maximum of replies still coming, and they are owed QoS 1
    /// messages that must not be dropped.
    pub(crate) fn new(
        limit: QueueLimit,
        service_headroom: usize,
        journal: Option<Arc<dyn SessionJournal>>,
        clock: SharedClock,
    ) -> Self {
        Self {
            trie: RwLock::default(),
            retained: Mutex::default(),
            limit,
            service_limit: QueueLimit::messages(limit.messages.saturating_add(service_headroom)),
            journal,
            clock,
            peers: OnceLock::new(),
            put_back: Mutex::default(),
        }
    }

    /// `client_id`'s session was put back on this node `at` (remembered in a cluster only).
    pub(crate) fn note_put_back(&self, client_id: Arc<str>, at: Instant) {
        if self.peers.get().is_none() {
            return;
        }
        let mut put_back = self.put_back.lock().unwrap_or_else(|p| p.into_inner());
        if put_back.len() >= 1024 {
            put_back.retain(|_, when| at.saturating_duration_since(*when) < PUT_BACK_MEMORY);
        }
        put_back.insert(client_id, at);
    }

    /// Fans out a publish again, to the non-shared subscriptions of sessions put back on this
    /// node at or after `since` only, and to one member of each of `groups` — at QoS 2, to none
    /// if a member here took it in already (decision 0066): a publish held while the node that
    /// had its subscriber died (decisions 0057, 0062). Never forwarded.
    pub(crate) fn route_redelivered(
        &self,
        message: Message,
        origin: Option<&str>,
        (at, at_ms): (Instant, u64),
        since: Instant,
        groups: &[GroupKey],
        id: Option<PublishId>,
    ) -> Routed {
        self.fan_out(
            Arc::new(message),
            origin,
            (at, Some(at_ms)),
            Scope::Redelivered(since, groups),
            id,
        )
    }

    /// Those of `groups` a member of which took the publish numbered `id` in.
    pub(crate) fn groups_that_took(&self, groups: &[GroupKey], id: PublishId) -> Vec<GroupKey> {
        // The sessions are locked after the trie's lock is let go, as a fan-out does.
        let members: Vec<(&GroupKey, Vec<Arc<SessionHandle>>)> = {
            let trie = self.trie.read().unwrap_or_else(|p| p.into_inner());
            groups
                .iter()
                .map(|key| {
                    let members = trie.group_members(&key.filter, &key.group);
                    (
                        key,
                        members.iter().map(|(_, m)| m.session.clone()).collect(),
                    )
                })
                .collect()
        };
        members
            .into_iter()
            .filter(|(_, members)| members.iter().any(|m| m.has_taken(&id)))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Attaches the other nodes of a cluster and tells them, one call per subscription, what this
    /// node holds already: under the trie's lock, so that no subscription is told twice or
    /// missed. Only the first call counts.
    pub(crate) fn attach_peers(&self, peers: Arc<dyn Peers>) -> bool {
        let trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        if self.peers.set(peers.clone()).is_err() {
            return false;
        }
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keep_clears();
        trie.for_each_subscription(|filter, group| drop(peers.subscribed(filter, group)));
        true
    }

    /// The queue limit for a message from `publisher` (`None` = a service).
    pub(crate) fn queue_limit(&self, publisher: Option<&str>) -> QueueLimit {
        if publisher.is_none() {
            self.service_limit
        } else {
            self.limit
        }
    }

    /// Adds (or replaces) a subscription; returns whether it is new and, in a cluster, when the
    /// other nodes know of it.
    pub(crate) fn subscribe(
        &self,
        session: &Arc<SessionHandle>,
        filter: ParsedFilter<'_>,
        options: SubscriptionOptions,
    ) -> (bool, Option<Settled>) {
        let sub = Subscriber {
            options,
            session: session.clone(),
        };
        // A poisoned trie lock means a panic mid-update elsewhere; the trie stays structurally
        // valid (every update is a single insert/remove), so keep serving.
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        let is_new = trie.insert(filter.filter, filter.group, &session.client_id, sub);
        let settled = match self.peers.get() {
            Some(peers) if is_new => peers.subscribed(filter.filter, filter.group),
            _ => None,
        };
        (is_new, settled)
    }

    pub(crate) fn unsubscribe(&self, client_id: &str, filter: ParsedFilter<'_>) -> bool {
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        let removed = trie.remove(filter.filter, filter.group, client_id);
        self.unsubscribed(removed, filter);
        removed
    }

    /// The other nodes, in a cluster.
    pub(crate) fn peers(&self) -> Option<&Arc<dyn Peers>> {
        self.peers.get()
    }

    /// Tells the other nodes a subscription went (called under the trie's lock).
    fn unsubscribed(&self, removed: bool, filter: ParsedFilter<'_>) {
        if let (true, Some(peers)) = (removed, self.peers.get()) {
            peers.unsubscribed(filter.filter, filter.group);
        }
    }

    /// Removes all of an ended session's subscriptions.
    pub(crate) fn remove_session(&self, session: &SessionHandle) {
        let filters: Vec<_> = session.lock().subscriptions.keys().cloned().collect();
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        for raw in &filters {
            if let Some(f) = crate::topic::parse_filter(raw) {
                let removed = trie.remove(f.filter, f.group, &session.client_id);
                self.unsubscribed(removed, f);
            }
        }
    }

    /// Removes the subscriptions of a session handed over to another node, but none that a new
    /// session of the same client made meanwhile.
    pub(crate) fn remove_handed_over(&self, session: &Arc<SessionHandle>) {
        let filters: Vec<_> = session.lock().subscriptions.keys().cloned().collect();
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        for raw in &filters {
            if let Some(f) = crate::topic::parse_filter(raw) {
                let removed = trie.remove_if(f.filter, f.group, &session.client_id, |sub| {
                    Arc::ptr_eq(&sub.session, session)
                });
                self.unsubscribed(removed, f);
            }
        }
    }

    pub(crate) fn retained_matching(&self, filter: &str, now: Instant) -> Vec<Retained> {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .matching(filter, now)
    }

    /// Routes `message` to every matching session (updating the retained store first if it is
    /// retained), and in a cluster to the other nodes that have matching subscriptions.
    /// `publisher` is the sending client, for No Local. Never blocks on a subscriber: it only
    /// enqueues.
    pub(crate) fn route(&self, message: Message, publisher: Option<&str>) -> Routed {
        // The wall time only if a retained message is journalled (read there).
        let received = (self.clock.now(), None);
        let Some(peers) = self.peers.get() else {
            return self.fan_out(Arc::new(message), publisher, received, Scope::All, None);
        };
        let plan = peers.plan(&message.topic, message.retain);
        let message = Arc::new(message);
        let mut routed = self.fan_out(
            message.clone(),
            publisher,
            received,
            Scope::AllBut(&plan.elsewhere),
            plan.id,
        );
        if !plan.targets.is_empty() {
            routed.offered += plan.targets.len();
            let forward = Forward {
                message: &message,
                origin: publisher,
                acknowledged: message.qos != QoS::AtMostOnce,
                id: plan.id,
            };
            if let Some(settled) = peers.forward(plan.targets, forward) {
                routed.durable.push(Box::pin(async move {
                    settled.await;
                    Ok(())
                }));
            }
        }
        routed
    }

    /// Fans out a publish another node forwarded: this node's subscribers, and of its shared
    /// groups only those the origin assigned here (`groups`). Never forwarded again.
    pub(crate) fn route_forwarded(
        &self,
        message: Message,
        origin: Option<&str>,
        (at, at_ms): (Instant, u64),
        groups: &[GroupKey],
        id: Option<PublishId>,
    ) -> Routed {
        self.fan_out(
            Arc::new(message),
            origin,
            (at, Some(at_ms)),
            Scope::Only(groups),
            id,
        )
    }

    /// Takes in a retained message (or a clear: empty payload) another node holds, if it is
    /// newer than what this node holds or cleared on its topic: a node that rejoins learns what
    /// was retained, replaced or cleared while it was away (decision 0057).
    pub(crate) fn adopt_retained(
        &self,
        message: Arc<Message>,
        received: (Instant, u64),
    ) -> Option<Durable> {
        let mut retained = self.retained.lock().unwrap_or_else(|p| p.into_inner());
        if !retained.adopt(&message, received.0) {
            return None;
        }
        let change = if message.payload.is_empty() {
            SessionChange::RetainedCleared {
                topic: message.topic.clone(),
                at_ms: retained.keeps_clears().then_some(received.1),
            }
        } else {
            SessionChange::RetainedSet {
                message,
                received_at_ms: received.1,
            }
        };
        // Recorded under the store's lock, so the journal sees a topic's changes in order.
        self.journal
            .as_ref()
            .map(|journal| journal.record(vec![change]))
    }

    /// The clears of retained messages this node remembers (a cluster node), with when they
    /// were made.
    pub(crate) fn retained_clears(&self) -> Vec<(bytestring::ByteString, Instant)> {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clears()
    }

    /// Every retained message that has not expired, with when it was received.
    pub(crate) fn retained_all(&self, now: Instant) -> Vec<Retained> {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all(now)
    }

    fn fan_out(
        &self,
        message: Arc<Message>,
        publisher: Option<&str>,
        (now, now_ms): (Instant, Option<u64>),
        scope: Scope<'_>,
        id: Option<PublishId>,
    ) -> Routed {
        let limit = self.queue_limit(publisher);
        // A numbered publish (one that may be given again) is remembered by the sessions that
        // take it in at QoS 2, and skipped by those that did already (decision 0066).
        let numbered = match (id, self.peers.get()) {
            (Some(id), Some(peers)) if message.qos == QoS::ExactlyOnce => {
                Some((id, peers.redelivered_within()))
            }
            _ => None,
        };
        let mut durable = Vec::new();
        if message.retain {
            let mut retained = self.retained.lock().unwrap_or_else(|p| p.into_inner());
            retained.apply(&message, now);
            // Recorded under the store's lock, so the journal sees a topic's changes in order.
            if let Some(journal) = &self.journal {
                let now_ms = now_ms.unwrap_or_else(|| self.clock.now_ms());
                let change = if message.payload.is_empty() {
                    SessionChange::RetainedCleared {
                        topic: message.topic.clone(),
                        at_ms: retained.keeps_clears().then_some(now_ms),
                    }
                } else {
                    SessionChange::RetainedSet {
                        message: message.clone(),
                        received_at_ms: now_ms,
                    }
                };
                durable.push(journal.record(vec![change]));
            }
        }
        let mut targets: Vec<Target> = Vec::new();
        {
            let put_back = match scope {
                Scope::Redelivered(..) => {
                    Some(self.put_back.lock().unwrap_or_else(|p| p.into_inner()))
                }
                _ => None,
            };
            let trie = self.trie.read().unwrap_or_else(|p| p.into_inner());
            trie.for_each_match(&message.topic, |client, sub, group| {
                let shared = group.is_some();
                if (!shared && sub.options.no_local && publisher == Some(&**client))
                    || !scope.serves(group)
                {
                    return;
                }
                if let (Scope::Redelivered(since, _), Some(put_back), false) =
                    (scope, &put_back, shared)
                {
                    if put_back.get(&**client).is_none_or(|at| *at < since) {
                        return;
                    }
                }
                let members = match (scope, group, numbered) {
                    (Scope::Redelivered(..), Some((filter, name)), Some(_)) => trie
                        .group_members(filter, name)
                        .iter()
                        .map(|(_, member)| member.session.clone())
                        .collect(),
                    _ => Vec::new(),
                };
                targets.push(Target {
                    session: sub.session.clone(),
                    shared,
                    qos: message.qos.min(sub.options.qos),
                    retain_as_published: sub.options.retain_as_published,
                    subscription_ids: sub.options.subscription_id.into_iter().collect(),
                    members,
                });
            });
        }
        // A client with several matching (non-shared) subscriptions gets the message once, at
        // the highest granted QoS, with every subscription id. Sessions get it in client id order
        // (stable: the trie's walk orders one client's subscriptions), so the order of the
        // journal records it causes is a function of the subscriptions, not of addresses. (The
        // address only separates an ended session from its successor while a clean start
        // replaces it, so that each one's subscriptions stay together to be merged.) Each trie
        // node yields its subscribers in client id order, so the targets are a few sorted runs
        // (one when a single filter matches), which the sort merges without sorting them again.
        targets.sort_by(|a, b| {
            let at = Arc::as_ptr(&a.session) as usize;
            let bt = Arc::as_ptr(&b.session) as usize;
            (&*a.session.client_id, at, a.shared).cmp(&(&*b.session.client_id, bt, b.shared))
        });
        let mut offered = 0;
        let mut iter = targets.into_iter().peekable();
        while let Some(mut t) = iter.next() {
            while let Some(next) =
                iter.next_if(|n| !t.shared && !n.shared && Arc::ptr_eq(&n.session, &t.session))
            {
                t.qos = t.qos.max(next.qos);
                t.retain_as_published |= next.retain_as_published;
                t.subscription_ids.extend(next.subscription_ids);
            }
            let delivery = Delivery {
                message: message.clone(),
                qos: t.qos,
                retain: message.retain && t.retain_as_published,
                subscription_ids: t.subscription_ids,
                received_at: now,
                seq: 0,
            };
            if let Some((id, _)) = numbered {
                if t.members.iter().any(|member| member.has_taken(&id)) {
                    continue;
                }
            }
            let numbered = numbered.filter(|_| t.qos == QoS::ExactlyOnce);
            durable.extend(t.session.deliver(delivery, limit, numbered).1);
            offered += 1;
        }
        Routed { offered, durable }
    }

    /// The changes that recreate the retained store from nothing.
    pub(crate) fn retained_image(&self, now: Instant, now_ms: u64) -> Vec<SessionChange> {
        let mut retained = self.retained.lock().unwrap_or_else(|p| p.into_inner());
        // The clears remembered (at most `CLEARS_KEPT`: the journal's tombstones are compacted
        // to those by every snapshot), then the messages.
        let clears =
            retained
                .clears()
                .into_iter()
                .map(|(topic, at)| SessionChange::RetainedCleared {
                    topic,
                    at_ms: Some(wall::to_ms(at, now, now_ms)),
                });
        let mut image: Vec<SessionChange> = clears.collect();
        image.extend(
            retained
                .all(now)
                .into_iter()
                .map(|r| SessionChange::RetainedSet {
                    message: r.message,
                    received_at_ms: wall::to_ms(r.received_at, now, now_ms),
                }),
        );
        image
    }

    /// Puts back a retained message read from the journal.
    pub(crate) fn restore_retained(&self, message: Arc<Message>, received_at: Instant) {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(&message, received_at);
    }

    /// Puts back a clear read from the journal (a cluster node's), made at `at`.
    pub(crate) fn restore_clear(&self, topic: &bytestring::ByteString, at: Instant) {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restore_clear(topic, at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::QoS;
    use crate::persist::Restored;
    use crate::topic::parse_filter;
    use bytes::Bytes;
    use mqstate_clock::ManualClock;
    use std::time::Duration;

    /// Keeps what it is told, in order.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<SessionChange>>);

    impl SessionJournal for Recorder {
        fn record(&self, changes: Vec<SessionChange>) -> Durable {
            self.0.lock().unwrap().extend(changes);
            Box::pin(async { Ok(()) })
        }
    }

    fn options(qos: QoS) -> SubscriptionOptions {
        SubscriptionOptions {
            qos,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
            subscription_id: None,
        }
    }

    /// Decision 0063: a cluster node journals a clear with its time, and a restarted node
    /// remembers it, so a stale copy offered by a node that was away does not come back.
    #[tokio::test(start_paused = true)]
    async fn a_clear_is_journalled_with_its_time_and_outlives_a_restart() {
        let recorder = Arc::new(Recorder::default());
        let journal: Arc<dyn SessionJournal> = recorder.clone();
        let clock: SharedClock = Arc::new(ManualClock::starting_at(1_000));
        let router = Router::new(
            QueueLimit::messages(10),
            0,
            Some(journal.clone()),
            clock.clone(),
        );
        router.retained.lock().unwrap().keep_clears();
        let retained = |payload: &'static [u8]| Message {
            topic: "r".into(),
            payload: Bytes::from_static(payload),
            qos: QoS::AtMostOnce,
            retain: true,
            properties: Default::default(),
        };
        drop(router.route(retained(b"v1"), None));
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(router.route(retained(b""), None));

        let mut restored = Restored::default();
        for change in recorder.0.lock().unwrap().drain(..) {
            restored.apply(change);
        }
        assert!(restored.retained.is_empty());
        assert_eq!(restored.retained_clears.get("r"), Some(&1_010));

        tokio::time::advance(Duration::from_millis(10)).await;
        let again = Router::new(QueueLimit::messages(10), 0, Some(journal), clock.clone());
        let (now, now_ms) = (clock.now(), clock.now_ms());
        for (topic, at_ms) in &restored.retained_clears {
            again.restore_clear(topic, wall::to_instant(*at_ms, now, now_ms));
        }
        assert_eq!(
            again.retained_image(now, now_ms),
            [SessionChange::RetainedCleared {
                topic: "r".into(),
                at_ms: Some(1_010)
            }],
            "a snapshot keeps the clear"
        );
        let stale = (now - Duration::from_millis(20), 1_000);
        assert!(again
            .adopt_retained(Arc::new(retained(b"v1")), stale)
            .is_none());
        assert!(again.retained_matching("r", now).is_empty(), "not back");
        assert!(again
            .adopt_retained(Arc::new(retained(b"v2")), (now, now_ms))
            .is_some());
        assert_eq!(again.retained_matching("r", now).len(), 1, "a later one is");
    }

    /// A router whose sessions' changes a [`Recorder`] keeps, on a manual clock at 1 000 ms.
    struct Fixture {
        recorder: Arc<Recorder>,
        journal: Arc<dyn SessionJournal>,
        clock: SharedClock,
        router: Router,
    }

    fn router_for_test() -> Fixture {
        let recorder = Arc::new(Recorder::default());
        let journal: Arc<dyn SessionJournal> = recorder.clone();
        let clock: SharedClock = Arc::new(ManualClock::starting_at(1_000));
        let router = Router::new(
            QueueLimit::messages(10),
            0,
            Some(journal.clone()),
            clock.clone(),
        );
        Fixture {
            recorder,
            journal,
            clock,
            router,
        }
    }

    impl Fixture {
        /// A session `id` subscribed at QoS 1 to `t/+`, or, for `q`, in the shared group
        /// `$share/g/t/#`.
        fn subscriber(&self, id: &str) {
            let session = Arc::new(SessionHandle::new(
                id.into(),
                60,
                Some(self.journal.clone()),
                self.clock.clone(),
            ));
            drop(session.lock()); // hands its Created to the journal
            let filter = if id == "q" { "$share/g/t/#" } else { "t/+" };
            self.router.subscribe(
                &session,
                parse_filter(filter).unwrap(),
                options(QoS::AtLeastOnce),
            );
        }
    }

    /// A QoS 1 message on `t/1`.
    fn message() -> Message {
        Message {
            topic: "t/1".into(),
            payload: Bytes::from_static(b"x"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Default::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn fan_out_reaches_the_journal_in_client_id_order() {
        let test = router_for_test();
        // Created in an order that is neither sorted nor the order of their addresses.
        for id in ["m", "b", "z", "a", "q"] {
            test.subscriber(id);
        }
        test.recorder.0.lock().unwrap().clear();
        let routed = test.router.route(message(), None);
        assert_eq!(routed.offered, 5);
        let order: Vec<String> = test
            .recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|c| match c {
                SessionChange::Appended {
                    client_id, message, ..
                } => {
                    assert_eq!(message.received_at_ms, 1_000, "dated by the router's clock");
                    client_id.to_string()
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(order, ["a", "b", "m", "q", "z"]);
    }

    /// A port that knows no other node: only so that the router counts as a cluster node's.
    struct Alone;

    impl Peers for Alone {
        fn subscribed(&self, _: &str, _: Option<&str>) -> Option<Settled> {
            None
        }
        fn unsubscribed(&self, _: &str, _: Option<&str>) {}
        fn plan(&self, _: &str, _: bool) -> crate::peers::Plan {
            crate::peers::Plan::default()
        }
        fn forward(
            &self,
            _: Vec<(crate::peers::PeerId, Vec<GroupKey>)>,
            _: Forward<'_>,
        ) -> Option<Settled> {
            None
        }
        fn claim(&self, _: &str) -> Option<Settled> {
            None
        }
        fn retained_ready(&self) -> Option<Settled> {
            None
        }
        fn redelivered_within(&self) -> std::time::Duration {
            std::time::Duration::from_secs(60)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_reaches_only_sessions_put_back_since() {
        let test = router_for_test();
        let (router, clock) = (&test.router, &test.clock);
        assert!(router.attach_peers(Arc::new(Alone)));
        let since = clock.now();
        let second = std::time::Duration::from_secs(1);
        // a: never put back; b: put back after; c: before; q: after, but in a shared group.
        for (id, put_back) in [
            ("a", None),
            ("b", Some(since + second)),
            ("c", since.checked_sub(second)),
            ("q", Some(since + second)),
        ] {
            test.subscriber(id);
            if let Some(at) = put_back {
                router.note_put_back(id.into(), at);
            }
        }
        test.recorder.0.lock().unwrap().clear();
        let routed =
            router.route_redelivered(message(), None, (clock.now(), 1_000), since, &[], None);
        assert_eq!(routed.offered, 1);
        let got: Vec<String> = test
            .recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match c {
                SessionChange::Appended { client_id, .. } => Some(client_id.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(got, ["b"]);

        // A shared group a failed node was to serve: one of its members gets it, put back or not.
        test.recorder.0.lock().unwrap().clear();
        let group = GroupKey {
            filter: "t/#".into(),
            group: "g".into(),
        };
        let routed = router.route_redelivered(
            message(),
            None,
            (clock.now(), 1_000),
            since + second * 2,
            &[group],
            None,
        );
        assert_eq!(routed.offered, 1);
        let got: Vec<String> = test
            .recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match c {
                SessionChange::Appended { client_id, .. } => Some(client_id.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(got, ["q"]);
    }

    /// Decision 0066: a redelivered QoS 2 publish of a shared group is skipped by the group when
    /// any member here took it in, not only the one the group's turn picks.
    #[tokio::test(start_paused = true)]
    async fn a_redelivered_qos2_group_message_is_skipped_if_any_member_took_it() {
        let test = router_for_test();
        let (router, clock) = (&test.router, &test.clock);
        assert!(router.attach_peers(Arc::new(Alone)));
        for id in ["q1", "q2"] {
            let session = Arc::new(SessionHandle::new(
                id.into(),
                60,
                Some(test.journal.clone()),
                clock.clone(),
            ));
            drop(session.lock());
            router.subscribe(
                &session,
                parse_filter("$share/g/t/#").unwrap(),
                options(QoS::ExactlyOnce),
            );
        }
        let group = GroupKey {
            filter: "t/#".into(),
            group: "g".into(),
        };
        let id = PublishId {
            node: 2,
            incarnation: 1,
            seq: 7,
        };
        let qos2 = || Message {
            qos: QoS::ExactlyOnce,
            ..message()
        };
        let appended = || -> Vec<String> {
            test.recorder
                .0
                .lock()
                .unwrap()
                .drain(..)
                .filter_map(|c| match c {
                    SessionChange::Appended { client_id, .. } => Some(client_id.to_string()),
                    _ => None,
                })
                .collect()
        };
        let redeliver = || {
            router.route_redelivered(
                qos2(),
                None,
                (clock.now(), 1_000),
                clock.now(),
                std::slice::from_ref(&group),
                Some(id),
            )
        };
        appended();
        assert_eq!(redeliver().offered, 1);
        assert_eq!(appended().len(), 1, "one member took it in");
        // Given again: the group's turn picks the other member, which did not take it.
        for _ in 0..2 {
            redeliver();
            assert_eq!(appended(), Vec::<String>::new(), "the group had it");
        }
        let took = router.groups_that_took(std::slice::from_ref(&group), id);
        assert_eq!(took, std::slice::from_ref(&group));
        let other = PublishId { seq: 8, ..id };
        assert!(router.groups_that_took(&[group], other).is_empty());
    }
}
