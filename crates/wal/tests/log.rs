//! The synchronous log against real files: recovery, torn tails, corruption, rotation, snapshots.

use std::fs;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use mqstate_wal::segment::{encoded_record_len, SEGMENT_HEADER_LEN};
use mqstate_wal::{Entry, Snapshot, Wal, WalError, WalOptions};
use proptest::prelude::*;

fn open(dir: &Path) -> (Wal, mqstate_wal::Recovered) {
    Wal::open(dir, WalOptions::default()).unwrap()
}

fn append(wal: &mut Wal, records: &[&[u8]]) -> Vec<u64> {
    let lsns = wal.write_batch(records.iter().map(|r| (1, *r))).unwrap();
    wal.sync().unwrap();
    lsns.collect()
}

fn datas(records: &[Entry]) -> Vec<&[u8]> {
    records.iter().map(|e| &e.data[..]).collect()
}

fn segment_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir.join("log"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn segment0(dir: &Path) -> PathBuf {
    dir.join("log").join("0000000000000000000.log")
}

#[test]
fn a_fresh_directory_gets_metadata_and_an_empty_first_segment() {
    let tmp = tempfile::tempdir().unwrap();
    let (wal, recovered) = open(tmp.path());
    assert_eq!(wal.next_lsn(), 0);
    assert!(all(recovered.records).is_empty() && recovered.snapshot.is_none());
    #[rustfmt::skip]
    let fresh_metadata: Vec<u8> = [
        &[0x5A, 0x6E, 0xA0, 0x12][..], &[0, 0, 0, 3], &[0; 8], &[0xFF; 4], &[0; 4], &[0; 8],
        &[0; 8], &[0xFF; 8], &[0; 8], &[0xFF; 8], &[0; 8], &[0], &[0x2B, 0xF2, 0x07, 0xB9],
    ].concat();
    assert_eq!(
        fs::read(tmp.path().join("mqstate.metadata")).unwrap(),
        fresh_metadata
    );
    assert_eq!(
        fs::read(segment0(tmp.path())).unwrap(),
        [0x12, 0x76, 0xAD, 0x55, 0, 0, 0, 1, 0, 0, 0, 0]
    );
    assert!(tmp.path().join("temp").is_dir());
}

#[test]
fn records_survive_a_reopen_with_their_lsns_and_terms() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    assert_eq!(append(&mut wal, &[b"one", b"two"]), vec![0, 1]);
    let lsns = wal.write_batch([(7, &b"three"[..])]).unwrap();
    assert_eq!(lsns, 2..3);
    wal.sync().unwrap();
    drop(wal);
    let (wal, recovered) = open(tmp.path());
    let records = all(recovered.records);
    assert_eq!(datas(&records), vec![&b"one"[..], b"two", b"three"]);
    assert_eq!(
        records.iter().map(|e| (e.lsn, e.term)).collect::<Vec<_>>(),
        vec![(0, 1), (1, 1), (2, 7)]
    );
    assert_eq!(wal.next_lsn(), 3);
}

#[test]
fn empty_files_count_as_absent() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("log")).unwrap();
    fs::write(tmp.path().join("mqstate.snapshot"), b"").unwrap();
    fs::write(tmp.path().join("mqstate.metadata"), b"").unwrap();
    fs::write(segment0(tmp.path()), b"").unwrap();
    let (mut wal, recovered) = open(tmp.path());
    assert!(recovered.snapshot.is_none());
    assert_eq!(recovered.metadata, mqstate_wal::Metadata::default());
    append(&mut wal, &[b"x"]);
    drop(wal);
    assert_eq!(datas(&all(open(tmp.path()).1.records)), vec![&b"x"[..]]);
}

