//! A snapshot streamed to its file while the executor encodes it (decision 0014): each chunk goes
//! to a background task that appends it to `temp/mqstate.snapshot` ([`SnapshotWriter`]), so the
//! encoded state is never whole in memory. The file is completed and renamed into place only when
//! the completer seals it ([`SnapshotSeal::commit`]) — once every record the snapshot may reflect is
//! durable; dropping the stream or the seal abandons it and the previous snapshot stays.
//! Public for `examples/snapshot_rss.rs`, which measures this path's memory.

use std::sync::Arc;
use std::time::Instant;

use mqstate_store::snapshot::RequestsEncoder;
use mqstate_store::StatePatch;
use mqstate_wal::{LogId, SnapshotWriter, WalError, WalWriter};
use tokio::sync::{mpsc, oneshot};

use crate::metrics;

/// Chunks on their way to the file: with chunks of at most [`super::SNAPSHOT_CHUNK_BYTES`] (plus one
/// key), a few megabytes at most. A slow disk pauses encoding, not requests.
pub const SNAPSHOT_CHUNKS_QUEUED: usize = 8;

const WHAT: &str = "the snapshot being written";

/// The task writing the file stopped: the file failed (the task reported it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// The executor's end: where the chunks go.
pub struct SnapshotStream {
    chunks: mpsc::Sender<Vec<u8>>,
    seal: oneshot::Sender<Sealed>,
}

/// Encodes the next batch of the requests that end the state into the encoder, from after a cursor
/// (`None`: from the first); returns the cursor of the next batch, `None` at the end. Called on the
/// writing thread, so the requests are never gathered whole.
pub type RequestBatches = Box<dyn FnMut(&mut RequestsEncoder, Option<u64>) -> Option<u64> + Send>;

/// The end of the state, known once its records are durable.
struct Sealed {
    /// The last part of the state: the requests.
    requests: RequestBatches,
    /// The fields of bytes already written known only at the end.
    patches: Vec<StatePatch>,
}

/// The completer's end: completes the file once the records it may reflect are durable.
pub struct SnapshotSeal(oneshot::Sender<Sealed>);

impl SnapshotSeal {
    /// Appends the requests, patches the fields known only at the end, then completes the file
    /// (fsync, rename, purge) in the background.
    pub fn commit(self, requests: RequestBatches, patches: Vec<StatePatch>) {
        // The task is gone only if the file already failed; it said so.
        let _ = self.0.send(Sealed { requests, patches });
    }
}

/// Starts the file of a snapshot of the state with every record up to `last_index` applied.
pub fn start(wal: &Arc<WalWriter>, last_index: u64) -> SnapshotStream {
    let (chunks, rx) = mpsc::channel(SNAPSHOT_CHUNKS_QUEUED);
    let (seal, sealed) = oneshot::channel();
    let wal = Arc::clone(wal);
    let upto = LogId {
        index: last_index,
        term: 0,
    };
    tokio::spawn(async move {
        // A metrics timer (the `write` phase), not a time the service acts on.
        let started = Instant::now();
        let written = wal
            .install_streamed_snapshot(upto, move |file| feed(file, rx, sealed))
            .await;
        match written {
            Ok(()) => {
                metrics::snapshot_phase("write", started.elapsed());
                metrics::snapshot_finished(true);
                tracing::info!(last_index, "snapshot written");
            }
            // Counted and logged where it was abandoned.
            Err(WalError::Abandoned { .. }) => {}
            Err(e) => {
                metrics::snapshot_finished(false);
                tracing::error!(last_index, "snapshot failed: {e}");
            }
        }
    });
    SnapshotStream { chunks, seal }
}

