//! Arbitrary bytes through a broker connection's decode and validation path (protocol probing,
//! MQTT 3.1.1/5 packet decoding, conversion, topic aliases, topic and filter validation).
//! The path must never panic, whatever the bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mqstate_broker::fuzzing::connection_bytes(data);
    // Also behind a valid MQTT 5 CONNECT, so the fuzzer reaches post-handshake packets quickly.
    let mut framed = b"\x10\x0d\x00\x04MQTT\x05\x02\x00\x00\x00\x00\x00".to_vec();
    framed.extend_from_slice(data);
    mqstate_broker::fuzzing::connection_bytes(&framed);
});
