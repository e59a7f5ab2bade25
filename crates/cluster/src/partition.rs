//! Which partition a key (or a session) lives in, and which nodes a partition's chain wants.
//!
//! The hash is part of the on-disk and on-wire contract: every node and every version must map a key
//! to the same partition, so it is spelled out here rather than borrowed from a crate whose output
//! may change. It is **FNV-1a, 64 bit** over the key's bytes (offset basis `0xcbf29ce484222325`,
//! prime `0x100000001b3`), and the partition is `hash % partition_count`. Sessions are placed by
//! their client id's UTF-8 bytes with the same function. The partition count is fixed when the
//! cluster is created.

use crate::NodeId;

/// A partition's number, `0..partition_count`.
pub type PartitionId = u32;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `key`.
pub fn key_hash(key: &[u8]) -> u64 {
    key.iter().fold(FNV_OFFSET, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME)
    })
}

/// The partition of a state-store key.
pub fn partition_of(key: &[u8], partition_count: u32) -> PartitionId {
    debug_assert!(partition_count > 0);
    (key_hash(key) % u64::from(partition_count.max(1))) as PartitionId
}

/// The partition of an MQTT session, by client id.
pub fn partition_of_session(client_id: &str, partition_count: u32) -> PartitionId {
    partition_of(client_id.as_bytes(), partition_count)
}

/// The nodes partition `p` should be replicated on, head first: walking the ring of all members
/// (sorted by id) from position `p % n`, the first `replication_factor` that are up. Starting each
/// partition one position further spreads the heads evenly; skipping a down node (rather than
/// leaving a hole) replaces it with the next node on the ring, so a failure moves as few
/// partitions as possible.
pub fn ideal_chain(
    p: PartitionId,
    members: &[NodeId],
    is_up: impl Fn(NodeId) -> bool,
    replication_factor: u32,
) -> Vec<NodeId> {
    let n = members.len();
    if n == 0 {
        return Vec::new();
    }
    let want = (replication_factor as usize).min(n);
    let start = p as usize % n;
    (0..n)
        .map(|i| members[(start + i) % n])
        .filter(|&id| is_up(id))
        .take(want)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fnv1a_64() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(key_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(key_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn partitions_are_in_range_and_stable() {
        for count in [1, 7, 64, 1024] {
            for i in 0..500u32 {
                let key = format!("key-{i}");
                let p = partition_of(key.as_bytes(), count);
                assert!(p < count);
                assert_eq!(p, partition_of(key.as_bytes(), count));
            }
        }
        assert_eq!(
            partition_of_session("client-1", 64),
            partition_of(b"client-1", 64)
        );
    }

    #[test]
    fn keys_spread_over_partitions() {
        let mut counts = [0u32; 16];
        for i in 0..16_000u32 {
            counts[partition_of(format!("sensor/{i}").as_bytes(), 16) as usize] += 1;
        }
        for c in counts {
            assert!((700..1300).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn heads_are_spread_evenly_and_chains_capped_by_node_count() {
        let members = [1, 2, 3];
        let mut heads = [0; 4];
        for p in 0..30 {
            let chain = ideal_chain(p, &members, |_| true, 3);
            assert_eq!(chain.len(), 3);
            heads[chain[0] as usize] += 1;
        }
        assert_eq!(heads[1..], [10, 10, 10]);
        assert_eq!(ideal_chain(0, &[1, 2], |_| true, 3), vec![1, 2]);
        assert_eq!(ideal_chain(1, &[1, 2, 3, 4], |_| true, 2), vec![2, 3]);
        assert!(ideal_chain(0, &[], |_| true, 3).is_empty());
    }

    #[test]
    fn a_down_node_is_replaced_by_the_next_on_the_ring() {
        let members = [1, 2, 3, 4];
        assert_eq!(ideal_chain(1, &members, |id| id != 3, 2), vec![2, 4]);
        assert_eq!(ideal_chain(0, &members, |id| id == 1, 3), vec![1]);
    }
}
