//! `mqstate serve`: resolve settings, recover the data directory, start the broker and the state store,
//! and stop gracefully on SIGINT/SIGTERM (stop accepting, disconnect clients, flush and fsync the log).
//! SIGHUP (and any change of the files) reloads the TLS certificate, key and client CA.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use mqstate_broker::tls::{ClientAuth, IdentitySource, Tls, TlsFiles};
use mqstate_broker::{Acceptor, Broker, BrokerConfig, Listener};
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_statestore::service::{self, Durability, ServiceConfig};
use mqstate_store::{Limits, StoreConfig};
use mqstate_wal::{Committer, Failpoints, FsyncPolicy, WalOptions};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use crate::metrics::{self, Exporter};
use crate::settings::{
    defaults, Fsync, ListenerKind, ListenerSpec, LogFormat, Persistence, Resolved, Settings,
    TlsClientAuth, TlsIdentity, TlsSettings,
};

/// The one stable HLC node id of the state-store service (spec §4: clients check it does not change).
pub const SERVICE_NODE_ID: &str = "mqstate";

/// The settings of `serve`: the file (if any) under the environment and the flags, resolved. Before
/// the async runtime starts, since they size it ([`Resolved::worker_threads`]).
pub fn settings(config: Option<PathBuf>, flags: Settings) -> anyhow::Result<Resolved> {
    let file = match &config {
        Some(path) => Settings::from_file(path)?,
        None => Settings::default(),
    };
    flags.layer(file).resolve()
}

