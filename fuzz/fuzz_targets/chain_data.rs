//! The data plane's messages between nodes (crates/replication `wire`: chain messages, requests
//! forwarded to a partition's head, their answers) and the state of its chain log's snapshot
//! (`compaction`: images and remembered requests, version 1 or 2): bytes from another node or the
//! disk never panic the decoders, and what decodes re-encodes to what decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_replication::compaction;
use mqstate_replication::wire::{decode, encode, DataRequest, DataResponse};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector % 3 {
        0 => {
            if let Ok(request) = decode::<DataRequest>(body) {
                assert_eq!(decode::<DataRequest>(&encode(&request)).ok(), Some(request));
            }
        }
        1 => {
            let _ = decode::<DataResponse>(body);
        }
        _ => {
            if let Ok(contents) = compaction::decode(body) {
                let again = compaction::decode(&compaction::encode(contents.clone()));
                assert_eq!(again.ok(), Some(contents));
            }
        }
    }
});
