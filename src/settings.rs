//! The one settings schema of `mqstate serve`.
//!
//! Every setting can come from three places, lowest precedence first: the settings file
//! (`--config FILE`, TOML or JSON; default `<data-dir>/../mqstate.settings.json` is *not* implied — a file
//! is read only when named), `MQSTATE_*` environment variables, and command-line flags. One struct,
//! [`Settings`], is both the clap argument group and the serde file schema, so the three cannot drift
//! apart; [`Settings::layer`] merges them field by field and [`Settings::resolve`] applies defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use mqstate_broker::BrokerConfig;
use mqstate_statestore::service::ServiceConfig;
use serde::Deserialize;

/// Defaults of the settings that only the binary uses. A setting passed on to a component defaults to
/// that component's own `Default` (`BrokerConfig`, `ServiceConfig`, `Limits`, `NotifyConfig`): one home
/// per default, and a test (`settings/reference.rs`) checks that every help text names the value the
/// code uses.
pub mod defaults {
    pub const LISTEN: &str = "127.0.0.1:1883";
    pub const DATA_DIR: &str = "./data";
    /// The log filter (RUST_LOG syntax).
    pub const LOG: &str = "info";
    /// How often the TLS certificate, key and client CA files are checked for changes.
    pub const TLS_RELOAD_POLL: std::time::Duration = std::time::Duration::from_secs(2);
    /// Partitions of the key space, fixed when a cluster is created.
    pub const CLUSTER_PARTITIONS: u32 = 64;
    /// Replicas per partition (capped by the node count).
    pub const REPLICATION_FACTOR: u32 = 3;
    /// How long a control-plane lease lets a node act, in seconds.
    /// Short: a lost node is detected lease + clock factor after its last grant, and the fail-over
    /// window is about that (decision 0049).
    pub const CLUSTER_LEASE_SECS: u64 = 1;
    /// Bound on clock drift between nodes over one lease, in seconds.
    pub const CLUSTER_CLOCK_FACTOR_SECS: u64 = 1;
    /// Raft election timeout (the low end; the high end is twice this), in milliseconds.
    pub const CLUSTER_ELECTION_TIMEOUT_MS: u64 = 500;
}

/// `fsync` policy of the write-ahead log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// Acknowledge only after `fdatasync` (group commit). The default: nothing acknowledged is lost.
    Always,
    /// `fdatasync` at most every N ms; acknowledged writes of the last interval can be lost in a power cut.
    Interval(Duration),
    /// Leave flushing to the OS; a crash of the machine can lose acknowledged writes.
    Never,
}

impl std::str::FromStr for Fsync {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "always" => Ok(Fsync::Always),
            "never" => Ok(Fsync::Never),
            other => {
                let ms = other
                    .strip_prefix("interval(")
                    .and_then(|r| r.strip_suffix(')'))
                    .or_else(|| other.strip_prefix("interval:"))
                    .ok_or_else(|| {
                        format!(
                            "invalid fsync policy {s:?}: expected always, never or interval(MS)"
                        )
                    })?;
                let ms: u64 = ms.trim().trim_end_matches("ms").parse().map_err(|_| {
                    format!(
                        "invalid fsync interval in {s:?}: expected milliseconds, e.g. interval(10)"
                    )
                })?;
                if ms == 0 {
                    return Err(
                        "fsync interval must be at least 1 ms; use `always` for per-batch fsync"
                            .into(),
                    );
                }
                Ok(Fsync::Interval(Duration::from_millis(ms)))
            }
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Which state-store keys are durable (spec §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Persistence {
    /// Every key is written to the log (the default).
    All,
    /// Only SETs carrying `aio-persistence: true` are written to the log, as in AIO.
    OptIn,
}

/// What a listener runs before MQTT, from the scheme of its `listen` address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    Tcp,
    Tls,
    Ws,
    Wss,
}

/// One resolved `listen` entry: `[tcp|tls|ws|wss://]IP:PORT[?TLS options]`.
#[derive(Debug, Clone)]
pub struct ListenerSpec {
    pub kind: ListenerKind,
    pub addr: SocketAddr,
    /// The listener's TLS settings: set exactly for `tls://` and `wss://`.
    pub tls: Option<TlsSettings>,
}

impl ListenerSpec {
    pub fn uses_tls(&self) -> bool {
        matches!(self.kind, ListenerKind::Tls | ListenerKind::Wss)
    }

    /// Parses a `listen` entry. TLS listeners take the `tls_*` settings (`global`), each of which
    /// the entry may override after a `?`: `tls://0.0.0.0:8883?client_ca=ca.pem&identity=san`.
    fn parse(text: &str, global: &TlsOptions) -> anyhow::Result<Self> {
        let (base, query) = match text.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (text, None),
        };
        let (kind, addr) = match base.split_once("://") {
            None => (ListenerKind::Tcp, base),
            Some((scheme, addr)) => {
                let kind = match scheme.to_ascii_lowercase().as_str() {
                    "tcp" | "mqtt" => ListenerKind::Tcp,
                    "tls" | "mqtts" | "ssl" => ListenerKind::Tls,
                    "ws" => ListenerKind::Ws,
                    "wss" => ListenerKind::Wss,
                    other => bail!(
                        "invalid listen address {text:?}: unknown scheme {other:?} (tcp, tls, ws or wss)"
                    ),
                };
                (kind, addr)
            }
        };
        let addr = addr.parse().with_context(|| {
            format!(
                "invalid listen address {text:?}: expected [tcp|tls|ws|wss://]IP:PORT, e.g. tls://0.0.0.0:8883"
            )
        })?;
        let mut spec = ListenerSpec {
            kind,
            addr,
            tls: None,
        };
        let mut local = TlsOptions::default();
        if let Some(query) = query {
            if !spec.uses_tls() {
                bail!("listen address {text:?}: options after `?` are TLS options, for tls:// and wss:// only");
            }
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                local
                    .set(key, value)
                    .with_context(|| format!("listen address {text:?}"))?;
            }
        }
        if spec.uses_tls() {
            spec.tls = Some(local.over(global).resolve(&spec)?);
        }
        Ok(spec)
    }
}

impl std::fmt::Display for ListenerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = match self.kind {
            ListenerKind::Tcp => "tcp",
            ListenerKind::Tls => "tls",
            ListenerKind::Ws => "ws",
            ListenerKind::Wss => "wss",
        };
        write!(f, "{scheme}://{}", self.addr)
    }
}

/// TLS options as given, globally (`tls_*` settings) or for one listener; unset ones are inherited
/// (listener from global), then defaulted.
#[derive(Debug, Clone, Default)]
struct TlsOptions {
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    client_auth: Option<TlsClientAuth>,
    identity: Option<TlsIdentity>,
    use_identity_as_client_id: Option<bool>,
}

impl TlsOptions {
    /// One per-listener option; the names are the settings' without `tls_`.
    fn set(&mut self, key: &str, value: &str) -> anyhow::Result<()> {
        use clap::ValueEnum;
        let path = || Some(PathBuf::from(value));
        match key {
            "cert" => self.cert = path(),
            "key" => self.key = path(),
            "client_ca" => self.client_ca = path(),
            "client_auth" => {
                self.client_auth = Some(TlsClientAuth::from_str(value, true).map_err(|_| {
                    anyhow::anyhow!("client_auth={value:?}: expected required or optional")
                })?)
            }
            "identity" => {
                self.identity = Some(TlsIdentity::from_str(value, true).map_err(|_| {
                    anyhow::anyhow!("identity={value:?}: expected subject or san")
                })?)
            }
            "use_identity_as_client_id" => {
                self.use_identity_as_client_id = Some(value.parse().map_err(|_| {
                    anyhow::anyhow!("use_identity_as_client_id={value:?}: expected true or false")
                })?)
            }
            other => bail!(
                "unknown TLS option {other:?}: expected cert, key, client_ca, client_auth, identity or use_identity_as_client_id"
            ),
        }
        Ok(())
    }

