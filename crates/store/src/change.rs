//! A log record of the state store: a key change or a change to topics and queues. The first byte
//! (the marker) says which.

use crate::delta::Delta;
use crate::error::StoreError;
use crate::notify::QueueDelta;

/// One record of the store's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Key(Delta),
    Queue(QueueDelta),
}

impl Change {
    pub fn encode(&self) -> Result<Vec<u8>, StoreError> {
        match self {
            Change::Key(delta) => delta.encode(),
            Change::Queue(delta) => delta.encode(),
        }
    }

    /// Decodes one record; a marker neither kind knows is the key delta's error.
    pub fn decode(data: &[u8]) -> Result<Change, StoreError> {
        match data.first() {
            Some(&marker) if QueueDelta::is_marker(marker) => {
                QueueDelta::decode(data).map(Change::Queue)
            }
            _ => Delta::decode(data).map(Change::Key),
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
