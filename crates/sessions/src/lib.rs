//! mqstate-sessions: the broker's session journal over its own write-ahead log,
//! `<data-dir>/sessions/` (same `mqstate-wal` layout as the state store's log, independent LSNs and
//! snapshots). The broker knows only its `SessionJournal` port; this crate is the one that knows
//! both it and the log.
//!
//! [`SessionLog::record`] encodes the changes (under the caller's session lock, so records keep
//! the order of the changes) and hands them to one appender task, which appends them in that order
//! to its [`DurableLog`] and tells each caller when its record is durable. Every
//! `snapshot_threshold_bytes` of records the appender writes a snapshot: it appends an empty
//! checkpoint record, takes the broker's image, and installs the image as a snapshot at the
//! checkpoint's LSN. Changes made while the image is taken land after the checkpoint and replay
//! harmlessly over it (`mqstate_broker::persist`).
//!
//! A failed write (disk full, I/O error) degrades the log: it refuses records (their callers get
//! the error, so nothing unpersisted is acknowledged) until a retry cuts it back to its last good
//! record. The appender owns that recovery: told of a failure, it retries at once and then every
//! [`RETRY_INTERVAL`](mqstate_wal::durable::RETRY_INTERVAL) until the disk works again, whether or not records arrive. Nothing is rolled
//! back in memory: the broker's state stays ahead of the disk, and the callers that were refused
//! know it.

pub mod replicated;
pub mod row;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use mqstate_broker::persist::{decode_changes, encode_changes, DecodeError};
use mqstate_broker::{Broker, Durable, JournalError, Restored, SessionChange, SessionJournal};
use mqstate_wal::durable::sleep_until;
use mqstate_wal::{
    Commit, DurableLog, Lsn, Settler, Snapshot, SnapshotSchedule, Wal, WalError, WalOptions,
    WalStats, WalWriter,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Directory of the session log under the data directory.
pub const SESSIONS_DIR: &str = "sessions";

/// Why the session log could not be recovered; each names the log and the way out.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("cannot open the session log {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: WalError,
    },
    #[error("the session snapshot in {} does not decode; run `mqstate data verify {}`", path.display(), data_dir.display())]
    Snapshot {
        path: PathBuf,
        data_dir: PathBuf,
        #[source]
        source: DecodeError,
    },
    #[error("cannot read the session log {}; run `mqstate data verify {}`", path.display(), data_dir.display())]
    Read {
        path: PathBuf,
        data_dir: PathBuf,
        #[source]
        source: WalError,
    },
    #[error(
        "session log record {lsn} in {} does not decode; run `mqstate data verify {}`, then \
         `mqstate data repair {}` to cut the session log before it",
        path.display(), data_dir.display(), data_dir.display()
    )]
    Record {
        lsn: Lsn,
        path: PathBuf,
        data_dir: PathBuf,
        #[source]
        source: DecodeError,
    },
    #[error("cannot start the session log writer")]
    Writer(#[source] WalError),
}

enum Command {
    Append {
        data: Bytes,
        done: oneshot::Sender<Result<Commit, WalError>>,
    },
    /// Flush and stop; answers when everything before it is durable.
    Close { done: oneshot::Sender<()> },
}

/// The journal the broker records into.
pub struct SessionLog {
    tx: mpsc::UnboundedSender<Command>,
    settler: Settler,
}

/// The appender side, started once the broker exists ([`Appender::run`]).
pub struct Appender {
    rx: mpsc::UnboundedReceiver<Command>,
    /// Nothing to undo: the broker's state is not rolled back.
    log: DurableLog<()>,
}

/// The session log path under `data_dir`.
pub fn dir(data_dir: &Path) -> PathBuf {
    data_dir.join(SESSIONS_DIR)
}

