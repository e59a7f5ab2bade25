//! Arbitrary bytes through the request path: RESP framing, then command parsing. Neither may panic;
//! a payload that frames must re-encode to the same bytes (the parser accepts only canonical RESP).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use mqstate_protocol::{encode_request, parse_request, Command, RequestLimits};

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    if let Ok(args) = parse_request(&input, &RequestLimits::default()) {
        assert_eq!(encode_request(&args), input);
        if let Ok(command) = Command::parse(args) {
            assert_eq!(Command::parse(command.to_args()), Ok(command));
        }
    }
});
