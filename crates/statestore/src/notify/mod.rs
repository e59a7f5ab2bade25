//! Persistent notifications, the service side: settings, the requests the queue owner sends the
//! executor ([`Internal`]), the admin RPC ([`admin`]) and the queue owner itself ([`owner`]).
//!
//! The queues are state-machine state (`mqstate_store::notify`): a write and its notifications are
//! one log record. The executor reserves before it executes and commits or releases after
//! (`service/notify_exec.rs`); the owner task takes each queue's lock key with `SET … NEX PX`,
//! lists entries, pushes them to the endpoint (`mqstate_notify`) and removes what was acknowledged
//! with a request the lock key fences. See `docs/notifications.md` and decision `0019-notify-queues`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::Hlc;
use mqstate_store::notify::{QueueEntry, RemoveError, TopicDef};
use tokio::sync::oneshot;

pub mod admin;
pub mod owner;

pub use mqstate_notify::tls::client_config as tls_client_config;

/// The topic the admin RPC is claimed on (JSON requests; MQTT 5 request/response).
pub use mqstate_protocol::topic::NOTIFY_ADMIN_TOPIC as ADMIN_TOPIC;

/// Settings of persistent notifications.
#[derive(Debug, Clone)]
pub struct NotifyConfig {
    /// Names this node in lock keys; unique per node of a cluster.
    pub node_id: String,
    /// A reservation not committed or aborted by then is stale and aborted (only a log written
    /// before decision 0038, which logged reservations on their own, can leave one behind).
    pub reservation_timeout: Duration,
    /// How often every queue's lock is taken or renewed.
    pub walk_interval: Duration,
    /// The lock's `PX`: another node takes a queue over after this long without renewal.
    pub lock_expiry: Duration,
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Entries listed and pushed at a time.
    pub batch_max: usize,
    /// After pushing a batch that was not full, how long the owner lets the queue fill before it
    /// lists the next one: under a steady stream of changes, fewer and fuller pushes (each costs
    /// an HTTP request or a PUBACK round trip on both sides) for at most this much more latency.
    /// Zero pushes whatever is queued at once.
    pub linger: Duration,
    /// How long an endpoint may take to acknowledge a push.
    pub push_timeout: Duration,
    /// CA certificates (PEM) that `https`/`mqtts` endpoints are verified against; `None`: the
    /// system's.
    pub tls_ca_file: Option<PathBuf>,
}

impl Default for NotifyConfig {
    fn default() -> Self {
        NotifyConfig {
            node_id: "mqstate".into(),
            reservation_timeout: Duration::from_secs(30),
            walk_interval: Duration::from_secs(30),
            lock_expiry: Duration::from_secs(90),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
            batch_max: 100,
            linger: Duration::from_millis(5),
            push_timeout: Duration::from_secs(10),
            tls_ca_file: None,
        }
    }
}

/// What the lock key of a queue says after a lock attempt.
#[derive(Debug, Clone)]
pub struct LockState {
    /// The holder now (`<node id>/<cookie>`), if any.
    pub holder: Option<Bytes>,
    /// Set when the caller holds the lock: the version of its SET, the fencing token of removals.
    pub token: Option<Hlc>,
    pub expires_at_ms: Option<u64>,
}

/// Requests of the queue owner to the executor; each is answered once its effect is durable.
pub(crate) enum Internal {
    Topics {
        reply: oneshot::Sender<Vec<TopicDef>>,
    },
    /// Renew `current` if it holds the lock; otherwise take a free (or this node's previous
    /// incarnation's) lock as `fresh`.
    Lock {
        topic: String,
        current: Option<Bytes>,
        fresh: Bytes,
        reply: oneshot::Sender<LockState>,
    },
    /// The first `max` entries; `None` if the topic is gone.
    List {
        topic: String,
        max: usize,
        reply: oneshot::Sender<Option<Vec<QueueEntry>>>,
    },
    Remove {
        topic: String,
        up_to_seq: u64,
        holder: Bytes,
        token: Hlc,
        reply: oneshot::Sender<Result<(), RemoveError>>,
    },
}

/// Delivery figures of one topic on this node (the queue itself is in the state machine).
#[derive(Debug, Clone, Default)]
pub struct Delivery {
    pub delivered: u64,
    /// Records pushed again after a failed push.
    pub retried: u64,
    pub failed_pushes: u64,
    /// Removals refused because this node no longer held the lock.
    pub fenced: u64,
    pub last_error: Option<String>,
}

/// Delivery figures by topic, written by the owner, read by `topic stats`.
#[derive(Debug, Default)]
pub struct DeliveryStats(Mutex<HashMap<String, Delivery>>);

impl DeliveryStats {
    pub fn update(&self, topic: &str, f: impl FnOnce(&mut Delivery)) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(map.entry(topic.to_owned()).or_default());
    }

    pub fn get(&self, topic: &str) -> Delivery {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(topic).cloned().unwrap_or_default()
    }

    pub fn forget(&self, topic: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(topic);
    }
}
