//! What `mqstate cluster status` shows: one node's view of the cluster, as JSON and as a table.

use serde::{Deserialize, Serialize};

use crate::partition::{ideal_chain, PartitionId};
use crate::NodeId;

/// One node's view of the cluster. The JSON shape is a public contract (issue 14): ids are
/// numbers, `leader` is a node id or null, a member's `state` is `"up"` or `"down"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub node_id: NodeId,
    pub leader: Option<NodeId>,
    pub term: u64,
    /// Index of the last control-plane entry applied on this node.
    pub applied_index: Option<u64>,
    pub members: Vec<MemberStatus>,
    /// Fixed at cluster creation; 0 before the map exists.
    pub partition_count: u32,
    pub replication_factor: u32,
    pub partitions: Vec<PartitionStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatus {
    pub id: NodeId,
    pub addr: String,
    /// `"up"` or `"down"`.
    pub state: String,
    /// A voter (false: a learner still catching up).
    pub voter: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStatus {
    pub id: PartitionId,
    /// Head first.
    pub chain: Vec<NodeId>,
    pub view: u64,
    pub read_view: Vec<NodeId>,
    pub write_view: Vec<NodeId>,
    /// A new view is waiting for the lease rule.
    pub pending: bool,
}

fn ids(list: &[NodeId]) -> String {
    list.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

impl Status {
    /// The table a person reads at a glance.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let leader = self
            .leader
            .map_or_else(|| "none (no quorum yet)".to_owned(), |l| l.to_string());
        out.push_str(&format!(
            "node {}   leader {}   term {}   partitions {}   replication factor {}\n\n",
            self.node_id, leader, self.term, self.partition_count, self.replication_factor
        ));
        out.push_str(&format!(
            "{:<6} {:<24} {:<6} {:<8} {}\n",
            "ID", "ADDRESS", "STATE", "ROLE", "HEADS"
        ));
        for m in &self.members {
            let role = if Some(m.id) == self.leader {
                "leader"
            } else if m.voter {
                "voter"
            } else {
                "learner"
            };
            let heads = self
                .partitions
                .iter()
                .filter(|p| p.chain.first() == Some(&m.id))
                .count();
            out.push_str(&format!(
                "{:<6} {:<24} {:<6} {:<8} {}\n",
                m.id, m.addr, m.state, role, heads
            ));
        }
        if !self.partitions.is_empty() {
            out.push_str(&format!(
                "\n{:<10} {:<6} {:<16} {:<16} {}\n",
                "PARTITION", "VIEW", "CHAIN", "READ VIEW", "NOTE"
            ));
            for p in &self.partitions {
                let note = if p.pending {
                    "view change pending"
                } else if p.read_view != p.write_view {
                    "replica catching up"
                } else {
                    ""
                };
                out.push_str(&format!(
                    "{:<10} {:<6} {:<16} {:<16} {}\n",
                    p.id,
                    p.view,
                    ids(&p.chain),
                    ids(&p.read_view),
                    note
                ));
            }
        }
        out
    }
}

/// Why a node should not be given clients yet: what `/ready` answers 503 with on a cluster node.
/// Ready means a voting member, up, holding a valid lease, and in the read view of every partition
/// whose chain it is in (caught up), so that a rolling restart may move on to the next node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// The cluster has not formed, or this node is not (yet, or any more) in its membership.
    NotMember,
    /// Added as a learner and not yet made a voter.
    Learner,
    /// The partition map does not exist yet.
    NoPartitionMap,
    /// The leader marks this node down: its lease renewals are not arriving.
    Down,
    /// This node's lease is not valid (no quorum, or renewals failing): it acts on no partition.
    NoLease,
    /// In these partitions' chains but not yet in their read views: still being copied.
    CatchingUp(Vec<PartitionId>),
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotReady::NotMember => {
                f.write_str("not a member of a cluster (not formed yet, or waiting to be added)")
            }
            NotReady::Learner => f.write_str("a learner, not yet a voting member"),
            NotReady::NoPartitionMap => f.write_str("the partition map does not exist yet"),
            NotReady::Down => f.write_str("marked down by the leader"),
            NotReady::NoLease => {
                f.write_str("no valid lease (no quorum reached, or renewals failing)")
            }
            NotReady::CatchingUp(partitions) => {
                let shown: Vec<String> =
                    partitions.iter().take(8).map(ToString::to_string).collect();
                let more = if partitions.len() > 8 { ", ..." } else { "" };
                write!(
                    f,
                    "catching up in {} partition(s): {}{more}",
                    partitions.len(),
                    shown.join(", ")
                )
            }
        }
    }
}

