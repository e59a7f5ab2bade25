//! The endpoint side of persistent notifications: what a notification looks like on the wire
//! ([`record`]) and how a batch of them is pushed to an endpoint ([`Endpoint`]): an HTTP POST of a JSON
//! batch acknowledged by a 2xx status, or MQTT PUBLISHes at QoS 1 acknowledged by PUBACKs.
//!
//! Architecture invariant: this crate knows nothing of the state store or the broker: it turns records
//! into bytes and sockets into acknowledgements. The queue, its owner and its retries are elsewhere.

mod dial;
pub mod endpoint;
mod http;
mod mqtt;
pub mod record;
pub mod tls;

pub use endpoint::{Endpoint, EndpointError, Options, Pushed};
pub use record::Record;