pub async fn run(settings: Resolved) -> anyhow::Result<()> {
    init_logging(settings.log_format, &settings.log)?;
    crate::auth::check_exposure(&settings)?;
    tracing::debug!(?settings, "settings");

    // Up before recovery, so that /health answers and /ready says 503 while a large log replays.
    let (stop_metrics, metrics_stopped) = oneshot::channel::<()>();
    let metrics = match settings.metrics_listen {
        Some(addr) => {
            let exporter = Exporter::install()?;
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for metrics on {addr}"))?;
            let task = tokio::spawn(metrics::serve(
                listener,
                Arc::clone(&exporter),
                async move {
                    let _ = metrics_stopped.await;
                },
            ));
            Some((exporter, task))
        }
        None => None,
    };

    // The node's one clock: the broker, the state store and the session journal read time from it.
    let clock: mqstate_clock::SharedClock = match settings.clock_offset_ms {
        0 => mqstate_clock::system(),
        offset => {
            tracing::warn!(
                offset_ms = offset,
                "the wall clock is skewed (test_clock_offset_ms)"
            );
            Arc::new(mqstate_clock::OffsetClock::new(
                mqstate_clock::system(),
                offset,
            ))
        }
    };
    let store_config = StoreConfig {
        node_id: SERVICE_NODE_ID.into(),
        limits: store_limits(&settings),
    };
    let (recovered, recovery) = mqstate_statestore::recovery::recover(
        &settings.data_dir,
        WalOptions {
            // The executor writes its own batches (decision 0069).
            committer: Committer::Owner,
            ..wal_options(&settings, "statestore")
        },
        store_config.clone(),
        clock.now_ms(),
    )?;
    metrics::record_recovery(recovery.elapsed);
    let wal = Arc::clone(&recovered.wal);

    let policy = crate::auth::load(&settings)?;
    let (restored, session_log, appender) = mqstate_sessions::recover(
        &settings.data_dir,
        wal_options(&settings, "sessions"),
        settings.snapshot_threshold_bytes,
    )?;
    let session_log = Arc::new(session_log);
    let mut restored = restored;
    let mut builder = Broker::builder(broker_config(&settings))
        .security(policy.security)
        .clock(clock.clone());
    // A cluster node keeps persistent sessions on the chains (decision 0047): its own
    // log keeps retained messages only, and what it held of sessions before is the chains' now.
    let replicated_sessions = settings.cluster.as_ref().map(|cluster| {
        mqstate_sessions::replicated::ReplicatedSessions::new(cluster.node_id, session_log.clone())
    });
    builder = match &replicated_sessions {
        Some(replicated) => {
            restored.sessions.clear();
            builder
                .journal(Arc::new(replicated.clone()))
                .sessions_elsewhere(Arc::new(replicated.clone()))
        }
        None => builder.journal(session_log.clone()),
    };
    let broker = builder.build();
    if let Some(replicated) = &replicated_sessions {
        replicated.attach_broker(broker.clone());
    }
    let report = broker.restore(restored);
    tracing::info!(
        sessions = report.sessions,
        messages = report.messages,
        retained = report.retained,
        expired = report.expired,
        wills_published = report.wills_published,
        "MQTT sessions recovered"
    );
    let session_log_stats = appender.wal_stats();
    let appender = tokio::spawn(appender.run(broker.clone()));
    let inbox = broker
        .claim_topic(INVOKE_TOPIC)
        .context("cannot attach the state store to the broker")?;

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Started before the MQTT listeners, but it never waits for the cluster to form: the
    // listeners open at once.
    let cluster = match &settings.cluster {
        Some(cluster) => {
            let data = mqstate_node::DataPlane {
                wal: wal_options(&settings, "chains"),
                snapshot_threshold_bytes: settings.snapshot_threshold_bytes,
                head: mqstate_replication::head::HeadConfig {
                    store: store_config,
                    limits: mqstate_protocol::RequestLimits::default(),
                    node: cluster.node_id,
                },
                clock: clock.clone(),
            };
            let mut running = crate::cluster::start(cluster, &settings.data_dir, data).await?;
            running.attach_mesh(&broker, crate::cluster::incarnation(&clock));
            if let Some(replicated) = &replicated_sessions {
                replicated.attach_rows(running.session_rows());
            }
            Some(running)
        }
        None => None,
    };
    // Sessions whose node died (or this node before a restart) are adopted (decision 0054).
    let adopter = replicated_sessions
        .as_ref()
        .map(|replicated| replicated.adopt_orphans_regularly());
    let admin_inbox = broker
        .claim_topic(mqstate_cluster::admin::ADMIN_TOPIC)
        .context("cannot attach cluster administration to the broker")?;
    let admin = tokio::spawn(crate::cluster::serve_admin(
        broker.clone(),
        admin_inbox,
        cluster.as_ref().map(|running| Arc::clone(&running.node)),
        wait_for(shutdown_rx.clone()),
    ));
    let hangup = settings
        .listen
        .iter()
        .any(|spec| spec.tls.is_some())
        .then(Hangup::register);
    let mut listeners = Vec::new();
    let mut reloadable = Vec::new();
    for spec in &settings.listen {
        let tcp = TcpListener::bind(spec.addr)
            .await
            .with_context(|| format!("cannot listen on {spec}"))?;
        warn_if_open(spec, &settings);
        let tls = match &spec.tls {
            Some(t) => {
                let tls = Tls::load(tls_files(t))
                    .with_context(|| format!("cannot load the TLS files of listener {spec}"))?;
                reloadable.push(tls.clone());
                Some(tls)
            }
            None => None,
        };
        let acceptor = match (spec.kind, tls) {
            (ListenerKind::Tcp, _) => Acceptor::Tcp,
            (ListenerKind::Ws, _) => Acceptor::Ws,
            (ListenerKind::Tls, Some(tls)) => Acceptor::Tls(tls),
            (ListenerKind::Wss, Some(tls)) => Acceptor::Wss(tls),
            // `resolve` gives every TLS listener its TLS settings.
            (ListenerKind::Tls | ListenerKind::Wss, None) => {
                anyhow::bail!("listener {spec} needs a TLS certificate and key")
            }
        };
        listeners.push(tokio::spawn(mqstate_broker::serve(
            Listener { tcp, acceptor },
            broker.clone(),
            wait_for(shutdown_rx.clone()),
        )));
    }
    if let Some(hangup) = hangup {
        tokio::spawn(reload_tls(
            reloadable,
            hangup,
            wait_for(shutdown_rx.clone()),
        ));
    }

    let service_config = ServiceConfig {
        server_id: SERVICE_NODE_ID.to_owned(),
        durability: match settings.persistence {
            Persistence::All => Durability::All,
            Persistence::OptIn => Durability::OptIn,
        },
        snapshot_threshold_bytes: settings.snapshot_threshold_bytes,
        key_access: policy.key_access,
        requests_per_second: settings.statestore_requests_per_second,
        notify: Some(settings.notify.clone()),
        failpoints: Failpoints::from_env(),
        router: cluster
            .as_ref()
            .map(|running| running.router(replicated_sessions.as_ref())),
        ..ServiceConfig::default()
    };
    let store = tokio::spawn(service::run(
        broker.clone(),
        inbox,
        recovered,
        service_config,
        wait_for(shutdown_rx.clone()),
    ));
    if let Some((exporter, _)) = &metrics {
        let broker = broker.clone();
        let logs = [Arc::clone(wal.stats()), session_log_stats.clone()];
        exporter.on_scrape(move || {
            metrics::record_sessions(broker.session_count());
            for log in &logs {
                metrics::record_wal(log);
            }
        });
        if let Some(running) = &cluster {
            // A pod taken into the client Service, or the next node of a rolling restart, waits
            // until this node serves its partitions.
            let node = Arc::clone(&running.node);
            exporter.ready_when(move || node.readiness().map_err(|e| e.to_string()));
        }
        exporter.set_ready(true);
    }
    let listen: Vec<String> = settings.listen.iter().map(ToString::to_string).collect();
    tracing::info!(?listen, data_dir = %settings.data_dir.display(), "mqstate ready");

    shutdown_signal().await;
    if let Some((exporter, _)) = &metrics {
        exporter.set_ready(false);
    }
    tracing::info!("shutting down: disconnecting clients and flushing the log");
    let _ = shutdown_tx.send(true);
    for listener in listeners {
        let _ = listener.await;
    }
    let _ = store.await;
    let _ = admin.await;
    if let Some(adopter) = adopter {
        adopter.abort();
        let _ = adopter.await;
    }
    if let Some(cluster) = cluster {
        cluster.stop().await;
    }
    // Connections are closed (their detach and wills recorded): flush the session log.
    session_log.close().await;
    let _ = appender.await;
    match Arc::try_unwrap(wal) {
        Ok(wal) => wal
            .shutdown()
            .await
            .context("the log could not be flushed at shutdown")?,
        Err(_) => tracing::warn!("log writer still shared at shutdown; relying on its last fsync"),
    }
    let _ = stop_metrics.send(());
    if let Some((_, task)) = metrics {
        let _ = task.await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Warns loudly about a listener on a non-loopback address that anyone who reaches it can use.
fn warn_if_open(spec: &ListenerSpec, settings: &Resolved) {
    let anonymous = settings.allow_anonymous == Some(true);
    if spec.addr.ip().is_loopback() || (crate::auth::auth_configured(settings) && !anonymous) {
        return;
    }
    let listener = spec.to_string();
    if !spec.uses_tls() {
        tracing::warn!(%listener, "unencrypted MQTT without authentication on a non-loopback address: anyone who can reach it can read and write everything");
        return;
    }
    let mtls_required = spec
        .tls
        .as_ref()
        .is_some_and(|t| t.client_ca.is_some() && t.client_auth == TlsClientAuth::Required);
    if !mtls_required {
        tracing::warn!(%listener, "MQTT over TLS without client authentication on a non-loopback address: anyone who can reach it can read and write everything");
    }
}

fn tls_files(t: &TlsSettings) -> TlsFiles {
    TlsFiles {
        cert: t.cert.clone(),
        key: t.key.clone(),
        client_ca: t.client_ca.clone(),
        client_auth: match t.client_auth {
            TlsClientAuth::Required => ClientAuth::Required,
            TlsClientAuth::Optional => ClientAuth::Optional,
        },
        identity: match t.identity {
            TlsIdentity::Subject => IdentitySource::Subject,
            TlsIdentity::San => IdentitySource::San,
        },
        identity_is_client_id: t.use_identity_as_client_id,
    }
}

/// SIGHUP. Registered before any listener starts: until then the signal's default action would end
/// the server.
struct Hangup {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangup {
    fn register() -> Hangup {
        #[cfg(unix)]
        let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| {
                tracing::error!("cannot listen for SIGHUP (file changes still reload TLS): {e}")
            })
            .ok();
        Hangup {
            #[cfg(unix)]
            signal,
        }
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = self.signal.as_mut() {
            signal.recv().await;
            return;
        }
        std::future::pending().await
    }
}

/// Reloads the TLS files of every TLS listener on SIGHUP and whenever they change. Established
/// connections keep the configuration they started with; files that do not load are logged and
/// the previous configuration kept.
async fn reload_tls(
    listeners: Vec<Tls>,
    mut hangup: Hangup,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut poll = tokio::time::interval(defaults::TLS_RELOAD_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        let forced = tokio::select! {
            _ = &mut shutdown => return,
            () = hangup.recv() => true,
            _ = poll.tick() => false,
        };
        for tls in &listeners {
            let outcome = if forced {
                Some(tls.reload())
            } else {
                tls.reload_if_changed()
            };
            match outcome {
                None => {}
                Some(Ok(())) => {
                    tracing::info!(cert = %tls.files().cert.display(), "TLS certificate reloaded; new connections use it")
                }
                Some(Err(e)) => {
                    tracing::error!("TLS reload failed, keeping the previous certificate: {e}")
                }
            }
        }
    }
}

/// Options of both logs (state store and sessions).
fn wal_options(settings: &Resolved, name: &'static str) -> WalOptions {
    WalOptions {
        name,
        fsync: match settings.fsync {
            Fsync::Always => FsyncPolicy::Always,
            Fsync::Interval(every) => FsyncPolicy::Interval(every),
            Fsync::Never => FsyncPolicy::Never,
        },
        // Crash tests arm these with MQSTATE_FAILPOINT=<name>; unset in production, they cost nothing.
        failpoints: Failpoints::from_env(),
        ..WalOptions::default()
    }
}

pub(crate) fn store_limits(settings: &Resolved) -> Limits {
    let defaults = Limits::default();
    Limits {
        max_keys: settings.max_keys.unwrap_or(defaults.max_keys),
        max_total_bytes: settings.max_bytes.unwrap_or(defaults.max_total_bytes),
        max_key_bytes: settings.max_key_bytes.unwrap_or(defaults.max_key_bytes),
        max_value_bytes: settings.max_value_bytes,
        ..defaults
    }
}

pub(crate) fn broker_config(settings: &Resolved) -> BrokerConfig {
    let defaults = BrokerConfig::default();
    BrokerConfig {
        max_packet_size: settings.max_packet_size,
        receive_maximum: settings.receive_maximum.unwrap_or(defaults.receive_maximum),
        max_queued_messages: settings
            .max_queued_messages
            .unwrap_or(defaults.max_queued_messages),
        max_queued_bytes: settings
            .max_queued_bytes
            .unwrap_or(defaults.max_queued_bytes),
        session_expiry_max_secs: settings
            .session_expiry_max
            .unwrap_or(defaults.session_expiry_max_secs),
        auth_failure_burst: settings.auth_failure_limit,
        auth_failure_refill: settings.auth_failure_refill,
        max_connections: settings.max_connections.unwrap_or(defaults.max_connections),
        max_connections_per_address: settings
            .max_connections_per_address
            .unwrap_or(defaults.max_connections_per_address),
        connect_timeout: settings.connect_timeout.unwrap_or(defaults.connect_timeout),
        max_subscriptions_per_session: settings
            .max_subscriptions_per_session
            .unwrap_or(defaults.max_subscriptions_per_session),
        max_topic_length: settings
            .max_topic_length
            .unwrap_or(defaults.max_topic_length),
        max_topic_levels: settings
            .max_topic_levels
            .unwrap_or(defaults.max_topic_levels),
        slow_consumer_timeout: settings
            .slow_consumer_timeout
            .unwrap_or(defaults.slow_consumer_timeout),
        server_keep_alive_secs: settings.server_keep_alive,
        ..defaults
    }
}

async fn wait_for(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for SIGINT: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

fn init_logging(format: LogFormat, filter: &str) -> anyhow::Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| anyhow::anyhow!("invalid log filter {filter:?}: {e}"))?;
    // Colour codes only on a terminal: in a file or the journal they are noise (`\x1b[2m…`).
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let repeats = crate::repeated_logs::RepeatedLogs::default();
    let registry = tracing_subscriber::registry();
    let result = match format {
        LogFormat::Text => registry
            .with(layer.with_filter(filter).with_filter(repeats))
            .try_init(),
        LogFormat::Json => registry
            .with(layer.json().with_filter(filter).with_filter(repeats))
            .try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}
