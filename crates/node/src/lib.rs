//! A cluster member's assembly, as `mqstate serve --node-id` runs it (and the simulation of the
//! whole cluster, `crates/node/tests/turmoil_sim.rs`): the control-plane node and the data plane
//! (`mqstate-replication`: the state store's keys on chains) on one transport, the state-store
//! service's router to the partitions' heads, the broker's persistent sessions as rows on the
//! chains and the brokers' mesh. Where the node listens, how it connects and which incarnation its
//! mesh announces are the caller's: `serve` binds the operating system's TCP, the simulation
//! turmoil's.

use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use mqstate_broker::{Broker, Message};
use mqstate_cluster::transport::socket::{Accept, Connect};
use mqstate_cluster::transport::tcp::{self, TcpTransport};
use mqstate_cluster::transport::tls::NodeTls;
use mqstate_cluster::{ClusterNode, NodeConfig};
use mqstate_replication::head::{HeadConfig, KeyRequest};
use mqstate_replication::log::ChainLog;
use mqstate_replication::notify::Sink;
use mqstate_replication::wire::{Committed, RowExpect, RowWritten};
use mqstate_replication::{rows, Replication};
use mqstate_sessions::replicated::{
    Observers, ReadRow, ReplicatedSessions, RowFuture, SessionRows, Version, ROW_BUDGET,
};
use mqstate_statestore::router::{
    ClusterChange, ClusterChanges, KeepFuture, KeyRouter, RestoredObserver, RestoredObservers,
    RoutedReply, RoutedRequest, Router, RouterFuture, ScanFuture, ScanRequest,
};
use mqstate_wal::WalOptions;
use tokio::sync::{mpsc, oneshot};

/// The running node, its data plane, its brokers' mesh and its listener task.
pub struct Running {
    pub node: Arc<ClusterNode>,
    replication: mqstate_replication::Running,
    mesh: Option<mqstate_mesh::Mesh>,
    listener: tokio::task::JoinHandle<()>,
}

/// What the data plane needs besides the cluster settings.
pub struct DataPlane {
    /// The chain log's options (`fsync` and the like, as the other logs).
    pub wal: WalOptions,
    /// The chain log is compacted with a snapshot once it grew by this much (`snapshot_threshold_bytes`).
    pub snapshot_threshold_bytes: u64,
    /// The store's configuration: the head executes with the same semantics as a single node.
    pub head: HeadConfig,
    pub clock: mqstate_clock::SharedClock,
}

/// Where the node listens for the other nodes and how it reaches them.
pub struct Network<L> {
    /// The cluster port, bound.
    pub listener: L,
    /// How the node connects to the other nodes' cluster ports.
    pub connect: Arc<dyn Connect>,
    /// Mutual TLS between the nodes, or plain TCP.
    pub tls: Option<NodeTls>,
}

/// Starts the node `config` describes and its data plane on `network`, its chain log in
/// `data_dir`; the node forms or joins the cluster in the background.
pub async fn start(
    config: NodeConfig,
    network: Network<impl Accept>,
    data_dir: &std::path::Path,
    data: DataPlane,
) -> anyhow::Result<Running> {
    let Network {
        listener,
        connect,
        tls,
    } = network;
    let transport = TcpTransport::over(connect, tls.clone());
    let node = ClusterNode::start(config, Arc::new(transport))
        .await
        .context("cannot start the cluster node")?;
    let node = Arc::new(node);
    let (log, restored) = ChainLog::open(data_dir, data.wal, data.clock.now_ms())
        .context("cannot open the chain replicas' log")?;
    let log = log.snapshot_every(data.snapshot_threshold_bytes);
    let replication = Replication::start(Arc::clone(&node), log, restored, data.head, data.clock);
    let listener = tokio::spawn(tcp::serve_with(
        listener,
        tls,
        node.handler(),
        std::future::pending(),
    ));
    Ok(Running {
        node,
        replication,
        mesh: None,
        listener,
    })
}

impl Running {
    /// The broker's persistent sessions as rows on the data plane.
    pub fn session_rows(&self) -> Arc<ChainSessionRows> {
        Arc::new(ChainSessionRows(Arc::clone(&self.replication.replication)))
    }

