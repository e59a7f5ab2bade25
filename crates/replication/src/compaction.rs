//! Compaction of the chain log: once `snapshot_threshold_bytes` were logged since the last
//! snapshot, the driver hands the [`Compactor`] every replica's image ([`mqstate_chain::Replica::image`],
//! and what the log restored for replicas not created yet) between two turns, when each image is
//! exactly what the records appended so far fold to. The snapshot covers those records: it is
//! written (by `mqstate-wal`'s snapshot machinery, as the state store's) only once they are all
//! fsynced — a snapshot never holds a row the log did not make durable — and the segments it covers
//! are then purged. At start the log reads the snapshot and folds the records after it
//! ([`crate::log::ChainLog::open`]).
//!
//! The image is cloned in the driver and encoded on a blocking thread, whole in memory (rows are
//! the store's records; a streamed encoding like the state store's is future work).

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use mqstate_chain::Restored;
use mqstate_wal::snapshot::Snapshot;
use mqstate_wal::{Lsn, WalWriter};
use tokio::task::JoinHandle;

/// Longest a closing log waits for a snapshot under way.
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The snapshot's state: each partition's image (postcard).
pub fn encode(images: &BTreeMap<u32, Restored>) -> Vec<u8> {
    // Encoding into a Vec fails only for types postcard cannot express; ours are plain data.
    postcard::to_allocvec(images).unwrap_or_default()
}

/// The images a snapshot holds.
pub fn decode(state: &[u8]) -> Result<BTreeMap<u32, Restored>, String> {
    postcard::from_bytes(state).map_err(|e| e.to_string())
}

/// Takes the snapshots of one node's chain log, one at a time.
pub struct Compactor {
    threshold: u64,
    running: Option<JoinHandle<()>>,
}

impl Compactor {
    /// Snapshots once `threshold` bytes were logged since the last one.
    pub fn new(threshold: u64) -> Compactor {
        Compactor {
            threshold: threshold.max(1),
            running: None,
        }
    }

    /// Whether a snapshot should begin, `logged` bytes after the last one began.
    pub fn due(&self, logged: u64) -> bool {
        logged >= self.threshold && self.running.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Begins a snapshot of `images`, which must be what every record of `wal` up to `upto` folds
    /// to.
    pub fn start(&mut self, wal: Arc<WalWriter>, upto: Lsn, images: BTreeMap<u32, Restored>) {
        self.running = Some(tokio::spawn(snapshot(wal, upto, images)));
    }

    /// Waits for a snapshot under way, so the log can close: it completes, or is abandoned after
    /// [`STOP_WAIT`] (its records never became durable: a failing disk). An abandoned snapshot
    /// leaves at most its temporary file; the previous snapshot and the log stay valid.
    pub async fn stop(&mut self) {
        if let Some(mut task) = self.running.take() {
            if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
                tracing::warn!(
                    "the chain log's snapshot did not complete in {STOP_WAIT:?}; abandoned"
                );
                task.abort();
                let _ = task.await;
            }
        }
    }
}

async fn snapshot(wal: Arc<WalWriter>, upto: Lsn, images: BTreeMap<u32, Restored>) {
    // Every record the images hold must be durable before a snapshot stands for them.
    let mut durable = wal.reader().durable();
    while *durable.borrow_and_update() <= upto {
        if durable.changed().await.is_err() {
            return;
        }
    }
    let rows: usize = images.values().map(|image| image.rows.len()).sum();
    let Ok(state) = tokio::task::spawn_blocking(move || encode(&images)).await else {
        return;
    };
    let bytes = state.len();
    let snapshot = Snapshot {
        last_index: upto,
        last_term: 0,
        state: Bytes::from(state),
    };
    match wal.install_snapshot(snapshot).await {
        Ok(()) => tracing::debug!(upto, rows, bytes, "chain log snapshot written, log purged"),
        Err(e) => tracing::warn!(
            upto,
            "the chain log's snapshot failed (the log is kept): {e}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::ChainLog;
    use mqstate_chain::{Record, Row, Version};
    use mqstate_wal::WalOptions;

    fn row(v: u64) -> Row {
        Row {
            value: Some(vec![v as u8; 40]),
            version: Version {
                wall_ms: v,
                counter: 0,
                node: 1,
            },
            view: 1,
            locked: v.is_multiple_of(3),
        }
    }

    /// What the records of `batches` fold to.
    fn fold(batches: &[(u32, Vec<Record>)]) -> BTreeMap<u32, Restored> {
        let mut images: BTreeMap<u32, Restored> = BTreeMap::new();
        for (partition, records) in batches {
            for record in records {
                images.entry(*partition).or_default().apply(record.clone());
            }
        }
        images
    }

    fn segments(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir.join("chains").join("log"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn a_reopened_log_is_its_snapshot_and_the_tail_and_the_covered_segments_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let options = || WalOptions {
            segment_soft_limit_bytes: 1024,
            preallocate_segments: false,
            ..WalOptions::default()
        };
        let mut batches = Vec::new();
        let write = |n: u64| -> (u32, Vec<Record>) {
            let partition = (n % 4) as u32;
            let mut records = vec![Record::Row {
                key: format!("k{}", n % 50).into_bytes(),
                row: row(n),
            }];
            if n == 120 {
                records.insert(0, Record::Clear { view: 7 });
            }
            if n == 160 {
                records.push(Record::CaughtUp { view: 7 });
            }
            (partition, records)
        };
        {
            let (log, restored) = ChainLog::open(dir.path(), options(), 1_000).unwrap();
            let mut log = log.snapshot_every(2048);
            assert!(restored.is_empty());
            for n in 1..=200 {
                let (partition, records) = write(n);
                batches.push((partition, records.clone()));
                let commit = log.append(partition, records).await.unwrap();
                if n != 150 {
                    // One at a time, so that segments fill and rotate.
                    commit.await.unwrap();
                } else {
                    let segments_before = segments(dir.path());
                    assert!(log.snapshot_due());
                    log.snapshot(fold(&batches));
                    assert!(
                        !log.snapshot_due(),
                        "one at a time, and the count starts over"
                    );
                    // Written only once its records are durable: wait for them, then for it.
                    commit.await.unwrap();
                    log.wait_for_snapshot().await;
                    assert!(
                        segments(dir.path()) < segments_before,
                        "segments covered by the snapshot are purged: {} before, {} after",
                        segments_before,
                        segments(dir.path())
                    );
                }
            }
            log.shutdown().await;
        }
        assert!(dir.path().join("chains").join("mqstate.snapshot").exists());
        let (log, restored) = ChainLog::open(dir.path(), options(), 1_000).unwrap();
        assert_eq!(restored, fold(&batches));
        assert_eq!(restored[&0].joining_since, Some(7));
        assert_eq!(restored[&0].caught_up_view, Some(7));
        log.shutdown().await;
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode(&[0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
        let images = BTreeMap::from([(3, Restored::default())]);
        assert_eq!(decode(&encode(&images)).unwrap(), images);
    }
}
