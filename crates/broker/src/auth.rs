//! Authentication and authorization ports: the broker asks, the binary's configured policy answers.
//!
//! The broker knows no password files, tokens or ACL formats. It hands every CONNECT to an
//! [`Authenticator`] (off the async runtime: verifying a password hash is deliberately slow) and asks an
//! [`Authorizer`] before it routes a PUBLISH, accepts a will or adds a subscription. The defaults,
//! [`AllowAll`], keep a broker without configuration open, as it has always been.
//!
//! Refusals carry no detail to the client (CONNACK 0x86 / 0x87 / 0x8C without a reason string); the
//! policy logs what went wrong. Failed authentications are counted per source address
//! ([`crate::BrokerConfig::auth_failure_burst`]): past the limit, CONNECTs from that address are refused
//! with 0x87 without asking the authenticator.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;

/// CONNACK reason codes an [`Authenticator`] may refuse with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 0x86 Bad User Name or Password.
    BadCredentials,
    /// 0x87 Not authorized (no credentials where some are required, a bad token, a rate-limited address).
    NotAuthorized,
    /// 0x8C Bad authentication method (an enhanced authentication method we do not support).
    BadAuthenticationMethod,
}

impl Refusal {
    pub fn reason_code(self) -> u8 {
        match self {
            Refusal::BadCredentials => 0x86,
            Refusal::NotAuthorized => 0x87,
            Refusal::BadAuthenticationMethod => 0x8C,
        }
    }
}

/// What a CONNECT claims about who is connecting.
#[derive(Debug, Clone)]
pub struct ConnectAttempt {
    /// The client id the connection will have (the assigned one if the client sent none).
    pub client_id: Arc<str>,
    pub username: Option<Arc<str>>,
    pub password: Option<Bytes>,
    /// MQTT 5 Authentication Method (enhanced authentication) and its data.
    pub auth_method: Option<Arc<str>>,
    pub auth_data: Option<Bytes>,
    pub peer: SocketAddr,
    /// The verified client certificate's identity (subject or SAN), when the listener does mTLS.
    pub cert_identity: Option<Arc<str>>,
}

/// Who a connection is once authenticated; authorization decisions and services see this.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The authenticated user name (password file, token subject, or certificate identity), if any.
    pub user: Option<Arc<str>>,
    /// The verified client certificate's identity, if any.
    pub cert: Option<Arc<str>>,
}

/// A connected client as authorization sees it.
#[derive(Debug, Clone, Copy)]
pub struct Principal<'a> {
    pub client_id: &'a str,
    pub identity: &'a Identity,
}

/// Decides whether a CONNECT may proceed. Called once per CONNECT: on a blocking thread unless
/// [`Authenticator::blocks`] says it answers at once.
pub trait Authenticator: Send + Sync + 'static {
    fn authenticate(&self, attempt: &ConnectAttempt) -> Result<Identity, Refusal>;

    /// Whether [`Authenticator::authenticate`] may take long (hash a password, verify a token):
    /// then it runs on a blocking thread. One that answers at once runs on the connection's task,
    /// which spares every CONNECT a hand-off to another thread and keeps a simulated run, where
    /// another thread's work ends at a real-time moment, deterministic (decision 0067).
    fn blocks(&self) -> bool {
        true
    }
}

/// Decides what a connected client may do with topics. Called on the connection's task for every
/// PUBLISH and subscription, so it must be cheap and must not block.
pub trait Authorizer: Send + Sync + 'static {
    /// PUBLISH (and the will, checked at CONNECT) on `topic`.
    fn may_publish(&self, who: Principal<'_>, topic: &str) -> bool;
    /// SUBSCRIBE to `filter` (without any `$share/<group>/` prefix).
    fn may_subscribe(&self, who: Principal<'_>, filter: &str) -> bool;
}

/// Every client is welcome and may do everything: the broker without configuration. It supports no
/// enhanced authentication, so a CONNECT naming an Authentication Method is refused with 0x8C
/// (MQTT-4.12.0-1): accepting it would tell the client that a method it relies on was carried out.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Authenticator for AllowAll {
    fn authenticate(&self, attempt: &ConnectAttempt) -> Result<Identity, Refusal> {
        match attempt.auth_method {
            Some(_) => Err(Refusal::BadAuthenticationMethod),
            None => Ok(Identity::default()),
        }
    }

    fn blocks(&self) -> bool {
        false
    }
}

impl Authorizer for AllowAll {
    fn may_publish(&self, _: Principal<'_>, _: &str) -> bool {
        true
    }

    fn may_subscribe(&self, _: Principal<'_>, _: &str) -> bool {
        true
    }
}

/// The policy a broker enforces.
#[derive(Clone)]
pub struct Security {
    pub authenticator: Arc<dyn Authenticator>,
    pub authorizer: Arc<dyn Authorizer>,
}

impl Default for Security {
    fn default() -> Self {
        Security {
            authenticator: Arc::new(AllowAll),
            authorizer: Arc::new(AllowAll),
        }
    }
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security").finish_non_exhaustive()
    }
}
