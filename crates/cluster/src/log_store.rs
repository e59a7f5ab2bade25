//! openraft's log storage over our write-ahead log (`mqstate-wal`, TaskFlux layout; decision 0031).
//!
//! * An entry is one record: its term in the record header, its index the record's LSN (a log id
//!   is (term, index) with openraft's `single-term-leader`), its payload postcard-encoded as the
//!   record's data.
//! * The vote is the metadata file's term, voted-for and vote-committed fields; the last purged
//!   log id and the committed log id are its v3 fields. No file of our own.
//! * The state machine keeps its snapshot apart (`state_machine`), so the log is opened with
//!   [`WalOptions::snapshot_elsewhere`]: a purge is openraft's promise that the snapshot covers it.

use std::fmt::Debug;
use std::ops::{Bound, Range, RangeBounds};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use mqstate_wal::{Wal, WalError, WalOptions, WalReader};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{CommittedLeaderId, EntryPayload, LeaderId, OptionalSend, RaftLogReader};
use tokio::sync::watch;

use crate::types::{storage_error, Entry, LogId, StorageError, TypeConfig, Vote};
use crate::NodeId;

/// The largest node id the metadata file's voted-for field holds (`Int32`).
pub const MAX_NODE_ID: NodeId = i32::MAX as NodeId;

/// The committed log id is a hint (it lets a restart apply without waiting for a leader), so it is
/// written to the metadata file only every this many entries, and with every vote.
const COMMITTED_WRITE_EVERY: u64 = 64;

/// How long a purge waits for the snapshot covering it to be written (an install from the leader
/// takes a fsync or two; one that fails stops Raft, which this then does not hold up for ever).
const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The control plane's log is small and its rate low: small segments, so that a purge frees
/// space soon, and none prepared ahead.
fn options() -> WalOptions {
    WalOptions {
        name: "raft",
        segment_soft_limit_bytes: 1 << 20,
        segment_hard_limit_bytes: 4 << 20,
        preallocate_segments: false,
        snapshot_elsewhere: true,
        ..WalOptions::default()
    }
}

/// The file earlier builds kept the Raft log and vote in (decision 0021).
const OLD_JOURNAL: &str = "raft.journal";

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Wal(#[from] WalError),
    /// Starting over an empty log would forget the vote and the membership: refused.
    #[error("{path} is the Raft log of an earlier mqstate build, which this one does not read; stop the node, move its cluster directory away and add it to the cluster again as a new node (a new id)")]
    OldJournal { path: std::path::PathBuf },
}

#[derive(Debug)]
struct Inner {
    wal: Wal,
    committed: Option<LogId>,
    /// The committed log id as the metadata file has it.
    written_committed: Option<LogId>,
}

/// The Raft log of this node. Clones share the log (the reader openraft asks for is a clone).
#[derive(Debug, Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
    /// Reads records without waiting for a write in progress.
    reader: WalReader,
    /// The last log id the state machine's snapshot on disk covers, when the log is a node's
    /// ([`LogStore::purging_within`]).
    snapshot: Option<watch::Receiver<Option<LogId>>>,
}

impl LogStore {
    /// Opens (or creates) the log in `dir` (`log/`, `mqstate.metadata`, `temp/`, `LOCK`).
    pub fn open(dir: &Path) -> Result<LogStore, OpenError> {
        LogStore::open_with(dir, options())
    }

    fn open_with(dir: &Path, options: WalOptions) -> Result<LogStore, OpenError> {
        let old = dir.join(OLD_JOURNAL);
        if old.exists() {
            return Err(OpenError::OldJournal { path: old });
        }
        let (wal, recovered) = Wal::open(dir, options)?;
        let committed = recovered.metadata.committed.map(to_raft);
        Ok(LogStore {
            snapshot: None,
            reader: wal.reader(),
            inner: Arc::new(Mutex::new(Inner {
                wal,
                committed,
                written_committed: committed,
            })),
        })
    }

