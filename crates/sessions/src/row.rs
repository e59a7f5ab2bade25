//! A persistent session as one chain row (decision 0047): who owns it, under which
//! epoch, and the session's image in the journal's own change encoding
//! (`mqstate_broker::persist::encode_changes`, documented in `docs/storage-format.md`).
//!
//! ```text
//! row      = version u8 (= 1), owner u64, epoch u64, image
//!          | version u8 (= 2), owner u64, epoch u64, observed, image
//!          | version u8 (= 3), owner u64, epoch u64, observed, cursors, image
//! observed = count u32, (length u32, key bytes) × count   -- the client's KEYNOTIFY keys, in order
//! cursors  = (length u32, version bytes) × count           -- per observed key, in the same order:
//!            the last change of it queued into the session (decision 0065); length 0: from the
//!            key's first change, length u32::MAX: not known
//! image    = the change list that recreates the session from nothing (Created first)
//! ```
//!
//! A session whose client observes no state-store key is written as version 1, which nodes of
//! the previous release read; version 2 carries its registrations with it (decision 0054), version
//! 3 also where each key's notifications stand (decision 0065), written once one is known.
//! The image of a session that took forwarded QoS 2 publishes in within the last settle bound
//! holds their numbers (`K` changes, decision 0066): a node of the previous release cannot read
//! that row (the image does not decode) until those are forgotten.
//!
//! Big-endian like every other format. The bytes come from other nodes and from the chain log on
//! disk: decoding never panics (proptest below, fuzz target `session_row`).

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use mqstate_broker::persist::{decode_changes, encode_changes, DecodeError};
use mqstate_broker::{Restored, SessionChange, StoredSession};

/// Version byte at the start of a session row without observed keys.
pub const ROW_VERSION: u8 = 1;
/// Version byte of a row that carries the client's observed keys.
pub const ROW_VERSION_OBSERVED: u8 = 2;
/// Version byte of a row that carries the client's observed keys and their cursors.
pub const ROW_VERSION_CURSORS: u8 = 3;
/// A cursor's length that says "not known".
const NO_CURSOR: u32 = u32::MAX;
/// Bytes of one cursor, at most (a version is about 30).
const MAX_CURSOR: usize = 1 << 10;
/// Bytes of a row's header: version, owner, epoch.
pub const HEADER: usize = 1 + 8 + 8;
/// Observed keys a row holds at most (the store's own registration limit is far below).
const MAX_OBSERVED: usize = 1 << 20;

/// A session row, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRow {
    /// The node that owns the session: the only one that writes it.
    pub owner: u64,
    /// Raised by every node that takes the session over (and every clean start), so an owner can
    /// tell its own write from another's.
    pub epoch: u64,
    pub session: StoredSession,
    /// The state-store keys the client observes (KEYNOTIFY), in key order: they move with the
    /// session when another node takes it over.
    pub observed: Vec<Vec<u8>>,
    /// Per observed key, the version of its last change queued into the session (`""`: the key
    /// had no row when observed: every change of it is owed); a key missing here is not known.
    /// A node that takes the session over delivers the changes after it (decision 0065).
    pub cursors: BTreeMap<Vec<u8>, String>,
}

