//! The openraft type configuration of the control plane.

use std::io::Cursor;

use crate::control::{Command, Outcome};
use crate::NodeId;

openraft::declare_raft_types!(
    /// Commands are [`Command`]s, answers [`Outcome`]s; a node is known by its cluster address.
    pub TypeConfig:
        D = Command,
        R = Outcome,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type Raft = openraft::Raft<TypeConfig>;
pub type Membership = openraft::Membership<NodeId, openraft::BasicNode>;
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;

/// Storage failures as openraft wants them.
pub mod storage_error {
    use std::fmt::Display;

    use openraft::{AnyError, StorageIOError};

    use super::StorageError;

    pub fn write_logs(e: impl Display) -> StorageError {
        StorageIOError::write_logs(AnyError::error(e.to_string())).into()
    }
    pub fn read_logs(e: impl Display) -> StorageError {
        StorageIOError::read_logs(AnyError::error(e.to_string())).into()
    }
    pub fn write_vote(e: impl Display) -> StorageError {
        StorageIOError::write_vote(AnyError::error(e.to_string())).into()
    }
    pub fn write_snapshot(e: impl Display) -> StorageError {
        StorageIOError::write_snapshot(None, AnyError::error(e.to_string())).into()
    }
    pub fn read_snapshot(e: impl Display) -> StorageError {
        StorageIOError::read_snapshot(None, AnyError::error(e.to_string())).into()
    }
}