#[test]
fn a_torn_last_record_is_cut_at_every_byte_offset_and_the_log_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    append(&mut wal, &[b"first", b"second"]);
    append(&mut wal, &[b"the last one"]);
    drop(wal);
    let pristine = fs::read(segment0(tmp.path())).unwrap();
    let last_at = SEGMENT_HEADER_LEN + encoded_record_len(5) + encoded_record_len(6);
    let last_end = last_at + encoded_record_len(12);
    assert_eq!(pristine.len(), last_end + 4);

    for cut in last_at..last_end + 4 {
        let dir = tmp.path().join(format!("cut-{cut}"));
        fs::create_dir_all(dir.join("log")).unwrap();
        fs::copy(
            tmp.path().join("mqstate.metadata"),
            dir.join("mqstate.metadata"),
        )
        .unwrap();
        fs::write(segment0(&dir), &pristine[..cut]).unwrap();
        let (mut wal, recovered) = open(&dir);
        let expected: Vec<&[u8]> = if cut < last_end {
            vec![b"first", b"second"]
        } else {
            vec![b"first", b"second", b"the last one"]
        };
        assert_eq!(datas(&all(recovered.records)), expected, "cut at {cut}");
        let next = expected.len() as u64;
        assert_eq!(append(&mut wal, &[b"after"]), vec![next], "cut at {cut}");
        drop(wal);
        let mut again = expected.clone();
        again.push(b"after");
        assert_eq!(datas(&all(open(&dir).1.records)), again, "cut at {cut}");
    }
}

#[test]
fn a_damaged_last_record_is_cut_off() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    append(&mut wal, &[b"kept", b"damaged"]);
    drop(wal);
    let path = segment0(tmp.path());
    let mut bytes = fs::read(&path).unwrap();
    let damaged_at = SEGMENT_HEADER_LEN + encoded_record_len(4);
    bytes[damaged_at + 20] ^= 0x40; // a data byte: checksum mismatch
    fs::write(&path, &bytes).unwrap();
    let (_, recovered) = open(tmp.path());
    assert_eq!(datas(&all(recovered.records)), vec![&b"kept"[..]]);
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        damaged_at as u64 + 4,
        "cut at the record start"
    );
}

#[test]
fn damage_in_the_middle_is_refused_with_file_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    append(&mut wal, &[b"one", b"two", b"three"]);
    drop(wal);
    let path = segment0(tmp.path());
    let mut bytes = fs::read(&path).unwrap();
    let two_at = SEGMENT_HEADER_LEN + encoded_record_len(3);
    bytes[two_at + 20] ^= 0xFF;
    fs::write(&path, &bytes).unwrap();
    let err = Wal::open(tmp.path(), WalOptions::default()).unwrap_err();
    assert!(
        matches!(&err, WalError::Corrupt { offset, .. } if *offset == two_at as u64),
        "{err}"
    );
    let message = err.to_string();
    assert!(message.contains("0000000000000000000.log"), "{message}");
    assert!(
        message.contains(&format!("byte offset {two_at}")),
        "{message}"
    );
    assert!(message.contains("mqstate data repair"), "{message}");
    assert_eq!(
        fs::read(&path).unwrap(),
        bytes,
        "a refused open must not modify the file"
    );
}

#[test]
fn a_bad_snapshot_checksum_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    append(&mut wal, &[b"a"]);
    wal.install_snapshot(&Snapshot {
        last_index: 0,
        last_term: 1,
        state: Bytes::from_static(b"state"),
    })
    .unwrap();
    drop(wal);
    let path = tmp.path().join("mqstate.snapshot");
    let mut bytes = fs::read(&path).unwrap();
    bytes[25] ^= 1;
    fs::write(&path, &bytes).unwrap();
    let message = Wal::open(tmp.path(), WalOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("mqstate.snapshot") && message.contains("byte offset 29"),
        "{message}"
    );
}

fn small_segments() -> WalOptions {
    WalOptions {
        segment_soft_limit_bytes: 64,
        segment_hard_limit_bytes: 128,
        ..WalOptions::default()
    }
}

