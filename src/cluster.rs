//! `mqstate serve` as a cluster member: starts the control-plane node on `--cluster-listen` and
//! the data plane (`mqstate-node`) on the operating system's TCP, and answers the operator's
//! `mqstate cluster …` requests on the admin topic of the MQTT port.

use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use mqstate_broker::service::ServiceInbox;
use mqstate_broker::{Broker, Message, PublishProperties, QoS};
use mqstate_cluster::admin::{AdminCall, AdminReply};
use mqstate_cluster::transport::socket::TokioTcp;
use mqstate_cluster::transport::tls::NodeTls;
use mqstate_cluster::{ClusterNode, MapConfig, NodeConfig};
use mqstate_node::{DataPlane, Network, Running};
use tokio::net::TcpListener;

use crate::settings::{ClusterSettings, ClusterTlsFiles};

/// Reads the node's certificate, key and the cluster CA with the MQTT listeners' PEM loading.
fn load_tls(files: &ClusterTlsFiles) -> anyhow::Result<NodeTls> {
    use mqstate_broker::tls::{read_certs, read_key};
    let chain = read_certs(&files.cert).context("cluster_tls_cert")?;
    let key = read_key(&files.key).context("cluster_tls_key")?;
    let ca = read_certs(&files.ca).context("cluster_tls_ca")?;
    NodeTls::new(chain, key, ca).map_err(|e| {
        anyhow::anyhow!(
            "cluster TLS ({}, {}, {}): {e}",
            files.cert.display(),
            files.key.display(),
            files.ca.display()
        )
    })
}

/// Binds the cluster address and starts the node and its data plane; the node forms or joins the
/// cluster in the background.
pub async fn start(
    settings: &ClusterSettings,
    data_dir: &std::path::Path,
    data: DataPlane,
) -> anyhow::Result<Running> {
    let listener = TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen for cluster traffic on {}", settings.listen))?;
    let config = NodeConfig {
        id: settings.node_id,
        addr: settings.advertise.clone(),
        peers: settings.peers.clone(),
        join: settings.join,
        dir: data_dir.join("cluster"),
        map: MapConfig {
            partition_count: settings.partitions,
            replication_factor: settings.replication_factor,
            lease_ms: settings.lease.as_millis() as u64,
            clock_factor_ms: settings.clock_factor.as_millis() as u64,
        },
        heartbeat: settings.election_timeout / 5,
        election_timeout: settings.election_timeout,
        election_timeout_max: None,
        clock: data.clock.clone(),
        snapshot_every: mqstate_cluster::node::SNAPSHOT_EVERY_ENTRIES,
    };
    let tls = settings.tls.as_ref().map(load_tls).transpose()?;
    if tls.is_none() && settings.plaintext {
        tracing::warn!(
            "node-to-node traffic is plain TCP (cluster_plaintext): anyone who reaches the cluster port can join the Raft group; set cluster_tls_* for mutual TLS"
        );
    }
    let mutual_tls = tls.is_some();
    let network = Network {
        listener,
        connect: Arc::new(TokioTcp),
        tls,
    };
    let running = mqstate_node::start(config, network, data_dir, data).await?;
    tracing::info!(
        node_id = settings.node_id,
        cluster_listen = %settings.listen,
        peers = ?settings.peers,
        join = settings.join,
        mutual_tls,
        "cluster node started"
    );
    Ok(running)
}

/// This run of the node, for its mesh: distinct across restarts (and from other nodes' runs).
pub fn incarnation(clock: &mqstate_clock::SharedClock) -> u64 {
    clock.now_ms() << 16 ^ u64::from(std::process::id() & 0xffff)
}

/// Answers admin requests until the inbox closes or `shutdown` completes. Without a cluster every
/// request gets an error saying so.
pub async fn serve_admin(
    broker: Broker,
    mut inbox: ServiceInbox,
    node: Option<Arc<ClusterNode>>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let mut request = tokio::select! {
            () = &mut shutdown => return,
            request = inbox.recv() => match request {
                Some(request) => request,
                None => return,
            },
        };
        request.ack(0);
        let properties = &request.message.properties;
        let Some(response_topic) = properties.response_topic.clone() else {
            tracing::debug!(client = %request.client_id, "admin request without a response topic ignored");
            continue;
        };
        let correlation = properties.correlation_data.clone();
        let call = serde_json::from_slice::<AdminCall>(&request.message.payload);
        let broker = broker.clone();
        let node = node.clone();
        // Membership changes take seconds; status requests must not queue behind them.
        tokio::spawn(async move {
            let reply = match (call, node) {
                (Err(e), _) => AdminReply::error(format!("invalid admin request: {e}")),
                (Ok(_), None) => AdminReply::error(
                    "this server is a single node, not part of a cluster (start it with --node-id, --cluster-listen and --peers)",
                ),
                (Ok(call), Some(node)) => execute(&node, call).await,
            };
            let payload = serde_json::to_vec(&reply).unwrap_or_default();
            broker.publish(Message {
                topic: response_topic,
                payload: Bytes::from(payload),
                qos: QoS::AtLeastOnce,
                retain: false,
                properties: PublishProperties {
                    correlation_data: correlation,
                    content_type: Some("application/json".into()),
                    payload_is_utf8: true,
                    ..PublishProperties::default()
                },
            });
        });
    }
}

async fn execute(node: &ClusterNode, call: AdminCall) -> AdminReply {
    match call {
        AdminCall::Status => AdminReply {
            status: Some(node.status()),
            ..AdminReply::default()
        },
        AdminCall::PartitionOf { key } => match node.partition_of(&key) {
            Some(placement) => AdminReply {
                placement: Some(placement),
                ..AdminReply::default()
            },
            None => AdminReply::error(
                "the partition map does not exist yet: the cluster has not formed",
            ),
        },
        AdminCall::AddNode { id, addr } => match node.add_node(id, addr).await {
            Ok(()) => AdminReply {
                done: Some(true),
                ..AdminReply::default()
            },
            Err(e) => AdminReply::error(e.to_string()),
        },
        AdminCall::RemoveNode { id } => match node.remove_node(id).await {
            Ok(()) => AdminReply {
                done: Some(true),
                ..AdminReply::default()
            },
            Err(e) => AdminReply::error(e.to_string()),
        },
    }
}
