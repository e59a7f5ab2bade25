//! Arbitrary bytes as a state-store log record (key or queue delta, or either as a request's `J`, or
//! the previous release's `I`): decoding returns an error, never panics; what it accepts re-encodes to
//! the same bytes (an `I` is written again as a `J`) and applies to a state machine (with a topic
//! defined first, so queue records take effect) without panicking. The header-only read of the
//! record's request (`RequestRecord::of_record`) never panics and agrees with the decoded record.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use mqstate_store::notify::{TopicDef, ALL_EVENTS};
use mqstate_store::request::LEGACY_REQUESTED_MARKER;
use mqstate_store::{Change, Limits, RequestRecord, StateMachine, StoreConfig};

fuzz_target!(|data: &[u8]| {
    let header_read = RequestRecord::of_record(data);
    if let Ok(change) = Change::decode(data) {
        assert_eq!(header_read.ok(), Some(change.request().cloned()));
        if data.first() != Some(&LEGACY_REQUESTED_MARKER) {
            assert_eq!(change.encode().as_deref(), Ok(data));
        }
        let config = StoreConfig {
            node_id: Arc::from("fuzz"),
            limits: Limits::default(),
        };
        let Ok(mut machine) = StateMachine::new(config) else { return };
        machine.define_topic(TopicDef {
            name: "t".into(),
            endpoint: "http://127.0.0.1:1/".into(),
            keys: bytes::Bytes::from_static(b"*"),
            events: ALL_EVENTS,
            max_queue: 4,
        });
        machine.apply_change(&change);
        let _ = machine.snapshot_encode();
    }
});
