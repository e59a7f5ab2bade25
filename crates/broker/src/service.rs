//! The system service port: how in-process services (the state store) plug into the broker.
//!
//! CONTRACT (implemented by the broker; relied on by `mqstate-statestore`):
//!
//! * [`Broker::claim_topic`] — every PUBLISH whose topic equals the claimed topic exactly is *not*
//!   routed to subscribers; it is handed to the returned inbox as a [`ServiceRequest`] carrying the
//!   publisher's client id, its authenticated [`Identity`] and all properties. The publish was
//!   authorized like any other (the [`crate::Authorizer`] allowed it) before it reaches the inbox. For QoS 1/2 the publisher gets its PUBACK/PUBREC only
//!   when the service calls [`ServiceRequest::ack`] (dropping the request unacked acks with
//!   0x80 Unspecified error). The inbox is bounded; when it is full the broker applies back-pressure to
//!   the publishing connection (it stops reading from that socket) rather than dropping.
//! * [`Broker::publish`] — route a message as if a (privileged, client-less) publisher sent it:
//!   subscribers, retained store, shared subscriptions, all as for a client publish.
//! * [`Broker::may_publish`] — whether a client could publish on a topic itself (topic valid and
//!   authorized as for its own PUBLISH); services check it before publishing where a client asked.
//! * [`Broker::deliver_to`] — put a message straight into one client's session, whether or not it has
//!   a matching subscription (if subscriptions match, their options — max QoS, subscription ids —
//!   apply, but the message is delivered exactly once). Returns `false` if no such session exists.
//! * Ordering: `publish` and `deliver_to` are synchronous and enqueue into the target sessions before
//!   they return, so two calls made in order reach a given client in that order.
//! * [`Broker::disconnect`] — send DISCONNECT with the reason code (and reason string) and close.
//! * [`Broker::events`] — connection and session lifecycle events.
//!
//! DURABILITY (also a port, `crate::persist`): [`BrokerBuilder::journal`] installs a
//! [`SessionJournal`] that records persistent sessions, retained messages and delayed wills;
//! [`Broker::restore`] puts back what a journal held (before listeners start), and
//! [`Broker::journal_image`] dumps the current state as changes (for a snapshot).
//!
//! HAND-OVER (for fail-over): [`Broker::export_session`] takes a persistent session that no
//! connection owns out of the broker as a [`StoredSession`]; [`Broker::adopt_session`] puts one in
//! while the broker runs, and its client resumes it with Session Present.
//!
//! TIME AND IDS: the broker reads time only from the [`Clock`] it is built with
//! ([`BrokerBuilder::clock`]; services use the same one, [`Broker::clock`]) and assigns client ids
//! from its [`ClientIds`] ([`BrokerBuilder::client_ids`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytestring::ByteString;
use mqstate_clock::SharedClock;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::auth::{Identity, Principal, Security};
use crate::auth_failures::AuthFailures;
use crate::client_ids::ClientIds;
use crate::config::BrokerConfig;
use crate::error::BrokerError;
use crate::limits::{Connections, MAX_REFUSALS_IN_PROGRESS};
use crate::message::{Message, QoS};
use crate::persist::{
    wall, CopyId, Durable, Restored, SessionChange, SessionJournal, SessionSource, StoredSession,
};
use crate::queue::QueueLimit;
use crate::registry::{Control, Effects, Registry, Taken, Timer, Untaken, WillOnEnd};
use crate::router::Router;
use crate::session::{Delivery, Inflight, Phase, SessionHandle, SessionState};
use crate::topic;
use crate::will::Will;

/// Capacity of the lifecycle event channel; slow listeners miss events (and are told so by
/// `broadcast::error::RecvError::Lagged`) rather than slow the broker down.
const EVENT_CHANNEL_CAPACITY: usize = 1024;

/// A PUBLISH on a claimed topic, handed to its service.
#[derive(Debug)]
pub struct ServiceRequest {
    /// The publisher's client id (assigned id for clients that connected with an empty one).
    pub client_id: Arc<str>,
    /// Who the publisher authenticated as.
    pub identity: Identity,
    pub message: Message,
    /// DUP flag of the PUBLISH: the client is retrying.
    pub dup: bool,
    pub(crate) ack: Option<oneshot::Sender<u8>>,
}