    /// The state-store service's router: key commands go to their partition's head, and the
    /// changes committed there come back for this node's observers. KEYNOTIFY registrations of
    /// persistent sessions are kept with the session's row in `sessions`, and come back to the
    /// state store when a session is taken over here (decision 0054).
    pub fn router(&self, sessions: Option<&ReplicatedSessions>) -> Router {
        let (tx, rx) = mpsc::unbounded_channel();
        let replication = Arc::clone(&self.replication.replication);
        replication.set_sink(Arc::new(ChangeSink(tx)));
        let (restored_tx, restored_rx) = mpsc::unbounded_channel();
        if let Some(sessions) = sessions {
            sessions.attach_observers(Arc::new(ObserverBridge {
                restored: restored_tx,
                replication: Arc::clone(&replication),
            }));
        }
        Router(Arc::new(ChainRouter {
            replication,
            changes: std::sync::Mutex::new(Some(rx)),
            sessions: sessions.cloned(),
            restored: std::sync::Mutex::new(Some(restored_rx)),
        }))
    }

    /// Makes `broker` one broker with the other nodes' (decision 0044): routes, publishes,
    /// retained messages and client-id takeover across the cluster. `incarnation` tells this run
    /// of the node from its others (and from other nodes' runs).
    pub fn attach_mesh(&mut self, broker: &Broker, incarnation: u64) {
        self.mesh = Some(mqstate_mesh::Mesh::start(
            Arc::clone(&self.node),
            broker.clone(),
            incarnation,
        ));
    }

    pub async fn stop(self) {
        if let Some(mesh) = self.mesh {
            mesh.stop().await;
        }
        self.listener.abort();
        let _ = self.listener.await;
        self.replication.stop().await;
        match Arc::try_unwrap(self.node) {
            Ok(node) => node.shutdown().await,
            Err(_) => tracing::warn!("cluster node still in use at shutdown"),
        }
    }
}

/// The state store's router port on the data plane.
struct ChainRouter {
    replication: Arc<Replication>,
    changes: std::sync::Mutex<Option<ClusterChanges>>,
    sessions: Option<ReplicatedSessions>,
    restored: std::sync::Mutex<Option<RestoredObservers>>,
}

/// Registrations of a session taken over here, handed to the state-store service; the CONNACK
/// waits until they are in force. Also where the session's cursors come from (decision 0065).
struct ObserverBridge {
    restored: mpsc::UnboundedSender<RestoredObserver>,
    replication: Arc<Replication>,
}

impl Observers for ObserverBridge {
    fn restore(
        &self,
        client_id: Arc<str>,
        keys: Vec<(Vec<u8>, Option<String>)>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let (done, wait) = oneshot::channel();
        let observer = RestoredObserver {
            client_id,
            keys: keys
                .into_iter()
                .map(|(key, after)| (Bytes::from(key), after))
                .collect(),
            done,
        };
        let sent = self.restored.send(observer).is_ok();
        Box::pin(async move {
            if sent {
                let _ = wait.await;
            }
        })
    }

    fn position(&self, key: &[u8]) -> Option<String> {
        self.replication.position(key)
    }

    fn notified(&self, message: &Message) -> Option<(Vec<u8>, String)> {
        let key = mqstate_protocol::topic::notified_key(&message.topic)?;
        let version = message
            .properties
            .user_property(mqstate_statestore::envelope::prop::TIMESTAMP)?;
        Some((key, version.to_string()))
    }
}

/// Committed changes for this node's observers, handed to the state-store service.
struct ChangeSink(mpsc::UnboundedSender<ClusterChange>);

impl ChangeSink {
    /// Hands the key changes of `committed` to the service (one that does not decode is dropped,
    /// with a log line). The service is gone only at shutdown: nobody is left to notify.
    fn send(
        &self,
        committed: &[Committed],
        done: oneshot::Sender<()>,
        catch_up: Option<(Arc<str>, Bytes)>,
    ) {
        let changes = committed
            .iter()
            .filter_map(|c| {
                rows::delta_of_committed(c)
                    .map_err(|e| tracing::error!("a notification from the cluster dropped: {e}"))
                    .ok()
            })
            .collect();
        let _ = self.0.send(ClusterChange {
            changes,
            done,
            catch_up,
        });
    }
}