    /// Purges only what the snapshot on disk covers, waiting for it if need be
    /// ([`crate::state_machine::StateMachineStore::snapshot_covers`]; decision 0073).
    pub fn purging_within(self, covered: watch::Receiver<Option<LogId>>) -> LogStore {
        LogStore {
            snapshot: Some(covered),
            ..self
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Memory changes only after the disk did, so a lock poisoned by a panic is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn last_purged(&self) -> Option<LogId> {
        self.reader.last_purged().map(to_raft)
    }

    #[allow(clippy::result_large_err)] // openraft's own error type, as its traits return
    fn read(&self, range: Range<u64>) -> Result<Vec<Entry>, StorageError> {
        let bounds = self.reader.bounds();
        let range = range.start.max(bounds.start)..range.end.min(bounds.end);
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let records = self.reader.read(range).map_err(storage_error::read_logs)?;
        records
            .into_iter()
            .map(|record| {
                let payload: EntryPayload<TypeConfig> = postcard::from_bytes(&record.data)
                    .map_err(|e| {
                        storage_error::read_logs(format!(
                            "the Raft log record at index {} does not decode: {e}",
                            record.lsn
                        ))
                    })?;
                Ok(Entry {
                    log_id: log_id(record.term, record.lsn),
                    payload,
                })
            })
            .collect()
    }
}

fn log_id(term: u64, index: u64) -> LogId {
    LogId::new(CommittedLeaderId::new(term, 0), index)
}

fn to_raft(id: mqstate_wal::LogId) -> LogId {
    log_id(id.term, id.index)
}

fn to_wal(id: LogId) -> mqstate_wal::LogId {
    mqstate_wal::LogId {
        term: id.leader_id.term,
        index: id.index,
    }
}

fn to_range(range: impl RangeBounds<u64>) -> Range<u64> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => u64::MAX,
    };
    start..end
}

impl Inner {
    /// Writes the vote fields and the committed log id to the metadata file (replaced atomically,
    /// fsynced). The log's own fields (durable end, last purged) are kept as the log knows them.
    #[allow(clippy::result_large_err)] // openraft's own error type, as its traits return
    fn write_metadata(&mut self, vote: Option<Vote>) -> Result<(), StorageError> {
        let mut metadata = self.wal.metadata();
        if let Some(vote) = vote {
            metadata.term = vote.leader_id.term;
            metadata.voted_for = match vote.leader_id.voted_for {
                None => None,
                Some(id) => Some(
                    u32::try_from(id)
                        .ok()
                        .filter(|&id| NodeId::from(id) <= MAX_NODE_ID)
                        .ok_or_else(|| {
                            storage_error::write_vote(format!(
                                "cannot record a vote for node {id}: the metadata file's voted-for field holds node ids up to {MAX_NODE_ID}"
                            ))
                        })?,
                ),
            };
            metadata.vote_committed = vote.committed;
        }
        metadata.committed = self.committed.map(to_wal);
        self.wal.write_metadata(&metadata).map_err(|e| {
            if vote.is_some() {
                storage_error::write_vote(e)
            } else {
                storage_error::write_logs(e)
            }
        })?;
        self.written_committed = self.committed;
        Ok(())
    }

