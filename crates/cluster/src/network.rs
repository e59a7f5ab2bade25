//! openraft's network over a [`Transport`].

use std::sync::Arc;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;

use crate::transport::{Request, Response, Transport, TransportError};
use crate::types::TypeConfig;
use crate::NodeId;

type RpcError<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

/// Makes a [`Peer`] per target node.
pub struct Network {
    transport: Arc<dyn Transport>,
}

impl Network {
    pub fn new(transport: Arc<dyn Transport>) -> Network {
        Network { transport }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Peer {
        Peer {
            transport: Arc::clone(&self.transport),
            target,
            addr: node.addr.clone(),
        }
    }
}

/// Raft's view of one other node.
pub struct Peer {
    transport: Arc<dyn Transport>,
    target: NodeId,
    addr: String,
}

impl Peer {
    async fn call<E: std::error::Error>(
        &self,
        request: Request,
        option: &RPCOption,
    ) -> Result<Response, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>> {
        match self
            .transport
            .call(&self.addr, request, option.hard_ttl())
            .await
        {
            Ok(Response::Failed(reason)) => Err(RPCError::Network(NetworkError::new(
                &std::io::Error::other(format!("node {} failed: {reason}", self.target)),
            ))),
            Ok(response) => Ok(response),
            // Unreachable makes openraft back off instead of retrying at once.
            Err(e @ TransportError::Unreachable { .. }) => {
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }
}

fn unexpected<E: std::error::Error>(
    target: NodeId,
    response: &Response,
) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
    RPCError::Network(NetworkError::new(&std::io::Error::other(format!(
        "node {target} answered with the wrong message: {response:?}"
    ))))
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcError> {
        match self.call(Request::AppendEntries(rpc), &option).await? {
            Response::AppendEntries(response) => Ok(response),
            other => Err(unexpected(self.target, &other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcError<InstallSnapshotError>> {
        match self.call(Request::InstallSnapshot(rpc), &option).await? {
            Response::InstallSnapshot(response) => Ok(response),
            other => Err(unexpected(self.target, &other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcError> {
        match self.call(Request::Vote(rpc), &option).await? {
            Response::Vote(response) => Ok(response),
            other => Err(unexpected(self.target, &other)),
        }
    }
}