/// Bytes that are not a session row of the expected client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    #[error("session row too short ({0} bytes)")]
    Short(usize),
    #[error("session row format {0} is not supported (this build reads {ROW_VERSION} to {ROW_VERSION_CURSORS})")]
    Version(u8),
    #[error("session row's observed keys are damaged: {0}")]
    Observed(&'static str),
    #[error("session row image: {0}")]
    Image(#[from] DecodeError),
    #[error("session row does not hold the session of its client id")]
    OtherClient,
}

/// Encodes `row` for `client_id`.
pub fn encode(client_id: &Arc<str>, row: &SessionRow) -> Vec<u8> {
    let image = encode_changes(&image_of(client_id, &row.session));
    let observed: usize = row.observed.iter().map(|k| 8 + k.len() + 32).sum();
    let mut out = BytesMut::with_capacity(HEADER + 4 + observed + image.len());
    let cursors = row.observed.iter().any(|k| row.cursors.contains_key(k));
    out.put_u8(match (row.observed.is_empty(), cursors) {
        (true, _) => ROW_VERSION,
        (false, false) => ROW_VERSION_OBSERVED,
        (false, true) => ROW_VERSION_CURSORS,
    });
    out.put_u64(row.owner);
    out.put_u64(row.epoch);
    if !row.observed.is_empty() {
        out.put_u32(row.observed.len() as u32);
        for key in &row.observed {
            out.put_u32(key.len() as u32);
            out.extend_from_slice(key);
        }
    }
    if cursors {
        for key in &row.observed {
            match row.cursors.get(key) {
                Some(cursor) => {
                    out.put_u32(cursor.len() as u32);
                    out.extend_from_slice(cursor.as_bytes());
                }
                None => out.put_u32(NO_CURSOR),
            }
        }
    }
    out.extend_from_slice(&image);
    out.to_vec()
}

/// Owner and epoch of a row from its first [`HEADER`] bytes (the rest need not be there);
/// `None` if they are not a header this build reads.
pub fn header(data: &[u8]) -> Option<(u64, u64)> {
    let header = data.get(..HEADER)?;
    if !(ROW_VERSION..=ROW_VERSION_CURSORS).contains(&header[0]) {
        return None;
    }
    let word = |at: usize| u64::from_be_bytes(header[at..at + 8].try_into().unwrap_or_default());
    Some((word(1), word(9)))
}

/// Decodes the row of `client_id`.
pub fn decode(client_id: &str, data: &[u8]) -> Result<SessionRow, RowError> {
    if data.len() < HEADER {
        return Err(RowError::Short(data.len()));
    }
    if !(ROW_VERSION..=ROW_VERSION_CURSORS).contains(&data[0]) {
        return Err(RowError::Version(data[0]));
    }
    let word = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&data[at..at + 8]);
        u64::from_be_bytes(bytes)
    };
    let (owner, epoch) = (word(1), word(9));
    let mut rest = &data[HEADER..];
    let mut observed = Vec::new();
    let mut cursors = BTreeMap::new();
    if data[0] != ROW_VERSION {
        let count = take_u32(&mut rest)? as usize;
        if count == 0 || count > MAX_OBSERVED {
            return Err(RowError::Observed("count out of range"));
        }
        for _ in 0..count {
            let len = take_u32(&mut rest)? as usize;
            if rest.len() < len {
                return Err(RowError::Observed("a key runs past the row"));
            }
            let (key, tail) = rest.split_at(len);
            observed.push(key.to_vec());
            rest = tail;
        }
    }
    if data[0] == ROW_VERSION_CURSORS {
        for key in &observed {
            let len = take_u32(&mut rest)?;
            if len == NO_CURSOR {
                continue;
            }
            let len = len as usize;
            if len > MAX_CURSOR || rest.len() < len {
                return Err(RowError::Observed("a cursor runs past the row"));
            }
            let (cursor, tail) = rest.split_at(len);
            let cursor = std::str::from_utf8(cursor)
                .map_err(|_| RowError::Observed("a cursor is not text"))?;
            cursors.insert(key.clone(), cursor.to_owned());
            rest = tail;
        }
    }
    let mut restored = Restored::default();
    for change in decode_changes(rest)? {
        restored.apply(change);
    }
    let session = restored
        .sessions
        .remove(client_id)
        .ok_or(RowError::OtherClient)?;
    if !restored.sessions.is_empty()
        || !restored.retained.is_empty()
        || !restored.retained_clears.is_empty()
    {
        return Err(RowError::OtherClient);
    }
    Ok(SessionRow {
        owner,
        epoch,
        session,
        observed,
        cursors,
    })
}

