//! A running member of the cluster: its Raft, how it finds or forms the cluster, its lease, the
//! leader's periodic step, membership changes and [`Status`].
//!
//! Time enters here and only here, through the injected [`mqstate_clock::Clock`]: the leader
//! stamps its wall clock (Unix ms) on every timed command it proposes, and a node measures its own
//! lease on its monotonic clock from the moment it asked for it. Timers are tokio's, so a
//! simulation that runs tokio's clock (turmoil) runs every timer of the node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mqstate_clock::SharedClock;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, ServerState};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::control::{Command, MapConfig, Outcome, Partition};
use crate::identity::{ClusterId, Identity};
use crate::log_store::LogStore;
use crate::network::Network;
use crate::partition::{partition_of, PartitionId};
use crate::state_machine::{SharedState, StateMachineStore};
use crate::status::{KeyPlacement, MemberStatus, PartitionStatus, Status};
use crate::transport::{AdminRequest, BoxFuture, Handler, Request, Response, Transport};
use crate::types::Raft;
use crate::NodeId;

/// How long a forwarded proposal or admin request may take.
const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// A refused request (of another cluster) is logged at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How long a `Hello` during bootstrap may take.
const HELLO_TIMEOUT: Duration = Duration::from_millis(500);
/// Bootstrap retries this often until a majority of the listed peers answered.
const BOOTSTRAP_RETRY: Duration = Duration::from_millis(300);
/// How long `add-node` waits for the new node to copy the log before making it a voter.
const LEARNER_CATCH_UP: Duration = Duration::from_secs(10);
/// The leader's step (failure detection, publishing views) runs this often.
const LEADER_STEP: Duration = Duration::from_millis(50);
/// How often the lease task looks for a pending view change to confirm between renewals.
const CONFIRM_LOOK: Duration = Duration::from_millis(25);
/// Raft snapshots after this many entries ([`NodeConfig::snapshot_every`]); older entries are then
/// purged but for the last tenth.
pub const SNAPSHOT_EVERY_ENTRIES: u64 = 1000;

/// How a node runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub id: NodeId,
    /// This node's cluster address as the others reach it.
    pub addr: String,
    /// Every founding member (this one included), or empty when joining an existing cluster.
    pub peers: BTreeMap<NodeId, String>,
    /// Wait to be added (`cluster add-node`) instead of forming the cluster.
    pub join: bool,
    /// Where the Raft log (a `mqstate-wal` log), its metadata and the snapshot live.
    pub dir: PathBuf,
    /// Proposed when this node creates the partition map.
    pub map: MapConfig,
    pub heartbeat: Duration,
    /// A follower that hears no leader for a random time in `election_timeout ..
    /// election_timeout_max` stands for election.
    pub election_timeout: Duration,
    /// `None`: twice `election_timeout`. The simulation pins it 1 ms above, with a different
    /// timeout per node, so that openraft's own (unseeded) random draw cannot change a run.
    pub election_timeout_max: Option<Duration>,
    /// Wall time for the leader's stamps, monotonic time for this node's lease.
    pub clock: SharedClock,
    /// Raft snapshots after this many entries ([`SNAPSHOT_EVERY_ENTRIES`]; tests take fewer to
    /// have a follower brought back by a snapshot).
    pub snapshot_every: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("the cluster has no leader yet (is a majority of the nodes up?)")]
    NoLeader,
    #[error("node {node} is not the leader{}", leader.map_or(String::new(), |l| format!(" (node {l} is)")))]
    NotLeader {
        node: NodeId,
        leader: Option<NodeId>,
    },
    #[error("{0}")]
    Transport(#[from] crate::transport::TransportError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("cannot open the cluster state: {0}")]
    Storage(String),
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Refused(String),
}

/// The lease this node holds, on its own monotonic clock.
#[derive(Debug, Default)]
struct LocalLease {
    valid_until: Option<Instant>,
    /// The lease holds only once this node applied the state up to here.
    epoch: u64,
    /// Whether the last check found it valid (to count expiries once).
    was_valid: bool,
}

/// The data plane (the chains) attached to a node: it answers [`Request::Data`], and once it is
/// attached it reports catch-up itself ([`ClusterNode::report_caught_up`]).
pub trait DataHandler: Send + Sync + 'static {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>>;
}

