//! openraft's log storage over the [`Journal`].

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};

use crate::journal::{Journal, JournalError};
use crate::types::{storage_error, Entry, LogId, StorageError, TypeConfig, Vote};

/// The Raft log of this node. Clones share the journal (the reader openraft asks for is a clone).
#[derive(Debug, Clone)]
pub struct LogStore {
    journal: Arc<Mutex<Journal>>,
}

impl LogStore {
    pub fn open(dir: &std::path::Path) -> Result<LogStore, JournalError> {
        Ok(LogStore {
            journal: Arc::new(Mutex::new(Journal::open(dir)?)),
        })
    }

    fn journal(&self) -> MutexGuard<'_, Journal> {
        // A panic while holding the lock cannot leave the journal half-applied (memory is changed
        // only after the write succeeded), so a poisoned lock is still usable.
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self.journal().entries(range))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let journal = self.journal();
        Ok(LogState {
            last_purged_log_id: journal.last_purged(),
            last_log_id: journal.last_log_id(),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.journal()
            .save_vote(*vote)
            .map_err(storage_error::write_vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        Ok(self.journal().vote())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.journal()
            .save_committed(committed)
            .map_err(storage_error::write_logs)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.journal().committed())
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
        if entries.is_empty() {
            callback.log_io_completed(Ok(()));
            return Ok(());
        }
        // Synchronous: the control plane appends rarely and small, and the fsync is done when
        // `append` returns, which is what the callback reports.
        match self.journal().append(entries) {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(storage_error::write_logs(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.journal()
            .truncate_from(log_id.index)
            .map_err(storage_error::write_logs)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.journal()
            .purge_up_to(log_id)
            .map_err(storage_error::write_logs)
    }
}
