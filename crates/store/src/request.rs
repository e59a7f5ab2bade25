//! A request's identity and first reply, recorded with the change it made, so that a node that
//! learns the change from a log (a restart, a replica) still answers a retry of the request with
//! that reply instead of executing it again (the AIO protocol's duplicate-request rule).
//!
//! ```text
//! Requested 'J' | request id 16 bytes | expires at Int64 (Unix ms) | reply | reply __ts
//!               | change (the rest of the record: a 'K', 'X' or 'A' record)
//! request id    = the first 16 bytes of SHA-256(client id Buffer ‖ correlation data Buffer)
//! reply         = UInt8 1 (`+OK\r\n`) | 2 (`:1\r\n`) | 0 then Buffer (any other RESP payload)
//! reply __ts    = UInt8 0 (none) | 1 (the change's version) | 2 then HLC (any other)
//! ```
//! The identity is kept compact because every logged write carries it (decision 0034): a fixed-width
//! id instead of the client id and correlation data, and the reply and `__ts` of a SET or a DEL as a
//! byte, since they follow from the change. One encoding per value: a reply or `__ts` that has a
//! byte of its own is refused when spelled out.
//!
//! In a snapshot (format version 4) a request is `request id | expires at | reply | reply __ts
//! Nullable<HLC>` (no change to take the version from), as a list after the keys.
//!
//! Records and snapshots of the previous release (`'I'`, snapshot format 3) carry the client id and
//! correlation data themselves; they are still read, and their id computed from them.
//!
//! The records are not state of the machine: replaying one applies its change; the identities
//! are for the service's duplicate-request cache.

use std::fmt;

use bytes::Bytes;
use mqstate_protocol::Hlc;
use sha2::{Digest, Sha256};

use crate::codec::{Reader, Writer};
use crate::delta::Delta;
use crate::error::StoreError;
use crate::notify::QueueDelta;
use crate::Change;

/// Marker byte of a change made by an identified request.
pub const REQUESTED_MARKER: u8 = b'J';
/// Marker byte of the previous release's request record (client id and correlation data spelled
/// out); read, never written.
pub const LEGACY_REQUESTED_MARKER: u8 = b'I';

/// The identity of a request: who sent it (client id) and which of its requests it is
/// (correlation data), hashed to a fixed width.
///
/// SHA-256 rather than a fast hash because an id that two requests share lets one get the other's
/// reply (a GET's value among them): finding a collision must be out of reach for a client that
/// chooses its own client id and correlation data. 128 bits keep that (2^64 work) and half the size.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub [u8; 16]);

impl RequestId {
    /// The id of the request `correlation` of client `client_id`.
    pub fn of(client_id: &str, correlation: &[u8]) -> RequestId {
        let mut hasher = Sha256::new();
        // As `Buffer`s, so that ("ab", "c") and ("a", "bc") differ. MQTT bounds both to 65,535
        // bytes, so the lengths always fit.
        for part in [client_id.as_bytes(), correlation] {
            hasher.update(u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            hasher.update(part);
        }
        let digest = hasher.finalize();
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        RequestId(id)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({self})")
    }
}

/// Which request made a change, until when a retry may come, and what the first reply was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub id: RequestId,
    /// The request's own expiry (Unix ms): after it a retry is a new request.
    pub expires_at_ms: u64,
    /// The RESP payload of the first reply.
    pub reply: Bytes,
    /// The first reply's `__ts`.
    pub reply_ts: Option<Hlc>,
}

/// Replies that take one byte: (byte, payload). Byte 0 is a payload spelled out.
const SHORT_REPLIES: [(u8, &[u8]); 2] = [(1, b"+OK\r\n"), (2, b":1\r\n")];
const REPLY_SPELLED_OUT: u8 = 0;

/// `reply __ts` of a `'J'` record.
const TS_NONE: u8 = 0;
const TS_OF_CHANGE: u8 = 1;
const TS_SPELLED_OUT: u8 = 2;

/// The fewest bytes of a `'J'` record before its change.
pub(crate) const MIN_REQUESTED_HEADER: usize = 1 + 16 + 8 + 1 + 1;

impl RequestRecord {
    /// The fields of a snapshot's request (format version 4).
    pub(crate) fn encode_fields(&self, w: &mut Writer) -> Result<(), StoreError> {
        w.bytes(&self.id.0);
        w.u63(self.expires_at_ms);
        self.encode_reply(w)?;
        w.nullable_hlc(self.reply_ts.as_ref())
    }

