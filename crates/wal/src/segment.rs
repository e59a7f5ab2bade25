//! The log segment format (pure: bytes in, bytes out).
//!
//! ```text
//! file marker 12 76 AD 55 | version Int32 (1)
//! record*     AA F5 34 C4 | term Int64 | CRC UInt32 of data | data Buffer | zero padding to 4 bytes
//! end marker  00 00 00 00
//! ```
//! Every record starts 4-byte aligned (the header is 8 bytes, records are padded), which lets
//! [`scan_segment`] look for intact records after a damaged one.

use std::ops::Range;

use crate::checksum::crc32;
use crate::codec::{put_buffer, put_i32, put_i64, put_u32, to_disk_i64, Reader};
use crate::error::{Damage, FormatError, WalError};
use crate::{Lsn, Term};

pub const SEGMENT_MARKER: [u8; 4] = [0x12, 0x76, 0xAD, 0x55];
pub const SEGMENT_VERSION: i32 = 1;
pub const RECORD_MARKER: [u8; 4] = [0xAA, 0xF5, 0x34, 0xC4];
pub const END_MARKER: [u8; 4] = [0, 0, 0, 0];
/// File marker + version.
pub const SEGMENT_HEADER_LEN: usize = 8;
/// Record marker + term + checksum + data length.
pub const RECORD_HEADER_LEN: usize = 20;
const ALIGN: usize = 4;
const FILE_NAME_DIGITS: usize = 19;
const FILE_NAME_SUFFIX: &str = ".log";

/// `0000000000000000042.log` for the segment whose first record has LSN 42.
pub fn segment_file_name(first_lsn: Lsn) -> String {
    format!(
        "{first_lsn:0width$}{FILE_NAME_SUFFIX}",
        width = FILE_NAME_DIGITS
    )
}

/// The first LSN named by a segment file name, or `None` if the name is not one of ours.
pub fn parse_segment_file_name(name: &str) -> Option<Lsn> {
    let digits = name.strip_suffix(FILE_NAME_SUFFIX)?;
    if digits.len() != FILE_NAME_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The bytes of a new, empty segment: header then end marker.
pub fn empty_segment() -> Vec<u8> {
    let mut out = Vec::with_capacity(SEGMENT_HEADER_LEN + END_MARKER.len());
    out.extend_from_slice(&SEGMENT_MARKER);
    put_i32(&mut out, SEGMENT_VERSION);
    out.extend_from_slice(&END_MARKER);
    out
}

fn padding(len: usize) -> usize {
    (ALIGN - len % ALIGN) % ALIGN
}

/// Bytes one record of `data_len` bytes occupies on disk.
pub fn encoded_record_len(data_len: usize) -> usize {
    RECORD_HEADER_LEN + data_len + padding(data_len)
}

/// Appends one encoded record (without end marker) to `out`.
pub fn encode_record(term: Term, data: &[u8], out: &mut Vec<u8>) -> Result<(), WalError> {
    let term_disk = to_disk_i64(term).ok_or(WalError::OutOfRange {
        what: "term",
        value: term,
    })?;
    let start = out.len();
    out.extend_from_slice(&RECORD_MARKER);
    put_i64(out, term_disk);
    put_u32(out, crc32(data));
    put_buffer(out, data, "record")?;
    out.resize(out.len() + padding(data.len()), 0);
    debug_assert_eq!(out.len() - start, encoded_record_len(data.len()));
    Ok(())
}

/// One intact record found by [`scan_segment`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Byte offset of the record marker.
    pub offset: u64,
    pub term: Term,
    /// Where the data bytes are in the scanned buffer.
    pub data: Range<usize>,
}

/// How the scan of a segment stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentEnd {
    /// A clean end marker at this offset: the next record goes here.
    EndMarker { offset: u64 },
    /// The record at `offset` is damaged (torn, bad checksum, ...) or the end marker is missing.
    /// `intact_after` is the offset of an intact record further on, if there is one: then the
    /// damage is in the middle of the log rather than a torn tail.
    Damaged {
        offset: u64,
        damage: Damage,
        intact_after: Option<u64>,
    },
}

