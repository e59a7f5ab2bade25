//! The brokers' mesh messages between nodes (crates/mesh `wire`: batches of routes, publishes,
//! claims and retained messages, their answers): bytes from another node never panic the
//! decoders, what decodes re-encodes to the same value, and its messages convert to the broker's
//! or are refused.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mqstate_mesh::wire::{decode, encode, Batch, Item, Reply};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector % 2 {
        0 => {
            if let Ok(batch) = decode::<Batch>(body) {
                assert_eq!(decode::<Batch>(&encode(&batch)).ok(), Some(batch.clone()));
                for item in batch.items {
                    if let Item::Publish(p) = item {
                        let _ = p.message.into_message();
                    }
                }
            }
        }
        _ => {
            let _ = decode::<Reply>(body);
        }
    }
});
