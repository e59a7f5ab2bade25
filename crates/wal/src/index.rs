//! Where each record of an open log is: per segment, the byte offset of every record, and the
//! terms as runs. Built by the scan at open instead of keeping the records in memory; shared (behind
//! a lock) between the thread that appends and the [`crate::WalReader`]s that read by LSN range.

use std::ops::Range;
use std::path::PathBuf;

use crate::{Lsn, Term};

/// One segment's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentIndex {
    pub first_lsn: Lsn,
    pub path: PathBuf,
    /// Byte offset of each record's marker, in LSN order.
    pub offsets: Vec<u64>,
    /// Byte offset just after the last record (where the end marker is).
    pub end_offset: u64,
}

impl SegmentIndex {
    pub fn end_lsn(&self) -> Lsn {
        self.first_lsn + self.offsets.len() as u64
    }
}

/// A contiguous run of records in one segment, as a reader needs it: the file, the LSN of the first
/// record and the byte span that holds exactly these records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub path: PathBuf,
    pub first_lsn: Lsn,
    pub count: usize,
    pub bytes: Range<u64>,
}

/// The index of a whole log (every segment still on disk, the active one last).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LogIndex {
    segments: Vec<SegmentIndex>,
    /// `(first LSN, term)` of each run of records written in the same term, ascending.
    terms: Vec<(Lsn, Term)>,
    /// LSN of the first record still on disk, when there is none (`segments` all empty).
    empty_start: Lsn,
}

impl LogIndex {
    /// First LSN still on disk.
    pub fn start(&self) -> Lsn {
        self.segments
            .first()
            .map_or(self.empty_start, |s| s.first_lsn)
    }

    /// One past the last record written.
    pub fn end(&self) -> Lsn {
        self.segments
            .last()
            .map_or(self.empty_start, SegmentIndex::end_lsn)
    }

    /// The term of the record at `lsn`, if it is on disk.
    pub fn term_at(&self, lsn: Lsn) -> Option<Term> {
        if lsn < self.start() || lsn >= self.end() {
            return None;
        }
        let i = self.terms.partition_point(|&(first, _)| first <= lsn);
        i.checked_sub(1).map(|i| self.terms[i].1)
    }

    /// Starts a segment (empty) after the last one; its first LSN must be the log's end, or any
    /// LSN at or after it when the log restarts after a snapshot.
    pub fn add_segment(&mut self, first_lsn: Lsn, path: PathBuf, end_offset: u64) {
        debug_assert!(first_lsn >= self.end(), "segments ascend");
        if self
            .segments
            .last()
            .is_none_or(|s| s.end_lsn() != first_lsn)
        {
            // The log restarts after a gap the snapshot covers: what came before is unreadable.
            self.segments.clear();
            self.terms.clear();
        }
        self.empty_start = first_lsn;
        self.segments.push(SegmentIndex {
            first_lsn,
            path,
            offsets: Vec::new(),
            end_offset,
        });
    }

    /// Appends a record at `offset` of the last segment, which now ends at `end_offset`.
    pub fn push(&mut self, term: Term, offset: u64, end_offset: u64) {
        let lsn = self.end();
        let Some(last) = self.segments.last_mut() else {
            debug_assert!(false, "a record pushed before any segment");
            return;
        };
        debug_assert!(last.offsets.last().is_none_or(|&o| o < offset));
        last.offsets.push(offset);
        last.end_offset = end_offset;
        if self.terms.last().is_none_or(|&(_, t)| t != term) {
            self.terms.push((lsn, term));
        }
    }

    /// Forgets every record at or after `end` (the segment files are cut by the caller). Segments
    /// that start after `end` are dropped; one that starts at `end` stays, empty, as the place the
    /// log continues (its file stays too).
    pub fn truncate(&mut self, end: Lsn) {
        while self.segments.len() > 1 && self.segments.last().is_some_and(|s| s.first_lsn > end) {
            self.segments.pop();
        }
        if let Some(last) = self.segments.last_mut() {
            let keep = end.saturating_sub(last.first_lsn) as usize;
            if keep < last.offsets.len() {
                last.end_offset = last.offsets[keep];
                last.offsets.truncate(keep);
            }
        }
        self.terms.retain(|&(first, _)| first < end);
    }