impl ServiceRequest {
    /// Build a request (used by the broker, and by services' own tests).
    pub fn new(
        client_id: Arc<str>,
        identity: Identity,
        message: Message,
        dup: bool,
    ) -> (Self, oneshot::Receiver<u8>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                client_id,
                identity,
                message,
                dup,
                ack: Some(tx),
            },
            rx,
        )
    }

    /// Acknowledge the publish with an MQTT reason code (0x00 success, 0x10 no matching subscribers,
    /// 0x80.. failures). Only the first call has an effect; QoS 0 requests ignore it.
    pub fn ack(&mut self, reason_code: u8) {
        if let Some(tx) = self.ack.take() {
            let _ = tx.send(reason_code);
        }
    }

    /// Split off the acknowledgement so the message can be moved on while the ack waits (e.g. for fsync).
    pub fn take_ack(&mut self) -> Acker {
        Acker(self.ack.take())
    }
}

/// The deferred acknowledgement of a [`ServiceRequest`].
#[derive(Debug)]
pub struct Acker(Option<oneshot::Sender<u8>>);

impl Acker {
    pub fn ack(mut self, reason_code: u8) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(reason_code);
        }
    }
}

/// The receiving end of a claimed topic.
pub type ServiceInbox = mpsc::Receiver<ServiceRequest>;

/// Lifecycle events services may care about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// A network connection for `client_id` was established (CONNACK sent).
    Connected { client_id: Arc<str> },
    /// The network connection ended (the session may live on).
    Disconnected { client_id: Arc<str> },
    /// The session is gone: expired, discarded by Clean Start, ended with Session Expiry 0, or
    /// moved to another node (`Broker::forget_session`).
    SessionEnded { client_id: Arc<str> },
}

/// Builds a [`Broker`] with its optional ports (see [`Broker::builder`]).
pub struct BrokerBuilder {
    config: BrokerConfig,
    security: Security,
    journal: Option<Arc<dyn SessionJournal>>,
    elsewhere: Option<Arc<dyn SessionSource>>,
    clock: SharedClock,
    client_ids: ClientIds,
}

impl BrokerBuilder {
    /// Authenticate and authorize clients with `security` (default: allow everything).
    pub fn security(mut self, security: Security) -> Self {
        self.security = security;
        self
    }

    /// Record persistent sessions, retained messages and delayed wills in `journal`, and acknowledge
    /// what is recorded only once it is durable (default: memory only).
    pub fn journal(mut self, journal: Arc<dyn SessionJournal>) -> Self {
        self.journal = Some(journal);
        self
    }

    /// Ask `source` on every CONNECT whether the client's session lives elsewhere (a cluster
    /// node; decision 0047). Default: sessions are this broker's only.
    pub fn sessions_elsewhere(mut self, source: Arc<dyn SessionSource>) -> Self {
        self.elsewhere = Some(source);
        self
    }

    /// Read wall and monotonic time from `clock` (default: the system's).
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Assign ids to clients that connect with an empty one from `ids` (default: random).
    pub fn client_ids(mut self, ids: ClientIds) -> Self {
        self.client_ids = ids;
        self
    }

    pub fn build(self) -> Broker {
        Broker::build(self)
    }
}

/// Handle to a running broker (cheap to clone). See the module docs for the contract.
#[derive(Clone)]
pub struct Broker {
    pub(crate) inner: Arc<Inner>,
}

/// Broker-wide shared state.
pub(crate) struct Inner {
    pub config: BrokerConfig,
    pub security: Security,
    /// Authentications running at once, each on a blocking thread. Bounded by the cores: hashing
    /// passwords is CPU work, so more threads add no throughput, and a burst of CONNECTs would
    /// otherwise start hundreds of blocking threads that stay (stacks, allocator caches) long
    /// after it (decision 0026).
    pub auth_slots: Arc<tokio::sync::Semaphore>,
    pub auth_failures: AuthFailures,
    pub connections: Arc<Connections>,
    pub router: Router,
    pub registry: Registry,
    claims: RwLock<HashMap<ByteString, mpsc::Sender<ServiceRequest>>>,
    events: broadcast::Sender<ClientEvent>,
    next_conn_id: AtomicU64,
    journal: Option<Arc<dyn SessionJournal>>,
    /// Where sessions held by other nodes are found (a cluster node), asked on CONNECT.
    pub elsewhere: Option<Arc<dyn SessionSource>>,
    pub clock: SharedClock,
    pub client_ids: ClientIds,
}