#[test]
fn segments_rotate_and_are_named_by_their_first_lsn() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..10u8 {
        wal.write_batch([(1, &[i; 30][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    drop(wal);
    // header 8 + two 50-byte records + end marker passes the 64-byte soft limit.
    let expected: Vec<String> = [0, 2, 4, 6, 8, 10]
        .iter()
        .map(|n| format!("{n:019}.log"))
        .collect();
    assert_eq!(segment_files(tmp.path()), expected);
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.data[0])
            .collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    assert_eq!(wal.next_lsn(), 10);
}

#[test]
fn the_hard_limit_rotates_even_without_a_sync_first() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    wal.write_batch([(1, &[0u8; 100][..])]).unwrap();
    wal.rotate_if_needed().unwrap(); // 8 + 120 + 4 > 128: rotates (and syncs)
    assert!(wal.is_synced());
    assert_eq!(segment_files(tmp.path()).len(), 2);
}

#[test]
fn a_snapshot_deletes_the_segments_it_covers() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..10u8 {
        wal.write_batch([(1, &[i; 30][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    // Records 0..=4 are in segments 0, 2 and 4; 4 also holds 5, so it stays.
    wal.install_snapshot(&Snapshot {
        last_index: 4,
        last_term: 1,
        state: Bytes::from_static(b"s"),
    })
    .unwrap();
    let expected: Vec<String> = [4, 6, 8, 10]
        .iter()
        .map(|n| format!("{n:019}.log"))
        .collect();
    assert_eq!(segment_files(tmp.path()), expected);
    drop(wal);
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(recovered.snapshot.unwrap().last_index, 4);
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.lsn)
            .collect::<Vec<_>>(),
        vec![5, 6, 7, 8, 9]
    );
    assert_eq!(wal.next_lsn(), 10);
}

#[test]
fn segments_left_by_an_interrupted_compaction_are_removed_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(1, &[i; 30][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    let snapshot = Snapshot {
        last_index: 3,
        last_term: 1,
        state: Bytes::from_static(b"s"),
    };
    mqstate_wal::write_snapshot(wal.data_dir(), &snapshot, &Default::default()).unwrap();
    drop(wal); // "crash" before the covered segments were deleted
               // Newest-first deletion had removed segment 2 but not segment 0: a gap the snapshot covers.
    fs::remove_file(tmp.path().join("log").join(format!("{:019}.log", 2))).unwrap();
    let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.lsn)
            .collect::<Vec<_>>(),
        vec![4, 5]
    );
    let expected: Vec<String> = [4, 6].iter().map(|n| format!("{n:019}.log")).collect();
    assert_eq!(segment_files(tmp.path()), expected);
}

#[test]
fn a_missing_segment_that_no_snapshot_covers_is_a_gap() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(1, &[i; 30][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    drop(wal);
    fs::remove_file(tmp.path().join("log").join(format!("{:019}.log", 2))).unwrap();
    let err = Wal::open(tmp.path(), small_segments()).unwrap_err();
    assert!(
        matches!(
            err,
            WalError::Gap {
                expected: 2,
                found: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_snapshot_ahead_of_the_log_restarts_the_log_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    append(&mut wal, &[b"a", b"b"]);
    wal.install_snapshot(&Snapshot {
        last_index: 99,
        last_term: 3,
        state: Bytes::from_static(b"s"),
    })
    .unwrap();
    assert_eq!(wal.next_lsn(), 100);
    assert_eq!(segment_files(tmp.path()), vec![format!("{:019}.log", 100)]);
    assert_eq!(append(&mut wal, &[b"c"]), vec![100]);
    drop(wal);
    let (_, recovered) = open(tmp.path());
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.lsn)
            .collect::<Vec<_>>(),
        vec![100]
    );
}

#[test]
fn oversized_records_and_terms_are_refused_without_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let options = WalOptions {
        record_max_bytes: 8,
        ..WalOptions::default()
    };
    let (mut wal, _) = Wal::open(tmp.path(), options).unwrap();
    assert!(matches!(
        wal.write_batch([(1, &[0u8; 9][..])]),
        Err(WalError::TooLarge { len: 9, max: 8, .. })
    ));
    assert!(matches!(
        wal.write_batch([(u64::MAX, &b"x"[..])]),
        Err(WalError::OutOfRange { .. })
    ));
    assert_eq!(wal.next_lsn(), 0);
    assert!(wal.failure().is_none());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_batches_read_back_identical(
        batches in proptest::collection::vec(
            proptest::collection::vec((0..1000u64, proptest::collection::vec(any::<u8>(), 0..80)), 1..6),
            0..12)
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
        for batch in &batches {
            wal.write_batch(batch.iter().map(|(t, d)| (*t, &d[..]))).unwrap();
            wal.sync().unwrap();
            wal.rotate_if_needed().unwrap();
        }
        drop(wal);
        let (_, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
        let written: Vec<(u64, u64, Vec<u8>)> = batches.iter().flatten().enumerate()
            .map(|(i, (t, d))| (i as u64, *t, d.clone())).collect();
        let read: Vec<(u64, u64, Vec<u8>)> = all(recovered.records).iter()
            .map(|e| (e.lsn, e.term, e.data.to_vec())).collect();
        prop_assert_eq!(read, written);
    }
}

#[test]
fn a_failed_log_refuses_to_sync_or_rotate_until_retried() {
    use mqstate_wal::failpoint::AFTER_WRITE_BEFORE_FSYNC;
    use mqstate_wal::{FailAction, Failpoints};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let broken = Arc::new(AtomicBool::new(false));
    let hook_broken = Arc::clone(&broken);
    let failpoints = Failpoints::with_hook(move |name| {
        match name == AFTER_WRITE_BEFORE_FSYNC && hook_broken.load(SeqCst) {
            true => FailAction::Error,
            false => FailAction::Continue,
        }
    });
    let options = WalOptions {
        failpoints,
        segment_soft_limit_bytes: 16,
        ..WalOptions::default()
    };
    let (mut wal, _) = Wal::open(tmp.path(), options).unwrap();
    append(&mut wal, &[b"kept"]);
    broken.store(true, SeqCst);
    wal.write_batch([(1, &b"lost"[..])]).unwrap();
    assert!(wal.sync().is_err());
    assert!(wal.failure().is_some());
    assert!(matches!(wal.sync(), Err(WalError::Failed { .. })));
    assert!(matches!(
        wal.write_batch([(1, &b"refused"[..])]),
        Err(WalError::Failed { .. })
    ));
    wal.rotate_if_needed().unwrap();
    assert_eq!(
        segment_files(tmp.path()).len(),
        1,
        "no rotation while failed"
    );
    assert!(wal.retry().is_err());
    broken.store(false, SeqCst);
    wal.retry().unwrap();
    assert_eq!(wal.next_lsn(), 1, "the failed record's LSN is reused");
    assert_eq!(append(&mut wal, &[b"next"]), vec![1]);
    drop(wal);
    assert_eq!(
        datas(&all(open(tmp.path()).1.records)),
        vec![&b"kept"[..], b"next"]
    );
}

#[test]
fn rotation_takes_a_segment_prepared_full_of_zeros_and_recovery_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_soft_limit_bytes: 4096,
        segment_hard_limit_bytes: 8192,
        ..WalOptions::default()
    };
    let (mut wal, _) = Wal::open(tmp.path(), options.clone()).unwrap();
    let newest = |dir: &Path| {
        let name = segment_files(dir).pop().unwrap();
        fs::metadata(dir.join("log").join(name)).unwrap().len()
    };
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut written = Vec::new();
    let mut prepared_taken = false;
    while !prepared_taken {
        assert!(
            std::time::Instant::now() < give_up,
            "no rotation took a prepared segment"
        );
        let record = vec![written.len() as u8; 300];
        append(&mut wal, &[&record]);
        written.push(record);
        let segments = segment_files(tmp.path()).len();
        wal.rotate_if_needed().unwrap();
        // A prepared segment is the whole soft limit long from the start; a plain one is a header.
        prepared_taken = segment_files(tmp.path()).len() > segments && newest(tmp.path()) == 4096;
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let more = [7u8; 300];
    append(&mut wal, &[&more]);
    written.push(more.to_vec());
    assert_eq!(newest(tmp.path()), 4096, "appends land in the zeros");
    drop(wal);

    let (wal, recovered) = Wal::open(tmp.path(), options).unwrap();
    let records = all(recovered.records);
    let got: Vec<&[u8]> = datas(&records);
    let want: Vec<&[u8]> = written.iter().map(|r| &r[..]).collect();
    assert_eq!(got, want);
    assert_eq!(wal.next_lsn(), written.len() as u64);
    assert_eq!(fs::read_dir(tmp.path().join("temp")).unwrap().count(), 0);
}

fn all(entries: mqstate_wal::Entries) -> Vec<mqstate_wal::Entry> {
    entries.collect::<Result<_, _>>().unwrap()
}

// ---------------------------------------------------------------------------------------------
// The durable end: damage to acknowledged records is refused, not cut
// ---------------------------------------------------------------------------------------------

/// Three records, fsynced and recorded as durable (what a graceful stop leaves).
fn three_durable(dir: &Path) -> PathBuf {
    let (mut wal, _) = open(dir);
    append(&mut wal, &[b"one", b"two", b"three"]);
    wal.mark_durable().unwrap();
    assert_eq!(wal.metadata().durable_end, 3);
    segment0(dir)
}

#[test]
fn a_damaged_last_record_below_the_durable_end_is_refused_not_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let path = three_durable(tmp.path());
    let last_at = SEGMENT_HEADER_LEN + 2 * encoded_record_len(3);
    let mut bytes = fs::read(&path).unwrap();
    bytes[last_at + 20] ^= 0x01; // a data byte of "three"
    fs::write(&path, &bytes).unwrap();
    let err = Wal::open(tmp.path(), WalOptions::default()).unwrap_err();
    match &err {
        WalError::LostDurable {
            lsn, durable_end, ..
        } => assert_eq!((*lsn, *durable_end), (2, 3)),
        other => panic!("expected LostDurable, got {other}"),
    }
    let message = err.to_string();
    assert!(
        message.contains(&format!("byte offset {last_at}")),
        "{message}"
    );
    assert!(message.contains("mqstate data repair"), "{message}");
    assert_eq!(fs::read(&path).unwrap(), bytes, "nothing was cut");
}

#[test]
fn a_log_cut_short_below_the_durable_end_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = three_durable(tmp.path());
    // Cut exactly after the first record: every byte left is intact.
    let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len((SEGMENT_HEADER_LEN + encoded_record_len(3)) as u64)
        .unwrap();
    drop(file);
    let err = Wal::open(tmp.path(), WalOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            WalError::LostDurable {
                lsn: 1,
                durable_end: 3,
                ..
            }
        ),
        "{err}"
    );
    fs::remove_file(&path).unwrap();
    let err = Wal::open(tmp.path(), WalOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            WalError::LostDurable {
                lsn: 0,
                durable_end: 3,
                ..
            }
        ),
        "a deleted segment is a loss too: {err}"
    );
}