/// Opens (creating if needed) `<data-dir>/sessions/` and reads back its snapshot and records.
pub fn recover(
    data_dir: &Path,
    options: WalOptions,
    snapshot_threshold_bytes: u64,
) -> Result<(Restored, SessionLog, Appender), RecoverError> {
    let path = dir(data_dir);
    let (wal, recovered) = Wal::open(&path, options).map_err(|source| RecoverError::Open {
        path: path.clone(),
        source,
    })?;
    let mut restored = Restored::default();
    let mut next_lsn = 0;
    if let Some(snapshot) = &recovered.snapshot {
        let image = decode_changes(&snapshot.state).map_err(|source| RecoverError::Snapshot {
            path: path.clone(),
            data_dir: data_dir.to_path_buf(),
            source,
        })?;
        for change in image {
            restored.apply(change);
        }
        next_lsn = snapshot.last_index + 1;
    }
    let mut logged = 0u64;
    for entry in recovered.records {
        let entry = entry.map_err(|source| RecoverError::Read {
            path: path.clone(),
            data_dir: data_dir.to_path_buf(),
            source,
        })?;
        let changes = decode_changes(&entry.data).map_err(|source| RecoverError::Record {
            lsn: entry.lsn,
            path: path.clone(),
            data_dir: data_dir.to_path_buf(),
            source,
        })?;
        for change in changes {
            restored.apply(change);
        }
        logged += entry.data.len() as u64;
        next_lsn = entry.lsn + 1;
    }
    debug_assert_eq!(next_lsn.max(recovered.replay.start), recovered.replay.end);
    let wal = WalWriter::spawn(wal).map_err(RecoverError::Writer)?;
    let log = DurableLog::new(
        "sessions",
        Arc::new(wal),
        recovered.replay.end,
        SnapshotSchedule::new(snapshot_threshold_bytes, logged),
    );
    let (tx, rx) = mpsc::unbounded_channel();
    let session_log = SessionLog {
        tx,
        settler: log.settler(),
    };
    Ok((restored, session_log, Appender { rx, log }))
}

impl SessionLog {
    /// Writes everything recorded so far, fsyncs and stops the appender.
    pub async fn close(&self) {
        let (done, rx) = oneshot::channel();
        if self.tx.send(Command::Close { done }).is_ok() {
            let _ = rx.await;
        }
    }
}

impl SessionJournal for SessionLog {
    fn record(&self, changes: Vec<SessionChange>) -> Durable {
        let data = encode_changes(&changes);
        let (done, rx) = oneshot::channel();
        let queued = self.tx.send(Command::Append { data, done }).is_ok();
        let settler = self.settler.clone();
        Box::pin(async move {
            let closed = || JournalError("the session log is closed".into());
            if !queued {
                return Err(closed());
            }
            let commit = rx
                .await
                .map_err(|_| closed())?
                .map_err(|error| JournalError(error.to_string()))?;
            // A failure is reported to the appender, which recovers the log.
            settler
                .settle(commit)
                .await
                .map(drop)
                .map_err(|failed| JournalError(failed.error.to_string()))
        })
    }
}

/// What a record gets while the log is degraded.
fn refused() -> WalError {
    WalError::Failed {
        cause: "an earlier session log write failed and the log has not recovered yet".into(),
    }
}

impl Appender {
    /// The session log writer's counters (for metrics).
    pub fn wal_stats(&self) -> Arc<WalStats> {
        Arc::clone(self.log.wal().stats())
    }

    /// Appends records in order until the log is closed; snapshots `broker` as the log grows, and
    /// brings the log back after a failed write.
    pub async fn run(mut self, broker: Broker) {
        let mut snapshot: Option<JoinHandle<()>> = None;
        // The node's clock (the broker's): retry deadlines follow it, paused test time included.
        let clock = broker.clock().clone();
        loop {
            let retry_at = self
                .log
                .health()
                .retry_at()
                .map(tokio::time::Instant::from_std);
            let command = tokio::select! {
                command = self.rx.recv() => command,
                // Records queued behind the failed one are refused by the writer in order, so
                // retrying right away cannot let a later record in before an earlier failed one.
                Some(epoch) = self.log.next_failure() => {
                    if self.log.roll_back(epoch, clock.now()).is_some() {
                        let _ = self.log.recover(clock.now()).await;
                    }
                    continue;
                }
                () = sleep_until(retry_at), if retry_at.is_some() => {
                    let _ = self.log.recover(clock.now()).await;
                    continue;
                }
            };
            let Some(command) = command else { break };
            match command {
                Command::Append { data, done } => {
                    if self.log.health().is_degraded() {
                        let _ = done.send(Err(refused()));
                        continue;
                    }
                    let _ = done.send(self.log.append(data).await);
                    let idle = snapshot.as_ref().is_none_or(JoinHandle::is_finished);
                    if idle && self.log.snapshot_due() {
                        self.log.snapshot_started();
                        snapshot = self.start_snapshot(&broker).await;
                    }
                }
                Command::Close { done } => {
                    if let Some(running) = snapshot.take() {
                        let _ = running.await;
                    }
                    match Arc::try_unwrap(self.log.into_wal()) {
                        Ok(wal) => {
                            if let Err(error) = wal.shutdown().await {
                                tracing::error!(%error, "the session log could not be flushed");
                            }
                        }
                        Err(_) => tracing::warn!("session log still shared at shutdown"),
                    }
                    let _ = done.send(());
                    return;
                }
            }
        }
    }

