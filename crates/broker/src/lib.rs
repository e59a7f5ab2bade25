//! mqstate's MQTT 5 (and 3.1.1) broker.
//!
//! The broker owns listeners, connections, sessions, the subscription trie, retained messages, wills and
//! the QoS flows. Packet encoding/decoding comes from `rmqtt-codec` and is confined to the `codec`
//! module: everything else speaks our own types ([`Message`], [`QoS`], ...).
//!
//! In-process services (the state store) attach through the *system service port*, [`Broker`]:
//! they claim a topic, get every publish on it as a [`ServiceRequest`], and publish replies or
//! deliver messages straight into one client's session.
//!
//! A tour: [`serve`] (`server.rs`) accepts sockets and spawns one task per connection, which runs
//! the listener's [`Acceptor`] (`transport.rs`: TLS in `tls.rs`, WebSocket in `websocket.rs`) and then
//! `connection.rs` (handshake, read/decode, keep-alive, batched writes) over the resulting stream. Connections attach to a
//! session through the `registry` (client id -> session, atomic takeover, will and expiry timers).
//! A session (`session.rs`) is plain data: subscriptions, a bounded queue, in-flight QoS 1/2 messages.
//! Publishes go through the `router` (the subscription `trie`, shared groups, the `retained` store)
//! into session queues; the owning connection is woken and drains its queue.
//!
//! Overflow policy: each session queue holds at most [`BrokerConfig::max_queued_messages`] messages
//! and [`BrokerConfig::max_queued_bytes`] of topics and payloads (a single larger message still enters
//! an empty queue). When it is full a new QoS 0 message is dropped; a new QoS 1/2 message evicts the
//! oldest queued QoS 0 messages, or, if that is not enough, is itself dropped (counted per session). Publishers are never
//! blocked or disconnected because a subscriber is slow. Messages from services (replies to a
//! client's own requests) may exceed the limit by the Receive Maximum: while a client's queue is full
//! its connection holds back the acks of its service requests, which bounds the replies it is owed.
//!
//! Who may connect and what they may publish or subscribe to is asked of the ports in [`auth`]; the
//! binary plugs its configured policy in with [`BrokerBuilder::security`].
//!
//! Architecture invariant: this crate knows nothing of the state store, of the WAL or of replication.

pub mod auth;
mod auth_failures;
pub mod client_ids;
mod codec;
pub mod config;
mod connection;
pub mod error;
mod inbound;
pub mod limits;
mod mailbox;
pub mod message;
mod metrics;
pub mod peers;
pub mod persist;
pub mod queue;
mod registry;
mod retained;
mod router;
mod server;
pub mod service;
pub mod session;
mod signal;
pub mod tls;
mod topic;
mod transport;
mod trie;
mod websocket;
pub mod will;

pub use auth::{Authenticator, Authorizer, Identity, Principal, Security};
pub use client_ids::ClientIds;
pub use config::BrokerConfig;
pub use error::BrokerError;
pub use message::{Message, PublishProperties, QoS};
pub use mqstate_clock::{Clock, SharedClock};
pub use peers::{Forward, GroupKey, PeerId, Peers, Plan, PublishId, Settled};
pub use persist::StoredSession;
pub use persist::{
    CopyId, Durable, JournalError, Landing, Located, Locating, Restored, SessionChange,
    SessionJournal, SessionSource, Unlocated,
};
pub use server::{serve, serve_streams, Listener};
pub use service::{
    Acker, Adoption, Broker, BrokerBuilder, ClientEvent, RestoreReport, ServiceInbox,
    ServiceRequest,
};
pub use topic::matches as topic_matches;
pub use transport::{Acceptor, Peer, Transport};

/// Entry points for fuzzing; not part of the supported API.
#[doc(hidden)]
pub mod fuzzing {
    use crate::codec::{self, Inbound};
    use crate::inbound::TopicAliases;
    use crate::topic;

    /// Runs arbitrary bytes through what a connection does with them before touching shared state:
    /// protocol probing, packet decoding, conversion to our types, topic-alias resolution and
    /// topic/filter validation. Must never panic.
    pub fn connection_bytes(data: &[u8]) {
        let mut aliases = TopicAliases::new(8);
        for packet in codec::decode_all(data, 64 * 1024).into_iter().flatten() {
            match packet {
                Inbound::Publish(p) => {
                    if let Ok(t) = aliases.resolve(p.topic, p.topic_alias) {
                        let _ = topic::is_valid_topic_name(&t);
                    }
                }
                Inbound::Subscribe { filters, .. } => {
                    for (f, _) in filters {
                        let _ = topic::parse_filter(&f);
                    }
                }
                Inbound::Unsubscribe { filters, .. } => {
                    for f in filters {
                        let _ = topic::parse_filter(&f);
                    }
                }
                _ => {}
            }
        }
    }
}