    fn over(self, lower: &TlsOptions) -> TlsOptions {
        let lower = lower.clone();
        TlsOptions {
            cert: self.cert.or(lower.cert),
            key: self.key.or(lower.key),
            client_ca: self.client_ca.or(lower.client_ca),
            client_auth: self.client_auth.or(lower.client_auth),
            identity: self.identity.or(lower.identity),
            use_identity_as_client_id: self
                .use_identity_as_client_id
                .or(lower.use_identity_as_client_id),
        }
    }

    fn resolve(self, listener: &ListenerSpec) -> anyhow::Result<TlsSettings> {
        let (Some(cert), Some(key)) = (self.cert, self.key) else {
            bail!("listener {listener} needs a certificate and key: set tls_cert and tls_key (--tls-cert, --tls-key), or cert= and key= after `?`");
        };
        Ok(TlsSettings {
            cert,
            key,
            client_ca: self.client_ca,
            client_auth: self.client_auth.unwrap_or(TlsClientAuth::Required),
            identity: self.identity.unwrap_or(TlsIdentity::Subject),
            use_identity_as_client_id: self.use_identity_as_client_id.unwrap_or(false),
        })
    }
}

/// Whether TLS clients must present a certificate signed by `tls_client_ca`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TlsClientAuth {
    Required,
    Optional,
}

/// Which part of a client certificate is the client's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TlsIdentity {
    /// The subject's common name.
    Subject,
    /// The first DNS or URI subject alternative name.
    San,
}

/// TLS material and client-certificate options of one `tls://` or `wss://` listener.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub client_auth: TlsClientAuth,
    pub identity: TlsIdentity,
    pub use_identity_as_client_id: bool,
}

