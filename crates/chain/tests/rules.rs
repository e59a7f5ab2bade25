//! One test per rule of the seed (RTable, seed 002), each driven step by step.

mod harness;

use harness::{version, view, Cluster};
use mqstate_chain::{Answer, Config, Expect, Item, Message, NodeId, Record, Version, Write};

fn put(key: &str, value: &str, at: u64) -> Write {
    Write {
        key: key.as_bytes().to_vec(),
        value: Some(value.as_bytes().to_vec()),
        version: version(at),
        expect: Expect::Any,
    }
}

fn written(cluster: &mut Cluster, request: u64) -> Version {
    match cluster.answer(request) {
        Some(Answer::Written { version }) => version,
        other => panic!("request {request}: {other:?}"),
    }
}

fn value(cluster: &mut Cluster, request: u64) -> Option<Vec<u8>> {
    match cluster.answer(request) {
        Some(Answer::Value { value, .. }) => value,
        other => panic!("request {request}: {other:?}"),
    }
}

/// Replicas `ids`, each in view 1's chain and read view, in that order.
fn chain(ids: &[NodeId]) -> Cluster {
    chain_with(ids, Config::default())
}

fn chain_with(ids: &[NodeId], config: Config) -> Cluster {
    let mut c = Cluster::new(ids, config);
    c.publish(&view(1, ids, ids));
    c
}

/// `write` as request `request` at `head`, through the whole chain and answered.
fn committed(c: &mut Cluster, head: NodeId, request: u64, write: Write) -> Version {
    c.with(head, |r| r.write(request, write));
    c.settle(10);
    written(c, request)
}

/// Chain 1, 2, 3 with `k` = "old" at version 1; then `k` = `value` at version 5 (request 2) made
/// durable and committed by 3 and 2 while head 1 crashes before its own fsync and restarts under
/// the same view, holding the old row. With `lose_commit`, the commit on its way to the head is
/// lost too.
fn head_lost_its_last_write(value: &str, lose_commit: bool) -> Cluster {
    let mut c = chain(&[1, 2, 3]);
    committed(&mut c, 1, 1, put("k", "old", 1));
    c.with(1, |r| r.write(2, put("k", value, 5)));
    c.deliver_all(10);
    c.sync(3, None);
    c.deliver_all(10);
    c.sync(2, None);
    c.crash(1);
    if lose_commit {
        c.net.clear();
    }
    c.restart(1);
    c.set_view(1, Some(view(1, &[1, 2, 3], &[1, 2, 3])));
    c
}

/// Every replica of 1, 2, 3 holds `key` committed (unlocked) at `at`.
fn every_replica_committed(c: &Cluster, key: &[u8], at: Version) {
    for id in [1, 2, 3] {
        let row = c.replica(id).row(key).unwrap();
        assert_eq!((row.version, row.locked), (at, false), "node {id}");
    }
}

#[test]
fn a_write_goes_head_to_tail_and_back_before_it_is_answered() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.write(10, put("k", "v", 5)));
    assert!(c.replica(1).row(b"k").is_some_and(|r| r.locked));
    // Phase 1 is pipelined: each hop forwards at once, in parallel with its own fsync.
    assert_eq!(
        c.net.len(),
        1,
        "the prepare leaves the head before its fsync"
    );
    c.deliver_all(10);
    assert!(c.replica(2).row(b"k").is_some_and(|r| r.locked));
    let tail = c.replica(3).row(b"k").cloned().unwrap();
    assert!(!tail.locked, "the tail commits at once");
    // The tail sends the commit back only once its own copy is durable.
    assert!(c.net.is_empty());
    c.sync(3, None);
    c.deliver_all(1);
    // The commit reached the middle before its fsync: remembered, not passed on yet.
    assert!(c.net.is_empty());
    assert!(c.replica(2).row(b"k").unwrap().locked);
    c.sync(2, None);
    assert!(!c.replica(2).row(b"k").unwrap().locked);
    c.deliver_all(1);
    assert!(c.answer(10).is_none(), "not before the head's own fsync");
    c.sync(1, None);
    assert_eq!(written(&mut c, 10), version(5));
    assert!(!c.replica(1).row(b"k").unwrap().locked);
    // Not the head: forward.
    c.with(2, |r| r.read(11, b"k".to_vec()));
    assert_eq!(c.answer(11), Some(Answer::NotHead { head: Some(1) }));
}

