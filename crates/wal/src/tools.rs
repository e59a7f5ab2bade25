//! Data tools behind `mqstate data inspect | verify | repair`. They read a data directory the
//! way [`crate::Wal::open`] does (same scan, same verdicts) but never start a log.

use std::fs::OpenOptions;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::WalError;
use crate::layout::{read_optional, sync_dir, DataDir};
use crate::log::delete_segments;
use crate::metadata::{read_metadata, write_metadata, LogId, Metadata};
use crate::recovery::{
    check_log, cut_segment_at, first_finding, load_segments, read_segment, Finding, LoadedSegment,
};
use crate::segment::{
    decode_record_at, empty_segment, scan_segment, SegmentEnd, SEGMENT_HEADER_LEN,
};
use crate::snapshot::{read_snapshot, Snapshot};
use crate::{Failpoints, Lsn, Term};

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
    /// A damaged last record after the metadata's durable end, which `Wal::open` cuts off. Most
    /// likely a write that a crash interrupted before its fsync, but nothing proves it was never
    /// acknowledged (see [`TORN_TAIL_UNPROVEN`]).
    pub torn_tail: Option<String>,
}

/// Why a torn tail is not reported as clean.
pub const TORN_TAIL_UNPROVEN: &str = "it lies after the durable end recorded in the metadata \
    file, so it is most likely a write a crash interrupted before its fsync (never acknowledged), \
    but records fsynced since the last durable mark look the same when damaged: that it was never \
    acknowledged cannot be proven";

/// Judges the directory's files as `Wal::open` does: the first reason it would refuse them, or
/// the torn tail it would cut.
fn judge(data: &DataDir) -> Result<Option<String>, WalError> {
    let snapshot = read_snapshot(data)?;
    let segments = load_segments(data)?;
    let metadata = match read_metadata(data)? {
        Some(metadata) => metadata,
        None if !segments.is_empty() => {
            return Err(WalError::MetadataMissing {
                path: data.metadata_path(),
            })
        }
        // A directory restored from a copied snapshot: open writes a fresh file.
        None if snapshot.is_some() => Metadata::default(),
        None => {
            return Err(WalError::NotADataDirectory {
                path: data.root().to_path_buf(),
            })
        }
    };
    let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
    if let Some(purged) = metadata.last_purged.filter(|p| p.index >= keep_from) {
        return Err(WalError::PurgedPastSnapshot {
            path: data.snapshot_path(),
            purged: purged.index,
            snapshot: snapshot.as_ref().map(|s| s.last_index),
        });
    }
    let check = check_log(data, &segments, keep_from, metadata.durable_end)?;
    let torn = check.torn_tail.map(|t| {
        let path = segments
            .last()
            .map(|s| s.path.display().to_string())
            .unwrap_or_default();
        format!(
            "{path}: the last record (LSN {}) is damaged at byte offset {} ({}); \
             start-up cuts it off; {TORN_TAIL_UNPROVEN} (durable end: {})",
            t.lsn, t.offset, t.damage, metadata.durable_end
        )
    });
    Ok(torn)
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
    let segments = load_segments(&dir)?;
    let mut torn_tail = None;
    match judge(&dir) {
        Ok(torn) => torn_tail = torn,
        // Already listed above.
        Err(WalError::Corrupt { path, .. })
            if path == dir.metadata_path() || path == dir.snapshot_path() => {}
        Err(e) => problems.push(e.to_string()),
    }
    let mut reports = Vec::with_capacity(segments.len());
    for segment in &segments {
        reports.push(segment_report(segment, describe)?);
    }
    Ok(Report {
        metadata,
        snapshot: snapshot.map(|s| SnapshotSummary {
            last_index: s.last_index,
            last_term: s.last_term,
            state_bytes: s.state.len(),
        }),
        segments: reports,
        problems,
        torn_tail,
    })
}

fn segment_report(
    segment: &LoadedSegment,
    describe: &dyn Fn(&[u8]) -> String,
) -> Result<SegmentReport, WalError> {
    let (records, end) = match &segment.scan {
        Ok(scan) => {
            let bytes = read_segment(&segment.path)?;
            let records = scan
                .records
                .iter()
                .enumerate()
                .map(|(i, r)| RecordReport {
                    lsn: segment.first_lsn + i as u64,
                    term: r.term,
                    offset: r.offset,
                    len: r.data.len(),
                    summary: bytes
                        .get(r.data.clone())
                        .map_or_else(|| "(changed while read)".to_owned(), describe),
                })
                .collect();
            (records, Some(scan.end.clone()))
        }
        Err(_) => (Vec::new(), None),
    };
    Ok(SegmentReport {
        path: segment.path.clone(),
        first_lsn: segment.first_lsn,
        size_bytes: segment.size_bytes,
        records,
        end,
    })
}

