//! The broker's session journal over its own write-ahead log, `<data-dir>/sessions/` (same
//! `mqstate-wal` layout as the state store's log, independent LSNs and snapshots).
//!
//! [`SessionLog::record`] encodes the changes (under the caller's session lock, so records keep
//! the order of the changes) and hands them to one appender task, which appends them in that order
//! and tells each caller when its record is durable. Every `snapshot_threshold_bytes` of records the
//! appender writes a snapshot: it appends an empty checkpoint record, takes the broker's image, and
//! installs the image as a snapshot at the checkpoint's LSN. Changes made while the image is taken
//! land after the checkpoint and replay harmlessly over it (`mqstate_broker::persist`).
//!
//! A failed write (disk full, I/O error) puts the log in its failed state: it refuses records
//! (their callers get the error, so nothing unpersisted is acknowledged) until a retry cuts it back
//! to its last good record. The appender owns that recovery: told of a failure, it retries at once
//! and then every [`RETRY_INTERVAL`] until the disk works again, whether or not records arrive.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use mqstate_broker::persist::{decode_changes, encode_changes};
use mqstate_broker::{Broker, Durable, JournalError, Restored, SessionChange, SessionJournal};
use mqstate_wal::{PendingCommit, Snapshot, Wal, WalError, WalOptions, WalStats, WalWriter};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Directory of the session log under the data directory.
pub const SESSIONS_DIR: &str = "sessions";
/// How often a failed log is asked to recover.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

enum Command {
    Append {
        data: Bytes,
        done: oneshot::Sender<Result<PendingCommit, WalError>>,
    },
    /// A commit failed: the log refuses records until a retry succeeds.
    Failed,
    /// Flush and stop; answers when everything before it is durable.
    Close { done: oneshot::Sender<()> },
}

/// The journal the broker records into.
pub struct SessionLog {
    tx: mpsc::UnboundedSender<Command>,
}

/// The appender side, started once the broker exists ([`Appender::run`]).
pub struct Appender {
    rx: mpsc::UnboundedReceiver<Command>,
    /// For the snapshot task to report a failed checkpoint (weak: it must not keep the log open).
    tx: mpsc::WeakUnboundedSender<Command>,
    wal: WalWriter,
    snapshot_threshold_bytes: u64,
    logged_since_snapshot: u64,
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
) -> anyhow::Result<(Restored, SessionLog, Appender)> {
    let path = dir(data_dir);
    let (wal, recovered) = Wal::open(&path, options)
        .with_context(|| format!("cannot open the session log {}", path.display()))?;
    let mut restored = Restored::default();
    if let Some(snapshot) = &recovered.snapshot {
        let image = decode_changes(&snapshot.state).with_context(|| {
            format!(
                "the session snapshot in {} does not decode; run `mqstate data verify {}`",
                path.display(),
                data_dir.display()
            )
        })?;
        for change in image {
            restored.apply(change);
        }
    }
    let mut logged = 0u64;
    for entry in recovered.records {
        let entry = entry.with_context(|| {
            format!(
                "cannot read the session log {}; run `mqstate data verify {}`",
                path.display(),
                data_dir.display()
            )
        })?;
        let changes = decode_changes(&entry.data).with_context(|| {
            format!(
                "session log record {} in {} does not decode; run `mqstate data verify {}`, then \
                 `mqstate data repair {}` to cut the session log before it",
                entry.lsn,
                path.display(),
                data_dir.display(),
                data_dir.display()
            )
        })?;
        for change in changes {
            restored.apply(change);
        }
        logged += entry.data.len() as u64;
    }
    let wal = WalWriter::spawn(wal).context("cannot start the session log writer")?;
    let (tx, rx) = mpsc::unbounded_channel();
    let appender = Appender {
        rx,
        tx: tx.downgrade(),
        wal,
        snapshot_threshold_bytes,
        logged_since_snapshot: logged,
    };
    Ok((restored, SessionLog { tx }, appender))
}