#[test]
fn versions_never_go_backwards_and_conditions_are_checked_at_the_head() {
    let mut c = chain(&[1, 2]);
    committed(&mut c, 1, 1, put("k", "a", 10));
    c.with(1, |r| r.write(2, put("k", "b", 10)));
    assert_eq!(
        c.answer(2),
        Some(Answer::StaleVersion {
            current: version(10)
        })
    );
    let mut nx = put("k", "c", 11);
    nx.expect = Expect::Absent;
    c.with(1, |r| r.write(3, nx));
    assert_eq!(
        c.answer(3),
        Some(Answer::ConditionFailed {
            current: Some(version(10))
        })
    );
    let mut cas = put("k", "d", 12);
    cas.expect = Expect::Version(version(10));
    c.with(1, |r| r.write(4, cas));
    c.settle(10);
    assert_eq!(written(&mut c, 4), version(12));
}

/// Seed 002: "1) at T1 only R1 is in view v1, head and tail; 2) C1 inserts K1 on R1; 3) the view
/// changes to v2 and brings in R2; 4) the recovery agent finds K1 absent on R1 and declares R2 in sync
/// with R1; 5) the view changes to v3; 6) the insert completes on R1" — the tail would be ahead of
/// the chain. The insert's locked row (the locked tombstone) is in the head's state before anything
/// else happens, so the recovery scan sees the key as in flight instead of absent, and R2 is not
/// declared caught up until the insert reached it through the chain.
#[test]
fn the_insert_tombstone_race_cannot_declare_a_joining_replica_caught_up_early() {
    let mut c = Cluster::new(&[1, 2], Config::default());
    c.publish(&view(1, &[1], &[1]));
    c.set_view(2, None);
    // 2) the insert is started on R1 and is not durable yet.
    c.with(1, |r| r.write(7, put("K1", "x", 3)));
    assert!(
        c.replica(1).row(b"K1").is_some(),
        "the key exists at the head from the start of the insert"
    );
    // 3) v2 brings R2 in at the tail, write view only.
    c.pause();
    c.publish(&view(2, &[1, 2], &[1]));
    // 4) the recovery agent's scan runs, chunk by chunk, while the insert is still not durable.
    for _ in 0..5 {
        c.deliver_all(100);
        c.with(2, |r| r.tick());
        c.with(1, |r| r.tick());
        c.sync(2, None);
    }
    assert!(
        c.caught_up.is_empty(),
        "R2 is not declared in sync while K1 is in flight at the head"
    );
    assert!(c.answer(7).is_none());
    // 6) the insert completes — through R2, under v2.
    c.settle(20);
    assert_eq!(written(&mut c, 7), version(3));
    assert_eq!(c.replica(2).row(b"K1").unwrap().value, Some(b"x".to_vec()));
    assert_eq!(c.caught_up, vec![(2, 2)]);
}

/// Seed 002 figure 17: a read at the head of a locked row first completes the interrupted write
/// (Flush2pc), then answers with it.
#[test]
fn a_read_of_a_locked_row_flushes_the_interrupted_write_first() {
    let config = Config {
        // No background repair: only the read can complete the write.
        repair_batch: 0,
        resend_ticks: u64::MAX,
        ..Config::default()
    };
    let mut c = chain_with(&[1, 2, 3], config);
    committed(&mut c, 1, 1, put("k", "old", 1));
    // The next write reaches the middle; the tail dies before it gets it.
    c.with(1, |r| r.write(2, put("k", "new", 2)));
    c.sync(1, None);
    c.deliver_all(10);
    c.sync(2, None);
    c.crash(3);
    c.net.clear();
    c.pause();
    c.publish(&view(2, &[1, 2], &[1, 2]));
    c.settle(3);
    assert!(
        c.replica(1).row(b"k").unwrap().locked,
        "interrupted at the head"
    );
    assert!(
        c.replica(2).row(b"k").unwrap().locked,
        "and at the new tail"
    );
    assert!(c.answer(2).is_none());
    c.with(1, |r| r.read(3, b"k".to_vec()));
    assert!(c.answer(3).is_none(), "the read waits for the flush");
    c.settle(10);
    assert_eq!(value(&mut c, 3), Some(b"new".to_vec()));
    assert_eq!(c.replica(1).stats().flushes, 1);
    assert_eq!(written(&mut c, 2), version(2), "the writer gets its answer");
    assert!(!c.replica(2).row(b"k").unwrap().locked);
}