/// The brokers' mesh attached to a node: it answers [`Request::Mesh`] (routes, forwarded
/// publishes, client-id claims; `mqstate-mesh`).
pub trait MeshHandler: Send + Sync + 'static {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>>;
}

struct Inner {
    config: NodeConfig,
    raft: Raft,
    state: SharedState,
    /// Stamps every request with this node's cluster id once known ([`Stamping`]).
    transport: Arc<dyn Transport>,
    identity: Arc<Identity>,
    /// When a refused request was last logged.
    refusal_logged: Mutex<Option<Instant>>,
    lease: Mutex<LocalLease>,
    data: OnceLock<Arc<dyn DataHandler>>,
    mesh: OnceLock<Arc<dyn MeshHandler>>,
}

/// A running cluster member. Serve [`ClusterNode::handler`] on the cluster address.
pub struct ClusterNode {
    inner: Arc<Inner>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl ClusterNode {
    /// Opens the node's Raft state and starts it; the node forms or joins the cluster by itself.
    pub async fn start(
        config: NodeConfig,
        transport: Arc<dyn Transport>,
    ) -> Result<ClusterNode, ClusterError> {
        if config.id == 0 {
            return Err(ClusterError::Config("node ids start at 1".into()));
        }
        if let Some(id) = std::iter::once(config.id)
            .chain(config.peers.keys().copied())
            .find(|&id| id > crate::log_store::MAX_NODE_ID)
        {
            return Err(ClusterError::Config(format!(
                "node id {id} is too large: node ids go up to {} (the Raft metadata file's voted-for field)",
                crate::log_store::MAX_NODE_ID
            )));
        }
        if !config.join && !config.peers.is_empty() && !config.peers.contains_key(&config.id) {
            return Err(ClusterError::Config(format!(
                "the peer list does not name this node (id {}); list every founding node, this one included, or start it with --join",
                config.id
            )));
        }
        let log = LogStore::open(&config.dir).map_err(|e| ClusterError::Storage(e.to_string()))?;
        let identity = Arc::new(Identity::open(&config.dir).map_err(ClusterError::Storage)?);
        let transport: Arc<dyn Transport> = Arc::new(Stamping {
            inner: transport,
            identity: Arc::clone(&identity),
        });
        let machine = StateMachineStore::open(&config.dir)
            .map_err(|e| ClusterError::Storage(e.to_string()))?;
        let log = log.purging_within(machine.snapshot_covers());
        let state = machine.shared();
        let heartbeat = config.heartbeat.as_millis() as u64;
        let election = config.election_timeout.as_millis() as u64;
        let raft_config = openraft::Config {
            cluster_name: "mqstate".into(),
            heartbeat_interval: heartbeat.max(1),
            election_timeout_min: election.max(heartbeat + 1),
            election_timeout_max: config
                .election_timeout_max
                .map_or(election.max(heartbeat + 1) * 2, |max| {
                    (max.as_millis() as u64).max(election.max(heartbeat + 1) + 1)
                }),
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(config.snapshot_every.max(1)),
            max_in_snapshot_log_to_keep: config.snapshot_every / 10,
            ..openraft::Config::default()
        }
        .validate()
        .map_err(|e| ClusterError::Config(e.to_string()))?;
        let raft = Raft::new(
            config.id,
            Arc::new(raft_config),
            Network::new(Arc::clone(&transport)),
            log,
            machine,
        )
        .await
        .map_err(|e| ClusterError::Raft(e.to_string()))?;
        let inner = Arc::new(Inner {
            config,
            raft,
            state,
            transport,
            identity,
            refusal_logged: Mutex::new(None),
            lease: Mutex::new(LocalLease::default()),
            data: OnceLock::new(),
            mesh: OnceLock::new(),
        });
        let (stop, stopped) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(bootstrap(Arc::clone(&inner), stopped.clone())),
            tokio::spawn(lead(Arc::clone(&inner), stopped.clone())),
            tokio::spawn(renew_lease(Arc::clone(&inner), stopped.clone())),
            tokio::spawn(report_metrics(Arc::clone(&inner), stopped)),
        ];
        Ok(ClusterNode { inner, stop, tasks })
    }

    pub fn id(&self) -> NodeId {
        self.inner.config.id
    }

    /// Answers other nodes' requests; serve it on the cluster address.
    pub fn handler(&self) -> Arc<dyn Handler> {
        Arc::clone(&self.inner) as Arc<dyn Handler>
    }

