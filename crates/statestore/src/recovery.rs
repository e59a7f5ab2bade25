//! The state store at start: open the log, decode the snapshot, replay the records after it, and
//! resume the clock at the ceiling in the metadata file (decision 0012), with a new ceiling above it
//! on disk before anything is handed out. The requests the snapshot and the replayed records carry
//! (decision 0034) are gathered for the duplicate cache ([`RecoveredRequests`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mqstate_protocol::Hlc;
use mqstate_store::{Change, StateMachine, StoreConfig, StoreError};
use mqstate_wal::{Lsn, Metadata, Wal, WalError, WalOptions, WalWriter};

use crate::dedup::{RecoveredRequests, DEFAULT_MAX_ENTRIES};
use crate::service::{next_clock_ceiling, Recovered};

/// Why the data directory could not be recovered; each names the directory and the way out.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error("cannot open the data directory {}", dir.display())]
    Open {
        dir: PathBuf,
        #[source]
        source: WalError,
    },
    #[error("invalid state store configuration")]
    Config(#[source] StoreError),
    #[error("the snapshot in {} does not decode; run `mqstate data verify {}`", dir.display(), dir.display())]
    Snapshot {
        dir: PathBuf,
        #[source]
        source: StoreError,
    },
    #[error("cannot read the log in {}; run `mqstate data verify {}`", dir.display(), dir.display())]
    Read {
        dir: PathBuf,
        #[source]
        source: WalError,
    },
    #[error("log record {lsn} in {} does not decode as a state change", dir.display())]
    Record {
        lsn: Lsn,
        dir: PathBuf,
        #[source]
        source: StoreError,
    },
    #[error("cannot record the clock ceiling in {}", dir.display())]
    Ceiling {
        dir: PathBuf,
        #[source]
        source: WalError,
    },
    #[error("cannot start the log writer")]
    Writer(#[source] WalError),
}

/// Records decoded per batch handed from the reader thread to the replaying one, and how many
/// batches it may be ahead: bounded, so a long log tail is never held decoded all at once.
const REPLAY_BATCH: usize = 1024;
const REPLAY_QUEUE_BATCHES: usize = 8;

/// A log record read, checked and decoded, waiting to be applied.
struct Replayed {
    lsn: Lsn,
    bytes: usize,
    change: Change,
}

/// Reads the records after the snapshot in order and decodes them, a batch at a time, into
/// `batches`; stops at the first error (sent as the last item) or once the receiver is gone.
fn read_and_decode(
    entries: mqstate_wal::Entries,
    dir: &Path,
    batches: &std::sync::mpsc::SyncSender<Result<Vec<Replayed>, RecoveryError>>,
) {
    let mut batch = Vec::with_capacity(REPLAY_BATCH);
    for entry in entries {
        let decoded = entry
            .map_err(|source| RecoveryError::Read {
                dir: dir.to_path_buf(),
                source,
            })
            .and_then(|entry| {
                let change =
                    Change::decode(&entry.data).map_err(|source| RecoveryError::Record {
                        lsn: entry.lsn,
                        dir: dir.to_path_buf(),
                        source,
                    })?;
                Ok(Replayed {
                    lsn: entry.lsn,
                    bytes: entry.data.len(),
                    change,
                })
            });
        match decoded {
            Ok(replayed) => batch.push(replayed),
            Err(error) => {
                let _ = batches.send(Err(error));
                return;
            }
        }
        if batch.len() == REPLAY_BATCH {
            let full = std::mem::replace(&mut batch, Vec::with_capacity(REPLAY_BATCH));
            if batches.send(Ok(full)).is_err() {
                return;
            }
        }
    }
    if !batch.is_empty() {
        let _ = batches.send(Ok(batch));
    }
}

/// What recovery did, for the log line and the metrics.
#[derive(Debug, Clone, Copy)]
pub struct RecoveryReport {
    /// Records replayed after the snapshot.
    pub records: usize,
    pub replayed_bytes: usize,
    pub elapsed: Duration,
}

/// Opens the data directory `dir` and rebuilds the state machine from the snapshot and the log
/// after it, with its clock resumed at the ceiling in the metadata file (no timestamp handed out
/// before the restart is handed out again) and a new ceiling above it and `now_ms` persisted.
/// Returns the state with its log writer started, and the requests that have not expired at
/// `now_ms` (the newest [`DEFAULT_MAX_ENTRIES`]).
pub fn recover(
    dir: &Path,
    options: WalOptions,
    store: StoreConfig,
    now_ms: u64,
) -> Result<(Recovered, RecoveryReport), RecoveryError> {
    let started = Instant::now();
    let at = || dir.to_path_buf();
    let (wal, recovered) =
        Wal::open(dir, options).map_err(|source| RecoveryError::Open { dir: at(), source })?;
    let mqstate_wal::Recovered {
        metadata: found_metadata,
        snapshot,
        records: entries,
        replay,
    } = recovered;
    let node_id = Arc::clone(&store.node_id);
    let mut requests = RecoveredRequests::new(DEFAULT_MAX_ENTRIES, now_ms);
    let mut replayed_bytes = 0usize;
    let mut records = 0usize;
    // Two halves that each take a core's worth of CPU at a large restart: decoding the snapshot
    // into the keyspace, and reading, checksumming and decoding the log after it. The second runs
    // on its own thread, a bounded number of batches ahead, while this one decodes the snapshot
    // and then applies the batches in log order.
    let (batches, decoded) =
        std::sync::mpsc::sync_channel::<Result<Vec<Replayed>, RecoveryError>>(REPLAY_QUEUE_BATCHES);
    let (mut machine, next_lsn) = std::thread::scope(|scope| {
        scope.spawn(move || read_and_decode(entries, dir, &batches));
        let (mut machine, mut next_lsn) = match &snapshot {
            Some(snapshot) => {
                let (machine, in_snapshot) =
                    StateMachine::snapshot_decode_with_requests(&snapshot.state, store)
                        .map_err(|source| RecoveryError::Snapshot { dir: at(), source })?;
                in_snapshot.into_iter().for_each(|r| requests.add(r));
                (machine, snapshot.last_index + 1)
            }
            None => (StateMachine::new(store).map_err(RecoveryError::Config)?, 0),
        };
        // Dropping `decoded` on an early return ends the reader at its next send.
        for batch in decoded {
            for Replayed { lsn, bytes, change } in batch? {
                debug_assert!(lsn >= next_lsn, "records are replayed in log order");
                machine.apply_change(&requests.replayed(change));
                replayed_bytes += bytes;
                records += 1;
                next_lsn = lsn + 1;
            }
        }
        Ok::<_, RecoveryError>((machine, next_lsn))
    })?;
    debug_assert_eq!(next_lsn.max(replay.start), replay.end);
    // Resume at the old ceiling (above everything handed out before) and persist a new one above
    // it before anything is handed out. Failpoints stand for crashes of a serving process, not of
    // this step: a crash here leaves the old file, and nothing was handed out.
    machine.observe_clock(&Hlc::new(found_metadata.hlc_high_water_ms, 0, node_id));
    let metadata = Metadata {
        hlc_high_water_ms: next_clock_ceiling(machine.clock().high_water().wall_ms, now_ms),
        ..found_metadata
    };
    wal.write_metadata(&metadata)
        .map_err(|source| RecoveryError::Ceiling { dir: at(), source })?;
    let report = RecoveryReport {
        records,
        replayed_bytes,
        elapsed: started.elapsed(),
    };
    tracing::info!(
        keys = machine.keyspace().len(),
        records,
        replayed_mb_per_s = (replayed_bytes as f64 / 1e6) / report.elapsed.as_secs_f64().max(1e-9),
        elapsed_ms = report.elapsed.as_millis() as u64,
        "state recovered"
    );
    let wal = WalWriter::spawn(wal).map_err(RecoveryError::Writer)?;
    let recovered = Recovered {
        machine,
        wal: Arc::new(wal),
        next_lsn,
        metadata,
        requests,
    };
    Ok((recovered, report))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use mqstate_store::{Delta, Limits};
    use mqstate_wal::{read_metadata, DataDir, Snapshot};

    use super::*;
    use crate::service::CLOCK_CEILING_LEASE_MS;

    const NOW_MS: u64 = 1_700_000_000_000;

    fn config() -> StoreConfig {
        StoreConfig {
            node_id: "mqstate".into(),
            limits: Limits::default(),
        }
    }

    fn put(key: &str, wall_ms: u64) -> Delta {
        Delta::Put {
            key: Bytes::copy_from_slice(key.as_bytes()),
            value: Bytes::from_static(b"v"),
            version: Hlc::new(wall_ms, 0, "mqstate".into()),
            fencing_token: None,
            expires_at_ms: None,
        }
    }

    /// Writes `records` to the log in `dir` (and a snapshot of the first `snapshot_after` of them).
    fn write_log(dir: &Path, records: &[Vec<u8>], snapshot_after: Option<usize>) {
        let (mut wal, _) = Wal::open(dir, WalOptions::default()).unwrap();
        let mut machine = StateMachine::new(config()).unwrap();
        for (i, record) in records.iter().enumerate() {
            wal.write_batch([(0, &record[..])]).unwrap();
            wal.sync().unwrap();
            if let Ok(change) = Change::decode(record) {
                machine.apply_change(&change);
            }
            if snapshot_after == Some(i + 1) {
                let state = Bytes::from(machine.snapshot_encode().unwrap());
                wal.install_snapshot(&Snapshot {
                    last_index: i as u64,
                    last_term: 0,
                    state,
                })
                .unwrap();
            }
        }
    }

    async fn stop(recovered: Recovered) {
        Arc::try_unwrap(recovered.wal)
            .unwrap()
            .shutdown()
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_new_directory_starts_empty_with_a_ceiling_ahead_of_the_wall_clock() {
        let dir = tempfile::tempdir().unwrap();
        let (recovered, report) =
            recover(dir.path(), WalOptions::default(), config(), NOW_MS).unwrap();
        assert_eq!(recovered.machine.keyspace().len(), 0);
        assert_eq!((recovered.next_lsn, report.records), (0, 0));
        let ceiling = NOW_MS + CLOCK_CEILING_LEASE_MS;
        assert_eq!(recovered.metadata.hlc_high_water_ms, ceiling);
        let on_disk = read_metadata(&DataDir::new(dir.path())).unwrap().unwrap();
        assert_eq!(on_disk.hlc_high_water_ms, ceiling);
        stop(recovered).await;
    }

    #[tokio::test]
    async fn replays_the_records_after_the_snapshot_and_resumes_at_the_old_ceiling() {
        let dir = tempfile::tempdir().unwrap();
        let records: Vec<Vec<u8>> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, key)| put(key, NOW_MS + i as u64).encode().unwrap())
            .collect();
        write_log(dir.path(), &records, Some(2));
        // A ceiling far ahead of every version and of the wall clock: the clock resumes there.
        let (recovered, _) = recover(dir.path(), WalOptions::default(), config(), NOW_MS).unwrap();
        let old_ceiling = recovered.metadata.hlc_high_water_ms;
        stop(recovered).await;

        let (recovered, report) =
            recover(dir.path(), WalOptions::default(), config(), NOW_MS).unwrap();
        assert_eq!(recovered.machine.keyspace().len(), 3);
        assert_eq!(
            report.records, 1,
            "only the record after the snapshot is replayed"
        );
        assert_eq!(recovered.next_lsn, 3);
        assert!(recovered.machine.clock().high_water().wall_ms >= old_ceiling);
        assert_eq!(
            recovered.metadata.hlc_high_water_ms,
            old_ceiling + CLOCK_CEILING_LEASE_MS
        );
        stop(recovered).await;
    }

    #[tokio::test]
    async fn the_requests_of_replayed_records_are_recovered_unless_expired() {
        let dir = tempfile::tempdir().unwrap();
        let requested = |correlation: &'static [u8], expires_at_ms| {
            let change = Change::Key(put("k", NOW_MS));
            mqstate_store::RequestRecord {
                id: mqstate_store::RequestId::of("c", correlation),
                expires_at_ms,
                reply: Bytes::from_static(b"+OK\r\n"),
                reply_ts: None,
            }
            .encode_with(&change.encode().unwrap(), change.key_version().unwrap())
            .unwrap()
        };
        let records = [
            requested(b"live", NOW_MS + 1_000),
            requested(b"expired", NOW_MS - 1),
            put("plain", NOW_MS).encode().unwrap(),
        ];
        write_log(dir.path(), &records, None);
        let (recovered, report) =
            recover(dir.path(), WalOptions::default(), config(), NOW_MS).unwrap();
        assert_eq!(report.records, 3);
        assert_eq!(recovered.machine.keyspace().len(), 2);
        assert_eq!(recovered.requests.len(), 1, "only the live request");
        stop(recovered).await;
    }

    #[test]
    fn a_record_that_does_not_decode_is_named_by_its_lsn() {
        let dir = tempfile::tempdir().unwrap();
        let good = put("a", NOW_MS).encode().unwrap();
        write_log(dir.path(), &[good, b"not a change".to_vec()], None);
        let error = recover(dir.path(), WalOptions::default(), config(), NOW_MS)
            .err()
            .unwrap();
        assert!(
            matches!(error, RecoveryError::Record { lsn: 1, .. }),
            "{error}"
        );
        assert!(error.to_string().starts_with("log record 1 in "), "{error}");
    }
}