/// Writes the chunks to `file` as they come, then the seal's requests a batch at a time and its
/// patches; `Abandoned` if the stream or the seal was dropped first (the file is then left
/// unfinished under `temp/`).
fn feed(
    file: &mut SnapshotWriter,
    mut chunks: mpsc::Receiver<Vec<u8>>,
    sealed: oneshot::Receiver<Sealed>,
) -> Result<(), WalError> {
    while let Some(chunk) = chunks.blocking_recv() {
        file.write(&chunk)?;
    }
    let Sealed {
        mut requests,
        patches,
    } = sealed
        .blocking_recv()
        .map_err(|_| WalError::Abandoned { what: WHAT })?;
    let requests_at = file.state_len();
    let mut encoder = RequestsEncoder::default();
    let mut cursor = None;
    loop {
        cursor = requests(&mut encoder, cursor);
        file.write(&encoder.take_encoded())?;
        if cursor.is_none() {
            break;
        }
    }
    let (rest, count) = encoder
        .finish_streamed(requests_at)
        .map_err(|_| WalError::TooLarge {
            what: "snapshot request list",
            len: usize::MAX,
            max: i32::MAX as usize,
        })?;
    file.write(&rest)?;
    for patch in patches.iter().chain([&count]) {
        file.patch(patch.offset, &patch.bytes)?;
    }
    Ok(())
}

impl SnapshotStream {
    /// Whether a chunk can be queued now, or the writing task stopped (then [`SnapshotStream::push`]
    /// says so, and the snapshot is dropped rather than waited on).
    pub fn has_room(&self) -> bool {
        self.chunks.capacity() > 0 || self.chunks.is_closed()
    }

    /// Resolves when a chunk can be queued (at once if it can), or the writing task stopped.
    pub async fn room(&self) {
        if !self.has_room() {
            // The permit is released at once: the executor is the only sender, so the room stays.
            let _ = self.chunks.reserve().await;
        }
    }

    /// Queues the next chunk. Call only when [`SnapshotStream::has_room`]; `Err` when the writing
    /// task stopped (the file failed, already reported).
    pub fn push(&self, chunk: Vec<u8>) -> Result<(), Stopped> {
        if chunk.is_empty() {
            return Ok(());
        }
        debug_assert!(self.has_room(), "a chunk is pushed only when it fits");
        // Full cannot happen: the executor is the only sender and checked for room.
        self.chunks.try_send(chunk).map_err(|_| Stopped)
    }

    /// Queues a chunk, waiting for room: for the last one, after which there is nothing to encode.
    pub async fn push_waiting(&self, chunk: Vec<u8>) -> Result<(), Stopped> {
        if chunk.is_empty() {
            return Ok(());
        }
        self.chunks.send(chunk).await.map_err(|_| Stopped)
    }