    pub fn status(&self) -> Status {
        self.inner.status()
    }

    /// Whether this node holds its control-plane lease now. Once it lapses the control plane
    /// may count this node down (after its clock factor) and other members take over what it
    /// held: its partitions, its clients' sessions.
    pub fn lease_valid(&self) -> bool {
        self.inner.lease_valid()
    }

    /// Whether this node is ready for clients: a voting member, up, with a valid lease and caught
    /// up in every partition whose chain it is in (`/ready` on a cluster node).
    pub fn readiness(&self) -> Result<(), crate::status::NotReady> {
        self.inner.status().readiness(self.inner.lease_valid())
    }

    /// The view under which this node may act on `partition` now, if any: the partition is in a
    /// published view that has this node in its chain, and this node's lease is valid.
    pub fn acting_view(&self, partition: PartitionId) -> Option<u64> {
        if !self.inner.lease_valid() {
            return None;
        }
        self.inner
            .state
            .read()
            .state
            .acting_view(self.inner.config.id, partition)
    }

    /// Attaches the data plane: it answers [`Request::Data`] from now on, and this node stops
    /// reporting itself caught up at its lease renewals (the data plane reports it once its copy
    /// is complete). Only the first call counts.
    pub fn set_data_handler(&self, handler: Arc<dyn DataHandler>) {
        if self.inner.data.set(handler).is_err() {
            tracing::warn!("a data handler is already attached; the second one is ignored");
        }
    }

    /// Attaches the brokers' mesh: it answers [`Request::Mesh`] from now on. Only the first call
    /// counts.
    pub fn set_mesh_handler(&self, handler: Arc<dyn MeshHandler>) {
        if self.inner.mesh.set(handler).is_err() {
            tracing::warn!("a mesh handler is already attached; the second one is ignored");
        }
    }

    /// The members as this node last applied them: id, cluster address and whether the control
    /// plane counts it up (its lease is current), by id.
    pub fn members(&self) -> Vec<(NodeId, String, bool)> {
        let metrics = self.inner.raft.metrics().borrow().clone();
        let applied = self.inner.state.read();
        metrics
            .membership_config
            .membership()
            .nodes()
            .map(|(&id, node)| {
                let up = applied.state.members.get(&id).is_some_and(|m| m.up);
                (id, node.addr.clone(), up)
            })
            .collect()
    }

    /// The cluster's timing and shape (lease, clock factor, partitions).
    pub fn map_config(&self) -> MapConfig {
        self.inner.config.map
    }

    /// The transport this node sends with (the data plane reuses it).
    pub fn transport(&self) -> Arc<dyn Transport> {
        Arc::clone(&self.inner.transport)
    }

    /// The cluster address of member `id`, if it is one.
    pub fn addr_of(&self, id: NodeId) -> Option<String> {
        self.inner.addr_of(id)
    }

    /// The partition count, once the partition map exists.
    pub fn partition_count(&self) -> Option<u32> {
        self.inner
            .state
            .read()
            .state
            .config
            .map(|c| c.partition_count)
    }

    /// `partition` as this node last applied it (published view, chain, read view, pending change).
    pub fn partition(&self, partition: PartitionId) -> Option<Partition> {
        self.inner
            .state
            .read()
            .state
            .partitions
            .get(partition as usize)
            .cloned()
    }

    /// [`ClusterNode::acting_view`] with the view itself: the partition as published, when this
    /// node may act on it now.
    pub fn acting_partition(&self, partition: PartitionId) -> Option<Partition> {
        let view = self.acting_view(partition)?;
        self.partition(partition).filter(|p| p.view == view)
    }

    /// Reports that this node's replica of `partition` holds every committed row, as reached under
    /// `view`: proposed only while `view` is still the partition's published view (a report of
    /// a replaced view is dropped; the replica copies again under the new one).
    pub async fn report_caught_up(&self, partition: PartitionId, view: u64) {
        let current = self.partition(partition);
        if !current.is_some_and(|p| p.view == view && p.pending.is_none()) {
            tracing::debug!(partition, view, "stale catch-up report dropped");
            return;
        }
        let command = Command::CaughtUp {
            node: self.inner.id(),
            partitions: vec![(partition, view)],
        };
        if let Err(e) = self.inner.propose(command).await {
            tracing::debug!(partition, view, "catch-up report failed: {e}");
        }
    }