    pub(crate) fn decode_fields(r: &mut Reader<'_>) -> Result<RequestRecord, StoreError> {
        Ok(RequestRecord {
            id: RequestId(r.array("request id")?),
            expires_at_ms: r.u63("expires at")?,
            reply: decode_reply(r)?,
            reply_ts: r.nullable_hlc("reply __ts")?,
        })
    }

    /// The fields of the previous release's request (an `'I'` record's, a format-3 snapshot's):
    /// client id, correlation data, expires at, reply `Buffer`, reply `__ts` `Nullable<HLC>`.
    pub(crate) fn decode_legacy_fields(r: &mut Reader<'_>) -> Result<RequestRecord, StoreError> {
        let client_id = std::str::from_utf8(r.buffer("client id")?)
            .map_err(|_| r.invalid("client id", "must be UTF-8"))?;
        let correlation = r.buffer("correlation data")?;
        Ok(RequestRecord {
            id: RequestId::of(client_id, correlation),
            expires_at_ms: r.u63("expires at")?,
            reply: r.bytes("reply")?,
            reply_ts: r.nullable_hlc("reply __ts")?,
        })
    }

    fn encode_reply(&self, w: &mut Writer) -> Result<(), StoreError> {
        match SHORT_REPLIES.iter().find(|(_, p)| *p == &self.reply[..]) {
            Some((byte, _)) => {
                w.u8(*byte);
                Ok(())
            }
            None => {
                w.u8(REPLY_SPELLED_OUT);
                w.buffer("reply", &self.reply)
            }
        }
    }

    /// The log record of `change` (an encoded `K`, `X` or `A` record, whose key change has version
    /// `change_version`) made by this request.
    pub fn encode_with(&self, change: &[u8], change_version: &Hlc) -> Result<Vec<u8>, StoreError> {
        debug_assert!(
            matches!(change.first(), Some(b'K' | b'X' | b'A')),
            "only key changes and their commits come from requests"
        );
        let mut w = Writer {
            buf: Vec::with_capacity(MIN_REQUESTED_HEADER + change.len()),
        };
        w.u8(REQUESTED_MARKER);
        w.bytes(&self.id.0);
        w.u63(self.expires_at_ms);
        self.encode_reply(&mut w)?;
        match &self.reply_ts {
            None => w.u8(TS_NONE),
            Some(ts) if ts == change_version => w.u8(TS_OF_CHANGE),
            Some(ts) => {
                w.u8(TS_SPELLED_OUT);
                w.hlc(ts)?;
            }
        }
        w.bytes(change);
        Ok(w.buf)
    }
}

fn decode_reply(r: &mut Reader<'_>) -> Result<Bytes, StoreError> {
    match r.u8("reply")? {
        REPLY_SPELLED_OUT => {
            let reply = r.buffer("reply")?;
            if SHORT_REPLIES.iter().any(|(_, p)| *p == reply) {
                return Err(r.invalid("reply", "a reply with a byte of its own is spelled out"));
            }
            Ok(Bytes::copy_from_slice(reply))
        }
        byte => SHORT_REPLIES
            .iter()
            .find(|(b, _)| *b == byte)
            .map(|(_, payload)| Bytes::from_static(payload))
            .ok_or_else(|| r.invalid("reply", "expected 0, 1 or 2")),
    }
}

impl RequestRecord {
    /// The request that made the encoded log record `data`, if one did (`Ok(None)`: a key or
    /// queue record of its own). A `'J'` record's header is read, and of its change only the
    /// version (its key and value are skipped, not copied): a replica notes the request of every
    /// row it persists (decision 0050). Where [`Change::decode`] accepts `data`, this is its
    /// [`Change::request`]; the rest of the change is not checked here, but by whoever decodes
    /// the record to apply it.
    pub fn of_record(data: &[u8]) -> Result<Option<RequestRecord>, StoreError> {
        match data.first() {
            Some(&REQUESTED_MARKER) => {
                let mut r = Reader::new("requested change", data);
                let header = Header::decode(&mut r)?;
                let inner = r.rest();
                let version = version_of_change(&r, inner)?;
                header.with_version(&r, &version).map(Some)
            }
            Some(&LEGACY_REQUESTED_MARKER) => Ok(decode_legacy_requested(data)?.request().cloned()),
            _ => Ok(None),
        }
    }
}

/// A `'J'` record before its change: the `reply __ts` may be the change's version.
struct Header {
    id: RequestId,
    expires_at_ms: u64,
    reply: Bytes,
    /// `None`: no `__ts`; `Some(None)`: the change's version.
    ts: Option<Option<Hlc>>,
}