    /// Every chunk has been pushed: what is left is to seal the file.
    pub fn end(self) -> SnapshotSeal {
        SnapshotSeal(self.seal)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use mqstate_store::snapshot::encode_requests;
    use mqstate_store::RequestRecord;
    use mqstate_wal::{read_snapshot, DataDir, Wal, WalOptions};

    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    /// A log with records 0 and 1.
    async fn log(dir: &std::path::Path) -> Arc<WalWriter> {
        let (wal, _) = Wal::open(dir, WalOptions::default()).unwrap();
        let writer = WalWriter::spawn(wal).unwrap();
        for data in [&b"a"[..], b"b"] {
            writer
                .append(0, Bytes::from_static(data))
                .await
                .unwrap()
                .await
                .unwrap();
        }
        Arc::new(writer)
    }

    fn no_requests() -> RequestBatches {
        Box::new(|_, _| None)
    }

    async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        tokio::time::timeout(WAIT, async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: not in time"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_become_the_snapshot_only_once_sealed() {
        let tmp = tempfile::tempdir().unwrap();
        let wal = log(tmp.path()).await;
        let dir = DataDir::new(tmp.path());
        let stream = start(&wal, 0);
        for chunk in [&b"xx--"[..], b"ab", b""] {
            stream.room().await;
            stream.push(chunk.to_vec()).unwrap();
        }
        stream.push_waiting(b"cd".to_vec()).await.unwrap();
        let seal = stream.end();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(read_snapshot(&dir).unwrap(), None, "not before the seal");
        let patches = vec![StatePatch {
            offset: 0,
            bytes: b"st".to_vec(),
        }];
        seal.commit(no_requests(), patches);
        eventually("the snapshot", || wal.reader().last_purged().is_some()).await;
        let snapshot = read_snapshot(&dir).unwrap().unwrap();
        assert_eq!(
            (snapshot.last_index, &snapshot.state[..]),
            (0, &b"st--abcd\0\0\0\0"[..])
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_requests_end_the_state_a_batch_at_a_time() {
        let tmp = tempfile::tempdir().unwrap();
        let wal = log(tmp.path()).await;
        let requests: Vec<RequestRecord> = (0..5u8)
            .map(|i| RequestRecord {
                id: mqstate_store::RequestId::of("c", &[i]),
                expires_at_ms: 9,
                reply: Bytes::from_static(b"+OK\r\n"),
                reply_ts: None,
            })
            .collect();
        let stream = start(&wal, 0);
        stream.push(b"keys".to_vec()).unwrap();
        let batches = requests.clone();
        // Two a batch, the cursor being the index of the next.
        let next_batch: RequestBatches = Box::new(move |encoder, after| {
            let from = after.map_or(0, |a| a as usize);
            for request in batches.iter().skip(from).take(2) {
                encoder.push(request).unwrap();
            }
            (from + 2 < batches.len()).then_some(from as u64 + 2)
        });
        stream.end().commit(next_batch, Vec::new());
        eventually("the snapshot", || wal.reader().last_purged().is_some()).await;
        let snapshot = read_snapshot(&DataDir::new(tmp.path())).unwrap().unwrap();
        let mut expected = b"keys".to_vec();
        expected.extend(encode_requests(&requests).unwrap());
        assert_eq!(&snapshot.state[..], &expected[..]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_seal_abandons_the_file_and_keeps_the_old_snapshot() {
        let tmp = tempfile::tempdir().unwrap();
        let wal = log(tmp.path()).await;
        let stream = start(&wal, 1);
        stream.push(b"state".to_vec()).unwrap();
        drop(stream.end());
        // A later snapshot is written: the abandoned one released the one-at-a-time lock.
        let next = start(&wal, 0);
        next.push(b"next".to_vec()).unwrap();
        next.end().commit(no_requests(), Vec::new());
        eventually("the next snapshot", || wal.reader().last_purged().is_some()).await;
        let snapshot = read_snapshot(&DataDir::new(tmp.path())).unwrap().unwrap();
        assert_eq!(
            (snapshot.last_index, &snapshot.state[..]),
            (0, &b"next\0\0\0\0"[..])
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_stream_whose_file_failed_refuses_chunks_instead_of_waiting() {
        let tmp = tempfile::tempdir().unwrap();
        let wal = log(tmp.path()).await;
        // `first` holds the one-at-a-time lock (its file takes chunks), so `second`'s chunks stay
        // queued until it is full.
        let first = start(&wal, 0);
        first.push(b"first".to_vec()).unwrap();
        eventually("the first file", || {
            first.chunks.capacity() == SNAPSHOT_CHUNKS_QUEUED
        })
        .await;
        let second = start(&wal, 0);
        for _ in 0..SNAPSHOT_CHUNKS_QUEUED {
            second.push(b"chunk".to_vec()).unwrap();
        }
        assert!(!second.has_room());
        // Then its temp file cannot be created.
        std::fs::remove_dir_all(tmp.path().join("temp")).unwrap();
        drop(first);
        eventually("the task's end", || second.chunks.is_closed()).await;
        assert!(second.has_room(), "the executor must not wait on it");
        second.room().await;
        assert!(second.push(b"chunk".to_vec()).is_err());
        assert_eq!(wal.reader().last_purged(), None);
    }
}
