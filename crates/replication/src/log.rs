//! The replicas' log: one `mqstate-wal` log per node in `<data-dir>/chains/`, each record one
//! `Output::Persist` batch of one partition's replica, tagged with the partition (decision
//! 0035). One log, so one writer thread and one fsync per group commit for
//! every partition this node replicates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use mqstate_chain::{Record, Restored};
use mqstate_wal::{PendingCommit, Wal, WalError, WalOptions, WalWriter};
use serde::{Deserialize, Serialize};

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
    wal: WalWriter,
}

impl ChainLog {
    /// Opens (creating if needed) `<data-dir>/chains/` and folds every record into its
    /// partition's [`Restored`].
    pub fn open(
        data_dir: &Path,
        options: WalOptions,
    ) -> Result<(ChainLog, BTreeMap<u32, Restored>), LogError> {
        let path = data_dir.join(CHAINS_DIR);
        let (wal, recovered) = Wal::open(&path, options).map_err(|source| LogError::Open {
            path: path.clone(),
            source,
        })?;
        let mut restored: BTreeMap<u32, Restored> = BTreeMap::new();
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
            let partition = restored.entry(batch.partition).or_default();
            for record in batch.records {
                partition.apply(record);
            }
        }
        let wal = WalWriter::spawn(wal).map_err(LogError::Writer)?;
        Ok((ChainLog { wal }, restored))
    }

    /// Queues one batch of `partition`'s replica; the returned commit resolves once it is durable.
    /// Batches get their place in the log in the order this is called.
    pub async fn append(
        &self,
        partition: u32,
        records: Vec<Record>,
    ) -> Result<PendingCommit, WalError> {
        let data = encode_batch(partition, records);
        self.wal.append(0, Bytes::from(data)).await
    }

    pub async fn shutdown(self) {
        if let Err(e) = self.wal.shutdown().await {
            tracing::warn!("the chain log did not close cleanly: {e}");
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
            let (log, restored) = ChainLog::open(dir.path(), WalOptions::default()).unwrap();
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
        let (log, restored) = ChainLog::open(dir.path(), WalOptions::default()).unwrap();
        assert_eq!(restored.len(), 2);
        assert_eq!(restored[&3].rows[b"k".as_slice()], row(5));
        assert_eq!(restored[&7].rows[b"k".as_slice()], row(2));
        assert_eq!(restored[&7].joining_since, Some(2));
        log.shutdown().await;
    }
}
