//! Arbitrary bytes as a log segment, a snapshot and a metadata file: the decoders must return
//! errors, never panic, and whatever they accept must encode back to the same bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use mqstate_wal::segment::{SEGMENT_MARKER, SEGMENT_VERSION};
use mqstate_wal::{
    decode_metadata, decode_snapshot, encode_metadata, encode_snapshot, scan_segment, Snapshot,
};

fuzz_target!(|data: &[u8]| {
    // As is, and behind a valid header so the record scanner sees most inputs.
    let _ = scan_segment(data);
    let mut segment = SEGMENT_MARKER.to_vec();
    segment.extend_from_slice(&SEGMENT_VERSION.to_be_bytes());
    segment.extend_from_slice(data);
    if let Ok(scan) = scan_segment(&segment) {
        let mut previous_end = 0;
        for record in &scan.records {
            assert!(record.offset as usize >= previous_end);
            assert!(record.data.end <= segment.len());
            previous_end = record.data.end;
        }
        assert!(scan.end.offset() as usize <= segment.len());
    }

    if let Ok(view) = decode_snapshot(data) {
        let snapshot = Snapshot {
            last_index: view.last_index,
            last_term: view.last_term,
            state: Bytes::copy_from_slice(view.state),
        };
        assert_eq!(encode_snapshot(&snapshot).expect("decoded snapshots re-encode"), data);
    }

    if let Ok(metadata) = decode_metadata(data) {
        let current_version = data.get(4..8) == Some(&[0, 0, 0, 3][..]);
        if current_version {
            assert_eq!(encode_metadata(&metadata).expect("decoded metadata re-encodes"), data);
        }
    }
});
