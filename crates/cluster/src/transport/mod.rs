//! Node-to-node messages and how they travel (decision 0022): request/response
//! pairs in length-prefixed frames — a `u32` big-endian length, then the postcard encoding — over
//! byte streams ([`tcp`]: the system's TCP or turmoil's simulated one, through the [`socket`]
//! port, optionally in mutual TLS, [`tls`]), or handed over in memory for tests ([`mem`]). One
//! mechanism for the control plane now and the chains later: a new message is a new enum variant.

pub mod mem;
pub mod socket;
pub mod tcp;
pub mod tls;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};

use crate::control::{Command, Outcome};
use crate::identity::ClusterId;
use crate::types::TypeConfig;
use crate::NodeId;

/// Largest frame either side accepts (a snapshot chunk is a few MiB at most).
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// A request from one node to another.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// Propose a command; only the leader accepts.
    Propose(Command),
    /// A membership change; only the leader accepts.
    Admin(AdminRequest),
    /// Who are you, and do you belong to a cluster already? (bootstrap)
    Hello,
    /// Data-plane traffic (the chains), opaque here: handed to the node's [`crate::node::DataHandler`].
    Data(Vec<u8>),
    /// Broker-to-broker traffic (routes, publishes, client-id claims), opaque here: handed to the
    /// node's [`crate::node::MeshHandler`].
    Mesh(Vec<u8>),
    /// `request`, from a node of cluster `cluster` (decision 0075): a node that knows its cluster
    /// sends every request so, and serves only these of its own cluster (and `Hello`s).
    OfCluster {
        cluster: ClusterId,
        request: Box<Request>,
    },
}

impl Request {
    /// Whether this is one of Raft's own messages (a node with no cluster id adopts theirs).
    pub fn is_raft(&self) -> bool {
        matches!(
            self,
            Request::AppendEntries(_) | Request::Vote(_) | Request::InstallSnapshot(_)
        )
    }
}

/// Membership changes (joint consensus inside openraft).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminRequest {
    AddNode { id: NodeId, addr: String },
    RemoveNode { id: NodeId },
}

/// The answer to a [`Request`].
#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    AppendEntries(AppendEntriesResponse<NodeId>),
    Vote(VoteResponse<NodeId>),
    InstallSnapshot(InstallSnapshotResponse<NodeId>),
    Proposed(Outcome),
    AdminDone,
    Hello {
        node_id: NodeId,
        initialized: bool,
        /// The cluster it belongs to, if it knows.
        cluster: Option<ClusterId>,
    },
    /// Not the leader; here is who is, if known.
    NotLeader {
        leader: Option<NodeId>,
    },
    /// The request failed on the remote node.
    Failed(String),
    /// The data plane's answer to [`Request::Data`].
    Data(Vec<u8>),
    /// The mesh's answer to [`Request::Mesh`].
    Mesh(Vec<u8>),
}

/// Why a call got no response.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    #[error("cannot reach {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("bad frame from {addr}: {reason}")]
    Frame { addr: String, reason: String },
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The receiving side: a node answers requests.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: Request) -> BoxFuture<'_, Response>;
}

/// The sending side.
pub trait Transport: Send + Sync + 'static {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Request,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>>;
}

impl<T: Transport + ?Sized> Transport for Arc<T> {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Request,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>> {
        (**self).call(addr, request, timeout)
    }
}

/// Encodes a message that travels as opaque bytes inside a frame (the data plane's in
/// [`Request::Data`], the mesh's in [`Request::Mesh`], and their answers): postcard, like the frame
/// bodies, and decoded with [`decode_body`].
pub fn encode_body<T: Serialize>(message: &T) -> Vec<u8> {
    // Our own plain data: postcard cannot fail on it but for allocation.
    postcard::to_allocvec(message).unwrap_or_default()
}

/// Encodes one frame: length, then body.
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, postcard::Error> {
    let body = postcard::to_allocvec(message)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a frame body (the length already read and checked against [`MAX_FRAME_BYTES`]).
pub fn decode_body<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_an_error() {
        let request = Request::Propose(Command::Renew {
            node: 3,
            seen_epoch: 9,
            now_ms: 0,
        });
        let frame = encode_frame(&request).unwrap();
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        let back: Request = decode_body(&frame[4..]).unwrap();
        assert!(matches!(
            back,
            Request::Propose(Command::Renew {
                node: 3,
                seen_epoch: 9,
                ..
            })
        ));
        assert!(decode_body::<Request>(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode_body::<Request>(&[]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn any_body_decodes_or_fails_without_panicking(body in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            if let Ok(request) = decode_body::<Request>(&body) {
                // What decodes re-encodes and decodes again.
                let frame = encode_frame(&request).unwrap();
                proptest::prop_assert!(decode_body::<Request>(&frame[4..]).is_ok());
            }
            let _ = decode_body::<Response>(&body);
        }
    }
}
