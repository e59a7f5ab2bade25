//! The durability port of the broker: what it tells a [`SessionJournal`] about persistent sessions,
//! retained messages and delayed wills, and how a journal's contents are read back ([`Restored`]).
//!
//! The broker knows nothing of where changes go; the binary installs a journal over a write-ahead
//! log (`BrokerBuilder::journal`). Without one (the default) nothing is recorded.
//!
//! What is journalled: sessions with a Session Expiry Interval above 0 (clean, expiry-0 sessions
//! cost nothing), their subscriptions, their QoS 1/2 messages (queued and in flight, with the packet
//! id and phase), the packet ids of their inbound QoS 2 publishes awaiting PUBREL, their pending
//! delayed will, and every retained message. QoS 0 messages are not. A journal that keeps clean
//! wills (a cluster node's, [`SessionJournal::keeps_clean_wills`]) also gets the will of a clean
//! session's client while it is connected.
//!
//! Ordering contract: every change about one session is recorded while that session's lock is held,
//! so the journal sees a session's changes in the order they were made. Each change is an
//! assignment (set or remove one thing), so replaying a suffix of the journal over an image that
//! already contains part of it gives the same state — this is what lets a snapshot be taken while
//! changes go on (see `docs/decisions/0004-durable-sessions.md`).
//!
//! Times are wall-clock milliseconds since the Unix epoch: `Instant`s do not survive a restart.

mod codec;
mod replay;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytestring::ByteString;

use crate::message::{Message, QoS};
use crate::peers::PublishId;
use crate::session::SubscriptionOptions;
use crate::will::Will;

pub use codec::{decode_changes, encode_changes, DecodeError, FORMAT_VERSION};
pub use replay::{Restored, StoredEntry, StoredSession, TakenId};

/// Resolves once the recorded changes are durable (fsynced), or with the reason they never will be.
pub type Durable = Pin<Box<dyn Future<Output = Result<(), JournalError>> + Send>>;

/// A change could not be made durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session change not durable: {0}")]
pub struct JournalError(pub String);

/// Where the broker records durable changes (implemented by the binary over a write-ahead log).
pub trait SessionJournal: Send + Sync {
    /// Records `changes` as one unit, after everything recorded before this call. Must not block:
    /// it is called with a session lock held. The broker awaits the result only where MQTT
    /// acknowledges something (PUBACK/PUBREC/PUBCOMP, SUBACK, UNSUBACK, CONNACK); other changes
    /// are recorded and not waited for.
    fn record(&self, changes: Vec<SessionChange>) -> Durable;

    /// Whether a clean session (expiry 0) whose client set a will is recorded too, as `Created`
    /// and `WillSet` at CONNECT and `Deleted` when it ends: a cluster node's journal, so that the
    /// will outlives the node (decision 0063). Nothing else of such a session is recorded.
    fn keeps_clean_wills(&self) -> bool {
        false
    }
}

/// What a [`SessionSource`] found.
pub type Locating = Pin<Box<dyn Future<Output = Result<Located, Unlocated>> + Send>>;

/// Where a session is cannot be told now: its replicas are unreachable, or this node may not
/// take sessions (its lease lapsed). The CONNECT is refused, retryable; the text says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unlocated(pub String);

/// Where a client's session is, as a [`SessionSource`] answers on CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Located {
    /// This broker's copy (if it holds one) is the session: attach as usual.
    Here,
    /// Taken from elsewhere (now owned here): it replaces any copy this broker holds, and the
    /// client resumes it with Session Present.
    Taken(Box<StoredSession>),
    /// No session exists anywhere: a copy this broker holds is stale; drop it.
    Gone,
}

/// The identity of one copy of a session this broker holds: a new one whenever a copy comes into
/// being here (created by a CONNECT, restored from the journal, adopted, taken in from another
/// node); a resumed session keeps its copy's. Whoever decides that a copy is obsolete names it
/// ([`crate::Broker::forget_session`]), so that a drop meant for one copy never drops a newer one
/// of the same client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyId(pub u64);

/// Where a cluster node finds the persistent sessions other nodes held (decision
/// 0047). Asked on every CONNECT before the client attaches; the CONNACK waits for the
/// answer, and an error refuses the CONNECT with 0x88 Server unavailable (retry), never with a
/// fresh session in place of one that exists.
pub trait SessionSource: Send + Sync {
    /// Where `client_id`'s session is. `clean_start`: the client discards any session (the
    /// source drops it everywhere); `persistent`: the new connection's session is kept by the
    /// journal (its expiry is above 0, or its client set a will the journal keeps);
    /// `held_here`: this broker holds a copy. `copy`: the identity of the copy this CONNECT puts
    /// here if the answer is not `Here` (the session taken in, or a new one); with `Here`, a
    /// copy held here keeps its own.
    fn locate(
        &self,
        client_id: &str,
        clean_start: bool,
        persistent: bool,
        held_here: bool,
        copy: CopyId,
    ) -> Locating;

