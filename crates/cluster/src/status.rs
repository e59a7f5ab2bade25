//! What `mqstate cluster status` shows: one node's view of the cluster, as JSON and as a table.

use serde::{Deserialize, Serialize};

use crate::partition::PartitionId;
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
}
