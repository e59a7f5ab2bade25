//! Reading records by LSN range, from the thread that owns the [`crate::Wal`] or from any other
//! ([`WalReader`]) while it appends: the index says which bytes of which segment hold the range,
//! one positioned read per segment fetches them, and every record's checksum is checked again.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use tokio::sync::watch;

use crate::error::{FormatError, WalError};
use crate::index::{LogIndex, Span};
use crate::log::Entry;
use crate::metadata::{LogId, Metadata, MetadataFile};
use crate::segment::decode_record_at;
use crate::{Lsn, Term};

/// A cloneable, thread-safe read handle on an open log ([`crate::Wal::reader`],
/// [`crate::WalWriter::reader`]).
#[derive(Debug, Clone)]
pub struct WalReader {
    index: Arc<RwLock<LogIndex>>,
    durable: watch::Receiver<Lsn>,
    metadata: Arc<MetadataFile>,
}

impl WalReader {
    pub(crate) fn new(
        index: Arc<RwLock<LogIndex>>,
        durable: watch::Receiver<Lsn>,
        metadata: Arc<MetadataFile>,
    ) -> Self {
        Self {
            index,
            durable,
            metadata,
        }
    }

    fn with_index<T>(&self, f: impl FnOnce(&LogIndex) -> T) -> T {
        f(&self.index.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The records of `range` that are on disk (written, durable or not), in LSN order. Records
    /// outside [`WalReader::bounds`] are left out, so the result may be shorter than the range.
    pub fn read(&self, range: Range<Lsn>) -> Result<Vec<Entry>, WalError> {
        self.entries(range).collect()
    }

    /// [`WalReader::read`] one segment at a time.
    pub fn entries(&self, range: Range<Lsn>) -> Entries {
        Entries::new(self.with_index(|index| index.spans(range)))
    }

    /// The term of the record at `lsn`, if it is on disk.
    pub fn term_at(&self, lsn: Lsn) -> Option<Term> {
        self.with_index(|index| index.term_at(lsn))
    }

    /// The LSNs on disk: from the first record not purged to one past the last written.
    pub fn bounds(&self) -> Range<Lsn> {
        let purged_end = self.last_purged().map_or(0, |p| p.index + 1);
        self.with_index(|index| index.start().max(purged_end)..index.end())
    }

    /// One past the last fsynced record, watchable: `changed().await` wakes when it moves (it
    /// goes down only when [`crate::Wal::truncate_from`] removes records).
    pub fn durable(&self) -> watch::Receiver<Lsn> {
        self.durable.clone()
    }

    /// The last purged record, as the metadata file records it (openraft's last purged log id).
    pub fn last_purged(&self) -> Option<LogId> {
        self.metadata.get().last_purged
    }

    /// The metadata file as last written.
    pub fn metadata(&self) -> Metadata {
        self.metadata.get()
    }

    pub(crate) fn mark_durable(&self) -> Result<(), WalError> {
        self.metadata.raise_durable_end()
    }

    pub(crate) fn write_application_fields(&self, metadata: &Metadata) -> Result<(), WalError> {
        self.metadata.write_application_fields(metadata, true)
    }
}

/// Iterator over records read span by span; see [`crate::Wal::entries`].
#[derive(Debug)]
pub struct Entries {
    spans: VecDeque<Span>,
    current: Option<SpanCursor>,
}

#[derive(Debug)]
struct SpanCursor {
    span: Span,
    bytes: Bytes,
    pos: usize,
    done: usize,
}

impl Entries {
    pub(crate) fn new(spans: Vec<Span>) -> Self {
        Self {
            spans: spans.into(),
            current: None,
        }
    }

    fn next_entry(&mut self) -> Result<Option<Entry>, WalError> {
        loop {
            if let Some(cursor) = &mut self.current {
                if cursor.done < cursor.span.count {
                    let at = cursor.pos;
                    let (record, next) = decode_record_at(&cursor.bytes, at).map_err(|e| {
                        WalError::corrupt(
                            &cursor.span.path,
                            FormatError {
                                offset: e.offset + cursor.span.bytes.start,
                                damage: e.damage,
                            },
                        )
                    })?;
                    let entry = Entry {
                        lsn: cursor.span.first_lsn + cursor.done as u64,
                        term: record.term,
                        data: cursor.bytes.slice(record.data),
                    };
                    cursor.pos = next;
                    cursor.done += 1;
                    return Ok(Some(entry));
                }
                self.current = None;
            }
            let Some(span) = self.spans.pop_front() else {
                return Ok(None);
            };
            let bytes = read_span(&span)?;
            self.current = Some(SpanCursor {
                span,
                bytes,
                pos: 0,
                done: 0,
            });
        }
    }
}

impl Iterator for Entries {
    type Item = Result<Entry, WalError>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.next_entry() {
            Ok(entry) => entry.map(Ok),
            Err(e) => {
                // One error ends the iteration.
                self.spans.clear();
                self.current = None;
                Some(Err(e))
            }
        }
    }
}

fn read_span(span: &Span) -> Result<Bytes, WalError> {
    let len =
        usize::try_from(span.bytes.end - span.bytes.start).map_err(|_| WalError::TooLarge {
            what: "segment span",
            len: usize::MAX,
            max: usize::MAX,
        })?;
    let mut buf = vec![0u8; len];
    File::open(&span.path)
        .and_then(|file| file.read_exact_at(&mut buf, span.bytes.start))
        .map_err(WalError::io("read", &span.path))?;
    Ok(Bytes::from(buf))
}
