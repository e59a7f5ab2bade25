//! The operator's requests (`mqstate cluster …`), carried over MQTT like the other CLI commands:
//! a PUBLISH of a JSON [`AdminCall`] to [`ADMIN_TOPIC`] with a response topic and correlation data;
//! the server publishes an [`AdminReply`] (JSON) to the response topic with the correlation data
//! echoed. Who may publish to the topic is the broker's authorization (ACL) decision.

use serde::{Deserialize, Serialize};

use crate::status::{KeyPlacement, Status};
use crate::NodeId;

/// The topic the server claims for cluster administration.
pub const ADMIN_TOPIC: &str = "mqstate/cluster/v1/admin";

/// One request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminCall {
    Status,
    PartitionOf { key: String },
    AddNode { id: NodeId, addr: String },
    RemoveNode { id: NodeId },
}

/// One answer: exactly one of the fields is set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AdminReply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<KeyPlacement>,
    /// An add or remove went through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl AdminReply {
    pub fn error(text: impl Into<String>) -> AdminReply {
        AdminReply {
            error: Some(text.into()),
            ..AdminReply::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_tagged_json() {
        let call: AdminCall =
            serde_json::from_str(r#"{"op":"add_node","id":4,"addr":"h:1"}"#).unwrap();
        assert_eq!(
            call,
            AdminCall::AddNode {
                id: 4,
                addr: "h:1".into()
            }
        );
        assert_eq!(
            serde_json::to_string(&AdminCall::Status).unwrap(),
            r#"{"op":"status"}"#
        );
        assert!(serde_json::from_str::<AdminCall>(r#"{"op":"explode"}"#).is_err());
    }
}
