//! A log record of the state store: a key change, a change to topics and queues, or either made by
//! an identified request ([`crate::request`]). The first byte (the marker) says which.

use mqstate_protocol::Hlc;

use crate::delta::Delta;
use crate::error::StoreError;
use crate::notify::QueueDelta;
use crate::request::{
    decode_legacy_requested, decode_requested, RequestRecord, LEGACY_REQUESTED_MARKER,
    REQUESTED_MARKER,
};

/// One record of the store's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Key(Delta),
    Queue(QueueDelta),
    /// `change` (a key change, or a commit of one with its notifications) made by `request`.
    Requested {
        request: RequestRecord,
        change: Box<Change>,
    },
}

impl Change {
    pub fn encode(&self) -> Result<Vec<u8>, StoreError> {
        match self {
            Change::Key(delta) => delta.encode(),
            Change::Queue(delta) => delta.encode(),
            Change::Requested { request, change } => {
                let version = change.key_version().ok_or(StoreError::Invalid {
                    context: "requested change",
                    what: "change",
                    offset: 0,
                    reason: "a request's change must change a key",
                })?;
                request.encode_with(&change.encode()?, version)
            }
        }
    }

    /// Decodes one record; a marker no kind knows is the key delta's error.
    pub fn decode(data: &[u8]) -> Result<Change, StoreError> {
        match data.first() {
            Some(&REQUESTED_MARKER) => decode_requested(data),
            Some(&LEGACY_REQUESTED_MARKER) => decode_legacy_requested(data),
            Some(&marker) if QueueDelta::is_marker(marker) => {
                QueueDelta::decode(data).map(Change::Queue)
            }
            _ => Delta::decode(data).map(Change::Key),
        }
    }

    /// The version of the key change this is or commits (`None`: a change of topics or queues only).
    pub fn key_version(&self) -> Option<&Hlc> {
        match self {
            Change::Key(delta) | Change::Queue(QueueDelta::Commit { change: delta, .. }) => {
                Some(delta.version())
            }
            Change::Queue(_) => None,
            Change::Requested { change, .. } => change.key_version(),
        }
    }

    /// The request that made this change, if it was recorded.
    pub fn request(&self) -> Option<&RequestRecord> {
        match self {
            Change::Requested { request, .. } => Some(request),
            Change::Key(_) | Change::Queue(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mqstate_protocol::Hlc;
    use std::sync::Arc;

    #[test]
    fn the_marker_chooses_the_kind() {
        let key = Change::Key(Delta::Delete {
            key: Bytes::from_static(b"k"),
            version: Hlc::new(1, 0, Arc::from("n")),
        });
        let queue = Change::Queue(QueueDelta::DeleteTopic("t".into()));
        for change in [key, queue] {
            assert_eq!(Change::decode(&change.encode().unwrap()).unwrap(), change);
        }
        assert!(Change::decode(b"").is_err());
        assert!(Change::decode(b"Z").is_err());
    }
}
