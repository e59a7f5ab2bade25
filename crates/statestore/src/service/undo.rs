//! What puts the state machine back as it was before a logged record, and the rollback that
//! applies it when a commit fails. The undos themselves are kept by the executor's
//! [`DurableLog`](mqstate_wal::DurableLog) until their records are durable.

use std::sync::Arc;

use mqstate_store::notify::QueueUndo;
use mqstate_store::Delta;

use super::Executor;

/// What restores the state before one logged record.
pub(super) enum Undo {
    Key(Delta),
    Queue(QueueUndo),
    /// A commit: its key change, its queue entries and the reservations it was made under
    /// (topic, id), which were never logged on their own.
    Notified {
        key: Option<Delta>,
        commit: QueueUndo,
        reserved: Vec<(Arc<str>, u64)>,
    },
}

impl Undo {
    /// What takes back an expiry: its key's deletion, and its queue entries if topics watch
    /// expiries (made under no reservation).
    pub(super) fn of_expiry(key: Delta, queued: Option<QueueUndo>) -> Undo {
        match queued {
            Some(commit) => Undo::Notified {
                key: Some(key),
                commit,
                reserved: Vec::new(),
            },
            None => Undo::Key(key),
        }
    }
}

impl Executor {
    pub(super) fn apply_undo(&mut self, undo: Undo) {
        match undo {
            Undo::Key(delta) => self.machine.apply_delta(&delta),
            Undo::Queue(queue) => self.machine.undo_queue(queue),
            Undo::Notified {
                key,
                commit,
                reserved,
            } => {
                self.machine.undo_queue(commit);
                self.machine.undo_queue(QueueUndo::Unreserve(reserved));
                if let Some(delta) = key {
                    self.machine.apply_delta(&delta);
                }
            }
        }
    }

    /// A commit made in `epoch` failed: everything after the last durable record is gone from the
    /// log (the writer cuts it back), so take it out of memory too, newest first. Every commit
    /// behind a failed one fails too; only the first failure of an epoch rolls back, the rest
    /// (computed before that rollback) must not roll back writes made since.
    pub(super) fn roll_back_undurable(&mut self, epoch: u64) {
        let Some(undone) = self.log.roll_back(epoch, self.clock.now()) else {
            return;
        };
        let rolled_back = undone.len();
        for undo in undone {
            self.apply_undo(undo);
        }
        self.abandon_snapshot();
        self.report_keyspace_size();
        tracing::error!(rolled_back, durable_lsn = self.log.next_lsn(), "log write failed: undurable writes rolled back; writes are refused until the log recovers, reads go on");
    }
}
