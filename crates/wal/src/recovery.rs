//! Reading a data directory back: which segments exist, what each holds, and whether together
//! they form one contiguous log after the snapshot. Shared by [`crate::Wal::open`] and the data
//! tools, so both judge damage the same way.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::error::{Damage, FormatError, WalError};
use crate::layout::{read_optional, DataDir};
use crate::segment::{parse_segment_file_name, scan_segment, SegmentEnd, SegmentScan, END_MARKER};
use crate::Lsn;

/// One segment file, scanned. The bytes are not kept: [`read_segment`] reads them again when a
/// record's data is wanted.
#[derive(Debug)]
pub(crate) struct LoadedSegment {
    pub path: PathBuf,
    pub first_lsn: Lsn,
    pub size_bytes: u64,
    pub scan: Result<SegmentScan, FormatError>,
}

impl LoadedSegment {
    /// One past the LSN of the last intact record.
    pub fn end_lsn(&self) -> Lsn {
        let count = self.scan.as_ref().map_or(0, |s| s.records.len());
        self.first_lsn + count as u64
    }
}

/// A whole segment file (empty if it vanished or is empty).
pub(crate) fn read_segment(path: &Path) -> Result<Bytes, WalError> {
    Ok(read_optional(path)?.map(Bytes::from).unwrap_or_default())
}

/// Every non-empty segment under `log/`, in LSN order. Files that are not segments are skipped
/// with a warning; empty files count as absent.
pub(crate) fn load_segments(dir: &DataDir) -> Result<Vec<LoadedSegment>, WalError> {
    let log_dir = dir.log_dir();
    let entries = match fs::read_dir(&log_dir) {
        Ok(entries) => entries,
        // A directory restored from a copied snapshot alone has no log yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(WalError::io("list", &log_dir)(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
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
            size_bytes: bytes.len() as u64,
            scan,
        });
    }
    Ok(segments)
}

/// The first thing wrong with a log, in LSN order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finding {
    /// The segment's header is unreadable, so none of it can be trusted.
    BadHeader(FormatError),
    /// The segment does not start where the previous one ended (or after the snapshot).
    Gap { expected: Lsn },
    /// A damaged record; `intact_after` is an intact record further on in the same segment.
    Damaged {
        offset: u64,
        damage: Damage,
        intact_after: Option<u64>,
    },
}

impl Finding {
    pub fn into_error(self, segment: &LoadedSegment) -> WalError {
        let path = segment.path.clone();
        match self {
            Finding::BadHeader(e) => WalError::corrupt(path, e),
            Finding::Gap { expected } => WalError::Gap {
                path,
                expected,
                found: segment.first_lsn,
            },
            Finding::Damaged { offset, damage, .. } => WalError::Corrupt {
                path,
                offset,
                damage,
            },
        }
    }
}

/// Walks the segments as one log continuing the snapshot (`keep_from` = first LSN not in the
/// snapshot, 0 without one) and returns the first segment with something wrong.
pub(crate) fn first_finding(
    segments: &[LoadedSegment],
    keep_from: Lsn,
) -> Option<(usize, Finding)> {
    let mut expected = None;
    for (i, segment) in segments.iter().enumerate() {
        let scan = match &segment.scan {
            Ok(scan) => scan,
            Err(e) => return Some((i, Finding::BadHeader(e.clone()))),
        };
        // A gap is harmless only where the snapshot covers everything before this segment.
        let contiguous = match expected {
            None => segment.first_lsn <= keep_from,
            Some(end) => segment.first_lsn == end || segment.first_lsn <= keep_from,
        };
        if !contiguous {
            let expected = expected.unwrap_or(keep_from);
            return Some((i, Finding::Gap { expected }));
        }
        if let SegmentEnd::Damaged {
            offset,
            damage,
            intact_after,
        } = &scan.end
        {
            let finding = Finding::Damaged {
                offset: *offset,
                damage: damage.clone(),
                intact_after: *intact_after,
            };
            return Some((i, finding));
        }
        expected = Some(segment.end_lsn());
    }
    None
}

/// Damage at the very end of the log, after the durable end: recovery cuts it off. It is most
/// likely a write that a crash interrupted before its fsync (never acknowledged), but an
/// acknowledged record damaged since cannot be told apart from one, so the tools say so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TornTail {
    pub offset: u64,
    /// The LSN the damaged record would have had.
    pub lsn: Lsn,
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
    /// One past the last intact record, or `keep_from` if the log holds nothing after it.
    pub end_lsn: Lsn,
}

/// Accepts a log that is whole, or only torn at its very end after `durable_end` (the metadata
/// file's proof of what was fsynced); anything else is an error. A log that ends below
/// `durable_end`, torn or not, lost acknowledged records: [`WalError::LostDurable`].
pub(crate) fn check_log(
    dir: &DataDir,
    segments: &[LoadedSegment],
    keep_from: Lsn,
    durable_end: Lsn,
) -> Result<LogCheck, WalError> {
    let mut check = LogCheck::default();
    let last = segments.len().saturating_sub(1);
    match first_finding(segments, keep_from) {
        None => {}
        Some((
            i,
            Finding::Damaged {
                offset,
                damage,
                intact_after: None,
            },
        )) if i == last => {
            let lsn = segments[i].end_lsn();
            if lsn < durable_end {
                return Err(WalError::LostDurable {
                    path: segments[i].path.clone(),
                    lsn,
                    durable_end,
                    what: format!("the record at byte offset {offset} is damaged ({damage})"),
                });
            }
            check.torn_tail = Some(TornTail {
                offset,
                lsn,
                damage,
            });
        }
        Some((i, finding)) => return Err(finding.into_error(&segments[i])),
    }
    check.end_lsn = segments
        .last()
        .map_or(keep_from, LoadedSegment::end_lsn)
        .max(keep_from);
    if check.end_lsn < durable_end {
        let path = segments
            .last()
            .map_or_else(|| dir.log_dir(), |s| s.path.clone());
        return Err(WalError::LostDurable {
            path,
            lsn: check.end_lsn,
            durable_end,
            what: format!(
                "the log ends before them (its last intact record is LSN {})",
                match check.end_lsn.checked_sub(1) {
                    Some(lsn) => lsn.to_string(),
                    None => "none".to_owned(),
                }
            ),
        });
    }
    check.covered = (0..last)
        .filter(|&i| segments[i].end_lsn() <= keep_from)
        .collect();
    Ok(check)
}

/// Cuts a segment file at `offset` (a record boundary), writes the end marker there, fsyncs.
pub(crate) fn cut_segment_at(path: &Path, offset: u64) -> Result<(), WalError> {
    let mut file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(WalError::io("open", path))?;
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.write_all(&END_MARKER))
        .and_then(|()| file.set_len(offset + END_MARKER.len() as u64))
        .and_then(|()| file.sync_data())
        .map_err(WalError::io("cut", path))
}
