//! Node-to-node frame bodies (crates/cluster): bytes from another node never panic the decoders.
//! (The Raft log is a `mqstate-wal` log; its files are fuzzed by `wal_files`.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_cluster::transport::{decode_body, encode_frame, Request, Response};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector % 2 {
        0 => {
            if let Ok(request) = decode_body::<Request>(body) {
                let frame = encode_frame(&request).expect("a decoded request encodes");
                assert!(decode_body::<Request>(&frame[4..]).is_ok());
            }
        }
        _ => {
            let _ = decode_body::<Response>(body);
        }
    }
});
