//! Incremental encoding: equal to the one-shot format when nothing changes, and exact after replay when
//! the machine changes between chunks.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::command::SetCondition;
use mqstate_protocol::{Command, Hlc};
use proptest::prelude::*;

use super::*;
use crate::delta::Delta;
use crate::limits::Limits;
use crate::machine::RequestContext;

const NODE: &str = "StateStore";
const T0: u64 = 1_700_000_000_000;

fn config() -> StoreConfig {
    StoreConfig {
        node_id: Arc::from(NODE),
        limits: Limits::default(),
    }
}

fn machine() -> StateMachine {
    StateMachine::new(config()).unwrap()
}

/// The snapshot encoder as it was before chunking (format version 1), kept as the definition of the
/// bytes a state must encode to.
fn one_shot_reference(m: &StateMachine) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(SNAPSHOT_MARKER);
    w.i32(SNAPSHOT_VERSION);
    w.hlc(&m.clock.high_water()).unwrap();
    w.i32(0); // no topics
    w.i32(i32::try_from(m.keyspace.len()).unwrap());
    for entry in m.keyspace.iter() {
        encode_entry(&mut w, &entry).unwrap();
    }
    w.i32(0); // no requests
    w.buf
}

/// One random operation: `(kind, key, value, time step)`.
type Op = (u8, u8, u8, u16);

fn op() -> impl Strategy<Value = Op> {
    (0..7u8, 0..24u8, 0..3u8, 0..200u16)
}

/// Applies `op` at `*now` (advanced by its step); returns the deltas it produced.
fn apply(m: &mut StateMachine, (kind, key, value, step): Op, now: &mut u64) -> Vec<Delta> {
    *now += u64::from(step);
    let key = Bytes::from(format!("k{key:02}"));
    let value = Bytes::from(format!("v{value}"));
    let command = match kind {
        0 | 1 => Command::Set {
            key,
            value,
            condition: SetCondition::Always,
            expiry_ms: None,
        },
        2 => Command::Set {
            key,
            value,
            condition: SetCondition::NotExistsOrEqual,
            expiry_ms: Some(100),
        },
        3 => Command::Set {
            key,
            value,
            condition: SetCondition::NotExists,
            expiry_ms: None,
        },
        4 => Command::Del { key },
        5 => Command::VDel { key, value },
        _ => return m.expire_due(*now).into_iter().map(|e| e.delta).collect(),
    };
    let ctx = RequestContext {
        client_id: Arc::from("c"),
        ts: Some(Hlc::new(*now, 0, Arc::from("client"))),
        fencing_token: None,
        now_ms: *now,
    };
    m.execute(command, &ctx).delta.into_iter().collect()
}

fn loaded(ops: &[Op]) -> (StateMachine, u64) {
    let mut m = machine();
    let mut now = T0;
    for op in ops {
        apply(&mut m, *op, &mut now);
    }
    (m, now)
}

#[test]
fn chunks_resume_after_the_cursor_and_stop_at_the_key_limit() {
    let (m, _) = loaded(&[(0, 1, 0, 0), (0, 2, 0, 0), (0, 3, 0, 0)]);
    let mut encoder = SnapshotEncoder::new(&m).unwrap();
    assert_eq!(encoder.step(&m, 2, usize::MAX).unwrap(), Progress::Continue);
    assert_eq!(encoder.count, 2);
    assert_eq!(encoder.step(&m, 2, usize::MAX).unwrap(), Progress::Done);
    assert_eq!(encoder.count, 3);
    assert_eq!(encoder.finish(&m, &[]).unwrap(), one_shot_reference(&m));
}

#[test]
fn a_chunk_stops_at_the_byte_limit_but_encodes_at_least_one_key() {
    let (m, _) = loaded(&[(0, 1, 0, 0), (0, 2, 0, 0)]);
    let mut encoder = SnapshotEncoder::new(&m).unwrap();
    assert_eq!(encoder.step(&m, usize::MAX, 1).unwrap(), Progress::Continue);
    assert_eq!(encoder.count, 1);
}