    #[allow(clippy::result_large_err)] // openraft's own error type, as its traits return
    fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        debug_assert!(entries
            .windows(2)
            .all(|w| w[0].log_id.index + 1 == w[1].log_id.index));
        // Entries at or below the last purged one are covered by the snapshot (committed, so
        // the same everywhere): nothing to write.
        let purged = self.wal.metadata().last_purged;
        let skip = purged.map_or(0, |p| {
            entries
                .iter()
                .take_while(|e| e.log_id.index <= p.index)
                .count()
        });
        let entries = &entries[skip..];
        let Some(first) = entries.first().map(|e| e.log_id.index) else {
            return Ok(());
        };
        let encoded = entries
            .iter()
            .map(|e| Ok((e.log_id.leader_id.term, postcard::to_allocvec(&e.payload)?)))
            .collect::<Result<Vec<_>, postcard::Error>>()
            .map_err(storage_error::write_logs)?;
        let next = self.wal.next_lsn();
        if first > next && next == 0 && purged.is_none() {
            // A log that never held an entry begins where its first entry is (openraft's storage
            // suite starts logs at 1 or 2). What comes before it is not here, as if purged; in a
            // running cluster the first entry is 0, or follows a snapshot's purge.
            let before = mqstate_wal::LogId {
                term: entries[0].log_id.leader_id.term,
                index: first - 1,
            };
            self.wal
                .compact(before)
                .map_err(storage_error::write_logs)?;
        }
        // An append over entries already present replaces them from there on.
        if first < self.wal.next_lsn() {
            self.wal
                .truncate_from(first)
                .map_err(storage_error::write_logs)?;
        }
        // The durable end is raised with every append, not only at rotation: openraft counts an
        // entry it was told is flushed toward a quorum, so its later loss must be refused at
        // recovery (`LostDurable`), never cut as a torn tail. One small metadata write per
        // append; the control plane appends a few small batches a second.
        self.wal
            .write_batch_at(first, encoded.iter().map(|(term, data)| (*term, &data[..])))
            .and_then(|_| self.wal.sync())
            .and_then(|()| self.wal.mark_durable())
            .and_then(|()| self.wal.rotate_if_needed())
            .map_err(storage_error::write_logs)?;
        debug_assert_eq!(self.wal.metadata().durable_end, self.wal.next_lsn());
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        self.read(to_range(range))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id = self.last_purged();
        let bounds = self.reader.bounds();
        let last_log_id = match bounds.end.checked_sub(1).filter(|_| !bounds.is_empty()) {
            Some(last) => {
                let term = self.reader.term_at(last).ok_or_else(|| {
                    storage_error::read_logs(format!("no term for the Raft log index {last}"))
                })?;
                Some(log_id(term, last))
            }
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.inner().write_metadata(Some(*vote))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        let m = self.reader.metadata();
        if m.term == 0 && m.voted_for.is_none() && !m.vote_committed {
            return Ok(None);
        }
        let leader_id = LeaderId {
            term: m.term,
            voted_for: m.voted_for.map(NodeId::from),
        };
        Ok(Some(Vote {
            leader_id,
            committed: m.vote_committed,
        }))
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        let mut inner = self.inner();
        inner.committed = committed;
        let due = match (inner.written_committed, committed) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(written), Some(now)) => now.index >= written.index + COMMITTED_WRITE_EVERY,
        };
        if due {
            inner.write_metadata(None)?;
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.inner().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        // Synchronous: the control plane appends rarely and small, and the fsync is done when
        // `append` returns, which is what the callback reports.
        match self.inner().append(&entries) {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(e)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.inner()
            .wal
            .truncate_from(log_id.index)
            .map_err(storage_error::write_logs)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        if let Some(covered) = &mut self.snapshot {
            // openraft 0.9 purges after a snapshot from the leader without waiting for the
            // state machine to have written it (decision 0073).
            let written = covered.wait_for(|c| c.is_some_and(|c| c.index >= log_id.index));
            match tokio::time::timeout(SNAPSHOT_WAIT, written).await {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => {
                    return Err(storage_error::write_logs(
                        "cannot purge the Raft log: the state machine is gone",
                    ))
                }
                Err(_) => {
                    return Err(storage_error::write_logs(format!(
                        "cannot purge the Raft log up to {log_id}: no snapshot covering it was written within {SNAPSHOT_WAIT:?}"
                    )))
                }
            }
        }
        let mut inner = self.inner();
        let obsolete = inner
            .wal
            .compact(to_wal(log_id))
            .map_err(storage_error::write_logs)?;
        mqstate_wal::delete_segments(inner.wal.data_dir(), &obsolete)
            .map_err(storage_error::write_logs)
    }
}

#[cfg(test)]
mod tests {
    use openraft::EntryPayload;

    use super::*;
    use crate::control::Command;

    fn entry(term: u64, index: u64) -> Entry {
        Entry {
            log_id: log_id(term, index),
            payload: EntryPayload::Normal(Command::Tick { now_ms: index }),
        }
    }

