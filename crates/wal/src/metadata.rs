//! The metadata file: small, fixed facts a node must never forget (term, vote, identity, how far
//! the log is known durable, what was purged from its front).
//!
//! ```text
//! v1: marker 5A 6E A0 12 | version Int32 = 1 | term Int64 | voted-for Int32 | CRC UInt32
//! v2: marker 5A 6E A0 12 | version Int32 = 2 | term Int64 | voted-for Int32
//!     | node id Buffer (UTF-8, empty = unset) | HLC high-water Int64 (ms, 0 = unset) | CRC UInt32
//! v3: v2's fields | durable end Int64 | last purged index Int64 (-1 = none) | last purged term Int64
//!     | committed index Int64 (-1 = none) | committed term Int64 | vote committed Bool | CRC UInt32
//! ```
//! The CRC covers every field but the marker. This build writes v3 and reads v1 to v3.

use std::sync::Mutex;

use bytes::BufMut;
use tokio::sync::watch;

use crate::checksum::crc32;
use crate::codec::{put_buffer, put_i32, put_i64, put_u32, to_disk_i64, Reader};
use crate::error::{Damage, FormatError, WalError};
use crate::failpoint::Failpoints;
use crate::layout::{read_optional, replace_atomically, DataDir};
use crate::{Lsn, Term};

pub const METADATA_MARKER: [u8; 4] = [0x5A, 0x6E, 0xA0, 0x12];
pub const METADATA_VERSION: i32 = 3;
/// Longest node id the file holds.
pub const NODE_ID_MAX_BYTES: usize = 255;
const NO_VOTE: i32 = -1;
/// The index of an absent log id.
const NO_LOG_ID: i64 = -1;

/// A record's place in the log: its index (LSN) and the term it was written in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogId {
    pub term: Term,
    pub index: Lsn,
}

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
    /// Every record below this LSN was fsynced (v3; 0 = nothing known). Owned by the log: it is
    /// raised at rotation, snapshot, shutdown, periodically and with every other metadata write,
    /// and lowered before the log is cut below it. A log that ends below it lost records that were
    /// acknowledged, which recovery refuses rather than cuts.
    pub durable_end: Lsn,
    /// The last record removed from the front of the log (v3; openraft's "last purged log id").
    /// Owned by the log.
    pub last_purged: Option<LogId>,
    /// The last record known committed (v3; openraft's `save_committed`), if the application
    /// records it.
    pub committed: Option<LogId>,
    /// Whether the vote (`term`, `voted_for`) is committed, i.e. granted by a quorum (v3; openraft's
    /// `Vote::committed`).
    pub vote_committed: bool,
}

/// `(index, term)` on disk: `(-1, 0)` for none.
fn encode_log_id(id: Option<LogId>, what: &'static str) -> Result<(i64, i64), WalError> {
    match id {
        None => Ok((NO_LOG_ID, 0)),
        Some(id) => Ok((
            to_disk_i64(id.index).ok_or(WalError::OutOfRange {
                what,
                value: id.index,
            })?,
            to_disk_i64(id.term).ok_or(WalError::OutOfRange {
                what,
                value: id.term,
            })?,
        )),
    }
}

fn decode_log_id(r: &mut Reader<'_>, what: &'static str) -> Result<Option<LogId>, FormatError> {
    let index_at = r.pos() as u64;
    let index = r.i64()?;
    let term_at = r.pos() as u64;
    let term = r.non_negative_i64(what)?;
    match index {
        // One encoding per value: re-encoding what was read gives the same bytes.
        NO_LOG_ID if term != 0 => Err(FormatError {
            offset: term_at,
            damage: Damage::TermWithoutIndex { field: what, term },
        }),
        NO_LOG_ID => Ok(None),
        index => Ok(Some(LogId {
            index: u64::try_from(index).map_err(|_| FormatError {
                offset: index_at,
                damage: Damage::Negative {
                    field: what,
                    value: index,
                },
            })?,
            term,
        })),
    }
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
    let durable_end = to_disk_i64(metadata.durable_end).ok_or(WalError::OutOfRange {
        what: "durable end",
        value: metadata.durable_end,
    })?;
    let purged = encode_log_id(metadata.last_purged, "last purged log id")?;
    let committed = encode_log_id(metadata.committed, "committed log id")?;
    let mut out = Vec::with_capacity(80 + metadata.node_id.len());
    out.put_slice(&METADATA_MARKER);
    put_i32(&mut out, METADATA_VERSION);
    put_i64(&mut out, term);
    put_i32(&mut out, vote);
    put_buffer(&mut out, metadata.node_id.as_bytes(), "node id")?;
    put_i64(&mut out, hlc);
    put_i64(&mut out, durable_end);
    for (index, term) in [purged, committed] {
        put_i64(&mut out, index);
        put_i64(&mut out, term);
    }
    out.put_u8(u8::from(metadata.vote_committed));
    let checksum = crc32(&out[METADATA_MARKER.len()..]);
    put_u32(&mut out, checksum);
    Ok(out)
}

