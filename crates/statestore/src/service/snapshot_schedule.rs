//! The snapshot schedule: once enough was logged since the last snapshot ([`DurableLog`]), the
//! executor encodes one a chunk at a time between requests (decision 0014), each chunk streamed to
//! the snapshot's file as it is encoded ([`snapshot_stream`]), and queues its seal behind the
//! records it may reflect; the completer seals the file in the background once they are all
//! durable, ending it with the identities of the logged requests the duplicate cache holds.
//!
//! [`DurableLog`]: mqstate_wal::DurableLog

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mqstate_broker::{service::Acker, SharedClock};
use mqstate_store::{Progress, SnapshotEncoder, StatePatch};
use mqstate_wal::Lsn;

use super::completer::Outcome;
use super::{snapshot_stream, Executor};
use crate::dedup::DedupCache;
use crate::metrics;

/// A snapshot being encoded between requests (decision 0014).
pub(super) struct SnapshotInProgress {
    encoder: SnapshotEncoder,
    /// Where the encoded chunks go.
    stream: snapshot_stream::SnapshotStream,
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
    /// the one in progress into its file (unless the file is behind); when it is complete, queues
    /// its seal behind the records it may reflect.
    pub(super) async fn advance_snapshot(&mut self) {
        let Some(mut progress) = self.snapshot.take().or_else(|| self.start_snapshot()) else {
            return;
        };
        if !progress.stream.has_room() {
            self.snapshot = Some(progress);
            return;
        }
        // A metrics timer: the executor's time spent encoding.
        let started = Instant::now();
        let stepped =
            progress
                .encoder
                .step(&self.machine, SNAPSHOT_CHUNK_KEYS, SNAPSHOT_CHUNK_BYTES);
        let chunk = progress.encoder.take_encoded();
        progress.encoding += started.elapsed();
        progress.chunks += 1;
        if progress.stream.push(chunk).is_err() {
            // The file failed; its task reported it.
            return;
        }
        let finished = match stepped {
            Ok(Progress::Continue) => {
                self.snapshot = Some(progress);
                return;
            }
            Ok(Progress::Done) => progress.encoder.finish_streamed(&self.machine),
            Err(e) => Err(e),
        };
        let end = match finished {
            Ok(end) => end,
            Err(e) => {
                metrics::snapshot_finished(false);
                return tracing::error!("snapshot not taken: {e}");
            }
        };
        if progress.stream.push_waiting(end.rest).await.is_err() {
            return;
        }
        metrics::snapshot_phase("encode", progress.encoding);
        tracing::debug!(
            last_index = progress.last_index,
            chunks = progress.chunks,
            encoding_ms = progress.encoding.as_millis() as u64,
            "snapshot encoded"
        );
        let reflects_below = self.log.next_lsn();
        self.send(Outcome::Snapshot(PendingSnapshot {
            seal: progress.stream.end(),
            patches: end.patches,
            last_index: progress.last_index,
            reflects_below,
        }))
        .await;
    }

    fn start_snapshot(&mut self) -> Option<SnapshotInProgress> {
        if !self.log.snapshot_due() {
            return None;
        }
        self.log.snapshot_started();
        let last_index = self.log.next_lsn() - 1;
        match SnapshotEncoder::new(&self.machine) {
            Ok(encoder) => Some(SnapshotInProgress {
                encoder,
                stream: snapshot_stream::start(self.log.wal(), last_index),
                last_index,
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
    /// started at are handed out again. Dropping its stream abandons its file.
    pub(super) fn abandon_snapshot(&mut self) {
        if self.snapshot.take().is_some() {
            metrics::snapshot_finished(false);
            tracing::warn!("snapshot in progress abandoned after the log write failure");
        }
    }
}

/// An executor turn for the snapshot in progress: at once (after yielding) if its file can take a
/// chunk, else once it can.
pub(super) async fn turn(snapshot: Option<&SnapshotInProgress>) {
    match snapshot {
        Some(progress) if !progress.stream.has_room() => progress.stream.room().await,
        _ => tokio::task::yield_now().await,
    }
}

/// An encoded snapshot's seal on its way to the completer.
pub(super) struct PendingSnapshot {
    seal: snapshot_stream::SnapshotSeal,
    /// The fields of the state known only at its end.
    patches: Vec<StatePatch>,
    last_index: u64,
    /// The snapshot may reflect every record below this LSN: unless all of them became durable,
    /// it is abandoned.
    reflects_below: Lsn,
}

/// The completer's hand-off: seals the file of `pending` in the background (appends and
/// completions go on meanwhile) if every record it may reflect is below `durable`, ending it with
/// the logged requests of `dedup`; otherwise abandons it.
pub(super) fn write_when_durable(
    pending: PendingSnapshot,
    durable: Lsn,
    dedup: &Arc<Mutex<DedupCache<Acker>>>,
    clock: &SharedClock,
) {
    let PendingSnapshot {
        seal,
        patches,
        last_index,
        reflects_below,
    } = pending;
    if durable < reflects_below {
        metrics::snapshot_finished(false);
        tracing::warn!(
            last_index,
            "snapshot not written: it may hold writes whose log records did not become durable"
        );
        // Dropping the seal abandons the file; the previous snapshot stays.
        return;
    }
    seal.commit(
        logged_requests_of(Arc::clone(dedup), clock.clone()),
        patches,
    );
}

/// Requests of the duplicate cache encoded per batch at the end of a snapshot (the cache is locked
/// for one batch at a time).
const SNAPSHOT_REQUEST_BATCH: usize = 1024;

/// The end of a snapshot's state, encoded a batch at a time on the thread writing it: the requests
/// of the duplicate cache whose changes are logged. Every request whose record the snapshot may hold
/// has completed when the snapshot is sealed (the completer goes in order); later ones are harmless
/// (their records are replayed after the snapshot anyway).
fn logged_requests_of(
    dedup: Arc<Mutex<DedupCache<Acker>>>,
    clock: SharedClock,
) -> snapshot_stream::RequestBatches {
    Box::new(move |encoder, after| {
        dedup
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .for_each_logged_request(
                after,
                SNAPSHOT_REQUEST_BATCH,
                clock.now(),
                clock.now_ms(),
                |request| {
                    if let Err(e) = encoder.push(&request) {
                        tracing::warn!(request = %request.id, "request left out of the snapshot: {e}");
                    }
                },
            )
    })
}