    fn ids(entries: &[Entry]) -> Vec<(u64, u64)> {
        entries
            .iter()
            .map(|e| (e.log_id.leader_id.term, e.log_id.index))
            .collect()
    }

    #[tokio::test]
    async fn log_vote_purge_and_committed_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut store = LogStore::open(dir.path()).unwrap();
            {
                let mut inner = store.inner();
                inner
                    .append(&(0..=5).map(|i| entry(1, i)).collect::<Vec<_>>())
                    .unwrap();
                inner.wal.truncate_from(4).unwrap();
                inner.append(&[entry(2, 4)]).unwrap();
                // An append over existing entries replaces the suffix.
                inner.append(&[entry(2, 5), entry(2, 6)]).unwrap();
                inner.append(&[entry(3, 6)]).unwrap();
            }
            store.purge(log_id(1, 1)).await.unwrap();
            store.save_committed(Some(log_id(1, 2))).await.unwrap();
            store.save_vote(&Vote::new_committed(3, 2)).await.unwrap();
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        let all = store.try_get_log_entries(..).await.unwrap();
        assert_eq!(ids(&all), [(1, 2), (1, 3), (2, 4), (2, 5), (3, 6)]);
        assert_eq!(
            all[3].payload,
            EntryPayload::Normal(Command::Tick { now_ms: 5 })
        );
        assert_eq!(
            store.read_vote().await.unwrap(),
            Some(Vote::new_committed(3, 2))
        );
        assert_eq!(store.read_committed().await.unwrap(), Some(log_id(1, 2)));
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 1)));
        assert_eq!(state.last_log_id, Some(log_id(3, 6)));
        // The header carries the term and the LSN is the index: what `mqstate data inspect` shows.
        let records = store.reader.read(2..7).unwrap();
        let headers: Vec<(u64, u64)> = records.iter().map(|r| (r.term, r.lsn)).collect();
        assert_eq!(headers, ids(&all));
    }

    #[tokio::test]
    async fn a_purge_past_the_end_leaves_an_empty_log_that_continues_after_it() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut store = LogStore::open(dir.path()).unwrap();
            store.inner().append(&[entry(1, 0), entry(1, 1)]).unwrap();
            store.purge(log_id(4, 30)).await.unwrap();
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(4, 30)));
        assert_eq!(state.last_log_id, Some(log_id(4, 30)));
        assert!(store.try_get_log_entries(..).await.unwrap().is_empty());
        // An entry the purge covers is not written again.
        store.inner().append(&[entry(4, 30), entry(4, 31)]).unwrap();
        assert_eq!(
            ids(&store.try_get_log_entries(..).await.unwrap()),
            [(4, 31)]
        );
    }

    /// openraft 0.9 has a follower install its leader's snapshot in the state machine's worker
    /// and purge the log it covers at once, without waiting for the install to be written. A
    /// crash between the two left a log purged past the snapshot on disk: the restarted node
    /// could not re-apply what it had committed, and answered its leader's heartbeat with a
    /// conflict below the entries it had acknowledged (the leader's "follower log reversion is
    /// not allowed"). The purge now waits for the snapshot covering it.
    #[tokio::test]
    async fn a_purge_waits_until_the_snapshot_on_disk_covers_it() {
        use openraft::storage::RaftStateMachine;

        use crate::state_machine::{Applied, StateMachineStore};

        let dir = tempfile::tempdir().unwrap();
        let installed = {
            let mut machine = StateMachineStore::open(dir.path()).unwrap();
            let mut store = LogStore::open(dir.path())
                .unwrap()
                .purging_within(machine.snapshot_covers());
            store
                .inner()
                .append(&(0..10).map(|i| entry(1, i)).collect::<Vec<_>>())
                .unwrap();
            // The leader's snapshot (ahead of this log) is on its way to the state machine
            // worker when openraft purges the log up to it.
            let mut purging = store.clone();
            let purge = purging.purge(log_id(2, 20));
            tokio::pin!(purge);
            tokio::select! {
                biased;
                purged = &mut purge => panic!("purged before the snapshot was written: {purged:?}"),
                () = std::future::ready(()) => {}
            }
            assert_eq!(
                store.get_log_state().await.unwrap().last_purged_log_id,
                None
            );
            // A crash now keeps the whole log. Once the snapshot is written the purge goes on.
            let applied = Applied {
                last_applied: Some(log_id(2, 20)),
                ..Applied::default()
            };
            let meta = openraft::SnapshotMeta {
                last_log_id: Some(log_id(2, 20)),
                last_membership: Default::default(),
                snapshot_id: "leader".into(),
            };
            let data = postcard::to_allocvec(&applied).unwrap();
            machine
                .install_snapshot(&meta, Box::new(std::io::Cursor::new(data)))
                .await
                .unwrap();
            purge.await.unwrap();
            store.get_log_state().await.unwrap()
        };
        assert_eq!(installed.last_purged_log_id, Some(log_id(2, 20)));
        assert_eq!(installed.last_log_id, Some(log_id(2, 20)));

        // What a crash before the install leaves: the log whole, nothing purged.
        let dir = tempfile::tempdir().unwrap();
        {
            let machine = StateMachineStore::open(dir.path()).unwrap();
            let mut store = LogStore::open(dir.path())
                .unwrap()
                .purging_within(machine.snapshot_covers());
            store.inner().append(&[entry(1, 0), entry(1, 1)]).unwrap();
            let purge = store.purge(log_id(2, 20));
            tokio::pin!(purge);
            tokio::select! {
                biased;
                purged = &mut purge => panic!("purged before the snapshot was written: {purged:?}"),
                () = std::future::ready(()) => {}
            }
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, None);
        assert_eq!(state.last_log_id, Some(log_id(1, 1)));
    }

    /// Set in the child process of the kill -9 test: the directory it appends to.
    const KILL9_DIR: &str = "MQSTATE_TEST_RAFT_LOG_KILL9_DIR";
    const KILL9_ENTRIES: u64 = 40;

    /// The child of [`acknowledged_entries_survive_kill_9_and_are_below_the_durable_end`]:
    /// appends entries one batch at a time, says which it appended, then waits to be killed.
    /// Does nothing when run as an ordinary test.
    #[test]
    fn kill9_child_appends_then_waits() {
        let Some(dir) = std::env::var_os(KILL9_DIR) else {
            return;
        };
        let store = LogStore::open(Path::new(&dir)).unwrap();
        for i in 0..KILL9_ENTRIES {
            store.inner().append(&[entry(1, i)]).unwrap();
            println!("appended {i}");
        }
        std::thread::sleep(std::time::Duration::from_secs(600));
    }

    /// openraft is told an entry is flushed when `append` returns: after a kill -9 every such
    /// entry is back, and the metadata file's durable end covers it, so damage to it afterwards
    /// is refused at recovery instead of being cut as a torn tail (an acknowledged vote-counting
    /// entry silently lost).
    #[test]
    fn acknowledged_entries_survive_kill_9_and_are_below_the_durable_end() {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "log_store::tests::kill9_child_appends_then_waits",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KILL9_DIR, dir.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut acknowledged = None;
        for line in stdout.lines() {
            let line = line.unwrap();
            if let Some(i) = line.strip_prefix("appended ") {
                acknowledged = Some(i.parse::<u64>().unwrap());
                if acknowledged == Some(KILL9_ENTRIES - 1) {
                    break;
                }
            }
        }
        assert_eq!(
            acknowledged,
            Some(KILL9_ENTRIES - 1),
            "the child stopped early"
        );
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let segment = std::fs::read_dir(dir.path().join("log"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .max()
            .unwrap();
        // Where the last entry ends (a clean reopen writes an end marker after it).
        let len = std::fs::metadata(&segment).unwrap().len();

        {
            let (wal, recovered) = Wal::open(dir.path(), options()).unwrap();
            assert_eq!(
                recovered.metadata.durable_end, KILL9_ENTRIES,
                "every acknowledged entry is below the durable end"
            );
            assert_eq!(wal.next_lsn(), KILL9_ENTRIES);
        }
        let all = LogStore::open(dir.path())
            .unwrap()
            .read(0..KILL9_ENTRIES + 1)
            .unwrap();
        assert_eq!(
            ids(&all),
            (0..KILL9_ENTRIES).map(|i| (1, i)).collect::<Vec<_>>()
        );

        // Lose the end of the last acknowledged entry: refused, naming the durable end.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&segment)
            .unwrap()
            // The 4-byte end marker and the last 4 bytes of the last entry (24 bytes long).
            .set_len(len - 8)
            .unwrap();
        let err = LogStore::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("durable end"), "{err}");
    }

    /// What the log should hold: the terms of the entries after the last purged one, the last
    /// purged log id, the vote and the committed log id last saved.
    #[derive(Debug, Default)]
    struct Model {
        entries: std::collections::BTreeMap<u64, u64>,
        purged: Option<(u64, u64)>,
        vote: Option<Vote>,
        committed: Option<LogId>,
        /// The highest term written: a leader's entries replace only entries of lower terms.
        term: u64,
    }

    impl Model {
        fn first(&self) -> u64 {
            self.purged.map_or(0, |(_, i)| i + 1)
        }

        fn next(&self) -> u64 {
            self.entries
                .last_key_value()
                .map_or(self.first(), |(&i, _)| i + 1)
        }

        /// Where an append or a truncation may start: committed entries are never replaced.
        fn replaceable(&self) -> u64 {
            self.committed.map_or(0, |c| c.index + 1).max(self.first())
        }

        fn last_log_id(&self) -> Option<LogId> {
            match self.entries.last_key_value() {
                Some((&i, &t)) => Some(log_id(t, i)),
                None => self.purged.map(|(t, i)| log_id(t, i)),
            }
        }
    }

    /// One storage call as openraft makes them; the numbers pick positions relative to the log
    /// as it is when the call is made.
    #[derive(Debug, Clone)]
    enum Op {
        Append { at: u8, count: u8, bump: u8 },
        Truncate { at: u8 },
        Purge { at: u8, past: u8 },
        Committed { at: u8 },
        Vote { bump: u8 },
        Reopen,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (any::<u8>(), 1..6u8, 0..2u8).prop_map(|(at, count, bump)| Op::Append { at, count, bump }),
            1 => any::<u8>().prop_map(|at| Op::Truncate { at }),
            1 => (any::<u8>(), 0..4u8).prop_map(|(at, past)| Op::Purge { at, past }),
            1 => any::<u8>().prop_map(|at| Op::Committed { at }),
            1 => (0..2u8).prop_map(|bump| Op::Vote { bump }),
            2 => Just(Op::Reopen),
        ]
    }

    /// Small segments, so that purges delete segments and truncations cross them.
    fn small_segments() -> WalOptions {
        WalOptions {
            segment_soft_limit_bytes: 128,
            segment_hard_limit_bytes: 256,
            ..options()
        }
    }

    async fn run(dir: &Path, ops: &[Op]) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prop_assert_eq;
        let mut store = LogStore::open_with(dir, small_segments()).unwrap();
        let mut model = Model::default();
        for op in ops {
            match *op {
                Op::Append { at, count, bump } => {
                    // From below the first entry (covered by the purge, skipped) to the end.
                    let low = match model.purged {
                        Some(_) if model.committed.is_none_or(|c| c.index < model.first()) => {
                            model.first().saturating_sub(2)
                        }
                        _ => model.replaceable(),
                    };
                    let start = low + u64::from(at) % (model.next() - low + 1);
                    let term = match model.purged {
                        Some((t, i)) if start <= i => t,
                        _ if start < model.next() => model.term.max(1) + 1,
                        _ => model.term.max(1) + u64::from(bump),
                    };
                    model.term = model.term.max(term);
                    let batch: Vec<Entry> = (start..start + u64::from(count))
                        .map(|i| entry(term, i))
                        .collect();
                    store.inner().append(&batch).unwrap();
                    // What the purge covers is not written; the rest replaces the suffix.
                    let written = start.max(model.first())..start + u64::from(count);
                    if !written.is_empty() {
                        model.entries.split_off(&written.start);
                        model.entries.extend(written.map(|i| (i, term)));
                    }
                }
                Op::Truncate { at } => {
                    let first = model.replaceable();
                    if model.next() <= first {
                        continue;
                    }
                    let from = first + u64::from(at) % (model.next() - first);
                    let term = model.entries[&from];
                    store.truncate(log_id(term, from)).await.unwrap();
                    model.entries.split_off(&from);
                }
                Op::Purge { at, past } => {
                    let first = model.first();
                    let end = model.next() + u64::from(past);
                    if end == first {
                        continue;
                    }
                    let upto = first + u64::from(at) % (end - first);
                    let term = match model.entries.get(&upto) {
                        Some(&t) => t,
                        // Past the end: a snapshot installed from a leader.
                        None => model.term.max(1) + u64::from(past % 2),
                    };
                    model.term = model.term.max(term);
                    store.purge(log_id(term, upto)).await.unwrap();
                    model.entries = model.entries.split_off(&(upto + 1));
                    model.purged = Some((term, upto));
                }
                Op::Committed { at } => {
                    let Some((&last, _)) = model.entries.last_key_value() else {
                        continue;
                    };
                    let index = model
                        .committed
                        .map_or(model.first(), |c| c.index.max(model.first()));
                    if index > last {
                        continue;
                    }
                    let index = index + u64::from(at) % (last - index + 1);
                    let committed = Some(log_id(model.entries[&index], index));
                    store.save_committed(committed).await.unwrap();
                    model.committed = committed;
                }
                Op::Vote { bump } => {
                    let term = model.vote.map_or(1, |v| v.leader_id.term + u64::from(bump));
                    let vote = if bump == 0 {
                        Vote::new_committed(term, 1)
                    } else {
                        Vote::new(term, 2)
                    };
                    store.save_vote(&vote).await.unwrap();
                    model.vote = Some(vote);
                }
                Op::Reopen => {
                    drop(store);
                    store = LogStore::open_with(dir, small_segments()).unwrap();
                    // The committed log id is a hint written now and then: never ahead of what
                    // was saved; what a restart starts from.
                    let committed = store.read_committed().await.unwrap();
                    proptest::prop_assert!(
                        committed <= model.committed,
                        "{committed:?} > {:?}",
                        model.committed
                    );
                    model.committed = committed;
                }
            }
            let state = store.get_log_state().await.unwrap();
            prop_assert_eq!(
                state.last_purged_log_id,
                model.purged.map(|(t, i)| log_id(t, i)),
                "after {:?}",
                op
            );
            prop_assert_eq!(state.last_log_id, model.last_log_id(), "after {:?}", op);
            let all = store.try_get_log_entries(..).await.unwrap();
            let want: Vec<(u64, u64)> = model.entries.iter().map(|(&i, &t)| (t, i)).collect();
            prop_assert_eq!(ids(&all), want, "after {:?}", op);
            prop_assert_eq!(store.read_vote().await.unwrap(), model.vote);
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

        /// Whatever sequence of appends, truncations, purges, votes and restarts openraft makes,
        /// the log reports after a restart exactly what it acknowledged before: no entry lost,
        /// none come back, the last log id never below the last purged one (a follower whose
        /// log reverts trips the leader's "follower log reversion" assertion).
        #[test]
        fn the_log_state_survives_any_sequence_of_calls_and_reopens(ops in proptest::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(run(dir.path(), &ops))?;
        }
    }

    #[test]
    fn a_journal_of_an_earlier_build_is_refused_not_ignored() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(OLD_JOURNAL), b"old").unwrap();
        let err = LogStore::open(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("raft.journal") && err.contains("earlier"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_vote_for_a_node_id_the_file_cannot_hold_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(dir.path()).unwrap();
        let err = store
            .save_vote(&Vote::new(1, MAX_NODE_ID + 1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("voted-for field"), "{err}");
        store.save_vote(&Vote::new(1, MAX_NODE_ID)).await.unwrap();
        assert_eq!(
            store.read_vote().await.unwrap(),
            Some(Vote::new(1, MAX_NODE_ID))
        );
    }
}