/// Seed 002 figure 20: a write interrupted by a failure in the middle of the chain goes onto the
/// repair queue and is completed, roll-forward, under the new view.
#[test]
fn a_write_interrupted_by_a_mid_chain_crash_is_repaired_forward() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.write(1, put("k", "v", 1)));
    c.sync(1, None);
    c.deliver_all(1);
    c.sync(2, None);
    // The middle dies after its fsync, before its forward reached the tail.
    c.crash(2);
    c.net.clear();
    assert!(c.replica(3).row(b"k").is_none());
    c.pause();
    c.publish(&view(2, &[1, 3], &[1, 3]));
    assert_eq!(c.replica(1).stats().repaired, 1);
    c.settle(10);
    assert_eq!(written(&mut c, 1), version(1));
    assert_eq!(c.replica(3).row(b"k").unwrap().value, Some(b"v".to_vec()));
    assert!(!c.replica(1).row(b"k").unwrap().locked);
    // The middle comes back with its locked row on disk: it re-enters at the tail, drops what it
    // held and is copied.
    c.restart(2);
    assert!(
        c.nodes[&2]
            .replica
            .as_ref()
            .unwrap()
            .row(b"k")
            .unwrap()
            .locked
    );
    c.pause();
    c.publish(&view(3, &[1, 3, 2], &[1, 3]));
    c.settle(20);
    assert_eq!(c.caught_up, vec![(2, 3)]);
    let row = c.replica(2).row(b"k").unwrap();
    assert!(!row.locked);
    assert_eq!(row.version, version(1));
}

/// Seed 002 "introducing a new replica": it joins at the tail, in the write view and not the read
/// view, while the head copies the rows; writes keep flowing through it; it reports caught up only
/// after the copy, and drops whatever stale rows it held before.
#[test]
fn a_replica_joins_at_the_tail_and_catches_up_while_writes_continue() {
    let config = Config {
        copy_batch: 7,
        ..Config::default()
    };
    let mut c = Cluster::new(&[1, 2, 3], config);
    c.publish(&view(1, &[1, 2], &[1, 2]));
    c.set_view(3, None);
    for i in 0..40u64 {
        c.with(1, |r| r.write(i, put(&format!("k{i:02}"), "a", 10 + i)));
    }
    c.with(1, |r| r.write(100, put("gone", "a", 5)));
    c.settle(20);
    let mut delete = put("gone", "", 6);
    delete.value = None;
    c.with(1, |r| r.write(101, delete));
    c.settle(20);
    // Node 3 comes with a stale row the head no longer has as a value.
    c.crash(3);
    c.nodes
        .get_mut(&3)
        .unwrap()
        .disk
        .durable
        .push(mqstate_chain::Record::Row {
            key: b"stale".to_vec(),
            row: mqstate_chain::Row {
                value: Some(b"old".to_vec()),
                version: version(1),
                view: 0,
                locked: true,
            },
        });
    c.restart(3);
    c.pause();
    c.publish(&view(2, &[1, 2, 3], &[1, 2]));
    assert!(c.replica(3).joining());
    // Writes during the copy, some to keys not yet copied.
    for i in 0..10u64 {
        c.with(1, |r| {
            r.write(200 + i, put(&format!("k{:02}", 39 - i), "b", 100 + i))
        });
        c.deliver_all(3);
        c.sync_all();
        c.with(1, |r| r.tick());
    }
    c.assert_images_are_their_logs();
    c.settle(50);
    c.assert_images_are_their_logs();
    assert_eq!(c.caught_up, vec![(3, 2)]);
    for i in 0..10u64 {
        written(&mut c, 200 + i);
    }
    let head: Vec<_> = c
        .replica(1)
        .rows()
        .iter()
        .map(|(k, r)| (k.clone(), r.value.clone(), r.version))
        .collect();
    let new: Vec<_> = c
        .replica(3)
        .rows()
        .iter()
        .map(|(k, r)| (k.clone(), r.value.clone(), r.version))
        .collect();
    assert_eq!(head, new, "the new tail holds exactly the head's rows");
    assert!(c.replica(3).row(b"stale").is_none());
    assert_eq!(c.replica(3).row(b"gone").unwrap().value, None);
    // Then the read view takes it in.
    c.pause();
    c.publish(&view(3, &[1, 2, 3], &[1, 2, 3]));
    assert!(!c.replica(3).joining());
    committed(&mut c, 1, 300, put("k00", "c", 500));
    c.assert_images_are_their_logs();
}