/// The settings schema: every field optional here; [`Settings::resolve`] fills defaults.
#[derive(Debug, Clone, Default, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields, rename_all = "snake_case")]
pub struct Settings {
    /// Address to accept MQTT on (repeatable): `IP:PORT` or `tcp://` for plain TCP, `tls://`, `ws://`
    /// (WebSocket) or `wss://` (WebSocket over TLS) before it. Default 127.0.0.1:1883.
    #[arg(
        long = "listen",
        env = "MQSTATE_LISTEN",
        value_delimiter = ',',
        value_name = "ADDR"
    )]
    pub listen: Vec<String>,

    /// Address of the HTTP endpoint with Prometheus `/metrics`, `/health` and `/ready`. Default: off.
    #[arg(long, env = "MQSTATE_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<String>,

    /// Directory of the durable state (log, snapshot, metadata). Default ./data.
    #[arg(long, env = "MQSTATE_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// When to fsync the log: always | interval(MS) | never. Default always.
    #[arg(long, env = "MQSTATE_FSYNC", value_name = "POLICY")]
    pub fsync: Option<String>,

    /// Which state-store keys are durable: all | opt-in. Default all.
    #[arg(long, env = "MQSTATE_PERSISTENCE", value_enum)]
    pub persistence: Option<Persistence>,

    /// Log format: text | json. Default text.
    #[arg(long, env = "MQSTATE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,

    /// Log filter in RUST_LOG syntax (e.g. `info,mqstate_broker=debug`). Default `info`.
    #[arg(long, env = "MQSTATE_LOG", value_name = "FILTER")]
    pub log: Option<String>,

    /// Largest MQTT packet accepted and advertised, in bytes. Default 1 MiB.
    #[arg(long, env = "MQSTATE_MAX_PACKET_SIZE", value_name = "BYTES")]
    pub max_packet_size: Option<u32>,

    /// Receive Maximum advertised to clients. Default 1024.
    #[arg(long, env = "MQSTATE_RECEIVE_MAXIMUM", value_name = "N")]
    pub receive_maximum: Option<u16>,

    /// Messages queued per session while the client is away or slow. Default 1000.
    #[arg(long, env = "MQSTATE_MAX_QUEUED_MESSAGES", value_name = "N")]
    pub max_queued_messages: Option<usize>,

    /// Topic and payload bytes queued per session while the client is away or slow; a single larger
    /// message still enters an empty queue. Default 67108864 (64 MiB).
    #[arg(long, env = "MQSTATE_MAX_QUEUED_BYTES", value_name = "BYTES")]
    pub max_queued_bytes: Option<usize>,

    /// Upper bound on the Session Expiry Interval a client may ask for, in seconds. Default 7 days.
    #[arg(long, env = "MQSTATE_SESSION_EXPIRY_MAX", value_name = "SECS")]
    pub session_expiry_max: Option<u32>,

    /// Take a snapshot (and drop the log it covers) once a log grew by this many bytes: each of the state store's, the sessions' and a cluster node's chain log. Default 64 MiB.
    #[arg(long, env = "MQSTATE_SNAPSHOT_THRESHOLD_BYTES", value_name = "BYTES")]
    pub snapshot_threshold_bytes: Option<u64>,

    /// State store: maximum number of keys. Default 10,000,000.
    #[arg(long, env = "MQSTATE_MAX_KEYS", value_name = "N")]
    pub max_keys: Option<u64>,

    /// State store: maximum total bytes of keys + values. Default 1 GiB.
    #[arg(long, env = "MQSTATE_MAX_BYTES", value_name = "BYTES")]
    pub max_bytes: Option<u64>,

    /// State store: maximum key size in bytes. Default 65536.
    #[arg(long, env = "MQSTATE_MAX_KEY_BYTES", value_name = "BYTES")]
    pub max_key_bytes: Option<u64>,

    /// State store: maximum value size in bytes. Default: the maximum packet size.
    #[arg(long, env = "MQSTATE_MAX_VALUE_BYTES", value_name = "BYTES")]
    pub max_value_bytes: Option<u64>,

    /// Password file (`user:argon2id-hash` lines, managed with `mqstate passwd`). Default none.
    #[arg(long, env = "MQSTATE_PASSWORD_FILE", value_name = "FILE")]
    pub password_file: Option<PathBuf>,

    /// Public key (PEM, RS256 or ES256) that verifies `K8S-SAT` tokens. Default none (method refused).
    #[arg(long, env = "MQSTATE_JWT_PUBLIC_KEY", value_name = "FILE")]
    pub jwt_public_key: Option<PathBuf>,

    /// Audience `K8S-SAT` tokens must carry in `aud`. Default: not checked.
    #[arg(long, env = "MQSTATE_JWT_AUDIENCE", value_name = "AUD")]
    pub jwt_audience: Option<String>,

    /// Whether clients without credentials may connect; unset and without authentication, listeners
    /// beyond loopback are refused at start-up, set it to true to allow that on purpose. Default: true
    /// only when no authentication (password file, JWT key, client CA) is configured.
    #[arg(long, env = "MQSTATE_ALLOW_ANONYMOUS", value_name = "BOOL")]
    pub allow_anonymous: Option<bool>,

    /// ACL file (topics and state-store keys per user, client id or certificate). Default none: every
    /// client may do everything.
    #[arg(long, env = "MQSTATE_ACL_FILE", value_name = "FILE")]
    pub acl_file: Option<PathBuf>,

    /// Failed authentications from one address before its CONNECTs are refused unchecked; 0 disables.
    /// Default 30.
    #[arg(long, env = "MQSTATE_AUTH_FAILURE_LIMIT", value_name = "N")]
    pub auth_failure_limit: Option<u32>,

    /// Seconds after which a rate-limited address gets one more attempt. Default 2.
    #[arg(long, env = "MQSTATE_AUTH_FAILURE_REFILL", value_name = "SECS")]
    pub auth_failure_refill: Option<u64>,
    /// PEM certificate chain for `tls://` and `wss://` listeners (reloaded on SIGHUP or change). Default none.
    #[arg(long, env = "MQSTATE_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert. Default none.
    #[arg(long, env = "MQSTATE_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificate(s) of client certificates: enables mTLS on TLS listeners. Default none.
    #[arg(long, env = "MQSTATE_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,

    /// With --tls-client-ca: required (no certificate, no connection) | optional. Default required.
    #[arg(long, env = "MQSTATE_TLS_CLIENT_AUTH", value_enum)]
    pub tls_client_auth: Option<TlsClientAuth>,

    /// Client certificate identity: subject (CN) | san (first DNS/URI name). Default subject.
    #[arg(long, env = "MQSTATE_TLS_IDENTITY", value_enum)]
    pub tls_identity: Option<TlsIdentity>,

    /// On TLS listeners, the client id is the certificate identity (told in CONNACK). Default false.
    #[arg(long, env = "MQSTATE_USE_IDENTITY_AS_CLIENT_ID", value_name = "BOOL",
          num_args = 0..=1, default_missing_value = "true")]
    pub use_identity_as_client_id: Option<bool>,

    /// Open MQTT sockets at most (handshakes included); more get CONNACK 0x97 or are closed. 0 disables.
    /// Default 100,000.
    #[arg(long, env = "MQSTATE_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,

    /// Open MQTT sockets at most from one source address; 0 disables. Default 0.
    #[arg(long, env = "MQSTATE_MAX_CONNECTIONS_PER_ADDRESS", value_name = "N")]
    pub max_connections_per_address: Option<usize>,

    /// Seconds allowed between accepting a socket and a complete CONNECT. Default 10.
    #[arg(long, env = "MQSTATE_CONNECT_TIMEOUT", value_name = "SECS")]
    pub connect_timeout: Option<u64>,

    /// Subscriptions one session may hold; more get SUBACK 0x97. 0 disables. Default 1000.
    #[arg(long, env = "MQSTATE_MAX_SUBSCRIPTIONS_PER_SESSION", value_name = "N")]
    pub max_subscriptions_per_session: Option<usize>,

    /// Longest topic name or filter in bytes (DISCONNECT 0x90 / SUBACK 0x8F beyond). Default 65535.
    #[arg(long, env = "MQSTATE_MAX_TOPIC_LENGTH", value_name = "BYTES")]
    pub max_topic_length: Option<usize>,

    /// Most levels in a topic name or filter (DISCONNECT 0x90 / SUBACK 0x8F beyond). Default 128.
    #[arg(long, env = "MQSTATE_MAX_TOPIC_LEVELS", value_name = "N")]
    pub max_topic_levels: Option<usize>,

    /// Seconds a client's socket may take no write batch before the client is disconnected. Default 30.
    #[arg(long, env = "MQSTATE_SLOW_CONSUMER_TIMEOUT", value_name = "SECS")]
    pub slow_consumer_timeout: Option<u64>,

    /// Longest keep-alive a client may use, in seconds (Mosquitto's max_keepalive): MQTT 5 clients
    /// asking for more or for none are told this value (CONNACK Server Keep Alive); MQTT 3.1.1 clients
    /// get CONNACK 0x02. Default none (the client's own keep-alive).
    #[arg(long, env = "MQSTATE_SERVER_KEEP_ALIVE", value_name = "SECS")]
    pub server_keep_alive: Option<u16>,

    /// State-store requests executed per second per client; more are answered
    /// `-ERR the quota has been exceeded`. 0 disables. Default 0.
    #[arg(long, env = "MQSTATE_STATESTORE_REQUESTS_PER_SECOND", value_name = "N")]
    pub statestore_requests_per_second: Option<u32>,

    /// Threads that run connections and the state store (the async runtime's workers; the
    /// write-ahead log writes on threads of its own). 0: one per core. Fewer spend less CPU per
    /// durable write but carry less load (on two cores, 1 cuts CPU per durable SET by a quarter
    /// and state-store throughput at 64 connections by as much; decision 0045). Default 0.
    #[arg(long, env = "MQSTATE_RUNTIME_THREADS", value_name = "N")]
    pub runtime_threads: Option<usize>,

    /// Names this node in the lock keys of notification queues (`<id>/<cookie>`); unique per node. Default `mqstate`.
    #[arg(long, env = "MQSTATE_NOTIFY_NODE_ID", value_name = "ID")]
    pub notify_node_id: Option<String>,

    /// Milliseconds after which a notification reservation that was neither committed nor aborted is aborted (only a log written before decision 0038 can hold one: a crash between its reservation and commit records). Default 30000.
    #[arg(long, env = "MQSTATE_NOTIFY_RESERVATION_TIMEOUT_MS", value_name = "MS")]
    pub notify_reservation_timeout_ms: Option<u64>,

    /// Milliseconds between two walks over the notification queues that take or renew their locks. Default 30000.
    #[arg(long, env = "MQSTATE_NOTIFY_WALK_INTERVAL_MS", value_name = "MS")]
    pub notify_walk_interval_ms: Option<u64>,

    /// Milliseconds a queue lock lasts without renewal; then another node may take the queue over. Default 90000.
    #[arg(long, env = "MQSTATE_NOTIFY_LOCK_EXPIRY_MS", value_name = "MS")]
    pub notify_lock_expiry_ms: Option<u64>,

    /// First delay before a failed push is retried; it doubles per failure. Default 1000.
    #[arg(long, env = "MQSTATE_NOTIFY_RETRY_MIN_MS", value_name = "MS")]
    pub notify_retry_min_ms: Option<u64>,

    /// Longest delay between retries of a failed push. Default 30000.
    #[arg(long, env = "MQSTATE_NOTIFY_RETRY_MAX_MS", value_name = "MS")]
    pub notify_retry_max_ms: Option<u64>,

    /// Notifications listed and pushed at a time (one HTTP POST). Default 100.
    #[arg(long, env = "MQSTATE_NOTIFY_BATCH", value_name = "N")]
    pub notify_batch: Option<usize>,

    /// Milliseconds a queue's owner waits after pushing a batch that was not full, so the next one fills: fewer, fuller pushes under a steady stream of changes, for at most this much more latency; 0 pushes at once. Default 5.
    #[arg(long, env = "MQSTATE_NOTIFY_LINGER_MS", value_name = "MS")]
    pub notify_linger_ms: Option<u64>,

    /// CA certificates (PEM) that `https://` and `mqtts://` notification endpoints are verified against. Default none: the system's CA certificates.
    #[arg(long, env = "MQSTATE_NOTIFY_TLS_CA_FILE", value_name = "FILE")]
    pub notify_tls_ca_file: Option<PathBuf>,
    /// This node's id in a cluster: a positive number, never reused. Default: none (a single node).
    #[arg(long, env = "MQSTATE_NODE_ID", value_name = "N")]
    pub node_id: Option<u64>,

    /// Take the node id from this host's name instead of node_id: the number after its last `-`, plus
    /// one (a Kubernetes StatefulSet's pod `mqstate-0` is node 1, `mqstate-3` node 4). A node whose id
    /// is not in peers then waits to be added, as with join. Default false.
    #[arg(long, env = "MQSTATE_NODE_ID_FROM_HOSTNAME", value_name = "BOOL",
          num_args = 0..=1, default_missing_value = "true")]
    pub node_id_from_hostname: Option<bool>,

    /// Address for node-to-node traffic (control plane), e.g. 0.0.0.0:7001. Default: none (a single node).
    #[arg(long, env = "MQSTATE_CLUSTER_LISTEN", value_name = "ADDR")]
    pub cluster_listen: Option<String>,

    /// The founding members as ID=HOST:PORT (their cluster addresses), this node included; the same
    /// list on every node. Default: none (a single node).
    #[arg(
        long,
        env = "MQSTATE_PEERS",
        value_delimiter = ',',
        value_name = "ID=ADDR"
    )]
    pub peers: Vec<String>,

    /// Join an existing cluster: wait to be added with `mqstate cluster add-node` instead of forming
    /// one. Default false.
    #[arg(long, env = "MQSTATE_JOIN", value_name = "BOOL",
          num_args = 0..=1, default_missing_value = "true")]
    pub join: Option<bool>,

    /// Partitions of the key space; fixed when the cluster is created. Default 64.
    #[arg(long, env = "MQSTATE_CLUSTER_PARTITIONS", value_name = "N")]
    pub cluster_partitions: Option<u32>,

    /// Replicas of each partition (capped by the node count). Default 3.
    #[arg(long, env = "MQSTATE_REPLICATION_FACTOR", value_name = "N")]
    pub replication_factor: Option<u32>,

    /// Seconds a control-plane lease lets a node act on its partitions; a node that misses its
    /// renewals for lease + clock factor is taken out of its chains. Default 1.
    #[arg(long, env = "MQSTATE_CLUSTER_LEASE", value_name = "SECS")]
    pub cluster_lease: Option<u64>,

    /// Seconds by which node clocks may drift apart over one lease; a new view waits lease + this.
    /// Default 1.
    #[arg(long, env = "MQSTATE_CLUSTER_CLOCK_FACTOR", value_name = "SECS")]
    pub cluster_clock_factor: Option<u64>,

    /// Raft election timeout in milliseconds (a leader is replaced within about twice this).
    /// Default 500.
    #[arg(long, env = "MQSTATE_CLUSTER_ELECTION_TIMEOUT", value_name = "MS")]
    pub cluster_election_timeout: Option<u64>,

    /// PEM certificate chain of this node for mutual TLS between nodes; it must name the host of
    /// this node's cluster address. Needs cluster_tls_key and cluster_tls_ca. Default none.
    #[arg(long, env = "MQSTATE_CLUSTER_TLS_CERT", value_name = "FILE")]
    pub cluster_tls_cert: Option<PathBuf>,

    /// PEM private key of --cluster-tls-cert. Default none.
    #[arg(long, env = "MQSTATE_CLUSTER_TLS_KEY", value_name = "FILE")]
    pub cluster_tls_key: Option<PathBuf>,

    /// PEM CA certificate(s) that sign every node's certificate; a peer without one is refused.
    /// Default none.
    #[arg(long, env = "MQSTATE_CLUSTER_TLS_CA", value_name = "FILE")]
    pub cluster_tls_ca: Option<PathBuf>,

    /// Allow node-to-node traffic without TLS on addresses beyond loopback (a private network you
    /// trust); without it and without cluster_tls_*, only loopback addresses are allowed. Default false.
    #[arg(long, env = "MQSTATE_CLUSTER_PLAINTEXT", value_name = "BOOL",
          num_args = 0..=1, default_missing_value = "true")]
    pub cluster_plaintext: Option<bool>,

    /// Testing only: milliseconds added to this node's wall clock (negative: behind), to run a
    /// node with a skewed clock (the robustness suite's per-node clock offset). Default 0.
    #[arg(
        long,
        env = "MQSTATE_TEST_CLOCK_OFFSET_MS",
        value_name = "MS",
        hide = true,
        allow_negative_numbers = true
    )]
    pub test_clock_offset_ms: Option<i64>,
}