#[test]
fn a_graceful_writer_shutdown_records_the_durable_end() {
    let tmp = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (wal, _) = open(tmp.path());
        let writer = mqstate_wal::WalWriter::spawn(wal).unwrap();
        for data in [&b"a"[..], b"b"] {
            writer
                .append(1, Bytes::copy_from_slice(data))
                .await
                .unwrap()
                .await
                .unwrap();
        }
        writer.shutdown().await.unwrap();
    });
    let metadata = mqstate_wal::read_metadata(&mqstate_wal::DataDir::new(tmp.path()))
        .unwrap()
        .unwrap();
    assert_eq!(metadata.durable_end, 2);
}

#[test]
fn opening_a_directory_with_a_log_but_no_metadata_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    three_durable(tmp.path());
    fs::remove_file(tmp.path().join("mqstate.metadata")).unwrap();
    let err = Wal::open(tmp.path(), WalOptions::default()).unwrap_err();
    assert!(matches!(err, WalError::MetadataMissing { .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// What a replica needs
// ---------------------------------------------------------------------------------------------

#[test]
fn a_replica_appends_at_the_next_index_only() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = open(tmp.path());
    assert_eq!(wal.write_batch_at(0, [(3, &b"a"[..])]).unwrap(), 0..1);
    for wrong in [0, 2] {
        let err = wal.write_batch_at(wrong, [(3, &b"x"[..])]).unwrap_err();
        assert!(
            matches!(err, WalError::NotNext { expected: 1, found } if found == wrong),
            "{err}"
        );
    }
    assert_eq!(wal.write_batch_at(1, [(4, &b"b"[..])]).unwrap(), 1..2);
    wal.sync().unwrap();
    assert_eq!(
        (wal.term_at(0), wal.term_at(1), wal.term_at(2)),
        (Some(3), Some(4), None)
    );
}

#[test]
fn truncate_from_removes_a_suffix_across_segments_and_the_log_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(1, &[b'a' + i; 8][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    wal.mark_durable().unwrap();
    let reader = wal.reader();
    let durable = reader.durable();
    assert_eq!(*durable.borrow(), 6);
    wal.truncate_from(3).unwrap();
    assert_eq!(wal.next_lsn(), 3);
    assert_eq!(
        *durable.borrow(),
        3,
        "the durable index follows the truncation"
    );
    assert_eq!(
        wal.metadata().durable_end,
        3,
        "lowered in the metadata file"
    );
    assert_eq!(reader.bounds(), 0..3);
    assert_eq!(wal.write_batch([(2, &b"new"[..])]).unwrap(), 3..4);
    wal.sync().unwrap();
    let read: Vec<(u64, u64, Vec<u8>)> = reader
        .read(0..10)
        .unwrap()
        .into_iter()
        .map(|e| (e.lsn, e.term, e.data.to_vec()))
        .collect();
    assert_eq!(
        read,
        vec![
            (0, 1, vec![b'a'; 8]),
            (1, 1, vec![b'b'; 8]),
            (2, 1, vec![b'c'; 8]),
            (3, 2, b"new".to_vec())
        ]
    );
    drop(wal);
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.data.to_vec())
            .collect::<Vec<_>>(),
        vec![vec![b'a'; 8], vec![b'b'; 8], vec![b'c'; 8], b"new".to_vec()]
    );
    assert_eq!(wal.next_lsn(), 4);
}

#[test]
fn truncate_from_the_first_record_of_a_segment_keeps_that_segment_as_the_active_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(1, &[b'a' + i; 8][..])]).unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    wal.truncate_from(4).unwrap();
    assert_eq!(wal.write_batch([(2, &b"new"[..])]).unwrap(), 4..5);
    wal.sync().unwrap();
    let read: Vec<Vec<u8>> = wal
        .read(0..10)
        .unwrap()
        .into_iter()
        .map(|e| e.data.to_vec())
        .collect();
    assert_eq!(read.len(), 5);
    assert_eq!(read[4], b"new".to_vec());
    drop(wal);
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    let reopened: Vec<Vec<u8>> = all(recovered.records)
        .into_iter()
        .map(|e| e.data.to_vec())
        .collect();
    assert_eq!(reopened, read);
    assert_eq!(wal.next_lsn(), 5);
}