    /// Forgets the segments whose records are all below `start` (their files are deleted by the
    /// caller). Returns their paths.
    pub fn purge_before(&mut self, start: Lsn) -> Vec<PathBuf> {
        let whole = self
            .segments
            .iter()
            .take(self.segments.len().saturating_sub(1))
            .take_while(|s| s.end_lsn() <= start)
            .count();
        let removed: Vec<PathBuf> = self.segments.drain(..whole).map(|s| s.path).collect();
        let first = self.start();
        // Keep the run that covers the new first record.
        let runs_before = self.terms.partition_point(|&(lsn, _)| lsn <= first);
        if runs_before > 1 {
            self.terms.drain(..runs_before - 1);
        }
        removed
    }

    /// The spans that hold the records of `range` (clipped to what is on disk), in LSN order.
    pub fn spans(&self, range: Range<Lsn>) -> Vec<Span> {
        let mut out = Vec::new();
        for segment in &self.segments {
            let lo = range.start.max(segment.first_lsn);
            let hi = range.end.min(segment.end_lsn());
            if lo >= hi {
                continue;
            }
            let from = (lo - segment.first_lsn) as usize;
            let to = (hi - segment.first_lsn) as usize;
            let end = segment
                .offsets
                .get(to)
                .copied()
                .unwrap_or(segment.end_offset);
            out.push(Span {
                path: segment.path.clone(),
                first_lsn: lo,
                count: to - from,
                bytes: segment.offsets[from]..end,
            });
        }
        out
    }

    /// The segments, oldest first.
    pub fn segments(&self) -> &[SegmentIndex] {
        &self.segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_of(segments: &[(Lsn, usize)]) -> LogIndex {
        let mut index = LogIndex::default();
        for &(first, count) in segments {
            index.add_segment(first, PathBuf::from(format!("{first}")), 8);
            for i in 0..count as u64 {
                let term = (first + i) / 4;
                index.push(term, 8 + i * 24, 8 + (i + 1) * 24);
            }
        }
        index
    }

    #[test]
    fn spans_cover_exactly_the_asked_records() {
        let index = index_of(&[(0, 3), (3, 3)]);
        assert_eq!((index.start(), index.end()), (0, 6));
        let spans = index.spans(1..5);
        assert_eq!(spans.len(), 2);
        assert_eq!(
            (spans[0].first_lsn, spans[0].count, spans[0].bytes.clone()),
            (1, 2, 32..80)
        );
        assert_eq!(
            (spans[1].first_lsn, spans[1].count, spans[1].bytes.clone()),
            (3, 2, 8..56)
        );
        assert!(index.spans(6..9).is_empty());
    }

    #[test]
    fn terms_are_looked_up_by_run() {
        let index = index_of(&[(0, 3), (3, 6)]);
        let terms: Vec<_> = (0..10).map(|lsn| index.term_at(lsn)).collect();
        let expected: Vec<_> = (0..9).map(|lsn| Some(lsn / 4)).chain([None]).collect();
        assert_eq!(terms, expected);
    }

    #[test]
    fn truncate_and_purge_keep_the_index_consistent() {
        let mut at_boundary = index_of(&[(0, 3), (3, 3), (6, 3)]);
        at_boundary.truncate(6);
        assert_eq!(
            at_boundary.segments().len(),
            3,
            "the segment starting at 6 stays"
        );
        assert_eq!(
            (at_boundary.end(), at_boundary.segments()[2].end_offset),
            (6, 8)
        );
        let mut index = index_of(&[(0, 3), (3, 3), (6, 3)]);
        index.truncate(4);
        assert_eq!(index.end(), 4);
        assert_eq!(index.segments().len(), 2);
        assert_eq!(index.segments()[1].end_offset, 32);
        assert_eq!(index.term_at(3), Some(0));
        let removed = index.purge_before(3);
        assert_eq!(removed, vec![PathBuf::from("0")]);
        assert_eq!((index.start(), index.end()), (3, 4));
        assert_eq!(index.term_at(3), Some(0));
        index.push(5, 32, 56);
        assert_eq!(index.term_at(4), Some(5));
    }

    #[test]
    fn a_segment_after_a_gap_starts_the_index_afresh() {
        let mut index = index_of(&[(0, 3)]);
        index.add_segment(10, PathBuf::from("10"), 8);
        assert_eq!((index.start(), index.end()), (10, 10));
        assert_eq!(index.term_at(2), None);
    }
}
