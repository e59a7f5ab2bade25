//! Arbitrary bytes as a cluster node's session row (from another node or the chain log): the
//! decoder must return an error, never panic, and a row it accepts must survive an encode/decode
//! round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_sessions::row::{decode, encode};

fuzz_target!(|data: &[u8]| {
    if let Ok(row) = decode("c", data) {
        let again = decode("c", &encode(&"c".into(), &row));
        assert_eq!(again.as_ref(), Ok(&row));
    }
});