impl Header {
    fn decode(r: &mut Reader<'_>) -> Result<Header, StoreError> {
        r.u8("marker")?;
        Ok(Header {
            id: RequestId(r.array("request id")?),
            expires_at_ms: r.u63("expires at")?,
            reply: decode_reply(r)?,
            ts: match r.u8("reply __ts")? {
                TS_NONE => None,
                TS_OF_CHANGE => Some(None),
                TS_SPELLED_OUT => Some(Some(r.hlc("reply __ts")?)),
                _ => return Err(r.invalid("reply __ts", "expected 0, 1 or 2")),
            },
        })
    }

    /// The request, its change's version being `version`.
    fn with_version(self, r: &Reader<'_>, version: &Hlc) -> Result<RequestRecord, StoreError> {
        let reply_ts = match self.ts {
            None => None,
            Some(None) => Some(version.clone()),
            Some(Some(ts)) if ts == *version => {
                return Err(r.invalid(
                    "reply __ts",
                    "the change's version is written as 1, not spelled out",
                ))
            }
            Some(spelled) => spelled,
        };
        Ok(RequestRecord {
            id: self.id,
            expires_at_ms: self.expires_at_ms,
            reply: self.reply,
            reply_ts,
        })
    }
}

/// The version of the key change a request made (an encoded `K` or `X` record, or an `A` commit
/// of one), its key and value skipped.
fn version_of_change(r: &Reader<'_>, inner: &[u8]) -> Result<Hlc, StoreError> {
    match inner.first() {
        Some(b'A') => {
            let mut commit = Reader::new("queue delta", inner);
            commit.u8("marker")?;
            commit.u8("event")?;
            Delta::version_of(commit.buffer("key change")?)
        }
        Some(b'K' | b'X') => Delta::version_of(inner),
        _ => Err(r.invalid(
            "change",
            "a request's change must be a 'K', 'X' or 'A' record",
        )),
    }
}

/// The key change a request may have made: a `K` or `X` record, or an `A` commit.
fn decode_change(r: &Reader<'_>, inner: &[u8]) -> Result<Change, StoreError> {
    match inner.first() {
        Some(b'A') => QueueDelta::decode(inner).map(Change::Queue),
        Some(b'K' | b'X') => Delta::decode(inner).map(Change::Key),
        _ => Err(r.invalid(
            "change",
            "a request's change must be a 'K', 'X' or 'A' record",
        )),
    }
}

/// Decodes a `'J'` record.
pub(crate) fn decode_requested(data: &[u8]) -> Result<Change, StoreError> {
    let mut r = Reader::new("requested change", data);
    let header = Header::decode(&mut r)?;
    let inner = r.rest();
    let change = decode_change(&r, inner)?;
    let Some(version) = change.key_version() else {
        return Err(r.invalid("change", "a request's change must change a key"));
    };
    Ok(Change::Requested {
        request: header.with_version(&r, version)?,
        change: Box::new(change),
    })
}

