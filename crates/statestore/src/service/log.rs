//! The executor's appends: each change is encoded and handed to its [`DurableLog`], in apply
//! order; while the log is degraded, writes are refused before they execute.
//!
//! [`DurableLog`]: mqstate_wal::DurableLog

use bytes::Bytes;
use mqstate_protocol::Hlc;
use mqstate_store::notify::QueueDelta;
use mqstate_store::{Delta, RequestRecord, StoreError};
use mqstate_wal::Commit;

use super::Executor;

impl Executor {
    /// While degraded, asks the writer to recover at most once per
    /// [`RETRY_INTERVAL`](mqstate_wal::durable::RETRY_INTERVAL).
    pub(super) async fn log_accepts_writes(&mut self) -> bool {
        if !self.log.health().is_degraded() {
            return true;
        }
        let Some(refused) = self.log.accepts_appends(self.clock.now()).await else {
            return false;
        };
        // What the failed writer refused meanwhile (stale-reservation aborts, logged without
        // asking) is undone in memory too. No snapshot started meanwhile: none is due while
        // degraded.
        let undone = refused.len();
        for undo in refused {
            self.apply_undo(undo);
        }
        if undone > 0 {
            self.report_keyspace_size();
            tracing::warn!(
                undone,
                "changes the log refused while it was failed are undone"
            );
        }
        true
    }

    /// Appends a delta; returns the future of its durability.
    pub(super) async fn log(&mut self, delta: &Delta) -> Result<Option<Commit>, String> {
        let bytes = delta.encode().map_err(|e| e.to_string())?;
        self.log_bytes(bytes).await
    }

    /// Appends a queue change; returns the future of its durability.
    pub(super) async fn log_queue(&mut self, delta: &QueueDelta) -> Result<Option<Commit>, String> {
        // The record of `Change::Queue(delta)` (`mqstate_store::Change`), without cloning the delta into one.
        let bytes = delta.encode().map_err(|e| e.to_string())?;
        self.log_bytes(bytes).await
    }

    /// Appends `change` (an encoded `K`, `X` or `A` record, its key change of version `version`)
    /// made by `request`, with the request's identity (so a retry is answered, not executed, by a
    /// node that learns the change from the log); returns the future of its durability.
    pub(super) async fn log_requested(
        &mut self,
        change: Result<Vec<u8>, StoreError>,
        version: &Hlc,
        request: &RequestRecord,
    ) -> Result<Option<Commit>, String> {
        let bytes = change
            .and_then(|change| request.encode_with(&change, version))
            .map_err(|e| e.to_string())?;
        self.log_bytes(bytes).await
    }

    /// Appends an encoded record; returns the future of its durability.
    async fn log_bytes(&mut self, bytes: Vec<u8>) -> Result<Option<Commit>, String> {
        match self.log.append(Bytes::from(bytes)).await {
            Ok(commit) => Ok(Some(commit)),
            Err(e) => Err(e.to_string()),
        }
    }
}