impl Broker {
    /// A broker with `config` that keeps its state in memory only and lets every client in and do
    /// everything; serve it on listeners with [`crate::serve`].
    pub fn new(config: BrokerConfig) -> Self {
        Self::builder(config).build()
    }

    /// A broker with ports plugged in: security policy, session journal.
    pub fn builder(config: BrokerConfig) -> BrokerBuilder {
        BrokerBuilder {
            config,
            security: Security::default(),
            journal: None,
            elsewhere: None,
            clock: mqstate_clock::system(),
            client_ids: ClientIds::random(),
        }
    }

    fn build(builder: BrokerBuilder) -> Self {
        let BrokerBuilder {
            config,
            security,
            journal,
            elsewhere,
            clock,
            client_ids,
        } = builder;
        let (events, _) = broadcast::channel(EVENT_CHANNEL_CAPACITY);
        let inner = Inner {
            auth_failures: AuthFailures::new(
                config.auth_failure_burst,
                config.auth_failure_refill,
                config.auth_failure_tracked_max,
            ),
            connections: Arc::new(Connections::new(
                config.max_connections,
                config.max_connections_per_address,
                MAX_REFUSALS_IN_PROGRESS,
            )),
            security,
            auth_slots: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            router: Router::new(
                QueueLimit {
                    messages: config.max_queued_messages,
                    bytes: config.max_queued_bytes,
                },
                usize::from(config.receive_maximum),
                journal.clone(),
                clock.clone(),
            ),
            config,
            registry: Registry::new(journal.clone(), clock.clone()),
            claims: RwLock::default(),
            events,
            next_conn_id: AtomicU64::new(1),
            journal,
            elsewhere,
            clock,
            client_ids,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.inner.config
    }

    /// The clock of this node: services attached to the broker read time from it too.
    pub fn clock(&self) -> &SharedClock {
        &self.inner.clock
    }

    /// Claims `topic`: publishes to it go to the returned inbox instead of subscribers. A topic can
    /// be claimed again once the previous inbox is dropped.
    pub fn claim_topic(&self, topic: &str) -> Result<ServiceInbox, BrokerError> {
        if !topic::is_valid_topic_name(topic) {
            return Err(BrokerError::InvalidTopic {
                topic: topic.to_owned(),
            });
        }
        let mut claims = self.inner.claims.write().unwrap_or_else(|p| p.into_inner());
        if claims.get(topic).is_some_and(|tx| !tx.is_closed()) {
            return Err(BrokerError::TopicAlreadyClaimed {
                topic: topic.to_owned(),
            });
        }
        let (tx, rx) = mpsc::channel(self.inner.config.service_inbox_capacity.max(1));
        claims.insert(ByteString::from(topic), tx);
        Ok(rx)
    }

    /// Routes `message` like a client publish (subscribers, shared subscriptions, retained store),
    /// even on a claimed topic. Returns how many sessions it was offered to.
    pub fn publish(&self, message: Message) -> usize {
        self.inner.router.route(message, None).offered
    }

    /// Whether `topic` is a topic name a client's PUBLISH may carry: no wildcards, no NUL, not empty,
    /// within `max_topic_length` and `max_topic_levels`.
    pub fn is_publishable_topic(&self, topic: &str) -> bool {
        topic::is_valid_topic_name(topic) && self.inner.config.topic_within_limits(topic)
    }

    /// Whether `who` could PUBLISH on `topic` itself: a publishable topic the broker's
    /// [`crate::Authorizer`] allows it. A service that publishes on a topic a client chose (a reply
    /// on its Response Topic) asks this first, so that it never publishes where the client could
    /// not (it would be a confused deputy).
    pub fn may_publish(&self, who: Principal<'_>, topic: &str) -> bool {
        self.is_publishable_topic(topic) && self.inner.security.authorizer.may_publish(who, topic)
    }

    /// Puts `message` into `client_id`'s session whether or not it subscribed; matching
    /// subscriptions contribute their maximum QoS, Retain As Published and subscription ids. Returns
    /// `false` if there is no such session.
    pub fn deliver_to(&self, client_id: &str, message: Message) -> bool {
        let Some(session) = self.inner.registry.session(client_id) else {
            return false;
        };
        let mut granted: Option<QoS> = None;
        let mut retain_as_published = false;
        let mut subscription_ids = Vec::new();
        {
            let state = session.lock();
            for (raw, options) in &state.subscriptions {
                let Some(filter) = topic::parse_filter(raw) else {
                    continue;
                };
                if topic::matches(filter.filter, &message.topic) {
                    granted = Some(granted.map_or(options.qos, |g| g.max(options.qos)));
                    retain_as_published |= options.retain_as_published;
                    subscription_ids.extend(options.subscription_id);
                }
            }
        }
        let qos = granted.map_or(message.qos, |g| message.qos.min(g));
        let retain = message.retain && (granted.is_none() || retain_as_published);
        let delivery = Delivery {
            message: Arc::new(message),
            qos,
            retain,
            subscription_ids,
            received_at: self.inner.clock.now(),
            seq: 0,
        };
        session.deliver(delivery, self.inner.router.queue_limit(None), None);
        true
    }

    /// Whether this broker holds a session of `client_id`.
    pub fn has_session(&self, client_id: &str) -> bool {
        self.inner.registry.session(client_id).is_some()
    }

    /// Sends `client_id`'s connection DISCONNECT with `reason_code` (and `reason_string`) and closes
    /// it. Returns `false` if the client is not connected.
    pub fn disconnect(
        &self,
        client_id: &str,
        reason_code: u8,
        reason_string: Option<&str>,
    ) -> bool {
        let control = Control::Disconnect {
            reason_code,
            reason_string: reason_string.map(str::to_owned),
            will: WillOnEnd::Publish,
        };
        self.inner.registry.send_control(client_id, None, control)
    }

    /// Disconnects `client_id`'s connection with 0x9C Use another server, its session kept: a
    /// cluster node whose control-plane lease lapsed serves no session until it is renewed. The
    /// connection's end counts as abnormal (MQTT: the server closed it), so its will is armed as
    /// usual, but published only once the end landed in the session's row, and not at all if
    /// another node adopted the session first: that node then holds the will
    /// (`publish_once_landed`). Before, the will was left to an adopter, and lost when nobody
    /// adopted (the lease came back) and the client never returned. Returns whether a connection
    /// was told.
    pub fn send_away(&self, client_id: &str) -> bool {
        let control = Control::Disconnect {
            reason_code: crate::codec::reason::USE_ANOTHER_SERVER,
            reason_string: Some(
                "this node lost touch with its cluster for now; reconnect, to another node if you can"
                    .into(),
            ),
            will: WillOnEnd::OnceLanded,
        };
        self.inner.registry.send_control(client_id, None, control)
    }

    /// Subscribes to connection and session lifecycle events.
    pub fn events(&self) -> broadcast::Receiver<ClientEvent> {
        self.inner.events.subscribe()
    }

    /// Number of sessions (connected or not).
    pub fn session_count(&self) -> usize {
        self.inner.registry.len()
    }

    /// Puts back what the journal held, as of the clock's time now: call once, before listeners
    /// start, inside the runtime (it arms timers). Sessions whose expiry passed while the server
    /// was down end (with their will); sessions that were connected when the server stopped count
    /// as disconnected now; delayed wills that came due are published.
    pub fn restore(&self, restored: Restored) -> RestoreReport {
        let inner = &self.inner;
        let (now, now_ms) = (inner.clock.now(), inner.clock.now_ms());
        let mut report = RestoreReport::default();
        for (topic, (message, received_at_ms)) in restored.retained {
            debug_assert_eq!(topic, message.topic);
            let at = wall::to_instant(received_at_ms, now, now_ms);
            inner.router.restore_retained(message, at);
            report.retained += 1;
        }
        // Oldest first: the newest are kept if there are more than the store remembers.
        let mut clears: Vec<_> = restored.retained_clears.into_iter().collect();
        clears.sort_unstable_by_key(|(_, at_ms)| *at_ms);
        for (topic, at_ms) in clears {
            let at = wall::to_instant(at_ms, now, now_ms);
            inner.router.restore_clear(&topic, at);
        }
        let mut due_wills = Vec::new();
        let mut timers = Vec::new();
        for (client_id, stored) in restored.sessions {
            let put = PutBack {
                client_id,
                stored,
                now,
                now_ms,
                origin: Origin::Journal,
                copy: inner.registry.new_copy(),
            };
            if let Ok((timer, _)) = inner.put_back(put, &mut report, &mut due_wills) {
                timers.extend(timer);
            }
        }
        report.wills_published = due_wills.len();
        inner.start(due_wills, timers);
        report
    }

    /// Takes the persistent session of `client_id` out of this broker to hand it to another node:
    /// its subscriptions, its QoS 1/2 messages (queued and in flight), its inbound QoS 2 packet ids
    /// and its pending delayed will, as [`Broker::adopt_session`] takes them. The session must
    /// have no connection (disconnect the client first, [`Broker::disconnect`]); queued QoS 0
    /// messages are not handed over, as a restart would not keep them either. The journal records
    /// the session as deleted here. A message routed to the session at this very moment may
    /// miss both nodes: hand sessions over while the node takes no publishes.
    pub fn export_session(&self, client_id: &str) -> Result<StoredSession, BrokerError> {
        let inner = &self.inner;
        let taken = inner.registry.take(client_id, None);
        let Taken { handle, will } = taken.map_err(|why| match why {
            Untaken::Missing | Untaken::Another(_) => BrokerError::NoSuchSession {
                client_id: client_id.to_owned(),
            },
            Untaken::Connected => BrokerError::SessionConnected {
                client_id: client_id.to_owned(),
            },
        })?;
        inner.router.remove_handed_over(&handle);
        let (now, now_ms) = (inner.clock.now(), inner.clock.now_ms());
        let mut state = handle.lock();
        let mut restored = Restored::default();
        for change in state.image(now, now_ms) {
            restored.apply(change);
        }
        if let Some((will, at_ms)) = will {
            restored.apply(SessionChange::WillScheduled {
                client_id: handle.client_id.clone(),
                will,
                at_ms,
            });
        }
        state.end();
        drop(state);
        tracing::debug!(client_id, "session handed over");
        let exported = restored.sessions.remove(client_id);
        debug_assert!(exported.is_some(), "an image starts with Created");
        Ok(exported.unwrap_or_default())
    }

    /// Drops copy `copy` of `client_id`'s session without recording anything: another node owns
    /// the session now (a cluster node learnt it when its write was fenced). Only that copy: if
    /// the broker holds another (a newer one, put here since by a CONNECT or an adoption), the
    /// drop was meant for a copy already gone and does nothing. A connected copy is disconnected
    /// with 0x8E Session taken over first (its will is left to the new holder), and dropped when
    /// the next CONNECT of the client finds it. Returns whether the copy was dropped.
    pub fn forget_session(&self, client_id: &str, copy: CopyId) -> bool {
        match self.inner.forget(client_id, copy) {
            Ok(dropped) => dropped,
            Err(Untaken::Connected) => {
                // The session lives on at its new holder, which publishes its will when due.
                let control = Control::Disconnect {
                    reason_code: crate::codec::reason::SESSION_TAKEN_OVER,
                    reason_string: Some("the session moved to another node".into()),
                    will: WillOnEnd::Skip,
                };
                self.inner
                    .registry
                    .send_control(client_id, Some(copy), control);
                false
            }
            Err(Untaken::Missing | Untaken::Another(_)) => false,
        }
    }

    /// Publishes the will of a session another node held (decision 0063): the node died while
    /// its client was connected, or with its delayed will pending, and the cluster node that
    /// settled the session's row found it ended (expired, or discarded by a clean start); or a
    /// clean start here ended a session whose delayed will a running node dropped when this
    /// node claimed the client id.
    pub fn publish_will(&self, will: Will) {
        tracing::info!(topic = %will.message.topic, "will of a session held by another node published");
        drop(self.inner.router.route(will.message, None));
    }

    /// Puts a session handed over by another node ([`Broker::export_session`]) into this running
    /// broker: its client resumes it with Session Present, and messages routed from now on reach
    /// it. As with [`Broker::restore`], a session whose expiry passed ends at once (its will is
    /// published) and a delayed will that came due is published. With a journal, the session is
    /// recorded; the returned [`Adoption::durable`] resolves once it is durable.
    pub fn adopt_session(
        &self,
        client_id: Arc<str>,
        session: StoredSession,
    ) -> Result<Adoption, BrokerError> {
        self.inner
            .adopt(client_id, session, self.inner.registry.new_copy())
    }

    /// Every persistent session (with its delayed will) and retained message as changes that
    /// recreate them from nothing: the state of a journal snapshot. Consistent per session and for
    /// the retained store; changes made meanwhile are recorded after and replay harmlessly.
    pub fn journal_image(&self) -> Vec<SessionChange> {
        let (now, now_ms) = (self.inner.clock.now(), self.inner.clock.now_ms());
        let mut image = self.inner.router.retained_image(now, now_ms);
        image.extend(self.inner.registry.image(now, now_ms));
        image
    }
}

/// What [`Broker::adopt_session`] did.
pub struct Adoption {
    /// One session put back (`sessions` 1), or one that had expired meanwhile (`expired` 1).
    pub report: RestoreReport,
    /// With a journal: resolves when the adopted session is durable here.
    pub durable: Option<Durable>,
    /// The copy of the session put back (`None` if it had expired): name it to drop it
    /// ([`Broker::forget_session`]).
    pub copy: Option<CopyId>,
}

/// Where a session put back into the broker comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// This broker's own journal: already recorded there.
    Journal,
    /// Another node: new to this broker's journal.
    HandedOver,
}