/// Decodes a whole metadata file of version 1, 2 or 3.
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
    if version >= 3 {
        metadata.durable_end = r.non_negative_i64("durable end")?;
        metadata.last_purged = decode_log_id(&mut r, "last purged log id")?;
        metadata.committed = decode_log_id(&mut r, "committed log id")?;
        let flag_at = r.pos() as u64;
        metadata.vote_committed = match r.take(1)? {
            [0] => false,
            [1] => true,
            other => {
                return Err(FormatError {
                    offset: flag_at,
                    damage: Damage::InvalidBool {
                        field: "vote committed",
                        value: other.first().copied().unwrap_or_default(),
                    },
                })
            }
        };
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
/// Crate-private: an open log writes through its `MetadataFile`, which keeps the log's own fields
/// (a write from outside could lower the durable end or forget a purge).
pub(crate) fn write_metadata(
    dir: &DataDir,
    metadata: &Metadata,
    failpoints: &Failpoints,
) -> Result<(), WalError> {
    let bytes = encode_metadata(metadata)?;
    replace_atomically(dir, &dir.metadata_path(), failpoints, |file| {
        std::io::Write::write_all(file, &bytes)
    })
}

/// The metadata file of an open log: what was last written, behind the lock that makes writes one
/// at a time (they share one temp file name). The log owns `durable_end` and `last_purged`; the
/// application owns the other fields ([`MetadataFile::write_application_fields`]).
#[derive(Debug)]
pub(crate) struct MetadataFile {
    dir: DataDir,
    failpoints: Failpoints,
    current: Mutex<Metadata>,
    /// One past the last fsynced record. Read under the lock, so that a raise of the durable end
    /// cannot slip in after [`crate::Wal::truncate_from`] lowered both.
    durable: watch::Receiver<Lsn>,
}

impl MetadataFile {
    pub(crate) fn new(
        dir: DataDir,
        failpoints: Failpoints,
        current: Metadata,
        durable: watch::Receiver<Lsn>,
    ) -> Self {
        Self {
            dir,
            failpoints,
            current: Mutex::new(current),
            durable,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Metadata> {
        // A panic mid-update leaves the previous, still valid, content.
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn get(&self) -> Metadata {
        self.lock().clone()
    }

    /// Replaces the file with `change` applied; the remembered content changes only if the write
    /// succeeded. Nothing is written if `change` changes nothing. `armed`: whether the failpoints
    /// apply (they stand for crashes and full disks of a serving process; the periodic durable
    /// marks and the write at start-up are not what they test).
    pub(crate) fn update(
        &self,
        armed: bool,
        change: impl FnOnce(&mut Metadata),
    ) -> Result<(), WalError> {
        let mut current = self.lock();
        let mut next = current.clone();
        next.durable_end = next.durable_end.max(*self.durable.borrow());
        change(&mut next);
        if next == *current {
            return Ok(());
        }
        let unarmed = Failpoints::default();
        let failpoints = if armed { &self.failpoints } else { &unarmed };
        write_metadata(&self.dir, &next, failpoints)?;
        *current = next;
        Ok(())
    }

    /// Writes the application's fields of `metadata` (term, vote, node id, HLC high-water,
    /// committed log id, vote committed), and
    /// raises the durable end to what is fsynced now.
    pub(crate) fn write_application_fields(
        &self,
        metadata: &Metadata,
        armed: bool,
    ) -> Result<(), WalError> {
        self.update(armed, |m| {
            m.term = metadata.term;
            m.voted_for = metadata.voted_for;
            m.node_id.clone_from(&metadata.node_id);
            m.hlc_high_water_ms = metadata.hlc_high_water_ms;
            m.committed = metadata.committed;
            m.vote_committed = metadata.vote_committed;
        })
    }

    /// Raises the durable end to what is fsynced now (never lowers it).
    pub(crate) fn raise_durable_end(&self) -> Result<(), WalError> {
        self.update(false, |_| {})
    }
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
            &[0, 0, 0, 3],                   // version 3
            &[0, 0, 0, 0, 0, 0, 0, 0],       // term 0
            &[0xFF, 0xFF, 0xFF, 0xFF],       // voted-for -1 (none)
            &[0, 0, 0, 0],                   // node id: empty buffer
            &[0, 0, 0, 0, 0, 0, 0, 0],       // HLC high-water 0
            &[0, 0, 0, 0, 0, 0, 0, 0],       // durable end 0
            &[0xFF; 8],                      // last purged index -1 (none)
            &[0, 0, 0, 0, 0, 0, 0, 0],       // last purged term 0
            &[0xFF; 8],                      // committed index -1 (none)
            &[0, 0, 0, 0, 0, 0, 0, 0],       // committed term 0
            &[0],                            // vote not committed
            &[0x2B, 0xF2, 0x07, 0xB9],       // CRC of everything after the marker
        ].concat();
        assert_eq!(bytes, expected);
    }

    #[test]
    fn golden_metadata_with_every_field() {
        let metadata = Metadata {
            term: 2,
            voted_for: Some(1),
            node_id: "n1".into(),
            hlc_high_water_ms: 0x0102,
            durable_end: 0x30,
            last_purged: Some(LogId {
                term: 2,
                index: 0x20,
            }),
            committed: Some(LogId {
                term: 2,
                index: 0x2F,
            }),
            vote_committed: true,
        };
        let bytes = encode_metadata(&metadata).unwrap();
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0x5A, 0x6E, 0xA0, 0x12][..],   // marker
            &[0, 0, 0, 3],                   // version 3
            &[0, 0, 0, 0, 0, 0, 0, 2],       // term 2
            &[0, 0, 0, 1],                   // voted for node 1
            &[0, 0, 0, 2], b"n1",            // node id
            &[0, 0, 0, 0, 0, 0, 0x01, 0x02], // HLC high-water
            &[0, 0, 0, 0, 0, 0, 0, 0x30],    // durable end
            &[0, 0, 0, 0, 0, 0, 0, 0x20],    // last purged index
            &[0, 0, 0, 0, 0, 0, 0, 2],       // last purged term
            &[0, 0, 0, 0, 0, 0, 0, 0x2F],    // committed index
            &[0, 0, 0, 0, 0, 0, 0, 2],       // committed term
            &[1],                            // vote committed
            &[0x37, 0x54, 0x64, 0xCF],       // CRC
        ].concat();
        assert_eq!(bytes, expected);
        assert_eq!(decode_metadata(&bytes).unwrap(), metadata);
    }

    #[test]
    fn reads_the_v2_layout() {
        let mut bytes = vec![0x5A, 0x6E, 0xA0, 0x12, 0, 0, 0, 2];
        bytes.extend_from_slice(&5i64.to_be_bytes());
        bytes.extend_from_slice(&(-1i32).to_be_bytes());
        bytes.extend_from_slice(&[0, 0, 0, 1, b'a']);
        bytes.extend_from_slice(&77i64.to_be_bytes());
        let checksum = crc32(&bytes[4..]);
        bytes.extend_from_slice(&checksum.to_be_bytes());
        let metadata = decode_metadata(&bytes).unwrap();
        assert_eq!(
            metadata,
            Metadata {
                term: 5,
                node_id: "a".into(),
                hlc_high_water_ms: 77,
                ..Metadata::default()
            }
        );
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
                      node_id in "[a-z0-9-]{0,40}", hlc in 0..=i64::MAX as u64,
                      durable_end in 0..=i64::MAX as u64,
                      purged in proptest::option::of((0..=i64::MAX as u64, 0..=i64::MAX as u64)),
                      committed in proptest::option::of((0..=i64::MAX as u64, 0..=i64::MAX as u64)),
                      vote_committed in any::<bool>()) {
            let last_purged = purged.map(|(index, term)| LogId { index, term });
            let committed = committed.map(|(index, term)| LogId { index, term });
            let metadata = Metadata { term, voted_for: vote, node_id, hlc_high_water_ms: hlc,
                                      durable_end, last_purged, committed, vote_committed };
            let back = decode_metadata(&encode_metadata(&metadata).unwrap()).unwrap();
            prop_assert_eq!(back, metadata);
        }
    }
}