/// Mutual TLS between nodes: the files as given (read when the node starts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// The cluster part of the resolved settings; absent on a single node.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    pub node_id: u64,
    pub listen: SocketAddr,
    /// The address the other nodes reach this one at: its entry in `peers`, else `listen`.
    pub advertise: String,
    /// Founding members (empty when joining).
    pub peers: std::collections::BTreeMap<u64, String>,
    pub join: bool,
    pub partitions: u32,
    pub replication_factor: u32,
    pub lease: Duration,
    pub clock_factor: Duration,
    pub election_timeout: Duration,
    /// `None`: plain TCP (loopback only, unless `cluster_plaintext`).
    pub tls: Option<ClusterTlsFiles>,
    pub plaintext: bool,
}

/// Whether `host` (an IP or a name, from `HOST:PORT`) is this machine's loopback.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The node id a host name stands for with `node_id_from_hostname`: the number after its last `-`,
/// plus one, so that the ordinal 0 of a StatefulSet's first pod becomes the first id, 1.
fn node_id_of_hostname(hostname: &str) -> anyhow::Result<u64> {
    let name = hostname.split('.').next().unwrap_or(hostname);
    name.rsplit_once('-')
        .and_then(|(_, ordinal)| ordinal.parse::<u64>().ok())
        .and_then(|ordinal| ordinal.checked_add(1))
        .with_context(|| {
            format!("node_id_from_hostname: the host name {hostname:?} does not end in -NUMBER (a StatefulSet pod's ordinal, as in mqstate-0); set node_id instead")
        })
}

/// This host's name (`gethostname`): in a Kubernetes pod, the pod's name.
fn system_hostname() -> anyhow::Result<String> {
    let name =
        nix::unistd::gethostname().context("node_id_from_hostname: cannot read the host name")?;
    name.into_string().map_err(|name| {
        anyhow::anyhow!("node_id_from_hostname: the host name {name:?} is not UTF-8")
    })
}

impl ClusterSettings {
    fn resolve(s: &Settings) -> anyhow::Result<Option<ClusterSettings>> {
        ClusterSettings::resolve_with(s, system_hostname)
    }

    /// `hostname` is asked only with `node_id_from_hostname`.
    fn resolve_with(
        s: &Settings,
        hostname: impl FnOnce() -> anyhow::Result<String>,
    ) -> anyhow::Result<Option<ClusterSettings>> {
        let mut join = s.join.unwrap_or(false);
        let from_hostname = s.node_id_from_hostname.unwrap_or(false);
        if s.node_id.is_none()
            && !from_hostname
            && s.cluster_listen.is_none()
            && s.peers.is_empty()
            && !join
        {
            return Ok(None);
        }
        let node_id = match (s.node_id, from_hostname) {
            (Some(_), true) => {
                bail!("node_id and node_id_from_hostname are both set: set one of them")
            }
            (Some(id), false) => id,
            (None, true) => node_id_of_hostname(&hostname()?)?,
            (None, false) => bail!(
                "a cluster node needs --node-id (a positive number, never reused), or --node-id-from-hostname"
            ),
        };
        if node_id == 0 {
            bail!("node_id must be at least 1");
        }
        let Some(listen) = &s.cluster_listen else {
            bail!("a cluster node needs --cluster-listen, the address for node-to-node traffic");
        };
        let listen: SocketAddr = listen.parse().with_context(|| {
            format!("invalid cluster_listen {listen:?}: expected IP:PORT, e.g. 0.0.0.0:7001")
        })?;
        let mut peers = std::collections::BTreeMap::new();
        for entry in &s.peers {
            let (id, addr) = entry.split_once('=').with_context(|| {
                format!("invalid peer {entry:?}: expected ID=HOST:PORT, e.g. 1=10.0.0.1:7001")
            })?;
            let id: u64 = id
                .trim()
                .parse()
                .ok()
                .filter(|&id| id > 0)
                .with_context(|| {
                    format!("invalid peer {entry:?}: the id must be a positive number")
                })?;
            let addr = addr.trim();
            if addr
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.parse::<u16>().is_err())
            {
                bail!("invalid peer {entry:?}: expected ID=HOST:PORT");
            }
            if peers.insert(id, addr.to_owned()).is_some() {
                bail!("peer id {id} is listed twice in --peers");
            }
        }
        // One pod template for every replica: the ones beyond the founding list are new nodes.
        if from_hostname && !peers.contains_key(&node_id) {
            join = true;
        }
        if peers.is_empty() && !join {
            bail!("a cluster node needs --peers ID=ADDR,... (every founding node, this one included) or --join");
        }
        if !peers.is_empty() && !join && !peers.contains_key(&node_id) {
            bail!("--peers does not list this node (id {node_id}); list every founding node, this one included");
        }
        let positive = |name: &str, value: Option<u64>, default: u64| -> anyhow::Result<u64> {
            match value {
                Some(0) => bail!("{name} must be at least 1"),
                Some(v) => Ok(v),
                None => Ok(default),
            }
        };
        let partitions = positive(
            "cluster_partitions",
            s.cluster_partitions.map(u64::from),
            u64::from(defaults::CLUSTER_PARTITIONS),
        )?;
        let replication_factor = positive(
            "replication_factor",
            s.replication_factor.map(u64::from),
            u64::from(defaults::REPLICATION_FACTOR),
        )?;
        let tls = match (&s.cluster_tls_cert, &s.cluster_tls_key, &s.cluster_tls_ca) {
            (None, None, None) => None,
            (Some(cert), Some(key), Some(ca)) => Some(ClusterTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            }),
            _ => bail!("mutual TLS between nodes needs all three of cluster_tls_cert, cluster_tls_key and cluster_tls_ca (--cluster-tls-cert, --cluster-tls-key, --cluster-tls-ca)"),
        };
        let plaintext = s.cluster_plaintext.unwrap_or(false);
        if tls.is_none() && !plaintext {
            let beyond = std::iter::once(listen.ip().to_string())
                .chain(peers.values().map(|addr| {
                    addr.rsplit_once(':')
                        .map_or(addr.as_str(), |(host, _)| host)
                        .to_owned()
                }))
                .find(|host| !is_loopback_host(host));
            if let Some(host) = beyond {
                bail!("cluster address {host} is beyond loopback and node-to-node traffic would be plain TCP: set cluster_tls_cert, cluster_tls_key and cluster_tls_ca (mutual TLS), or cluster_plaintext = true on a private network you trust");
            }
        }
        Ok(Some(ClusterSettings {
            node_id,
            listen,
            advertise: peers
                .get(&node_id)
                .cloned()
                .unwrap_or_else(|| listen.to_string()),
            peers,
            join,
            partitions: u32::try_from(partitions).unwrap_or(u32::MAX),
            replication_factor: u32::try_from(replication_factor).unwrap_or(u32::MAX),
            lease: Duration::from_secs(positive(
                "cluster_lease",
                s.cluster_lease,
                defaults::CLUSTER_LEASE_SECS,
            )?),
            clock_factor: Duration::from_secs(
                s.cluster_clock_factor
                    .unwrap_or(defaults::CLUSTER_CLOCK_FACTOR_SECS),
            ),
            election_timeout: Duration::from_millis(positive(
                "cluster_election_timeout",
                s.cluster_election_timeout,
                defaults::CLUSTER_ELECTION_TIMEOUT_MS,
            )?),
            tls,
            plaintext,
        }))
    }
}