    /// Resolves once what this broker recorded of `client_id`'s session has landed where the
    /// sessions live, or another node took the session over first: `true` if it landed (an
    /// expiry's `Deleted`, a due will's `WillCancelled`), so what this node took out of the
    /// session (the will of its end, a due will) is this node's to publish; `false` if another
    /// node took the session over (it lives on there and its will is not due here). Waits
    /// through failures to write: the will of an expired session is published once its end is
    /// durable, never before a node that reads its row could still find the session (decision
    /// 0070). Also awaited once a copy taken over by another node was dropped
    /// (`Broker::take_over_here`): the claiming node then reads what this broker recorded of the
    /// session.
    fn landed(&self, client_id: &str) -> Landing;
}

/// What [`SessionSource::landed`] found.
pub type Landing = Pin<Box<dyn Future<Output = bool> + Send>>;

/// A message in a session queue, with its per-subscriber QoS, retain flag and subscription ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub message: Arc<Message>,
    pub qos: QoS,
    pub retain: bool,
    pub subscription_ids: Vec<u32>,
    /// When the broker received it (wall clock, ms); its Message Expiry Interval counts from here.
    pub received_at_ms: u64,
}

/// One durable change. Session messages are identified by a per-session sequence number (`seq`),
/// the seed's queue deltas: `Created`/`Deleted` are its C/D, `Appended`/`Removed` its A/R.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionChange {
    /// A new, empty, connected session (replaces any earlier one of the client).
    Created {
        client_id: Arc<str>,
        expiry_secs: u32,
    },
    /// The client reconnected to its session: connected again, delayed will cancelled.
    Attached {
        client_id: Arc<str>,
        expiry_secs: u32,
    },
    /// The connection ended at `at_ms`; the session expires `expiry_secs` later.
    Detached {
        client_id: Arc<str>,
        expiry_secs: u32,
        at_ms: u64,
    },
    Subscribed {
        client_id: Arc<str>,
        filter: ByteString,
        options: SubscriptionOptions,
    },
    Unsubscribed {
        client_id: Arc<str>,
        filter: ByteString,
    },
    /// A QoS 1/2 message entered the session queue.
    Appended {
        client_id: Arc<str>,
        seq: u64,
        message: StoredMessage,
    },
    /// The message was sent with `packet_id` and waits for PUBACK/PUBREC.
    Sent {
        client_id: Arc<str>,
        seq: u64,
        packet_id: u16,
    },
    /// PUBREC came for the (QoS 2) message: PUBREL was sent, PUBCOMP is awaited.
    Released { client_id: Arc<str>, seq: u64 },
    /// The message left the session: acknowledged, expired or dropped.
    Removed { client_id: Arc<str>, seq: u64 },
    /// The session ended (expired, discarded by Clean Start, or no longer persistent).
    Deleted { client_id: Arc<str> },
    /// The client's QoS 2 PUBLISH with `packet_id` was received and routed: a retry of it must
    /// not be routed again until PUBREL releases the id.
    Qos2Received { client_id: Arc<str>, packet_id: u16 },
    /// PUBREL released the inbound QoS 2 `packet_id` (or its PUBREC failed): the client may reuse it.
    Qos2Released { client_id: Arc<str>, packet_id: u16 },
    /// A delayed will is due at `at_ms` unless the client reconnects first.
    WillScheduled {
        client_id: Arc<str>,
        will: Will,
        at_ms: u64,
    },
    /// The delayed will was published.
    WillCancelled { client_id: Arc<str> },
    /// The session took in the forwarded QoS 2 publish numbered `id` at `at_ms` (a cluster node,
    /// decision 0066): a redelivery of it skips the session. Forgotten `keep_ms` later.
    Took {
        client_id: Arc<str>,
        id: PublishId,
        at_ms: u64,
        keep_ms: u64,
    },
    /// The will of the connected client (its CONNECT's): if the session is put back without its
    /// connection (the node died), the will is scheduled then, after its delay (decision 0054).
    /// A later `Attached` or `Detached` ends it.
    WillSet { client_id: Arc<str>, will: Will },
    /// A retained message was set on its topic.
    RetainedSet {
        message: Arc<Message>,
        received_at_ms: u64,
    },
    /// The retained message of `topic` was cleared, at `at_ms` where a cluster node remembers
    /// the clear (decision 0063: the clear is a tombstone that outlives a restart, so that a node
    /// that was away and still holds the old message does not bring it back).
    RetainedCleared {
        topic: ByteString,
        at_ms: Option<u64>,
    },
}

/// Conversions between the wall-clock ms the journal stores and the `Instant`s the broker computes
/// with, given one reading of both clocks (`now`, `now_ms`).
pub(crate) mod wall {
    use std::time::{Duration, Instant};

    /// The wall-clock time of `at`, given that `now` is `now_ms`.
    pub(crate) fn to_ms(at: Instant, now: Instant, now_ms: u64) -> u64 {
        let back = now.saturating_duration_since(at).as_millis();
        now_ms.saturating_sub(u64::try_from(back).unwrap_or(u64::MAX))
    }

    /// The `Instant` of wall-clock `ms`, given that `now` is `now_ms`. Times before the monotonic
    /// clock's origin become `now` (a message then expires a little later, never earlier).
    pub(crate) fn to_instant(ms: u64, now: Instant, now_ms: u64) -> Instant {
        if ms <= now_ms {
            now.checked_sub(Duration::from_millis(now_ms - ms))
                .unwrap_or(now)
        } else {
            now + Duration::from_millis(ms - now_ms)
        }
    }
}