impl Status {
    /// Whether this node is ready for clients (see [`NotReady`]); `lease_valid` is whether its
    /// lease is valid now, which the status does not carry.
    pub fn readiness(&self, lease_valid: bool) -> Result<(), NotReady> {
        let me = self
            .members
            .iter()
            .find(|m| m.id == self.node_id)
            .ok_or(NotReady::NotMember)?;
        if !me.voter {
            return Err(NotReady::Learner);
        }
        if self.partition_count == 0 {
            return Err(NotReady::NoPartitionMap);
        }
        if me.state != "up" {
            return Err(NotReady::Down);
        }
        if !lease_valid {
            return Err(NotReady::NoLease);
        }
        // Where this node belongs by the layout as well as where the published views have it: just
        // marked up, it is in no chain until the views that add it are published, and must not
        // look ready in between.
        let ids: Vec<NodeId> = self.members.iter().map(|m| m.id).collect();
        let up = |id: NodeId| self.members.iter().any(|m| m.id == id && m.state == "up");
        let behind: Vec<PartitionId> = self
            .partitions
            .iter()
            .filter(|p| {
                let belongs = p.write_view.contains(&self.node_id)
                    || ideal_chain(p.id, &ids, up, self.replication_factor).contains(&self.node_id);
                belongs && !p.read_view.contains(&self.node_id)
            })
            .map(|p| p.id)
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(NotReady::CatchingUp(behind))
        }
    }
}

/// The answer to `cluster partition-of KEY`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyPlacement {
    pub key: String,
    pub partition: PartitionId,
    pub chain: Vec<NodeId>,
    pub view: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_documented_shape() {
        let status = Status {
            node_id: 2,
            leader: None,
            term: 3,
            applied_index: Some(9),
            members: vec![MemberStatus {
                id: 1,
                addr: "127.0.0.1:7001".into(),
                state: "down".into(),
                voter: true,
            }],
            partition_count: 1,
            replication_factor: 3,
            partitions: vec![PartitionStatus {
                id: 0,
                chain: vec![1, 2],
                view: 4,
                read_view: vec![1],
                write_view: vec![1, 2],
                pending: false,
            }],
        };
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["node_id"], 2);
        assert!(json["leader"].is_null());
        assert_eq!(json["members"][0]["id"], 1);
        assert_eq!(json["members"][0]["state"], "down");
        assert_eq!(json["partitions"][0]["chain"], serde_json::json!([1, 2]));
        assert_eq!(json["partitions"][0]["read_view"], serde_json::json!([1]));
        let table = status.render_table();
        assert!(table.contains("none (no quorum yet)"), "{table}");
        assert!(table.contains("replica catching up"), "{table}");
    }

    fn ready_node() -> Status {
        let member = |id| MemberStatus {
            id,
            addr: format!("127.0.0.1:700{id}"),
            state: "up".into(),
            voter: true,
        };
        let partition = |id, chain: Vec<NodeId>| PartitionStatus {
            id,
            chain: chain.clone(),
            view: 2,
            read_view: chain.clone(),
            write_view: chain,
            pending: false,
        };
        Status {
            node_id: 2,
            leader: Some(1),
            term: 1,
            applied_index: Some(12),
            members: vec![member(1), member(2), member(3)],
            partition_count: 3,
            replication_factor: 2,
            partitions: vec![
                partition(0, vec![1, 2]),
                partition(1, vec![2, 3]),
                partition(2, vec![3, 1]),
            ],
        }
    }

    #[test]
    fn a_caught_up_voting_member_with_a_lease_is_ready() {
        assert_eq!(ready_node().readiness(true), Ok(()));
        assert_eq!(ready_node().readiness(false), Err(NotReady::NoLease));
    }

    #[test]
    fn a_replica_still_copied_is_not_ready_and_says_where() {
        let mut status = ready_node();
        // Back at the tail of partition 1's chain, not yet in its read view; partition 2 is
        // another node's business.
        status.partitions[1].read_view = vec![3];
        status.partitions[2].read_view = vec![3];
        let not_ready = status.readiness(true).unwrap_err();
        assert_eq!(not_ready, NotReady::CatchingUp(vec![1]));
        assert_eq!(not_ready.to_string(), "catching up in 1 partition(s): 1");
    }

    #[test]
    fn a_node_just_marked_up_is_not_ready_before_the_views_add_it() {
        let mut status = ready_node();
        // Back up, but the views that put it back at the tails are not published yet.
        status.partitions[0].chain = vec![1];
        status.partitions[0].write_view = vec![1];
        status.partitions[0].read_view = vec![1];
        status.partitions[1].chain = vec![3];
        status.partitions[1].write_view = vec![3];
        status.partitions[1].read_view = vec![3];
        assert_eq!(
            status.readiness(true),
            Err(NotReady::CatchingUp(vec![0, 1]))
        );
    }

    #[test]
    fn outside_the_membership_without_a_map_or_down_is_not_ready() {
        let mut status = ready_node();
        status.members.retain(|m| m.id != 2);
        assert_eq!(status.readiness(true), Err(NotReady::NotMember));

        let mut status = ready_node();
        status.members[1].voter = false;
        assert_eq!(status.readiness(true), Err(NotReady::Learner));

        let mut status = ready_node();
        status.partition_count = 0;
        status.partitions.clear();
        assert_eq!(status.readiness(true), Err(NotReady::NoPartitionMap));

        let mut status = ready_node();
        status.members[1].state = "down".into();
        assert_eq!(status.readiness(true), Err(NotReady::Down));
    }
}
