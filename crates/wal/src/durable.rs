//! One durable log as a service uses it: the state store's executor and the broker's session
//! journal both sit on a [`DurableLog`] (decision 0030).
//!
//! * **Append** ([`DurableLog::append`]): the record goes to the group-commit writer ([`WalWriter`])
//!   and comes back as a [`Commit`] that knows the LSN it will get and the rollback epoch it was
//!   appended in.
//! * **Durable index** ([`Settler`], [`DurableIndex`]): whoever waits for a commit settles it through
//!   a `Settler`, which raises the durable index on success and reports the failure to the log's
//!   owner otherwise ([`DurableLog::next_failure`]).
//! * **Rollback** ([`DurableLog::roll_back`]): the owner may keep an undo for each record it applied
//!   ahead of the disk. A failed commit hands back, newest first, the undos of every record not
//!   below the durable index (the writer refuses every record queued behind a failed one), and
//!   starts a new epoch: failures reported for the old one afterwards change nothing.
//! * **Degraded mode** ([`LogHealth`]): after a failure the log does not accept appends
//!   ([`DurableLog::accepts_appends`]) until a retry of the writer succeeds, tried at most once per
//!   [`RETRY_INTERVAL`]; when to retry (on the next write or on a timer) is the owner's choice. A
//!   successful retry hands back the undos of what the failed writer refused meanwhile and starts
//!   a new epoch.
//! * **Snapshot schedule** ([`SnapshotSchedule`]): a snapshot is due once enough bytes were logged
//!   since the last one.
//!
//! Time comes in as arguments (`now`), so the owner decides which clock the log sees.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::error::WalError;
use crate::writer::{PendingCommit, WalWriter};
use crate::Lsn;

/// How often a degraded log is asked to recover (disk space may have come back).
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Sleeps until `deadline`; never resolves without one (a timer branch of a `select!` that is off).
pub async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// One past the last record whose commit settled successfully. Shared between the task that
/// appends (it keeps undos only for records at or above it) and the tasks that settle commits.
#[derive(Debug, Clone)]
pub struct DurableIndex(Arc<AtomicU64>);

impl DurableIndex {
    fn new(next_lsn: Lsn) -> DurableIndex {
        DurableIndex(Arc::new(AtomicU64::new(next_lsn)))
    }

    /// Records below this are durable.
    pub fn get(&self) -> Lsn {
        self.0.load(Ordering::Acquire)
    }

    /// Record `lsn` is durable; returns the previous index. Commits settled by several tasks may
    /// arrive out of order, so the index only ever rises.
    fn advance(&self, lsn: Lsn) -> Lsn {
        self.0.fetch_max(lsn + 1, Ordering::AcqRel)
    }
}

/// A record handed to the writer, not yet known durable. Settle it with a [`Settler`].
#[derive(Debug)]
pub struct Commit {
    lsn: Lsn,
    epoch: u64,
    pending: PendingCommit,
}

impl Commit {
    /// The LSN the record gets.
    pub fn lsn(&self) -> Lsn {
        self.lsn
    }

    /// The rollback epoch the record was appended in.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Waits for the record without settling it: neither the durable index nor the owner learns
    /// the result (a crash test that must know the record is on disk before it aborts).
    pub async fn wait(self) -> Result<Lsn, WalError> {
        self.pending.await
    }
}

/// A commit that did not become durable.
#[derive(Debug)]
pub struct Failed {
    /// The epoch the record was appended in.
    pub epoch: u64,
    pub error: WalError,
}

/// Waits for commits: raises the durable index, or reports the failure to the log's owner.
#[derive(Debug, Clone)]
pub struct Settler {
    durable: DurableIndex,
    failures: mpsc::UnboundedSender<u64>,
}

