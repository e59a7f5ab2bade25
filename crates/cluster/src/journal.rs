//! The durable Raft log and vote of the control plane: one append-only file of CRC-framed records
//! (`<dir>/raft.journal`), replayed into memory at open and rewritten whole when it holds mostly
//! dead records.
//!
//! Why not the segmented `mqstate-wal` log yet: Raft needs to cut off a suffix of the log (a
//! follower's conflicting entries) and to remember the last purged log id, which `Wal` does not
//! offer today. The control plane's log is small and low-rate, so this file is enough; [`Journal`]'s
//! methods are the whole contract the [`crate::log_store`] relies on, so moving it onto `Wal` (term
//! and index in the record header, `truncate_suffix`, last purged id in the metadata) changes this
//! file only.
//!
//! Frame: `u32` little-endian payload length, `u32` CRC-32/MPEG-2 of the payload, the payload (a
//! postcard-encoded [`Record`]). A frame cut short at the end of the file (a crash mid-append) is
//! dropped at open; a bad frame with whole frames after it is corruption and refuses to open, naming
//! the file and offset.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use mqstate_wal::checksum::crc32;
use serde::{Deserialize, Serialize};

use crate::types::{Entry, LogId, Vote};

const FILE_NAME: &str = "raft.journal";
const FRAME_HEADER: usize = 8;
/// Largest record accepted back from disk (a membership entry or a batch is far smaller).
const MAX_RECORD_BYTES: usize = 64 << 20;
/// Rewrite once this many records were appended since the last rewrite and most are dead.
const REWRITE_AFTER_RECORDS: u64 = if cfg!(test) { 64 } else { 4096 };

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the Raft journal {path} is damaged at offset {offset}: {reason}; move the node's cluster directory away and re-add the node")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("cannot encode a Raft journal record: {0}")]
    Encode(#[from] postcard::Error),
}

/// One change of the durable Raft state.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Record {
    Entry(Entry),
    /// Entries from this index on are gone (a follower's conflicting suffix).
    TruncateFrom(u64),
    /// Entries up to this log id are gone (covered by a snapshot).
    PurgeUpTo(LogId),
    Vote(Vote),
    Committed(Option<LogId>),
}

/// The Raft log and vote: in memory, and in the journal file before any change is reported done.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    appended_since_rewrite: u64,
    entries: BTreeMap<u64, Entry>,
    vote: Option<Vote>,
    committed: Option<LogId>,
    last_purged: Option<LogId>,
}

