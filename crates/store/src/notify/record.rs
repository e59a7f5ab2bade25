//! Queue deltas: the log records of topics and queues (`storage-format.md`'s queue markers).
//!
//! ```text
//! CreateTopic 'C' | name Buffer | endpoint Buffer | keys Buffer | events UInt8 | max queue Int32
//! DeleteTopic 'D' | name Buffer
//! Reserve     'V' | Array<name Buffer | reservation id Int64 | deadline Int64>
//! Abort       'B' | Array<name Buffer | reservation id Int64>
//! Commit      'A' | event UInt8 | change Buffer (a 'K' or 'X' key delta) | Array<name Buffer | reservation id Int64>
//! Remove      'R' | name Buffer | up to seq Int64
//! ```
//! A commit carries the key change itself, so the change and its notifications are one record:
//! replaying it applies both or neither. Entry seqs are not recorded — they follow from the order
//! of commits. Reservation id 0 ([`NO_RESERVATION`]) is a commit that reserved nothing (expiry).
//! The write path logs no `Reserve`: its reservation is named by the commit (decision 0038);
//! `Reserve` records of older logs are still read.

use std::sync::Arc;

use super::{event_from_byte, Event, TopicDef};
use crate::codec::{Reader, Writer};
use crate::delta::Delta;
use crate::error::StoreError;

pub const CREATE_TOPIC_MARKER: u8 = b'C';
pub const DELETE_TOPIC_MARKER: u8 = b'D';
pub const RESERVE_MARKER: u8 = b'V';
pub const ABORT_MARKER: u8 = b'B';
pub const COMMIT_MARKER: u8 = b'A';
pub const REMOVE_MARKER: u8 = b'R';

/// The reservation id of a commit that reserved nothing.
pub const NO_RESERVATION: u64 = 0;

const CONTEXT: &str = "queue delta";

/// One change to topics and queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueDelta {
    /// Create a topic with an empty queue, or replace the definition of an existing one (its queue
    /// stays).
    CreateTopic(TopicDef),
    /// Delete a topic with its queue and pending notifications.
    DeleteTopic(String),
    /// (topic, reservation id, deadline in Unix ms).
    Reserve(Vec<(Arc<str>, u64, u64)>),
    /// (topic, reservation id).
    Abort(Vec<(Arc<str>, u64)>),
    /// The key change and the notifications it commits: (topic, reservation id).
    Commit {
        change: Delta,
        event: Event,
        commits: Vec<(Arc<str>, u64)>,
    },
    /// Remove the entries up to `up_to_seq` (the endpoint acknowledged them).
    Remove { topic: String, up_to_seq: u64 },
}

impl QueueDelta {
    pub fn is_marker(byte: u8) -> bool {
        matches!(
            byte,
            CREATE_TOPIC_MARKER
                | DELETE_TOPIC_MARKER
                | RESERVE_MARKER
                | ABORT_MARKER
                | COMMIT_MARKER
                | REMOVE_MARKER
        )
    }

    pub fn encode(&self) -> Result<Vec<u8>, StoreError> {
        let mut w = Writer::with_capacity(self.encoded_len_hint());
        match self {
            QueueDelta::CreateTopic(def) => {
                w.u8(CREATE_TOPIC_MARKER);
                w.buffer("topic name", def.name.as_bytes())?;
                w.buffer("endpoint", def.endpoint.as_bytes())?;
                w.buffer("key pattern", &def.keys)?;
                w.u8(def.events);
                w.i32(i32::try_from(def.max_queue).unwrap_or(i32::MAX));
            }
            QueueDelta::DeleteTopic(name) => {
                w.u8(DELETE_TOPIC_MARKER);
                w.buffer("topic name", name.as_bytes())?;
            }
            QueueDelta::Reserve(list) => {
                w.u8(RESERVE_MARKER);
                w.count("queue delta list", list.len())?;
                for (name, id, deadline) in list {
                    w.buffer("topic name", name.as_bytes())?;
                    w.u63(*id);
                    w.u63(*deadline);
                }
            }
            QueueDelta::Abort(list) => {
                w.u8(ABORT_MARKER);
                w.count("queue delta list", list.len())?;
                for (name, id) in list {
                    w.buffer("topic name", name.as_bytes())?;
                    w.u63(*id);
                }
            }
            QueueDelta::Commit {
                change,
                event,
                commits,
            } => {
                w.u8(COMMIT_MARKER);
                w.u8(event.bit());
                let start = w.begin_buffer();
                change.encode_into(&mut w)?;
                w.end_buffer("key change", start)?;
                w.count("queue delta list", commits.len())?;
                for (name, id) in commits {
                    w.buffer("topic name", name.as_bytes())?;
                    w.u63(*id);
                }
            }
            QueueDelta::Remove { topic, up_to_seq } => {
                w.u8(REMOVE_MARKER);
                w.buffer("topic name", topic.as_bytes())?;
                w.u63(*up_to_seq);
            }
        }
        Ok(w.buf)
    }