impl Settler {
    /// Resolves once `commit` is durable (with its LSN) or failed (reported to the owner, which
    /// rolls back).
    pub async fn settle(&self, commit: Commit) -> Result<Lsn, Failed> {
        match commit.pending.await {
            Ok(lsn) => {
                debug_assert_eq!(lsn, commit.lsn, "a record gets the LSN it was appended for");
                self.durable.advance(lsn);
                Ok(lsn)
            }
            Err(error) => {
                let _ = self.failures.send(commit.epoch);
                Err(Failed {
                    epoch: commit.epoch,
                    error,
                })
            }
        }
    }

    /// The durable index.
    pub fn durable(&self) -> &DurableIndex {
        &self.durable
    }
}

/// Whether the log accepts appends; after a failure, when recovery was last tried.
#[derive(Debug, Default)]
pub struct LogHealth {
    /// Set while the log refuses appends: when the last attempt to recover was made.
    degraded: Option<Instant>,
}

impl LogHealth {
    pub fn is_degraded(&self) -> bool {
        self.degraded.is_some()
    }

    /// When the next attempt to recover is due, while degraded.
    pub fn retry_at(&self) -> Option<Instant> {
        self.degraded.map(|tried| tried + RETRY_INTERVAL)
    }

    fn failed(&mut self, now: Instant) {
        self.degraded = Some(now);
    }

    /// Whether an attempt to recover is due at `now`.
    fn retry_due(&self, now: Instant) -> bool {
        self.retry_at().is_some_and(|at| now >= at)
    }
}

/// Bytes logged since the last snapshot, against the threshold that makes the next one due.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotSchedule {
    threshold_bytes: u64,
    logged_since: u64,
}

impl SnapshotSchedule {
    /// A schedule that has counted `logged_since` bytes already (those replayed at start, say).
    pub fn new(threshold_bytes: u64, logged_since: u64) -> SnapshotSchedule {
        SnapshotSchedule {
            threshold_bytes,
            logged_since,
        }
    }

    fn logged(&mut self, bytes: usize) {
        self.logged_since = self.logged_since.saturating_add(bytes as u64);
    }

    pub fn is_due(&self) -> bool {
        self.logged_since >= self.threshold_bytes
    }

    /// A snapshot starts: counting begins again.
    fn started(&mut self) {
        self.logged_since = 0;
    }
}

/// The owner's side of one log: appends in order, the undo of each record not yet durable, the
/// log's health and its snapshot schedule. `U` is whatever puts the owner's state back as it was
/// before a record (`()` for an owner that keeps no undo).
#[derive(Debug)]
pub struct DurableLog<U> {
    /// For the log messages: which log this is.
    name: &'static str,
    wal: Arc<WalWriter>,
    next_lsn: Lsn,
    settler: Settler,
    failures: mpsc::UnboundedReceiver<u64>,
    /// For each appended record not known durable, in LSN order: what restores the state before it.
    undo: VecDeque<(Lsn, U)>,
    /// Rollbacks and recoveries made so far.
    epoch: u64,
    health: LogHealth,
    snapshots: SnapshotSchedule,
}

impl<U> DurableLog<U> {
    /// The owner's side of `wal`, whose next record gets `next_lsn`.
    pub fn new(
        name: &'static str,
        wal: Arc<WalWriter>,
        next_lsn: Lsn,
        snapshots: SnapshotSchedule,
    ) -> DurableLog<U> {
        let (failures_tx, failures) = mpsc::unbounded_channel();
        DurableLog {
            name,
            wal,
            next_lsn,
            settler: Settler {
                durable: DurableIndex::new(next_lsn),
                failures: failures_tx,
            },
            failures,
            undo: VecDeque::new(),
            epoch: 0,
            health: LogHealth::default(),
            snapshots,
        }
    }

    pub fn wal(&self) -> &Arc<WalWriter> {
        &self.wal
    }

    /// The writer, for its shutdown.
    pub fn into_wal(self) -> Arc<WalWriter> {
        self.wal
    }

