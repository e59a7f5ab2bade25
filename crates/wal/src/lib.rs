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
//! * [`Wal`] (`log`) — the segmented log, driven synchronously: [`Wal::open`] recovers by scanning
//!   and indexing the segments (a torn last record after the metadata's durable end is cut off;
//!   acknowledged records lost below it, or any other damage, are an error naming file and offset),
//!   then `write_batch` / `sync` / `rotate_if_needed` / `install_snapshot`. Records stay on disk:
//!   [`Recovered::records`] and [`Wal::entries`] read them back one segment at a time.
//! * [`WalReader`] (`reader`, over `index`) — reads records by LSN range from any thread while the
//!   log appends, looks up terms, and watches the durable index.
//! * What a replica needs: [`Wal::write_batch_at`] / [`WalWriter::append_at`] (append at a given
//!   index, never a gap), [`Wal::truncate_from`] / [`WalWriter::truncate_from`] (drop an
//!   uncommitted suffix), [`WalReader::durable`] (a `tokio::sync::watch` of the durable index),
//!   [`WalReader::last_purged`] (persisted in the metadata at every purge, [`WalWriter::purge`]).
//! * [`WalWriter`] (`writer`) — group commit for the server: a dedicated thread owns the
//!   [`Wal`], drains a queue of appends, writes them as one batch, fsyncs once and only then
//!   completes every waiting future. A write or fsync error fails the batch and stops the
//!   writer until [`WalWriter::retry`] succeeds; nothing unacknowledged stays in the file. Records
//!   the durable end in the metadata file once a second.
//! * [`durable`] — the log as a service uses it ([`DurableLog`]): appends with their LSN and
//!   rollback epoch, the durable index commits are settled into, the undo of what is not yet
//!   durable, degraded mode and its retries, the snapshot schedule.
//! * [`SnapshotWriter`] — a snapshot streamed to its file chunk by chunk.
//! * [`WalStats`] — batch and fsync counters for metrics. [`Failpoints`] — crash-test hooks.
//! * [`tools`] — `inspect`, `verify`, `repair` for the `mqstate data` commands.

pub mod checksum;
mod codec;
pub mod durable;
mod error;
pub mod failpoint;
mod index;
pub mod layout;
mod log;
pub mod metadata;
mod options;
mod prealloc;
mod reader;
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

pub use durable::{Commit, DurableIndex, DurableLog, Settler, SnapshotSchedule};
pub use error::{Damage, FormatError, WalError};
pub use failpoint::{FailAction, Failpoints};
pub use layout::{DataDir, DirLock};
pub use log::{delete_segments, Entry, Recovered, Wal};
pub use metadata::{decode_metadata, encode_metadata, read_metadata, LogId, Metadata};
pub use options::{Committer, FsyncPolicy, WalOptions};
pub use reader::{Entries, WalReader};
pub use segment::{scan_segment, SegmentEnd, SegmentScan};
pub use snapshot::{
    decode_snapshot, encode_snapshot, read_snapshot, write_snapshot, Snapshot, SnapshotWriter,
};
pub use stats::{WalStats, WalStatsSnapshot};
pub use writer::{PendingCommit, WalWriter};
