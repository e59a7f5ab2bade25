//! The two key spaces of a control-plane partition (decision 0047).
//!
//! Each partition of the control plane's map carries two replicas on the same chain: the state
//! store's keys (replica number = the partition) and the broker's persistent sessions, keyed by
//! client id (replica number = the partition with [`SESSIONS`] set). Two replicas rather than a
//! key prefix, so that a session row can never be a state-store key (state-store keys are any
//! bytes) and nothing that walks the store's rows (SCAN, expiry) sees a session. They share the
//! chain, the views and the node's one chain log (records are tagged with the replica number);
//! the control plane hears one catch-up per partition, once both replicas here hold every
//! committed row ([`CatchUp`]).

use std::collections::BTreeMap;

/// The bit of a replica number that marks the sessions space (partition counts stay far below).
pub const SESSIONS: u32 = 1 << 31;

/// The replica number of `partition`'s sessions space.
pub fn sessions(partition: u32) -> u32 {
    partition | SESSIONS
}

/// The control-plane partition a replica number belongs to.
pub fn control(replica: u32) -> u32 {
    replica & !SESSIONS
}

/// The replica numbers of one control-plane partition.
pub fn replicas(partition: u32) -> [u32; 2] {
    [partition, sessions(partition)]
}

/// Catch-up reports of the replicas here, per control-plane partition: a partition is caught up
/// under a view once both its replicas reported it under that view.
#[derive(Debug, Default)]
pub struct CatchUp(BTreeMap<u32, (u64, u8)>);

impl CatchUp {
    /// Replica `replica` reached `view`; returns the control partition to report caught up, once
    /// both of its replicas have reached that view.
    pub fn reached(&mut self, replica: u32, view: u64) -> Option<u32> {
        let partition = control(replica);
        let bit = if replica & SESSIONS == 0 { 1 } else { 2 };
        let entry = self.0.entry(partition).or_insert((view, 0));
        if entry.0 != view {
            *entry = (view, 0);
        }
        entry.1 |= bit;
        (entry.1 == 3).then_some(partition)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spaces_map_back_to_their_partition() {
        assert_eq!(control(sessions(5)), 5);
        assert_eq!(control(5), 5);
        assert_ne!(sessions(5), 5);
        assert_eq!(replicas(3), [3, sessions(3)]);
    }

    #[test]
    fn a_partition_is_caught_up_once_both_replicas_are_in_the_same_view() {
        let mut catch_up = CatchUp::default();
        assert_eq!(catch_up.reached(4, 7), None);
        // The sessions replica under an older view does not complete the newer one.
        assert_eq!(catch_up.reached(sessions(4), 6), None);
        assert_eq!(catch_up.reached(4, 7), None);
        assert_eq!(catch_up.reached(sessions(4), 7), Some(4));
        assert_eq!(catch_up.reached(sessions(9), 2), None);
    }
}
