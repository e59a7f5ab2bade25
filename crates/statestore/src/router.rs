//! The port through which a cluster node executes key commands elsewhere (issue 15): the state
//! store replicated on chains. With a [`Router`] in the service's configuration, GET, SET, DEL and
//! VDEL are checked here (envelope, duplicates, rate, key access, syntax) and then handed to the
//! router, which runs them at the head of the key's partition; the reply is released through the
//! completer like any other. The single-node path is untouched when there is no router.
//!
//! KEYNOTIFY registrations stay on the node the observer is connected to (session state); the
//! router is told which keys are observed here ([`KeyRouter::watch`]) and hands back the changes
//! of those keys committed at any partition's head ([`ClusterChanges`]), which the service turns
//! into notifications for its observers. SCAN pages are assembled over every partition
//! ([`KeyRouter::scan`]).
//!
//! The registrations of a client with a persistent session are kept with its session (decision
//! 0050): a KEYNOTIFY's reply waits until its client's whole set is kept
//! ([`KeyRouter::keep_observed`]; nothing to keep for a clean session), and a node that takes a
//! session over hands its registrations back ([`RestoredObservers`]). On a cluster node, a
//! client's registrations therefore end with its session, not with its connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::{Command, Hlc};
use mqstate_store::{Delta, RequestId};
use tokio::sync::{mpsc, oneshot};

/// A key command that passed this node's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedRequest {
    pub client_id: Arc<str>,
    /// The envelope's request id (client id and correlation data hashed once, here).
    pub id: RequestId,
    pub correlation: Bytes,
    /// The key the command names.
    pub key: Bytes,
    /// The RESP request as the client sent it, and as this node parsed it.
    pub payload: Bytes,
    pub command: Command,
    pub ts: Option<Hlc>,
    pub fencing_token: Option<Hlc>,
    /// What remains of the request's message expiry.
    pub expiry: Duration,
}

/// The RESP reply and its `__ts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedReply {
    pub payload: Bytes,
    pub ts: Option<Hlc>,
}

pub type RouterFuture<'a> = Pin<Box<dyn Future<Output = RoutedReply> + Send + 'a>>;

/// A SCAN page that passed this node's checks (the pattern is a valid glob within the limits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanRequest {
    pub pattern: Bytes,
    pub continuation: Option<Bytes>,
    /// What remains of the request's message expiry.
    pub expiry: Duration,
}

/// A SCAN page over every partition (keys in order, the continuation) or why there is none.
pub type ScanFuture<'a> =
    Pin<Box<dyn Future<Output = Result<(Vec<Bytes>, Option<Bytes>), String>> + Send + 'a>>;

/// Changes committed at a partition's head for keys observed here (a `Put` or a `Delete` with the
/// new version), in commit order per key; `done` is signalled once their notifications are queued.
#[derive(Debug)]
pub struct ClusterChange {
    pub changes: Vec<Delta>,
    pub done: oneshot::Sender<()>,
    /// For one client alone: the changes of one key it missed while its session moved here, which
    /// end its catch-up of the key ([`KeyRouter::catch_up`], decision 0065).
    pub catch_up: Option<(Arc<str>, Bytes)>,
}

/// Where a cluster node's service takes [`ClusterChange`]s from.
pub type ClusterChanges = mpsc::UnboundedReceiver<ClusterChange>;

/// The registrations of a session this node took over: `client_id` observes `keys` here from
/// now on; `done` is signalled once they are registered and the other nodes know. Each key comes
/// with its cursor: the version of the last change of it queued into the session (`""`: every
/// change is owed; `None`: not known), after which the client is owed the changes (decision 0065).
#[derive(Debug)]
pub struct RestoredObserver {
    pub client_id: Arc<str>,
    pub keys: Vec<(Bytes, Option<String>)>,
    pub done: oneshot::Sender<()>,
}

/// Where a cluster node's service takes [`RestoredObserver`]s from.
pub type RestoredObservers = mpsc::UnboundedReceiver<RestoredObserver>;

pub type KeepFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// Executes key commands where their data lives.
pub trait KeyRouter: Send + Sync + 'static {
    fn execute(&self, request: RoutedRequest) -> RouterFuture<'_>;

    /// One SCAN page over every partition.
    fn scan(&self, request: ScanRequest) -> ScanFuture<'_>;

    /// `key` is observed by some client here now (`true`) or by none any more (`false`); resolves
    /// once every node that may execute its writes knows (bounded).
    fn watch(&self, key: Bytes, observed: bool) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;

    /// The changes for this node's observers; the service takes it once, at start.
    fn take_changes(&self) -> Option<ClusterChanges>;

    /// `client_id` observes `keys` now (its whole set, in key order): kept with its session if
    /// it has a persistent one; resolves once that is durable.
    fn keep_observed(&self, client_id: &str, keys: Vec<Bytes>) -> KeepFuture<'_>;

    /// The registrations of sessions taken over here; the service takes it once, at start.
    fn take_restored(&self) -> Option<RestoredObservers>;

    /// Hands `client_id` (whose session was taken over here) the changes of `key` after `after`,
    /// its cursor, as a [`ClusterChange`] for it alone, ordered with the changes handed to every
    /// observer here; resolves once it is handed (bounded).
    fn catch_up(
        &self,
        client_id: Arc<str>,
        key: Bytes,
        after: Option<String>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// A shared router, as the configuration holds it.
#[derive(Clone)]
pub struct Router(pub Arc<dyn KeyRouter>);

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Router")
    }
}
