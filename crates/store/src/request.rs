//! A request's identity and first reply, recorded with the change it made, so that a node that
//! learns the change from a log (a restart, a replica) still answers a retry of the request with
//! that reply instead of executing it again (the AIO protocol's duplicate-request rule).
//!
//! ```text
//! Requested 'I' | client id Buffer (UTF-8) | correlation data Buffer | expires at Int64 (Unix ms)
//!               | reply Buffer | reply __ts Nullable<HLC> | change Buffer (a 'K', 'X' or 'A' record)
//! ```
//! In a snapshot (format version 3) the same fields but the change, as a list after the keys.
//! The records are not state of the machine: replaying one applies its change; the identities
//! are for the service's duplicate-request cache.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::Hlc;

use crate::codec::{Reader, Writer};
use crate::error::StoreError;

/// Marker byte of a change made by an identified request.
pub const REQUESTED_MARKER: u8 = b'I';

/// Who asked for a change, until when a retry may come, and what the first reply was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub client_id: Arc<str>,
    pub correlation: Bytes,
    /// The request's own expiry (Unix ms): after it a retry is a new request.
    pub expires_at_ms: u64,
    /// The RESP payload of the first reply.
    pub reply: Bytes,
    /// The first reply's `__ts`.
    pub reply_ts: Option<Hlc>,
}

impl RequestRecord {
    /// Every field but the change.
    pub(crate) fn encode_fields(&self, w: &mut Writer) -> Result<(), StoreError> {
        w.buffer("client id", self.client_id.as_bytes())?;
        w.buffer("correlation data", &self.correlation)?;
        w.u63(self.expires_at_ms);
        w.buffer("reply", &self.reply)?;
        w.nullable_hlc(self.reply_ts.as_ref())
    }

    pub(crate) fn decode_fields(r: &mut Reader<'_>) -> Result<RequestRecord, StoreError> {
        let client_id = std::str::from_utf8(r.buffer("client id")?)
            .map_err(|_| r.invalid("client id", "must be UTF-8"))?;
        Ok(RequestRecord {
            client_id: Arc::from(client_id),
            correlation: r.bytes("correlation data")?,
            expires_at_ms: r.u63("expires at")?,
            reply: r.bytes("reply")?,
            reply_ts: r.nullable_hlc("reply __ts")?,
        })
    }

    /// The log record of `change` (an encoded `K`, `X` or `A` record) made by this request.
    pub fn encode_with(&self, change: &[u8]) -> Result<Vec<u8>, StoreError> {
        debug_assert!(
            matches!(change.first(), Some(b'K' | b'X' | b'A')),
            "only key changes and their commits come from requests"
        );
        let mut w = Writer::default();
        w.u8(REQUESTED_MARKER);
        self.encode_fields(&mut w)?;
        w.buffer("change", change)?;
        Ok(w.buf)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::delta::Delta;
    use crate::notify::record::COMMIT_MARKER;
    use crate::Change;
    use proptest::prelude::*;

    fn hlc(wall_ms: u64, counter: u32, node: &str) -> Hlc {
        Hlc::new(wall_ms, counter, Arc::from(node))
    }

    fn request() -> RequestRecord {
        RequestRecord {
            client_id: Arc::from("c1"),
            correlation: Bytes::from_static(&[0xAB, 0xCD]),
            expires_at_ms: 0x0102,
            reply: Bytes::from_static(b"+OK\r\n"),
            reply_ts: Some(hlc(7, 1, "n")),
        }
    }

    #[test]
    fn golden_requested_delete() {
        let change = Change::Requested {
            request: request(),
            change: Box::new(Change::Key(Delta::Delete {
                key: Bytes::from_static(b"k"),
                version: hlc(7, 1, "n"),
            })),
        };
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
        assert_eq!(change.encode().unwrap(), wire);
        assert_eq!(Change::decode(&wire).unwrap(), change);
    }

    #[test]
    fn only_key_changes_and_commits_are_wrapped() {
        let inner = |bytes: &[u8]| {
            let mut w = Writer::default();
            w.u8(REQUESTED_MARKER);
            request().encode_fields(&mut w).unwrap();
            w.buffer("change", bytes).unwrap();
            w.buf
        };
        let delete = Change::Key(Delta::Delete {
            key: Bytes::from_static(b"k"),
            version: hlc(7, 1, "n"),
        })
        .encode()
        .unwrap();
        assert!(Change::decode(&inner(&delete)).is_ok());
        // Nested, a topic record, nothing: refused.
        for bad in [inner(&delete), b"D\0\0\0\x01t".to_vec(), Vec::new()] {
            let wrapped = inner(&bad);
            assert!(Change::decode(&wrapped).is_err(), "{bad:?} accepted");
        }
        // A commit with a bad body is still refused by its own decoder.
        assert!(Change::decode(&inner(&[COMMIT_MARKER])).is_err());
    }

    #[test]
    fn a_client_id_that_is_not_utf8_is_refused() {
        let mut wire = Change::Requested {
            request: request(),
            change: Box::new(Change::Key(Delta::Delete {
                key: Bytes::from_static(b"k"),
                version: hlc(7, 1, "n"),
            })),
        }
        .encode()
        .unwrap();
        wire[5] = 0xFF;
        assert!(Change::decode(&wire).is_err());
    }

    pub(crate) fn any_request() -> impl Strategy<Value = RequestRecord> {
        (
            "[a-zA-Z0-9/é]{0,12}",
            prop::collection::vec(any::<u8>(), 0..20),
            0..=i64::MAX as u64,
            prop::collection::vec(any::<u8>(), 0..12),
            prop::option::of(crate::delta::tests::any_hlc()),
        )
            .prop_map(|(client_id, correlation, expires_at_ms, reply, reply_ts)| {
                RequestRecord {
                    client_id: Arc::from(client_id.as_str()),
                    correlation: Bytes::from(correlation),
                    expires_at_ms,
                    reply: Bytes::from(reply),
                    reply_ts,
                }
            })
    }

    proptest! {
        #[test]
        fn round_trip(request in any_request(), key in prop::collection::vec(any::<u8>(), 1..8),
                      version in crate::delta::tests::any_hlc()) {
            let change = Change::Requested {
                request,
                change: Box::new(Change::Key(Delta::Delete { key: Bytes::from(key), version })),
            };
            let wire = change.encode().unwrap();
            prop_assert_eq!(Change::decode(&wire).unwrap(), change);
        }

        #[test]
        fn decode_never_panics(tail in prop::collection::vec(any::<u8>(), 0..96)) {
            let mut data = vec![REQUESTED_MARKER];
            data.extend(tail);
            if let Ok(change) = Change::decode(&data) {
                prop_assert_eq!(change.encode().unwrap(), data);
            }
        }
    }
}
