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
//! * [`Broker::deliver_to`] — put a message straight into one client's session, whether or not it has
//!   a matching subscription (if subscriptions match, their options — max QoS, subscription ids —
//!   apply, but the message is delivered exactly once). Returns `false` if no such session exists.
//! * Ordering: `publish` and `deliver_to` are synchronous and enqueue into the target sessions before
//!   they return, so two calls made in order reach a given client in that order.
//! * [`Broker::disconnect`] — send DISCONNECT with the reason code (and reason string) and close.
//! * [`Broker::events`] — connection and session lifecycle events.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use bytestring::ByteString;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::auth::{Identity, Security};
use crate::auth_failures::AuthFailures;
use crate::config::BrokerConfig;
use crate::error::BrokerError;
use crate::message::{Message, QoS};
use crate::registry::{Control, Effects, Registry, Timer};
use crate::router::Router;
use crate::session::Delivery;
use crate::topic;

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
    /// The session is gone: expired, discarded by Clean Start, or ended with Session Expiry 0.
    SessionEnded { client_id: Arc<str> },
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
    pub auth_failures: AuthFailures,
    pub router: Router,
    pub registry: Registry,
    claims: RwLock<HashMap<ByteString, mpsc::Sender<ServiceRequest>>>,
    events: broadcast::Sender<ClientEvent>,
    next_conn_id: AtomicU64,
}

impl Broker {
    /// A broker with `config` that lets every client in and do everything; serve it on listeners
    /// with [`crate::serve`].
    pub fn new(config: BrokerConfig) -> Self {
        Self::with_security(config, Security::default())
    }

    /// A broker that authenticates and authorizes clients with `security`.
    pub fn with_security(config: BrokerConfig, security: Security) -> Self {
        let (events, _) = broadcast::channel(EVENT_CHANNEL_CAPACITY);
        let inner = Inner {
            auth_failures: AuthFailures::new(
                config.auth_failure_burst,
                config.auth_failure_refill,
                config.auth_failure_tracked_max,
            ),
            security,
            router: Router::new(
                config.max_queued_messages,
                usize::from(config.receive_maximum),
            ),
            config,
            registry: Registry::default(),
            claims: RwLock::default(),
            events,
            next_conn_id: AtomicU64::new(1),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.inner.config
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
        self.inner.router.route(message, None)
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
            received_at: Instant::now(),
        };
        session.deliver(delivery, self.inner.router.queue_limit(None));
        true
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
        };
        self.inner.registry.send_control(client_id, control)
    }

    /// Subscribes to connection and session lifecycle events.
    pub fn events(&self) -> broadcast::Receiver<ClientEvent> {
        self.inner.events.subscribe()
    }

    /// Number of sessions (connected or not).
    pub fn session_count(&self) -> usize {
        self.inner.registry.len()
    }
}

impl Inner {
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
/// (the registry checks the epoch).
async fn session_timer(inner: Arc<Inner>, timer: Timer) {
    if let Some(at) = timer.will_at {
        tokio::time::sleep_until(at.into()).await;
        if let Some(will) = inner.registry.take_due_will(&timer.client_id, timer.epoch) {
            inner.router.route(will.message, None);
        }
    }
    if let Some(at) = timer.expire_at {
        tokio::time::sleep_until(at.into()).await;
        let effects = inner.registry.expire(&timer.client_id, timer.epoch);
        if !effects.ended.is_empty() {
            tracing::debug!(client_id = %timer.client_id, "session expired");
        }
        inner.apply(effects);
    }
}
