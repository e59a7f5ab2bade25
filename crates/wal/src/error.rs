//! Errors of the storage layer: [`Damage`]/[`FormatError`] from the pure decoders, [`WalError`]
//! from everything that touches files.

use std::io;
use std::path::PathBuf;

/// What is wrong with the bytes at some offset of a file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("the file ends in the middle of a field")]
    Truncated,
    #[error("file marker {found:02X?} is not the {kind} marker {expected:02X?}")]
    BadFileMarker {
        kind: &'static str,
        expected: [u8; 4],
        found: [u8; 4],
    },
    #[error("{kind} format version {found} is not supported (this build reads up to {supported})")]
    UnsupportedVersion {
        kind: &'static str,
        found: i32,
        supported: i32,
    },
    #[error("record marker expected, found {0:02X?}")]
    BadRecordMarker([u8; 4]),
    #[error("the file ends after the last record without the end marker")]
    MissingEndMarker,
    #[error("{field} is negative ({value})")]
    Negative { field: &'static str, value: i64 },
    #[error("length {len} exceeds the limit of {max} bytes")]
    TooLong { len: usize, max: usize },
    #[error("alignment padding after the record data is not zero")]
    NonZeroPadding,
    #[error("checksum mismatch (stored {stored:#010X}, computed {computed:#010X})")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("voted-for is {0}, but only -1 (no vote) or a node id >= 0 is valid")]
    InvalidVote(i32),
    #[error("{field} has term {term} but no index (-1), so its term must be 0")]
    TermWithoutIndex { field: &'static str, term: u64 },
    #[error("{field} is {value}, but only 0 (false) or 1 (true) is valid")]
    InvalidBool { field: &'static str, value: u8 },
    #[error("node id is not UTF-8")]
    InvalidUtf8,
    #[error("{0} unexpected bytes after the end of the file's content")]
    TrailingBytes(usize),
}

/// [`Damage`] at a byte offset, as reported by the pure `decode_*`/`scan_*` functions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{damage} at byte offset {offset}")]
pub struct FormatError {
    pub offset: u64,
    pub damage: Damage,
}

const FIX_HINT: &str = "run `mqstate data verify` to see the damage, then restore the file from a \
                        backup or run `mqstate data repair` to cut the log back to the last good record";

/// Every failure of the storage layer. Messages name the file and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: {damage} at byte offset {offset}; {FIX_HINT}", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        damage: Damage,
    },
    #[error("{}: the log jumps from LSN {expected} to {found}, so records are missing; {FIX_HINT}", path.display())]
    Gap {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("{}: records from LSN {lsn} up to {durable_end} (excluded) were fsynced and acknowledged \
             (the metadata file's durable end is {durable_end}), but {what}; refusing to start without \
             them: restore the directory from a backup or a replica, or run `mqstate data repair` to \
             accept the loss (it keeps every intact record before it and reports what is gone)",
            path.display())]
    LostDurable {
        path: PathBuf,
        lsn: u64,
        durable_end: u64,
        what: String,
    },
    #[error("{}: the metadata file is missing although the directory holds a log or a snapshot; \
             run `mqstate data repair` to rebuild it from them, or restore it from a backup", path.display())]
    MetadataMissing { path: PathBuf },
    #[error("{}: not a data directory (it has no {} file, no log/ and no snapshot); pass the \
             directory given to `mqstate serve --data-dir`", path.display(), crate::layout::METADATA_FILE)]
    NotADataDirectory { path: PathBuf },
    #[error("{}: the metadata file says records up to LSN {purged} were purged, but {}; restore \
             the snapshot from a backup or a replica", path.display(),
            match snapshot { Some(i) => format!("the snapshot covers only up to {i}"), None => "there is no snapshot".to_owned() })]
    PurgedPastSnapshot {
        path: PathBuf,
        purged: u64,
        snapshot: Option<u64>,
    },
    #[error(
        "a record for LSN {found} cannot be appended: the log's next LSN is {expected} \
             (append without a gap; truncate first to replace records)"
    )]
    NotNext { expected: u64, found: u64 },
    #[error("cannot truncate the log from LSN {lsn}: records before {first} are purged")]
    TruncatePurged { lsn: u64, first: u64 },
    #[error("{what} is {len} bytes, more than the limit of {max}; raise the limit in the WAL options or send less")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{what} is {value}, more than the on-disk Int64 can hold")]
    OutOfRange { what: &'static str, value: u64 },
    #[error("the write-ahead log stopped after a write error and refuses records until a retry succeeds \
             (check disk space and the kernel log): {cause}")]
    Failed { cause: String },
    #[error("the write-ahead log writer has stopped; restart the server")]
    Closed,
    #[error("{what} was abandoned before it was complete; the previous one stays")]
    Abandoned { what: &'static str },
    #[error("{} is in use by another process (it holds the lock on {}); stop that process first, \
             or give this one another data directory", path.display(), crate::layout::LOCK_FILE)]
    Locked { path: PathBuf },
}

impl WalError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| WalError::Io { op, path, source }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, e: FormatError) -> Self {
        WalError::Corrupt {
            path: path.into(),
            offset: e.offset,
            damage: e.damage,
        }
    }
}
