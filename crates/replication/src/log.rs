//! The replicas' log: one `mqstate-wal` log per node in `<data-dir>/chains/`, each record one
//! `Output::Persist` batch of one partition's replica, tagged with the partition (decision
//! 0035). One log, so one writer thread and one fsync per group commit for
//! every partition this node replicates. The log is compacted by snapshots of the replicas'
//! images ([`crate::compaction`]): at start the snapshot is read, then the records after it folded
//! over it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use mqstate_chain::{Record, Restored};
use mqstate_store::RequestRecord;
use mqstate_wal::{Lsn, PendingCommit, Wal, WalError, WalOptions, WalWriter};
use serde::{Deserialize, Serialize};

use crate::compaction::{Compactor, Contents};
use crate::trail::Trail;

/// The directory under the data directory.
pub const CHAINS_DIR: &str = "chains";

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("cannot open the chain log in {path}: {source}")]
    Open { path: PathBuf, source: WalError },
    #[error("cannot read the chain log in {path}: {source}")]
    Read { path: PathBuf, source: WalError },
    #[error("record {lsn} of the chain log in {path} does not decode: {reason}")]
    Record {
        lsn: u64,
        path: PathBuf,
        reason: String,
    },
    #[error("the chain log's snapshot in {path} does not decode: {reason}")]
    Snapshot { path: PathBuf, reason: String },
    #[error("cannot start the chain log's writer: {0}")]
    Writer(WalError),
}

/// One record: a replica's batch.
#[derive(Debug, Serialize, Deserialize)]
struct Batch {
    partition: u32,
    records: Vec<Record>,
}

/// One record's data: a batch of `partition`'s replica.
pub fn encode_batch(partition: u32, records: Vec<Record>) -> Vec<u8> {
    postcard::to_allocvec(&Batch { partition, records }).unwrap_or_default()
}

/// One record's data as the offline tools read it: the partition and the replica's records.
pub fn decode_batch(data: &[u8]) -> Result<(u32, Vec<Record>), String> {
    postcard::from_bytes::<Batch>(data)
        .map(|batch| (batch.partition, batch.records))
        .map_err(|e| e.to_string())
}

/// The open log.
pub struct ChainLog {
    wal: Arc<WalWriter>,
    /// The LSN the next append gets (the writer numbers appends in the order they are queued).
    next_lsn: Lsn,
    /// Bytes appended since the last snapshot began.
    logged: u64,
    /// Cleared when an append or a commit failed: the log may then hold less than was appended
    /// (and LSNs counted here may be off), so no snapshot is taken until a restart.
    healthy: Arc<AtomicBool>,
    /// Snapshots, once [`ChainLog::snapshot_every`] set a threshold.
    compactor: Option<Compactor>,
    /// The requests the snapshot remembered and those of every row the replay after it folded
    /// (not only each key's last), still live at open, per partition, until
    /// [`ChainLog::take_replayed_requests`] (decision 0050).
    replayed_requests: BTreeMap<u32, Vec<RequestRecord>>,
    /// The recent changes of state-store keys the replay after the snapshot folded, until
    /// [`ChainLog::take_replayed_trail`] (decision 0061).
    replayed_trail: Trail,
}