    /// A handle for the tasks that wait for commits.
    pub fn settler(&self) -> Settler {
        self.settler.clone()
    }

    /// The LSN the next appended record gets.
    pub fn next_lsn(&self) -> Lsn {
        self.next_lsn
    }

    /// Rollbacks and recoveries made so far: outcomes computed on the owner's state can be tagged
    /// with it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn health(&self) -> &LogHealth {
        &self.health
    }

    /// Appends `data` (waiting for room in the writer's queue). Records get LSNs in the order of
    /// the calls.
    pub async fn append(&mut self, data: Bytes) -> Result<Commit, WalError> {
        let len = data.len();
        let pending = self.wal.append(0, data).await?;
        let lsn = self.next_lsn;
        self.next_lsn += 1;
        self.snapshots.logged(len);
        Ok(Commit {
            lsn,
            epoch: self.epoch,
            pending,
        })
    }

    /// Writes and fsyncs the records appended since the last call as one batch, in the caller, when
    /// the log's owner commits ([`crate::Committer::Owner`]); nothing otherwise (a writer thread
    /// does it). The owner calls it after each turn of its work, before it waits for more.
    pub fn commit_queued(&self) {
        self.wal.commit_queued();
    }

    /// Whether records wait for [`DurableLog::commit_queued`] (never with a writer thread).
    pub fn awaits_commit(&self) -> bool {
        self.wal.awaits_commit()
    }

    /// Keeps `undo`, which restores the state before the last appended record, until that record
    /// is durable. Undos of records already durable are dropped on the way.
    pub fn push_undo(&mut self, undo: U) {
        debug_assert!(self.next_lsn > 0, "an undo follows an append");
        let lsn = self.next_lsn - 1;
        let durable = self.settler.durable.get();
        while self.undo.front().is_some_and(|(kept, _)| *kept < durable) {
            self.undo.pop_front();
        }
        debug_assert!(
            self.undo.back().is_none_or(|(last, _)| *last < lsn),
            "the undo log is in LSN order"
        );
        self.undo.push_back((lsn, undo));
    }

    /// The epoch of the next failed commit reported by a [`Settler`]; pending while none fails.
    pub async fn next_failure(&mut self) -> Option<u64> {
        self.failures.recv().await
    }

    /// A commit appended in `epoch` failed. The first failure of the current epoch returns the
    /// undos of every record not durable, newest first, the log is degraded and a new epoch
    /// begins. `None` for a failure of an epoch already rolled back: every commit behind a failed
    /// one fails too, and must not roll back what was appended since.
    pub fn roll_back(&mut self, epoch: u64, now: Instant) -> Option<Vec<U>> {
        if epoch != self.epoch {
            return None;
        }
        let durable = self.settler.durable.get();
        let keep = self.undo.partition_point(|(lsn, _)| *lsn < durable);
        let undone = self
            .undo
            .drain(keep..)
            .rev()
            .map(|(_, undo)| undo)
            .collect();
        // The writer cuts the log back to the last durable record: the LSNs after it come again.
        self.next_lsn = durable;
        self.epoch += 1;
        self.health.failed(now);
        Some(undone)
    }

    /// Whether the log accepts appends at `now`: while degraded, asks the writer to recover at most
    /// once per [`RETRY_INTERVAL`]. `Some` when it does, with what [`DurableLog::recover`] returns.
    pub async fn accepts_appends(&mut self, now: Instant) -> Option<Vec<U>> {
        if !self.health.is_degraded() {
            return Some(Vec::new());
        }
        if !self.health.retry_due(now) {
            return None;
        }
        self.recover(now).await
    }

    /// Asks the writer to recover now. `None` while it still fails; once it accepts records again,
    /// the undos of the records it refused while degraded (appended after the rollback, newest
    /// first), which the owner applies like a rollback's. A new epoch begins: the failures of those
    /// records, reported later, must not roll back what is appended from here.
    pub async fn recover(&mut self, now: Instant) -> Option<Vec<U>> {
        match self.wal.retry().await {
            Ok(()) => {
                // Every record appended before the retry was written or refused ahead of it.
                let end = self.wal.reader().bounds().end;
                let keep = self.undo.partition_point(|(lsn, _)| *lsn < end);
                let refused = self
                    .undo
                    .drain(keep..)
                    .rev()
                    .map(|(_, undo)| undo)
                    .collect();
                self.next_lsn = end;
                if self.health.degraded.take().is_some() {
                    self.epoch += 1;
                    tracing::info!(log = self.name, "log recovered; accepting writes again");
                }
                Some(refused)
            }
            Err(error) => {
                tracing::warn!(log = self.name, %error, "log still refuses writes");
                self.health.failed(now);
                None
            }
        }
    }

    /// Whether enough was logged since the last snapshot for the next one (never while degraded:
    /// the LSNs of refused records come again).
    pub fn snapshot_due(&self) -> bool {
        !self.health.is_degraded() && self.next_lsn > 0 && self.snapshots.is_due()
    }

    /// A snapshot starts: bytes are counted towards the next one from here.
    pub fn snapshot_started(&mut self) {
        self.snapshots.started();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::failpoint::AFTER_WRITE_BEFORE_FSYNC;
    use crate::{FailAction, Failpoints, Wal, WalOptions};

    /// A log whose fsyncs fail while `failing` is set.
    fn open(dir: &std::path::Path, failing: &Arc<AtomicBool>) -> DurableLog<&'static str> {
        let failing = Arc::clone(failing);
        let options = WalOptions {
            failpoints: Failpoints::with_hook(move |name| {
                if name == AFTER_WRITE_BEFORE_FSYNC && failing.load(Ordering::SeqCst) {
                    FailAction::Error
                } else {
                    FailAction::Continue
                }
            }),
            preallocate_segments: false,
            ..WalOptions::default()
        };
        let (wal, _) = Wal::open(dir, options).unwrap();
        let wal = Arc::new(WalWriter::spawn(wal).unwrap());
        DurableLog::new("test", wal, 0, SnapshotSchedule::new(10, 0))
    }

    fn record(text: &'static str) -> Bytes {
        Bytes::from_static(text.as_bytes())
    }

    #[tokio::test]
    async fn a_failed_commit_rolls_back_what_is_not_durable_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        let mut log = open(dir.path(), &failing);
        let settler = log.settler();

        let first = log.append(record("a")).await.unwrap();
        log.push_undo("undo a");
        assert_eq!(first.lsn(), 0);
        assert_eq!(settler.settle(first).await.unwrap(), 0);
        assert_eq!(settler.durable().get(), 1);

        failing.store(true, Ordering::SeqCst);
        let second = log.append(record("b")).await.unwrap();
        log.push_undo("undo b");
        let third = log.append(record("c")).await.unwrap();
        log.push_undo("undo c");
        assert_eq!((second.lsn(), third.lsn()), (1, 2));
        let failed = settler.settle(second).await.unwrap_err();
        assert_eq!(failed.epoch, 0);
        assert!(settler.settle(third).await.is_err());
        assert_eq!(settler.durable().get(), 1, "nothing failed is durable");

        assert_eq!(log.next_failure().await, Some(0));
        let now = Instant::now();
        let undone = log.roll_back(0, now).unwrap();
        assert_eq!(
            undone,
            ["undo c", "undo b"],
            "newest first, the durable one kept"
        );
        assert_eq!((log.next_lsn(), log.epoch()), (1, 1));
        assert!(log.health().is_degraded());
        // The second failure of the same epoch is the same rollback.
        assert_eq!(log.next_failure().await, Some(0));
        assert!(log.roll_back(0, now).is_none());

        // Degraded: no retry before the interval, whatever the disk does.
        failing.store(false, Ordering::SeqCst);
        assert!(log.accepts_appends(now).await.is_none());
        let refused = log.accepts_appends(now + RETRY_INTERVAL).await.unwrap();
        assert!(refused.is_empty(), "nothing was appended while degraded");
        assert!(!log.health().is_degraded());
        let fourth = log.append(record("d")).await.unwrap();
        assert_eq!(
            fourth.lsn(),
            1,
            "the LSNs of the refused records come again"
        );
        assert_eq!(fourth.epoch(), 2, "a rollback and a recovery");
        assert_eq!(settler.settle(fourth).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn a_retry_while_the_disk_still_fails_waits_another_interval() {
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(true));
        let mut log = open(dir.path(), &failing);
        let settler = log.settler();
        let commit = log.append(record("a")).await.unwrap();
        assert!(settler.settle(commit).await.is_err());
        let start = Instant::now();
        assert!(log.roll_back(0, start).unwrap().is_empty());
        assert_eq!(log.health().retry_at(), Some(start + RETRY_INTERVAL));

        let later = start + RETRY_INTERVAL;
        assert!(
            log.accepts_appends(later).await.is_none(),
            "the disk still fails"
        );
        assert_eq!(log.health().retry_at(), Some(later + RETRY_INTERVAL));
        failing.store(false, Ordering::SeqCst);
        assert!(
            log.recover(later).await.is_some(),
            "recover does not wait for the interval"
        );
        assert_eq!(log.next_lsn(), 0);
    }

    /// What an owner appends while degraded (the state store's expiries) is refused by the failed
    /// writer; recovery hands back its undo, and the late report of its failure rolls back nothing
    /// appended after the recovery.
    #[tokio::test]
    async fn recovery_undoes_what_the_failed_writer_refused_and_starts_an_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let failing = Arc::new(AtomicBool::new(false));
        let mut log = open(dir.path(), &failing);
        let settler = log.settler();
        let durable = log.append(record("a")).await.unwrap();
        log.push_undo("undo a");
        settler.settle(durable).await.unwrap();

        failing.store(true, Ordering::SeqCst);
        let failed = log.append(record("b")).await.unwrap();
        log.push_undo("undo b");
        let failed = settler.settle(failed).await.unwrap_err();
        let now = Instant::now();
        assert_eq!(log.roll_back(failed.epoch, now).unwrap(), ["undo b"]);
        assert!(!log.snapshot_due(), "no snapshot while degraded");

        // Appended while degraded: the writer refuses it (it is still failed).
        let refused = log.append(record("c")).await.unwrap();
        log.push_undo("undo c");
        assert_eq!((refused.lsn(), refused.epoch()), (1, 1));
        failing.store(false, Ordering::SeqCst);
        assert_eq!(log.recover(now).await.unwrap(), ["undo c"]);
        assert_eq!((log.next_lsn(), log.epoch()), (1, 2));

        let after = log.append(record("d")).await.unwrap();
        log.push_undo("undo d");
        assert_eq!(after.lsn(), 1);
        let late = settler.settle(refused).await.unwrap_err();
        assert!(
            log.roll_back(late.epoch, now).is_none(),
            "a failure of an older epoch"
        );
        assert_eq!(settler.settle(after).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn a_snapshot_is_due_once_the_threshold_is_logged() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = open(dir.path(), &Arc::new(AtomicBool::new(false)));
        assert!(!log.snapshot_due());
        log.append(record("12345")).await.unwrap();
        assert!(!log.snapshot_due());
        log.append(record("67890")).await.unwrap();
        assert!(log.snapshot_due());
        log.snapshot_started();
        assert!(!log.snapshot_due());
    }

    #[test]
    fn a_schedule_counts_what_was_replayed() {
        assert!(SnapshotSchedule::new(10, 10).is_due());
        assert!(!SnapshotSchedule::new(10, 9).is_due());
    }
}
