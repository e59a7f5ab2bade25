//! The metadata file: small, fixed facts a node must never forget (term, vote, identity).
//!
//! ```text
//! v1: marker 5A 6E A0 12 | version Int32 = 1 | term Int64 | voted-for Int32 | CRC UInt32
//! v2: marker 5A 6E A0 12 | version Int32 = 2 | term Int64 | voted-for Int32
//!     | node id Buffer (UTF-8, empty = unset) | HLC high-water Int64 (ms, 0 = unset) | CRC UInt32
//! ```
//! The CRC covers every field but the marker. This build writes v2 and reads v1 and v2.

use bytes::BufMut;

use crate::checksum::crc32;
use crate::codec::{put_buffer, put_i32, put_i64, put_u32, to_disk_i64, Reader};
use crate::error::{Damage, FormatError, WalError};
use crate::failpoint::Failpoints;
use crate::layout::{read_optional, replace_atomically, DataDir};
use crate::Term;

pub const METADATA_MARKER: [u8; 4] = [0x5A, 0x6E, 0xA0, 0x12];
pub const METADATA_VERSION: i32 = 2;
/// Longest node id the file holds.
pub const NODE_ID_MAX_BYTES: usize = 255;
const NO_VOTE: i32 = -1;

/// What the metadata file records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    /// Last term this node saw (Raft); 0 on a single node.
    pub term: Term,
    /// Node voted for in `term`; at most `i32::MAX`.
    pub voted_for: Option<u32>,
    /// This node's id, empty until assigned (v2).
    pub node_id: String,
    /// Highest HLC wall time (ms) handed out, so a restart never issues an older one (v2).
    pub hlc_high_water_ms: u64,
}

/// The complete file content, always in the current version.
pub fn encode_metadata(metadata: &Metadata) -> Result<Vec<u8>, WalError> {
    let term = to_disk_i64(metadata.term).ok_or(WalError::OutOfRange {
        what: "metadata term",
        value: metadata.term,
    })?;
    let vote = match metadata.voted_for {
        None => NO_VOTE,
        Some(id) => i32::try_from(id).map_err(|_| WalError::OutOfRange {
            what: "voted-for node",
            value: u64::from(id),
        })?,
    };
    if metadata.node_id.len() > NODE_ID_MAX_BYTES {
        return Err(WalError::TooLarge {
            what: "node id",
            len: metadata.node_id.len(),
            max: NODE_ID_MAX_BYTES,
        });
    }
    let hlc = to_disk_i64(metadata.hlc_high_water_ms).ok_or(WalError::OutOfRange {
        what: "HLC high-water mark",
        value: metadata.hlc_high_water_ms,
    })?;
    let mut out = Vec::with_capacity(40 + metadata.node_id.len());
    out.put_slice(&METADATA_MARKER);
    put_i32(&mut out, METADATA_VERSION);
    put_i64(&mut out, term);
    put_i32(&mut out, vote);
    put_buffer(&mut out, metadata.node_id.as_bytes(), "node id")?;
    put_i64(&mut out, hlc);
    let checksum = crc32(&out[METADATA_MARKER.len()..]);
    put_u32(&mut out, checksum);
    Ok(out)
}

/// Decodes a whole metadata file of version 1 or 2.
pub fn decode_metadata(bytes: &[u8]) -> Result<Metadata, FormatError> {
    let mut r = Reader::new(bytes);
    let found = r.array4()?;
    if found != METADATA_MARKER {
        return Err(FormatError {
            offset: 0,
            damage: Damage::BadFileMarker {
                kind: "metadata",
                expected: METADATA_MARKER,
                found,
            },
        });
    }
    let version = r.i32()?;
    if !(1..=METADATA_VERSION).contains(&version) {
        return Err(FormatError {
            offset: 4,
            damage: Damage::UnsupportedVersion {
                kind: "metadata",
                found: version,
                supported: METADATA_VERSION,
            },
        });
    }
    let term = r.non_negative_i64("metadata term")?;
    let vote_at = r.pos() as u64;
    let voted_for = match r.i32()? {
        NO_VOTE => None,
        id => Some(u32::try_from(id).map_err(|_| FormatError {
            offset: vote_at,
            damage: Damage::InvalidVote(id),
        })?),
    };
    let mut metadata = Metadata {
        term,
        voted_for,
        ..Metadata::default()
    };
    if version >= 2 {
        let id_at = r.pos() as u64;
        let id = r.buffer(NODE_ID_MAX_BYTES)?;
        metadata.node_id = std::str::from_utf8(id)
            .map_err(|_| FormatError {
                offset: id_at,
                damage: Damage::InvalidUtf8,
            })?
            .to_owned();
        metadata.hlc_high_water_ms = r.non_negative_i64("HLC high-water mark")?;
    }
    let covered = &bytes[METADATA_MARKER.len()..r.pos()];
    let checksum_at = r.pos() as u64;
    let stored = r.u32()?;
    let computed = crc32(covered);
    if stored != computed {
        return Err(FormatError {
            offset: checksum_at,
            damage: Damage::ChecksumMismatch { stored, computed },
        });
    }
    r.expect_end()?;
    Ok(metadata)
}