/// Decodes an `'I'` record (the previous release's).
pub(crate) fn decode_legacy_requested(data: &[u8]) -> Result<Change, StoreError> {
    let mut r = Reader::new("requested change", data);
    r.u8("marker")?;
    let request = RequestRecord::decode_legacy_fields(&mut r)?;
    let inner = r.buffer("change")?;
    r.finish()?;
    Ok(Change::Requested {
        request,
        change: Box::new(decode_change(&r, inner)?),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::notify::record::COMMIT_MARKER;
    use proptest::prelude::*;

    fn hlc(wall_ms: u64, counter: u32, node: &str) -> Hlc {
        Hlc::new(wall_ms, counter, Arc::from(node))
    }

    /// `RequestId::of("c1", AB CD)`, computed independently (Python's hashlib).
    const C1_ABCD: [u8; 16] = [
        0x3c, 0x1d, 0x16, 0x5a, 0x24, 0x1d, 0x59, 0x86, 0xf1, 0xd8, 0x71, 0x45, 0x70, 0x2f, 0x40,
        0x91,
    ];

    fn request(reply: &'static [u8], reply_ts: Option<Hlc>) -> RequestRecord {
        RequestRecord {
            id: RequestId::of("c1", &[0xAB, 0xCD]),
            expires_at_ms: 0x0102,
            reply: Bytes::from_static(reply),
            reply_ts,
        }
    }

    fn delete(version: Hlc) -> Change {
        Change::Key(Delta::Delete {
            key: Bytes::from_static(b"k"),
            version,
        })
    }

    #[test]
    fn the_id_is_sha256_of_the_client_id_and_correlation_data_as_buffers() {
        assert_eq!(RequestId::of("c1", &[0xAB, 0xCD]).0, C1_ABCD);
        assert_ne!(RequestId::of("ab", b"c"), RequestId::of("a", b"bc"));
        assert_eq!(
            RequestId(C1_ABCD).to_string(),
            "3c1d165a241d5986f1d87145702f4091"
        );
    }

    #[test]
    fn golden_requested_delete() {
        // A DEL's reply: `:1`, no `__ts`.
        let change = Change::Requested {
            request: request(b":1\r\n", None),
            change: Box::new(delete(hlc(7, 1, "n"))),
        };
        #[rustfmt::skip]
        let wire: Vec<u8> = [
            &[b'J'][..],
            &C1_ABCD,                                               // request id
            &[0, 0, 0, 0, 0, 0, 0x01, 0x02],                        // expires at
            &[2],                                                   // reply `:1`
            &[0],                                                   // no reply __ts
            &[b'X', 0, 0, 0, 1, b'k', 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 1, b'n'],
        ].concat();
        assert_eq!(change.encode().unwrap(), wire);
        assert_eq!(Change::decode(&wire).unwrap(), change);
    }

    #[test]
    fn golden_requested_delete_with_a_reply_spelled_out() {
        let change = Change::Requested {
            request: request(b":-1\r\n", Some(hlc(8, 0, "m"))),
            change: Box::new(delete(hlc(7, 1, "n"))),
        };
        #[rustfmt::skip]
        let wire: Vec<u8> = [
            &[b'J'][..],
            &C1_ABCD,
            &[0, 0, 0, 0, 0, 0, 0x01, 0x02],
            &[0, 0, 0, 0, 5], b":-1\r\n",                           // reply spelled out
            &[2, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 1, b'm'], // reply __ts spelled out
            &[b'X', 0, 0, 0, 1, b'k', 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 1, b'n'],
        ].concat();
        assert_eq!(change.encode().unwrap(), wire);
        assert_eq!(Change::decode(&wire).unwrap(), change);
    }

    #[test]
    fn a_set_takes_its_reply_and_timestamp_from_its_change() {
        let version = hlc(7, 1, "n");
        let change = Change::Requested {
            request: request(b"+OK\r\n", Some(version.clone())),
            change: Box::new(Change::Key(Delta::Put {
                key: Bytes::from_static(b"k"),
                value: Bytes::from_static(b"v"),
                version,
                fencing_token: None,
                expires_at_ms: None,
            })),
        };
        let wire = change.encode().unwrap();
        assert_eq!(&wire[25..27], &[1, 1], "`+OK`, the change's version");
        assert_eq!(Change::decode(&wire).unwrap(), change);
    }

    #[test]
    fn a_record_of_the_previous_release_is_read_with_its_id_computed() {
        #[rustfmt::skip]
        let wire: Vec<u8> = [
            &[b'I'][..],
            &[0, 0, 0, 2], b"c1",                                   // client id
            &[0, 0, 0, 2, 0xAB, 0xCD],                              // correlation data
            &[0, 0, 0, 0, 0, 0, 0x01, 0x02],                        // expires at
            &[0, 0, 0, 5], b"+OK\r\n",                              // reply
            &[1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 1, b'n'], // reply __ts
            &[0, 0, 0, 23],                                         // change Buffer
            &[b'X', 0, 0, 0, 1, b'k', 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 1, b'n'],
        ].concat();
        let expected = Change::Requested {
            request: request(b"+OK\r\n", Some(hlc(7, 1, "n"))),
            change: Box::new(delete(hlc(7, 1, "n"))),
        };
        assert_eq!(Change::decode(&wire).unwrap(), expected);
        // Written again, it is the compact record.
        assert_eq!(expected.encode().unwrap()[0], b'J');
        // Not UTF-8: refused.
        let mut bad = wire.clone();
        bad[5] = 0xFF;
        assert!(Change::decode(&bad).is_err());
    }

    #[test]
    fn only_key_changes_and_commits_are_wrapped() {
        let wrap = |change: &[u8]| {
            let mut w = request(b"+OK\r\n", None)
                .encode_with(b"X", &hlc(1, 0, "n"))
                .unwrap();
            w.truncate(w.len() - 1);
            w.extend_from_slice(change);
            w
        };
        let delete = delete(hlc(7, 1, "n")).encode().unwrap();
        assert!(Change::decode(&wrap(&delete)).is_ok());
        // Nested, a topic record, nothing: refused.
        for bad in [wrap(&delete), b"D\0\0\0\x01t".to_vec(), Vec::new()] {
            let wrapped = wrap(&bad);
            assert!(Change::decode(&wrapped).is_err(), "{bad:?} accepted");
        }
        // A commit with a bad body is still refused by its own decoder.
        assert!(Change::decode(&wrap(&[COMMIT_MARKER])).is_err());
    }

    #[test]
    fn a_value_with_a_byte_of_its_own_is_refused_spelled_out() {
        let version = hlc(7, 1, "n");
        let record = |reply: &[u8], ts: &[u8]| {
            let mut w = vec![b'J'];
            w.extend_from_slice(&C1_ABCD);
            w.extend_from_slice(&[0; 8]);
            w.extend_from_slice(reply);
            w.extend_from_slice(ts);
            w.extend(delete(version.clone()).encode().unwrap());
            w
        };
        assert!(Change::decode(&record(&[1], &[0])).is_ok());
        assert!(Change::decode(&record(
            &[0, 0, 0, 0, 5, b'+', b'O', b'K', b'\r', b'\n'],
            &[0]
        ))
        .is_err());
        let mut spelled_version = vec![2];
        let mut w = Writer::default();
        w.hlc(&version).unwrap();
        spelled_version.extend(w.buf);
        assert!(Change::decode(&record(&[1], &spelled_version)).is_err());
        assert!(Change::decode(&record(&[3], &[0])).is_err());
        assert!(Change::decode(&record(&[1], &[3])).is_err());
    }

    pub(crate) fn any_request() -> impl Strategy<Value = RequestRecord> {
        (
            any::<[u8; 16]>(),
            0..=i64::MAX as u64,
            prop_oneof![
                Just(b"+OK\r\n".to_vec()),
                Just(b":1\r\n".to_vec()),
                prop::collection::vec(any::<u8>(), 0..12),
            ],
            prop::option::of(crate::delta::tests::any_hlc()),
        )
            .prop_map(|(id, expires_at_ms, reply, reply_ts)| RequestRecord {
                id: RequestId(id),
                expires_at_ms,
                reply: Bytes::from(reply),
                reply_ts,
            })
    }

    proptest! {
        #[test]
        fn round_trip(request in any_request(), key in prop::collection::vec(any::<u8>(), 1..8),
                      version in crate::delta::tests::any_hlc(), ts_of_change in any::<bool>()) {
            let mut request = request;
            if ts_of_change {
                request.reply_ts = Some(version.clone());
            }
            let change = Change::Requested {
                request,
                change: Box::new(Change::Key(Delta::Delete { key: Bytes::from(key), version })),
            };
            let wire = change.encode().unwrap();
            prop_assert_eq!(Change::decode(&wire).unwrap(), change);
        }

        #[test]
        fn the_header_read_finds_the_decoded_request(request in any_request(),
                      delta in crate::delta::tests::any_delta(), committed in any::<bool>(),
                      ts_of_change in any::<bool>()) {
            let mut request = request;
            if ts_of_change {
                request.reply_ts = Some(delta.version().clone());
            }
            let change = if committed {
                Change::Queue(QueueDelta::Commit {
                    change: delta,
                    event: crate::notify::Event::Set,
                    commits: vec![(Arc::from("t"), 3)],
                })
            } else {
                Change::Key(delta)
            };
            let inner = change.encode().unwrap();
            prop_assert_eq!(RequestRecord::of_record(&inner).unwrap(), None);
            let wire = Change::Requested { request: request.clone(), change: Box::new(change) }
                .encode()
                .unwrap();
            prop_assert_eq!(RequestRecord::of_record(&wire).unwrap(), Some(request));
        }

        #[test]
        fn decode_never_panics(tail in prop::collection::vec(any::<u8>(), 0..96)) {
            let mut data = vec![REQUESTED_MARKER];
            data.extend(&tail);
            let header_read = RequestRecord::of_record(&data);
            if let Ok(change) = Change::decode(&data) {
                prop_assert_eq!(header_read.unwrap(), change.request().cloned());
                prop_assert_eq!(change.encode().unwrap(), data);
            }
            let mut legacy = vec![LEGACY_REQUESTED_MARKER];
            legacy.extend(tail);
            let _ = Change::decode(&legacy);
        }
    }
}