/// One stored session to put back, as of `now` (`now_ms` on the wall clock).
struct PutBack {
    client_id: Arc<str>,
    stored: StoredSession,
    now: Instant,
    now_ms: u64,
    origin: Origin,
    /// The identity the copy gets.
    copy: CopyId,
}

/// What [`Broker::restore`] put back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreReport {
    pub sessions: usize,
    pub messages: usize,
    pub retained: usize,
    /// Sessions whose expiry passed while the server was down (discarded).
    pub expired: usize,
    /// Delayed wills that came due while the server was down (published at start).
    pub wills_published: usize,
}

impl Inner {
    /// Puts one stored session back, or ends it if its expiry passed (its will then goes into
    /// `due_wills`). Returns the timer to arm and, for a session new to the journal, when it is
    /// recorded; `Err` (and changes nothing) if the client has a session already.
    fn put_back(
        &self,
        put: PutBack,
        report: &mut RestoreReport,
        due_wills: &mut Vec<Will>,
    ) -> Result<(Option<Timer>, Option<Durable>), ()> {
        let PutBack {
            client_id,
            stored,
            now,
            now_ms,
            origin,
            copy,
        } = put;
        let detached_at_ms = stored.detached_at_ms.unwrap_or(now_ms);
        let expire_at_ms = (stored.expiry_secs != u32::MAX)
            .then(|| detached_at_ms.saturating_add(u64::from(stored.expiry_secs) * 1000));
        if expire_at_ms.is_some_and(|at| at <= now_ms) {
            // Expired while the server was down (or the session in transit): its will goes now,
            // at the latest.
            due_wills.extend(stored.will_at_end().cloned());
            if let (Some(journal), Origin::Journal) = (&self.journal, origin) {
                drop(journal.record(vec![SessionChange::Deleted { client_id }]));
            }
            report.expired += 1;
            return Ok((None, None));
        }
        let mut state = SessionState::new(client_id.clone(), stored.expiry_secs);
        state.journalled = self.journal.is_some();
        state.in_journal = state.journalled && stored.expiry_secs > 0;
        state.inbound_qos2 = stored.inbound_qos2;
        state.restore_taken(stored.taken, now_ms);
        let messages = stored.messages.len();
        for (seq, entry) in stored.messages {
            let d = Delivery {
                message: entry.message.message,
                qos: entry.message.qos,
                retain: entry.message.retain,
                subscription_ids: entry.message.subscription_ids,
                received_at: wall::to_instant(entry.message.received_at_ms, now, now_ms),
                seq,
            };
            state.next_seq = state.next_seq.max(seq + 1);
            match entry.packet_id {
                Some(packet_id) => {
                    let phase = match (d.qos, entry.released) {
                        (_, true) => Phase::AwaitPubComp,
                        (QoS::ExactlyOnce, false) => Phase::AwaitPubRec,
                        _ => Phase::AwaitPubAck,
                    };
                    state
                        .inflight
                        .insert(packet_id, Inflight { delivery: d, phase });
                }
                None => state.queue.push_back(d),
            }
        }
        if stored.detached_at_ms.is_none() {
            // It was connected when the server stopped: its expiry counts from now.
            state.detached(now_ms);
        } else {
            state.detached_at_ms = stored.detached_at_ms;
        }
        state.subscriptions = stored.subscriptions;
        // Put back without the connection it had (its node stopped or died): that connection's
        // will is due after its delay from now, as if it had ended now (decision 0054).
        let lost_connection_will = match (stored.detached_at_ms, stored.connected_will) {
            (None, Some(will)) => {
                let delay_ms = u64::from(will.delay_secs.min(stored.expiry_secs)) * 1000;
                Some((will, now_ms.saturating_add(delay_ms)))
            }
            _ => None,
        };
        let from_connection = lost_connection_will.is_some();
        let (will, will_at, will_due) = match stored.will.or(lost_connection_will) {
            Some((will, at_ms)) if at_ms <= now_ms => (None, None, Some(will)),
            Some((will, at_ms)) => {
                let at = wall::to_instant(at_ms, now, now_ms);
                (Some((will, at_ms)), Some(at), None)
            }
            None => (None, None, None),
        };
        match origin {
            Origin::Journal if will_due.is_some() => {
                state.note(|client_id| SessionChange::WillCancelled { client_id });
            }
            Origin::Journal => {
                if let (Some((will, at_ms)), true) = (&will, from_connection) {
                    // The journal has it as the connection's will, which the detach ends.
                    state.note(|client_id| SessionChange::WillScheduled {
                        client_id,
                        will: will.clone(),
                        at_ms: *at_ms,
                    });
                }
            }
            Origin::HandedOver if state.in_journal => {
                // New to this journal: recorded whole, as a snapshot would hold it.
                state.changes = state.image(now, now_ms);
                if let Some((will, at_ms)) = &will {
                    state.changes.push(SessionChange::WillScheduled {
                        client_id: client_id.clone(),
                        will: will.clone(),
                        at_ms: *at_ms,
                    });
                }
            }
            Origin::HandedOver => {}
        }
        let subscriptions: Vec<_> = state
            .subscriptions
            .iter()
            .map(|(raw, options)| (raw.clone(), *options))
            .collect();
        let handle = Arc::new(SessionHandle::restored(
            state,
            self.journal.clone(),
            self.clock.clone(),
        ));
        // Nothing noted above reaches the journal unless the registry takes the session.
        let epoch = self
            .registry
            .restore(handle.clone(), will, copy)
            .ok_or(())?;
        self.router.note_put_back(client_id.clone(), now);
        for (raw, options) in &subscriptions {
            if let Some(filter) = topic::parse_filter(raw) {
                // The other nodes learn of it too; nobody waits for a SUBACK here.
                drop(self.router.subscribe(&handle, filter, *options));
            }
        }
        let durable = handle.lock().commit();
        due_wills.extend(will_due);
        report.sessions += 1;
        report.messages += messages;
        let timer = Timer {
            client_id,
            epoch,
            will_at,
            expire_at: expire_at_ms.map(|at| now + Duration::from_millis(at - now_ms)),
        };
        Ok((Some(timer), durable))
    }

