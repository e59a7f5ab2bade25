//! [`Wal`]: the segmented log on disk, driven synchronously (blocking I/O). The group-commit
//! writer ([`crate::WalWriter`]) owns one on its thread; tests and tools use it directly.

use std::fs::{self, File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::error::WalError;
use crate::failpoint::{Failpoints, AFTER_WRITE_BEFORE_FSYNC, POWER_LOSS};
use crate::layout::{rename_into_place, replace_atomically, sync_dir, DataDir, DirLock};
use crate::metadata::{read_metadata, write_metadata, Metadata};
use crate::options::WalOptions;
use crate::prealloc::Preallocator;
use crate::recovery::{check_log, cut_segment_at, load_segments, LoadedSegment};
use crate::segment::{empty_segment, encode_record, END_MARKER, SEGMENT_HEADER_LEN};
use crate::snapshot::{read_snapshot, write_snapshot, Snapshot};
use crate::stats::WalStats;
use crate::{Lsn, Term};

/// One record read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub lsn: Lsn,
    pub term: Term,
    pub data: Bytes,
}

/// What [`Wal::open`] found: the state to rebuild the application from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The metadata file (a fresh one is written on first start).
    pub metadata: Metadata,
    /// The latest snapshot, if any.
    pub snapshot: Option<Snapshot>,
    /// Every record after the snapshot, in LSN order.
    pub records: Vec<Entry>,
}

/// A point in the active segment: where the end marker is and which LSN comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    end_offset: u64,
    next_lsn: Lsn,
}

#[derive(Debug)]
struct ClosedSegment {
    first_lsn: Lsn,
    end_lsn: Lsn,
    path: PathBuf,
}

#[derive(Debug)]
struct ActiveSegment {
    file: File,
    path: PathBuf,
    first_lsn: Lsn,
    /// Everything written, durable or not.
    written: Position,
    /// Everything fsynced.
    durable: Position,
}

/// Why the log stopped, and the point a retry cuts back to.
#[derive(Debug)]
struct Failure {
    cause: String,
    keep: Position,
}

/// A batch buffer that grew beyond this (a burst of large values) is not kept for the next batch.
const BATCH_BUFFER_KEPT: usize = 1 << 20;

/// The write-ahead log: closed segments plus the active one that appends go to.
#[derive(Debug)]
pub struct Wal {
    dir: DataDir,
    options: WalOptions,
    stats: Arc<WalStats>,
    closed: Vec<ClosedSegment>,
    active: ActiveSegment,
    failure: Option<Failure>,
    /// The encoding buffer of `write_batch`, kept between batches so that a batch does not grow
    /// a fresh one record by record.
    batch: Vec<u8>,
    /// Prepares the next segment in the background (see `prealloc`).
    prealloc: Preallocator,
    /// Keeps other processes (a second server, `mqstate data repair`) out while the log is open.
    _lock: DirLock,
}

