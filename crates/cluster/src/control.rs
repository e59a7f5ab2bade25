//! The control-plane state machine: members, the partition map with each partition's chain and
//! view, and node leases. Pure and deterministic — time arrives inside the commands (stamped by the
//! Raft leader), so every replica that applies the same log holds the same state.
//!
//! # Views and leases (RTable, seed `002`)
//!
//! A partition's *published view* is its chain (the write view, head first), the read view (the
//! chain without the replicas still catching up) and a view id that grows by one with every change.
//! A node **acts** on a partition only while (a) its own lease is valid by its own clock and its copy
//! of this state has reached the epoch the lease was granted at, (b) the partition has no pending
//! change in that copy, and (c) it is in the partition's chain ([`ControlState::acting_view`]).
//!
//! A change is never published directly. It is first made *pending* (RTable's "delete the current
//! configuration"): from then on no node starts acting on the partition under the old view. The new
//! view is published ([`Command::Tick`]) only when every node that could still be acting under the old
//! one has either **confirmed** — renewed its lease from a state in which the change was already
//! pending (`seen_epoch`) — or **lapsed**: lease + clock factor has passed since its last grant, by
//! the leader's clock. Hence no two nodes ever act on one partition under different views at the same
//! time, provided clocks drift apart by less than the clock factor over one lease.
//!
//! # Failure detection
//!
//! A member whose last grant is older than lease + clock factor is marked down and leaves every
//! chain (head → its successor is head; tail → its predecessor is tail); when it renews again it is up
//! and re-enters chains at the tail, in the write view but not the read view until it reports that it
//! has caught up ([`Command::CaughtUp`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::partition::{ideal_chain, PartitionId};
use crate::NodeId;

/// Timing and shape fixed when the cluster is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapConfig {
    pub partition_count: u32,
    pub replication_factor: u32,
    /// How long a grant lets a node act, by the node's clock from when it asked.
    pub lease_ms: u64,
    /// The bound on clock drift over one lease (RTable's CF).
    pub clock_factor_ms: u64,
}

/// A node's last lease grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The leader's clock when it granted.
    pub granted_ms: u64,
    pub lease_ms: u64,
    pub clock_factor_ms: u64,
    /// The epoch of the state the node had applied when it asked: its confirmation of every change
    /// made pending up to there.
    pub seen_epoch: u64,
}

impl Lease {
    /// From this moment (leader's clock) the holder cannot be acting on this grant any more.
    pub fn lapses_at_ms(&self) -> u64 {
        self.granted_ms
            .saturating_add(self.lease_ms)
            .saturating_add(self.clock_factor_ms)
    }
}

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The cluster (node-to-node) address.
    pub addr: String,
    pub up: bool,
    /// When it last counted as alive: its last grant, or when it joined (leader's clock).
    pub last_seen_ms: u64,
    pub lease: Option<Lease>,
}

/// A view not yet published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingView {
    pub chain: Vec<NodeId>,
    pub read_view: Vec<NodeId>,
    /// The epoch at which the partition became pending; renewals from this epoch on confirm.
    pub since_epoch: u64,
}

/// One partition of the key space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub id: PartitionId,
    /// Published view id; 0 before the first view.
    pub view: u64,
    /// The write view, head first.
    pub chain: Vec<NodeId>,
    /// The replicas reads may use: the chain without those still catching up, in chain order.
    pub read_view: Vec<NodeId>,
    pub pending: Option<PendingView>,
}

/// Everything the control plane agrees on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlState {
    /// `None` until the first leader created the map.
    pub config: Option<MapConfig>,
    pub members: BTreeMap<NodeId, Member>,
    pub partitions: Vec<Partition>,
    /// Leases of removed members, kept until they lapse so that no view is published under them.
    pub retired: BTreeMap<NodeId, Lease>,
    /// Grows with every change of the partition map (pending or published).
    pub epoch: u64,
    /// The latest leader clock seen in any command (time for entries that carry none).
    pub now_ms: u64,
}

/// A change proposed to the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Create the partition map (first leader; ignored once created).
    Init { config: MapConfig, now_ms: u64 },
    /// `node` asks for a lease, having applied the state up to `seen_epoch`.
    Renew {
        node: NodeId,
        seen_epoch: u64,
        now_ms: u64,
    },
    /// `node` holds these partitions' data, each as of the view id given with it: it may enter
    /// their read views. A partition whose published view has changed since is left alone (the
    /// node may have been moved, or have to copy again; it reports again under the new view).
    CaughtUp {
        node: NodeId,
        partitions: Vec<(PartitionId, u64)>,
    },
    /// The leader's periodic step: failure detection and publication of pending views.
    Tick { now_ms: u64 },
}