    /// An upper bound of the size of the binary form, so that encoding it allocates once.
    fn encoded_len_hint(&self) -> usize {
        // A list item: name length, name, reservation id, deadline.
        let item = |name: &str| 4 + name.len() + 16;
        1 + match self {
            QueueDelta::CreateTopic(def) => {
                12 + def.name.len() + def.endpoint.len() + def.keys.len() + 5
            }
            QueueDelta::DeleteTopic(name) => 4 + name.len(),
            QueueDelta::Reserve(list) => 4 + list.iter().map(|(n, ..)| item(n)).sum::<usize>(),
            QueueDelta::Abort(list) => 4 + list.iter().map(|(n, _)| item(n)).sum::<usize>(),
            QueueDelta::Commit {
                change, commits, ..
            } => {
                1 + 4
                    + change.encoded_len_hint()
                    + 4
                    + commits.iter().map(|(n, _)| item(n)).sum::<usize>()
            }
            QueueDelta::Remove { topic, .. } => 4 + topic.len() + 8,
        }
    }

    /// Decodes exactly one queue delta; any other input is an error, never a panic.
    pub fn decode(data: &[u8]) -> Result<QueueDelta, StoreError> {
        let mut r = Reader::new(CONTEXT, data);
        let delta = match r.u8("marker")? {
            CREATE_TOPIC_MARKER => {
                let def = TopicDef {
                    name: text(&mut r, "topic name")?,
                    endpoint: text(&mut r, "endpoint")?,
                    keys: r.bytes("key pattern")?,
                    events: r.u8("events")?,
                    max_queue: u32::try_from(r.i32("max queue")?)
                        .map_err(|_| r.invalid("max queue", "must not be negative"))?,
                };
                if def.validate().is_err() {
                    return Err(r.invalid("topic", "not a valid topic definition"));
                }
                QueueDelta::CreateTopic(def)
            }
            DELETE_TOPIC_MARKER => QueueDelta::DeleteTopic(text(&mut r, "topic name")?),
            RESERVE_MARKER => {
                let n = r.len("count")?;
                let mut list = Vec::with_capacity(n.min(r.remaining() / 20));
                for _ in 0..n {
                    list.push((
                        text(&mut r, "topic name")?.into(),
                        r.u63("reservation id")?,
                        r.u63("deadline")?,
                    ));
                }
                QueueDelta::Reserve(list)
            }
            ABORT_MARKER => {
                let n = r.len("count")?;
                let mut list = Vec::with_capacity(n.min(r.remaining() / 12));
                for _ in 0..n {
                    list.push((text(&mut r, "topic name")?.into(), r.u63("reservation id")?));
                }
                QueueDelta::Abort(list)
            }
            COMMIT_MARKER => {
                let event = event_from_byte(r.u8("event")?).ok_or_else(|| {
                    r.invalid("event", "expected 1 (set), 2 (delete) or 4 (expire)")
                })?;
                let change = Delta::decode(r.buffer("key change")?)?;
                let n = r.len("count")?;
                let mut commits = Vec::with_capacity(n.min(r.remaining() / 12));
                for _ in 0..n {
                    commits.push((text(&mut r, "topic name")?.into(), r.u63("reservation id")?));
                }
                QueueDelta::Commit {
                    change,
                    event,
                    commits,
                }
            }
            REMOVE_MARKER => QueueDelta::Remove {
                topic: text(&mut r, "topic name")?,
                up_to_seq: r.u63("seq")?,
            },
            _ => return Err(r.invalid("marker", "not a queue delta marker")),
        };
        r.finish()?;
        Ok(delta)
    }
}