#[test]
fn reads_by_range_see_every_segment_and_the_purge_is_remembered() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), small_segments()).unwrap();
    for i in 0..6u8 {
        wal.write_batch([(u64::from(i), &[b'a' + i; 8][..])])
            .unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    let reader = wal.reader();
    let lsns: Vec<u64> = reader.read(1..5).unwrap().iter().map(|e| e.lsn).collect();
    assert_eq!(lsns, vec![1, 2, 3, 4]);
    wal.install_snapshot(&Snapshot {
        last_index: 2,
        last_term: 2,
        state: Bytes::from_static(b"s"),
    })
    .unwrap();
    let purged = Some(mqstate_wal::LogId { term: 2, index: 2 });
    assert_eq!(reader.last_purged(), purged);
    assert_eq!(reader.bounds(), 3..6);
    assert_eq!(reader.term_at(5), Some(5));
    drop(wal);
    let (wal, recovered) = Wal::open(tmp.path(), small_segments()).unwrap();
    assert_eq!(recovered.metadata.last_purged, purged);
    assert_eq!(recovered.replay, 3..6);
    assert_eq!(wal.reader().bounds(), 3..6);
    let err = {
        let (mut wal, _) = (wal, ());
        wal.truncate_from(2).unwrap_err()
    };
    assert!(
        matches!(err, WalError::TruncatePurged { lsn: 2, first: 3 }),
        "{err}"
    );
}