impl Wal {
    /// Opens (or creates) the data directory, locks it against other processes
    /// ([`WalError::Locked`]) and recovers it: a torn last record is cut off, anything else damaged
    /// is an error that names the file and offset.
    pub fn open(
        dir: impl Into<PathBuf>,
        options: WalOptions,
    ) -> Result<(Wal, Recovered), WalError> {
        let dir = DataDir::new(dir);
        dir.create()?;
        // Before anything is cleared or cut: those files may be another process's live ones.
        let lock = dir.lock()?;
        dir.clear_temp()?;
        let metadata = match read_metadata(&dir)? {
            Some(metadata) => metadata,
            None => {
                let fresh = Metadata::default();
                write_metadata(&dir, &fresh, &options.failpoints)?;
                fresh
            }
        };
        let snapshot = read_snapshot(&dir)?;
        let keep_from = snapshot.as_ref().map_or(0, |s| s.last_index + 1);
        let segments = load_segments(&dir)?;
        let check = check_log(&segments, keep_from)?;
        if let (Some(torn), Some(last)) = (&check.torn_tail, segments.last()) {
            cut_torn_tail(last, torn.offset, &torn.damage)?;
        }

        let mut records = Vec::new();
        for segment in &segments {
            let Ok(scan) = &segment.scan else { continue };
            for (i, record) in scan.records.iter().enumerate() {
                let lsn = segment.first_lsn + i as u64;
                if lsn >= keep_from {
                    records.push(Entry {
                        lsn,
                        term: record.term,
                        data: segment.bytes.slice(record.data.clone()),
                    });
                }
            }
        }

        let mut obsolete: Vec<PathBuf> = check
            .covered
            .iter()
            .map(|&i| segments[i].path.clone())
            .collect();
        let mut closed: Vec<ClosedSegment> = segments
            .iter()
            .enumerate()
            .filter(|(i, _)| !check.covered.contains(i))
            .map(|(_, s)| ClosedSegment {
                first_lsn: s.first_lsn,
                end_lsn: s.end_lsn(),
                path: s.path.clone(),
            })
            .collect();
        let continues = segments.last().filter(|s| s.end_lsn() >= keep_from);
        let active = match continues {
            Some(last) => {
                closed.pop();
                open_active(last)?
            }
            None => {
                // No log yet, or a snapshot newer than all of it: start fresh after the snapshot.
                obsolete.extend(closed.drain(..).map(|s| s.path));
                create_segment(&dir, keep_from, &options.failpoints, None)?
            }
        };
        delete_segments(&dir, &obsolete)?;
        debug_assert!(records
            .last()
            .is_none_or(|r| r.lsn + 1 == active.written.next_lsn));

        let stats = Arc::new(WalStats::new(options.name));
        let prealloc = Preallocator::new(
            dir.temp_dir(),
            if options.preallocate_segments {
                options.segment_soft_limit_bytes
            } else {
                0
            },
        );
        let wal = Wal {
            dir,
            options,
            stats,
            closed,
            active,
            failure: None,
            batch: Vec::new(),
            prealloc,
            _lock: lock,
        };
        Ok((
            wal,
            Recovered {
                metadata,
                snapshot,
                records,
            },
        ))
    }

    /// The LSN the next appended record gets.
    pub fn next_lsn(&self) -> Lsn {
        self.active.written.next_lsn
    }

    /// Whether every written record has been fsynced.
    pub fn is_synced(&self) -> bool {
        self.active.written == self.active.durable
    }

    pub fn stats(&self) -> &Arc<WalStats> {
        &self.stats
    }

    pub fn data_dir(&self) -> &DataDir {
        &self.dir
    }

    pub fn options(&self) -> &WalOptions {
        &self.options
    }