/// Reads `<data>/mqstate.metadata`; `None` if absent or empty.
pub fn read_metadata(dir: &DataDir) -> Result<Option<Metadata>, WalError> {
    let path = dir.metadata_path();
    match read_optional(&path)? {
        None => Ok(None),
        Some(bytes) => decode_metadata(&bytes)
            .map(Some)
            .map_err(|e| WalError::corrupt(&path, e)),
    }
}

/// Replaces `<data>/mqstate.metadata` atomically (temp file, fsync, rename, directory fsync).
pub fn write_metadata(
    dir: &DataDir,
    metadata: &Metadata,
    failpoints: &Failpoints,
) -> Result<(), WalError> {
    let bytes = encode_metadata(metadata)?;
    replace_atomically(dir, &dir.metadata_path(), failpoints, |file| {
        std::io::Write::write_all(file, &bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_fresh_metadata() {
        let bytes = encode_metadata(&Metadata::default()).unwrap();
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0x5A, 0x6E, 0xA0, 0x12][..],   // marker
            &[0, 0, 0, 2],                   // version 2
            &[0, 0, 0, 0, 0, 0, 0, 0],       // term 0
            &[0xFF, 0xFF, 0xFF, 0xFF],       // voted-for -1 (none)
            &[0, 0, 0, 0],                   // node id: empty buffer
            &[0, 0, 0, 0, 0, 0, 0, 0],       // HLC high-water 0
            &[0xA2, 0xE5, 0x67, 0xEB],       // CRC of everything after the marker
        ].concat();
        assert_eq!(bytes, expected);
    }

    #[test]
    fn reads_the_taskflux_v1_layout() {
        let mut bytes = vec![0x5A, 0x6E, 0xA0, 0x12, 0, 0, 0, 1];
        bytes.extend_from_slice(&5i64.to_be_bytes());
        bytes.extend_from_slice(&2i32.to_be_bytes());
        let checksum = crc32(&bytes[4..]);
        bytes.extend_from_slice(&checksum.to_be_bytes());
        let metadata = decode_metadata(&bytes).unwrap();
        assert_eq!(
            metadata,
            Metadata {
                term: 5,
                voted_for: Some(2),
                ..Metadata::default()
            }
        );
    }

    #[test]
    fn rejects_other_negative_votes() {
        let mut bytes = encode_metadata(&Metadata::default()).unwrap();
        bytes[16..20].copy_from_slice(&(-2i32).to_be_bytes());
        let err = decode_metadata(&bytes).unwrap_err();
        assert_eq!(
            err,
            FormatError {
                offset: 16,
                damage: Damage::InvalidVote(-2)
            }
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode_metadata(&bytes);
        }

        #[test]
        fn round_trip(term in 0..=i64::MAX as u64, vote in proptest::option::of(0..=i32::MAX as u32),
                      node_id in "[a-z0-9-]{0,40}", hlc in 0..=i64::MAX as u64) {
            let metadata = Metadata { term, voted_for: vote, node_id, hlc_high_water_ms: hlc };
            let back = decode_metadata(&encode_metadata(&metadata).unwrap()).unwrap();
            prop_assert_eq!(back, metadata);
        }
    }
}