    /// Takes copy `copy` of `client_id`'s session out without recording anything (another node
    /// owns it): its pending delayed will goes with it, its timers find nothing. `Ok(false)` if
    /// that copy is not here.
    pub(crate) fn forget(&self, client_id: &str, copy: CopyId) -> Result<bool, Untaken> {
        let handle = match self.registry.take(client_id, Some(copy)) {
            Ok(Taken { handle, .. }) => handle,
            Err(Untaken::Missing) => return Ok(false),
            Err(Untaken::Another(held)) => {
                tracing::debug!(
                    client_id,
                    ?copy,
                    ?held,
                    "a drop of an earlier copy of a session leaves the copy held now"
                );
                return Ok(false);
            }
            Err(Untaken::Connected) => return Err(Untaken::Connected),
        };
        self.router.remove_handed_over(&handle);
        let mut state = handle.lock();
        // Not ours to delete: the owner's copy lives on.
        state.in_journal = false;
        state.set_connected_will(None);
        state.end();
        debug_assert!(state.changes.is_empty());
        drop(state);
        tracing::debug!(client_id, ?copy, "stale copy of a session dropped");
        // Gone from this node: what services keep for the session here ends too.
        self.emit(ClientEvent::SessionEnded {
            client_id: client_id.into(),
        });
        Ok(true)
    }

