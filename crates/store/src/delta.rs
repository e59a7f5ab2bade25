//! Key-value deltas: the only way the keyspace changes, and the unit the WAL and replication carry.
//!
//! ```text
//! Put    'K' | key Buffer | value Buffer | version HLC | fencing token Nullable<HLC> | expires at Nullable<Int64>
//! Delete 'X' | key Buffer | version HLC
//! HLC    = wall ms Int64 | counter Int32 | node id Buffer (UTF-8)
//! ```
//! Markers `K`/`X` do not collide with the queue deltas `C`/`D`/`A`/`R` of `storage-format.md`.

use bytes::Bytes;
use mqstate_protocol::Hlc;

use crate::codec::{Reader, Writer};
use crate::error::StoreError;

/// Marker byte of [`Delta::Put`].
pub const PUT_MARKER: u8 = b'K';
/// Marker byte of [`Delta::Delete`].
pub const DELETE_MARKER: u8 = b'X';

/// One change to the keyspace. Applying the same deltas in the same order always yields the same state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Create or replace `key`.
    Put {
        key: Bytes,
        value: Bytes,
        version: Hlc,
        fencing_token: Option<Hlc>,
        /// Absolute deadline, Unix milliseconds.
        expires_at_ms: Option<u64>,
    },
    /// Remove `key` (by DEL, VDEL or expiry).
    Delete { key: Bytes, version: Hlc },
}

impl Delta {
    /// The key this delta changes.
    pub fn key(&self) -> &Bytes {
        match self {
            Delta::Put { key, .. } | Delta::Delete { key, .. } => key,
        }
    }

    /// The version of the change (the `__ts` of its notifications).
    pub fn version(&self) -> &Hlc {
        match self {
            Delta::Put { version, .. } | Delta::Delete { version, .. } => version,
        }
    }

    /// The binary form (first byte an ASCII marker).
    pub fn encode(&self) -> Result<Vec<u8>, StoreError> {
        let mut w = Writer::with_capacity(self.encoded_len_hint());
        self.encode_into(&mut w)?;
        Ok(w.buf)
    }

    /// An upper bound of the size of the binary form (exact for a put with an expiry).
    pub(crate) fn encoded_len_hint(&self) -> usize {
        // marker, key and value lengths, HLC wall + counter + node id length, nullable flags.
        const FIXED: usize = 1 + 4 + 4 + 16 + 2 + 8;
        match self {
            Delta::Put {
                key,
                value,
                version,
                fencing_token,
                ..
            } => {
                FIXED
                    + key.len()
                    + value.len()
                    + version.node_id.len()
                    + fencing_token.as_ref().map_or(0, |t| 16 + t.node_id.len())
            }
            Delta::Delete { key, version } => FIXED + key.len() + version.node_id.len(),
        }
    }

    /// Appends the binary form to `w`.
    pub(crate) fn encode_into(&self, w: &mut Writer) -> Result<(), StoreError> {
        match self {
            Delta::Put {
                key,
                value,
                version,
                fencing_token,
                expires_at_ms,
            } => {
                w.u8(PUT_MARKER);
                w.buffer("key", key)?;
                w.buffer("value", value)?;
                w.hlc(version)?;
                w.nullable_hlc(fencing_token.as_ref())?;
                w.nullable_u64(*expires_at_ms);
            }
            Delta::Delete { key, version } => {
                w.u8(DELETE_MARKER);
                w.buffer("key", key)?;
                w.hlc(version)?;
            }
        }
        Ok(())
    }

    /// The version of an encoded delta, read without copying its key or value (the fields after
    /// the version are not checked: [`Delta::decode`] checks them).
    pub(crate) fn version_of(data: &[u8]) -> Result<Hlc, StoreError> {
        let mut r = Reader::new("key-value delta", data);
        match r.u8("marker")? {
            PUT_MARKER => {
                r.key()?;
                r.buffer("value")?;
            }
            DELETE_MARKER => {
                r.key()?;
            }
            _ => return Err(r.invalid("marker", "expected 'K' (put) or 'X' (delete)")),
        }
        r.hlc("version")
    }