/// Checks the directory exactly as `Wal::open` would, without changing it: `Err` is the error
/// open would fail with (also [`WalError::NotADataDirectory`] for a directory no log was ever
/// opened in). A torn tail is not an error (open cuts it) but is not clean either: see
/// [`Report::torn_tail`].
pub fn verify(dir: impl AsRef<Path>) -> Result<Report, WalError> {
    judge(&DataDir::new(dir.as_ref()))?;
    inspect(dir, &|_| String::new())
}

/// What [`repair`] changed, exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// The metadata file was damaged or missing and was rebuilt: why, and where the damaged
    /// file was kept.
    pub metadata_rebuilt: Option<String>,
    /// Segments whose damaged 8-byte header was rewritten, every record after it being intact.
    pub headers_rewritten: Vec<PathBuf>,
    /// The segment cut at the first damage, and where.
    pub cut: Option<(PathBuf, u64)>,
    /// Segments deleted because they came after the damage.
    pub deleted: Vec<PathBuf>,
    /// Intact records removed: those after the damage in the cut segment, and those of deleted
    /// segments (they cannot be kept: the log must stay contiguous).
    pub dropped_records: usize,
    /// Every byte removed, damaged or not.
    pub dropped_bytes: u64,
    /// LSNs of acknowledged records (below the metadata's durable end) that the log no longer
    /// holds after the repair, damaged or missing before it ran; the durable end was lowered to
    /// their start. Only a backup or a replica has them.
    pub lost_durable: Option<Range<Lsn>>,
}

/// Repairs what can be repaired without losing an intact record that the log can keep: rebuilds
/// a damaged or missing metadata file (keeping the damaged one as `mqstate.metadata.damaged`),
/// rewrites a damaged segment header when every record after it is intact, cuts the log at its
/// first damage and deletes later segments (a log must stay contiguous), and lowers the durable
/// end to what is left, reporting exactly what went. A damaged snapshot is not repairable here:
/// restore it from a backup or another replica.
///
/// `hlc_high_water_ms` is what a rebuilt metadata file records as the HLC high-water mark; the
/// caller knows the highest timestamp the log holds. The caller holds the directory's lock
/// ([`DataDir::lock`]): a log a server has open must not be cut.
pub fn repair(dir: impl AsRef<Path>, hlc_high_water_ms: u64) -> Result<RepairReport, WalError> {
    let data = DataDir::new(dir.as_ref());
    let failpoints = Failpoints::default();
    let snapshot = read_snapshot(&data)?;
    let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
    let mut report = RepairReport::default();

    for segment in load_segments(&data)? {
        if segment.scan.is_err() && rewrite_header(&segment.path)? {
            tracing::warn!(path = %segment.path.display(), "rewrote a damaged segment header");
            report.headers_rewritten.push(segment.path);
        }
    }
    let segments = load_segments(&data)?;

    let mut metadata = match read_metadata(&data) {
        Ok(Some(metadata)) => metadata,
        Ok(None) if segments.is_empty() => {
            if snapshot.is_none() {
                return Err(WalError::NotADataDirectory {
                    path: data.root().to_path_buf(),
                });
            }
            // A directory restored from a copied snapshot: open writes a fresh file.
            Metadata::default()
        }
        found => {
            let why = match found {
                Err(e) => e.to_string(),
                _ => "the metadata file is missing".to_owned(),
            };
            let kept = keep_damaged_metadata(&data)?;
            let rebuilt = rebuild_metadata(snapshot.as_ref(), &segments, hlc_high_water_ms);
            write_metadata(&data, &rebuilt, &failpoints)?;
            report.metadata_rebuilt = Some(format!(
                "{why}; rebuilt it with term {}, no vote, no node id, HLC high-water {} ms{}",
                rebuilt.term,
                rebuilt.hlc_high_water_ms,
                kept.map_or_else(String::new, |p| format!(
                    " (the damaged file is kept as {})",
                    p.display()
                ))
            ));
            rebuilt
        }
    };

    let mut end = segments
        .last()
        .map_or(keep_from, LoadedSegment::end_lsn)
        .max(keep_from);
    if let Some((first_bad, finding)) = first_finding(&segments, keep_from) {
        let damaged = &segments[first_bad];
        let later = &segments[first_bad + 1..];
        match finding {
            Finding::Damaged { offset, .. } => {
                tracing::warn!(path = %damaged.path.display(), offset, "cutting the log at the first damage");
                report.dropped_records += count_intact_after(&damaged.path, offset)?;
                cut_segment_at(&damaged.path, offset)?;
                report.dropped_bytes += damaged.size_bytes.saturating_sub(offset);
                report.cut = Some((damaged.path.clone(), offset));
                end = damaged.end_lsn().max(keep_from);
            }
            Finding::BadHeader(_) | Finding::Gap { .. } => {
                report.deleted.push(damaged.path.clone());
                report.dropped_records +=
                    damaged.end_lsn().saturating_sub(damaged.first_lsn) as usize;
                report.dropped_bytes += damaged.size_bytes;
                end = segments[..first_bad]
                    .last()
                    .map_or(keep_from, LoadedSegment::end_lsn)
                    .max(keep_from);
            }
        }
        for segment in later {
            report.deleted.push(segment.path.clone());
            report.dropped_records += (segment.end_lsn() - segment.first_lsn) as usize;
            report.dropped_bytes += segment.size_bytes;
        }
        for path in &report.deleted {
            tracing::warn!(path = %path.display(), "deleting a segment after the first damage");
        }
        delete_segments(&data, &report.deleted)?;
    }
    if metadata.durable_end > end {
        report.lost_durable = Some(end..metadata.durable_end);
        metadata.durable_end = end;
        write_metadata(&data, &metadata, &failpoints)?;
    }
    Ok(report)
}

