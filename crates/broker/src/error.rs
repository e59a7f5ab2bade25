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
}