    /// Decodes exactly one delta; any other input is an error, never a panic.
    pub fn decode(data: &[u8]) -> Result<Delta, StoreError> {
        let mut r = Reader::new("key-value delta", data);
        let delta = match r.u8("marker")? {
            PUT_MARKER => Delta::Put {
                key: Bytes::copy_from_slice(r.key()?),
                value: r.bytes("value")?,
                version: r.hlc("version")?,
                fencing_token: r.nullable_hlc("fencing token")?,
                expires_at_ms: r.nullable_u63("expiry")?,
            },
            DELETE_MARKER => Delta::Delete {
                key: Bytes::copy_from_slice(r.key()?),
                version: r.hlc("version")?,
            },
            _ => {
                return Err(StoreError::Invalid {
                    context: "key-value delta",
                    what: "marker",
                    offset: 0,
                    reason: "expected 'K' (put) or 'X' (delete)",
                })
            }
        };
        r.finish()?;
        Ok(delta)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn hlc(wall_ms: u64, counter: u32, node: &str) -> Hlc {
        Hlc::new(wall_ms, counter, Arc::from(node))
    }

    #[test]
    fn golden_put() {
        let delta = Delta::Put {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"vv"),
            version: hlc(258, 3, "n"),
            fencing_token: Some(hlc(1, 0, "")),
            expires_at_ms: Some(5),
        };
        let wire: &[u8] = &[
            b'K', 0, 0, 0, 1, b'k', 0, 0, 0, 2, b'v', b'v', // key, value
            0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 3, 0, 0, 0, 1, b'n', // version
            1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, // fencing token
            1, 0, 0, 0, 0, 0, 0, 0, 5, // expiry
        ];
        assert_eq!(delta.encode().unwrap(), wire);
        assert_eq!(Delta::decode(wire).unwrap(), delta);
    }

    #[test]
    fn golden_delete() {
        let delta = Delta::Delete {
            key: Bytes::from_static(b"ab"),
            version: hlc(1, 2, "s"),
        };
        let wire: &[u8] = &[
            b'X', 0, 0, 0, 2, b'a', b'b', 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 1, b's',
        ];
        assert_eq!(delta.encode().unwrap(), wire);
        assert_eq!(Delta::decode(wire).unwrap(), delta);
    }

    #[test]
    fn rejects_bad_input() {
        let good = Delta::Delete {
            key: Bytes::from_static(b"ab"),
            version: hlc(1, 2, "s"),
        }
        .encode()
        .unwrap();
        for cut in 0..good.len() {
            assert!(matches!(
                Delta::decode(&good[..cut]),
                Err(StoreError::Truncated { .. })
            ));
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(matches!(
            Delta::decode(&trailing),
            Err(StoreError::TrailingBytes { .. })
        ));
        assert!(Delta::decode(b"Z").is_err());
        let empty_key = [
            b'X', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0,
        ];
        assert!(Delta::decode(&empty_key).is_err());
        let negative_len = [b'X', 0xff, 0xff, 0xff, 0xff];
        assert!(Delta::decode(&negative_len).is_err());
        let colon_node = [
            b'X', 0, 0, 0, 1, b'k', 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 1, b':',
        ];
        assert!(Delta::decode(&colon_node).is_err());
    }

    pub(crate) fn any_hlc() -> impl Strategy<Value = Hlc> {
        (0..=i64::MAX as u64, 0..=i32::MAX as u32, "[a-z]{0,4}")
            .prop_map(|(w, c, n)| Hlc::new(w, c, Arc::from(n.as_str())))
    }

    pub(crate) fn any_delta() -> impl Strategy<Value = Delta> {
        let bytes = |min| prop::collection::vec(any::<u8>(), min..16).prop_map(Bytes::from);
        prop_oneof![
            (
                bytes(1),
                bytes(0),
                any_hlc(),
                prop::option::of(any_hlc()),
                prop::option::of(0..=i64::MAX as u64)
            )
                .prop_map(|(key, value, version, fencing_token, expires_at_ms)| {
                    Delta::Put {
                        key,
                        value,
                        version,
                        fencing_token,
                        expires_at_ms,
                    }
                }),
            (bytes(1), any_hlc()).prop_map(|(key, version)| Delta::Delete { key, version }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(delta in any_delta()) {
            let bytes = delta.encode().unwrap();
            // One allocation: the hint is an upper bound.
            prop_assert!(bytes.len() <= delta.encoded_len_hint());
            prop_assert_eq!(Delta::version_of(&bytes).unwrap(), delta.version().clone());
            prop_assert_eq!(Delta::decode(&bytes).unwrap(), delta);
        }

        #[test]
        fn decode_never_panics(data in prop::collection::vec(any::<u8>(), 0..96)) {
            let _ = Delta::decode(&data);
        }
    }
}
