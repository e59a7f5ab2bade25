//! The system service port: how in-process services (the state store) plug into the broker.
//!
//! CONTRACT (implemented by the broker; relied on by `mqstate-statestore`):
//!
//! * [`Broker::claim_topic`] — every PUBLISH whose topic equals the claimed topic exactly is *not*
//!   routed to subscribers; it is handed to the returned inbox as a [`ServiceRequest`] carrying the
//!   publisher's client id and all properties. For QoS 1/2 the publisher gets its PUBACK/PUBREC only
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

use std::sync::Arc;

use tokio::sync::{broadcast, mpsc, oneshot};

use crate::message::Message;

/// A PUBLISH on a claimed topic, handed to its service.
#[derive(Debug)]
pub struct ServiceRequest {
    /// The publisher's client id (assigned id for clients that connected with an empty one).
    pub client_id: Arc<str>,
    pub message: Message,
    /// DUP flag of the PUBLISH: the client is retrying.
    pub dup: bool,
    pub(crate) ack: Option<oneshot::Sender<u8>>,
}

impl ServiceRequest {
    /// Build a request (used by the broker, and by services' own tests).
    pub fn new(client_id: Arc<str>, message: Message, dup: bool) -> (Self, oneshot::Receiver<u8>) {
        let (tx, rx) = oneshot::channel();
        (Self { client_id, message, dup, ack: Some(tx) }, rx)
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
    // implementation pending (broker crate)
    _events: broadcast::Sender<ClientEvent>,
}
