//! The group-commit writer: batching, failure handling, fsync policies, snapshots.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use mqstate_wal::failpoint::AFTER_WRITE_BEFORE_FSYNC;
use mqstate_wal::{
    FailAction, Failpoints, FsyncPolicy, Snapshot, Wal, WalError, WalOptions, WalWriter,
};

fn reopen(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let (_, recovered) = Wal::open(dir, WalOptions::default()).unwrap();
    all(recovered.records)
        .iter()
        .map(|e| e.data.to_vec())
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn appends_queued_during_an_fsync_share_the_next_one() {
    const N: u64 = 64;
    let tmp = tempfile::tempdir().unwrap();
    let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let first_fsync = AtomicBool::new(true);
    // Holds the writer inside its first fsync until every other append is queued.
    let failpoints = Failpoints::with_hook(move |name| {
        if name == AFTER_WRITE_BEFORE_FSYNC && first_fsync.swap(false, SeqCst) {
            entered_tx.send(()).unwrap();
            release_rx.lock().unwrap().recv().unwrap();
        }
        FailAction::Continue
    });
    let (wal, _) = Wal::open(
        tmp.path(),
        WalOptions {
            failpoints,
            ..WalOptions::default()
        },
    )
    .unwrap();
    let writer = WalWriter::spawn(wal).unwrap();

    let first = writer.append(1, Bytes::from_static(b"r0")).await.unwrap();
    tokio::task::spawn_blocking(move || entered_rx.recv().unwrap())
        .await
        .unwrap();
    let mut rest = Vec::new();
    for i in 1..N {
        rest.push(
            writer
                .append(1, Bytes::from(format!("r{i}")))
                .await
                .unwrap(),
        );
    }
    release_tx.send(()).unwrap();

    assert_eq!(first.await.unwrap(), 0);
    for (i, commit) in rest.into_iter().enumerate() {
        assert_eq!(commit.await.unwrap(), i as u64 + 1);
    }
    let stats = writer.stats().snapshot();
    assert_eq!(
        stats.fsyncs,
        2,
        "one fsync for r0, one for the {} queued behind it",
        N - 1
    );
    assert_eq!(stats.largest_batch_records, N - 1);
    assert_eq!(stats.records, N);
    writer.shutdown().await.unwrap();
    let expected: Vec<Vec<u8>> = (0..N).map(|i| format!("r{i}").into_bytes()).collect();
    assert_eq!(reopen(tmp.path()), expected);
}

#[tokio::test(flavor = "current_thread")]
async fn a_failed_fsync_fails_the_batch_and_stops_the_log_until_a_retry_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let disk_broken = Arc::new(AtomicBool::new(false));
    let broken = Arc::clone(&disk_broken);
    let failpoints = Failpoints::with_hook(move |name| {
        if name == AFTER_WRITE_BEFORE_FSYNC && broken.load(SeqCst) {
            FailAction::Error
        } else {
            FailAction::Continue
        }
    });
    let (wal, _) = Wal::open(
        tmp.path(),
        WalOptions {
            failpoints,
            ..WalOptions::default()
        },
    )
    .unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let append = |data: &'static [u8]| writer.append(1, Bytes::from_static(data));

    assert_eq!(append(b"durable").await.unwrap().await.unwrap(), 0);
    disk_broken.store(true, SeqCst);
    let lost = append(b"lost").await.unwrap().await.unwrap_err();
    assert!(
        matches!(&lost, WalError::Failed { cause } if cause.contains("injected")),
        "{lost}"
    );
    let refused = append(b"refused").await.unwrap().await.unwrap_err();
    assert!(matches!(refused, WalError::Failed { .. }), "{refused}");
    assert!(
        writer.retry().await.is_err(),
        "the disk still fails, so the retry must too"
    );

    disk_broken.store(false, SeqCst);
    writer.retry().await.unwrap();
    assert_eq!(append(b"after retry").await.unwrap().await.unwrap(), 1);
    assert!(writer.stats().snapshot().write_errors >= 1);
    writer.shutdown().await.unwrap();
    assert_eq!(
        reopen(tmp.path()),
        vec![b"durable".to_vec(), b"after retry".to_vec()]
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_oversized_record_is_refused_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let options = WalOptions {
        record_max_bytes: 4,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let big = writer
        .append(1, Bytes::from_static(b"too big"))
        .await
        .unwrap();
    let ok = writer.append(1, Bytes::from_static(b"ok")).await.unwrap();
    assert!(matches!(
        big.await,
        Err(WalError::TooLarge { len: 7, max: 4, .. })
    ));
    assert_eq!(ok.await.unwrap(), 0);
    writer.shutdown().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn policy_never_acknowledges_without_fsync_and_shutdown_flushes() {
    let tmp = tempfile::tempdir().unwrap();
    let options = WalOptions {
        fsync: FsyncPolicy::Never,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    for i in 0..5u64 {
        assert_eq!(
            writer
                .append(1, Bytes::from(vec![i as u8]))
                .await
                .unwrap()
                .await
                .unwrap(),
            i
        );
    }
    assert_eq!(writer.stats().snapshot().fsyncs, 0);
    let stats = Arc::clone(writer.stats());
    writer.shutdown().await.unwrap();
    assert_eq!(stats.snapshot().fsyncs, 1);
    assert_eq!(reopen(tmp.path()).len(), 5);
}

#[tokio::test(flavor = "current_thread")]
async fn a_snapshot_through_the_writer_deletes_covered_segments() {
    let tmp = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_soft_limit_bytes: 32,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options.clone()).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    for i in 0..6u8 {
        writer
            .append(1, Bytes::from(vec![i; 16]))
            .await
            .unwrap()
            .await
            .unwrap();
    }
    // 8 + 36 + 4 > 32: every record gets its own segment, and a fresh one follows the last.
    writer
        .install_snapshot(Snapshot {
            last_index: 3,
            last_term: 1,
            state: Bytes::from_static(b"state"),
        })
        .await
        .unwrap();
    let lsn = writer
        .append(1, Bytes::from_static(b"after"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(lsn, 6);
    writer.shutdown().await.unwrap();
    let mut names: Vec<String> = std::fs::read_dir(tmp.path().join("log"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let expected: Vec<String> = [4, 5, 6, 7]
        .iter()
        .map(|n| format!("{n:019}.log"))
        .collect();
    assert_eq!(names, expected);
    let (_, recovered) = Wal::open(tmp.path(), options).unwrap();
    assert_eq!(
        recovered.snapshot.unwrap().state,
        Bytes::from_static(b"state")
    );
    assert_eq!(
        all(recovered.records)
            .iter()
            .map(|e| e.lsn)
            .collect::<Vec<_>>(),
        vec![4, 5, 6]
    );
}

#[tokio::test(flavor = "current_thread")]
async fn policy_interval_acknowledges_before_the_interval_fsync() {
    let tmp = tempfile::tempdir().unwrap();
    let hour = std::time::Duration::from_secs(3600);
    let options = WalOptions {
        fsync: FsyncPolicy::Interval(hour),
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    for i in 0..3u64 {
        assert_eq!(
            writer
                .append(1, Bytes::from_static(b"r"))
                .await
                .unwrap()
                .await
                .unwrap(),
            i
        );
    }
    assert_eq!(
        writer.stats().snapshot().fsyncs,
        0,
        "the interval has not passed"
    );
    writer.shutdown().await.unwrap();
    assert_eq!(reopen(tmp.path()).len(), 3);
}

fn all(entries: mqstate_wal::Entries) -> Vec<mqstate_wal::Entry> {
    entries.collect::<Result<_, _>>().unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn a_replica_appends_at_given_indexes_truncates_and_watches_the_durable_index() {
    let tmp = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(tmp.path(), WalOptions::default()).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let mut durable = writer.reader().durable();
    assert_eq!(*durable.borrow_and_update(), 0);
    for (lsn, data) in [(0, &b"a"[..]), (1, b"b"), (2, b"c")] {
        let pending = writer
            .append_at(lsn, 5, Bytes::copy_from_slice(data))
            .await
            .unwrap();
        assert_eq!(pending.await.unwrap(), lsn);
    }
    durable.changed().await.unwrap();
    assert_eq!(*durable.borrow_and_update(), 3);
    let gap = writer
        .append_at(4, 5, Bytes::from_static(b"gap"))
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(
            gap,
            WalError::NotNext {
                expected: 3,
                found: 4
            }
        ),
        "{gap}"
    );
    writer.truncate_from(1).await.unwrap();
    assert_eq!(*durable.borrow_and_update(), 1);
    let pending = writer
        .append_at(1, 6, Bytes::from_static(b"B"))
        .await
        .unwrap();
    assert_eq!(pending.await.unwrap(), 1);
    let read: Vec<(u64, u64, Vec<u8>)> = writer
        .reader()
        .read(0..10)
        .unwrap()
        .into_iter()
        .map(|e| (e.lsn, e.term, e.data.to_vec()))
        .collect();
    assert_eq!(read, vec![(0, 5, b"a".to_vec()), (1, 6, b"B".to_vec())]);
    writer.shutdown().await.unwrap();
    assert_eq!(reopen(tmp.path()), vec![b"a".to_vec(), b"B".to_vec()]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_streamed_snapshot_is_installed_and_purges_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(tmp.path(), WalOptions::default()).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    for data in [&b"a"[..], b"b", b"c"] {
        writer
            .append(1, Bytes::copy_from_slice(data))
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    let feeder = tokio::spawn(async move {
        for chunk in [&b"sta"[..], b"te"] {
            tx.send(Bytes::copy_from_slice(chunk)).await.unwrap();
        }
    });
    let upto = mqstate_wal::LogId { term: 1, index: 1 };
    writer
        .install_streamed_snapshot(upto, move |file| {
            while let Some(chunk) = rx.blocking_recv() {
                file.write(&chunk)?;
            }
            Ok(())
        })
        .await
        .unwrap();
    feeder.await.unwrap();
    assert_eq!(writer.reader().last_purged(), Some(upto));
    writer.shutdown().await.unwrap();
    let (_, recovered) = Wal::open(tmp.path(), WalOptions::default()).unwrap();
    let snapshot = recovered.snapshot.unwrap();
    assert_eq!(
        (snapshot.last_index, &snapshot.state[..]),
        (1, &b"state"[..])
    );
    let replayed: Vec<Vec<u8>> = recovered
        .records
        .map(|e| e.unwrap().data.to_vec())
        .collect();
    assert_eq!(replayed, vec![b"c".to_vec()]);
}

/// `Committer::Caller` (the simulation's writer): the record is written and fsynced by the time
/// `append` returns, segments rotate into prepared ones made in the caller, and what was appended
/// reads back after a reopen.
#[tokio::test(flavor = "current_thread")]
async fn an_inline_writer_is_durable_when_append_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let options = || WalOptions {
        committer: mqstate_wal::Committer::Caller,
        segment_soft_limit_bytes: 4096,
        segment_hard_limit_bytes: 8192,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options()).unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let mut durable = writer.reader().durable();
    let mut expected = Vec::new();
    for i in 0..200u64 {
        let data = format!("record {i:04} {}", "x".repeat(64));
        expected.push(data.clone().into_bytes());
        let before = *durable.borrow_and_update();
        let commit = writer.append(1, Bytes::from(data)).await.unwrap();
        assert_eq!(
            *durable.borrow_and_update(),
            before + 1,
            "record {i} is durable before its commit is awaited"
        );
        let lsn = tokio::time::timeout(std::time::Duration::ZERO, commit)
            .await
            .expect("the commit of an inline append is ready")
            .unwrap();
        assert_eq!(lsn, before, "the next LSN is the durable end before it");
    }
    let segments = std::fs::read_dir(tmp.path().join("log")).unwrap().count();
    assert!(segments > 2, "segments rotated: {segments}");
    writer.shutdown().await.unwrap();
    assert_eq!(reopen(tmp.path()), expected);
}

/// `Committer::Owner` (the state store's log): appends wait in the queue until the owner's
/// `commit_queued`, which writes and fsyncs them as one batch; a full queue is written out to make
/// room instead of waiting for a commit nobody else would make.
#[tokio::test(flavor = "current_thread")]
async fn an_owned_log_commits_what_was_queued_as_one_batch_when_its_owner_says() {
    let tmp = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(
        tmp.path(),
        WalOptions {
            committer: mqstate_wal::Committer::Owner,
            queue_capacity: 4,
            ..WalOptions::default()
        },
    )
    .unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let durable = writer.reader().durable();
    let mut commits = Vec::new();
    for i in 0..3u8 {
        commits.push(writer.append(1, Bytes::from(vec![i])).await.unwrap());
    }
    assert_eq!(
        *durable.borrow(),
        0,
        "nothing written before the owner commits"
    );
    assert_eq!(writer.stats().snapshot().fsyncs, 0);
    writer.commit_queued();
    assert_eq!(*durable.borrow(), 3, "the three records are durable");
    let stats = writer.stats().snapshot();
    assert_eq!(
        (stats.batches, stats.fsyncs),
        (1, 1),
        "one batch, one fsync"
    );
    for (lsn, commit) in commits.into_iter().enumerate() {
        let done = tokio::time::timeout(std::time::Duration::ZERO, commit)
            .await
            .expect("the commit is complete once the owner committed");
        assert_eq!(done.unwrap(), lsn as u64);
    }
    // Ten appends into a queue of four, with no commit in between: none waits forever.
    for i in 3..13u8 {
        writer.append(1, Bytes::from(vec![i])).await.unwrap();
    }
    writer.commit_queued();
    assert_eq!(*durable.borrow(), 13);
    writer.shutdown().await.unwrap();
    assert_eq!(
        reopen(tmp.path()),
        (0..13u8).map(|i| vec![i]).collect::<Vec<_>>()
    );
}

/// The relaxed fsync policies need the writer thread's timer: an owned log under them gets one.
#[tokio::test(flavor = "current_thread")]
async fn an_owned_log_without_fsync_always_keeps_the_writer_thread() {
    let tmp = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(
        tmp.path(),
        WalOptions {
            committer: mqstate_wal::Committer::Owner,
            fsync: FsyncPolicy::Never,
            ..WalOptions::default()
        },
    )
    .unwrap();
    let writer = WalWriter::spawn(wal).unwrap();
    let commit = writer.append(1, Bytes::from_static(b"a")).await.unwrap();
    assert_eq!(commit.await.unwrap(), 0, "written without commit_queued");
    writer.shutdown().await.unwrap();
}