#[test]
fn messages_of_another_view_are_rejected() {
    let mut c = Cluster::new(&[1, 2], Config::default());
    c.publish(&view(2, &[1, 2], &[1, 2]));
    let stale = Message {
        view: 1,
        from: 1,
        items: vec![Item::Prepare {
            key: b"k".to_vec(),
            value: Some(b"v".to_vec()),
            version: version(1),
        }],
    };
    c.with(2, |r| r.receive(stale));
    assert!(c.replica(2).row(b"k").is_none());
    assert_eq!(c.replica(2).stats().rejected_messages, 1);
    // Without a view (no lease), nothing is acted on either.
    c.set_view(2, None);
    let current = Message {
        view: 2,
        from: 1,
        items: vec![Item::Prepare {
            key: b"k".to_vec(),
            value: Some(b"v".to_vec()),
            version: version(1),
        }],
    };
    c.with(2, |r| r.receive(current));
    assert!(c.replica(2).row(b"k").is_none());
    c.with(1, |r| r.set_view(None));
    c.with(1, |r| r.write(5, put("k", "v", 1)));
    assert_eq!(c.answer(5), Some(Answer::Unavailable));
}

#[test]
fn a_failed_head_is_replaced_by_its_successor_which_keeps_every_acknowledged_write() {
    let mut c = chain(&[1, 2, 3]);
    committed(&mut c, 1, 1, put("a", "1", 1));
    // A second write reaches the tail and is committed there, but phase 2 never reaches the head.
    c.with(1, |r| r.write(2, put("a", "2", 2)));
    c.sync(1, None);
    c.deliver_all(1);
    c.sync(2, None);
    c.deliver_all(1);
    c.sync(3, None);
    c.crash(1);
    c.net.clear();
    c.pause();
    c.publish(&view(2, &[2, 3], &[2, 3]));
    c.with(2, |r| r.read(3, b"a".to_vec()));
    c.settle(10);
    assert_eq!(
        value(&mut c, 3),
        Some(b"2".to_vec()),
        "the committed value, never an older one"
    );
}

/// A replica that re-enters after having been readable starts over, even when the record saying it
/// became readable was lost in its crash: only a restart under the very view its copy began in
/// keeps the rows copied so far.
#[test]
fn a_returning_replica_starts_over_unless_it_restarts_within_its_own_copy() {
    let mut c = Cluster::new(&[1, 2], Config::default());
    c.publish(&view(1, &[1], &[1]));
    c.set_view(2, None);
    c.with(1, |r| r.write(1, put("a", "1", 1)));
    c.settle(10);
    c.pause();
    c.publish(&view(2, &[1, 2], &[1]));
    c.settle(20);
    assert_eq!(c.caught_up, vec![(2, 2)]);
    // A restart under the same view keeps the copy.
    c.crash(2);
    c.restart(2);
    c.set_view(2, Some(view(2, &[1, 2], &[1])));
    assert!(c.replica(2).row(b"a").is_some());
    // Readable, but that record is never fsynced: the node dies at once.
    c.pause();
    c.publish(&view(3, &[1, 2], &[1, 2]));
    c.crash(2);
    c.pause();
    c.publish(&view(4, &[1], &[1]));
    c.restart(2);
    c.pause();
    c.publish(&view(5, &[1, 2], &[1]));
    assert!(
        c.replica(2).rows().is_empty(),
        "a new episode: what it held may be stale"
    );
    c.settle(20);
    assert_eq!(c.replica(2).row(b"a").unwrap().value, Some(b"1".to_vec()));
}

