//! Arbitrary bytes as a session-log record or snapshot image: the decoder must return an error,
//! never panic, and whatever it accepts must survive an encode/decode round trip unchanged; replaying
//! it must not panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_broker::persist::{decode_changes, encode_changes};
use mqstate_broker::Restored;

fuzz_target!(|data: &[u8]| {
    if let Ok(changes) = decode_changes(data) {
        let again = decode_changes(&encode_changes(&changes));
        assert_eq!(again.as_ref(), Ok(&changes));
        let mut restored = Restored::default();
        for change in changes {
            restored.apply(change);
        }
    }
});