impl ChainLog {
    /// Opens (creating if needed) `<data-dir>/chains/` and folds every record into its
    /// partition's [`Restored`]; of the requests of the rows it folds, keeps those a retry may
    /// still come for at `now_ms` (the node's clock).
    pub fn open(
        data_dir: &Path,
        options: WalOptions,
        now_ms: u64,
    ) -> Result<(ChainLog, BTreeMap<u32, Restored>), LogError> {
        let path = data_dir.join(CHAINS_DIR);
        let (wal, recovered) = Wal::open(&path, options).map_err(|source| LogError::Open {
            path: path.clone(),
            source,
        })?;
        let snapshot = match &recovered.snapshot {
            Some(snapshot) => {
                crate::compaction::decode(&snapshot.state).map_err(|reason| LogError::Snapshot {
                    path: path.clone(),
                    reason,
                })?
            }
            None => Contents::default(),
        };
        let mut restored = snapshot.images;
        let next_lsn = recovered.replay.end;
        // The snapshot's requests come first: a re-entry in the records after it voids them too.
        let mut replayed_requests: BTreeMap<u32, Vec<RequestRecord>> = snapshot
            .requests
            .into_iter()
            .map(|(partition, mut requests)| {
                requests.retain(|r| crate::recent::is_live(r, now_ms));
                (partition, requests)
            })
            .collect();
        let mut replayed_trail = Trail::default();
        for entry in recovered.records {
            let entry = entry.map_err(|source| LogError::Read {
                path: path.clone(),
                source,
            })?;
            let batch: Batch = postcard::from_bytes(&entry.data).map_err(|e| LogError::Record {
                lsn: entry.lsn,
                path: path.clone(),
                reason: e.to_string(),
            })?;
            // Session rows are no state-store keys (as `TrailNotes::note`).
            if batch.partition & crate::space::SESSIONS == 0 {
                replayed_trail.note_replayed(batch.partition, &batch.records, now_ms);
            }
            let requests = replayed_requests.entry(batch.partition).or_default();
            for record in &batch.records {
                match record {
                    Record::Row { row, .. } => {
                        let request = row.value.as_deref().and_then(crate::recent::request_of);
                        requests.extend(request.filter(|r| crate::recent::is_live(r, now_ms)));
                    }
                    Record::Note { note } => {
                        let request = crate::recent::record_of_note(note);
                        requests.extend(request.filter(|r| crate::recent::is_live(r, now_ms)));
                    }
                    // The re-entry voided the rows before it, and their requests with them.
                    Record::Clear { .. } => requests.clear(),
                    Record::CaughtUp { .. } | Record::Readable => {}
                }
            }
            let partition = restored.entry(batch.partition).or_default();
            for record in batch.records {
                partition.apply(record);
            }
        }
        let wal = WalWriter::spawn(wal).map_err(LogError::Writer)?;
        let log = ChainLog {
            wal: Arc::new(wal),
            next_lsn,
            logged: 0,
            healthy: Arc::new(AtomicBool::new(true)),
            compactor: None,
            replayed_requests,
            replayed_trail,
        };
        Ok((log, restored))
    }

    /// The requests the log remembered at open (its snapshot's, then its rows'), per partition in
    /// log order (once).
    pub fn take_replayed_requests(&mut self) -> BTreeMap<u32, Vec<RequestRecord>> {
        std::mem::take(&mut self.replayed_requests)
    }

    /// The changes of state-store keys the log replayed at open ([`Trail::note_replayed`]), once.
    pub fn take_replayed_trail(&mut self) -> Trail {
        std::mem::take(&mut self.replayed_trail)
    }