    /// Where `key` lives, once the partition map exists.
    pub fn partition_of(&self, key: &str) -> Option<KeyPlacement> {
        let applied = self.inner.state.read();
        let config = applied.state.config?;
        let partition = partition_of(key.as_bytes(), config.partition_count);
        let p = applied.state.partitions.get(partition as usize)?;
        Some(KeyPlacement {
            key: key.to_owned(),
            partition,
            chain: p.chain.clone(),
            view: p.view,
        })
    }

    /// Adds a node (learner first, then voter: joint consensus inside openraft), via the leader.
    pub async fn add_node(&self, id: NodeId, addr: String) -> Result<(), ClusterError> {
        if id == 0 {
            return Err(ClusterError::Refused("node ids start at 1".into()));
        }
        self.inner.admin(AdminRequest::AddNode { id, addr }).await
    }

    /// Removes a node from the cluster, via the leader.
    pub async fn remove_node(&self, id: NodeId) -> Result<(), ClusterError> {
        self.inner.admin(AdminRequest::RemoveNode { id }).await
    }

    /// Waits until this node sees a leader, up to `timeout`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Option<NodeId> {
        let mut metrics = self.inner.raft.metrics();
        let wait = async {
            loop {
                if let Some(leader) = metrics.borrow().current_leader {
                    return leader;
                }
                if metrics.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok()
    }

    /// Stops the node's tasks and its Raft.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        if let Err(e) = self.inner.raft.shutdown().await {
            tracing::warn!("raft did not shut down cleanly: {e}");
        }
    }
}

impl Inner {
    fn id(&self) -> NodeId {
        self.config.id
    }

