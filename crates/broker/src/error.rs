//! Errors of the broker's public API.

/// What can go wrong when using a [`crate::Broker`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokerError {
    #[error("topic {topic:?} is already claimed by another service; claim each topic once")]
    TopicAlreadyClaimed { topic: String },
    #[error(
        "cannot claim topic {topic:?}: it is not a valid topic name (non-empty, no `+` or `#`)"
    )]
    InvalidTopic { topic: String },
    #[error("TLS file {}: {reason}", path.display())]
    Tls {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("no session of client {client_id:?} to hand over")]
    NoSuchSession { client_id: String },
    #[error("the session of client {client_id:?} has a connection; disconnect it before handing the session over")]
    SessionConnected { client_id: String },
    #[error("client {client_id:?} already has a session here; it cannot adopt another one (export or let it end first)")]
    SessionExists { client_id: String },
}