/// Rewrites the 8-byte header of a segment whose header is damaged, if the file with a correct
/// header scans to at least one intact record or a clean end. Returns whether it did.
fn rewrite_header(path: &Path) -> Result<bool, WalError> {
    let Some(mut bytes) = read_optional(path)? else {
        return Ok(false);
    };
    if bytes.len() < SEGMENT_HEADER_LEN {
        return Ok(false);
    }
    let header = empty_segment();
    bytes[..SEGMENT_HEADER_LEN].copy_from_slice(&header[..SEGMENT_HEADER_LEN]);
    let Ok(scan) = scan_segment(&bytes) else {
        return Ok(false);
    };
    if scan.records.is_empty() && !matches!(scan.end, SegmentEnd::EndMarker { .. }) {
        return Ok(false);
    }
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(WalError::io("open", path))?;
    file.write_all_at(&header[..SEGMENT_HEADER_LEN], 0)
        .and_then(|()| file.sync_data())
        .map_err(WalError::io("rewrite the header of", path))?;
    Ok(true)
}

/// Intact records at 4-byte-aligned offsets after the damaged record at `offset`.
fn count_intact_after(path: &Path, offset: u64) -> Result<usize, WalError> {
    let bytes = read_segment(path)?;
    let mut count = 0;
    let mut at = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .saturating_add(4);
    while at < bytes.len() {
        match decode_record_at(&bytes, at) {
            Ok((_, next)) => {
                count += 1;
                at = next;
            }
            Err(_) => at += 4,
        }
    }
    Ok(count)
}

/// Moves a damaged metadata file aside; returns where, `None` if there was none.
fn keep_damaged_metadata(data: &DataDir) -> Result<Option<PathBuf>, WalError> {
    let path = data.metadata_path();
    if !path.exists() {
        return Ok(None);
    }
    let kept = path.with_extension("metadata.damaged");
    std::fs::rename(&path, &kept).map_err(WalError::io("keep the damaged", &path))?;
    sync_dir(data.root())?;
    Ok(Some(kept))
}

/// What the rest of the directory proves of a lost metadata file: the highest term seen, no
/// vote (a cluster node should rather be restored from a replica: it may have voted in that
/// term), purged up to the snapshot, and a durable end of 0 (nothing proven; the repair lowers
/// nothing further).
fn rebuild_metadata(
    snapshot: Option<&Snapshot>,
    segments: &[LoadedSegment],
    hlc_high_water_ms: u64,
) -> Metadata {
    let record_terms = segments
        .iter()
        .filter_map(|s| s.scan.as_ref().ok())
        .flat_map(|scan| scan.records.iter().map(|r| r.term));
    let term = record_terms
        .chain(snapshot.map(|s| s.last_term))
        .max()
        .unwrap_or(0);
    Metadata {
        term,
        voted_for: None,
        node_id: String::new(),
        hlc_high_water_ms,
        durable_end: 0,
        last_purged: snapshot.map(|s| LogId {
            index: s.last_index,
            term: s.last_term,
        }),
        committed: None,
        vote_committed: false,
    }
}
