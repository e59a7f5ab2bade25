//! Reading a data directory back: which segments exist, what each holds, and whether together
//! they form one contiguous log after the snapshot. Shared by [`crate::Wal::open`] and the data
//! tools, so both judge damage the same way.

use std::fs;
use std::path::PathBuf;

use bytes::Bytes;

use crate::error::{Damage, FormatError, WalError};
use crate::layout::{read_optional, DataDir};
use crate::segment::{parse_segment_file_name, scan_segment, SegmentEnd, SegmentScan};
use crate::Lsn;

/// One segment file read into memory and scanned.
#[derive(Debug)]
pub(crate) struct LoadedSegment {
    pub path: PathBuf,
    pub first_lsn: Lsn,
    pub bytes: Bytes,
    pub scan: Result<SegmentScan, FormatError>,
}

impl LoadedSegment {
    /// One past the LSN of the last intact record.
    pub fn end_lsn(&self) -> Lsn {
        let count = self.scan.as_ref().map_or(0, |s| s.records.len());
        self.first_lsn + count as u64
    }
}

/// Every non-empty segment under `log/`, in LSN order. Files that are not segments are skipped
/// with a warning; empty files count as absent.
pub(crate) fn load_segments(dir: &DataDir) -> Result<Vec<LoadedSegment>, WalError> {
    let log_dir = dir.log_dir();
    let mut found = Vec::new();
    for entry in fs::read_dir(&log_dir).map_err(WalError::io("list", &log_dir))? {
        let path = entry.map_err(WalError::io("list", &log_dir))?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        match parse_segment_file_name(name) {
            Some(first_lsn) => found.push((first_lsn, path)),
            None => {
                tracing::warn!(path = %path.display(), "ignoring a file that is not a log segment")
            }
        }
    }
    found.sort_unstable_by_key(|(lsn, _)| *lsn);
    let mut segments = Vec::with_capacity(found.len());
    for (first_lsn, path) in found {
        let Some(bytes) = read_optional(&path)? else {
            continue;
        };
        let scan = scan_segment(&bytes);
        segments.push(LoadedSegment {
            path,
            first_lsn,
            bytes: Bytes::from(bytes),
            scan,
        });
    }
    Ok(segments)
}

/// A torn last record that recovery cuts off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TornTail {
    pub offset: u64,
    pub damage: Damage,
}

/// The verdict on a set of segments.
#[derive(Debug, Default)]
pub(crate) struct LogCheck {
    /// Segments wholly covered by the snapshot and not the last one: left by an interrupted
    /// compaction, to be deleted.
    pub covered: Vec<usize>,
    /// Damage at the end of the last segment with nothing intact after it.
    pub torn_tail: Option<TornTail>,
}

/// Checks that the segments hold one contiguous log continuing the snapshot (`keep_from` = first
/// LSN not in the snapshot, 0 without one). Damage anywhere but the tail is an error.
pub(crate) fn check_log(segments: &[LoadedSegment], keep_from: Lsn) -> Result<LogCheck, WalError> {
    let mut check = LogCheck::default();
    let last = segments.len().saturating_sub(1);
    let mut expected = None;
    for (i, segment) in segments.iter().enumerate() {
        let scan = segment
            .scan
            .as_ref()
            .map_err(|e| WalError::corrupt(&segment.path, e.clone()))?;
        // A gap is harmless only where the snapshot covers everything before this segment.
        let contiguous = match expected {
            None => segment.first_lsn <= keep_from,
            Some(end) => segment.first_lsn == end || segment.first_lsn <= keep_from,
        };
        if !contiguous {
            return Err(WalError::Gap {
                path: segment.path.clone(),
                expected: expected.unwrap_or(keep_from),
                found: segment.first_lsn,
            });
        }
        if let SegmentEnd::Damaged {
            offset,
            damage,
            intact_after,
        } = &scan.end
        {
            if i != last || intact_after.is_some() {
                return Err(WalError::Corrupt {
                    path: segment.path.clone(),
                    offset: *offset,
                    damage: damage.clone(),
                });
            }
            check.torn_tail = Some(TornTail {
                offset: *offset,
                damage: damage.clone(),
            });
        }
        if i != last && segment.end_lsn() <= keep_from {
            check.covered.push(i);
        }
        expected = Some(segment.end_lsn());
    }
    Ok(check)
}