    /// Queues one batch of `partition`'s replica; the returned commit resolves once it is durable
    /// (call [`ChainLog::failed`] if it does not). Batches get their place in the log in the order
    /// this is called.
    pub async fn append(
        &mut self,
        partition: u32,
        records: Vec<Record>,
    ) -> Result<PendingCommit, WalError> {
        let data = encode_batch(partition, records);
        self.logged += data.len() as u64;
        match self.wal.append(0, Bytes::from(data)).await {
            Ok(commit) => {
                self.next_lsn += 1;
                Ok(commit)
            }
            Err(e) => {
                self.healthy.store(false, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// A handle to report that a commit failed (see [`ChainLog::append`]).
    pub fn failed(&self) -> impl Fn() + Send + 'static {
        let healthy = Arc::clone(&self.healthy);
        move || healthy.store(false, Ordering::Relaxed)
    }

    /// Compacts the log with a snapshot once it grew by `bytes` since the last one (the server
    /// passes `snapshot_threshold_bytes`, as for its other logs). Without it the log only grows.
    pub fn snapshot_every(mut self, bytes: u64) -> ChainLog {
        self.compactor = Some(Compactor::new(bytes));
        self
    }

    /// Whether a snapshot should begin: enough was logged since the last one, every append and
    /// commit so far succeeded, and no snapshot is under way.
    pub fn snapshot_due(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && self.compactor.as_ref().is_some_and(|c| c.due(self.logged))
    }

    /// Begins a snapshot of `contents`, whose images must be what every batch appended so far
    /// folds to, partition by partition (each replica's [`mqstate_chain::Replica::image`]), and
    /// whose requests are those this node remembers. It is written once those batches are
    /// durable, then the log it covers is purged.
    pub fn snapshot(&mut self, contents: Contents) {
        let (Some(compactor), Some(last)) = (&mut self.compactor, self.next_lsn.checked_sub(1))
        else {
            return;
        };
        self.logged = 0;
        compactor.start(Arc::clone(&self.wal), last, contents);
    }

    /// Returns once no snapshot is under way.
    pub async fn wait_for_snapshot(&mut self) {
        if let Some(compactor) = &mut self.compactor {
            compactor.stop().await;
        }
    }

    /// Closes the log, after a snapshot under way completed or was abandoned.
    pub async fn shutdown(mut self) {
        self.wait_for_snapshot().await;
        match Arc::try_unwrap(self.wal) {
            Ok(wal) => {
                if let Err(e) = wal.shutdown().await {
                    tracing::warn!("the chain log did not close cleanly: {e}");
                }
            }
            Err(_) => {
                tracing::warn!("the chain log is still in use at shutdown; not closed cleanly")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_chain::{Row, Version};

    #[tokio::test]
    async fn batches_come_back_per_partition() {
        let dir = tempfile::tempdir().unwrap();
        let row = |v: u64| Row {
            value: Some(vec![v as u8]),
            version: Version {
                wall_ms: v,
                counter: 0,
                node: 1,
            },
            view: 1,
            locked: false,
        };
        {
            let (mut log, restored) =
                ChainLog::open(dir.path(), WalOptions::default(), 1_000).unwrap();
            assert!(restored.is_empty());
            let key = b"k".to_vec();
            let a = log
                .append(
                    3,
                    vec![Record::Row {
                        key: key.clone(),
                        row: row(1),
                    }],
                )
                .await
                .unwrap();
            let b = log
                .append(
                    7,
                    vec![
                        Record::Clear { view: 2 },
                        Record::Row {
                            key: key.clone(),
                            row: row(2),
                        },
                    ],
                )
                .await
                .unwrap();
            let c = log
                .append(3, vec![Record::Row { key, row: row(5) }])
                .await
                .unwrap();
            for commit in [a, b, c] {
                commit.await.unwrap();
            }
            log.shutdown().await;
        }
        let (log, restored) = ChainLog::open(dir.path(), WalOptions::default(), 1_000).unwrap();
        assert_eq!(restored.len(), 2);
        assert_eq!(restored[&3].rows[b"k".as_slice()], row(5));
        assert_eq!(restored[&7].rows[b"k".as_slice()], row(2));
        assert_eq!(restored[&7].joining_since, Some(2));
        log.shutdown().await;
    }

    /// Cluster simulation seed 56: a head restarted from its log ran a retry a second time, since
    /// it remembered only the requests of each key's last row; the first run's row had been
    /// replaced before the restart. Every row the replay folds gives its request now, unless it
    /// expired, and a re-entry voids those before it.
    #[tokio::test]
    async fn the_replay_gives_the_requests_of_every_row_since_the_last_re_entry() {
        use crate::recent::tests::row_of;
        use mqstate_store::RequestId;

        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, _) = ChainLog::open(dir.path(), WalOptions::default(), 1_000).unwrap();
            let batches = [
                (3, vec![row_of("c", b"1", 10_000)]),
                (3, vec![row_of("c", b"expired", 4_000)]),
                (3, vec![row_of("c", b"2", 10_000)]),
                (7, vec![row_of("c", b"voided", 10_000)]),
                (
                    7,
                    vec![Record::Clear { view: 2 }, row_of("c", b"3", 10_000)],
                ),
            ];
            for (partition, records) in batches {
                log.append(partition, records).await.unwrap().await.unwrap();
            }
            log.shutdown().await;
        }
        // Past the expired request's expiry and the clocks' margin, not the others'.
        let now_ms = 4_000 + crate::recent::CLOCK_MARGIN_MS;
        let (mut log, _) = ChainLog::open(dir.path(), WalOptions::default(), now_ms).unwrap();
        let ids = |requests: &[RequestRecord]| requests.iter().map(|r| r.id).collect::<Vec<_>>();
        let replayed = log.take_replayed_requests();
        assert_eq!(
            ids(&replayed[&3]),
            [RequestId::of("c", b"1"), RequestId::of("c", b"2")],
            "the replaced row's request too, not the expired one"
        );
        assert_eq!(ids(&replayed[&7]), [RequestId::of("c", b"3")]);
        assert!(log.take_replayed_requests().is_empty(), "given once");
        log.shutdown().await;
    }

    /// Robustness seed 400550: the changes a replica persisted were in no trail after it
    /// restarted, so when the head that committed them died too, an observer missed them. The
    /// replay notes the recent changes of state-store keys again (not session rows', not those
    /// older than the trail keeps, not those a re-entry voided), linked in log order.
    #[tokio::test]
    async fn the_replay_notes_the_recent_changes_of_state_store_keys_in_a_trail() {
        use mqstate_protocol::Hlc;
        use mqstate_store::{Change, Delta};

        const NOW_MS: u64 = 1_700_000_100_000;
        let change = |key: &str, wall_ms: u64| Record::Row {
            key: key.as_bytes().to_vec(),
            row: Row {
                value: Change::Key(Delta::Put {
                    key: Bytes::copy_from_slice(key.as_bytes()),
                    value: Bytes::from(format!("v{wall_ms}")),
                    version: Hlc::new(wall_ms, 0, Arc::from("1")),
                    fencing_token: None,
                    expires_at_ms: None,
                })
                .encode()
                .ok(),
                version: Version {
                    wall_ms,
                    counter: 0,
                    node: 1,
                },
                view: 1,
                locked: false,
            },
        };
        let version = |wall_ms: u64| Hlc::new(wall_ms, 0, Arc::from("1")).to_string();
        let (recent, old) = (NOW_MS - 1_000, NOW_MS - crate::trail::KEEP_MS - 1);
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, _) = ChainLog::open(dir.path(), WalOptions::default(), NOW_MS).unwrap();
            let batches = [
                (3, vec![change("k", old), change("k", recent)]),
                (3, vec![change("k", recent + 1)]),
                (5, vec![change("voided", recent)]),
                (5, vec![Record::Clear { view: 2 }]),
                (crate::space::SESSIONS, vec![change("session", recent)]),
            ];
            for (partition, records) in batches {
                log.append(partition, records).await.unwrap().await.unwrap();
            }
            log.shutdown().await;
        }
        let (mut log, _) = ChainLog::open(dir.path(), WalOptions::default(), NOW_MS).unwrap();
        let trail = log.take_replayed_trail();
        let between = trail
            .between(b"k", &version(recent), &version(recent + 1))
            .expect("linked");
        assert_eq!(
            between
                .iter()
                .map(|c| c.version.clone())
                .collect::<Vec<_>>(),
            [version(recent + 1)]
        );
        assert!(
            trail
                .between(b"k", &version(old), &version(recent))
                .is_none(),
            "the change older than the trail keeps is not noted"
        );
        assert!(trail.between(b"voided", "", &version(recent)).is_none());
        assert!(trail.between(b"session", "", &version(recent)).is_none());
        log.shutdown().await;
    }
}