    fn lease(&self) -> MutexGuard<'_, LocalLease> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lease_valid(&self) -> bool {
        let (valid_until, epoch) = {
            let lease = self.lease();
            (lease.valid_until, lease.epoch)
        };
        valid_until.is_some_and(|until| self.config.clock.now() < until)
            && self.state.read().state.epoch >= epoch
    }

    fn leader(&self) -> Option<NodeId> {
        self.raft.metrics().borrow().current_leader
    }

    fn addr_of(&self, id: NodeId) -> Option<String> {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .get_node(&id)
            .map(|node| node.addr.clone())
    }

    /// Proposes `command` through the leader (this node or another).
    async fn propose(&self, command: Command) -> Result<Outcome, ClusterError> {
        let leader = self.leader().ok_or(ClusterError::NoLeader)?;
        if leader == self.id() {
            return self.propose_here(command).await;
        }
        let addr = self.addr_of(leader).ok_or(ClusterError::NoLeader)?;
        match self
            .transport
            .call(&addr, Request::Propose(command), RPC_TIMEOUT)
            .await?
        {
            Response::Proposed(outcome) => Ok(outcome),
            Response::NotLeader { leader } => Err(ClusterError::NotLeader {
                node: leader.unwrap_or(0),
                leader,
            }),
            Response::Failed(reason) => Err(ClusterError::Raft(reason)),
            other => Err(ClusterError::Raft(format!("unexpected answer {other:?}"))),
        }
    }

    /// Proposes on this node, which must be the leader; the leader's clock is stamped on it.
    async fn propose_here(&self, command: Command) -> Result<Outcome, ClusterError> {
        match self
            .raft
            .client_write(command.stamped(self.config.clock.now_ms()))
            .await
        {
            Ok(response) => Ok(response.data),
            Err(e) => Err(self.write_error(e)),
        }
    }

    fn write_error(
        &self,
        e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
    ) -> ClusterError {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => {
                ClusterError::NotLeader {
                    node: self.id(),
                    leader: forward.leader_id,
                }
            }
            other => ClusterError::Raft(other.to_string()),
        }
    }

    async fn admin(&self, request: AdminRequest) -> Result<(), ClusterError> {
        let leader = self.leader().ok_or(ClusterError::NoLeader)?;
        if leader == self.id() {
            return self.admin_here(request).await;
        }
        let addr = self.addr_of(leader).ok_or(ClusterError::NoLeader)?;
        match self
            .transport
            .call(
                &addr,
                Request::Admin(request),
                LEARNER_CATCH_UP + RPC_TIMEOUT * 2,
            )
            .await?
        {
            Response::AdminDone => Ok(()),
            Response::NotLeader { leader } => Err(ClusterError::NotLeader {
                node: leader.unwrap_or(0),
                leader,
            }),
            Response::Failed(reason) => Err(ClusterError::Refused(reason)),
            other => Err(ClusterError::Raft(format!("unexpected answer {other:?}"))),
        }
    }

    async fn admin_here(&self, request: AdminRequest) -> Result<(), ClusterError> {
        match request {
            AdminRequest::AddNode { id, addr } => {
                let membership = self.raft.metrics().borrow().membership_config.clone();
                if membership.membership().voter_ids().any(|v| v == id) {
                    return Err(ClusterError::Refused(format!(
                        "node {id} is already a member"
                    )));
                }
                // A learner first: it copies the log before it counts toward any quorum.
                let learner = self.raft.add_learner(id, BasicNode::new(addr), true);
                match tokio::time::timeout(LEARNER_CATCH_UP, learner).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(self.write_error(e)),
                    Err(_) => tracing::warn!(
                        node = id,
                        "the new node has not caught up yet; making it a voter anyway"
                    ),
                }
                self.raft
                    .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
                    .await
                    .map_err(|e| self.write_error(e))?;
                tracing::info!(node = id, "node added to the cluster");
            }
            AdminRequest::RemoveNode { id } => {
                let membership = self.raft.metrics().borrow().membership_config.clone();
                if membership.membership().get_node(&id).is_none() {
                    return Err(ClusterError::Refused(format!("node {id} is not a member")));
                }
                let voters: BTreeSet<NodeId> = membership.membership().voter_ids().collect();
                if voters.len() == 1 && voters.contains(&id) {
                    return Err(ClusterError::Refused(
                        "cannot remove the last voter of the cluster".into(),
                    ));
                }
                let change = if voters.contains(&id) {
                    ChangeMembers::RemoveVoters(BTreeSet::from([id]))
                } else {
                    ChangeMembers::RemoveNodes(BTreeSet::from([id]))
                };
                self.raft
                    .change_membership(change, false)
                    .await
                    .map_err(|e| self.write_error(e))?;
                tracing::info!(node = id, "node removed from the cluster");
            }
        }
        Ok(())
    }

    fn status(&self) -> Status {
        let metrics = self.raft.metrics().borrow().clone();
        let applied = self.state.read();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(&id, node)| {
                let up = applied.state.members.get(&id).is_some_and(|m| m.up);
                MemberStatus {
                    id,
                    addr: node.addr.clone(),
                    state: if up { "up" } else { "down" }.to_owned(),
                    voter: voters.contains(&id),
                }
            })
            .collect();
        let partitions = applied
            .state
            .partitions
            .iter()
            .map(|p| PartitionStatus {
                id: p.id,
                chain: p.chain.clone(),
                view: p.view,
                read_view: p.read_view.clone(),
                write_view: p.chain.clone(),
                pending: p.pending.is_some(),
            })
            .collect();
        let config = applied.state.config;
        Status {
            node_id: self.id(),
            leader: metrics.current_leader,
            term: metrics.current_term,
            applied_index: metrics.last_applied.map(|id| id.index),
            members,
            partition_count: config.map_or(0, |c| c.partition_count),
            replication_factor: config.map_or(0, |c| c.replication_factor),
            partitions,
        }
    }
}

/// Sends every request as [`Request::OfCluster`] once this node knows its cluster.
struct Stamping {
    inner: Arc<dyn Transport>,
    identity: Arc<Identity>,
}

impl Transport for Stamping {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Request,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, crate::transport::TransportError>> {
        let request = match self.identity.get() {
            Some(cluster) => Request::OfCluster {
                cluster,
                request: Box::new(request),
            },
            None => request,
        };
        self.inner.call(addr, request, timeout)
    }
}

impl Handler for Inner {
    fn handle(&self, request: Request) -> BoxFuture<'_, Response> {
        let (stamp, request) = match request {
            Request::OfCluster { cluster, request } => (Some(cluster), *request),
            request => (None, request),
        };
        // A Hello is answered to anyone (it names the cluster); the operator's tools send Admin
        // requests unstamped (a node of another cluster stamps its own, which is refused).
        let exempt = match request {
            Request::Hello => true,
            Request::Admin(_) => stamp.is_none(),
            _ => false,
        };
        if !exempt {
            if let Err(refusal) = self.identity.admit(stamp, request.is_raft()) {
                self.log_refusal(&refusal);
                return Box::pin(async move { Response::Failed(refusal.to_string()) });
            }
        }
        self.serve(request)
    }
}