/// Many writes in flight per chain: one batch to persist, one message per hop, one fsync each.
#[test]
fn writes_to_different_keys_travel_together_one_batch_and_one_message_per_hop() {
    let mut c = chain(&[1, 2, 3]);
    let replica = c.nodes.get_mut(&1).unwrap().replica.as_mut().unwrap();
    for i in 0..100u64 {
        replica.write(i, put(&format!("k{i}"), "v", 1));
    }
    // One batch to persist and, pipelined, one message forwarding all of it at once.
    let mut outputs = replica.take_outputs();
    assert!(
        matches!(&outputs[..], [mqstate_chain::Output::Persist { index: 1, records }, mqstate_chain::Output::Send { to: 2, message }] if records.len() == 100 && message.items.len() == 100),
        "{outputs:?}"
    );
    outputs.remove(0);
    replica.durable(1);
    c.net.push((
        2,
        match outputs.into_iter().next() {
            Some(mqstate_chain::Output::Send { message, .. }) => message,
            _ => unreachable!(),
        },
    ));
    c.deliver_all(1);
    assert_eq!(c.nodes[&2].disk.pending.len(), 1, "one batch at the middle");
    c.settle(10);
    for i in 0..100u64 {
        written(&mut c, i);
    }
}

/// The control plane keeps survivors in place, so a replica still catching up can end up first in
/// its chain (`[3, 2, 1]`, read view `[3, 1]`, head 3 fails → `[2, 1]`, read view `[1]`). The head
/// must hold every committed row: replicas order the chain readable-first, so 1 leads and 2 is
/// copied again.
#[test]
fn a_replica_still_catching_up_never_becomes_head() {
    let mut c = Cluster::new(&[1, 2, 3], Config::default());
    c.publish(&view(1, &[3, 1], &[3, 1]));
    c.set_view(2, None);
    committed(&mut c, 3, 1, put("k", "v", 1));
    c.pause();
    c.publish(&view(2, &[3, 2, 1], &[3, 1]));
    c.crash(3);
    c.net.clear();
    c.pause();
    c.publish(&view(3, &[2, 1], &[1]));
    c.with(2, |r| r.read(2, b"k".to_vec()));
    assert_eq!(c.answer(2), Some(Answer::NotHead { head: Some(1) }));
    c.with(1, |r| r.read(3, b"k".to_vec()));
    assert_eq!(value(&mut c, 3), Some(b"v".to_vec()));
    c.settle(20);
    assert_eq!(c.caught_up, vec![(2, 3)]);
    assert_eq!(c.replica(2).row(b"k").unwrap().value, Some(b"v".to_vec()));
}

/// Messages are input from the network: any item, from anyone, under any view, never panics a
/// replica and never moves a row's version backwards (the harness checks every persisted record).
#[test]
fn arbitrary_messages_never_panic_or_move_a_version_backwards() {
    use harness::Rng;
    use mqstate_chain::CopiedRow;
    for seed in 0..200 {
        let mut rng = Rng::new(seed);
        let mut c = Cluster::new(&[1, 2, 3], Config::default());
        let v = view(5, &[1, 2, 3], &[1, 2]);
        c.publish(&v);
        for step in 0..300u64 {
            let key = format!("k{}", rng.below(4)).into_bytes();
            let version = version(rng.below(20) as u64);
            let item = match rng.below(10) {
                0 => Item::Prepare {
                    key,
                    value: Some(vec![1]),
                    version,
                },
                1 => Item::Commit { key, version },
                2 => Item::Copy {
                    seq: rng.below(5) as u64,
                    rows: vec![CopiedRow {
                        key,
                        value: None,
                        version,
                    }],
                },
                3 => Item::CopyAck {
                    seq: rng.below(5) as u64,
                },
                4 => Item::CopyDone,
                5 => Item::CopyDoneAck,
                6 => Item::Ahead {
                    key,
                    value: Some(vec![2]),
                    version,
                },
                7 => Item::Resync,
                8 => Item::Synced,
                _ => {
                    c.with(1, |r| r.write(step, put("k0", "w", 100 + step)));
                    continue;
                }
            };
            let message = Message {
                view: 4 + rng.below(3) as u64,
                from: 1 + rng.below(4) as u64,
                items: vec![item],
            };
            let to = 1 + rng.below(3) as u64;
            c.with(to, |r| r.receive(message));
            if rng.chance(1, 3) {
                c.sync_all();
            }
            if rng.chance(1, 5) {
                c.tick_all();
            }
            if rng.chance(1, 4) && !c.net.is_empty() {
                let i = rng.below(c.net.len());
                c.deliver(i);
            }
        }
        c.settle(20);
    }
}