fn take_u32(rest: &mut &[u8]) -> Result<u32, RowError> {
    if rest.len() < 4 {
        return Err(RowError::Observed("truncated"));
    }
    let (word, tail) = rest.split_at(4);
    *rest = tail;
    Ok(u32::from_be_bytes([word[0], word[1], word[2], word[3]]))
}

/// The changes that recreate `session` from nothing, as a journal snapshot holds it.
pub fn image_of(client_id: &Arc<str>, session: &StoredSession) -> Vec<SessionChange> {
    let id = || client_id.clone();
    let mut image = vec![SessionChange::Created {
        client_id: id(),
        expiry_secs: session.expiry_secs,
    }];
    if let Some(at_ms) = session.detached_at_ms {
        image.push(SessionChange::Detached {
            client_id: id(),
            expiry_secs: session.expiry_secs,
            at_ms,
        });
    }
    for (filter, options) in &session.subscriptions {
        image.push(SessionChange::Subscribed {
            client_id: id(),
            filter: filter.clone(),
            options: *options,
        });
    }
    for &packet_id in &session.inbound_qos2 {
        image.push(SessionChange::Qos2Received {
            client_id: id(),
            packet_id,
        });
    }
    for (&seq, entry) in &session.messages {
        image.push(SessionChange::Appended {
            client_id: id(),
            seq,
            message: entry.message.clone(),
        });
        if let Some(packet_id) = entry.packet_id {
            image.push(SessionChange::Sent {
                client_id: id(),
                seq,
                packet_id,
            });
        }
        if entry.released {
            image.push(SessionChange::Released {
                client_id: id(),
                seq,
            });
        }
    }
    for t in &session.taken {
        image.push(SessionChange::Took {
            client_id: id(),
            id: t.id,
            at_ms: t.at_ms,
            keep_ms: t.keep_ms,
        });
    }
    if let Some((will, at_ms)) = &session.will {
        image.push(SessionChange::WillScheduled {
            client_id: id(),
            will: will.clone(),
            at_ms: *at_ms,
        });
    }
    if let (Some(will), None) = (&session.connected_will, session.detached_at_ms) {
        image.push(SessionChange::WillSet {
            client_id: id(),
            will: will.clone(),
        });
    }
    image
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use bytestring::ByteString;
    use mqstate_broker::persist::{StoredEntry, StoredMessage, TakenId};
    use mqstate_broker::session::SubscriptionOptions;
    use mqstate_broker::PublishId;
    use mqstate_broker::{Message, QoS};
    use proptest::prelude::*;

    use super::*;

    fn message(seq: u64, qos: QoS) -> StoredEntry {
        StoredEntry {
            message: StoredMessage {
                message: Arc::new(Message {
                    topic: ByteString::from(format!("t/{seq}")),
                    payload: Bytes::from(vec![seq as u8; 3]),
                    qos,
                    retain: false,
                    properties: Default::default(),
                }),
                qos,
                retain: false,
                subscription_ids: vec![7],
                received_at_ms: 1_000 + seq,
            },
            packet_id: seq.is_multiple_of(2).then_some(seq as u16 + 1),
            released: seq.is_multiple_of(4) && qos == QoS::ExactlyOnce,
        }
    }

    fn session(messages: u64) -> StoredSession {
        let mut session = StoredSession {
            expiry_secs: 300,
            detached_at_ms: Some(5_000),
            ..StoredSession::default()
        };
        for (filter, qos) in [("a/#", QoS::AtLeastOnce), ("b/+", QoS::ExactlyOnce)] {
            session.subscriptions.insert(
                ByteString::from(filter),
                SubscriptionOptions {
                    qos,
                    no_local: false,
                    retain_as_published: true,
                    retain_handling: 0,
                    subscription_id: Some(7),
                },
            );
        }
        session.inbound_qos2.insert(42);
        for seq in 0..messages.min(3) {
            session.taken.push(TakenId {
                id: PublishId {
                    node: 2,
                    incarnation: 77,
                    seq,
                },
                at_ms: 4_000 + seq,
                keep_ms: 60_000,
            });
        }
        for seq in 0..messages {
            let qos = if seq.is_multiple_of(3) {
                QoS::ExactlyOnce
            } else {
                QoS::AtLeastOnce
            };
            session.messages.insert(seq, message(seq, qos));
        }
        session
    }

    #[test]
    fn a_session_row_round_trips() {
        let client_id: Arc<str> = "sub-1".into();
        let mut row = SessionRow {
            owner: 3,
            epoch: 9,
            session: session(6),
            observed: Vec::new(),
            cursors: BTreeMap::new(),
        };
        let bytes = encode(&client_id, &row);
        assert_eq!(
            bytes[0], ROW_VERSION,
            "no observed keys: the previous release's format"
        );
        assert_eq!(decode("sub-1", &bytes), Ok(row.clone()));
        row.observed = vec![b"a".to_vec(), Vec::from(&b"k\x00\xff"[..])];
        let bytes = encode(&client_id, &row);
        assert_eq!(bytes[0], ROW_VERSION_OBSERVED, "no cursors: format 2");
        assert_eq!(decode("sub-1", &bytes), Ok(row.clone()));
        row.cursors.insert(b"a".to_vec(), String::new());
        let bytes = encode(&client_id, &row);
        assert_eq!(bytes[0], ROW_VERSION_CURSORS);
        assert_eq!(decode("sub-1", &bytes), Ok(row.clone()));
        row.cursors
            .insert(row.observed[1].clone(), "001700000000000:00000:n1".into());
        assert_eq!(decode("sub-1", &encode(&client_id, &row)), Ok(row.clone()));
        // A cursor of a key no longer observed is not written.
        let mut stale = row.clone();
        stale.cursors.insert(b"gone".to_vec(), "x".into());
        assert_eq!(decode("sub-1", &encode(&client_id, &stale)), Ok(row));
    }

    #[test]
    fn a_row_is_only_its_own_clients() {
        let row = SessionRow {
            owner: 1,
            epoch: 1,
            session: session(1),
            observed: Vec::new(),
            cursors: BTreeMap::new(),
        };
        let bytes = encode(&"a".into(), &row);
        assert_eq!(decode("b", &bytes), Err(RowError::OtherClient));
        assert_eq!(decode("a", &bytes[..5]), Err(RowError::Short(5)));
        assert_eq!(header(&bytes[..5]), None);
        let mut other = bytes.clone();
        other[0] = 4;
        assert_eq!(decode("a", &other), Err(RowError::Version(4)));
    }

    proptest! {
        #[test]
        fn rows_round_trip(owner in any::<u64>(), epoch in any::<u64>(), messages in 0u64..20, expiry in any::<u32>(),
                           observed in proptest::collection::btree_map(proptest::collection::vec(any::<u8>(), 0..8), proptest::option::of("[0-9:a-z]{0,30}"), 0..4)) {
            let client_id: Arc<str> = "c".into();
            let mut s = session(messages);
            s.expiry_secs = expiry;
            let cursors = observed.iter().filter_map(|(k, c)| Some((k.clone(), c.clone()?))).collect();
            let row = SessionRow { owner, epoch, session: s, observed: observed.into_keys().collect(), cursors };
            let bytes = encode(&client_id, &row);
            prop_assert_eq!(header(&bytes[..HEADER]), Some((owner, epoch)));
            prop_assert_eq!(decode("c", &bytes), Ok(row));
        }

        #[test]
        fn any_bytes_decode_or_fail_without_panicking(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(row) = decode("c", &body) {
                let again = encode(&"c".into(), &row);
                prop_assert_eq!(decode("c", &again), Ok(row));
            }
        }
    }
}