/// Settings with every default applied and every value checked.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Added to the node's wall clock (`test_clock_offset_ms`; testing only).
    pub clock_offset_ms: i64,
    pub listen: Vec<ListenerSpec>,
    pub metrics_listen: Option<SocketAddr>,
    pub data_dir: PathBuf,
    pub fsync: Fsync,
    pub persistence: Persistence,
    pub log_format: LogFormat,
    pub log: String,
    pub max_packet_size: u32,
    /// The rest default to the broker's and the store's own documented defaults when unset.
    pub receive_maximum: Option<u16>,
    pub max_queued_messages: Option<usize>,
    pub max_queued_bytes: Option<usize>,
    pub session_expiry_max: Option<u32>,
    pub max_keys: Option<u64>,
    pub max_bytes: Option<u64>,
    pub max_key_bytes: Option<u64>,
    pub max_value_bytes: u64,
    pub snapshot_threshold_bytes: u64,
    pub password_file: Option<PathBuf>,
    pub jwt_public_key: Option<PathBuf>,
    pub jwt_audience: Option<String>,
    /// `None`: decided by whether authentication is configured (see `auth::load`).
    pub allow_anonymous: Option<bool>,
    pub acl_file: Option<PathBuf>,
    pub auth_failure_limit: u32,
    pub auth_failure_refill: Duration,
    pub max_connections: Option<usize>,
    pub max_connections_per_address: Option<usize>,
    pub connect_timeout: Option<Duration>,
    pub max_subscriptions_per_session: Option<usize>,
    pub max_topic_length: Option<usize>,
    pub max_topic_levels: Option<usize>,
    pub slow_consumer_timeout: Option<Duration>,
    pub server_keep_alive: Option<u16>,
    pub statestore_requests_per_second: u32,
    /// 0: chosen from the cores ([`Resolved::worker_threads`]).
    pub runtime_threads: usize,
    pub notify: mqstate_statestore::notify::NotifyConfig,
    pub cluster: Option<ClusterSettings>,
}

impl Resolved {
    /// The async runtime's worker threads: `runtime_threads`, or for 0 one per core (decision
    /// 0045: one worker less saves CPU per request but costs throughput under load).
    pub fn worker_threads(&self) -> usize {
        match self.runtime_threads {
            0 => std::thread::available_parallelism().map_or(1, |cores| cores.get()),
            n => n,
        }
    }
}

/// The notification settings with defaults applied; intervals of 0 and an invalid node id are refused.
fn notify_config(
    node_id: Option<String>,
    [reservation, walk, lock, retry_min, retry_max]: [Option<u64>; 5],
    batch: Option<usize>,
    linger_ms: Option<u64>,
    tls_ca_file: Option<PathBuf>,
) -> anyhow::Result<mqstate_statestore::notify::NotifyConfig> {
    let d = mqstate_statestore::notify::NotifyConfig::default();
    let ms = |value: Option<u64>, default: Duration, name: &str| match value {
        Some(0) => bail!("{name} must be at least 1 ms"),
        Some(ms) => Ok(Duration::from_millis(ms)),
        None => Ok(default),
    };
    let node_id = node_id.unwrap_or(d.node_id);
    if node_id.is_empty() || node_id.contains('/') {
        bail!("notify_node_id {node_id:?} must be non-empty and contain no '/'");
    }
    let config = mqstate_statestore::notify::NotifyConfig {
        node_id,
        reservation_timeout: ms(
            reservation,
            d.reservation_timeout,
            "notify_reservation_timeout_ms",
        )?,
        walk_interval: ms(walk, d.walk_interval, "notify_walk_interval_ms")?,
        lock_expiry: ms(lock, d.lock_expiry, "notify_lock_expiry_ms")?,
        retry_min: ms(retry_min, d.retry_min, "notify_retry_min_ms")?,
        retry_max: ms(retry_max, d.retry_max, "notify_retry_max_ms")?,
        batch_max: match batch {
            Some(0) => bail!("notify_batch must be at least 1"),
            Some(n) => n,
            None => d.batch_max,
        },
        linger: linger_ms.map_or(d.linger, Duration::from_millis),
        push_timeout: d.push_timeout,
        tls_ca_file,
    };
    if let Some(path) = &config.tls_ca_file {
        // Refused at start, not at the first push to a TLS endpoint.
        mqstate_statestore::notify::tls_client_config(Some(path))
            .map_err(|e| anyhow::anyhow!("notify_tls_ca_file: {e}"))?;
    }
    if config.lock_expiry <= config.walk_interval {
        tracing::warn!("notify_lock_expiry_ms is not longer than notify_walk_interval_ms: queue locks lapse between renewals");
    }
    Ok(config)
}

