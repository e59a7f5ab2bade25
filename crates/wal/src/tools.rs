//! Data tools behind `mqstate data inspect | verify | repair`. They read a data directory the
//! way [`crate::Wal::open`] does (same scan, same verdicts) but never start a log.

use std::path::{Path, PathBuf};

use crate::error::WalError;
use crate::layout::DataDir;
use crate::log::delete_segments;
use crate::metadata::{read_metadata, Metadata};
use crate::recovery::{
    check_log, cut_segment_at, first_finding, load_segments, Finding, LoadedSegment,
};
use crate::segment::SegmentEnd;
use crate::snapshot::read_snapshot;
use crate::{Lsn, Term};

/// One record as the tools show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordReport {
    pub lsn: Lsn,
    pub term: Term,
    /// Byte offset of the record marker in its segment.
    pub offset: u64,
    /// Length of the record's data.
    pub len: usize,
    /// What the caller's `describe` made of the data.
    pub summary: String,
}

/// One segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentReport {
    pub path: PathBuf,
    pub first_lsn: Lsn,
    pub size_bytes: u64,
    pub records: Vec<RecordReport>,
    /// How the scan ended; `None` if the header is unreadable.
    pub end: Option<SegmentEnd>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotSummary {
    pub last_index: Lsn,
    pub last_term: Term,
    pub state_bytes: usize,
}

/// Everything found in a data directory. Damage is listed in `problems` (as the message
/// `Wal::open` would give), not returned as an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub metadata: Option<Metadata>,
    pub snapshot: Option<SnapshotSummary>,
    pub segments: Vec<SegmentReport>,
    /// Fatal to `Wal::open`; empty if the directory opens.
    pub problems: Vec<String>,
    /// A torn last record that `Wal::open` will cut off by itself.
    pub torn_tail: Option<String>,
}

/// Lists metadata, snapshot, segments and every record (decoded for display by `describe`).
pub fn inspect(
    dir: impl AsRef<Path>,
    describe: &dyn Fn(&[u8]) -> String,
) -> Result<Report, WalError> {
    let dir = DataDir::new(dir.as_ref());
    let mut problems = Vec::new();
    let metadata = read_metadata(&dir).unwrap_or_else(|e| {
        problems.push(e.to_string());
        None
    });
    let snapshot = read_snapshot(&dir).unwrap_or_else(|e| {
        problems.push(e.to_string());
        None
    });
    let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
    let segments = load_segments(&dir)?;
    let mut torn_tail = None;
    match check_log(&segments, keep_from) {
        Ok(check) => {
            torn_tail = check.torn_tail.map(|t| {
                let path = segments
                    .last()
                    .map(|s| s.path.display().to_string())
                    .unwrap_or_default();
                format!(
                    "{path}: {} at byte offset {} (cut off at the next start)",
                    t.damage, t.offset
                )
            });
        }
        Err(e) => problems.push(e.to_string()),
    }
    Ok(Report {
        metadata,
        snapshot: snapshot.map(|s| SnapshotSummary {
            last_index: s.last_index,
            last_term: s.last_term,
            state_bytes: s.state.len(),
        }),
        segments: segments
            .iter()
            .map(|s| segment_report(s, describe))
            .collect(),
        problems,
        torn_tail,
    })
}

fn segment_report(segment: &LoadedSegment, describe: &dyn Fn(&[u8]) -> String) -> SegmentReport {
    let (records, end) = match &segment.scan {
        Ok(scan) => {
            let records = scan
                .records
                .iter()
                .enumerate()
                .map(|(i, r)| RecordReport {
                    lsn: segment.first_lsn + i as u64,
                    term: r.term,
                    offset: r.offset,
                    len: r.data.len(),
                    summary: describe(&segment.bytes[r.data.clone()]),
                })
                .collect();
            (records, Some(scan.end.clone()))
        }
        Err(_) => (Vec::new(), None),
    };
    SegmentReport {
        path: segment.path.clone(),
        first_lsn: segment.first_lsn,
        size_bytes: segment.bytes.len() as u64,
        records,
        end,
    }
}

/// Checks the directory exactly as `Wal::open` would, without changing it: `Err` is the error
/// open would fail with. A torn tail is not an error (open cuts it); see [`Report::torn_tail`].
pub fn verify(dir: impl AsRef<Path>) -> Result<Report, WalError> {
    let data = DataDir::new(dir.as_ref());
    read_metadata(&data)?;
    let snapshot = read_snapshot(&data)?;
    let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
    check_log(&load_segments(&data)?, keep_from)?;
    inspect(dir, &|_| String::new())
}

/// What [`repair`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// The segment cut at the first damage, and where.
    pub cut: Option<(PathBuf, u64)>,
    /// Segments deleted because they came after the damage.
    pub deleted: Vec<PathBuf>,
    /// Intact records lost with them (records after the damage inside the cut segment are
    /// counted as bytes in `dropped_bytes`, since they cannot be told apart from garbage).
    pub dropped_records: usize,
    pub dropped_bytes: u64,
}

/// Keeps the log up to its first damage and drops everything after it (cutting the damaged
/// segment, deleting later ones). Snapshot and metadata damage is not repairable here: restore
/// those files from a backup or another replica.
/// The caller holds the directory's lock ([`DataDir::lock`]): a log a server has open must not be cut.
pub fn repair(dir: impl AsRef<Path>) -> Result<RepairReport, WalError> {
    let data = DataDir::new(dir.as_ref());
    read_metadata(&data)?;
    let snapshot = read_snapshot(&data)?;
    let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
    let segments = load_segments(&data)?;
    let mut report = RepairReport::default();
    let Some((first_bad, finding)) = first_finding(&segments, keep_from) else {
        return Ok(report);
    };
    let later = &segments[first_bad + 1..];
    let damaged = &segments[first_bad];
    match finding {
        Finding::Damaged { offset, .. } => {
            tracing::warn!(path = %damaged.path.display(), offset, "cutting the log at the first damage");
            cut_segment_at(&damaged.path, offset)?;
            report.dropped_bytes += damaged.bytes.len() as u64 - offset;
            report.cut = Some((damaged.path.clone(), offset));
        }
        Finding::BadHeader(_) | Finding::Gap { .. } => {
            report.deleted.push(damaged.path.clone());
            report.dropped_records += damaged.end_lsn().saturating_sub(damaged.first_lsn) as usize;
            report.dropped_bytes += damaged.bytes.len() as u64;
        }
    }
    for segment in later {
        report.deleted.push(segment.path.clone());
        report.dropped_records += (segment.end_lsn() - segment.first_lsn) as usize;
        report.dropped_bytes += segment.bytes.len() as u64;
    }
    for path in &report.deleted {
        tracing::warn!(path = %path.display(), "deleting a segment after the first damage");
    }
    delete_segments(&data, &report.deleted)?;
    Ok(report)
}
