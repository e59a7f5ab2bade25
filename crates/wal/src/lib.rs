//! mqstate-wal: the durable storage of a node, in the TaskFlux file layout
//! (`docs/storage-format.md`). Records are opaque bytes here; the store crate gives them meaning.
//!
//! A tour, bottom up:
//!
//! * [`checksum`] — CRC-32/MPEG-2, the one checksum of every file.
//! * [`segment`], [`snapshot`], [`metadata`] — the three file formats as pure functions over
//!   bytes (`encode_*`, `decode_*`, [`scan_segment`]); they never panic on bad input and are
//!   fuzzed (`fuzz/fuzz_targets/wal_files.rs`).
//! * [`layout`] — where files live under the data directory, atomic replacement via `temp/`,
//!   directory fsync.
//! * [`Wal`] (`log`) — the segmented log, driven synchronously: [`Wal::open`] recovers (a torn
//!   last record is cut off; any other damage is an error naming file and offset), then
//!   `write_batch` / `sync` / `rotate_if_needed` / `install_snapshot`.
//! * [`WalWriter`] (`writer`) — group commit for the server: a dedicated thread owns the
//!   [`Wal`], drains a queue of appends, writes them as one batch, fsyncs once and only then
//!   completes every waiting future. A write or fsync error fails the batch and stops the
//!   writer until [`WalWriter::retry`] succeeds; nothing unacknowledged stays in the file.
//! * [`WalStats`] — batch and fsync counters for metrics. [`Failpoints`] — crash-test hooks.
//! * [`tools`] — `inspect`, `verify`, `repair` for the `mqstate data` commands.

pub mod checksum;
mod codec;
mod error;
pub mod failpoint;
pub mod layout;
mod log;
pub mod metadata;
mod options;
mod prealloc;
mod recovery;
pub mod segment;
pub mod snapshot;
mod stats;
pub mod tools;
mod writer;

/// Log sequence number: the position of a record in the log, consecutive from 0.
pub type Lsn = u64;
/// Raft term a record was written in (0 on a single node).
pub type Term = u64;

pub use error::{Damage, FormatError, WalError};
pub use failpoint::{FailAction, Failpoints};
pub use layout::{DataDir, DirLock};
pub use log::{delete_segments, Entry, Recovered, Wal};
pub use metadata::{decode_metadata, encode_metadata, read_metadata, write_metadata, Metadata};
pub use options::{FsyncPolicy, WalOptions};
pub use segment::{scan_segment, SegmentEnd, SegmentScan};
pub use snapshot::{decode_snapshot, encode_snapshot, read_snapshot, write_snapshot, Snapshot};
pub use stats::{WalStats, WalStatsSnapshot};
pub use writer::{PendingCommit, WalWriter};