    /// Appends a checkpoint, takes the broker's image and installs it as a snapshot at the
    /// checkpoint in the background (appends go on meanwhile).
    async fn start_snapshot(&mut self, broker: &Broker) -> Option<JoinHandle<()>> {
        let checkpoint = match self.log.append(encode_changes(&[])).await {
            Ok(commit) => commit,
            Err(error) => {
                tracing::error!(%error, "session log snapshot skipped");
                return None;
            }
        };
        // Everything recorded before the checkpoint is in the image: it was recorded (under its
        // lock) before the appender took the checkpoint, so before the image is taken.
        let image = broker.journal_image();
        let changes = image.len();
        let state = encode_changes(&image);
        let wal = Arc::clone(self.log.wal());
        let settler = self.log.settler();
        Some(tokio::spawn(async move {
            // A failed checkpoint is reported to the appender like any failed record.
            let last_index = match settler.settle(checkpoint).await {
                Ok(lsn) => lsn,
                Err(failed) => {
                    return tracing::error!(error = %failed.error, "session log snapshot failed")
                }
            };
            let snapshot = Snapshot {
                last_index,
                last_term: 0,
                state,
            };
            match wal.install_snapshot(snapshot).await {
                Ok(()) => tracing::info!(last_index, changes, "session log snapshot written"),
                Err(error) => tracing::error!(%error, "session log snapshot failed"),
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use mqstate_broker::BrokerConfig;
    use mqstate_wal::durable::RETRY_INTERVAL;
    use mqstate_wal::failpoint::AFTER_WRITE_BEFORE_FSYNC;
    use mqstate_wal::{read_snapshot, DataDir, FailAction, Failpoints};

    use super::*;

    /// A log whose fsyncs fail while `failing` is set.
    fn failing_options(failing: &Arc<AtomicBool>) -> WalOptions {
        let failing = Arc::clone(failing);
        WalOptions {
            failpoints: Failpoints::with_hook(move |name| {
                if name == AFTER_WRITE_BEFORE_FSYNC && failing.load(Ordering::SeqCst) {
                    FailAction::Error
                } else {
                    FailAction::Continue
                }
            }),
            ..WalOptions::default()
        }
    }

    fn created(client_id: &str) -> SessionChange {
        SessionChange::Created {
            client_id: client_id.into(),
            expiry_secs: 60,
        }
    }

    fn client_ids(restored: &Restored) -> Vec<&str> {
        restored.sessions.keys().map(|id| &**id).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovers_after_a_failed_write_and_keeps_only_what_it_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        let (_, log, appender) = recover(dir.path(), failing_options(&failing), u64::MAX).unwrap();
        let broker = Broker::builder(BrokerConfig::default()).build();
        let running = tokio::spawn(appender.run(broker));

        log.record(vec![created("before")]).await.unwrap();
        failing.store(true, Ordering::SeqCst);
        assert!(log.record(vec![created("lost-1")]).await.is_err());
        // Still failing: the appender's own retries fail too and nothing is acknowledged.
        tokio::time::sleep(RETRY_INTERVAL * 2).await;
        assert!(log.record(vec![created("lost-2")]).await.is_err());
        tokio::time::sleep(RETRY_INTERVAL / 4).await;
        failing.store(false, Ordering::SeqCst);
        // The disk works again: the log recovers without further failed records driving it.
        tokio::time::sleep(RETRY_INTERVAL * 2).await;
        log.record(vec![created("after")]).await.unwrap();
        log.close().await;
        running.await.unwrap();

        let (restored, _, _) = recover(dir.path(), WalOptions::default(), u64::MAX).unwrap();
        assert_eq!(client_ids(&restored), ["after", "before"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_at_the_threshold_holds_the_brokers_image() {
        let data_dir = tempfile::tempdir().unwrap();
        let (_, log, appender) = recover(data_dir.path(), WalOptions::default(), 1).unwrap();
        let broker = Broker::builder(BrokerConfig::default()).build();
        let running = tokio::spawn(appender.run(broker));
        log.record(vec![created("a")]).await.unwrap();
        log.close().await;
        running.await.unwrap();

        let snapshot = read_snapshot(&DataDir::new(dir(data_dir.path()))).unwrap();
        let snapshot = snapshot.expect("a snapshot once the threshold was logged");
        assert_eq!(snapshot.last_index, 1, "at the checkpoint after the record");
        // The image is the broker's (no sessions: it recorded none itself); the record before
        // the checkpoint was purged with its segment or stays below the snapshot, not replayed.
        let (restored, _, _) = recover(data_dir.path(), WalOptions::default(), u64::MAX).unwrap();
        assert!(client_ids(&restored).is_empty());
    }
}
