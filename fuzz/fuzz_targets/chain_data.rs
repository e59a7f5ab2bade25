//! The data plane's messages between nodes (crates/replication `wire`: chain messages, requests
//! forwarded to a partition's head, their answers): bytes from another node never panic the
//! decoders, and what decodes re-encodes to a message that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_replication::wire::{decode, encode, DataRequest, DataResponse};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector % 2 {
        0 => {
            if let Ok(request) = decode::<DataRequest>(body) {
                assert_eq!(decode::<DataRequest>(&encode(&request)).ok(), Some(request));
            }
        }
        _ => {
            let _ = decode::<DataResponse>(body);
        }
    }
});
