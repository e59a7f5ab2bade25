//! What a chain row says about its key: the row's value is a store log record (decision 0035),
//! read here for the parts the head's background work needs — liveness and expiry (SCAN, expiry
//! deletes) and the committed change an observer is notified of. Pure.

use bytes::Bytes;
use mqstate_protocol::Hlc;
use mqstate_store::{Change, Delta, StoreError};

use crate::wire::Committed;

/// The key change a row holds (the request that made it, if any, set aside).
pub fn delta_of(row: &[u8]) -> Result<Delta, StoreError> {
    let mut change = Change::decode(row)?;
    loop {
        match change {
            Change::Key(delta) => return Ok(delta),
            Change::Requested { change: inner, .. } => change = *inner,
            Change::Queue(_) => {
                return Err(StoreError::Invalid {
                    context: "chain row",
                    what: "change",
                    offset: 0,
                    reason: "a chain row must hold a key change",
                })
            }
        }
    }
}

/// Whether the row holds a value that is live at `now_ms`.
pub fn is_live(delta: &Delta, now_ms: u64) -> bool {
    match delta {
        Delta::Put { expires_at_ms, .. } => expires_at_ms.is_none_or(|at| at > now_ms),
        Delta::Delete { .. } => false,
    }
}

/// The expiry deadline of a value, if it has one.
pub fn deadline(delta: &Delta) -> Option<u64> {
    match delta {
        Delta::Put { expires_at_ms, .. } => *expires_at_ms,
        Delta::Delete { .. } => None,
    }
}

/// The change observers of the key are notified of, once the row is committed (the row it
/// replaced unknown: see [`committed_after`]).
pub fn committed(delta: &Delta) -> Committed {
    let value = match delta {
        Delta::Put { value, .. } => Some(value.to_vec()),
        Delta::Delete { .. } => None,
    };
    Committed {
        key: delta.key().to_vec(),
        version: delta.version().to_string(),
        value,
        prev: None,
    }
}

/// The change of `delta`, which replaced the committed row `before` (`None`: no row).
pub fn committed_after(delta: &Delta, before: Option<&[u8]>) -> Committed {
    Committed {
        prev: before
            .and_then(|row| delta_of(row).ok())
            .map(|d| d.version().to_string()),
        ..committed(delta)
    }
}

/// The store's delta back from a [`Committed`] (a damaged version is an error: it was written by a
/// head, so it is a bug or corruption, named in the log by the caller).
pub fn delta_of_committed(committed: &Committed) -> Result<Delta, String> {
    let version = Hlc::parse(&committed.version)
        .map_err(|e| format!("notification version {:?}: {e}", committed.version))?;
    let key = Bytes::copy_from_slice(&committed.key);
    Ok(match &committed.value {
        Some(value) => Delta::Put {
            key,
            value: Bytes::copy_from_slice(value),
            version,
            fencing_token: None,
            expires_at_ms: None,
        },
        None => Delta::Delete { key, version },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn rows_read_back_as_their_change() {
        let put = Delta::Put {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
            version: Hlc::new(5, 1, Arc::from("n")),
            fencing_token: None,
            expires_at_ms: Some(100),
        };
        let row = Change::Key(put.clone()).encode().unwrap();
        let delta = delta_of(&row).unwrap();
        assert_eq!(delta, put);
        assert!(is_live(&delta, 99));
        assert!(!is_live(&delta, 100));
        assert_eq!(deadline(&delta), Some(100));
        let c = committed(&delta);
        assert_eq!(c.value.as_deref(), Some(b"v".as_slice()));
        match delta_of_committed(&c).unwrap() {
            Delta::Put { version, .. } => assert_eq!(version, *put.version()),
            other => panic!("{other:?}"),
        }
        assert!(delta_of(b"??").is_err());
    }
}