impl Inner {
    /// A refused request is logged at most every [`REFUSAL_LOG_EVERY`] (a stranger's Raft
    /// heartbeats come many times a second).
    fn log_refusal(&self, refusal: &crate::identity::Refusal) {
        let now = self.config.clock.now();
        let mut last = self
            .refusal_logged
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|at| now.saturating_duration_since(at) >= REFUSAL_LOG_EVERY) {
            *last = Some(now);
            tracing::warn!("a node-to-node request refused: {refusal}");
        }
    }

    fn serve(&self, request: Request) -> BoxFuture<'_, Response> {
        Box::pin(async move {
            let failed = |e: &dyn std::fmt::Display| Response::Failed(e.to_string());
            match request {
                Request::AppendEntries(rpc) => match self.raft.append_entries(rpc).await {
                    Ok(response) => Response::AppendEntries(response),
                    Err(e) => failed(&e),
                },
                Request::Vote(rpc) => match self.raft.vote(rpc).await {
                    Ok(response) => Response::Vote(response),
                    Err(e) => failed(&e),
                },
                Request::InstallSnapshot(rpc) => match self.raft.install_snapshot(rpc).await {
                    Ok(response) => Response::InstallSnapshot(response),
                    Err(e) => failed(&e),
                },
                Request::Propose(command) => match self.propose_here(command).await {
                    Ok(outcome) => Response::Proposed(outcome),
                    Err(ClusterError::NotLeader { leader, .. }) => Response::NotLeader { leader },
                    Err(e) => failed(&e),
                },
                Request::Admin(request) => {
                    if self.leader() != Some(self.id()) {
                        return Response::NotLeader {
                            leader: self.leader(),
                        };
                    }
                    match self.admin_here(request).await {
                        Ok(()) => Response::AdminDone,
                        Err(ClusterError::NotLeader { leader, .. }) => {
                            Response::NotLeader { leader }
                        }
                        Err(e) => failed(&e),
                    }
                }
                Request::Hello => Response::Hello {
                    node_id: self.id(),
                    initialized: self.raft.is_initialized().await.unwrap_or(false),
                    cluster: self.identity.get(),
                },
                Request::Data(request) => match self.data.get() {
                    Some(data) => Response::Data(data.handle(request).await),
                    None => Response::Failed("this node serves no data plane".into()),
                },
                Request::Mesh(request) => match self.mesh.get() {
                    Some(mesh) => Response::Mesh(mesh.handle(request).await),
                    None => Response::Failed("this node has no broker mesh attached".into()),
                },
                Request::OfCluster { .. } => {
                    Response::Failed("a request stamped twice with a cluster id".into())
                }
            }
        })
    }
}

/// Sleeps `period` unless told to stop; false once stopped.
async fn pause(stopped: &mut watch::Receiver<bool>, period: Duration) -> bool {
    let slept = tokio::select! {
        biased; // deterministic under simulation
        _ = stopped.wait_for(|stop| *stop) => false,
        () = tokio::time::sleep(period) => true,
    };
    slept && !*stopped.borrow()
}