    /// Why the log refuses writes, if it does (see [`Wal::retry`]).
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_ref().map(|f| f.cause.as_str())
    }

    /// Refuses a record longer than [`WalOptions::record_max_bytes`] or with a term the file
    /// cannot hold, before anything is written.
    pub fn check_record(&self, term: Term, len: usize) -> Result<(), WalError> {
        if crate::codec::to_disk_i64(term).is_none() {
            return Err(WalError::OutOfRange {
                what: "term",
                value: term,
            });
        }
        let max = self.options.record_max_bytes.min(i32::MAX as usize);
        if len > max {
            return Err(WalError::TooLarge {
                what: "record",
                len,
                max,
            });
        }
        Ok(())
    }

    /// Writes records (not fsynced) and returns their LSNs. On an I/O error the batch is cut
    /// off again and the log enters the failed state.
    pub fn write_batch<'a>(
        &mut self,
        records: impl IntoIterator<Item = (Term, &'a [u8])>,
    ) -> Result<Range<Lsn>, WalError> {
        self.refuse_if_failed()?;
        let before = self.active.written;
        let mut buf = std::mem::take(&mut self.batch);
        buf.clear();
        if buf.capacity() > BATCH_BUFFER_KEPT {
            buf = Vec::new();
        }
        let mut count = 0u64;
        for (term, data) in records {
            self.check_record(term, data.len())?;
            encode_record(term, data, &mut buf)?;
            count += 1;
        }
        buf.extend_from_slice(&END_MARKER);
        let written = self.active.file.write_all_at(&buf, before.end_offset);
        let batch_len = buf.len();
        self.batch = buf;
        if let Err(e) = written {
            let error = WalError::io("write", &self.active.path)(e);
            self.fail(&error, before);
            return Err(error);
        }
        let after = Position {
            end_offset: before.end_offset + (batch_len - END_MARKER.len()) as u64,
            next_lsn: before.next_lsn + count,
        };
        self.active.written = after;
        self.stats.record_batch(count as usize, batch_len);
        if after.end_offset > self.options.segment_soft_limit_bytes / 2 {
            self.prealloc.start_for(self.active.first_lsn);
        }
        Ok(before.next_lsn..after.next_lsn)
    }

    /// Fsyncs what was written. On failure the unsynced records are cut off (the kernel may
    /// have dropped them already) and the log enters the failed state.
    pub fn sync(&mut self) -> Result<(), WalError> {
        // While failed, the unsynced bytes may be the failed batch: making them durable would
        // resurrect records whose callers were told they failed.
        self.refuse_if_failed()?;
        if self.is_synced() {
            return Ok(());
        }
        if self.options.failpoints.is_armed(POWER_LOSS) {
            self.lose_unsynced_writes_and_abort();
        }
        let started = Instant::now();
        let synced = self
            .options
            .failpoints
            .check(AFTER_WRITE_BEFORE_FSYNC)
            .and_then(|()| self.active.file.sync_data());
        if let Err(e) = synced {
            let error = WalError::io("fsync", &self.active.path)(e);
            self.fail(&error, self.active.durable);
            return Err(error);
        }
        self.stats.record_fsync(started.elapsed());
        self.active.durable = self.active.written;
        Ok(())
    }

    /// Starts a new segment if the active one passed the hard limit, or the soft limit with
    /// every record durable.
    pub fn rotate_if_needed(&mut self) -> Result<(), WalError> {
        let size = self.active.written.end_offset + END_MARKER.len() as u64;
        let due = size > self.options.segment_hard_limit_bytes
            || (size > self.options.segment_soft_limit_bytes && self.is_synced());
        // A retry cuts the active segment back, so it must stay the active one until then.
        let failed = self.failure.is_some();
        if !due || failed || self.active.written.next_lsn == self.active.first_lsn {
            return Ok(());
        }
        self.sync()?;
        self.start_segment(self.active.written.next_lsn)
    }

    /// Leaves the failed state: cuts the active segment back to the last good record, writes
    /// the end marker, fsyncs. Fails (and stays failed) while the disk still does.
    pub fn retry(&mut self) -> Result<(), WalError> {
        let Some(failure) = &self.failure else {
            return Ok(());
        };
        let keep = failure.keep;
        self.cut_back(keep)?;
        tracing::info!(path = %self.active.path.display(), "write-ahead log writable again");
        self.failure = None;
        Ok(())
    }

    /// Writes `snapshot` and deletes the segments it covers. See [`Wal::compact`].
    pub fn install_snapshot(&mut self, snapshot: &Snapshot) -> Result<(), WalError> {
        write_snapshot(&self.dir, snapshot, &self.options.failpoints)?;
        let obsolete = self.compact(snapshot.last_index)?;
        delete_segments(&self.dir, &obsolete)
    }

    /// Forgets the closed segments whose records are all at or below `last_index` (a snapshot
    /// now on disk covers them) and returns their paths for [`delete_segments`]. If the snapshot
    /// is ahead of the whole log (installed from elsewhere), the log restarts after it.
    pub fn compact(&mut self, last_index: Lsn) -> Result<Vec<PathBuf>, WalError> {
        let keep_from = last_index + 1;
        if self.active.written.next_lsn < keep_from {
            self.refuse_if_failed()?;
            self.start_segment(keep_from)?;
        }
        let (obsolete, kept) = std::mem::take(&mut self.closed)
            .into_iter()
            .partition(|s| s.end_lsn <= keep_from);
        self.closed = kept;
        Ok(obsolete
            .into_iter()
            .map(|s: ClosedSegment| s.path)
            .collect())
    }

    /// The [`POWER_LOSS`] failpoint: the segment's bytes after the last fsync become what they were
    /// on disk before (zeros: the end marker, then preallocated or no space), without an fsync of
    /// its own — the page cache outlives the abort, and is what the next start reads.
    fn lose_unsynced_writes_and_abort(&mut self) -> ! {
        let from = self.active.durable.end_offset;
        let to = self.active.written.end_offset + END_MARKER.len() as u64;
        let zeros = vec![0u8; usize::try_from(to.saturating_sub(from)).unwrap_or(0)];
        let lost = self.active.file.write_all_at(&zeros, from);
        tracing::error!(
            failpoint = POWER_LOSS,
            lost_bytes = zeros.len(),
            ?lost,
            "failpoint armed: discarding unsynced log writes and aborting the process"
        );
        std::process::abort()
    }

    fn refuse_if_failed(&self) -> Result<(), WalError> {
        match &self.failure {
            Some(f) => Err(WalError::Failed {
                cause: f.cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Enters the failed state, then tries at once to cut back to `keep` so no half-written
    /// record stays in the file; if that fails too, [`Wal::retry`] tries again later.
    fn fail(&mut self, error: &WalError, keep: Position) {
        tracing::error!(%error, "write-ahead log failed; refusing records until a retry succeeds");
        self.stats.record_write_error();
        self.failure = Some(Failure {
            cause: error.to_string(),
            keep,
        });
        if let Err(e) = self.cut_back(keep) {
            tracing::error!(error = %e, "could not cut the log back after the failure");
        }
    }

    fn cut_back(&mut self, keep: Position) -> Result<(), WalError> {
        let path = &self.active.path;
        let file = &mut self.active.file;
        let failpoints = &self.options.failpoints;
        file.seek(SeekFrom::Start(keep.end_offset))
            .and_then(|_| file.write_all(&END_MARKER))
            .and_then(|()| file.set_len(keep.end_offset + END_MARKER.len() as u64))
            .and_then(|()| failpoints.check(AFTER_WRITE_BEFORE_FSYNC))
            .and_then(|()| file.sync_data())
            .map_err(WalError::io("cut back", path))?;
        self.active.written = keep;
        self.active.durable = keep;
        Ok(())
    }

    fn start_segment(&mut self, first_lsn: Lsn) -> Result<(), WalError> {
        let prepared = self.prealloc.take_ready();
        let next = create_segment(&self.dir, first_lsn, &self.options.failpoints, prepared)?;
        let old = std::mem::replace(&mut self.active, next);
        self.closed.push(ClosedSegment {
            first_lsn: old.first_lsn,
            end_lsn: old.written.next_lsn,
            path: old.path,
        });
        debug_assert!(self
            .closed
            .windows(2)
            .all(|w| w[0].first_lsn < w[1].first_lsn));
        Ok(())
    }
}

/// Deletes segments newest first, so a crash halfway leaves a contiguous prefix, then fsyncs
/// the log directory.
pub fn delete_segments(dir: &DataDir, paths: &[PathBuf]) -> Result<(), WalError> {
    if paths.is_empty() {
        return Ok(());
    }
    let mut newest_first = paths.to_vec();
    newest_first.sort_unstable_by(|a, b| b.cmp(a));
    for path in &newest_first {
        fs::remove_file(path).map_err(WalError::io("delete segment", path))?;
        tracing::info!(path = %path.display(), "deleted a log segment covered by the snapshot");
    }
    sync_dir(&dir.log_dir())
}

/// A new empty segment: `prepared` (a zero-filled segment under `temp/`) renamed into place, or a
/// file of just a header.
fn create_segment(
    dir: &DataDir,
    first_lsn: Lsn,
    failpoints: &Failpoints,
    prepared: Option<PathBuf>,
) -> Result<ActiveSegment, WalError> {
    let path = dir.segment_path(first_lsn);
    match prepared {
        Some(prepared) => rename_into_place(dir, &prepared, &path, failpoints)?,
        None => replace_atomically(dir, &path, failpoints, |file| {
            file.write_all(&empty_segment())
        })?,
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(WalError::io("open", &path))?;
    let start = Position {
        end_offset: SEGMENT_HEADER_LEN as u64,
        next_lsn: first_lsn,
    };
    Ok(ActiveSegment {
        file,
        path,
        first_lsn,
        written: start,
        durable: start,
    })
}

fn open_active(segment: &LoadedSegment) -> Result<ActiveSegment, WalError> {
    let path = segment.path.clone();
    let end_offset = match &segment.scan {
        Ok(scan) => scan.end.offset(),
        Err(e) => return Err(WalError::corrupt(&path, e.clone())),
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(WalError::io("open", &path))?;
    let at = Position {
        end_offset,
        next_lsn: segment.end_lsn(),
    };
    Ok(ActiveSegment {
        file,
        path,
        first_lsn: segment.first_lsn,
        written: at,
        durable: at,
    })
}

/// Cuts the last segment at the start of its torn record and writes the end marker there.
fn cut_torn_tail(
    segment: &LoadedSegment,
    offset: u64,
    damage: &crate::Damage,
) -> Result<(), WalError> {
    let path = &segment.path;
    let dropped = segment.bytes.len() as u64 - offset;
    tracing::warn!(
        path = %path.display(),
        offset,
        dropped_bytes = dropped,
        %damage,
        "cutting off a torn record at the end of the log (it was never acknowledged)"
    );
    cut_segment_at(path, offset)
}