/// An old head cut off and removed: requests still waiting there are sent to the new head (they
/// were not executed); the write it had started gets no answer from it (its outcome is the chain's).
#[test]
fn a_removed_head_sends_its_waiting_requests_to_the_new_head() {
    let mut c = chain(&[1, 2]);
    c.with(1, |r| r.write(1, put("k", "a", 1)));
    c.with(1, |r| r.read(2, b"k".to_vec()));
    c.with(1, |r| r.write(3, put("k", "b", 2)));
    c.pause();
    c.publish(&view(2, &[2], &[2]));
    assert_eq!(c.answer(2), Some(Answer::NotHead { head: Some(2) }));
    assert_eq!(c.answer(3), Some(Answer::NotHead { head: Some(2) }));
    assert_eq!(c.answer(1), None);
}

/// A request whose message expired is forgotten while it waits; the write before it completes.
#[test]
fn a_cancelled_request_is_forgotten() {
    let mut c = chain(&[1, 2]);
    c.with(1, |r| r.write(1, put("k", "a", 1)));
    c.with(1, |r| r.read(2, b"k".to_vec()));
    c.with(1, |r| r.read(3, b"k".to_vec()));
    c.with(1, |r| r.cancel(2));
    c.settle(10);
    written(&mut c, 1);
    assert_eq!(c.answer(2), None);
    assert_eq!(value(&mut c, 3), Some(b"a".to_vec()));
}

/// Pipelined fsyncs (decision 0043): a commit may reach a replica before its own fsync of the row.
/// It is remembered, not dropped, and acted on once the row is durable there; the head answers only
/// then, so every replica of the chain holds the write on disk when it is answered.
#[test]
fn a_commit_that_arrives_before_the_own_fsync_waits_for_it() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.write(1, put("k", "v", 5)));
    c.deliver_all(10);
    c.sync(3, None);
    c.deliver_all(10);
    c.sync(2, None);
    c.deliver_all(10);
    // The commit is at the head, whose own record is not durable yet.
    assert!(c.net.is_empty());
    assert!(c.replica(1).row(b"k").unwrap().locked);
    assert!(
        c.answer(1).is_none(),
        "not answered before the head's fsync"
    );
    c.with(1, |r| r.read(2, b"k".to_vec()));
    assert!(c.answer(2).is_none(), "a read waits for the write");
    // Resends while waiting change nothing.
    for _ in 0..4 {
        c.tick_all();
        c.deliver_all(20);
    }
    assert!(c.answer(1).is_none());
    c.sync(1, None);
    assert_eq!(written(&mut c, 1), version(5));
    assert_eq!(value(&mut c, 2), Some(b"v".to_vec()));
    for id in [1, 2, 3] {
        assert_eq!(
            c.nodes[&id].disk.durable_versions.get(b"k".as_slice()),
            Some(&version(5)),
            "node {id} holds the answered write on disk"
        );
    }
}

/// Pipelined fsyncs: the head forwarded a write and lost power before its own fsync, while its
/// successors made it durable and committed it. The write was never answered. Back under the same
/// view, the head holds the older row; restarted from its log, it asks its successor for its rows
/// (`Resync`), takes the later one and rolls it forward, so the replicas agree again.
#[test]
fn a_head_that_lost_a_forwarded_row_before_its_fsync_takes_it_back_from_its_successor() {
    // The commit is on its way to the head, which dies before its fsync.
    let mut c = head_lost_its_last_write("new", false);
    assert_eq!(c.replica(1).row(b"k").unwrap().version, version(1));
    c.settle(20);
    assert!(c.answer(2).is_none(), "the head never answered it");
    every_replica_committed(&c, b"k", version(5));
    c.with(1, |r| r.read(3, b"k".to_vec()));
    assert_eq!(value(&mut c, 3), Some(b"new".to_vec()));
}