pub(crate) fn text(r: &mut Reader<'_>, what: &'static str) -> Result<String, StoreError> {
    let bytes = r.buffer(what)?;
    String::from_utf8(bytes.to_vec()).map_err(|_| r.invalid(what, "must be UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mqstate_protocol::Hlc;
    use proptest::prelude::*;

    fn def() -> TopicDef {
        TopicDef {
            name: "orders".into(),
            endpoint: "http://127.0.0.1:1/hook".into(),
            keys: Bytes::from_static(b"order:*"),
            events: 7,
            max_queue: 10,
        }
    }

    fn samples() -> Vec<QueueDelta> {
        vec![
            QueueDelta::CreateTopic(def()),
            QueueDelta::DeleteTopic("orders".into()),
            QueueDelta::Reserve(vec![("orders".into(), 3, 1000), ("b".into(), 1, 2)]),
            QueueDelta::Abort(vec![("orders".into(), 3)]),
            QueueDelta::Commit {
                change: Delta::Put {
                    key: Bytes::from_static(b"order:1"),
                    value: Bytes::from_static(b"v"),
                    version: Hlc::new(5, 1, Arc::from("n")),
                    fencing_token: None,
                    expires_at_ms: None,
                },
                event: Event::Set,
                commits: vec![("orders".into(), 3)],
            },
            QueueDelta::Remove {
                topic: "orders".into(),
                up_to_seq: 9,
            },
        ]
    }

    #[test]
    fn golden_remove() {
        let delta = QueueDelta::Remove {
            topic: "q".into(),
            up_to_seq: 258,
        };
        let wire: &[u8] = &[b'R', 0, 0, 0, 1, b'q', 0, 0, 0, 0, 0, 0, 1, 2];
        assert_eq!(delta.encode().unwrap(), wire);
        assert_eq!(QueueDelta::decode(wire).unwrap(), delta);
    }

    #[test]
    fn golden_reserve() {
        let delta = QueueDelta::Reserve(vec![("q".into(), 1, 2)]);
        let wire: &[u8] = &[
            b'V', 0, 0, 0, 1, 0, 0, 0, 1, b'q', 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2,
        ];
        assert_eq!(delta.encode().unwrap(), wire);
        assert_eq!(QueueDelta::decode(wire).unwrap(), delta);
    }

    #[test]
    fn round_trips_and_truncations_fail() {
        for delta in samples() {
            let bytes = delta.encode().unwrap();
            assert!(
                bytes.len() <= delta.encoded_len_hint(),
                "{delta:?}: encoding it must not grow its buffer"
            );
            assert!(QueueDelta::is_marker(bytes[0]));
            assert_eq!(QueueDelta::decode(&bytes).unwrap(), delta);
            for cut in 0..bytes.len() {
                assert!(
                    QueueDelta::decode(&bytes[..cut]).is_err(),
                    "{delta:?} cut {cut}"
                );
            }
            let mut trailing = bytes.clone();
            trailing.push(0);
            assert!(QueueDelta::decode(&trailing).is_err());
        }
    }

    #[test]
    fn an_invalid_topic_definition_is_refused() {
        let mut bad = def();
        bad.name = "a/b".into();
        let bytes = QueueDelta::CreateTopic(bad).encode().unwrap();
        assert!(QueueDelta::decode(&bytes).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(data in prop::collection::vec(any::<u8>(), 0..96)) {
            let _ = QueueDelta::decode(&data);
        }
    }
}
