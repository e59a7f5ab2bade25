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
    assert_eq!(
        report.metadata,
        Some(mqstate_wal::Metadata {
            durable_end: 6,
            last_purged: Some(mqstate_wal::LogId { term: 0, index: 1 }),
            ..mqstate_wal::Metadata::default()
        })
    );
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
fn verify_accepts_a_torn_tail_after_the_durable_end_but_says_it_is_unproven() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    // Half a record where the next one would go: a write that no fsync covered.
    let whole = fs::read(segment(tmp.path(), 4)).unwrap();
    let record = &whole[SEGMENT_HEADER_LEN..SEGMENT_HEADER_LEN + encoded_record_len(8) - 6];
    let active = segment(tmp.path(), 6);
    let mut bytes = fs::read(&active).unwrap();
    bytes.truncate(SEGMENT_HEADER_LEN);
    bytes.extend_from_slice(record);
    fs::write(&active, &bytes).unwrap();
    let report = verify(tmp.path()).unwrap();
    let torn = report.torn_tail.unwrap();
    assert!(torn.contains("0000000000000000006.log"), "{torn}");
    assert!(torn.contains("cannot be proven"), "{torn}");
}

#[test]
fn verify_refuses_a_torn_tail_below_the_durable_end() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let last = segment(tmp.path(), 4);
    let bytes = fs::read(&last).unwrap();
    fs::write(&last, &bytes[..bytes.len() - 10]).unwrap();
    fs::remove_file(segment(tmp.path(), 6)).unwrap();
    let err = verify(tmp.path()).unwrap_err();
    assert!(
        matches!(
            err,
            WalError::LostDurable {
                lsn: 5,
                durable_end: 6,
                ..
            }
        ),
        "{err}"
    );
    let repaired = repair(tmp.path(), 0).unwrap();
    assert_eq!(repaired.lost_durable, Some(5..6));
    assert_eq!(repaired.cut.map(|(path, _)| path), Some(last));
    verify(tmp.path()).unwrap();
    let (wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(wal.next_lsn(), 5);
}

#[test]
fn repair_rewrites_a_damaged_segment_header_and_keeps_every_record() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let damaged = segment(tmp.path(), 2);
    let mut bytes = fs::read(&damaged).unwrap();
    bytes[1] ^= 0x40;
    fs::write(&damaged, &bytes).unwrap();
    assert!(matches!(
        verify(tmp.path()).unwrap_err(),
        WalError::Corrupt { offset: 0, .. }
    ));
    let repaired = repair(tmp.path(), 0).unwrap();
    assert_eq!(repaired.headers_rewritten, vec![damaged]);
    assert_eq!((repaired.dropped_records, repaired.dropped_bytes), (0, 0));
    assert!(repaired.deleted.is_empty() && repaired.cut.is_none());
    let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(all(recovered.records).len(), 6, "every record kept");
}

#[test]
fn repair_counts_the_intact_records_it_drops_after_the_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), WalOptions::default()).unwrap();
    for i in 0..5u8 {
        wal.write_batch([(1, &[b'a' + i; 8][..])]).unwrap();
    }
    wal.sync().unwrap();
    drop(wal);
    let path = segment(tmp.path(), 0);
    let mut bytes = fs::read(&path).unwrap();
    let second = SEGMENT_HEADER_LEN + encoded_record_len(8);
    bytes[second] ^= 0xFF; // the record marker: its length cannot be trusted either
    fs::write(&path, &bytes).unwrap();
    let repaired = repair(tmp.path(), 0).unwrap();
    assert_eq!(repaired.cut, Some((path, second as u64)));
    assert_eq!(
        repaired.dropped_records, 3,
        "three intact records followed the damage"
    );
}

#[test]
fn a_damaged_metadata_file_is_rebuilt_by_repair() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    let metadata = tmp.path().join("mqstate.metadata");
    let mut bytes = fs::read(&metadata).unwrap();
    bytes[9] ^= 0x01;
    fs::write(&metadata, &bytes).unwrap();
    assert!(matches!(
        verify(tmp.path()).unwrap_err(),
        WalError::Corrupt { .. }
    ));
    let repaired = repair(tmp.path(), 1234).unwrap();
    let said = repaired.metadata_rebuilt.unwrap();
    assert!(
        said.contains("checksum") && said.contains("term 2"),
        "{said}"
    );
    assert_eq!(
        fs::read(tmp.path().join("mqstate.metadata.damaged")).unwrap(),
        bytes,
        "the damaged file is kept"
    );
    verify(tmp.path()).unwrap();
    let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(recovered.metadata.hlc_high_water_ms, 1234);
    assert_eq!(all(recovered.records).len(), 6);
}

#[test]
fn a_directory_that_never_held_a_log_is_not_a_data_directory() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("passwd"), b"root:x:0:0").unwrap();
    let err = verify(tmp.path()).unwrap_err();
    assert!(matches!(err, WalError::NotADataDirectory { .. }), "{err}");
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

    let repaired = repair(tmp.path(), 0).unwrap();
    assert_eq!(repaired.cut, Some((damaged.clone(), second_record as u64)));
    assert_eq!(
        repaired.deleted,
        vec![segment(tmp.path(), 4), segment(tmp.path(), 6)]
    );
    assert_eq!(repaired.dropped_records, 2);
    verify(tmp.path()).unwrap();
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    let kept: Vec<u8> = all(recovered.records).iter().map(|e| e.data[0]).collect();
    assert_eq!(kept, b"abc".to_vec());
    assert_eq!(wal.next_lsn(), 3);
}

#[test]
fn repair_of_a_healthy_directory_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    populate(tmp.path());
    assert_eq!(repair(tmp.path(), 0).unwrap(), Default::default());
    let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(all(recovered.records).len(), 6);
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
    assert!(all(recovered.records).is_empty());
}

fn all(entries: mqstate_wal::Entries) -> Vec<mqstate_wal::Entry> {
    entries.collect::<Result<_, _>>().unwrap()
}