impl Journal {
    /// Opens (or creates) `dir/raft.journal` and replays it.
    pub fn open(dir: &Path) -> Result<Journal, JournalError> {
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        let path = dir.join(FILE_NAME);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io("cannot open", &path))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(io("cannot read", &path))?;
        let mut journal = Journal {
            path,
            file,
            appended_since_rewrite: 0,
            entries: BTreeMap::new(),
            vote: None,
            committed: None,
            last_purged: None,
        };
        let (records, good_len) = decode_frames(&bytes, &journal.path)?;
        if good_len < bytes.len() {
            tracing::warn!(
                path = %journal.path.display(),
                offset = good_len,
                "dropping a Raft journal record cut short by a crash"
            );
            journal
                .file
                .set_len(good_len as u64)
                .map_err(io("cannot truncate", &journal.path))?;
            journal
                .file
                .sync_all()
                .map_err(io("cannot fsync", &journal.path))?;
        }
        journal.appended_since_rewrite = records.len() as u64;
        for record in records {
            journal.replay(record);
        }
        Ok(journal)
    }

    fn replay(&mut self, record: Record) {
        match record {
            Record::Entry(entry) => {
                self.entries.insert(entry.log_id.index, entry);
            }
            Record::TruncateFrom(index) => {
                self.entries.split_off(&index);
            }
            Record::PurgeUpTo(log_id) => {
                self.entries = self.entries.split_off(&(log_id.index + 1));
                self.last_purged = Some(log_id);
            }
            Record::Vote(vote) => self.vote = Some(vote),
            Record::Committed(committed) => self.committed = committed,
        }
    }

    /// Writes `records` and, with `sync`, fsyncs them; then applies them to memory.
    fn write(&mut self, records: Vec<Record>, sync: bool) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        for record in &records {
            encode_frame(record, &mut buf)?;
        }
        self.file
            .write_all(&buf)
            .map_err(io("cannot write", &self.path))?;
        if sync {
            self.file
                .sync_data()
                .map_err(io("cannot fsync", &self.path))?;
        }
        self.appended_since_rewrite += records.len() as u64;
        for record in records {
            self.replay(record);
        }
        if self.appended_since_rewrite > REWRITE_AFTER_RECORDS
            && self.appended_since_rewrite > 4 * (self.entries.len() as u64 + 3)
        {
            self.rewrite()?;
        }
        Ok(())
    }

    /// Replaces the file by one holding only the live state (temp file, fsync, rename, directory
    /// fsync), so a crash leaves either the old file or the new one.
    fn rewrite(&mut self) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        if let Some(vote) = self.vote {
            encode_frame(&Record::Vote(vote), &mut buf)?;
        }
        if let Some(purged) = self.last_purged {
            encode_frame(&Record::PurgeUpTo(purged), &mut buf)?;
        }
        encode_frame(&Record::Committed(self.committed), &mut buf)?;
        for entry in self.entries.values() {
            encode_frame(&Record::Entry(entry.clone()), &mut buf)?;
        }
        let temp = self.path.with_extension("journal.tmp");
        std::fs::write(&temp, &buf).map_err(io("cannot write", &temp))?;
        File::open(&temp)
            .and_then(|f| f.sync_all())
            .map_err(io("cannot fsync", &temp))?;
        std::fs::rename(&temp, &self.path).map_err(io("cannot rename into", &self.path))?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io("cannot fsync", dir))?;
        }
        self.file = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io("cannot open", &self.path))?;
        self.appended_since_rewrite = 0;
        Ok(())
    }

    /// Appends entries; durable when this returns.
    pub fn append(&mut self, entries: Vec<Entry>) -> Result<(), JournalError> {
        debug_assert!(entries
            .windows(2)
            .all(|w| w[0].log_id.index + 1 == w[1].log_id.index));
        // An append at an index already present replaces the entries from there on.
        let mut records = Vec::with_capacity(entries.len() + 1);
        if let Some(first) = entries.first() {
            if self.entries.range(first.log_id.index..).next().is_some() {
                records.push(Record::TruncateFrom(first.log_id.index));
            }
        }
        records.extend(entries.into_iter().map(Record::Entry));
        self.write(records, true)
    }

    /// Removes the entries from `index` on; durable when this returns.
    pub fn truncate_from(&mut self, index: u64) -> Result<(), JournalError> {
        self.write(vec![Record::TruncateFrom(index)], true)
    }

    /// Removes the entries up to and including `log_id` and remembers it as the last purged.
    pub fn purge_up_to(&mut self, log_id: LogId) -> Result<(), JournalError> {
        self.write(vec![Record::PurgeUpTo(log_id)], true)
    }

    pub fn save_vote(&mut self, vote: Vote) -> Result<(), JournalError> {
        self.write(vec![Record::Vote(vote)], true)
    }

    /// The committed id is a hint (it lets a restart apply without waiting for a leader): it rides
    /// on the next fsync rather than costing one of its own.
    pub fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), JournalError> {
        self.write(vec![Record::Committed(committed)], false)
    }

    pub fn vote(&self) -> Option<Vote> {
        self.vote
    }

    pub fn committed(&self) -> Option<LogId> {
        self.committed
    }

    pub fn last_purged(&self) -> Option<LogId> {
        self.last_purged
    }

    pub fn last_log_id(&self) -> Option<LogId> {
        self.entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(self.last_purged)
    }

    pub fn entries(&self, range: impl std::ops::RangeBounds<u64>) -> Vec<Entry> {
        self.entries.range(range).map(|(_, e)| e.clone()).collect()
    }
}