impl Command {
    /// The leader's clock goes into every timed command when it proposes it.
    pub fn stamped(self, leader_now_ms: u64) -> Command {
        match self {
            Command::Init { config, .. } => Command::Init {
                config,
                now_ms: leader_now_ms,
            },
            Command::Renew {
                node, seen_epoch, ..
            } => Command::Renew {
                node,
                seen_epoch,
                now_ms: leader_now_ms,
            },
            Command::Tick { .. } => Command::Tick {
                now_ms: leader_now_ms,
            },
            other => other,
        }
    }
}

/// What applying a command answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Done,
    /// A lease of this length was granted. It holds only once the node has applied the state up to
    /// `epoch`: a node whose copy is older (back from a crash or a partition) must not act on views
    /// that were replaced while it was away.
    Granted {
        lease_ms: u64,
        epoch: u64,
    },
    /// Refused, with the reason (not a member, no map yet, ...).
    Refused(String),
}

impl ControlState {
    /// Applies one command. Deterministic: the same commands give the same state everywhere.
    pub fn apply(&mut self, command: &Command) -> Outcome {
        match *command {
            Command::Init { config, now_ms } => self.init(config, now_ms),
            Command::Renew {
                node,
                seen_epoch,
                now_ms,
            } => self.renew(node, seen_epoch, now_ms),
            Command::CaughtUp {
                node,
                ref partitions,
            } => {
                for &(partition, view) in partitions {
                    self.caught_up(node, partition, view);
                }
                Outcome::Done
            }
            Command::Tick { now_ms } => {
                self.observe(now_ms);
                self.tick(now_ms);
                Outcome::Done
            }
        }
    }

    /// Members as Raft's membership has them now (voters and learners with their addresses).
    pub fn set_members(&mut self, members: &BTreeMap<NodeId, String>) {
        let now = self.now_ms;
        let removed: Vec<NodeId> = self
            .members
            .keys()
            .filter(|id| !members.contains_key(id))
            .copied()
            .collect();
        for id in removed {
            if let Some(Member {
                lease: Some(lease), ..
            }) = self.members.remove(&id)
            {
                self.retired.insert(id, lease);
            }
        }
        for (&id, addr) in members {
            let member = self.members.entry(id).or_insert_with(|| Member {
                addr: addr.clone(),
                up: true,
                last_seen_ms: now,
                lease: None,
            });
            member.addr.clone_from(addr);
        }
        self.reconcile_all();
    }