proptest! {
    #[test]
    fn chunked_encoding_of_an_unchanged_state_is_the_one_shot_encoding(
        ops in prop::collection::vec(op(), 0..80),
        max_keys in 1..6usize,
        max_bytes in 1..200usize,
    ) {
        let (m, _) = loaded(&ops);
        let mut encoder = SnapshotEncoder::new(&m).unwrap();
        while encoder.step(&m, max_keys, max_bytes).unwrap() == Progress::Continue {}
        let bytes = encoder.finish(&m, &[]).unwrap();
        prop_assert_eq!(&bytes, &one_shot_reference(&m));
        prop_assert_eq!(&m.snapshot_encode().unwrap(), &bytes);
        let restored = StateMachine::snapshot_decode(&bytes, config()).unwrap();
        prop_assert_eq!(restored.keyspace(), m.keyspace());
        prop_assert_eq!(restored.clock.high_water(), m.clock.high_water());
    }

    #[test]
    fn requests_come_back_from_a_snapshot_and_a_cut_one_is_refused(
        ops in prop::collection::vec(op(), 0..20),
        requests in prop::collection::vec(crate::request::tests::any_request(), 0..4),
    ) {
        let (m, _) = loaded(&ops);
        let bytes = SnapshotEncoder::new(&m).unwrap().finish(&m, &requests).unwrap();
        let (restored, found) = StateMachine::snapshot_decode_with_requests(&bytes, config()).unwrap();
        prop_assert_eq!(restored.keyspace(), m.keyspace());
        prop_assert_eq!(found, requests);
        for cut in 0..bytes.len() {
            prop_assert!(StateMachine::snapshot_decode(&bytes[..cut], config()).is_err());
        }
    }

    #[test]
    fn a_streamed_encoding_patched_at_the_end_is_the_one_shot_encoding(
        ops in prop::collection::vec(op(), 0..80),
        max_keys in 1..6usize,
        max_bytes in 1..200usize,
    ) {
        let (m, _) = loaded(&ops);
        let mut encoder = SnapshotEncoder::new(&m).unwrap();
        let mut streamed = encoder.take_encoded();
        while encoder.step(&m, max_keys, max_bytes).unwrap() == Progress::Continue {
            streamed.extend(encoder.take_encoded());
            prop_assert_eq!(encoder.encoded_len(), streamed.len());
        }
        streamed.extend(encoder.take_encoded());
        let end = encoder.finish_streamed(&m).unwrap();
        prop_assert_eq!(end.patches.len(), 2, "the count and the high-water mark");
        streamed.extend(end.rest);
        streamed.extend(encode_requests(&[]).unwrap());
        for patch in end.patches {
            let at = patch.offset as usize;
            streamed[at..at + patch.bytes.len()].copy_from_slice(&patch.bytes);
        }
        prop_assert_eq!(&streamed, &one_shot_reference(&m));
    }

    #[test]
    fn fuzzy_snapshot_plus_later_deltas_is_the_final_state(
        before in prop::collection::vec(op(), 0..60),
        during in prop::collection::vec((op(), 0..4usize), 0..80),
        max_keys in 1..4usize,
    ) {
        let (mut m, mut now) = loaded(&before);
        let mut encoder = SnapshotEncoder::new(&m).unwrap();
        let mut later = Vec::new();
        // Each operation is followed by `chunks` encoding steps, as the executor interleaves them.
        for (op, chunks) in during {
            later.extend(apply(&mut m, op, &mut now));
            for _ in 0..chunks {
                encoder.step(&m, max_keys, usize::MAX).unwrap();
            }
        }
        let snapshot = encoder.finish(&m, &[]).unwrap();
        let mut restored = StateMachine::snapshot_decode(&snapshot, config()).unwrap();
        for delta in &later {
            restored.apply_delta(delta);
        }
        prop_assert_eq!(restored.keyspace(), m.keyspace());
        let (restored_clock, live_clock) = (restored.clock.high_water(), m.clock.high_water());
        prop_assert!((restored_clock.wall_ms, restored_clock.counter) >= (live_clock.wall_ms, live_clock.counter));
    }
}