impl Sink for ChangeSink {
    fn deliver(&self, changes: Vec<Committed>, done: oneshot::Sender<()>) {
        self.send(&changes, done, None);
    }

    fn catch_up(&self, observer: Arc<str>, key: Vec<u8>, changes: Vec<Committed>) {
        let (done, _) = oneshot::channel();
        self.send(&changes, done, Some((observer, Bytes::from(key))));
    }
}

impl KeyRouter for ChainRouter {
    fn scan(&self, request: ScanRequest) -> ScanFuture<'_> {
        Box::pin(async move {
            let (keys, continuation) = self
                .replication
                .scan(
                    request.pattern.to_vec(),
                    request.continuation.map(|c| c.to_vec()),
                    request.expiry,
                )
                .await?;
            Ok((
                keys.into_iter().map(Bytes::from).collect(),
                continuation.map(Bytes::from),
            ))
        })
    }

    fn watch(
        &self,
        key: Bytes,
        observed: bool,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.replication.watch(key.to_vec(), observed))
    }

    fn take_changes(&self) -> Option<ClusterChanges> {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn keep_observed(&self, client_id: &str, keys: Vec<Bytes>) -> KeepFuture<'_> {
        match &self.sessions {
            Some(sessions) => {
                sessions.keep_observed(client_id, keys.into_iter().map(|k| k.to_vec()).collect())
            }
            None => Box::pin(async { Ok(()) }),
        }
    }

    fn take_restored(&self) -> Option<RestoredObservers> {
        self.restored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn catch_up(
        &self,
        client_id: Arc<str>,
        key: Bytes,
        after: Option<String>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.replication.catch_up(client_id, key.to_vec(), after))
    }

    fn execute(&self, request: RoutedRequest) -> RouterFuture<'_> {
        Box::pin(async move {
            let request = KeyRequest {
                client_id: request.client_id,
                id: request.id,
                correlation: request.correlation,
                key: request.key,
                payload: request.payload,
                command: request.command,
                ts: request.ts,
                fencing_token: request.fencing_token,
                expiry_ms: u64::try_from(request.expiry.as_millis()).unwrap_or(u64::MAX),
                // Set by `Replication::execute` from its retry budget.
                deadline_ms: 0,
            };
            let reply = self.replication.execute(request).await;
            RoutedReply {
                payload: reply.payload,
                ts: reply.ts,
            }
        })
    }
}

/// The broker's persistent sessions as rows on the data plane (decision 0047).
pub struct ChainSessionRows(pub Arc<Replication>);

impl SessionRows for ChainSessionRows {
    fn read<'a>(&'a self, client_id: &'a str) -> RowFuture<'a, ReadRow> {
        Box::pin(async move {
            let row = self.0.session_read(client_id, ROW_BUDGET).await?;
            Ok(ReadRow {
                value: row.value,
                version: row.version,
            })
        })
    }

    fn write<'a>(
        &'a self,
        client_id: &'a str,
        value: Option<Vec<u8>>,
        base: Option<Version>,
    ) -> RowFuture<'a, Result<Version, Option<Version>>> {
        Box::pin(async move {
            let expect = base.map_or(RowExpect::Absent, RowExpect::Version);
            match self
                .0
                .session_write(client_id, value, expect, ROW_BUDGET)
                .await?
            {
                RowWritten::Written(version) => Ok(Ok(version)),
                RowWritten::Conflict(current) => Ok(Err(current)),
            }
        })
    }

    fn here(&self) -> RowFuture<'_, Vec<(String, Vec<u8>, bool)>> {
        Box::pin(async move {
            Ok(self
                .0
                .sessions_here(mqstate_sessions::row::HEADER)
                .await
                .into_iter()
                // Rows are keyed by client id, which MQTT makes UTF-8.
                .filter_map(|(key, value, head)| Some((String::from_utf8(key).ok()?, value, head)))
                .collect())
        })
    }

    fn is_up(&self, node: u64) -> bool {
        self.0.is_up(node)
    }

    fn lease_held(&self) -> bool {
        self.0.lease_held()
    }
}
