//! `inspect`, `verify` and `repair` over real data directories.

use std::fs;
use std::path::Path;

use bytes::Bytes;
use mqstate_wal::segment::{encoded_record_len, SEGMENT_HEADER_LEN};
use mqstate_wal::tools::{inspect, repair, verify};
use mqstate_wal::{Snapshot, Wal, WalError, WalOptions};

fn small_segments() -> WalOptions {
    WalOptions {
        segment_soft_limit_bytes: 40,
        ..WalOptions::default()
    }
}

/// Six records of 8 bytes, two per segment (segments 0, 2, 4, and an empty 6).
fn populate(dir: &Path) {
    let (mut wal, _) = Wal::open(dir, small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(u64::from(i) / 2, &[b'a' + i; 8][..])])
            .unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
}

fn segment(dir: &Path, first_lsn: u64) -> std::path::PathBuf {
    dir.join("log").join(format!("{first_lsn:019}.log"))
}

#[test]
fn inspect_lists_every_record_with_its_position() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    wal.install_snapshot(&Snapshot {
        last_index: 1,
        last_term: 0,
        state: Bytes::from_static(b"abc"),
    })
    .unwrap();
    drop(wal);
    let report = inspect(tmp.path(), &|data| {
        String::from_utf8_lossy(data).into_owned()
    })
    .unwrap();
    assert!(
        report.problems.is_empty() && report.torn_tail.is_none(),
        "{report:?}"
    );
    assert_eq!(report.metadata, Some(mqstate_wal::Metadata::default()));
    let snapshot = report.snapshot.unwrap();
    assert_eq!((snapshot.last_index, snapshot.state_bytes), (1, 3));
    let firsts: Vec<u64> = report.segments.iter().map(|s| s.first_lsn).collect();
    assert_eq!(firsts, vec![2, 4, 6]);
    let second = &report.segments[0].records[1];
    assert_eq!(second.lsn, 3);
    assert_eq!(second.term, 1);
    assert_eq!(
        second.offset,
        (SEGMENT_HEADER_LEN + encoded_record_len(8)) as u64
    );
    assert_eq!(second.len, 8);
    assert_eq!(second.summary, "dddddddd");
}

#[test]
fn verify_accepts_a_torn_tail_but_reports_it() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let last = segment(tmp.path(), 4);
    let bytes = fs::read(&last).unwrap();
    fs::write(&last, &bytes[..bytes.len() - 10]).unwrap();
    fs::remove_file(segment(tmp.path(), 6)).unwrap();
    let report = verify(tmp.path()).unwrap();
    let torn = report.torn_tail.unwrap();
    assert!(torn.contains("0000000000000000004.log"), "{torn}");
}

#[test]
fn verify_refuses_middle_damage_and_repair_cuts_there() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let damaged = segment(tmp.path(), 2);
    let mut bytes = fs::read(&damaged).unwrap();
    let second_record = SEGMENT_HEADER_LEN + encoded_record_len(8);
    bytes[second_record + 20] ^= 0xFF;
    fs::write(&damaged, &bytes).unwrap();

    let err = verify(tmp.path()).unwrap_err();
    assert!(
        matches!(&err, WalError::Corrupt { offset, .. } if *offset == second_record as u64),
        "{err}"
    );
    let report = inspect(tmp.path(), &|_| String::new()).unwrap();
    assert_eq!(report.problems.len(), 1);
    assert!(
        report.problems[0].contains("0000000000000000002.log"),
        "{:?}",
        report.problems
    );

    let repaired = repair(tmp.path()).unwrap();
    assert_eq!(repaired.cut, Some((damaged.clone(), second_record as u64)));
    assert_eq!(
        repaired.deleted,
        vec![segment(tmp.path(), 4), segment(tmp.path(), 6)]
    );
    assert_eq!(repaired.dropped_records, 2);
    verify(tmp.path()).unwrap();
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    let kept: Vec<u8> = recovered.records.iter().map(|e| e.data[0]).collect();
    assert_eq!(kept, b"abc".to_vec());
    assert_eq!(wal.next_lsn(), 3);
}

#[test]
fn repair_of_a_healthy_directory_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    assert_eq!(repair(tmp.path()).unwrap(), Default::default());
    let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(recovered.records.len(), 6);
}

#[test]
fn a_directory_holding_only_a_copied_snapshot_verifies_and_opens() {
    let original = tempfile::tempdir().unwrap();
    populate(original.path());
    let (mut wal, _) = Wal::open(original.path(), small_segments()).unwrap();
    wal.install_snapshot(&Snapshot {
        last_index: 5,
        last_term: 0,
        state: Bytes::from_static(b"state"),
    })
    .unwrap();
    drop(wal);
    let restored = tempfile::tempdir().unwrap();
    fs::copy(
        original.path().join("mqstate.snapshot"),
        restored.path().join("mqstate.snapshot"),
    )
    .unwrap();

    let report = verify(restored.path()).unwrap();
    assert!(report.segments.is_empty(), "{report:?}");
    assert_eq!(report.snapshot.unwrap().last_index, 5);
    let (_, recovered) = Wal::open(restored.path(), small_segments()).unwrap();
    assert_eq!(
        recovered.snapshot.unwrap().state,
        Bytes::from_static(b"state")
    );
    assert!(recovered.records.is_empty());
}
