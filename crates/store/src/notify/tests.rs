use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::{Command, Hlc, SetCondition};

use super::*;
use crate::change::Change;
use crate::limits::Limits;
use crate::machine::{RequestContext, StateMachine, StoreConfig};

fn machine() -> StateMachine {
    StateMachine::new(StoreConfig {
        node_id: Arc::from("n"),
        limits: Limits::default(),
    })
    .unwrap()
}

fn def(max_queue: u32) -> TopicDef {
    TopicDef {
        name: "orders".into(),
        endpoint: "http://127.0.0.1:1/hook".into(),
        keys: Bytes::from_static(b"order:*"),
        events: ALL_EVENTS,
        max_queue,
    }
}

fn ctx(now_ms: u64) -> RequestContext {
    RequestContext {
        client_id: Arc::from("c"),
        ts: Some(Hlc::new(now_ms, 0, Arc::from("c"))),
        fencing_token: None,
        now_ms,
    }
}

fn set(key: &'static [u8], expiry_ms: Option<u64>) -> Command {
    Command::Set {
        key: Bytes::from_static(key),
        value: Bytes::from_static(b"v"),
        condition: SetCondition::Always,
        expiry_ms,
    }
}

/// Reserve, execute, commit: what the service does for one write. Returns the logged records.
fn write(m: &mut StateMachine, key: &'static [u8], now_ms: u64) -> Result<Vec<Change>, String> {
    let reserved = m.reserve(key, Event::Set, now_ms + 1000)?;
    let execution = m.execute(set(key, None), &ctx(now_ms));
    let delta = execution.delta.expect("a SET changes the key");
    Ok(match reserved {
        Some((reserve, _)) => {
            let (commit, _) = m.commit_reserved(&delta, Event::Set, &reserve);
            vec![Change::Queue(commit)]
        }
        None => vec![Change::Key(delta)],
    })
}

#[test]
fn a_matching_write_is_queued_in_commit_order_and_replays_identically() {
    let mut m = machine();
    let mut log = vec![Change::Queue(m.define_topic(def(10)).0)];
    for (i, key) in [&b"order:1"[..], b"other", b"order:2"]
        .into_iter()
        .enumerate()
    {
        let key: &'static [u8] = Box::leak(key.to_vec().into_boxed_slice());
        log.extend(write(&mut m, key, 100 + i as u64).unwrap());
    }
    let topic = m.topics().get("orders").unwrap();
    let seqs: Vec<_> = topic
        .entries()
        .iter()
        .map(|e| (e.seq, e.key.clone()))
        .collect();
    assert_eq!(
        seqs,
        vec![
            (1, Bytes::from_static(b"order:1")),
            (2, Bytes::from_static(b"order:2"))
        ]
    );
    assert_eq!(topic.reserved(), 0);
    let mut replayed = machine();
    for change in &log {
        let bytes = change.encode().unwrap();
        replayed.apply_change(&Change::decode(&bytes).unwrap());
    }
    let again = replayed.topics().get("orders").unwrap();
    assert_eq!(again.entries(), topic.entries());
    assert_eq!(
        (again.reserved(), again.next_reservation_id()),
        (0, topic.next_reservation_id()),
        "a commit without its reservation record replays as reserving and committing did"
    );
    assert_eq!(replayed.keyspace().len(), 3);
}

#[test]
fn a_reservation_record_then_its_commit_replay_as_before() {
    // Logs written before the reservation went into the commit record hold `V` then `A`.
    let mut m = machine();
    let mut log = vec![Change::Queue(m.define_topic(def(10)).0)];
    let (reserve, _) = m.reserve(b"order:1", Event::Set, 1000).unwrap().unwrap();
    let delta = m.execute(set(b"order:1", None), &ctx(100)).delta.unwrap();
    let (commit, _) = m.commit_reserved(&delta, Event::Set, &reserve);
    log.extend([Change::Queue(reserve), Change::Queue(commit)]);
    let mut replayed = machine();
    for change in &log {
        replayed.apply_change(change);
    }
    let (live, again) = (
        m.topics().get("orders").unwrap(),
        replayed.topics().get("orders").unwrap(),
    );
    assert_eq!(again.entries(), live.entries());
    assert_eq!((again.reserved(), again.next_reservation_id()), (0, 2));
}

#[test]
fn a_full_queue_refuses_the_reservation_and_reserved_slots_count() {
    let mut m = machine();
    m.define_topic(def(2));
    write(&mut m, b"order:1", 1).unwrap();
    let (_, undo) = m.reserve(b"order:2", Event::Set, 50).unwrap().unwrap();
    assert_eq!(m.reserve(b"order:3", Event::Set, 50).unwrap_err(), "orders");
    assert!(m.reserve(b"unrelated", Event::Set, 50).unwrap().is_none());
    // A write that did nothing releases its reservation, id included.
    m.undo_queue(undo);
    let topic = m.topics().get("orders").unwrap();
    assert_eq!((topic.used(), topic.next_reservation_id()), (1, 2));
}

#[test]
fn stale_reservations_are_aborted_after_their_deadline() {
    let mut m = machine();
    m.define_topic(def(5));
    m.reserve(b"order:1", Event::Set, 100).unwrap();
    assert!(m.abort_stale_reservations(99).is_none());
    let (abort, _) = m.abort_stale_reservations(100).unwrap();
    assert_eq!(abort, QueueDelta::Abort(vec![("orders".into(), 1)]));
    assert_eq!(m.topics().get("orders").unwrap().reserved(), 0);
}

