//! [`Wal`]: the segmented log on disk, driven synchronously (blocking I/O). The group-commit
//! writer ([`crate::WalWriter`]) owns one on its thread; tests and tools use it directly.

use std::fs::{self, File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::watch;

use crate::error::WalError;
use crate::failpoint::{Failpoints, AFTER_WRITE_BEFORE_FSYNC, POWER_LOSS};
use crate::index::LogIndex;
use crate::layout::{rename_into_place, replace_atomically, sync_dir, DataDir, DirLock};
use crate::metadata::{read_metadata, write_metadata, LogId, Metadata, MetadataFile};
use crate::options::WalOptions;
use crate::prealloc::Preallocator;
use crate::reader::{Entries, WalReader};
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
#[derive(Debug)]
pub struct Recovered {
    /// The metadata file (a fresh one is written on first start).
    pub metadata: Metadata,
    /// The latest snapshot, if any.
    pub snapshot: Option<Snapshot>,
    /// The LSNs of every record after the snapshot, to replay over it in order.
    pub replay: Range<Lsn>,
    /// Those records, read from disk as the iteration reaches them (one segment in memory at a
    /// time), each checksum checked again.
    pub records: Entries,
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
    /// Where every record is; shared with the [`WalReader`]s.
    index: Arc<RwLock<LogIndex>>,
    /// The metadata file; its `durable_end` and `last_purged` are kept by this log.
    metadata: Arc<MetadataFile>,
    /// One past the last fsynced record.
    durable: watch::Sender<Lsn>,
    /// Keeps other processes (a second server, `mqstate data repair`) out while the log is open.
    _lock: DirLock,
}

impl Wal {
    /// Opens (or creates) the data directory, locks it against other processes
    /// ([`WalError::Locked`]) and recovers it: a torn last record after the durable end is cut
    /// off; a log that ends below the durable end ([`WalError::LostDurable`]) or is damaged
    /// anywhere else is an error that names the file and offset. Reads no record data beyond what
    /// the scan needs: records are read on demand ([`Wal::entries`], [`Wal::reader`]).
    pub fn open(
        dir: impl Into<PathBuf>,
        options: WalOptions,
    ) -> Result<(Wal, Recovered), WalError> {
        let dir = DataDir::new(dir);
        dir.create()?;
        // Before anything is cleared or cut: those files may be another process's live ones.
        let lock = dir.lock()?;
        dir.clear_temp()?;
        // The snapshot and the segments are each read whole and checksummed: at a large restart
        // both take a core's worth of CPU, so they are read side by side.
        let (snapshot, segments) = std::thread::scope(|scope| {
            let segments = scope.spawn(|| load_segments(&dir));
            let snapshot = if options.snapshot_elsewhere {
                Ok(None)
            } else {
                read_snapshot(&dir)
            };
            let segments = segments
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            Ok::<_, WalError>((snapshot?, segments?))
        })?;
        let metadata = match read_metadata(&dir)? {
            Some(metadata) => metadata,
            // The file is written before the first segment, so only damage removes it. Without
            // a log there is nothing it could have vouched for (a directory restored from a
            // copied snapshot alone starts like that).
            None if !segments.is_empty() => {
                return Err(WalError::MetadataMissing {
                    path: dir.metadata_path(),
                })
            }
            None => {
                let fresh = Metadata::default();
                write_metadata(&dir, &fresh, &options.failpoints)?;
                fresh
            }
        };
        let keep_from = if options.snapshot_elsewhere {
            metadata.last_purged.map_or(0, |p| p.index + 1)
        } else {
            snapshot.as_ref().map_or(0, |s| s.last_index + 1)
        };
        if let Some(purged) = metadata.last_purged.filter(|p| p.index >= keep_from) {
            return Err(WalError::PurgedPastSnapshot {
                path: dir.snapshot_path(),
                purged: purged.index,
                snapshot: snapshot.as_ref().map(|s| s.last_index),
            });
        }
        let check = check_log(&dir, &segments, keep_from, metadata.durable_end)?;
        if let (Some(torn), Some(last)) = (&check.torn_tail, segments.last()) {
            cut_torn_tail(last, torn.offset, &torn.damage)?;
        }

        let mut obsolete: Vec<PathBuf> = check
            .covered
            .iter()
            .map(|&i| segments[i].path.clone())
            .collect();
        let kept: Vec<&LoadedSegment> = segments
            .iter()
            .enumerate()
            .filter(|(i, _)| !check.covered.contains(i))
            .map(|(_, s)| s)
            .collect();
        let mut index = LogIndex::default();
        for segment in &kept {
            let Ok(scan) = &segment.scan else { continue };
            index.add_segment(segment.first_lsn, segment.path.clone(), scan.end.offset());
            for (i, record) in scan.records.iter().enumerate() {
                let end = scan
                    .records
                    .get(i + 1)
                    .map_or(scan.end.offset(), |next| next.offset);
                index.push(record.term, record.offset, end);
            }
        }
        let mut closed: Vec<ClosedSegment> = kept
            .iter()
            .map(|s| ClosedSegment {
                first_lsn: s.first_lsn,
                end_lsn: s.end_lsn(),
                path: s.path.clone(),
            })
            .collect();
        let continues = kept.last().filter(|s| s.end_lsn() >= keep_from);
        let active = match continues {
            Some(last) => {
                closed.pop();
                open_active(last)?
            }
            None => {
                // No log yet, or a snapshot newer than all of it: start fresh after the snapshot.
                obsolete.extend(closed.drain(..).map(|s| s.path));
                let active = create_segment(&dir, keep_from, &options.failpoints, None)?;
                index.add_segment(keep_from, active.path.clone(), active.written.end_offset);
                active
            }
        };
        delete_segments(&dir, &obsolete)?;
        debug_assert_eq!(index.end(), active.written.next_lsn);
        let replay = keep_from..active.written.next_lsn;
        let records = Entries::new(index.spans(replay.clone()));

        let stats = Arc::new(WalStats::new(options.name));
        let prealloc = Preallocator::new(
            dir.temp_dir(),
            if options.preallocate_segments {
                options.segment_soft_limit_bytes
            } else {
                0
            },
        )
        .inline(options.committer == crate::options::Committer::Caller);
        let (durable, durable_rx) = watch::channel(active.durable.next_lsn);
        let metadata_file = MetadataFile::new(
            dir.clone(),
            options.failpoints.clone(),
            metadata.clone(),
            durable_rx,
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
            index: Arc::new(RwLock::new(index)),
            metadata: Arc::new(metadata_file),
            durable,
            _lock: lock,
        };
        Ok((
            wal,
            Recovered {
                metadata,
                snapshot,
                replay,
                records,
            },
        ))
    }

    /// The records of `range` that are on disk, read in LSN order one segment span at a time
    /// (each record's checksum checked again). What recovery replays.
    pub fn entries(&self, range: Range<Lsn>) -> Entries {
        Entries::new(self.read_index().spans(range))
    }

    /// The records of `range` that are on disk, all at once. See [`WalReader::read`].
    pub fn read(&self, range: Range<Lsn>) -> Result<Vec<Entry>, WalError> {
        self.entries(range).collect()
    }

    /// A handle that reads records from another thread while this log appends.
    pub fn reader(&self) -> WalReader {
        WalReader::new(
            Arc::clone(&self.index),
            self.durable.subscribe(),
            Arc::clone(&self.metadata),
        )
    }

    /// One past the last fsynced record; [`WalReader::durable`] watches it.
    pub fn durable_end(&self) -> Lsn {
        self.active.durable.next_lsn
    }

    /// The term of the record at `lsn`, if it is still on disk.
    pub fn term_at(&self, lsn: Lsn) -> Option<Term> {
        self.read_index().term_at(lsn)
    }

    /// The metadata as last written.
    pub fn metadata(&self) -> Metadata {
        self.metadata.get()
    }

    /// Replaces the metadata file with the application's fields of `metadata` (term, vote, node
    /// id, HLC high-water); the log's own fields (`durable_end`, `last_purged`) are kept as the
    /// log knows them, the durable end raised to what is fsynced now. For start-up, before
    /// anything is served, and for an owner that drives the log synchronously (the cluster's Raft
    /// log writes its vote here): the failpoints do not apply (the server's logs write through
    /// [`crate::WalWriter::write_metadata`]).
    pub fn write_metadata(&self, metadata: &Metadata) -> Result<(), WalError> {
        self.metadata.write_application_fields(metadata, false)
    }

    /// Records in the metadata file that every record below [`Wal::durable_end`] is fsynced, so
    /// that their later loss is told apart from a torn write. Done at rotation, snapshot and
    /// shutdown by the log itself, periodically by the writer.
    pub fn mark_durable(&self) -> Result<(), WalError> {
        self.metadata.raise_durable_end()
    }

    fn read_index(&self) -> RwLockReadGuard<'_, LogIndex> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_index(&self) -> RwLockWriteGuard<'_, LogIndex> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
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
        let mut placed: Vec<(Term, u64)> = Vec::new();
        for (term, data) in records {
            if let Err(e) = self.check_record(term, data.len()) {
                self.batch = buf;
                return Err(e);
            }
            placed.push((term, before.end_offset + buf.len() as u64));
            encode_record(term, data, &mut buf)?;
        }
        let count = placed.len() as u64;
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
        {
            let mut index = self.write_index();
            debug_assert_eq!(index.end(), before.next_lsn, "the index follows the file");
            let ends = placed
                .iter()
                .skip(1)
                .map(|&(_, o)| o)
                .chain([after.end_offset]);
            for (&(term, offset), end) in placed.iter().zip(ends) {
                index.push(term, offset, end);
            }
        }
        self.active.written = after;
        self.stats.record_batch(count as usize, batch_len);
        if after.end_offset > self.options.segment_soft_limit_bytes / 2 {
            self.prealloc.start_for(self.active.first_lsn);
        }
        Ok(before.next_lsn..after.next_lsn)
    }

    /// [`Wal::write_batch`] for a replica: the records must get LSNs from `first_lsn` on, which must
    /// be the next LSN of this log ([`WalError::NotNext`] otherwise, before anything is written):
    /// a follower appends exactly what its predecessor sent, without a gap and without overwriting
    /// (to replace records, [`Wal::truncate_from`] first).
    pub fn write_batch_at<'a>(
        &mut self,
        first_lsn: Lsn,
        records: impl IntoIterator<Item = (Term, &'a [u8])>,
    ) -> Result<Range<Lsn>, WalError> {
        let next = self.next_lsn();
        if first_lsn != next {
            return Err(WalError::NotNext {
                expected: next,
                found: first_lsn,
            });
        }
        self.write_batch(records)
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
        if self.options.failpoints.aborts_at(POWER_LOSS) {
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
        self.durable.send_replace(self.active.durable.next_lsn);
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
        let obsolete = self.compact(LogId {
            index: snapshot.last_index,
            term: snapshot.last_term,
        })?;
        delete_segments(&self.dir, &obsolete)
    }

    /// Purges the log up to `upto` (inclusive), which a snapshot now on disk covers: records
    /// `upto` as the last purged id in the metadata file, forgets the closed segments whose
    /// records are all at or below it and returns their paths for [`delete_segments`] (records
    /// below `upto` that share a segment with later ones stay on disk, unread). If the snapshot
    /// is ahead of the whole log (installed from elsewhere), the log restarts after it. A purge
    /// past the snapshot file's last index makes the next [`Wal::open`] refuse the directory.
    pub fn compact(&mut self, upto: LogId) -> Result<Vec<PathBuf>, WalError> {
        let keep_from = upto.index + 1;
        if self.active.written.next_lsn < keep_from {
            self.refuse_if_failed()?;
            self.start_segment(keep_from)?;
        }
        // The metadata first: a crash after it and before the deletion leaves files that the
        // next open deletes; the other order would leave a log that starts after `last_purged`.
        self.metadata.update(true, |m| {
            if m.last_purged.is_none_or(|p| p.index < upto.index) {
                m.last_purged = Some(upto);
            }
        })?;
        self.write_index().purge_before(keep_from);
        let (obsolete, kept) = std::mem::take(&mut self.closed)
            .into_iter()
            .partition(|s| s.end_lsn <= keep_from);
        self.closed = kept;
        let obsolete: Vec<PathBuf> = obsolete
            .into_iter()
            .map(|s: ClosedSegment| s.path)
            .collect();
        Ok(obsolete)
    }

    /// Removes every record at or after `lsn`: a replica dropping an uncommitted suffix that its
    /// leader replaced. The durable end in the metadata file is lowered first, so a crash midway
    /// never leaves a log shorter than the metadata says it is; later segments are deleted newest
    /// first, then the segment holding `lsn` is cut there and becomes the active one. The durable
    /// index ([`WalReader::durable`]) goes down with it. Refused ([`WalError::TruncatePurged`])
    /// at or below the last purged record, and while the log is failed.
    pub fn truncate_from(&mut self, lsn: Lsn) -> Result<(), WalError> {
        self.refuse_if_failed()?;
        let (start, end) = {
            let index = self.read_index();
            (index.start(), index.end())
        };
        if lsn >= end {
            return Ok(());
        }
        let purged = self.metadata.get().last_purged;
        if lsn < start || purged.is_some_and(|p| lsn <= p.index) {
            return Err(WalError::TruncatePurged {
                lsn,
                first: purged.map_or(start, |p| p.index + 1).max(start),
            });
        }
        // The watch first: the metadata file reads it under its lock when it raises the durable
        // end, so no raise can undo the lowering below.
        self.durable.send_modify(|d| *d = (*d).min(lsn));
        self.metadata
            .update(true, |m| m.durable_end = m.durable_end.min(lsn))?;
        let (target, later) = {
            let index = self.read_index();
            let segments = index.segments();
            let Some(t) = segments.iter().rposition(|s| s.first_lsn <= lsn) else {
                return Ok(());
            };
            let s = &segments[t];
            let offset = usize::try_from(lsn - s.first_lsn)
                .ok()
                .and_then(|i| s.offsets.get(i).copied())
                .unwrap_or(s.end_offset);
            let later: Vec<PathBuf> = segments[t + 1..].iter().map(|s| s.path.clone()).collect();
            ((s.first_lsn, s.path.clone(), offset), later)
        };
        let (first_lsn, path, offset) = target;
        let keep = Position {
            end_offset: offset,
            next_lsn: lsn,
        };
        if later.is_empty() {
            self.cut_back(keep)?;
        } else {
            delete_segments(&self.dir, &later)?;
            cut_segment_at(&path, offset)?;
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(WalError::io("open", &path))?;
            self.active = ActiveSegment {
                file,
                path,
                first_lsn,
                written: keep,
                durable: keep,
            };
            self.closed.retain(|s| s.first_lsn < first_lsn);
            self.write_index().truncate(lsn);
            self.durable.send_replace(lsn);
        }
        tracing::info!(lsn, "log truncated");
        Ok(())
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
        self.write_index().truncate(keep.next_lsn);
        self.durable.send_replace(keep.next_lsn);
        Ok(())
    }

    fn start_segment(&mut self, first_lsn: Lsn) -> Result<(), WalError> {
        let prepared = self.prealloc.take_ready();
        let next = create_segment(&self.dir, first_lsn, &self.options.failpoints, prepared)?;
        self.write_index()
            .add_segment(first_lsn, next.path.clone(), next.written.end_offset);
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
        if self.active.durable.next_lsn == first_lsn {
            // Everything before the new segment is fsynced: say so, once per segment.
            if let Err(error) = self.mark_durable() {
                tracing::warn!(%error, "cannot record the durable end in the metadata file");
            }
        }
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
    // What a crash left in the page cache is on disk before it counts as durable.
    file.sync_data().map_err(WalError::io("fsync", &path))?;
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
    let dropped = segment.size_bytes.saturating_sub(offset);
    tracing::warn!(
        path = %path.display(),
        offset,
        dropped_bytes = dropped,
        %damage,
        "cutting off a torn record at the end of the log (it was never acknowledged)"
    );
    cut_segment_at(path, offset)
}
