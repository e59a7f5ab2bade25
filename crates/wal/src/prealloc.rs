//! The next log segment, written full of zeros ahead of time by a background thread.
//!
//! Why: an append that grows a file changes its size, and `fdatasync` must then write the inode as
//! well as the data — a second synchronous write per commit (measured here: 165 µs per append +
//! fdatasync into a growing file, 115 µs into one already that long). Appends into a segment whose
//! bytes already exist change no metadata. Zeros read as the end marker (`00 00 00 00`,
//! storage-format.md), so a zero-filled segment with a header is a valid empty segment, and
//! recovery, `data verify` and the scanner need nothing new.
//!
//! The file is prepared under `temp/` (cleared at start-up) once the active segment is half full,
//! and renamed into place at rotation; if it is not ready, rotation creates a plain segment and
//! loses nothing but speed. It is only attempted while the disk has room for several segments, so
//! that preparing one never takes the space an append needs.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crate::segment::empty_segment;

/// File name of the prepared segment under `temp/` (cleared, like everything there, at start-up).
pub(crate) const PREPARED_NAME: &str = "next-segment.log";
/// Free space required, in segments, before one is prepared.
const ROOM_IN_SEGMENTS: u64 = 4;
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

#[derive(Debug)]
pub(crate) struct Preallocator {
    temp_dir: PathBuf,
    /// Size of a prepared segment; 0 disables preparing.
    len: u64,
    pending: Option<JoinHandle<io::Result<PathBuf>>>,
    /// The active segment (by first LSN) a preparation was last attempted for: one attempt each.
    attempted_for: Option<u64>,
    /// Prepared in the caller, not on a thread ([`crate::Committer::Caller`]).
    inline: bool,
    /// A segment prepared in the caller, not taken yet.
    ready: Option<PathBuf>,
}

impl Preallocator {
    pub(crate) fn new(temp_dir: PathBuf, len: u64) -> Self {
        Preallocator {
            temp_dir,
            len,
            pending: None,
            attempted_for: None,
            inline: false,
            ready: None,
        }
    }

    /// Prepares segments in the caller of [`Preallocator::start_for`] when `inline`.
    pub(crate) fn inline(mut self, inline: bool) -> Self {
        self.inline = inline;
        self
    }

    /// Starts preparing the segment to follow `active` (its first LSN), once per active segment,
    /// unless one is prepared or being prepared, or the disk is short of room.
    pub(crate) fn start_for(&mut self, active: u64) {
        if self.len == 0
            || self.pending.is_some()
            || self.ready.is_some()
            || self.attempted_for == Some(active)
        {
            return;
        }
        self.attempted_for = Some(active);
        if !room_for(&self.temp_dir, self.len) {
            tracing::debug!("not preparing the next log segment: the disk is short of room");
            return;
        }
        let (path, len) = (self.temp_dir.join(PREPARED_NAME), self.len);
        if self.inline {
            match prepare(&path, len) {
                Ok(()) => self.ready = Some(path),
                Err(error) => {
                    tracing::warn!(%error, "preparing the next log segment failed; it will be created when needed")
                }
            }
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("mqstate-wal-prealloc".into())
            .spawn(move || prepare(&path, len).map(|()| path));
        match spawned {
            Ok(handle) => self.pending = Some(handle),
            Err(error) => tracing::warn!(%error, "cannot start preparing the next log segment"),
        }
    }

    /// The prepared segment if it is ready now (never waits).
    pub(crate) fn take_ready(&mut self) -> Option<PathBuf> {
        if let Some(path) = self.ready.take() {
            return Some(path);
        }
        if !self.pending.as_ref()?.is_finished() {
            return None;
        }
        match self.pending.take()?.join() {
            Ok(Ok(path)) => Some(path),
            Ok(Err(error)) => {
                tracing::warn!(%error, "preparing the next log segment failed; it will be created when needed");
                None
            }
            Err(_) => None,
        }
    }
}

impl Drop for Preallocator {
    fn drop(&mut self) {
        // Not left writing into a directory its log no longer owns; whatever it leaves in temp/
        // is cleared at the next start.
        if let Some(pending) = self.pending.take() {
            let _ = pending.join();
        }
    }
}

/// Writes a segment header followed by zeros up to `len` bytes, fsynced; removes the file on failure.
fn prepare(path: &Path, len: u64) -> io::Result<()> {
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        let header = empty_segment();
        file.write_all(&header)?;
        let mut left = len.saturating_sub(header.len() as u64);
        while left > 0 {
            let n = left.min(ZEROS.len() as u64) as usize;
            file.write_all(&ZEROS[..n])?;
            left -= n as u64;
        }
        file.sync_all()
    })();
    if written.is_err() {
        let _ = fs::remove_file(path);
    }
    written
}

fn room_for(dir: &Path, len: u64) -> bool {
    match rustix::fs::statvfs(dir) {
        Ok(stat) => {
            stat.f_bavail.saturating_mul(stat.f_frsize) >= len.saturating_mul(ROOM_IN_SEGMENTS)
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{scan_segment, SegmentEnd, SEGMENT_HEADER_LEN};

    #[test]
    fn a_prepared_segment_is_a_valid_empty_segment_of_the_requested_length() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Preallocator::new(dir.path().to_path_buf(), 256 * 1024);
        p.start_for(1);
        let path = loop {
            if let Some(path) = p.take_ready() {
                break path;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let bytes = fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 256 * 1024);
        let scan = scan_segment(&bytes).unwrap();
        assert!(scan.records.is_empty());
        assert_eq!(
            scan.end,
            SegmentEnd::EndMarker {
                offset: SEGMENT_HEADER_LEN as u64
            }
        );
        assert!(p.take_ready().is_none(), "handed out once");
        p.start_for(1);
        assert!(p.pending.is_none(), "one attempt per active segment");
    }

    #[test]
    fn nothing_is_prepared_without_room_for_several_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Preallocator::new(dir.path().to_path_buf(), u64::MAX / 8);
        p.start_for(1);
        assert!(p.pending.is_none());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
