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
//! Architecture invariant: this crate knows nothing of the state store, of the WAL or of replication.

pub mod message;
pub mod service;

pub use message::{Message, PublishProperties, QoS};
pub use service::{Broker, ClientEvent, ServiceInbox, ServiceRequest};