/// As above, but the commit was lost too and the next write to the key at the restarted head is
/// stamped between the row it kept and the one it lost: the successor refuses the stale prepare
/// and shows the later row (`Ahead`); the head takes it, and the write is answered `StaleVersion`
/// (not executed: restamp and retry), never `Written` below a version a replica holds.
#[test]
fn a_write_below_a_row_the_head_lost_is_refused_as_stale_and_the_row_rolls_forward() {
    let mut c = head_lost_its_last_write("lost", true);
    c.with(1, |r| r.write(3, put("k", "between", 3)));
    c.settle(20);
    assert_eq!(
        c.answer(3),
        Some(Answer::StaleVersion {
            current: version(5)
        })
    );
    every_replica_committed(&c, b"k", version(5));
    c.with(1, |r| r.write(4, put("k", "after", 6)));
    c.settle(20);
    assert_eq!(written(&mut c, 4), version(6));
    assert_eq!(
        c.replica(3).row(b"k").unwrap().value,
        Some(b"after".to_vec())
    );
}

/// The notes `id`'s durable log holds.
fn durable_notes(c: &Cluster, id: NodeId) -> Vec<Vec<u8>> {
    c.nodes[&id]
        .disk
        .durable
        .iter()
        .filter_map(|record| match record {
            Record::Note { note } => Some(note.clone()),
            _ => None,
        })
        .collect()
}

/// A note (decision 0050: a request answered without a row) is answered only once every replica
/// holds it durably, and changes no row.
#[test]
fn a_note_goes_head_to_tail_and_back_before_it_is_answered() {
    let mut c = chain(&[1, 2, 3]);
    let at = committed(&mut c, 1, 1, put("k", "v", 1));
    c.with(1, |r| r.note(2, b"n".to_vec()));
    // Forwarded before the head's own fsync, like a prepare.
    c.deliver_all(10);
    c.deliver_all(10);
    assert!(c.answer(2).is_none());
    // The tail's acknowledgement waits for its fsync, the middle's for its own too.
    c.sync(3, None);
    c.deliver_all(10);
    c.sync(1, None);
    assert!(c.answer(2).is_none(), "the middle has not fsynced it");
    c.sync(2, None);
    c.deliver_all(10);
    assert_eq!(c.answer(2), Some(Answer::Noted));
    for id in [1, 2, 3] {
        assert_eq!(durable_notes(&c, id), [b"n".to_vec()], "node {id}");
    }
    every_replica_committed(&c, b"k", at);
    c.settle(5);
    for id in [1, 2, 3] {
        assert!(c.replica(id).is_quiet(), "node {id}");
    }
    c.assert_images_are_their_logs();
}

/// A note in flight when a replica fails is sent again on the new chain, as a locked row is; a
/// note held by a middle replica when the head fails reaches the tail under the new head.
#[test]
fn a_note_in_flight_across_a_failure_reaches_the_new_chain() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.note(1, b"a".to_vec()));
    c.sync(1, None);
    // The middle dies before the note went on.
    c.net.clear();
    c.crash(2);
    c.pause();
    c.publish(&view(2, &[1, 3], &[1, 3]));
    c.settle(10);
    assert_eq!(c.answer(1), Some(Answer::Noted));
    assert_eq!(durable_notes(&c, 3), [b"a".to_vec()]);

    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.note(1, b"b".to_vec()));
    c.deliver_all(1);
    c.sync(2, None);
    // The head dies with the note at the middle only: nobody is answered, the tail gets it.
    c.net.clear();
    c.crash(1);
    c.pause();
    c.publish(&view(2, &[2, 3], &[2, 3]));
    c.settle(10);
    assert_eq!(c.answer(1), None);
    assert_eq!(durable_notes(&c, 3), [b"b".to_vec()]);
    assert!(c.replica(2).is_quiet());
}