    fn observe(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    fn init(&mut self, config: MapConfig, now_ms: u64) -> Outcome {
        self.observe(now_ms);
        if self.config.is_some() {
            return Outcome::Done;
        }
        if config.partition_count == 0 || config.replication_factor == 0 {
            return Outcome::Refused(
                "partition count and replication factor must be at least 1".into(),
            );
        }
        self.config = Some(config);
        for member in self.members.values_mut() {
            member.last_seen_ms = now_ms;
        }
        let ids: Vec<NodeId> = self.members.keys().copied().collect();
        self.partitions = (0..config.partition_count)
            .map(|id| {
                let chain = ideal_chain(id, &ids, |_| true, config.replication_factor);
                Partition {
                    id,
                    view: 1,
                    read_view: chain.clone(),
                    chain,
                    pending: None,
                }
            })
            .collect();
        self.epoch += 1;
        Outcome::Done
    }

    fn renew(&mut self, node: NodeId, seen_epoch: u64, now_ms: u64) -> Outcome {
        self.observe(now_ms);
        let Some(config) = self.config else {
            return Outcome::Refused("the partition map is not created yet".into());
        };
        let Some(member) = self.members.get_mut(&node) else {
            return Outcome::Refused(format!("node {node} is not a member of the cluster"));
        };
        member.lease = Some(Lease {
            granted_ms: now_ms,
            lease_ms: config.lease_ms,
            clock_factor_ms: config.clock_factor_ms,
            seen_epoch: seen_epoch.min(self.epoch),
        });
        member.last_seen_ms = now_ms;
        if !member.up {
            member.up = true;
            self.reconcile_all();
        }
        Outcome::Granted {
            lease_ms: config.lease_ms,
            epoch: self.epoch,
        }
    }

    fn caught_up(&mut self, node: NodeId, partition: PartitionId, view: u64) {
        let Some(p) = self.partitions.get(partition as usize) else {
            return;
        };
        if p.view != view {
            return;
        }
        let (chain, read) = match &p.pending {
            Some(pending) => (&pending.chain, &pending.read_view),
            None => (&p.chain, &p.read_view),
        };
        if !chain.contains(&node) || read.contains(&node) {
            return;
        }
        let read_view = chain
            .iter()
            .copied()
            .filter(|&n| n == node || read.contains(&n))
            .collect();
        let chain = chain.clone();
        self.propose(partition, chain, read_view);
    }

    fn tick(&mut self, now_ms: u64) {
        let Some(config) = self.config else {
            return;
        };
        let mut changed = false;
        for member in self.members.values_mut() {
            let lapses_at_ms = match member.lease {
                Some(lease) => lease.lapses_at_ms(),
                // Never renewed (added but not running): counted from when it joined.
                None => member.last_seen_ms + config.lease_ms + config.clock_factor_ms,
            };
            if member.up && now_ms >= lapses_at_ms {
                member.up = false;
                changed = true;
            }
        }
        self.retired
            .retain(|_, lease| now_ms < lease.lapses_at_ms());
        if changed {
            self.reconcile_all();
        }
        for i in 0..self.partitions.len() {
            if self.may_publish(i, now_ms) {
                let p = &mut self.partitions[i];
                if let Some(pending) = p.pending.take() {
                    p.chain = pending.chain;
                    p.read_view = pending.read_view;
                    p.view += 1;
                    self.epoch += 1;
                }
            }
        }
    }

    /// Whether partition `i`'s pending view may be published at `now_ms` (leader's clock).
    fn may_publish(&self, i: usize, now_ms: u64) -> bool {
        let p = &self.partitions[i];
        let Some(pending) = &p.pending else {
            return false;
        };
        p.chain.iter().chain(p.read_view.iter()).all(|holder| {
            let lease = match self.members.get(holder) {
                Some(member) => member.lease,
                None => self.retired.get(holder).copied(),
            };
            match lease {
                None => true,
                Some(lease) => {
                    lease.seen_epoch >= pending.since_epoch || now_ms >= lease.lapses_at_ms()
                }
            }
        })
    }

    /// Recomputes every partition's wanted chain from members and their health.
    fn reconcile_all(&mut self) {
        let Some(config) = self.config else {
            return;
        };
        let ids: Vec<NodeId> = self.members.keys().copied().collect();
        for i in 0..self.partitions.len() {
            let p = &self.partitions[i];
            let (current, current_read) = match &p.pending {
                Some(pending) => (pending.chain.clone(), pending.read_view.clone()),
                None => (p.chain.clone(), p.read_view.clone()),
            };
            let target = ideal_chain(
                p.id,
                &ids,
                |id| self.members.get(&id).is_some_and(|m| m.up),
                config.replication_factor,
            );
            // Survivors keep their order (a lost head's successor leads, a lost tail's predecessor
            // ends the chain); newcomers enter at the tail. When a member leaves, the readable
            // survivors go first: a replica still catching up must never become head (it would
            // answer reads and take writes without holding every committed row; docs/chain.md).
            let mut chain: Vec<NodeId> = current
                .iter()
                .copied()
                .filter(|n| target.contains(n))
                .collect();
            if chain.len() < current.len() {
                let (readable, catching_up): (Vec<NodeId>, Vec<NodeId>) =
                    chain.iter().partition(|n| current_read.contains(n));
                chain = readable.into_iter().chain(catching_up).collect();
            }
            for n in &target {
                if !chain.contains(n) {
                    chain.push(*n);
                }
            }
            let read_view: Vec<NodeId> = chain
                .iter()
                .copied()
                .filter(|n| current_read.contains(n))
                .collect();
            if read_view.is_empty() && !current_read.is_empty() {
                // Every replica that holds all of the partition's rows is down (all leases can
                // lapse together, say while no leader renews them). A view without them could
                // never serve the partition again — a newcomer can only be copied from them — so
                // keep the view and wait for one of them to renew: no change is always safe.
                continue;
            }
            if chain != current || read_view != current_read {
                self.propose(p.id, chain, read_view);
            }
        }
    }

    /// Makes a new view of `partition` pending (or replaces the pending one, keeping when it began).
    fn propose(&mut self, partition: PartitionId, chain: Vec<NodeId>, read_view: Vec<NodeId>) {
        self.epoch += 1;
        let epoch = self.epoch;
        let p = &mut self.partitions[partition as usize];
        // A replaced pending change keeps its start: confirmations of it still hold, since nobody
        // has acted on the partition since. Even a change back to the published chain stays
        // pending (and is published under a new id): nodes may have stopped acting on it already.
        let since_epoch = p
            .pending
            .as_ref()
            .map_or(epoch, |pending| pending.since_epoch);
        p.pending = Some(PendingView {
            chain,
            read_view,
            since_epoch,
        });
    }

    /// The view under which `node` may act on `partition` according to this (local) state: the
    /// published view, if the partition has no pending change and `node` is in its chain. The
    /// caller adds the other half of the rule: its own lease must be valid.
    pub fn acting_view(&self, node: NodeId, partition: PartitionId) -> Option<u64> {
        let p = self.partitions.get(partition as usize)?;
        (p.pending.is_none() && p.chain.contains(&node)).then_some(p.view)
    }

    /// The member ids, sorted.
    pub fn member_ids(&self) -> Vec<NodeId> {
        self.members.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: u64 = 3_000;
    const CF: u64 = 1_000;

    fn config(partitions: u32) -> MapConfig {
        MapConfig {
            partition_count: partitions,
            replication_factor: 3,
            lease_ms: LEASE,
            clock_factor_ms: CF,
        }
    }

    fn members(nodes: &[NodeId]) -> BTreeMap<NodeId, String> {
        nodes.iter().map(|&id| (id, format!("n{id}"))).collect()
    }

    fn cluster(nodes: &[NodeId], partitions: u32) -> ControlState {
        let mut state = ControlState::default();
        state.set_members(&members(nodes));
        state.apply(&Command::Init {
            config: config(partitions),
            now_ms: 0,
        });
        state
    }

    fn renew_all(state: &mut ControlState, nodes: &[NodeId], now_ms: u64) {
        for &node in nodes {
            let seen_epoch = state.epoch;
            let granted = state.apply(&Command::Renew {
                node,
                seen_epoch,
                now_ms,
            });
            assert!(
                matches!(granted, Outcome::Granted { lease_ms: LEASE, epoch } if epoch == state.epoch),
                "{granted:?}"
            );
        }
    }

    #[test]
    fn init_creates_rotated_chains_with_equal_views() {
        let state = cluster(&[1, 2, 3], 6);
        let heads: Vec<NodeId> = state.partitions.iter().map(|p| p.chain[0]).collect();
        assert_eq!(heads, [1, 2, 3, 1, 2, 3]);
        for p in &state.partitions {
            assert_eq!(p.view, 1);
            assert_eq!(p.chain.len(), 3);
            assert_eq!(p.read_view, p.chain);
            assert_eq!(state.acting_view(p.chain[2], p.id), Some(1));
        }
        // Init is applied once: a second leader's Init changes nothing.
        let mut again = state.clone();
        again.apply(&Command::Init {
            config: config(99),
            now_ms: 5,
        });
        assert_eq!(again.partitions, state.partitions);
    }

    #[test]
    fn the_replication_factor_is_capped_by_the_node_count() {
        let state = cluster(&[7, 9], 4);
        assert!(state.partitions.iter().all(|p| p.chain.len() == 2));
    }

    #[test]
    fn renewal_needs_a_map_and_membership() {
        let mut state = ControlState::default();
        state.set_members(&[(1, "a".to_owned())].into());
        assert!(matches!(
            state.apply(&Command::Renew {
                node: 1,
                seen_epoch: 0,
                now_ms: 1
            }),
            Outcome::Refused(_)
        ));
        state.apply(&Command::Init {
            config: config(2),
            now_ms: 1,
        });
        assert!(matches!(
            state.apply(&Command::Renew { node: 5, seen_epoch: 0, now_ms: 1 }),
            Outcome::Refused(r) if r.contains("node 5")
        ));
    }

    fn renew(state: &mut ControlState, node: NodeId, seen_epoch: u64, now_ms: u64) {
        state.apply(&Command::Renew {
            node,
            seen_epoch,
            now_ms,
        });
    }

    #[test]
    fn a_failed_head_is_removed_and_its_successor_leads_after_the_lease_rule() {
        let mut state = cluster(&[1, 2, 3], 3);
        renew_all(&mut state, &[1, 2, 3], 1_000);
        // Node 1 stops renewing; 2 and 3 keep going.
        renew_all(&mut state, &[2, 3], 2_000);
        renew_all(&mut state, &[2, 3], 3_500);
        state.apply(&Command::Tick { now_ms: 4_999 });
        assert!(state.members[&1].up, "not before lease + clock factor");
        state.apply(&Command::Tick { now_ms: 5_000 });
        assert!(!state.members[&1].up);
        let p0 = &state.partitions[0];
        assert_eq!(p0.chain, [1, 2, 3], "still published");
        assert_eq!(p0.pending.as_ref().unwrap().chain, [2, 3]);
        assert_eq!(state.acting_view(2, 0), None, "nobody acts while pending");
        // 2 and 3 have not confirmed yet (their last renewal predates the change).
        state.apply(&Command::Tick { now_ms: 5_001 });
        assert!(state.partitions[0].pending.is_some());
        renew_all(&mut state, &[2, 3], 5_100);
        state.apply(&Command::Tick { now_ms: 5_200 });
        let p0 = &state.partitions[0];
        assert!(p0.pending.is_none());
        assert_eq!(p0.chain, [2, 3], "head 1 failed: successor 2 is head");
        assert_eq!(p0.view, 2);
        assert_eq!(state.acting_view(2, 0), Some(2));
        assert_eq!(state.acting_view(1, 0), None);
        // Partition 2's chain was [3, 1, 2]: its middle goes, order kept.
        assert_eq!(state.partitions[2].chain, [3, 2]);
        // Partition 1's tail 1 failed: predecessor 3 is the tail.
        assert_eq!(state.partitions[1].chain, [2, 3]);
    }

    #[test]
    fn a_holder_that_does_not_confirm_blocks_publication_until_its_grant_lapses() {
        let mut state = cluster(&[1, 2, 3], 1);
        renew_all(&mut state, &[1, 2, 3], 10_000);
        let stale = state.epoch;
        renew_all(&mut state, &[2, 3], 12_000);
        state.apply(&Command::Tick { now_ms: 15_000 }); // node 1 lapses
        assert!(state.partitions[0].pending.is_some());
        // 2 renews from a state that predates the change (it may still act); 3 confirms.
        renew(&mut state, 2, stale, 15_500);
        renew_all(&mut state, &[3], 15_500);
        state.apply(&Command::Tick { now_ms: 16_000 });
        assert!(state.partitions[0].pending.is_some());
        renew_all(&mut state, &[3], 18_000);
        state.apply(&Command::Tick { now_ms: 19_499 });
        assert!(
            state.partitions[0].pending.is_some(),
            "2 may act until 19.5 s"
        );
        state.apply(&Command::Tick { now_ms: 19_500 });
        let p0 = &state.partitions[0];
        assert!(p0.pending.is_none());
        assert_eq!(p0.chain, [3]);
        assert_eq!(p0.view, 2);
    }

    #[test]
    fn a_returning_node_reenters_at_the_tail_in_the_write_view_only() {
        let mut state = cluster(&[1, 2, 3], 3);
        renew_all(&mut state, &[2, 3], 1_000);
        state.apply(&Command::Tick { now_ms: 4_000 }); // 1 never renewed: down
        renew_all(&mut state, &[2, 3], 4_100);
        state.apply(&Command::Tick { now_ms: 4_200 });
        assert_eq!(state.partitions[0].chain, [2, 3]);
        // 1 comes back.
        renew_all(&mut state, &[1, 2, 3], 5_000);
        state.apply(&Command::Tick { now_ms: 5_100 });
        let p0 = &state.partitions[0];
        assert_eq!(p0.chain, [2, 3, 1], "re-enters at the tail");
        assert_eq!(p0.read_view, [2, 3], "not readable before it caught up");
        assert_eq!(p0.view, 3);
        // A report from an earlier view is ignored.
        state.apply(&Command::CaughtUp {
            node: 1,
            partitions: vec![(0, 2)],
        });
        assert!(state.partitions[0].pending.is_none());
        state.apply(&Command::CaughtUp {
            node: 1,
            partitions: vec![(0, 3)],
        });
        renew_all(&mut state, &[1, 2, 3], 5_200);
        state.apply(&Command::Tick { now_ms: 5_300 });
        let p0 = &state.partitions[0];
        assert_eq!(p0.read_view, [2, 3, 1]);
        assert_eq!(p0.view, 4);
    }

    #[test]
    fn a_replica_still_catching_up_never_becomes_head_when_the_head_is_lost() {
        let mut state = cluster(&[1, 2, 3], 1);
        state.partitions[0].chain = vec![3, 2, 1];
        state.partitions[0].read_view = vec![3, 1];
        renew_all(&mut state, &[1, 2, 3], 1_000);
        state.apply(&Command::Tick { now_ms: 1_100 });
        assert!(state.partitions[0].pending.is_none(), "nothing to change");
        // 3, the head, stops renewing.
        renew_all(&mut state, &[1, 2], 1_000 + LEASE);
        let lapsed = 1_000 + LEASE + CF;
        state.apply(&Command::Tick { now_ms: lapsed });
        renew_all(&mut state, &[1, 2], lapsed + 100);
        state.apply(&Command::Tick {
            now_ms: lapsed + 200,
        });
        let p0 = &state.partitions[0];
        assert!(p0.pending.is_none());
        assert_eq!(p0.chain, [1, 2], "the readable survivor leads");
        assert_eq!(p0.read_view, [1]);
    }

    #[test]
    fn when_every_readable_replica_lapses_the_view_is_kept_for_their_return() {
        let mut state = cluster(&[1, 2, 3], 3);
        renew_all(&mut state, &[1, 2, 3], 1_000);
        state.apply(&Command::Tick { now_ms: 1_100 });
        let before: Vec<_> = state
            .partitions
            .iter()
            .map(|p| (p.chain.clone(), p.read_view.clone(), p.view))
            .collect();
        // Nobody renews (no leader for longer than a lease): every member lapses at once.
        state.apply(&Command::Tick {
            now_ms: 1_000 + LEASE + CF,
        });
        assert!(state.members.values().all(|m| !m.up));
        for (p, (chain, read_view, view)) in state.partitions.iter().zip(&before) {
            assert!(
                p.pending.is_none(),
                "no view without a full copy is proposed"
            );
            assert_eq!((&p.chain, &p.read_view, p.view), (chain, read_view, *view));
        }
        // They come back one by one: the first readable replica back leads (the others re-enter
        // at the tail and are copied from it), so every partition is served again.
        let back = 1_000 + LEASE + CF + 100;
        renew_all(&mut state, &[1, 2, 3], back);
        renew_all(&mut state, &[1, 2, 3], back + 100);
        state.apply(&Command::Tick { now_ms: back + 200 });
        for p in &state.partitions {
            assert!(p.pending.is_none());
            let mut members = p.chain.clone();
            members.sort_unstable();
            assert_eq!(members, [1, 2, 3]);
            assert_eq!(p.read_view.first(), p.chain.first(), "a readable head");
            assert_eq!(state.acting_view(p.chain[0], p.id), Some(p.view));
        }
    }

    #[test]
    fn an_added_member_gets_partitions_and_a_removed_one_leaves_them() {
        let mut state = cluster(&[1, 2, 3], 8);
        renew_all(&mut state, &[1, 2, 3], 1_000);
        state.set_members(&members(&[1, 2, 3, 4]));
        renew_all(&mut state, &[1, 2, 3, 4], 1_100);
        state.apply(&Command::Tick { now_ms: 1_200 });
        let with_4 = state
            .partitions
            .iter()
            .filter(|p| p.chain.contains(&4))
            .count();
        assert_eq!(with_4, 6, "node 4 is in 3 of every 4 ideal chains");
        assert!(state.partitions.iter().all(|p| p.chain.len() == 3));
        // Remove 2: its lease is kept (retired) until it lapses.
        state.set_members(&members(&[1, 3, 4]));
        assert!(state.retired.contains_key(&2));
        renew_all(&mut state, &[1, 3, 4], 1_300);
        state.apply(&Command::Tick { now_ms: 1_400 });
        assert!(
            state.partitions.iter().any(|p| p.pending.is_some()),
            "2 has neither confirmed nor lapsed"
        );
        state.apply(&Command::Tick {
            now_ms: 1_100 + LEASE + CF,
        });
        assert!(state
            .partitions
            .iter()
            .all(|p| !p.chain.contains(&2) && p.pending.is_none()));
        assert!(state.retired.is_empty());
    }

    #[test]
    fn applying_the_same_commands_gives_the_same_state() {
        let run = || {
            let mut state = cluster(&[1, 2, 3], 4);
            renew_all(&mut state, &[1, 3], 1_000);
            state.apply(&Command::Tick { now_ms: 5_000 });
            renew_all(&mut state, &[1, 2, 3], 6_000);
            state.apply(&Command::Tick { now_ms: 6_100 });
            state
        };
        assert_eq!(run(), run());
    }
}
