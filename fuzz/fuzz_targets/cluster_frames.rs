//! Node-to-node frame bodies and Raft journal images (crates/cluster): bytes from another node or
//! from disk never panic the decoders.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_cluster::transport::{decode_body, encode_frame, Request, Response};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector % 3 {
        0 => {
            if let Ok(request) = decode_body::<Request>(body) {
                let frame = encode_frame(&request).expect("a decoded request encodes");
                assert!(decode_body::<Request>(&frame[4..]).is_ok());
            }
        }
        1 => {
            let _ = decode_body::<Response>(body);
        }
        _ => {
            let _ = mqstate_cluster::journal::scan(body);
        }
    }
});
