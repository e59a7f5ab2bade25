//! The writer in the caller ([`Committer::Caller`], [`Committer::Owner`]): no writer thread. Each
//! command is queued as for the writer thread and carried out by the task that queued it, with the
//! thread's own code ([`super::carry_out`]): under `Caller` at once, so an append is written and
//! fsynced before [`WalWriter::append`] returns and its [`PendingCommit`] is ready (no durable-mark
//! thread either: the durable end is recorded at rotation, snapshot and shutdown; for the
//! deterministic simulation, where work on other threads would run outside simulated time); under
//! `Owner` appends wait in the queue for the owner's [`WalWriter::commit_queued`], which writes
//! them as one batch (decision 0069).
//!
//! [`Committer::Caller`]: crate::Committer::Caller
//! [`Committer::Owner`]: crate::Committer::Owner

use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::mpsc;

use super::{carry_out, Command, WalWriter};
use crate::log::Wal;

pub(super) struct Inline {
    state: Mutex<State>,
    /// Appends wait for [`WalWriter::commit_queued`] ([`crate::Committer::Owner`]).
    owned: bool,
}

struct State {
    wal: Wal,
    rx: mpsc::Receiver<Command>,
    deferred: Option<Command>,
    last_sync: Instant,
}

impl std::fmt::Debug for Inline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inline")
    }
}

/// A [`WalWriter`] that writes in its caller; in its owner's [`WalWriter::commit_queued`] when `owned`.
pub(super) fn writer(wal: Wal, owned: bool) -> WalWriter {
    let dir = wal.data_dir().clone();
    let reader = wal.reader();
    let stats = std::sync::Arc::clone(wal.stats());
    let failpoints = wal.options().failpoints.clone();
    let (tx, rx) = mpsc::channel(wal.options().queue_capacity.max(1));
    WalWriter {
        tx,
        stats,
        dir,
        failpoints,
        snapshot_lock: tokio::sync::Mutex::new(()),
        reader,
        thread: None,
        marker: None,
        inline: Some(Inline {
            state: Mutex::new(State {
                wal,
                rx,
                deferred: None,
                last_sync: Instant::now(),
            }),
            owned,
        }),
    }
}

impl Inline {
    /// Carries out every command queued, in order, as the writer thread would.
    pub(super) fn pump(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let State {
            wal,
            rx,
            deferred,
            last_sync,
        } = &mut *state;
        while let Some(command) = deferred.take().or_else(|| rx.try_recv().ok()) {
            // After a shutdown nothing more is queued: the handle is consumed by it.
            let _ = carry_out(wal, rx, command, deferred, last_sync, false);
        }
    }
}

impl Inline {
    /// Whether appends wait for the owner's [`WalWriter::commit_queued`].
    pub(super) fn owned(&self) -> bool {
        self.owned
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // As the thread does once every handle is gone: what was written is flushed.
        if let Err(error) = self.wal.sync().and_then(|()| self.wal.mark_durable()) {
            tracing::error!(%error, "final fsync of the write-ahead log failed");
        }
    }
}
