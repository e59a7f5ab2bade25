//! The broker's session journal over its own write-ahead log, `<data-dir>/sessions/` (same
//! `mqstate-wal` layout as the state store's log, independent LSNs and snapshots).
//!
//! [`SessionLog::record`] encodes the changes (under the caller's session lock, so records keep
//! the order of the changes) and hands them to one appender task, which appends them in that order
//! and tells each caller when its record is durable. Every `snapshot_threshold_bytes` of records the
//! appender writes a snapshot: it appends an empty checkpoint record, takes the broker's image, and
//! installs the image as a snapshot at the checkpoint's LSN. Changes made while the image is taken
//! land after the checkpoint and replay harmlessly over it (`mqstate_broker::persist`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use mqstate_broker::persist::{decode_changes, encode_changes};
use mqstate_broker::{Broker, Durable, JournalError, Restored, SessionChange, SessionJournal};
use mqstate_wal::{PendingCommit, Snapshot, Wal, WalError, WalOptions, WalStats, WalWriter};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Directory of the session log under the data directory.
pub const SESSIONS_DIR: &str = "sessions";
/// A failed log is asked to recover at most this often.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

enum Command {
    Append {
        data: Bytes,
        done: oneshot::Sender<Result<PendingCommit, WalError>>,
    },
    /// A commit failed: cut the log back so that later records can be written.
    Retry,
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
                path.display()
            )
        })?;
        for change in image {
            restored.apply(change);
        }
    }
    let mut logged = 0u64;
    for entry in &recovered.records {
        let changes = decode_changes(&entry.data).with_context(|| {
            format!(
                "session log record {} in {} does not decode",
                entry.lsn,
                path.display()
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
                let _ = tx.send(Command::Retry);
                JournalError(error.to_string())
            })
        })
    }
}

impl Appender {
    /// Appends records in order until the log is closed; snapshots `broker` as the log grows.
    pub async fn run(mut self, broker: Broker) {
        let wal = Arc::new(self.wal);
        let mut snapshot: Option<JoinHandle<()>> = None;
        let mut last_retry: Option<Instant> = None;
        while let Some(command) = self.rx.recv().await {
            match command {
                Command::Append { data, done } => {
                    self.logged_since_snapshot += data.len() as u64;
                    let _ = done.send(wal.append(0, data).await);
                    let idle = snapshot.as_ref().is_none_or(JoinHandle::is_finished);
                    if idle && self.logged_since_snapshot >= self.snapshot_threshold_bytes {
                        self.logged_since_snapshot = 0;
                        snapshot = start_snapshot(&wal, &broker).await;
                    }
                }
                Command::Retry => {
                    if last_retry.is_none_or(|at| at.elapsed() >= RETRY_INTERVAL) {
                        last_retry = Some(Instant::now());
                        if let Err(error) = wal.retry().await {
                            tracing::error!(%error, "the session log cannot recover yet");
                        }
                    }
                }
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

/// Appends a checkpoint, takes the broker's image and installs it as a snapshot at the checkpoint
/// in the background (appends go on meanwhile).
async fn start_snapshot(wal: &Arc<WalWriter>, broker: &Broker) -> Option<JoinHandle<()>> {
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
            Err(error) => tracing::error!(%error, "session log snapshot failed"),
        }
    }))
}