impl Appender {
    /// The session log writer's counters (for metrics).
    pub fn wal_stats(&self) -> Arc<WalStats> {
        Arc::clone(self.wal.stats())
    }
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
        let tx = self.tx.clone();
        Box::pin(async move {
            let closed = || JournalError("the session log is closed".into());
            if !queued {
                return Err(closed());
            }
            let pending = rx.await.map_err(|_| closed())?;
            let result = match pending {
                Ok(pending) => pending.await,
                Err(error) => Err(error),
            };
            result.map(drop).map_err(|error| {
                let _ = tx.send(Command::Failed);
                JournalError(error.to_string())
            })
        })
    }
}

impl Appender {
    /// Appends records in order until the log is closed; snapshots `broker` as the log grows, and
    /// brings the log back after a failed write.
    pub async fn run(mut self, broker: Broker) {
        let wal = Arc::new(self.wal);
        let mut snapshot: Option<JoinHandle<()>> = None;
        // While the log is failed: when to ask it to recover next.
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let command = tokio::select! {
                command = self.rx.recv() => command,
                () = sleep_until(retry_at), if retry_at.is_some() => {
                    retry_at = retry(&wal, &**broker.clock()).await;
                    continue;
                }
            };
            let Some(command) = command else { break };
            match command {
                Command::Append { data, done } => {
                    self.logged_since_snapshot += data.len() as u64;
                    let _ = done.send(wal.append(0, data).await);
                    let idle = snapshot.as_ref().is_none_or(JoinHandle::is_finished);
                    if idle && self.logged_since_snapshot >= self.snapshot_threshold_bytes {
                        self.logged_since_snapshot = 0;
                        snapshot = start_snapshot(&wal, &broker, self.tx.clone()).await;
                    }
                }
                // Records queued behind the failed one are refused by the log in order, so
                // retrying right away cannot let a later record in before an earlier failed one.
                Command::Failed if retry_at.is_none() => {
                    retry_at = retry(&wal, &**broker.clock()).await
                }
                Command::Failed => {}
                Command::Close { done } => {
                    if let Some(running) = snapshot.take() {
                        let _ = running.await;
                    }
                    match Arc::try_unwrap(wal) {
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
}

/// Asks the failed log to recover; returns when to try again if it cannot yet.
async fn retry(wal: &WalWriter, clock: &dyn mqstate_broker::Clock) -> Option<tokio::time::Instant> {
    match wal.retry().await {
        Ok(()) => None,
        Err(error) => {
            tracing::error!(%error, "the session log refuses records until the disk works again");
            Some(clock.tokio_now() + RETRY_INTERVAL)
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

/// Appends a checkpoint, takes the broker's image and installs it as a snapshot at the checkpoint
/// in the background (appends go on meanwhile).
async fn start_snapshot(
    wal: &Arc<WalWriter>,
    broker: &Broker,
    failed: mpsc::WeakUnboundedSender<Command>,
) -> Option<JoinHandle<()>> {
    let checkpoint = match wal.append(0, encode_changes(&[])).await {
        Ok(pending) => pending,
        Err(error) => {
            tracing::error!(%error, "session log snapshot skipped");
            return None;
        }
    };
    // Everything recorded before the checkpoint is in the image: it was recorded (under its lock)
    // before the appender took the checkpoint, so before the image is taken.
    let image = broker.journal_image();
    let changes = image.len();
    let state = encode_changes(&image);
    let wal = Arc::clone(wal);
    Some(tokio::spawn(async move {
        let result = async {
            let last_index = checkpoint.await?;
            wal.install_snapshot(Snapshot {
                last_index,
                last_term: 0,
                state,
            })
            .await?;
            Ok::<_, WalError>(last_index)
        }
        .await;
        match result {
            Ok(last_index) => tracing::info!(last_index, changes, "session log snapshot written"),
            Err(error) => {
                tracing::error!(%error, "session log snapshot failed");
                if let Some(tx) = failed.upgrade() {
                    let _ = tx.send(Command::Failed);
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use mqstate_broker::BrokerConfig;
    use mqstate_wal::failpoint::AFTER_WRITE_BEFORE_FSYNC;
    use mqstate_wal::{FailAction, Failpoints};

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
        let ids: Vec<&str> = restored.sessions.keys().map(|id| &**id).collect();
        assert_eq!(ids, ["after", "before"]);
    }
}