/// Decodes a journal image as [`Journal::open`] would, without a file: the number of whole records,
/// or the damage. For the fuzzer and tools; never panics.
pub fn scan(bytes: &[u8]) -> Result<usize, JournalError> {
    decode_frames(bytes, Path::new("<memory>")).map(|(records, _)| records.len())
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> JournalError + 'a {
    move |source| JournalError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn encode_frame(record: &Record, out: &mut Vec<u8>) -> Result<(), JournalError> {
    let payload = postcard::to_allocvec(record)?;
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(())
}

/// Decodes whole frames; returns them and the length they cover. A damaged frame at the very end
/// is a torn append (dropped); one followed by more bytes is corruption.
fn decode_frames(bytes: &[u8], path: &Path) -> Result<(Vec<Record>, usize), JournalError> {
    let mut records = Vec::new();
    let mut offset = 0usize;
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        let corrupt = |reason: String| JournalError::Corrupt {
            path: path.to_owned(),
            offset: offset as u64,
            reason,
        };
        if rest.len() < FRAME_HEADER {
            break; // torn header
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > MAX_RECORD_BYTES {
            if rest[..FRAME_HEADER].iter().all(|&b| b == 0) {
                break;
            }
            return Err(corrupt(format!("record length {len} is implausible")));
        }
        let end = FRAME_HEADER + len;
        if rest.len() < end {
            break; // torn payload
        }
        let payload = &rest[FRAME_HEADER..end];
        if crc32(payload) != crc {
            if rest.len() == end {
                break; // the last frame, torn
            }
            return Err(corrupt("checksum mismatch".into()));
        }
        let record = postcard::from_bytes(payload)
            .map_err(|e| corrupt(format!("record does not decode: {e}")))?;
        records.push(record);
        offset += end;
    }
    Ok((records, offset))
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;
    use crate::control::Command;

    fn entry(term: u64, index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 0), index),
            payload: EntryPayload::Normal(Command::Tick { now_ms: index }),
        }
    }

    #[test]
    fn state_survives_reopen_and_truncation_and_purge_are_remembered() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut j = Journal::open(dir.path()).unwrap();
            j.append((1..=5).map(|i| entry(1, i)).collect()).unwrap();
            j.truncate_from(4).unwrap();
            j.append(vec![entry(2, 4)]).unwrap();
            j.purge_up_to(entry(1, 1).log_id).unwrap();
            j.save_vote(Vote::new(2, 3)).unwrap();
            j.save_committed(Some(entry(1, 2).log_id)).unwrap();
            j.append(vec![entry(2, 5)]).unwrap();
        }
        let j = Journal::open(dir.path()).unwrap();
        let ids: Vec<(u64, u64)> = j
            .entries(..)
            .iter()
            .map(|e| (e.log_id.leader_id.term, e.log_id.index))
            .collect();
        assert_eq!(ids, [(1, 2), (1, 3), (2, 4), (2, 5)]);
        assert_eq!(j.vote(), Some(Vote::new(2, 3)));
        assert_eq!(j.last_purged(), Some(entry(1, 1).log_id));
        assert_eq!(j.committed(), Some(entry(1, 2).log_id));
        assert_eq!(j.last_log_id(), Some(entry(2, 5).log_id));
    }

    #[test]
    fn an_append_over_existing_entries_replaces_the_suffix() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::open(dir.path()).unwrap();
        j.append((1..=5).map(|i| entry(1, i)).collect()).unwrap();
        j.append(vec![entry(3, 3)]).unwrap();
        assert_eq!(j.last_log_id(), Some(entry(3, 3).log_id));
        drop(j);
        assert_eq!(Journal::open(dir.path()).unwrap().entries(..).len(), 3);
    }

    #[test]
    fn a_torn_tail_is_dropped_and_damage_in_the_middle_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        {
            let mut j = Journal::open(dir.path()).unwrap();
            j.append(vec![entry(1, 1)]).unwrap();
            j.append(vec![entry(1, 2)]).unwrap();
        }
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 3]).unwrap();
        let j = Journal::open(dir.path()).unwrap();
        assert_eq!(j.last_log_id(), Some(entry(1, 1).log_id));
        drop(j);
        let mut damaged = whole.clone();
        damaged[FRAME_HEADER + 1] ^= 0xff; // inside the first record's payload
        std::fs::write(&path, &damaged).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("offset 0") && err.contains("checksum"),
            "{err}"
        );
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = scan(&bytes);
        }
    }

    #[test]
    fn rewriting_keeps_only_the_live_state() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::open(dir.path()).unwrap();
        for i in 1..=(REWRITE_AFTER_RECORDS + 10) {
            j.append(vec![entry(1, i)]).unwrap();
            if i > 5 {
                j.purge_up_to(entry(1, i - 5).log_id).unwrap();
            }
        }
        let size = std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len();
        assert!(
            size < 64 * 1024,
            "rewritten to the live entries: {size} bytes"
        );
        drop(j);
        let j = Journal::open(dir.path()).unwrap();
        assert_eq!(j.entries(..).len(), 5);
        assert_eq!(
            j.last_log_id(),
            Some(entry(1, REWRITE_AFTER_RECORDS + 10).log_id)
        );
    }
}