#[test]
fn removal_is_fenced_by_the_lock_key() {
    let mut m = machine();
    m.define_topic(def(5));
    write(&mut m, b"order:1", 1).unwrap();
    let token = Hlc::new(0, 0, Arc::from("n"));
    assert_eq!(
        m.remove_acknowledged("orders", 1, b"me", &token, 10)
            .unwrap_err(),
        RemoveError::Fenced,
        "no lock key"
    );
    let lock = Command::Set {
        key: lock_key("orders"),
        value: Bytes::from_static(b"me"),
        condition: SetCondition::NotExistsOrEqual,
        expiry_ms: Some(1000),
    };
    let mine = m.execute(lock, &ctx(10)).ts.unwrap();
    assert_eq!(
        m.remove_acknowledged("orders", 1, b"other", &mine, 10)
            .unwrap_err(),
        RemoveError::Fenced
    );
    assert_eq!(
        m.remove_acknowledged("orders", 1, b"me", &mine, 2000)
            .unwrap_err(),
        RemoveError::Fenced,
        "expired lock"
    );
    let (_, undo) = m
        .remove_acknowledged("orders", 1, b"me", &mine, 10)
        .unwrap();
    assert!(m.topics().get("orders").unwrap().entries().is_empty());
    m.undo_queue(undo);
    assert_eq!(m.topics().get("orders").unwrap().entries().len(), 1);
}

#[test]
fn undo_restores_commits_and_deletes() {
    let mut m = machine();
    m.define_topic(def(5));
    let (reserve, _) = m.reserve(b"order:1", Event::Set, 100).unwrap().unwrap();
    let delta = m.execute(set(b"order:1", None), &ctx(1)).delta.unwrap();
    let (_, undo) = m.commit_reserved(&delta, Event::Set, &reserve);
    m.undo_queue(undo);
    let topic = m.topics().get("orders").unwrap();
    assert_eq!(
        (topic.entries().len(), topic.reserved(), topic.next_seq()),
        (0, 1, 1)
    );
    let (_, undo) = m.delete_topic("orders").unwrap();
    assert!(m.topics().get("orders").is_none());
    m.undo_queue(undo);
    assert_eq!(m.topics().get("orders").unwrap().reserved(), 1);
}

#[test]
fn expiries_are_queued_without_reservation_and_dropped_when_full() {
    let mut m = machine();
    m.define_topic(def(1));
    m.execute(set(b"order:1", Some(10)), &ctx(1));
    m.execute(set(b"order:2", Some(10)), &ctx(1));
    let expired = m.expire_due(100);
    assert_eq!(expired.len(), 2);
    assert!(expired[0].commit.is_some());
    assert_eq!(expired[1].dropped, vec!["orders".to_owned()]);
    let topic = m.topics().get("orders").unwrap();
    assert_eq!(topic.entries()[0].event, Event::Expire);
}

#[test]
fn an_expiry_undone_newest_first_leaves_key_and_queue_as_they_were() {
    let mut m = machine();
    m.define_topic(def(10));
    m.execute(set(b"order:1", Some(10)), &ctx(1));
    m.execute(set(b"order:2", Some(10)), &ctx(1));
    let (keys, next_seq) = (
        m.keyspace().clone(),
        m.topics().get("orders").unwrap().next_seq(),
    );
    assert!(m.topics().get("orders").unwrap().entries().is_empty());
    let expired = m.expire_due(100);
    assert_eq!(expired.len(), 2);
    assert_eq!(m.topics().get("orders").unwrap().next_seq(), next_seq + 2);
    for expiration in expired.into_iter().rev() {
        let (_, commit) = expiration.commit.expect("queued");
        m.undo_queue(commit);
        m.apply_delta(&expiration.undo);
    }
    assert_eq!(m.keyspace(), &keys, "the expired entries are back");
    let topic = m.topics().get("orders").unwrap();
    assert_eq!(
        (topic.next_seq(), topic.entries().len()),
        (next_seq, 0),
        "the expiries' entries and seqs are gone"
    );
    assert_eq!(m.next_deadline(), Some(11), "and are due again");
}

#[test]
fn snapshots_hold_topics_queues_and_reservations() {
    let mut m = machine();
    m.define_topic(def(5));
    write(&mut m, b"order:1", 1).unwrap();
    m.reserve(b"order:2", Event::Set, 77).unwrap();
    let bytes = m.snapshot_encode().unwrap();
    let restored = StateMachine::snapshot_decode(
        &bytes,
        StoreConfig {
            node_id: Arc::from("n"),
            limits: Limits::default(),
        },
    )
    .unwrap();
    let (a, b) = (
        m.topics().get("orders").unwrap(),
        restored.topics().get("orders").unwrap(),
    );
    assert_eq!(a.entries(), b.entries());
    assert_eq!(b.reserved(), 1);
    assert_eq!(b.def, a.def);
    assert_eq!(
        restored.topics().reservation_deadline("orders", 2),
        Some(77)
    );
    for cut in 0..bytes.len() {
        assert!(StateMachine::snapshot_decode(
            &bytes[..cut],
            StoreConfig {
                node_id: Arc::from("n"),
                limits: Limits::default(),
            }
        )
        .is_err());
    }
}