    /// Puts a session taken from elsewhere into the registry as copy `copy` (it must hold none
    /// for the client; [`Broker::adopt_session`]).
    pub(crate) fn adopt(
        self: &Arc<Self>,
        client_id: Arc<str>,
        session: StoredSession,
        copy: CopyId,
    ) -> Result<Adoption, BrokerError> {
        let mut report = RestoreReport::default();
        let mut due_wills = Vec::new();
        let put = PutBack {
            client_id: client_id.clone(),
            stored: session,
            now: self.clock.now(),
            now_ms: self.clock.now_ms(),
            origin: Origin::HandedOver,
            copy,
        };
        let (timer, durable) = self
            .put_back(put, &mut report, &mut due_wills)
            .map_err(|()| BrokerError::SessionExists {
                client_id: client_id.to_string(),
            })?;
        report.wills_published = due_wills.len();
        let copy = timer.is_some().then_some(copy);
        self.start(due_wills, timer.into_iter().collect());
        Ok(Adoption {
            report,
            durable,
            copy,
        })
    }

    /// Publishes the wills that came due and arms the timers of sessions put back.
    fn start(self: &Arc<Self>, due_wills: Vec<Will>, timers: Vec<Timer>) {
        for will in due_wills {
            self.router.route(will.message, None);
        }
        for timer in timers {
            self.apply(Effects {
                timer: Some(timer),
                ..Effects::default()
            });
        }
    }