/// The notes the network carries, message by message.
fn notes_on_the_wire(c: &Cluster) -> Vec<Vec<Vec<u8>>> {
    c.net
        .iter()
        .map(|(_, message)| {
            message
                .items
                .iter()
                .filter_map(|item| match item {
                    Item::Note { note } => Some(note.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        })
        .filter(|notes| !notes.is_empty())
        .collect()
}

/// Notes taken while one is on its way are held at the head and go down together once it is
/// answered (one batch, one message per hop); each is answered only once every replica holds it.
#[test]
fn notes_taken_while_one_is_on_its_way_go_down_together_after_it() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.note(1, b"a".to_vec()));
    c.with(1, |r| r.note(2, b"c".to_vec()));
    c.with(1, |r| r.note(3, b"b".to_vec()));
    c.with(1, |r| r.note(4, b"c".to_vec()));
    let mut rounds = 0;
    while c.answer(1).is_none() {
        assert!(
            notes_on_the_wire(&c).iter().flatten().all(|n| n == b"a"),
            "only a goes down before it is answered"
        );
        assert!(c.replies.is_empty(), "nothing else is answered before a");
        c.sync_all();
        c.deliver_all(1);
        rounds += 1;
        assert!(rounds < 20, "a is never answered");
    }
    assert_eq!(
        notes_on_the_wire(&c),
        [vec![b"b".to_vec(), b"c".to_vec()]],
        "the held notes go down in one message"
    );
    assert_eq!(c.nodes[&1].disk.pending.len(), 1, "and in one batch");
    c.deliver_all(1);
    c.sync(2, None);
    assert!(
        c.replies.is_empty(),
        "not answered before the tail holds them"
    );
    c.settle(10);
    for request in [2, 3, 4] {
        assert_eq!(c.answer(request), Some(Answer::Noted), "request {request}");
    }
    for id in [1, 2, 3] {
        assert_eq!(
            durable_notes(&c, id),
            [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()],
            "node {id}"
        );
        assert!(c.replica(id).is_quiet(), "node {id}");
    }
}

/// A held note whose request gave up is never sent; one held when the head stops serving is
/// answered as a waiting request is (it was not sent).
#[test]
fn a_held_note_is_forgotten_when_cancelled_and_released_when_the_head_stops_serving() {
    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.note(1, b"a".to_vec()));
    c.with(1, |r| r.note(2, b"b".to_vec()));
    c.with(1, |r| r.note(3, b"c".to_vec()));
    c.with(1, |r| r.cancel(3));
    c.settle(10);
    assert_eq!(c.answer(1), Some(Answer::Noted));
    assert_eq!(c.answer(2), Some(Answer::Noted));
    assert_eq!(c.answer(3), None);
    for id in [1, 2, 3] {
        assert_eq!(
            durable_notes(&c, id),
            [b"a".to_vec(), b"b".to_vec()],
            "node {id}"
        );
    }

    let mut c = chain(&[1, 2, 3]);
    c.with(1, |r| r.note(1, b"a".to_vec()));
    c.with(1, |r| r.note(2, b"b".to_vec()));
    c.publish(&view(2, &[2, 3, 1], &[2, 3, 1]));
    assert_eq!(c.answer(2), Some(Answer::NotHead { head: Some(2) }));
    c.settle(10);
    assert_eq!(
        c.answer(1),
        None,
        "a was on its way: it completes unanswered"
    );
    for id in [1, 2, 3] {
        let notes = durable_notes(&c, id);
        assert!(notes.iter().all(|n| n == b"a"), "node {id}: {notes:?}");
    }
}

/// A head that is also the tail answers a note once it is durable; lost messages are resent on
/// ticks.
#[test]
fn a_note_is_resent_until_acknowledged() {
    let mut c = chain(&[1]);
    c.with(1, |r| r.note(1, b"x".to_vec()));
    assert!(c.answer(1).is_none());
    c.sync(1, None);
    assert_eq!(c.answer(1), Some(Answer::Noted));

    let mut c = chain(&[1, 2]);
    c.with(1, |r| r.note(2, b"y".to_vec()));
    c.with(1, |r| r.note(3, b"y".to_vec()));
    c.net.clear();
    c.sync(1, None);
    c.settle(10);
    assert_eq!(c.answer(2), Some(Answer::Noted));
    assert_eq!(c.answer(3), Some(Answer::Noted));
    assert_eq!(durable_notes(&c, 2), [b"y".to_vec()]);
}