impl Settings {
    /// Read a settings file: TOML, or JSON when the name ends in `.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Settings> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read settings file {}", path.display()))?;
        let parsed = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(anyhow::Error::from)
        } else {
            toml::from_str(&text).map_err(anyhow::Error::from)
        };
        parsed.with_context(|| format!("invalid settings file {}", path.display()))
    }

    /// `self` (flags and environment) over `lower` (the file): each field set here wins.
    pub fn layer(self, lower: Settings) -> Settings {
        Settings {
            listen: if self.listen.is_empty() {
                lower.listen
            } else {
                self.listen
            },
            metrics_listen: self.metrics_listen.or(lower.metrics_listen),
            data_dir: self.data_dir.or(lower.data_dir),
            fsync: self.fsync.or(lower.fsync),
            persistence: self.persistence.or(lower.persistence),
            log_format: self.log_format.or(lower.log_format),
            log: self.log.or(lower.log),
            max_packet_size: self.max_packet_size.or(lower.max_packet_size),
            receive_maximum: self.receive_maximum.or(lower.receive_maximum),
            max_queued_messages: self.max_queued_messages.or(lower.max_queued_messages),
            max_queued_bytes: self.max_queued_bytes.or(lower.max_queued_bytes),
            session_expiry_max: self.session_expiry_max.or(lower.session_expiry_max),
            max_keys: self.max_keys.or(lower.max_keys),
            max_bytes: self.max_bytes.or(lower.max_bytes),
            max_key_bytes: self.max_key_bytes.or(lower.max_key_bytes),
            max_value_bytes: self.max_value_bytes.or(lower.max_value_bytes),
            snapshot_threshold_bytes: self
                .snapshot_threshold_bytes
                .or(lower.snapshot_threshold_bytes),
            password_file: self.password_file.or(lower.password_file),
            jwt_public_key: self.jwt_public_key.or(lower.jwt_public_key),
            jwt_audience: self.jwt_audience.or(lower.jwt_audience),
            allow_anonymous: self.allow_anonymous.or(lower.allow_anonymous),
            acl_file: self.acl_file.or(lower.acl_file),
            auth_failure_limit: self.auth_failure_limit.or(lower.auth_failure_limit),
            auth_failure_refill: self.auth_failure_refill.or(lower.auth_failure_refill),
            tls_cert: self.tls_cert.or(lower.tls_cert),
            tls_key: self.tls_key.or(lower.tls_key),
            tls_client_ca: self.tls_client_ca.or(lower.tls_client_ca),
            tls_client_auth: self.tls_client_auth.or(lower.tls_client_auth),
            tls_identity: self.tls_identity.or(lower.tls_identity),
            use_identity_as_client_id: self
                .use_identity_as_client_id
                .or(lower.use_identity_as_client_id),
            max_connections: self.max_connections.or(lower.max_connections),
            max_connections_per_address: self
                .max_connections_per_address
                .or(lower.max_connections_per_address),
            connect_timeout: self.connect_timeout.or(lower.connect_timeout),
            max_subscriptions_per_session: self
                .max_subscriptions_per_session
                .or(lower.max_subscriptions_per_session),
            max_topic_length: self.max_topic_length.or(lower.max_topic_length),
            max_topic_levels: self.max_topic_levels.or(lower.max_topic_levels),
            slow_consumer_timeout: self.slow_consumer_timeout.or(lower.slow_consumer_timeout),
            server_keep_alive: self.server_keep_alive.or(lower.server_keep_alive),
            statestore_requests_per_second: self
                .statestore_requests_per_second
                .or(lower.statestore_requests_per_second),
            runtime_threads: self.runtime_threads.or(lower.runtime_threads),
            notify_node_id: self.notify_node_id.or(lower.notify_node_id),
            notify_reservation_timeout_ms: self
                .notify_reservation_timeout_ms
                .or(lower.notify_reservation_timeout_ms),
            notify_walk_interval_ms: self
                .notify_walk_interval_ms
                .or(lower.notify_walk_interval_ms),
            notify_lock_expiry_ms: self.notify_lock_expiry_ms.or(lower.notify_lock_expiry_ms),
            notify_retry_min_ms: self.notify_retry_min_ms.or(lower.notify_retry_min_ms),
            notify_retry_max_ms: self.notify_retry_max_ms.or(lower.notify_retry_max_ms),
            notify_batch: self.notify_batch.or(lower.notify_batch),
            notify_linger_ms: self.notify_linger_ms.or(lower.notify_linger_ms),
            notify_tls_ca_file: self.notify_tls_ca_file.or(lower.notify_tls_ca_file),
            node_id: self.node_id.or(lower.node_id),
            node_id_from_hostname: self.node_id_from_hostname.or(lower.node_id_from_hostname),
            cluster_listen: self.cluster_listen.or(lower.cluster_listen),
            peers: if self.peers.is_empty() {
                lower.peers
            } else {
                self.peers
            },
            join: self.join.or(lower.join),
            cluster_partitions: self.cluster_partitions.or(lower.cluster_partitions),
            replication_factor: self.replication_factor.or(lower.replication_factor),
            cluster_lease: self.cluster_lease.or(lower.cluster_lease),
            cluster_clock_factor: self.cluster_clock_factor.or(lower.cluster_clock_factor),
            cluster_election_timeout: self
                .cluster_election_timeout
                .or(lower.cluster_election_timeout),
            cluster_tls_cert: self.cluster_tls_cert.or(lower.cluster_tls_cert),
            cluster_tls_key: self.cluster_tls_key.or(lower.cluster_tls_key),
            cluster_tls_ca: self.cluster_tls_ca.or(lower.cluster_tls_ca),
            cluster_plaintext: self.cluster_plaintext.or(lower.cluster_plaintext),
            test_clock_offset_ms: self.test_clock_offset_ms.or(lower.test_clock_offset_ms),
        }
    }

    pub fn resolve(self) -> anyhow::Result<Resolved> {
        let broker = BrokerConfig::default();
        let service = ServiceConfig::default();
        let cluster = ClusterSettings::resolve(&self)?;
        let listen_text = if self.listen.is_empty() {
            vec![defaults::LISTEN.to_owned()]
        } else {
            self.listen
        };
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => bail!("tls_cert is set but tls_key is not: give both"),
            (None, Some(_)) => bail!("tls_key is set but tls_cert is not: give both"),
            _ => {}
        }
        let global_tls = TlsOptions {
            cert: self.tls_cert,
            key: self.tls_key,
            client_ca: self.tls_client_ca,
            client_auth: self.tls_client_auth,
            identity: self.tls_identity,
            use_identity_as_client_id: self.use_identity_as_client_id,
        };
        let listen = listen_text
            .iter()
            .map(|text| ListenerSpec::parse(text, &global_tls))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let metrics_listen = match &self.metrics_listen {
            None => None,
            Some(addr) => Some(addr.parse().with_context(|| {
                format!("invalid metrics listen address {addr:?}: expected IP:PORT, e.g. 127.0.0.1:9090")
            })?),
        };
        let fsync = match self.fsync.as_deref() {
            None => Fsync::Always,
            Some(text) => text.parse().map_err(anyhow::Error::msg)?,
        };
        let max_packet_size = self.max_packet_size.unwrap_or(broker.max_packet_size);
        if max_packet_size < 64 {
            bail!("max_packet_size {max_packet_size} is too small: at least 64 bytes");
        }
        if self.receive_maximum == Some(0) {
            bail!("receive_maximum must be at least 1 (MQTT 5 §3.2.2.3.3)");
        }
        for (name, secs) in [
            ("connect_timeout", self.connect_timeout),
            ("slow_consumer_timeout", self.slow_consumer_timeout),
        ] {
            if secs == Some(0) {
                bail!("{name} must be at least 1 second");
            }
        }
        if self.max_topic_levels == Some(0) || self.max_topic_length == Some(0) {
            bail!("max_topic_length and max_topic_levels must be at least 1");
        }
        if self.server_keep_alive == Some(0) {
            bail!(
                "server_keep_alive must be at least 1 second; leave it unset to let clients choose"
            );
        }
        Ok(Resolved {
            clock_offset_ms: self.test_clock_offset_ms.unwrap_or(0),
            listen,
            metrics_listen,
            data_dir: self
                .data_dir
                .unwrap_or_else(|| PathBuf::from(defaults::DATA_DIR)),
            fsync,
            persistence: self.persistence.unwrap_or(Persistence::All),
            log_format: self.log_format.unwrap_or(LogFormat::Text),
            log: self.log.unwrap_or_else(|| defaults::LOG.to_owned()),
            max_packet_size,
            receive_maximum: self.receive_maximum,
            max_queued_messages: self.max_queued_messages,
            max_queued_bytes: self.max_queued_bytes,
            session_expiry_max: self.session_expiry_max,
            max_keys: self.max_keys,
            max_bytes: self.max_bytes,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes.unwrap_or(u64::from(max_packet_size)),
            snapshot_threshold_bytes: self
                .snapshot_threshold_bytes
                .unwrap_or(service.snapshot_threshold_bytes),
            password_file: self.password_file,
            jwt_public_key: self.jwt_public_key,
            jwt_audience: self.jwt_audience,
            allow_anonymous: self.allow_anonymous,
            acl_file: self.acl_file,
            auth_failure_limit: self.auth_failure_limit.unwrap_or(broker.auth_failure_burst),
            auth_failure_refill: self
                .auth_failure_refill
                .map_or(broker.auth_failure_refill, Duration::from_secs),
            max_connections: self.max_connections,
            max_connections_per_address: self.max_connections_per_address,
            connect_timeout: self.connect_timeout.map(Duration::from_secs),
            max_subscriptions_per_session: self.max_subscriptions_per_session,
            max_topic_length: self.max_topic_length,
            max_topic_levels: self.max_topic_levels,
            slow_consumer_timeout: self.slow_consumer_timeout.map(Duration::from_secs),
            server_keep_alive: self.server_keep_alive,
            statestore_requests_per_second: self
                .statestore_requests_per_second
                .unwrap_or(service.requests_per_second),
            runtime_threads: self.runtime_threads.unwrap_or(0),
            notify: notify_config(
                self.notify_node_id,
                [
                    self.notify_reservation_timeout_ms,
                    self.notify_walk_interval_ms,
                    self.notify_lock_expiry_ms,
                    self.notify_retry_min_ms,
                    self.notify_retry_max_ms,
                ],
                self.notify_batch,
                self.notify_linger_ms,
                self.notify_tls_ca_file,
            )?,
            cluster,
        })
    }
}