/// Forms the cluster from the peer list: once a majority of the listed peers (this one included)
/// answers that it has no Raft state, every one of them initializes Raft with the same membership
/// (openraft accepts that). If any peer already belongs to a cluster, this node was not a founder:
/// it waits to be added.
async fn bootstrap(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let peers = inner.config.peers.clone();
    if inner.config.join || peers.is_empty() {
        return;
    }
    let ours = ClusterId::of_founders(&peers);
    loop {
        if inner.raft.is_initialized().await.unwrap_or(true) {
            return;
        }
        let mut empty = 1usize;
        let mut member_of_cluster = None;
        for (&id, addr) in &peers {
            if id == inner.id() {
                continue;
            }
            match inner
                .transport
                .call(addr, Request::Hello, HELLO_TIMEOUT)
                .await
            {
                // A node of another cluster at a founder's address: neither a member nor empty.
                Ok(Response::Hello {
                    initialized: true,
                    cluster: Some(theirs),
                    ..
                }) if theirs != ours => tracing::warn!(
                    peer = id,
                    %addr,
                    "the node at founder {id}'s address belongs to another cluster ({theirs}, this founding list makes {ours})"
                ),
                Ok(Response::Hello {
                    initialized: true, ..
                }) => member_of_cluster = Some(id),
                Ok(Response::Hello {
                    initialized: false, ..
                }) => empty += 1,
                _ => {}
            }
        }
        if let Some(peer) = member_of_cluster {
            if !inner.raft.is_initialized().await.unwrap_or(true) {
                tracing::info!(
                    peer,
                    "node {peer} already belongs to a cluster: waiting to be added (mqstate cluster add-node)"
                );
            }
            return;
        }
        if empty * 2 > peers.len() {
            let nodes: BTreeMap<NodeId, BasicNode> = peers
                .iter()
                .map(|(&id, addr)| (id, BasicNode::new(addr.clone())))
                .collect();
            // Kept before Raft holds anything: a founder never runs Raft without it.
            match inner.identity.settle(ours) {
                Ok(kept) if kept == ours => {}
                // The directory already belongs to another cluster, whose Raft state is gone (a
                // wiped log beside a kept id file, or a new founding list): forming now would
                // run a cluster under an id its own founders do not share. The operator decides.
                Ok(kept) => {
                    tracing::error!(
                        "not forming the cluster: this directory's {} holds cluster id {kept}, but this founding list makes {ours}; remove the file only if the old cluster is gone for good",
                        crate::identity::FILE
                    );
                    return;
                }
                Err(e) => {
                    tracing::error!("not forming the cluster: {e}");
                    if !pause(&mut stopped, BOOTSTRAP_RETRY).await {
                        return;
                    }
                    continue;
                }
            }
            match inner.raft.initialize(nodes).await {
                Ok(()) => tracing::info!(peers = ?peers, "cluster formed from the peer list"),
                Err(e) => tracing::debug!("not initializing: {e}"),
            }
            return;
        }
        if !pause(&mut stopped, BOOTSTRAP_RETRY).await {
            return;
        }
    }
}

/// The leader's duties: create the partition map once, then step the control state (failure
/// detection, publishing views) whenever a step would change it.
///
/// A new leader lets every member renew with it before it judges anyone's lease: the leases it
/// finds were granted by its predecessor, and while there was no leader nobody could renew. Judged
/// at once, every member would be found lapsed and put at the tail of its chains as if it had
/// to catch up — and a partition whose read view empties that way has no complete replica left.
async fn lead(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let grace = Duration::from_millis((inner.config.map.lease_ms / 3).max(50) * 2);
    let mut leader_since: Option<Instant> = None;
    while pause(&mut stopped, LEADER_STEP).await {
        if inner.leader() != Some(inner.id()) {
            leader_since = None;
            continue;
        }
        let now = inner.config.clock.now();
        let in_office = now.saturating_duration_since(*leader_since.get_or_insert(now));
        let now_ms = inner.config.clock.now_ms();
        let command = {
            let state = &inner.state.read().state;
            if state.config.is_some() && in_office < grace {
                None
            } else if state.config.is_none() {
                Some(Command::Init {
                    config: inner.config.map,
                    now_ms,
                })
            } else {
                let mut stepped = state.clone();
                stepped.apply(&Command::Tick { now_ms });
                stepped.now_ms = state.now_ms;
                (stepped != *state).then_some(Command::Tick { now_ms })
            }
        };
        if let Some(command) = command {
            if let Err(e) = inner.propose_here(command).await {
                tracing::debug!("leader step not committed: {e}");
            }
        }
    }
}