impl SegmentEnd {
    /// The offset where the valid part of the segment ends.
    pub fn offset(&self) -> u64 {
        match self {
            SegmentEnd::EndMarker { offset } | SegmentEnd::Damaged { offset, .. } => *offset,
        }
    }
}

/// Every intact record of a segment up to the end marker or the first damage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentScan {
    pub records: Vec<ScannedRecord>,
    pub end: SegmentEnd,
}

/// Checks the segment header; damage here makes the whole file unreadable.
pub fn decode_segment_header(bytes: &[u8]) -> Result<(), FormatError> {
    let mut r = Reader::new(bytes);
    let found = r.array4()?;
    if found != SEGMENT_MARKER {
        return Err(FormatError {
            offset: 0,
            damage: Damage::BadFileMarker {
                kind: "log segment",
                expected: SEGMENT_MARKER,
                found,
            },
        });
    }
    let version = r.i32()?;
    if version != SEGMENT_VERSION {
        return Err(FormatError {
            offset: 4,
            damage: Damage::UnsupportedVersion {
                kind: "log segment",
                found: version,
                supported: SEGMENT_VERSION,
            },
        });
    }
    Ok(())
}

/// Scans a whole segment file. `Err` only for a bad header; damage after it is a [`SegmentEnd`].
pub fn scan_segment(bytes: &[u8]) -> Result<SegmentScan, FormatError> {
    decode_segment_header(bytes)?;
    let mut records = Vec::new();
    let mut pos = SEGMENT_HEADER_LEN;
    loop {
        if bytes.len() == pos {
            let end = damaged(bytes, pos, Damage::MissingEndMarker);
            return Ok(SegmentScan { records, end });
        }
        if bytes[pos..].starts_with(&END_MARKER) {
            let end = SegmentEnd::EndMarker { offset: pos as u64 };
            return Ok(SegmentScan { records, end });
        }
        match decode_record_at(bytes, pos) {
            Ok((record, next)) => {
                records.push(record);
                pos = next;
            }
            Err(e) => {
                let end = damaged(bytes, pos, e.damage);
                return Ok(SegmentScan { records, end });
            }
        }
    }
}

fn damaged(bytes: &[u8], offset: usize, damage: Damage) -> SegmentEnd {
    let intact_after = (offset + ALIGN..bytes.len())
        .step_by(ALIGN)
        .find(|&at| bytes[at..].starts_with(&RECORD_MARKER) && decode_record_at(bytes, at).is_ok())
        .map(|at| at as u64);
    SegmentEnd::Damaged {
        offset: offset as u64,
        damage,
        intact_after,
    }
}

