//! The writer in the caller ([`crate::WalOptions::inline`]): no thread of its own. Each command is
//! queued as for the writer thread and carried out at once by the task that queued it, with the
//! thread's own code ([`super::carry_out`]): an append is written and fsynced before
//! [`WalWriter::append`] returns, so its [`PendingCommit`] is ready. No durable-mark thread: the
//! durable end is recorded at rotation, snapshot and shutdown. For the deterministic simulation,
//! where work on other threads would run outside simulated time.

use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::mpsc;

use super::{carry_out, Command, WalWriter};
use crate::log::Wal;

pub(super) struct Inline(Mutex<State>);

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

/// A [`WalWriter`] that writes in its caller.
pub(super) fn writer(wal: Wal) -> WalWriter {
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
        inline: Some(Inline(Mutex::new(State {
            wal,
            rx,
            deferred: None,
            last_sync: Instant::now(),
        }))),
    }
}

impl Inline {
    /// Carries out every command queued, in order, as the writer thread would.
    pub(super) fn pump(&self) {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let State {
            wal,
            rx,
            deferred,
            last_sync,
        } = &mut *state;
        while let Some(command) = deferred.take().or_else(|| rx.try_recv().ok()) {
            // After a shutdown nothing more is queued: the handle is consumed by it.
            let _ = carry_out(wal, rx, command, deferred, last_sync);
        }
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
