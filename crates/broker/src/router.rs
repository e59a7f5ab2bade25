//! Routing: the subscription trie and the retained store, and fan-out of one message into the
//! queues of the sessions it matches.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::message::{Message, QoS};
use mqstate_clock::SharedClock;

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
        }
    }

    /// The queue limit for a message from `publisher` (`None` = a service).
    pub(crate) fn queue_limit(&self, publisher: Option<&str>) -> QueueLimit {
        if publisher.is_none() {
            self.service_limit
        } else {
            self.limit
        }
    }

    /// Adds (or replaces) a subscription; returns whether it is new.
    pub(crate) fn subscribe(
        &self,
        session: &Arc<SessionHandle>,
        filter: ParsedFilter<'_>,
        options: SubscriptionOptions,
    ) -> bool {
        let sub = Subscriber {
            options,
            session: session.clone(),
        };
        // A poisoned trie lock means a panic mid-update elsewhere; the trie stays structurally
        // valid (every update is a single insert/remove), so keep serving.
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        trie.insert(filter.filter, filter.group, &session.client_id, sub)
    }

    pub(crate) fn unsubscribe(&self, client_id: &str, filter: ParsedFilter<'_>) -> bool {
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        trie.remove(filter.filter, filter.group, client_id)
    }

    /// Removes all of an ended session's subscriptions.
    pub(crate) fn remove_session(&self, session: &SessionHandle) {
        let filters: Vec<_> = session.lock().subscriptions.keys().cloned().collect();
        let mut trie = self.trie.write().unwrap_or_else(|p| p.into_inner());
        for raw in &filters {
            if let Some(f) = crate::topic::parse_filter(raw) {
                trie.remove(f.filter, f.group, &session.client_id);
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
                trie.remove_if(f.filter, f.group, &session.client_id, |sub| {
                    Arc::ptr_eq(&sub.session, session)
                });
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
    /// retained). `publisher` is the sending client, for No Local. Never blocks on a subscriber:
    /// it only enqueues.
    pub(crate) fn route(&self, message: Message, publisher: Option<&str>) -> Routed {
        let now = self.clock.now();
        let limit = self.queue_limit(publisher);
        let message = Arc::new(message);
        let mut durable = Vec::new();
        if message.retain {
            let mut retained = self.retained.lock().unwrap_or_else(|p| p.into_inner());
            retained.apply(&message, now);
            // Recorded under the store's lock, so the journal sees a topic's changes in order.
            if let Some(journal) = &self.journal {
                let change = if message.payload.is_empty() {
                    SessionChange::RetainedCleared {
                        topic: message.topic.clone(),
                    }
                } else {
                    SessionChange::RetainedSet {
                        message: message.clone(),
                        received_at_ms: self.clock.now_ms(),
                    }
                };
                durable.push(journal.record(vec![change]));
            }
        }
        let mut targets: Vec<Target> = Vec::new();
        {
            let trie = self.trie.read().unwrap_or_else(|p| p.into_inner());
            trie.for_each_match(&message.topic, |client, sub, shared| {
                if !shared && sub.options.no_local && publisher == Some(&**client) {
                    return;
                }
                targets.push(Target {
                    session: sub.session.clone(),
                    shared,
                    qos: message.qos.min(sub.options.qos),
                    retain_as_published: sub.options.retain_as_published,
                    subscription_ids: sub.options.subscription_id.into_iter().collect(),
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
            durable.extend(t.session.deliver(delivery, limit).1);
            offered += 1;
        }
        Routed { offered, durable }
    }

    /// The changes that recreate the retained store from nothing.
    pub(crate) fn retained_image(&self, now: Instant, now_ms: u64) -> Vec<SessionChange> {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all(now)
            .into_iter()
            .map(|r| SessionChange::RetainedSet {
                message: r.message,
                received_at_ms: wall::to_ms(r.received_at, now, now_ms),
            })
            .collect()
    }

    /// Puts back a retained message read from the journal.
    pub(crate) fn restore_retained(&self, message: Arc<Message>, received_at: Instant) {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(&message, received_at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::QoS;
    use crate::topic::parse_filter;
    use bytes::Bytes;
    use mqstate_clock::ManualClock;

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

    #[tokio::test(start_paused = true)]
    async fn fan_out_reaches_the_journal_in_client_id_order() {
        let recorder = Arc::new(Recorder::default());
        let journal: Arc<dyn SessionJournal> = recorder.clone();
        let clock: SharedClock = Arc::new(ManualClock::starting_at(1_000));
        let router = Router::new(
            QueueLimit::messages(10),
            0,
            Some(journal.clone()),
            clock.clone(),
        );
        // Created in an order that is neither sorted nor the order of their addresses.
        for id in ["m", "b", "z", "a", "q"] {
            let session = Arc::new(SessionHandle::new(
                id.into(),
                60,
                Some(journal.clone()),
                clock.clone(),
            ));
            drop(session.lock()); // hands its Created to the journal
            let filter = if id == "q" { "$share/g/t/#" } else { "t/+" };
            router.subscribe(
                &session,
                parse_filter(filter).unwrap(),
                options(QoS::AtLeastOnce),
            );
        }
        recorder.0.lock().unwrap().clear();
        let routed = router.route(
            Message {
                topic: "t/1".into(),
                payload: Bytes::from_static(b"x"),
                qos: QoS::AtLeastOnce,
                retain: false,
                properties: Default::default(),
            },
            None,
        );
        assert_eq!(routed.offered, 5);
        let order: Vec<String> = recorder
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
}