/// Decodes the record at `pos`; returns it and the offset just after it.
pub(crate) fn decode_record_at(
    bytes: &[u8],
    pos: usize,
) -> Result<(ScannedRecord, usize), FormatError> {
    let mut r = Reader::at(bytes, pos);
    let marker = r.array4()?;
    if marker != RECORD_MARKER {
        return Err(FormatError {
            offset: pos as u64,
            damage: Damage::BadRecordMarker(marker),
        });
    }
    let term = r.non_negative_i64("term")?;
    let stored = r.u32()?;
    let data = r.buffer(usize::MAX)?;
    let data_start = r.pos() - data.len();
    let pad = r.take(padding(data.len()))?;
    if pad.iter().any(|&b| b != 0) {
        return Err(r.error(Damage::NonZeroPadding));
    }
    let computed = crc32(data);
    if computed != stored {
        return Err(FormatError {
            offset: pos as u64,
            damage: Damage::ChecksumMismatch { stored, computed },
        });
    }
    let record = ScannedRecord {
        offset: pos as u64,
        term,
        data: data_start..data_start + data.len(),
    };
    Ok((record, r.pos()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn segment_with(records: &[(Term, &[u8])]) -> Vec<u8> {
        let mut out = empty_segment();
        out.truncate(SEGMENT_HEADER_LEN);
        for (term, data) in records {
            encode_record(*term, data, &mut out).unwrap();
        }
        out.extend_from_slice(&END_MARKER);
        out
    }

    #[test]
    fn golden_segment_with_one_record() {
        let bytes = segment_with(&[(7, b"abcde")]);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0x12, 0x76, 0xAD, 0x55][..], &[0, 0, 0, 1],       // file marker, version 1
            &[0xAA, 0xF5, 0x34, 0xC4], &[0, 0, 0, 0, 0, 0, 0, 7], // record marker, term 7
            &[0x5C, 0xA4, 0xB2, 0x0B], &[0, 0, 0, 5],            // CRC of the data, length
            b"abcde", &[0, 0, 0],                               // data, padding
            &[0, 0, 0, 0],                                      // end marker
        ].concat();
        assert_eq!(bytes, expected);
    }

    #[test]
    fn file_names_are_nineteen_digits() {
        assert_eq!(segment_file_name(645_261_357), "0000000000645261357.log");
        assert_eq!(
            parse_segment_file_name("0000000000645261357.log"),
            Some(645_261_357)
        );
        assert_eq!(parse_segment_file_name("645261357.log"), None);
        assert_eq!(parse_segment_file_name("000000000064526135x.log"), None);
        assert_eq!(parse_segment_file_name("0000000000645261357.tmp"), None);
    }

    #[test]
    fn padding_follows_the_seed_table() {
        for (len, pad) in [(1, 3), (34, 2), (1024, 0), (2051, 1)] {
            assert_eq!(padding(len), pad, "data length {len}");
        }
    }

    #[test]
    fn scan_finds_records_and_end() {
        let bytes = segment_with(&[(1, b"a"), (2, b""), (3, b"four")]);
        let scan = scan_segment(&bytes).unwrap();
        let datas: Vec<&[u8]> = scan
            .records
            .iter()
            .map(|r| &bytes[r.data.clone()])
            .collect();
        assert_eq!(datas, vec![&b"a"[..], b"", b"four"]);
        assert_eq!(
            scan.records.iter().map(|r| r.term).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(
            scan.end,
            SegmentEnd::EndMarker {
                offset: (bytes.len() - 4) as u64
            }
        );
    }

    #[test]
    fn damage_followed_by_an_intact_record_is_reported_as_middle() {
        let mut bytes = segment_with(&[(1, b"first"), (1, b"second")]);
        bytes[SEGMENT_HEADER_LEN + RECORD_HEADER_LEN] ^= 0xFF; // flip a data byte of record 1
        let scan = scan_segment(&bytes).unwrap();
        assert!(scan.records.is_empty());
        let second = (SEGMENT_HEADER_LEN + encoded_record_len(5)) as u64;
        match scan.end {
            SegmentEnd::Damaged {
                offset,
                damage: Damage::ChecksumMismatch { .. },
                intact_after,
            } => {
                assert_eq!(offset, SEGMENT_HEADER_LEN as u64);
                assert_eq!(intact_after, Some(second));
            }
            other => panic!("unexpected end {other:?}"),
        }
    }

    #[test]
    fn bad_header_is_an_error() {
        let mut bytes = empty_segment();
        bytes[5] = 9;
        assert!(matches!(
            scan_segment(&bytes).unwrap_err().damage,
            Damage::UnsupportedVersion {
                found: 0x0009_0001,
                ..
            }
        ));
    }

    proptest! {
        #[test]
        fn scan_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut with_header = empty_segment();
            with_header.truncate(SEGMENT_HEADER_LEN);
            with_header.extend_from_slice(&bytes);
            let _ = scan_segment(&bytes);
            let _ = scan_segment(&with_header);
        }

        #[test]
        fn records_round_trip(records in proptest::collection::vec(
            (0..=i64::MAX as u64, proptest::collection::vec(any::<u8>(), 0..64)), 0..16)
        ) {
            let refs: Vec<(Term, &[u8])> = records.iter().map(|(t, d)| (*t, d.as_slice())).collect();
            let bytes = segment_with(&refs);
            let scan = scan_segment(&bytes).unwrap();
            prop_assert_eq!(scan.end, SegmentEnd::EndMarker { offset: (bytes.len() - 4) as u64 });
            let back: Vec<(Term, Vec<u8>)> =
                scan.records.iter().map(|r| (r.term, bytes[r.data.clone()].to_vec())).collect();
            prop_assert_eq!(back, records);
        }
    }
}