/// Renews this node's lease every third of a lease (so two renewals can fail before it lapses),
/// confirming the state it has applied; and, when no data plane is attached (nothing to copy),
/// reports itself caught up on partitions whose write view it entered.
///
/// A pending view change of a partition this node holds is confirmed at once, not at the next
/// period: its publication waits for every holder's confirmation, and the partition has no head
/// acting until then (decision 0049).
async fn renew_lease(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let period = Duration::from_millis((inner.config.map.lease_ms / 3).max(50));
    let look = period.min(CONFIRM_LOOK);
    let mut last_renewal: Option<Instant> = None;
    // The epoch of the last renewal asked: pending changes up to it are confirmed (or were tried).
    let mut confirmed_epoch = 0u64;
    while pause(&mut stopped, look).await {
        let due = last_renewal.is_none_or(|at| {
            inner.config.clock.now().saturating_duration_since(at) + look / 2 >= period
        });
        if !due && !unconfirmed(&inner, confirmed_epoch) {
            continue;
        }
        let (seen_epoch, catching_up) = {
            let applied = inner.state.read();
            let catching_up: Vec<(PartitionId, u64)> = applied
                .state
                .partitions
                .iter()
                .filter(|p| {
                    p.pending.is_none()
                        && p.chain.contains(&inner.id())
                        && !p.read_view.contains(&inner.id())
                })
                .map(|p| (p.id, p.view))
                .collect();
            (applied.state.epoch, catching_up)
        };
        let asked_at = inner.config.clock.now();
        last_renewal = Some(asked_at);
        confirmed_epoch = seen_epoch;
        let renewed = inner
            .propose(Command::Renew {
                node: inner.id(),
                seen_epoch,
                now_ms: 0,
            })
            .await;
        match renewed {
            Ok(Outcome::Granted { lease_ms, epoch }) => {
                let mut lease = inner.lease();
                lease.valid_until = Some(asked_at + Duration::from_millis(lease_ms));
                lease.epoch = epoch;
            }
            Ok(other) => tracing::debug!(?other, "lease not granted"),
            Err(e) => tracing::debug!("lease renewal failed: {e}"),
        }
        let valid = inner.lease_valid();
        {
            let mut lease = inner.lease();
            if lease.was_valid && !valid {
                metrics::counter!("mqstate_cluster_lease_expiries_total").increment(1);
                tracing::warn!(
                    "this node's control-plane lease expired: it stops acting on its partitions until renewed"
                );
            }
            lease.was_valid = valid;
        }
        // With a data plane attached, the replicas report catch-up once their copy is complete.
        if valid && !catching_up.is_empty() && inner.data.get().is_none() {
            let command = Command::CaughtUp {
                node: inner.id(),
                partitions: catching_up,
            };
            if let Err(e) = inner.propose(command).await {
                tracing::debug!("catch-up report failed: {e}");
            }
        }
    }
}

/// Whether a partition this node holds has a view change pending since after `confirmed_epoch`.
fn unconfirmed(inner: &Inner, confirmed_epoch: u64) -> bool {
    let me = inner.id();
    inner.state.read().state.partitions.iter().any(|p| {
        p.pending
            .as_ref()
            .is_some_and(|pending| pending.since_epoch > confirmed_epoch)
            && (p.chain.contains(&me) || p.read_view.contains(&me))
    })
}

/// Publishes the control plane's figures through the `metrics` facade.
async fn report_metrics(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    while pause(&mut stopped, Duration::from_secs(1)).await {
        let raft = inner.raft.metrics().borrow().clone();
        metrics::gauge!("mqstate_cluster_term").set(raft.current_term as f64);
        metrics::gauge!("mqstate_cluster_leader").set(raft.current_leader.unwrap_or(0) as f64);
        metrics::gauge!("mqstate_cluster_is_leader")
            .set(f64::from(u8::from(raft.state == ServerState::Leader)));
        metrics::gauge!("mqstate_cluster_commit_index")
            .set(raft.last_applied.map_or(0, |id| id.index) as f64);
        metrics::gauge!("mqstate_cluster_lease_valid")
            .set(f64::from(u8::from(inner.lease_valid())));
        let applied = inner.state.read();
        let up = applied.state.members.values().filter(|m| m.up).count();
        let down = applied.state.members.len() - up;
        metrics::gauge!("mqstate_cluster_members", "state" => "up").set(up as f64);
        metrics::gauge!("mqstate_cluster_members", "state" => "down").set(down as f64);
        for p in &applied.state.partitions {
            let partition = p.id.to_string();
            metrics::gauge!("mqstate_cluster_partition_view", "partition" => partition.clone())
                .set(p.view as f64);
            metrics::gauge!("mqstate_cluster_partition_head", "partition" => partition.clone())
                .set(p.chain.first().copied().unwrap_or(0) as f64);
            metrics::gauge!("mqstate_cluster_partition_chain_length", "partition" => partition)
                .set(p.chain.len() as f64);
        }
    }
}
