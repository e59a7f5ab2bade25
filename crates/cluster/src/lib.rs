//! mqstate-cluster: the control plane of a cluster of mqstate nodes.
//!
//! Layers, bottom up (each knows only those below it):
//!
//! * [`partition`] — the stable key hash and the chain layout (pure).
//! * [`control`] — the control-plane state machine: members, partition map, views, leases,
//!   failure detection (pure, deterministic; time comes in the commands).
//! * [`log_store`], [`state_machine`] — openraft storage: the Raft log and vote in our
//!   write-ahead log (`mqstate-wal`), the applied [`control::ControlState`] with snapshots.
//! * [`identity`] — the cluster id every node-to-node request carries, kept in the cluster
//!   directory (decision 0075).
//! * [`transport`] — node-to-node frames (length-prefixed, postcard) over TCP, or in memory for tests.
//! * [`node`] — a running member: Raft, bootstrap, lease renewal, the leader's ticks, admin
//!   operations and [`status::Status`].

pub mod admin;
pub mod control;
pub mod identity;
pub mod log_store;
pub mod network;
pub mod node;
pub mod partition;
#[cfg(feature = "sim")]
pub mod sim;
pub mod state_machine;
pub mod status;
pub mod transport;
pub mod types;

/// A node's id: a positive number given on the command line, never reused.
pub type NodeId = u64;

pub use control::MapConfig;
pub use node::{ClusterError, ClusterNode, DataHandler, MeshHandler, NodeConfig};
pub use status::{KeyPlacement, NotReady, Status};