#[cfg(test)]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let r = Settings::default().resolve().unwrap();
        assert_eq!(r.listen.len(), 1);
        assert_eq!(r.listen[0].to_string(), "tcp://127.0.0.1:1883");
        assert!(r.listen[0].tls.is_none());
        assert_eq!(r.data_dir, PathBuf::from("./data"));
        assert_eq!(r.fsync, Fsync::Always);
        assert_eq!(r.metrics_listen, None);
        assert_eq!(
            r.max_value_bytes,
            u64::from(BrokerConfig::default().max_packet_size)
        );
    }

    #[test]
    fn flags_win_over_file_field_by_field() {
        let file: Settings =
            toml::from_str("listen = [\"127.0.0.1:2000\"]\ndata_dir = \"/f\"\nfsync = \"never\"")
                .unwrap();
        let flags = Settings {
            data_dir: Some("/flag".into()),
            ..Settings::default()
        };
        let r = flags.layer(file).resolve().unwrap();
        assert_eq!(r.data_dir, PathBuf::from("/flag"));
        assert_eq!(r.listen[0].addr, "127.0.0.1:2000".parse().unwrap());
        assert_eq!(r.fsync, Fsync::Never);
    }

    #[test]
    fn json_file_uses_the_same_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mqstate.settings.json");
        std::fs::write(
            &path,
            r#"{"fsync": "interval(5)", "persistence": "opt-in"}"#,
        )
        .unwrap();
        let r = Settings::from_file(&path).unwrap().resolve().unwrap();
        assert_eq!(r.fsync, Fsync::Interval(Duration::from_millis(5)));
        assert_eq!(r.persistence, Persistence::OptIn);
    }

    #[test]
    fn listeners_take_a_scheme_and_tls_listeners_need_a_certificate() {
        let tls = |listen: &[&str]| Settings {
            listen: listen.iter().map(|s| s.to_string()).collect(),
            tls_cert: Some("c.pem".into()),
            tls_key: Some("k.pem".into()),
            ..Settings::default()
        };
        let r = tls(&[
            "127.0.0.1:1",
            "tls://0.0.0.0:2",
            "ws://[::1]:3",
            "WSS://127.0.0.1:4",
        ])
        .resolve()
        .unwrap();
        let kinds: Vec<_> = r.listen.iter().map(|s| s.kind).collect();
        use ListenerKind::*;
        assert_eq!(kinds, [Tcp, Tls, Ws, Wss]);
        assert_eq!(r.listen[1].to_string(), "tls://0.0.0.0:2");
        assert!(r.listen[0].tls.is_none() && r.listen[2].tls.is_none());
        let t = r.listen[3].tls.clone().unwrap();
        assert_eq!(t.cert, PathBuf::from("c.pem"));
        assert_eq!(t.client_auth, TlsClientAuth::Required);
        assert_eq!(t.identity, TlsIdentity::Subject);
        assert!(!t.use_identity_as_client_id);

        let no_cert = Settings {
            listen: vec!["tls://127.0.0.1:8883".into()],
            ..Settings::default()
        };
        let err = format!("{:#}", no_cert.resolve().unwrap_err());
        assert!(
            err.contains("tls://127.0.0.1:8883") && err.contains("--tls-cert"),
            "{err}"
        );
        let bad_scheme = format!("{:#}", tls(&["quic://127.0.0.1:1"]).resolve().unwrap_err());
        assert!(bad_scheme.contains("quic"), "{bad_scheme}");
        let half = Settings {
            tls_cert: Some("c.pem".into()),
            ..Settings::default()
        };
        assert!(format!("{:#}", half.resolve().unwrap_err()).contains("tls_key"));
    }

    #[test]
    fn each_tls_listener_can_override_the_tls_settings() {
        let r = Settings {
            listen: vec![
                "tls://0.0.0.0:8883".into(),
                "tls://0.0.0.0:8884?client_ca=/ca.pem&identity=san&use_identity_as_client_id=true"
                    .into(),
                "wss://0.0.0.0:8443?cert=/web.pem&key=/web.key&client_auth=optional".into(),
            ],
            tls_cert: Some("/c.pem".into()),
            tls_key: Some("/k.pem".into()),
            ..Settings::default()
        }
        .resolve()
        .unwrap();
        let tls: Vec<TlsSettings> = r.listen.iter().map(|l| l.tls.clone().unwrap()).collect();
        assert_eq!(tls[0].client_ca, None);
        assert!(!tls[0].use_identity_as_client_id);
        assert_eq!(tls[1].client_ca, Some(PathBuf::from("/ca.pem")));
        assert_eq!(tls[1].identity, TlsIdentity::San);
        assert!(tls[1].use_identity_as_client_id);
        assert_eq!(tls[1].cert, PathBuf::from("/c.pem"));
        assert_eq!(tls[2].cert, PathBuf::from("/web.pem"));
        assert_eq!(tls[2].client_auth, TlsClientAuth::Optional);

        // A listener with its own pair needs no global one.
        let own = Settings {
            listen: vec!["tls://127.0.0.1:1?cert=c&key=k".into()],
            ..Settings::default()
        };
        assert!(own.resolve().is_ok());
        let err = |listen: &str| {
            let settings = Settings {
                listen: vec![listen.into()],
                tls_cert: Some("c".into()),
                tls_key: Some("k".into()),
                ..Settings::default()
            };
            format!("{:#}", settings.resolve().unwrap_err())
        };
        assert!(err("tcp://127.0.0.1:1?identity=san").contains("tls:// and wss:// only"));
        assert!(err("tls://127.0.0.1:1?colour=blue").contains("colour"));
        assert!(err("tls://127.0.0.1:1?identity=email").contains("subject or san"));
    }

    #[test]
    fn tls_options_come_from_the_file_too() {
        let file: Settings = toml::from_str(
            "listen = [\"wss://127.0.0.1:9001\"]\ntls_cert = \"c\"\ntls_key = \"k\"\n\
             tls_client_ca = \"ca\"\ntls_client_auth = \"optional\"\ntls_identity = \"san\"\n\
             use_identity_as_client_id = true",
        )
        .unwrap();
        let r = Settings::default().layer(file).resolve().unwrap();
        let t = r.listen[0].tls.clone().unwrap();
        assert_eq!(t.client_ca, Some(PathBuf::from("ca")));
        assert_eq!(t.client_auth, TlsClientAuth::Optional);
        assert_eq!(t.identity, TlsIdentity::San);
        assert!(t.use_identity_as_client_id);
    }

    /// The robustness suite starts a node with its clock behind: a negative flag value parses,
    /// and no setting means no offset.
    #[test]
    fn a_test_clock_offset_may_be_negative_and_defaults_to_none() {
        use clap::Parser;
        let cli =
            crate::Cli::try_parse_from(["mqstate", "serve", "--test-clock-offset-ms", "-1500"])
                .expect("a negative offset parses");
        let crate::Command::Serve(args) = cli.command else {
            panic!("serve parses as serve");
        };
        assert_eq!(args.settings.resolve().unwrap().clock_offset_ms, -1500);
        assert_eq!(Settings::default().resolve().unwrap().clock_offset_ms, 0);
    }

    #[test]
    fn unknown_file_keys_and_bad_values_are_errors_that_name_the_problem() {
        assert!(toml::from_str::<Settings>("lisen = []").is_err());
        let err = Settings {
            listen: vec!["nonsense".into()],
            ..Settings::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("nonsense"));
        let err = Settings {
            metrics_listen: Some("localhost".into()),
            ..Settings::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("invalid metrics listen address \"localhost\""));
        assert!("interval(x)"
            .parse::<Fsync>()
            .unwrap_err()
            .contains("milliseconds"));
        assert!("interval(0)".parse::<Fsync>().is_err());
        let err = Settings {
            slow_consumer_timeout: Some(0),
            ..Settings::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("slow_consumer_timeout"));
    }

    #[test]
    fn without_cluster_settings_the_server_is_a_single_node() {
        assert!(Settings::default().resolve().unwrap().cluster.is_none());
    }

    #[test]
    fn cluster_settings_resolve_and_bad_ones_name_the_problem() {
        let flags = Settings {
            node_id: Some(2),
            cluster_listen: Some("127.0.0.1:7002".into()),
            peers: vec![
                "1=127.0.0.1:7001".into(),
                "2=node2.example:7002".into(),
                "3=127.0.0.1:7003".into(),
            ],
            // node2.example is beyond loopback: plain TCP must be asked for.
            cluster_plaintext: Some(true),
            ..Settings::default()
        };
        let file: Settings =
            toml::from_str("cluster_lease = 5\nreplication_factor = 2\ncluster_partitions = 16")
                .unwrap();
        let c = flags
            .clone()
            .layer(file)
            .resolve()
            .unwrap()
            .cluster
            .unwrap();
        assert_eq!(c.node_id, 2);
        assert_eq!(c.advertise, "node2.example:7002");
        assert_eq!(c.peers.len(), 3);
        assert_eq!(c.lease, Duration::from_secs(5));
        assert_eq!(c.clock_factor, Duration::from_secs(1));
        assert_eq!((c.partitions, c.replication_factor), (16, 2));
        assert!(!c.join);
        let err = |s: Settings| format!("{:#}", s.resolve().unwrap_err());
        assert!(err(Settings {
            node_id: None,
            ..flags.clone()
        })
        .contains("--node-id"));
        assert!(err(Settings {
            node_id: Some(4),
            ..flags.clone()
        })
        .contains("does not list this node"));
        assert!(err(Settings {
            peers: vec!["x=1:2".into()],
            ..flags.clone()
        })
        .contains("positive number"));
        assert!(err(Settings {
            peers: vec!["1:7001".into()],
            ..flags.clone()
        })
        .contains("ID=HOST:PORT"));
        assert!(err(Settings {
            cluster_lease: Some(0),
            ..flags.clone()
        })
        .contains("cluster_lease"));
        assert!(err(Settings {
            peers: vec![],
            ..flags.clone()
        })
        .contains("--join"));
        let joining = Settings {
            peers: vec![],
            join: Some(true),
            ..flags
        }
        .resolve()
        .unwrap()
        .cluster
        .unwrap();
        assert!(joining.join && joining.peers.is_empty());
        assert_eq!(joining.advertise, "127.0.0.1:7002");
    }

    #[test]
    fn the_node_id_comes_from_a_statefulset_pod_name() {
        let pod = |name: &'static str, s: &Settings| {
            ClusterSettings::resolve_with(s, || Ok(name.to_owned())).map(|c| c.unwrap())
        };
        let flags = Settings {
            node_id_from_hostname: Some(true),
            cluster_listen: Some("127.0.0.1:7001".into()),
            peers: vec![
                "1=127.0.0.1:7001".into(),
                "2=127.0.0.1:7002".into(),
                "3=127.0.0.1:7003".into(),
            ],
            ..Settings::default()
        };
        let first = pod("mqstate-0", &flags).unwrap();
        assert_eq!((first.node_id, first.join), (1, false));
        assert_eq!(first.advertise, "127.0.0.1:7001");
        let third = pod("mqstate-2.mqstate-peers.default.svc.cluster.local", &flags).unwrap();
        assert_eq!((third.node_id, third.join), (3, false));
        // A fourth replica of the same template is not a founder: it waits to be added.
        let fourth = pod("mqstate-3", &flags).unwrap();
        assert_eq!((fourth.node_id, fourth.join), (4, true));
        let e = format!("{:#}", pod("mqstate", &flags).unwrap_err());
        assert!(e.contains("\"mqstate\"") && e.contains("-NUMBER"), "{e}");
        let e = format!(
            "{:#}",
            pod(
                "mqstate-0",
                &Settings {
                    node_id: Some(1),
                    ..flags.clone()
                }
            )
            .unwrap_err()
        );
        assert!(e.contains("both set"), "{e}");
        // Not asked for: the host name is not read, and a node without an id is refused as before.
        let e = ClusterSettings::resolve_with(
            &Settings {
                node_id_from_hostname: None,
                ..flags
            },
            || panic!("the host name is read only when asked for"),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("--node-id-from-hostname"));
    }

    #[test]
    fn plain_node_traffic_beyond_loopback_needs_tls_or_saying_so() {
        let local = Settings {
            node_id: Some(1),
            cluster_listen: Some("127.0.0.1:7001".into()),
            peers: vec!["1=127.0.0.1:7001".into(), "2=localhost:7002".into()],
            ..Settings::default()
        };
        let c = local.clone().resolve().unwrap().cluster.unwrap();
        assert_eq!(
            (c.tls, c.plaintext),
            (None, false),
            "loopback needs nothing"
        );
        let err = |s: Settings| format!("{:#}", s.resolve().unwrap_err());
        let wide = Settings {
            cluster_listen: Some("0.0.0.0:7001".into()),
            ..local.clone()
        };
        let e = err(wide.clone());
        assert!(
            e.contains("0.0.0.0")
                && e.contains("cluster_tls_cert")
                && e.contains("cluster_plaintext"),
            "{e}"
        );
        let remote_peer = Settings {
            peers: vec!["1=127.0.0.1:7001".into(), "2=10.0.0.2:7001".into()],
            ..local.clone()
        };
        assert!(err(remote_peer.clone()).contains("10.0.0.2"));
        assert!(
            Settings {
                cluster_plaintext: Some(true),
                ..remote_peer
            }
            .resolve()
            .unwrap()
            .cluster
            .unwrap()
            .plaintext
        );
        let tls = Settings {
            cluster_tls_cert: Some("node.pem".into()),
            cluster_tls_key: Some("node.key".into()),
            cluster_tls_ca: Some("ca.pem".into()),
            ..wide.clone()
        };
        let c = tls.clone().resolve().unwrap().cluster.unwrap();
        assert_eq!(
            c.tls,
            Some(ClusterTlsFiles {
                cert: "node.pem".into(),
                key: "node.key".into(),
                ca: "ca.pem".into()
            })
        );
        assert!(err(Settings {
            cluster_tls_ca: None,
            ..tls
        })
        .contains("all three"));
    }

    #[test]
    fn limits_come_from_the_file_too() {
        let file: Settings = toml::from_str(
            "max_connections = 5\nconnect_timeout = 3\nstatestore_requests_per_second = 100",
        )
        .unwrap();
        let r = Settings::default().layer(file).resolve().unwrap();
        assert_eq!(r.max_connections, Some(5));
        assert_eq!(r.connect_timeout, Some(Duration::from_secs(3)));
        assert_eq!(r.statestore_requests_per_second, 100);
    }

    #[test]
    fn runtime_threads_as_given_or_one_per_core() {
        let file: Settings = toml::from_str("runtime_threads = 3").unwrap();
        let given = Settings::default().layer(file).resolve().unwrap();
        assert_eq!(given.worker_threads(), 3);
        let auto = Settings::default().resolve().unwrap();
        assert_eq!(auto.runtime_threads, 0);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(auto.worker_threads(), cores);
    }
}