fn snapshot_elsewhere() -> WalOptions {
    WalOptions {
        snapshot_elsewhere: true,
        ..small_segments()
    }
}

/// openraft's log: the state machine keeps its own snapshot, so a purge stands without
/// `mqstate.snapshot` and the last purged id alone says where the log starts after a restart.
#[test]
fn with_the_snapshot_elsewhere_a_purge_alone_moves_the_start_of_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut wal, _) = Wal::open(tmp.path(), snapshot_elsewhere()).unwrap();
    for i in 0..6u8 {
        wal.write_batch_at(u64::from(i), [(1, &[b'a' + i; 8][..])])
            .unwrap();
        wal.sync().unwrap();
        wal.rotate_if_needed().unwrap();
    }
    let purged = mqstate_wal::LogId { term: 1, index: 2 };
    let obsolete = wal.compact(purged).unwrap();
    mqstate_wal::delete_segments(wal.data_dir(), &obsolete).unwrap();
    drop(wal);
    // The default options look for the snapshot that would cover the purge, and refuse.
    let err = Wal::open(tmp.path(), small_segments()).unwrap_err();
    assert!(matches!(err, WalError::PurgedPastSnapshot { .. }), "{err}");
    let (mut wal, recovered) = Wal::open(tmp.path(), snapshot_elsewhere()).unwrap();
    assert!(recovered.snapshot.is_none());
    assert_eq!(recovered.metadata.last_purged, Some(purged));
    assert_eq!(recovered.replay, 3..6);
    assert_eq!(wal.reader().bounds(), 3..6);
    assert_eq!(wal.write_batch_at(6, [(2, &b"g"[..])]).unwrap(), 6..7);
    wal.sync().unwrap();

    // A purge past the end of the log (a snapshot installed from the leader): the log restarts
    // after it, and stays so across a restart.
    let ahead = mqstate_wal::LogId { term: 3, index: 20 };
    let obsolete = wal.compact(ahead).unwrap();
    mqstate_wal::delete_segments(wal.data_dir(), &obsolete).unwrap();
    assert_eq!(wal.next_lsn(), 21);
    drop(wal);
    let (wal, recovered) = Wal::open(tmp.path(), snapshot_elsewhere()).unwrap();
    assert_eq!(recovered.metadata.last_purged, Some(ahead));
    assert_eq!(wal.next_lsn(), 21);
    assert_eq!(wal.reader().bounds(), 21..21);
}
