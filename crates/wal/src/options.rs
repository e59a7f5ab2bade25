//! Settings of the log, with their limits as named defaults.

use std::time::Duration;

use crate::failpoint::Failpoints;

/// Rotate once a segment is larger than this and all its records are durable.
pub const DEFAULT_SEGMENT_SOFT_LIMIT_BYTES: u64 = 16 * 1024 * 1024;
/// Rotate once a segment is larger than this, durable or not.
pub const DEFAULT_SEGMENT_HARD_LIMIT_BYTES: u64 = 32 * 1024 * 1024;
/// Largest record `append` accepts.
pub const DEFAULT_RECORD_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Records waiting for the writer before `append` waits for room (backpressure).
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// Most records written and fsynced as one batch.
pub const DEFAULT_BATCH_RECORDS_MAX: usize = 1024;
/// Most record bytes written and fsynced as one batch.
pub const DEFAULT_BATCH_BYTES_MAX: usize = 8 * 1024 * 1024;

/// When the writer fsyncs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Fsync every batch before acknowledging it: an acknowledged record survives power loss.
    #[default]
    Always,
    /// Acknowledge after the write and fsync at most this often: a power loss (not a process
    /// crash) can lose up to one interval of acknowledged records.
    Interval(Duration),
    /// Acknowledge after the write and leave flushing to the kernel: a power loss can lose any
    /// acknowledged record not yet flushed. For tests and throw-away data.
    Never,
}

/// Who carries out the appends of a [`crate::WalWriter`] (decision 0069).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Committer {
    /// A writer thread of the log's own: it takes everything queued since its last round as one
    /// batch (group commit) while the appenders go on. For logs with many appending tasks.
    #[default]
    Thread,
    /// The log's one owner: appends are only queued, and the owner's
    /// [`crate::WalWriter::commit_queued`] writes and fsyncs everything queued as one batch, in the
    /// owner's thread — after a turn of its work, as Redis does before it sleeps. Saves the
    /// writer thread's sleep and wake-up and the wake-up of the owner's runtime by it, per batch;
    /// the owner's thread is blocked for the fsync. Only under [`FsyncPolicy::Always`]: the
    /// relaxed policies need the thread's timer (the writer falls back to a thread for them).
    Owner,
    /// The caller of every command carries it out before it returns: [`crate::WalWriter::append`]
    /// writes and fsyncs the record (its commit is then ready), and the next segment is prepared
    /// in the caller too. No group commit, so slow: for the deterministic simulation
    /// (`crates/replication/tests/turmoil_sim.rs`), where work on other threads would run outside
    /// simulated time.
    Caller,
}

/// Options of [`crate::Wal::open`].
#[derive(Debug, Clone)]
pub struct WalOptions {
    /// Which log this is, as the `log` label of its metrics (a server runs more than one).
    pub name: &'static str,
    pub segment_soft_limit_bytes: u64,
    pub segment_hard_limit_bytes: u64,
    pub record_max_bytes: usize,
    pub fsync: FsyncPolicy,
    pub queue_capacity: usize,
    pub batch_records_max: usize,
    pub batch_bytes_max: usize,
    pub failpoints: Failpoints,
    /// Prepare each next segment full of zeros in the background, so that commits into it
    /// fdatasync data only (see `prealloc`). Default on.
    pub preallocate_segments: bool,
    /// The application keeps its snapshot outside this log (openraft's state machine keeps its
    /// own): `mqstate.snapshot` is neither read nor required, and the last purged id in the
    /// metadata alone says where the log starts. A purge ([`crate::Wal::compact`]) is then the
    /// application's promise that its snapshot covers the purged records. Default off.
    pub snapshot_elsewhere: bool,
    /// Who writes and fsyncs the appended records. Default [`Committer::Thread`].
    pub committer: Committer,
}

impl Default for WalOptions {
    fn default() -> Self {
        Self {
            name: "log",
            segment_soft_limit_bytes: DEFAULT_SEGMENT_SOFT_LIMIT_BYTES,
            segment_hard_limit_bytes: DEFAULT_SEGMENT_HARD_LIMIT_BYTES,
            record_max_bytes: DEFAULT_RECORD_MAX_BYTES,
            fsync: FsyncPolicy::Always,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            batch_records_max: DEFAULT_BATCH_RECORDS_MAX,
            batch_bytes_max: DEFAULT_BATCH_BYTES_MAX,
            failpoints: Failpoints::default(),
            preallocate_segments: true,
            snapshot_elsewhere: false,
            committer: Committer::Thread,
        }
    }
}
