//! The port through which a cluster node executes key commands elsewhere (issue 15): the state
//! store replicated on chains. With a [`Router`] in the service's configuration, GET, SET, DEL and
//! VDEL are checked here (envelope, duplicates, rate, key access, syntax) and then handed to the
//! router, which runs them at the head of the key's partition; the reply is released through the
//! completer like any other. The single-node path is untouched when there is no router.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::Hlc;

/// A key command that passed this node's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedRequest {
    pub client_id: Arc<str>,
    pub correlation: Bytes,
    /// The key the command names.
    pub key: Bytes,
    /// The RESP request as the client sent it.
    pub payload: Bytes,
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

/// Executes key commands where their data lives.
pub trait KeyRouter: Send + Sync + 'static {
    fn execute(&self, request: RoutedRequest) -> RouterFuture<'_>;
}

/// A shared router, as the configuration holds it.
#[derive(Clone)]
pub struct Router(pub Arc<dyn KeyRouter>);

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Router")
    }
}