    pub(crate) fn next_conn_id(&self) -> u64 {
        self.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn claim_for(&self, topic: &str) -> Option<mpsc::Sender<ServiceRequest>> {
        let claims = self.claims.read().unwrap_or_else(|p| p.into_inner());
        claims.get(topic).filter(|tx| !tx.is_closed()).cloned()
    }

    pub(crate) fn emit(&self, event: ClientEvent) {
        // No listener is fine.
        let _ = self.events.send(event);
    }

    /// Carries out registry side effects: publish wills, clean up ended sessions, arm timers.
    pub(crate) fn apply(self: &Arc<Self>, effects: Effects) {
        for will in effects.wills {
            self.router.route(will.message, None);
        }
        for ended in effects.ended {
            self.router.remove_session(&ended);
            self.emit(ClientEvent::SessionEnded {
                client_id: ended.client_id.clone(),
            });
        }
        if let Some(timer) = effects.timer {
            if timer.will_at.is_some() || timer.expire_at.is_some() {
                tokio::spawn(session_timer(self.clone(), timer));
            }
        }
    }
}

/// Publishes a delayed will and ends an expired session, unless the client came back meanwhile
/// (the registry checks the epoch). A will due when the session expires (its delay reaches the
/// expiry) goes with the expiry, as one change: a reconnect that saw the will finds no session.
/// On a cluster node the will of an expired session waits until the session's end landed in its
/// row (decision 0070): until then another node may still take the session over, and then the
/// session did not end and its will is not due.
async fn session_timer(inner: Arc<Inner>, timer: Timer) {
    let with_expiry = matches!(
        (timer.will_at, timer.expire_at),
        (Some(will_at), Some(expire_at)) if will_at >= expire_at
    );
    if let Some(at) = timer.will_at.filter(|_| !with_expiry) {
        tokio::time::sleep_until(at.into()).await;
        if let Some(will) = inner.registry.take_due_will(&timer.client_id, timer.epoch) {
            publish_once_landed(inner.clone(), timer.client_id.clone(), vec![will]).await;
        }
    }
    if let Some(at) = timer.expire_at {
        tokio::time::sleep_until(at.into()).await;
        let mut effects = inner.registry.expire(&timer.client_id, timer.epoch);
        if effects.ended.is_empty() {
            return;
        }
        tracing::debug!(client_id = %timer.client_id, "session expired");
        let wills = std::mem::take(&mut effects.wills);
        inner.apply(effects);
        publish_once_landed(inner, timer.client_id, wills).await;
    }
}

/// Publishes `wills` of `client_id`'s session: on a single node at once; on a cluster node once
/// what this node recorded of the session (its end, its due will's publication) landed in the
/// session's row. Until then another node may still take the session over (adopt it, or a
/// CONNECT's claim), and then the will is that node's, or not due (decisions 0057, 0070):
/// published here too, it would go out twice.
pub(crate) async fn publish_once_landed(inner: Arc<Inner>, client_id: Arc<str>, wills: Vec<Will>) {
    if wills.is_empty() {
        return;
    }
    if let Some(source) = &inner.elsewhere {
        if !source.landed(&client_id).await {
            tracing::info!(%client_id, "the session was taken over by another node first: its will is not published here");
            return;
        }
    }
    for will in wills {
        inner.router.route(will.message, None);
    }
}
