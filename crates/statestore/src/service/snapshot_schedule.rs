//! The snapshot schedule: once enough was logged since the last snapshot ([`DurableLog`]), the
//! executor encodes one a chunk at a time between requests (decision 0014) and queues it behind the
//! records it may reflect; the completer writes it in the background once they are all durable.
//!
//! [`DurableLog`]: mqstate_wal::DurableLog

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mqstate_store::{Progress, SnapshotEncoder};
use mqstate_wal::{Lsn, Snapshot, WalWriter};

use super::completer::Outcome;
use super::Executor;
use crate::metrics;

/// A snapshot being encoded between requests (decision 0014).
pub(super) struct SnapshotInProgress {
    encoder: SnapshotEncoder,
    /// The last record logged when encoding started: replay resumes after it.
    last_index: u64,
    /// Executor time spent encoding, over all chunks.
    encoding: Duration,
    chunks: u32,
}

/// Keys encoded per executor turn. A chunk of 1,024 small keys takes a few hundred microseconds, so a
/// request waits at most that long behind one, and a million keys need a thousand turns.
pub const SNAPSHOT_CHUNK_KEYS: usize = 1024;
/// Encoded bytes after which a chunk ends early, so large values do not make a chunk slow.
pub const SNAPSHOT_CHUNK_BYTES: usize = 256 * 1024;

impl Executor {
    /// Starts a snapshot once enough was logged since the last one, and encodes the next chunk of
    /// the one in progress; when it is complete, queues it behind the records it may reflect.
    pub(super) async fn advance_snapshot(&mut self) {
        let Some(mut progress) = self.snapshot.take().or_else(|| self.start_snapshot()) else {
            return;
        };
        let started = Instant::now();
        let stepped =
            progress
                .encoder
                .step(&self.machine, SNAPSHOT_CHUNK_KEYS, SNAPSHOT_CHUNK_BYTES);
        progress.encoding += started.elapsed();
        progress.chunks += 1;
        let finished = match stepped {
            Ok(Progress::Continue) => {
                self.snapshot = Some(progress);
                return;
            }
            Ok(Progress::Done) => progress.encoder.finish(&self.machine),
            Err(e) => Err(e),
        };
        let state = match finished {
            Ok(state) => state,
            Err(e) => {
                metrics::snapshot_finished(false);
                return tracing::error!("snapshot not taken: {e}");
            }
        };
        metrics::snapshot_phase("encode", progress.encoding);
        tracing::debug!(
            last_index = progress.last_index,
            chunks = progress.chunks,
            encoding_ms = progress.encoding.as_millis() as u64,
            "snapshot encoded"
        );
        let snapshot = Snapshot {
            last_index: progress.last_index,
            last_term: 0,
            state: Bytes::from(state),
        };
        let reflects_below = self.log.next_lsn();
        self.send(Outcome::Snapshot(PendingSnapshot {
            snapshot,
            reflects_below,
        }))
        .await;
    }

    fn start_snapshot(&mut self) -> Option<SnapshotInProgress> {
        if !self.log.snapshot_due() {
            return None;
        }
        self.log.snapshot_started();
        match SnapshotEncoder::new(&self.machine) {
            Ok(encoder) => Some(SnapshotInProgress {
                encoder,
                last_index: self.log.next_lsn() - 1,
                encoding: Duration::ZERO,
                chunks: 0,
            }),
            Err(e) => {
                metrics::snapshot_finished(false);
                tracing::error!("snapshot not taken: {e}");
                None
            }
        }
    }

    /// A failed commit: the snapshot in progress may hold rolled-back writes, and the LSNs it was
    /// started at are handed out again.
    pub(super) fn abandon_snapshot(&mut self) {
        if self.snapshot.take().is_some() {
            metrics::snapshot_finished(false);
            tracing::warn!("snapshot in progress abandoned after the log write failure");
        }
    }
}

/// An encoded snapshot on its way to the completer.
pub(super) struct PendingSnapshot {
    snapshot: Snapshot,
    /// The snapshot may reflect every record below this LSN: unless all of them became durable,
    /// it is not written.
    reflects_below: Lsn,
}

/// The completer's hand-off: writes `pending` in the background (appends and completions go on
/// meanwhile) if every record it may reflect is below `durable`.
pub(super) fn write_when_durable(wal: &Arc<WalWriter>, pending: PendingSnapshot, durable: Lsn) {
    let PendingSnapshot {
        snapshot,
        reflects_below,
    } = pending;
    if durable < reflects_below {
        metrics::snapshot_finished(false);
        tracing::warn!(
            last_index = snapshot.last_index,
            "snapshot not written: it may hold writes whose log records did not become durable"
        );
        return;
    }
    let wal = Arc::clone(wal);
    tokio::spawn(async move {
        let last_index = snapshot.last_index;
        let started = Instant::now();
        let written = wal.install_snapshot(snapshot).await;
        metrics::snapshot_phase("write", started.elapsed());
        metrics::snapshot_finished(written.is_ok());
        match written {
            Ok(()) => tracing::info!(last_index, "snapshot written"),
            Err(e) => tracing::error!(last_index, "snapshot failed: {e}"),
        }
    });
}
