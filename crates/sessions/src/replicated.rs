//! Persistent sessions on the chains of a cluster node (decision 0047).
//!
//! [`ReplicatedSessions`] is both the broker's journal and its `SessionSource`:
//!
//! * `record` applies a session's changes to a mirror of the sessions this node owns (the same
//!   `Restored` model recovery uses) and has the session's row written through its chain — one
//!   row per session, keyed by client id, holding the session's whole image ([`crate::row`]).
//!   While a write of a session is under way, its further changes accumulate and go in the next
//!   write (per-session group commit). A change counts as durable once a row write that
//!   includes it was answered `Written`: every replica of the write view fsynced it. Retained
//!   messages stay in the node's own session log.
//! * `locate` (every CONNECT) reads the client's row at its partition's head. A row another node
//!   owns, or this node under an older epoch, is taken over: written back with this node as
//!   owner and the epoch raised (compare-and-set on the version read), then handed to the broker
//!   to adopt. A clean start deletes the row.
//! * Every write is a compare-and-set on the version this node last wrote or read: a node that
//!   lost the session (another took it over) finds its write refused, stops writing the session
//!   and drops the broker's copy that was its claim's (`Broker::forget_session`, naming the copy:
//!   a copy put in since for a newer claim here stays).
//! * A session's row also carries the state-store keys its client observes (KEYNOTIFY; decision
//!   0050): the state store hands them over with [`ReplicatedSessions::keep_observed`], they are
//!   written like any change of the session, and a node that takes the session over hands them
//!   to its state store ([`Observers`]) before the client gets its CONNACK.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use mqstate_broker::{
    Broker, CopyId, Durable, JournalError, Landing, Located, Locating, Message, Restored,
    SessionChange, SessionJournal, SessionSource, StoredSession, Unlocated,
};
pub use mqstate_chain::Version;
use tokio::sync::watch;

use crate::row::{self, SessionRow};

/// How long a row read or write may wait for its partition to have a head.
pub const ROW_BUDGET: Duration = Duration::from_secs(10);
/// A failed row write (partition unavailable) is tried again this often.
const REWRITE_EVERY: Duration = Duration::from_millis(500);

pub type RowFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;

/// Where a node that took a session over puts back its client's KEYNOTIFY registrations (the
/// binary connects it to the state store).
pub trait Observers: Send + Sync {
    /// `client_id` observes `keys` here from now on, each with its cursor (the version of the last
    /// change of it queued into the session, `""`: every change is owed, `None`: not known);
    /// resolves once every node that may execute their writes knows (bounded), so a write after
    /// the CONNACK is notified. The changes after each cursor follow once the session is here
    /// (decision 0065).
    fn restore(
        &self,
        client_id: Arc<str>,
        keys: Vec<(Vec<u8>, Option<String>)>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;

    /// The cursor of a client that starts observing `key` here now: the version of the last
    /// change of it notified on this node (`""`: it has no row), if known.
    fn position(&self, key: &[u8]) -> Option<String>;

    /// The key and version of `message` if it is a state-store notification.
    fn notified(&self, message: &Message) -> Option<(Vec<u8>, String)>;
}

/// A session row as read at its partition's head.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadRow {
    pub value: Option<Vec<u8>>,
    pub version: Option<Version>,
}

/// The session rows of the cluster (the binary implements it over `mqstate-replication`).
pub trait SessionRows: Send + Sync {
    /// The committed row of `client_id` (linearizable).
    fn read<'a>(&'a self, client_id: &'a str) -> RowFuture<'a, ReadRow>;
    /// Writes the row (`None` deletes it) if its version is `base` (`None`: no value). `Ok(Ok)`
    /// with the new version, `Ok(Err)` with the row's version if it was not at `base`.
    fn write<'a>(
        &'a self,
        client_id: &'a str,
        value: Option<Vec<u8>>,
        base: Option<Version>,
    ) -> RowFuture<'a, Result<Version, Option<Version>>>;
    /// The rows this node's replicas hold now: client id, the value's first [`row::HEADER`] bytes
    /// (or all of it), and whether this node acts as the head of the row's partition. A
    /// replica's copy may trail the head's.
    fn here(&self) -> RowFuture<'_, Vec<(String, Vec<u8>, bool)>>;
    /// Whether node `node` is up: a member whose lease is current.
    fn is_up(&self, node: u64) -> bool;
    /// Whether this node holds its own control-plane lease. Once it lapses, the control plane
    /// may count this node down and the heads adopt its sessions (decision 0054).
    fn lease_held(&self) -> bool;
}

/// This node's relation to a client's session row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Taken over (or cleared) by `locate`: the broker's next `Created` makes it owned.
    Claimed,
    /// Owned: changes are applied and written.
    Owned,
    /// Another node took it over: nothing more is written.
    Lost,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Status {
    /// Every change up to this generation is in a written row.
    written: u64,
    /// Changes up to this generation were in a write that failed (unless `written` covers them).
    failed: u64,
    lost: bool,
    /// With `lost`: the entry was replaced by a take-over here (a CONNECT of this node's, e.g. a
    /// clean start, or the session ended by its row) of the row as this entry last wrote it,
    /// which published no will: no other node took the session meanwhile, so what this node took
    /// out of it before (a will that came due, or the will of its end) is still this node's to
    /// publish ([`SessionSource::landed`]).
    taken_here: bool,
}

struct Entry {
    role: Role,
    /// The broker's copy of the session that belongs to this claim: the one the CONNECT that
    /// claimed it puts in (`locate`'s `copy`), or the one adopted for it (`None` until then).
    /// Only this copy is dropped when the session is lost.
    copy: Option<CopyId>,
    /// The row's version this node knows (the base of its next write); `None`: no row.
    base: Option<Version>,
    epoch: u64,
    /// Changes applied to the mirror so far.
    generation: u64,
    status: watch::Sender<Status>,
    flushing: bool,
    /// The state-store keys the client observes, in key order (written with the session).
    observed: Vec<Vec<u8>>,
    /// Per observed key, its last change queued into the session (written with the session, so
    /// always in step with the messages the row holds; decision 0065).
    cursors: BTreeMap<Vec<u8>, String>,
}

#[derive(Default)]
struct State {
    /// The sessions this node owns, as their rows will hold them.
    mirror: Restored,
    entries: HashMap<Arc<str>, Entry>,
}

struct Shared {
    node: u64,
    rows: OnceLock<Arc<dyn SessionRows>>,
    broker: OnceLock<Broker>,
    observers: OnceLock<Arc<dyn Observers>>,
    state: Mutex<State>,
}

/// The journal and session source of a cluster node; retained messages go to `local`.
#[derive(Clone)]
pub struct ReplicatedSessions {
    shared: Arc<Shared>,
    local: Arc<dyn SessionJournal>,
}

impl ReplicatedSessions {
    /// For node `node`; rows and broker are attached once they exist.
    pub fn new(node: u64, local: Arc<dyn SessionJournal>) -> Self {
        ReplicatedSessions {
            shared: Arc::new(Shared {
                node,
                rows: OnceLock::new(),
                broker: OnceLock::new(),
                observers: OnceLock::new(),
                state: Mutex::new(State::default()),
            }),
            local,
        }
    }

    /// The cluster's session rows (before this, every CONNECT is refused retryably).
    pub fn attach_rows(&self, rows: Arc<dyn SessionRows>) {
        let _ = self.shared.rows.set(rows);
    }

    /// The broker whose copies of sessions lost to other nodes are dropped.
    pub fn attach_broker(&self, broker: Broker) {
        let _ = self.shared.broker.set(broker);
    }

    /// The state store that takes back the registrations of a session taken over here.
    pub fn attach_observers(&self, observers: Arc<dyn Observers>) {
        let _ = self.shared.observers.set(observers);
    }

    /// `client_id` now observes `keys` (the whole set, in key order). For a session this node
    /// owns, the set is written with the session's row; resolves once it is durable. A client
    /// without a replicated session (a clean one) has nothing to keep: resolves at once.
    pub fn keep_observed(
        &self,
        client_id: &str,
        keys: Vec<Vec<u8>>,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> {
        debug_assert!(keys.windows(2).all(|w| w[0] < w[1]), "keys in order");
        let wait = {
            let mut state = self.shared.lock();
            let id = state
                .entries
                .get_key_value(client_id)
                .map(|(id, _)| id.clone());
            // A clean session's row (its will only) keeps no registrations: they end with it.
            let persistent = state
                .mirror
                .sessions
                .get(client_id)
                .is_some_and(|s| s.expiry_secs > 0);
            match (id, state.entries.get_mut(client_id)) {
                (Some(id), Some(entry))
                    if persistent && entry.role == Role::Owned && entry.observed != keys =>
                {
                    // A key observed from now on owes the changes after the last one notified
                    // here; the others keep theirs.
                    let observers = self.shared.observers.get();
                    let mut cursors = BTreeMap::new();
                    for key in &keys {
                        let cursor = match entry.cursors.remove(key) {
                            Some(cursor) => Some(cursor),
                            None if entry.observed.binary_search(key).is_ok() => None,
                            None => observers.and_then(|o| o.position(key)),
                        };
                        if let Some(cursor) = cursor {
                            cursors.insert(key.clone(), cursor);
                        }
                    }
                    entry.cursors = cursors;
                    entry.observed = keys;
                    entry.generation += 1;
                    if !entry.flushing {
                        entry.flushing = true;
                        tokio::spawn(flush(Arc::clone(&self.shared), id, entry.epoch));
                    }
                    Some((entry.status.subscribe(), entry.generation))
                }
                _ => None,
            }
        };
        let client_id = client_id.to_owned();
        Box::pin(async move {
            let Some((mut status, generation)) = wait else {
                return Ok(());
            };
            match status
                .wait_for(|s| s.written >= generation || s.failed >= generation || s.lost)
                .await
                .map(|s| *s)
            {
                Ok(s) if s.written >= generation => Ok(()),
                Ok(s) if s.lost => Err(format!("session {client_id} moved to another node")),
                _ => Err(format!(
                    "the observed keys of {client_id} could not be written to their replicas"
                )),
            }
        })
    }
}

fn client_of(change: &SessionChange) -> Option<&Arc<str>> {
    use SessionChange::*;
    match change {
        Created { client_id, .. }
        | Attached { client_id, .. }
        | Detached { client_id, .. }
        | Subscribed { client_id, .. }
        | Unsubscribed { client_id, .. }
        | Appended { client_id, .. }
        | Sent { client_id, .. }
        | Released { client_id, .. }
        | Removed { client_id, .. }
        | Deleted { client_id }
        | Qos2Received { client_id, .. }
        | Qos2Released { client_id, .. }
        | Took { client_id, .. }
        | WillScheduled { client_id, .. }
        | WillCancelled { client_id }
        | WillSet { client_id, .. } => Some(client_id),
        RetainedSet { .. } | RetainedCleared { .. } => None,
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn rows(&self) -> Result<Arc<dyn SessionRows>, String> {
        self.rows
            .get()
            .cloned()
            .ok_or_else(|| "the cluster's data plane has not started yet".to_owned())
    }
}

impl SessionJournal for ReplicatedSessions {
    /// The will of a clean session's client is a row too while it is connected, so that the node
    /// that settles a dead node's rows publishes it (decision 0063).
    fn keeps_clean_wills(&self) -> bool {
        true
    }

    fn record(&self, changes: Vec<SessionChange>) -> Durable {
        let mut retained = Vec::new();
        let mut waits = Vec::new();
        let mut refused = None;
        {
            let mut state = self.shared.lock();
            let State { mirror, entries } = &mut *state;
            for change in changes {
                let Some(client_id) = client_of(&change).cloned() else {
                    retained.push(change);
                    continue;
                };
                let Some(entry) = entries.get_mut(&client_id) else {
                    refused = Some(format!("session {client_id} is not held by this node"));
                    continue;
                };
                if matches!(change, SessionChange::Created { .. }) && entry.role == Role::Claimed {
                    entry.role = Role::Owned;
                }
                if entry.role != Role::Owned {
                    refused = Some(format!("session {client_id} moved to another node"));
                    continue;
                }
                if let (SessionChange::Appended { message, .. }, false, Some(observers)) = (
                    &change,
                    entry.observed.is_empty(),
                    self.shared.observers.get(),
                ) {
                    // In the same row write as the message: the row's cursor never runs ahead
                    // of what the row holds.
                    if let Some((key, version)) = observers.notified(&message.message) {
                        if entry.observed.binary_search(&key).is_ok() {
                            entry.cursors.insert(key, version);
                        }
                    }
                }
                mirror.apply(change);
                entry.generation += 1;
                let generation = entry.generation;
                match waits.last_mut() {
                    Some((id, _, g)) if *id == client_id => *g = generation,
                    _ => waits.push((client_id, entry.status.subscribe(), generation)),
                }
            }
            for (client_id, _, _) in &waits {
                if let Some(entry) = entries.get_mut(client_id) {
                    if !entry.flushing {
                        entry.flushing = true;
                        tokio::spawn(flush(
                            Arc::clone(&self.shared),
                            client_id.clone(),
                            entry.epoch,
                        ));
                    }
                }
            }
        }
        let local = (!retained.is_empty()).then(|| self.local.record(retained));
        Box::pin(async move {
            if let Some(reason) = refused {
                return Err(JournalError(reason));
            }
            if let Some(local) = local {
                local.await?;
            }
            for (client_id, mut status, generation) in waits {
                let outcome = status
                    .wait_for(|s| s.written >= generation || s.failed >= generation || s.lost)
                    .await
                    .map(|s| *s);
                match outcome {
                    Ok(s) if s.written >= generation => {}
                    Ok(s) if s.lost => {
                        return Err(JournalError(format!(
                            "session {client_id} moved to another node"
                        )))
                    }
                    _ => {
                        return Err(JournalError(format!(
                            "session {client_id} could not be written to its replicas"
                        )))
                    }
                }
            }
            Ok(())
        })
    }
}

/// The entry of `client_id` this node took under `epoch`, if it is still the one held: a
/// take-over here replaces the entry (under a new epoch), and what was under way for the one it
/// replaced must not touch it.
fn entry_of<'a>(
    entries: &'a mut HashMap<Arc<str>, Entry>,
    client_id: &str,
    epoch: u64,
) -> Option<&'a mut Entry> {
    entries.get_mut(client_id).filter(|e| e.epoch == epoch)
}

/// Writes `client_id`'s row until it holds every change applied to the mirror (for the entry
/// of `epoch`).
async fn flush(shared: Arc<Shared>, client_id: Arc<str>, epoch: u64) {
    loop {
        let (value, base, generation) = {
            let mut state = shared.lock();
            let State { mirror, entries } = &mut *state;
            let Some(entry) = entry_of(entries, &client_id, epoch) else {
                return;
            };
            if entry.role != Role::Owned || entry.status.borrow().written >= entry.generation {
                entry.flushing = false;
                return;
            }
            let value = mirror.sessions.get_mut(&client_id).map(|session| {
                // Numbers that can no longer come again leave the row (decision 0066).
                let now = shared.now_ms();
                session.taken.retain(|t| t.kept_at(now));
                row::encode(
                    &client_id,
                    &SessionRow {
                        owner: shared.node,
                        epoch: entry.epoch,
                        session: session.clone(),
                        observed: entry.observed.clone(),
                        cursors: entry.cursors.clone(),
                    },
                )
            });
            (value, entry.base, entry.generation)
        };
        let deleting = value.is_none();
        let outcome = match shared.rows() {
            Ok(rows) => rows.write(&client_id, value, base).await,
            Err(reason) => Err(reason),
        };
        match outcome {
            Ok(Ok(version)) => written(&shared, &client_id, epoch, Some(version), generation),
            Ok(Err(current)) => {
                // Our own earlier write whose answer was lost, another node's take-over, or (for
                // a delete) another node that found the session ended and deleted it first.
                match refused(&shared, &client_id, epoch, current, deleting).await {
                    Refused::Ours => {}
                    Refused::Gone(version) => {
                        written(&shared, &client_id, epoch, version, generation)
                    }
                    Refused::Lost => {
                        lose(&shared, &client_id, epoch);
                        return;
                    }
                }
            }
            Err(reason) => {
                tracing::warn!(%client_id, "a session row could not be written: {reason}");
                {
                    let mut state = shared.lock();
                    if let Some(entry) = entry_of(&mut state.entries, &client_id, epoch) {
                        entry.status.send_modify(|s| s.failed = generation);
                    }
                }
                tokio::time::sleep(REWRITE_EVERY).await;
            }
        }
    }
}

/// The row of the entry of `epoch` holds every change up to `generation`, at `version`.
fn written(
    shared: &Shared,
    client_id: &Arc<str>,
    epoch: u64,
    version: Option<Version>,
    generation: u64,
) {
    let mut state = shared.lock();
    if let Some(entry) = entry_of(&mut state.entries, client_id, epoch) {
        entry.base = version;
        entry.status.send_modify(|s| s.written = generation);
    }
}

/// What a refused write of a row found.
enum Refused {
    /// This node wrote the row under its epoch (an answer was lost): the base is updated.
    Ours,
    /// A delete found the row deleted already (at this version): the session ended anyway.
    Gone(Option<Version>),
    /// Another node owns the session now.
    Lost,
}

/// After a refused write: reads the row. If this node under its epoch wrote it, adopts its
/// version as the base. A delete that finds no row is done: a node that reads a row whose
/// session ended deletes it (decision 0063), and a session whose end this node was writing had
/// ended.
async fn refused(
    shared: &Shared,
    client_id: &Arc<str>,
    epoch: u64,
    current: Option<Version>,
    deleting: bool,
) -> Refused {
    let Ok(rows) = shared.rows() else {
        return Refused::Lost;
    };
    let read = match rows.read(client_id).await {
        Ok(read) => read,
        // Unknown: try the write again later (it will be refused again if we lost it).
        Err(_) => return Refused::Ours,
    };
    if deleting && read.value.is_none() {
        tracing::debug!(%client_id, ?current, "a session row was deleted by another node first");
        return Refused::Gone(read.version);
    }
    let mine = read
        .value
        .as_deref()
        .map(|value| row::decode(client_id, value))
        .and_then(Result::ok)
        .map(|row| (row.owner, row.epoch));
    let mut state = shared.lock();
    match entry_of(&mut state.entries, client_id, epoch) {
        Some(entry) if mine == Some((shared.node, epoch)) => {
            tracing::debug!(%client_id, ?current, "a session row write of ours landed unanswered");
            entry.base = read.version;
            Refused::Ours
        }
        _ => Refused::Lost,
    }
}

/// Another node owns the session now: stop writing it, fail what waits, drop the broker's copy
/// that belongs to the entry of `epoch` (if that entry is still the one held), and disconnect
/// its client, whose will is the new holder's to publish.
fn lose(shared: &Shared, client_id: &Arc<str>, epoch: u64) {
    if let Some(copy) = fence(shared, client_id, epoch) {
        drop_lost(shared, client_id, copy);
    }
}

/// Drops the broker's copy of a claim that was lost, after the state lock is released. Named:
/// by now this node may have taken the session back (a CONNECT here, an adoption), and the copy
/// it put in for that is not this one (robustness seed 500764's shape).
fn drop_lost(shared: &Shared, client_id: &Arc<str>, copy: Option<CopyId>) {
    tracing::info!(%client_id, "session taken over by another node; the copy here is dropped");
    if let (Some(broker), Some(copy)) = (shared.broker.get(), copy) {
        broker.forget_session(client_id, copy);
    }
}

/// Marks the entry of `epoch` lost, if it is still the one held: nothing more of it is written,
/// and what waits fails. Returns the broker's copy that belongs to it (`Some(None)`: none put in
/// yet; an adoption that puts one in then drops it), or `None` if the entry was replaced.
fn fence(shared: &Shared, client_id: &Arc<str>, epoch: u64) -> Option<Option<CopyId>> {
    let mut state = shared.lock();
    let State { mirror, entries } = &mut *state;
    let entry = entry_of(entries, client_id, epoch)?;
    entry.role = Role::Lost;
    entry.flushing = false;
    entry.status.send_modify(|s| s.lost = true);
    mirror.sessions.remove(client_id);
    Some(entry.copy)
}

impl SessionSource for ReplicatedSessions {
    fn locate(
        &self,
        client_id: &str,
        clean_start: bool,
        persistent: bool,
        held_here: bool,
        copy: CopyId,
    ) -> Locating {
        let shared = Arc::clone(&self.shared);
        let client_id: Arc<str> = client_id.into();
        if clean_start && !persistent && !held_here {
            // A clean session is not replicated, and its CONNACK does not wait for the chains
            // (state-store clients, the admin CLI: they must connect while a partition fails
            // over or the cluster forms): a row held elsewhere is deleted in the background.
            // (With a copy here, the delete is waited for, as for a persistent session.)
            tokio::spawn(async move {
                if let Err(e) = discard_clean_start(&shared, client_id.clone(), copy).await {
                    tracing::warn!(%client_id, "a clean start could not discard the session's row: {e}");
                }
            });
            return Box::pin(async { Ok(Located::Here) });
        }
        Box::pin(async move {
            locate(&shared, client_id, clean_start, held_here, copy)
                .await
                .map_err(Unlocated)
        })
    }

    fn landed(&self, client_id: &str) -> Landing {
        let wait = {
            let state = self.shared.lock();
            match state.entries.get(client_id) {
                Some(entry) if entry.role == Role::Owned => {
                    Some((entry.status.subscribe(), entry.generation))
                }
                // Another node took the session over: it lives on there.
                Some(entry) if entry.role == Role::Lost => return Box::pin(async { false }),
                // Nothing of it written from here (not replicated, or claimed and never
                // written): its end is this node's.
                _ => None,
            }
        };
        Box::pin(async move {
            let Some((mut status, generation)) = wait else {
                return true;
            };
            // Failed writes are retried (`flush`): wait for the row to hold the end, or for
            // another node to have taken the session.
            match status
                .wait_for(|s| s.written >= generation || s.lost)
                .await
                .map(|s| *s)
            {
                // Landed, though the entry may have been replaced since (a CONNECT here that
                // found the row deleted). Or replaced first by a take-over here of the row as
                // this entry left it (a clean start of the client on this node whose delete of
                // the row won; an expiry the CONNECT's delete overtook).
                Ok(s) => s.written >= generation || s.taken_here,
                // Replaced before it landed: the session was taken over.
                Err(_) => false,
            }
        })
    }
}

/// Waits until this node's own writes of `client_id`'s row landed, if it holds the entry and
/// the broker no longer holds the session (it ended here: its `Deleted` on its way). A CONNECT
/// here must find the row as the session's end left it: reading the row still being deleted, it
/// would delete (or take over) the row itself, and the expiry, its own delete refused, would not
/// know whether the session ended (decision 0070). Failed writes are retried meanwhile; after
/// [`ROW_BUDGET`] the CONNECT is refused retryably.
async fn own_writes_landed(shared: &Shared, client_id: &str) -> Result<(), String> {
    let wait = {
        let state = shared.lock();
        match state.entries.get(client_id) {
            Some(entry)
                if entry.role == Role::Owned
                    && entry.status.borrow().written < entry.generation =>
            {
                Some((entry.status.subscribe(), entry.generation))
            }
            _ => None,
        }
    };
    if let Some((mut status, generation)) = wait {
        let landed = status.wait_for(|s| s.written >= generation || s.lost);
        if tokio::time::timeout(ROW_BUDGET, landed).await.is_err() {
            return Err(format!(
                "the end of the session of {client_id} is not written to its replicas yet"
            ));
        }
    }
    Ok(())
}

/// The background discard of a clean start that keeps no row: as `locate`, except that the
/// will row of a clean session connected to another running node is left to that node, which
/// publishes the will and deletes the row when the claim ends its connection — or, if it died
/// and is not counted down yet, to whoever settles its rows once it is (decision 0063).
async fn discard_clean_start(
    shared: &Shared,
    client_id: Arc<str>,
    copy: CopyId,
) -> Result<(), String> {
    let rows = shared.rows()?;
    let found = read_row(&*rows, &client_id).await?;
    if let Some(row) = &found.row {
        if is_will_row(&row.session) && !held_by_nobody(shared, &*rows, &client_id, row) {
            tracing::debug!(%client_id, owner = row.owner, "a clean start leaves a connected clean session's will row to its node");
            return Ok(());
        }
    }
    locate(shared, client_id, true, false, copy).await.map(drop)
}

/// A client's row as read at its partition's head.
struct Found {
    row: Option<SessionRow>,
    version: Option<Version>,
}

async fn read_row(rows: &dyn SessionRows, client_id: &Arc<str>) -> Result<Found, String> {
    let read = rows.read(client_id).await?;
    let row = match read.value.as_deref().map(|v| row::decode(client_id, v)) {
        Some(Ok(row)) => Some(row),
        Some(Err(e)) => {
            // A damaged row is not a session that does not exist: refuse (an operator looks).
            tracing::error!(%client_id, "the session row does not decode: {e}");
            return Err(format!("the session row of {client_id} is damaged: {e}"));
        }
        None => None,
    };
    Ok(Found {
        row,
        version: read.version,
    })
}

/// Where `client_id`'s session is, for a CONNECT whose copy (if it puts one in) is `copy`.
async fn locate(
    shared: &Shared,
    client_id: Arc<str>,
    clean_start: bool,
    held_here: bool,
    copy: CopyId,
) -> Result<Located, String> {
    let rows = shared.rows()?;
    // A node without its lease serves no session (`send_clients_away`): it takes none either, or
    // a CONNECT here would serve one the heads may be adopting.
    if !rows.lease_held() {
        return Err(
            "this node's control-plane lease has lapsed: it takes no session until it is renewed"
                .into(),
        );
    }
    if !held_here {
        own_writes_landed(shared, &client_id).await?;
    }
    for _ in 0..TAKE_OVER_TRIES {
        let mut found = read_row(&*rows, &client_id).await?;
        if clean_start {
            found = wait_for_will_row(shared, &*rows, &client_id, found).await?;
        }
        if let (Some(row), false, true) = (&found.row, clean_start, held_here) {
            let state = shared.lock();
            if let Some(entry) = state.entries.get(&client_id) {
                if entry.role == Role::Owned && row.owner == shared.node && row.epoch == entry.epoch
                {
                    return Ok(Located::Here);
                }
            }
        }
        // The row changed between the read and the write (its owner wrote it, or another node
        // settled it): read it again.
        let claim = take_over(
            shared,
            &*rows,
            client_id.clone(),
            found,
            clean_start,
            Some(copy),
        );
        if let Some(claim) = claim.await? {
            return Ok(claim.located);
        }
    }
    Err(format!(
        "the session of {client_id} kept changing while it was taken over"
    ))
}

/// Reads of a row that changed under a take-over before the CONNECT is refused (retryably).
const TAKE_OVER_TRIES: usize = 3;

/// Whether `session` is a clean session's will row: its client connected, with a will.
fn is_will_row(session: &StoredSession) -> bool {
    session.expiry_secs == 0 && session.detached_at_ms.is_none() && session.connected_will.is_some()
}

/// How long a clean start waits for another running node to settle the will row it finds.
const WILL_ROW_WAIT: Duration = Duration::from_secs(2);
/// How often the row is read again meanwhile.
const WILL_ROW_POLL: Duration = Duration::from_millis(100);

/// A clean start that keeps a row (its client has a will, or an expiry) must not take over the
/// will row of a clean session another node counts as up without its will being published
/// (decision 0066): if that node lives, the claim ended its connection and it publishes the will
/// and deletes the row; if it died and is not counted down yet, the row is settled (the will
/// published) once it is, by this node or the adopter. Waits [`WILL_ROW_WAIT`] for either, then
/// refuses retryably (the CONNECT is answered 0x88; the client's retry finds it settled).
async fn wait_for_will_row(
    shared: &Shared,
    rows: &dyn SessionRows,
    client_id: &Arc<str>,
    mut found: Found,
) -> Result<Found, String> {
    let started = tokio::time::Instant::now();
    loop {
        let owner = match &found.row {
            Some(row)
                if row.owner != shared.node
                    && is_will_row(&row.session)
                    && !held_by_nobody(shared, rows, client_id, row) =>
            {
                row.owner
            }
            _ => return Ok(found),
        };
        if started.elapsed() >= WILL_ROW_WAIT {
            return Err(format!(
                "the will of {client_id}'s connection on node {owner} is not settled yet"
            ));
        }
        tokio::time::sleep(WILL_ROW_POLL).await;
        found = read_row(rows, client_id).await?;
    }
}

/// Whether the connection (or delayed will) that `row` describes is no longer held by any
/// running node: its owner is down, or is this node under an earlier run (it restarted).
fn held_by_nobody(
    shared: &Shared,
    rows: &dyn SessionRows,
    client_id: &str,
    row: &SessionRow,
) -> bool {
    if row.owner == shared.node {
        shared
            .lock()
            .entries
            .get(client_id)
            .is_none_or(|e| e.epoch != row.epoch)
    } else {
        !rows.is_up(row.owner)
    }
}

/// Whether `session` has ended by `now_ms`: its expiry passed since its client left, or its
/// client was connected to a clean session (expiry 0: the session ended with the connection).
fn ended(session: &StoredSession, now_ms: u64) -> bool {
    match session.detached_at_ms {
        None => session.expiry_secs == 0,
        Some(_) if session.expiry_secs == u32::MAX => false,
        Some(at_ms) => at_ms.saturating_add(u64::from(session.expiry_secs) * 1000) <= now_ms,
    }
}

impl Shared {
    /// The node's clock — the broker's, which stamps the sessions' instants (a detach, a kept
    /// packet id) — so an expiry is judged on the clock it was stamped by (a node's clock may be
    /// offset from the system's: `test_clock_offset_ms`, a simulation); the system's until the
    /// broker is attached.
    fn now_ms(&self) -> u64 {
        self.broker
            .get()
            .map_or_else(system_now_ms, |broker| broker.clock().now_ms())
    }
}

fn system_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Makes the row found this node's: written back with this node as owner under a new epoch
/// (compare-and-set on the version read), or deleted for a clean start; the session is then
/// claimed here, waiting for the broker's `Created`, and its client's registrations are in force.
/// A row whose session ended is deleted, not taken. One that nobody running holds (its node
/// died) whose session ended — or that a clean start discards — has its will published here, as
/// its own node would have (decision 0063): the compare-and-set makes this node the only one
/// that does. So has a delayed will that a clean start ends while its running node holds it
/// (that node dropped it with its copy when this node claimed the client id). `copy`: the
/// broker's copy that belongs to the claim, if it is known yet (a CONNECT's). `Ok(None)`: the
/// row changed since it was read.
async fn take_over(
    shared: &Shared,
    rows: &dyn SessionRows,
    client_id: Arc<str>,
    found: Found,
    clean_start: bool,
    copy: Option<CopyId>,
) -> Result<Option<Claim>, String> {
    let known_epoch = shared.lock().entries.get(&client_id).map_or(0, |e| e.epoch);
    let epoch = known_epoch.max(found.row.as_ref().map_or(0, |r| r.epoch)) + 1;
    // An ended session is not taken: its row goes. Its will is published here only if no
    // running node holds it (a live owner publishes it itself, from its own timers or when the
    // claim ends its connection).
    let (ended, nobody) = found.row.as_ref().map_or((false, false), |row| {
        (
            ended(&row.session, shared.now_ms()),
            held_by_nobody(shared, rows, &client_id, row),
        )
    });
    let settle = nobody && (clean_start || ended);
    // A clean start ends a session whose delayed will another running node holds (pending, or
    // due when the connection the claim ended closes): the claim made that node drop its copy of
    // the session, the will with it (`Broker::take_over_here`), so the will goes out here, as one
    // node publishes a pending will when a clean start ends its session. A delay-0 will is the
    // owner's: its connection published it as the claim ended it; a clean session's connection
    // publishes its will whatever the delay (its session ends with it).
    let dropped = |row: &SessionRow| {
        clean_start
            && !nobody
            && !ended
            && row.owner != shared.node
            && row.session.expiry_secs > 0
            && row.session.will_at_end().is_some_and(|w| w.delay_secs > 0)
    };
    let mut observed = Vec::new();
    let mut cursors = BTreeMap::new();
    let mut will = None;
    // The row as this node's entry last wrote it: deleting it ends the session this node holds.
    let ours = found.row.as_ref().is_some_and(|row| {
        row.owner == shared.node
            && shared
                .lock()
                .entries
                .get(&client_id)
                .is_some_and(|e| e.role == Role::Owned && e.epoch == row.epoch)
    });
    let (base, located) = match found.row {
        Some(mut row) if !clean_start && !ended => {
            row.owner = shared.node;
            row.epoch = epoch;
            let value = row::encode(&client_id, &row);
            match rows.write(&client_id, Some(value), found.version).await? {
                Ok(version) => {
                    observed = row.observed;
                    cursors = row.cursors;
                    (Some(version), Located::Taken(Box::new(row.session)))
                }
                Err(_) => return Ok(None),
            }
        }
        // A clean start discards the session everywhere; an ended one goes too.
        Some(row) => match rows.write(&client_id, None, found.version).await? {
            Ok(version) => {
                if settle || dropped(&row) {
                    will = row.session.will_at_end().cloned();
                }
                (Some(version), Located::Gone)
            }
            Err(_) => return Ok(None),
        },
        None => (found.version, Located::Gone),
    };
    let taken_here = ours && will.is_none();
    let replaced;
    if let Some(will) = will {
        match shared.broker.get() {
            Some(broker) => broker.publish_will(will),
            None => {
                tracing::error!(%client_id, "the will of a session ended elsewhere is lost: no broker attached")
            }
        }
    }
    {
        let mut state = shared.lock();
        state.mirror.sessions.remove(&client_id);
        let previous = state.entries.remove(&client_id);
        if let Some(previous) = &previous {
            // Whoever waits on the copy this replaces is told it is gone, and whether it was
            // taken here.
            previous.status.send_modify(|s| {
                s.lost = true;
                s.taken_here = taken_here;
            });
        }
        replaced = previous.and_then(|p| p.copy);
        let (status, _) = watch::channel(Status::default());
        state.entries.insert(
            client_id.clone(),
            Entry {
                role: Role::Claimed,
                copy,
                base,
                epoch,
                generation: 0,
                status,
                flushing: false,
                observed: observed.clone(),
                cursors: cursors.clone(),
            },
        );
    }
    // The client's registrations are in force here before its CONNACK.
    if !observed.is_empty() {
        let keys = observed
            .into_iter()
            .map(|key| {
                let cursor = cursors.remove(&key);
                (key, cursor)
            })
            .collect();
        match shared.observers.get() {
            Some(observers) => observers.restore(client_id, keys).await,
            None => {
                tracing::warn!(%client_id, "observed keys of a session taken over, but no state store to register them")
            }
        }
    }
    Ok(Some(Claim {
        located,
        epoch,
        replaced,
    }))
}

/// A session claimed here by [`take_over`].
struct Claim {
    located: Located,
    epoch: u64,
    /// The broker's copy that belonged to the claim this one replaced (now obsolete), if any.
    replaced: Option<CopyId>,
}

/// How often a node looks for orphaned sessions (decision 0054).
pub const ADOPT_EVERY: Duration = Duration::from_secs(1);
/// How often a node looks whether its lease still holds (a lapse sends its sessions' clients
/// away at once: the control plane counts it down only a clock factor later).
pub const LEASE_LOOK: Duration = Duration::from_millis(100);

impl ReplicatedSessions {
    /// Looks for orphaned sessions every [`ADOPT_EVERY`], and whether this node's lease still
    /// holds every [`LEASE_LOOK`], while the journal lives (the task holds it weakly). Abort the
    /// task to stop earlier.
    pub fn adopt_orphans_regularly(&self) -> tokio::task::JoinHandle<()> {
        let shared = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(LEASE_LOOK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut next_look = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                tend(&shared, Some(&mut next_look)).await;
            }
        })
    }

    /// One look for orphaned sessions (decision 0054): rows that no running node holds — their
    /// owner is down (its lease lapsed; adopted by the head of their partition) or is this node
    /// under an earlier run (it restarted; adopted by itself). Each is taken over as a CONNECT
    /// would take it, and handed to the broker, which expires it, publishes its will when due
    /// and queues what is routed to it. Returns the client ids adopted. While this node's own
    /// lease has lapsed it adopts nothing and sends the clients of its sessions away instead.
    pub async fn adopt_orphans(&self) -> Vec<Arc<str>> {
        tend(&self.shared, None).await
    }
}

/// One step of this node's care of its sessions: while its own lease has lapsed, it sends their
/// clients away and adopts nothing; otherwise it adopts the orphans it finds (returned), when
/// `next_look` (if given) is due, and moves it on. The look is due again [`ADOPT_EVERY`] after
/// the last one made, not counting the time the lease was lapsed (so the first tick after a
/// renewal looks at once).
async fn tend(shared: &Shared, next_look: Option<&mut tokio::time::Instant>) -> Vec<Arc<str>> {
    let Ok(rows) = shared.rows() else {
        return Vec::new();
    };
    if !rows.lease_held() {
        send_clients_away(shared);
        return Vec::new();
    }
    if let Some(next_look) = next_look {
        let now = tokio::time::Instant::now();
        if now < *next_look {
            return Vec::new();
        }
        *next_look = now + ADOPT_EVERY;
    }
    let here = match rows.here().await {
        Ok(here) => here,
        Err(e) => {
            tracing::debug!("no look for orphaned sessions now: {e}");
            return Vec::new();
        }
    };
    let mut adopted = Vec::new();
    for (client_id, value, head) in here {
        let client_id: Arc<str> = client_id.into();
        let Some((owner, epoch)) = row::header(&value) else {
            continue;
        };
        let orphan = if owner == shared.node {
            // Nothing this run of the node took over or created: a row of an earlier run.
            !shared.lock().entries.contains_key(&client_id)
        } else {
            head && !rows.is_up(owner) && !holds(shared, &client_id)
        };
        if !orphan {
            continue;
        }
        match adopt(shared, &*rows, client_id.clone(), (owner, epoch)).await {
            Ok(true) => adopted.push(client_id),
            Ok(false) => {}
            Err(e) => tracing::warn!(%client_id, "an orphaned session was not adopted: {e}"),
        }
    }
    adopted
}

/// This node's control-plane lease lapsed: the control plane may count it down and the heads
/// adopt its sessions (decision 0054), while its clients, cut off with it, stay connected. Every
/// client of a session owned here is disconnected now (0x9C Use another server), before an
/// adoption can happen, so that a copy here never delivers beside an adopter's (seed 400378 of
/// the robustness suite: a client on a node cut off for 5 s got the old copy's notifications after
/// the partition healed, then the adopter's, which went back in version order). The copy stays,
/// with what it queued: if nobody adopts it, the client resumes it here once the lease holds;
/// if someone did, the client's next CONNECT finds the row moved and takes the adopter's (a
/// CONNECT reads the row at its head), and the copy here is fenced at its next write.
fn send_clients_away(shared: &Shared) {
    let Some(broker) = shared.broker.get() else {
        return;
    };
    let owned: Vec<Arc<str>> = shared
        .lock()
        .entries
        .iter()
        .filter(|(_, e)| e.role == Role::Owned)
        .map(|(client_id, _)| client_id.clone())
        .collect();
    for client_id in &owned {
        if broker.send_away(client_id) {
            tracing::info!(%client_id, "this node's lease lapsed: its client is sent to another node");
        }
    }
}

/// Whether this node owns (or is taking over) `client_id`'s session.
fn holds(shared: &Shared, client_id: &str) -> bool {
    shared
        .lock()
        .entries
        .get(client_id)
        .is_some_and(|e| e.role != Role::Lost)
}

/// Takes over the session of `client_id` if its row at the head is still the one seen (owner,
/// epoch), and hands it to the broker. `Ok(false)`: the row moved on meanwhile.
async fn adopt(
    shared: &Shared,
    rows: &dyn SessionRows,
    client_id: Arc<str>,
    seen: (u64, u64),
) -> Result<bool, String> {
    let broker = shared
        .broker
        .get()
        .cloned()
        .ok_or("no broker attached yet")?;
    let found = read_row(rows, &client_id).await?;
    if found.row.as_ref().map(|r| (r.owner, r.epoch)) != Some(seen) {
        return Ok(false);
    }
    let claim = take_over(shared, rows, client_id.clone(), found, false, None).await?;
    let (session, epoch, replaced) = match claim {
        Some(Claim {
            located: Located::Taken(session),
            epoch,
            replaced,
        }) => (session, epoch, replaced),
        // It had ended: its row is deleted and its will published.
        Some(_) => {
            tracing::info!(%client_id, owner = seen.0, "the ended session of a dead node settled");
            return Ok(true);
        }
        None => return Ok(false),
    };
    // A CONNECT of the client here may have taken the session from this claim while
    // `take_over` waited (for the restore of its observed keys): the copy it put in the broker
    // is the client's, and this adoption is over (seed 946 of the robustness suite: a drop of
    // whatever copy the broker held, made here then, dropped the CONNECT's before it attached,
    // which then created an empty session). A claim that ends after this check has the copy
    // adopted for it dropped below.
    let current = shared
        .lock()
        .entries
        .get(&client_id)
        .is_some_and(|e| e.role == Role::Claimed && e.epoch == epoch);
    if !current {
        tracing::info!(%client_id, "an orphaned session was taken by its client during its adoption");
        return Ok(false);
    }
    tracing::info!(%client_id, owner = seen.0, "orphaned session adopted");
    // The copy of the claim this one replaced (lost to the node that died; still here if its
    // client was connected then) makes way for the row's session.
    if let Some(stale) = replaced {
        broker.forget_session(&client_id, stale);
    }
    let adoption = broker
        .adopt_session(client_id.clone(), *session)
        .map_err(|e| e.to_string())?;
    if let Some(copy) = adoption.copy {
        // The copy is this claim's, unless the claim ended meanwhile (lost to another node, or
        // replaced by a CONNECT here): then the copy is obsolete already.
        let claimed = {
            let mut state = shared.lock();
            match entry_of(&mut state.entries, &client_id, epoch) {
                Some(entry) if entry.role != Role::Lost => {
                    entry.copy = Some(copy);
                    true
                }
                _ => false,
            }
        };
        if !claimed {
            broker.forget_session(&client_id, copy);
            return Ok(false);
        }
    }
    if let Some(durable) = adoption.durable {
        durable.await.map_err(|e| e.to_string())?;
    }
    if adoption.report.expired > 0 {
        // Its expiry passed while nobody held it: the broker published its will, the row goes.
        discard(shared, rows, &client_id).await?;
    }
    Ok(true)
}

/// Deletes the row of a session claimed here that the broker did not take (it had expired).
async fn discard(
    shared: &Shared,
    rows: &dyn SessionRows,
    client_id: &Arc<str>,
) -> Result<(), String> {
    let base = match shared.lock().entries.get(client_id) {
        Some(entry) if entry.role == Role::Claimed => entry.base,
        _ => return Ok(()),
    };
    match rows.write(client_id, None, base).await? {
        Ok(version) => {
            if let Some(entry) = shared.lock().entries.get_mut(client_id) {
                entry.base = Some(version);
            }
            Ok(())
        }
        Err(_) => Err("the row changed before the expired session was deleted".into()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use bytestring::ByteString;
    use mqstate_broker::session::SubscriptionOptions;
    use mqstate_broker::QoS;

    use super::*;

    /// The copy a CONNECT in these tests would put in the broker (the broker numbers its own
    /// from 1).
    const CONNECT: CopyId = CopyId(1 << 40);

    /// Rows in memory with the chain head's compare-and-set (the real chain runs in
    /// `tests/cluster_sessions.rs`).
    type Stored = (Option<Vec<u8>>, Version);

    /// The rows, the nodes counted down, (while holding) the writes waiting to land, and whether
    /// the nodes' own leases lapsed.
    #[derive(Default)]
    struct MemoryRows(
        Mutex<HashMap<String, Stored>>,
        Mutex<Vec<u64>>,
        Mutex<Option<Vec<tokio::sync::oneshot::Sender<()>>>>,
        std::sync::atomic::AtomicBool,
    );

    impl MemoryRows {
        /// From now on, writes wait to be let through (their compare-and-set made then).
        fn hold(&self) {
            *self.2.lock().unwrap() = Some(Vec::new());
        }

        /// Writes waiting to land.
        fn held(&self) -> usize {
            self.2.lock().unwrap().as_ref().map_or(0, Vec::len)
        }

        /// Lets the newest write waiting through.
        fn land_newest(&self) {
            if let Some(write) = self.2.lock().unwrap().as_mut().and_then(Vec::pop) {
                let _ = write.send(());
            }
        }

        /// Lets every write waiting through, and the next ones at once.
        fn stop_holding(&self) {
            for write in self.2.lock().unwrap().take().into_iter().flatten() {
                let _ = write.send(());
            }
        }

        fn compare_and_set(
            &self,
            client_id: &str,
            value: Option<Vec<u8>>,
            base: Option<Version>,
        ) -> Result<Version, Option<Version>> {
            let mut rows = self.0.lock().unwrap();
            let current = rows.get(client_id).cloned();
            let holds = match (&current, base) {
                (None, None) => true,
                (Some((value, _)), None) => value.is_none(),
                (Some((_, version)), Some(base)) => *version == base,
                (None, Some(_)) => false,
            };
            if holds {
                let wall_ms = current.as_ref().map_or(0, |(_, v)| v.wall_ms) + 1;
                let version = Version {
                    wall_ms,
                    counter: 0,
                    node: 0,
                };
                rows.insert(client_id.to_owned(), (value, version));
                Ok(version)
            } else {
                Err(current.map(|(_, v)| v))
            }
        }
    }

    impl SessionRows for MemoryRows {
        fn read<'a>(&'a self, client_id: &'a str) -> RowFuture<'a, ReadRow> {
            let rows = self.0.lock().unwrap();
            let row = rows.get(client_id).cloned();
            Box::pin(async move {
                Ok(
                    row.map_or_else(ReadRow::default, |(value, version)| ReadRow {
                        value,
                        version: Some(version),
                    }),
                )
            })
        }

        fn write<'a>(
            &'a self,
            client_id: &'a str,
            value: Option<Vec<u8>>,
            base: Option<Version>,
        ) -> RowFuture<'a, Result<Version, Option<Version>>> {
            let gate = self.2.lock().unwrap().as_mut().map(|held| {
                let (write, gate) = tokio::sync::oneshot::channel();
                held.push(write);
                gate
            });
            Box::pin(async move {
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                Ok(self.compare_and_set(client_id, value, base))
            })
        }

        /// Every row, as the head of one partition holding them all.
        fn here(&self) -> RowFuture<'_, Vec<(String, Vec<u8>, bool)>> {
            let rows = self.0.lock().unwrap();
            let here = rows
                .iter()
                .filter_map(|(id, (value, _))| Some((id.clone(), value.clone()?, true)))
                .collect();
            Box::pin(async move { Ok(here) })
        }

        fn is_up(&self, node: u64) -> bool {
            !self.1.lock().unwrap().contains(&node)
        }

        fn lease_held(&self) -> bool {
            !self.3.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// A node's own session log: what it was given (its retained messages).
    #[derive(Default)]
    struct Local(Mutex<Vec<SessionChange>>);

    impl SessionJournal for Local {
        fn record(&self, changes: Vec<SessionChange>) -> Durable {
            self.0.lock().unwrap().extend(changes);
            Box::pin(async { Ok(()) })
        }
    }

    impl Local {
        /// Waits (at most a second) until the will of `c` was published on this node.
        async fn until_a_will(&self) {
            for _ in 0..100 {
                if self.wills() > 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }

        /// How many times the (retained) will of `c` was published on this node.
        fn wills(&self) -> usize {
            self.0
                .lock()
                .unwrap()
                .iter()
                .filter(|c| matches!(c, SessionChange::RetainedSet { message, .. } if message.topic == "will/c"))
                .count()
        }
    }

    fn node(id: u64, rows: &Arc<MemoryRows>) -> ReplicatedSessions {
        node_with_log(id, rows).0
    }

    /// A node and its own session log.
    fn node_with_log(id: u64, rows: &Arc<MemoryRows>) -> (ReplicatedSessions, Arc<Local>) {
        let local = Arc::new(Local::default());
        let sessions = ReplicatedSessions::new(id, local.clone());
        sessions.attach_rows(rows.clone());
        (sessions, local)
    }

    /// `node` locates client `c` (no session yet) and creates its session, owned there.
    async fn create(node: &ReplicatedSessions, expiry_secs: u32) {
        assert_eq!(
            node.locate("c", false, true, false, CONNECT).await,
            Ok(Located::Gone)
        );
        node.record(vec![SessionChange::Created {
            client_id: "c".into(),
            expiry_secs,
        }])
        .await
        .unwrap();
    }

    /// `node` with a broker of its own that journals into it.
    fn with_broker(node: &ReplicatedSessions) -> Broker {
        let broker = Broker::builder(mqstate_broker::BrokerConfig::default())
            .journal(Arc::new(node.clone()))
            .sessions_elsewhere(Arc::new(node.clone()))
            .build();
        node.attach_broker(broker.clone());
        broker
    }

    fn subscribed(filter: &str) -> SessionChange {
        SessionChange::Subscribed {
            client_id: "c".into(),
            filter: ByteString::from(filter),
            options: SubscriptionOptions {
                qos: QoS::AtLeastOnce,
                no_local: false,
                retain_as_published: false,
                retain_handling: 0,
                subscription_id: None,
            },
        }
    }

    /// The value of `c`'s row (`None`: deleted).
    fn value_of(rows: &MemoryRows) -> Option<Vec<u8>> {
        rows.0.lock().unwrap()["c"].0.clone()
    }

    fn row_of(rows: &MemoryRows) -> SessionRow {
        let value = value_of(rows).expect("a row");
        row::decode("c", &value).unwrap()
    }

    #[tokio::test]
    async fn a_session_taken_over_is_fenced_on_its_old_node() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));

        assert_eq!(
            a.locate("c", false, true, false, CONNECT).await,
            Ok(Located::Gone)
        );
        let created = SessionChange::Created {
            client_id: "c".into(),
            expiry_secs: 60,
        };
        a.record(vec![created.clone(), subscribed("a/#")])
            .await
            .unwrap();
        let row = row_of(&rows);
        assert_eq!((row.owner, row.subscriptions_len()), (1, 1));
        // Node 1 asked again while it owns the row: its own copy is the session.
        assert_eq!(
            a.locate("c", false, true, true, CONNECT).await,
            Ok(Located::Here)
        );

        let Ok(Located::Taken(session)) = b.locate("c", false, true, false, CONNECT).await else {
            panic!("node 2 takes the session over");
        };
        assert!(session.subscriptions.contains_key("a/#"));
        let taken = row_of(&rows);
        assert_eq!(taken.owner, 2);
        assert!(taken.epoch > row.epoch);
        b.record(row::image_of(&"c".into(), &session))
            .await
            .unwrap();

        // Node 1 still thinks it owns it: its write is refused and nothing it says lands.
        let refused = a.record(vec![subscribed("stale/#")]).await;
        assert!(refused.is_err(), "a fenced write is not durable");
        assert!(a.record(vec![subscribed("later/#")]).await.is_err());
        b.record(vec![subscribed("b/#")]).await.unwrap();
        let now = row_of(&rows);
        assert_eq!(now.owner, 2);
        let filters: Vec<&str> = now.session.subscriptions.keys().map(|f| &**f).collect();
        assert_eq!(filters, ["a/#", "b/#"]);
    }

    #[tokio::test]
    async fn a_clean_start_deletes_the_row() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        create(&a, 60).await;
        assert_eq!(
            b.locate("c", true, true, false, CONNECT).await,
            Ok(Located::Gone)
        );
        assert_eq!(value_of(&rows), None, "deleted");
        assert_eq!(
            a.locate("c", false, true, true, CONNECT).await,
            Ok(Located::Gone)
        );
    }

    /// A client id and the keys handed back for it, with their cursors.
    type Handed = (Arc<str>, Vec<(Vec<u8>, Option<String>)>);

    /// The state store of a test: a key newly observed starts at "p0"; a notification is a
    /// message on `n/<key>` whose payload is its version.
    #[derive(Default)]
    struct Restored(Mutex<Vec<Handed>>);

    impl Observers for Restored {
        fn restore(
            &self,
            client_id: Arc<str>,
            keys: Vec<(Vec<u8>, Option<String>)>,
        ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
            self.0.lock().unwrap().push((client_id, keys));
            Box::pin(async {})
        }

        fn position(&self, _: &[u8]) -> Option<String> {
            Some("p0".into())
        }

        fn notified(&self, message: &Message) -> Option<(Vec<u8>, String)> {
            let key = message.topic.strip_prefix("n/")?;
            let version = std::str::from_utf8(&message.payload).ok()?;
            Some((key.as_bytes().to_vec(), version.to_owned()))
        }
    }

    fn notification(seq: u64, key: &str, version: &str) -> SessionChange {
        SessionChange::Appended {
            client_id: "c".into(),
            seq,
            message: mqstate_broker::persist::StoredMessage {
                message: Arc::new(Message {
                    topic: format!("n/{key}").into(),
                    payload: bytes::Bytes::from(version.to_owned()),
                    qos: mqstate_broker::QoS::AtLeastOnce,
                    retain: false,
                    properties: Default::default(),
                }),
                qos: mqstate_broker::QoS::AtLeastOnce,
                retain: false,
                subscription_ids: Vec::new(),
                received_at_ms: 1,
            },
        }
    }

    fn with_cursors(keys: &[Vec<u8>], cursors: &[Option<&str>]) -> Vec<(Vec<u8>, Option<String>)> {
        keys.iter()
            .cloned()
            .zip(cursors.iter().map(|c| c.map(str::to_owned)))
            .collect()
    }

    #[tokio::test]
    async fn a_cursor_follows_the_notifications_queued_and_moves_with_the_session() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let (on_a, on_b) = (Arc::new(Restored::default()), Arc::new(Restored::default()));
        a.attach_observers(on_a.clone());
        b.attach_observers(on_b.clone());
        create(&a, 60).await;
        a.keep_observed("c", vec![b"k1".to_vec()]).await.unwrap();
        let cursor = |key: &[u8]| row_of(&rows).cursors.get(key).cloned();
        assert_eq!(cursor(b"k1"), Some("p0".into()), "where this node stood");
        a.record(vec![
            notification(0, "k1", "v1"),
            notification(1, "k1", "v2"),
        ])
        .await
        .unwrap();
        assert_eq!(
            cursor(b"k1"),
            Some("v2".into()),
            "written with the messages"
        );
        // A message that is no notification, or of a key not observed, moves nothing.
        a.record(vec![subscribed("x/#"), notification(2, "other", "v9")])
            .await
            .unwrap();
        let keys = vec![b"k1".to_vec(), b"k2".to_vec()];
        a.keep_observed("c", keys.clone()).await.unwrap();
        assert_eq!(
            cursor(b"k1"),
            Some("v2".into()),
            "a key observed before keeps its own"
        );
        assert_eq!(cursor(b"k2"), Some("p0".into()));
        assert!(cursor(b"other").is_none());

        let Ok(Located::Taken(_)) = b.locate("c", false, true, false, CONNECT).await else {
            panic!("node 2 takes the session over");
        };
        assert_eq!(
            *on_b.0.lock().unwrap(),
            [("c".into(), with_cursors(&keys, &[Some("v2"), Some("p0")]))]
        );
    }

    #[tokio::test]
    async fn observed_keys_move_with_the_session() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let restored = Arc::new(Restored::default());
        b.attach_observers(restored.clone());
        // Not a session of this node (a clean one): nothing to keep.
        a.keep_observed("c", vec![b"k".to_vec()]).await.unwrap();
        create(&a, 60).await;
        assert!(row_of(&rows).observed.is_empty());
        let keys = vec![b"k1".to_vec(), b"k2".to_vec()];
        a.keep_observed("c", keys.clone()).await.unwrap();
        assert_eq!(row_of(&rows).observed, keys, "written with the session");

        let Ok(Located::Taken(session)) = b.locate("c", false, true, false, CONNECT).await else {
            panic!("node 2 takes the session over");
        };
        assert_eq!(
            *restored.0.lock().unwrap(),
            [("c".into(), with_cursors(&keys, &[None, None]))],
            "node 1 had no state store to say where its keys stood"
        );
        b.record(row::image_of(&"c".into(), &session))
            .await
            .unwrap();
        b.record(vec![subscribed("b/#")]).await.unwrap();
        assert_eq!(
            row_of(&rows).observed,
            keys,
            "kept by the new owner's writes"
        );
        // The old owner is fenced.
        assert!(a.keep_observed("c", Vec::new()).await.is_err());
        assert_eq!(row_of(&rows).observed, keys);
    }

    #[tokio::test]
    async fn a_session_of_a_dead_node_is_adopted_by_the_head() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let broker = with_broker(&b);
        let restored = Arc::new(Restored::default());
        b.attach_observers(restored.clone());
        create(&a, 60).await;
        a.record(vec![subscribed("a/#")]).await.unwrap();
        a.keep_observed("c", vec![b"k".to_vec()]).await.unwrap();
        let epoch = row_of(&rows).epoch;

        assert!(b.adopt_orphans().await.is_empty(), "node 1 is up");
        rows.1.lock().unwrap().push(1);
        assert_eq!(b.adopt_orphans().await, [Arc::<str>::from("c")]);
        let row = row_of(&rows);
        assert_eq!((row.owner, row.epoch), (2, epoch + 1));
        assert_eq!(broker.session_count(), 1, "the broker holds it");
        // Connected when its node died: detached since the adoption, so it expires from now.
        assert!(row.session.detached_at_ms.is_some());
        assert!(row.session.subscriptions.contains_key("a/#"));
        // Its client's KEYNOTIFY registrations are in force on the adopter.
        assert_eq!(
            *restored.0.lock().unwrap(),
            [("c".into(), with_cursors(&[b"k".to_vec()], &[None]))]
        );
        assert!(b.adopt_orphans().await.is_empty(), "adopted once");
        // The old owner is fenced.
        assert!(a.record(vec![subscribed("stale/#")]).await.is_err());
    }

    /// Seed 400378 of the robustness suite: a node cut off from the control plane kept serving
    /// its client's session while the head adopted it. While its lease has lapsed a node adopts
    /// nothing and takes no session (its clients are sent away: `service_port`'s test of
    /// `Broker::send_away`); its copies stay, and go on once the lease holds again.
    #[tokio::test]
    async fn a_node_whose_lease_lapsed_takes_and_adopts_no_session() {
        use std::sync::atomic::Ordering;
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let _broker = with_broker(&a);
        create(&b, 60).await;
        rows.1.lock().unwrap().push(2);

        rows.3.store(true, Ordering::Relaxed);
        assert!(
            a.adopt_orphans().await.is_empty(),
            "nothing adopted without a lease"
        );
        assert!(
            a.locate("c", false, true, false, CONNECT).await.is_err(),
            "no session taken without a lease"
        );
        assert_eq!(row_of(&rows).owner, 2, "the row stays where it was");
        assert!(
            b.record(vec![subscribed("b/#")]).await.is_ok(),
            "the owner's copy goes on"
        );

        rows.3.store(false, Ordering::Relaxed);
        assert_eq!(a.adopt_orphans().await, [Arc::<str>::from("c")]);
        assert_eq!(row_of(&rows).owner, 1);
    }

    /// A delayed will that came due on its owner is published once its cancellation landed
    /// (the broker's `publish_once_landed`). A clean start of the client on the owner itself
    /// whose delete of the row wins over that write leaves the will this node's: nobody else
    /// holds it (the clean start settles only other nodes' wills). Before, `landed` answered
    /// "taken over", and the will was lost.
    #[tokio::test]
    async fn a_clean_start_here_that_wins_the_row_leaves_a_due_will_to_this_node() {
        let rows = Arc::new(MemoryRows::default());
        let a = node(1, &rows);
        create(&a, 60).await;
        let ended = due_will_raced_by_a_clean_start_here(&a, &rows).await;
        assert!(ended, "the due will is still this node's");
    }

    /// As above, but another node adopted the session meanwhile (this node, cut off, never
    /// heard): a clean start here takes the row from the adopter, whose copy had the will, so
    /// the will this node took out is not its own any more.
    #[tokio::test]
    async fn a_clean_start_here_after_an_adoption_elsewhere_does_not_make_the_will_this_nodes() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let _broker = with_broker(&b);
        create(&a, 60).await;
        rows.1.lock().unwrap().push(1);
        assert_eq!(b.adopt_orphans().await, [Arc::<str>::from("c")]);
        rows.1.lock().unwrap().clear();
        let ended = due_will_raced_by_a_clean_start_here(&a, &rows).await;
        assert!(!ended, "the adopter held the will");
    }

    /// Node `a`'s delayed will of `c` came due (its `WillCancelled` recorded, its write held) and
    /// a clean start of `c` on `a` wins the row over that write. Returns what `landed` answered.
    async fn due_will_raced_by_a_clean_start_here(
        a: &ReplicatedSessions,
        rows: &MemoryRows,
    ) -> bool {
        rows.hold();
        let cancelled = a.record(vec![SessionChange::WillCancelled {
            client_id: "c".into(),
        }]);
        let ended = tokio::spawn(a.landed("c"));
        let clean_start = {
            let a = a.clone();
            tokio::spawn(async move { a.locate("c", true, true, true, CONNECT).await })
        };
        while rows.held() < 2 {
            tokio::task::yield_now().await;
        }
        rows.land_newest();
        assert_eq!(clean_start.await.unwrap(), Ok(Located::Gone));
        rows.stop_holding();
        assert!(
            cancelled.await.is_err(),
            "the cancellation's write lost the row"
        );
        ended.await.unwrap()
    }

    /// A state store whose first `restore` is held until the test opens it.
    struct Gated(
        Mutex<
            Option<(
                tokio::sync::oneshot::Sender<()>,
                tokio::sync::oneshot::Receiver<()>,
            )>,
        >,
    );

    impl Observers for Gated {
        fn restore(
            &self,
            _: Arc<str>,
            _: Vec<(Vec<u8>, Option<String>)>,
        ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
            let gate = self.0.lock().unwrap().take();
            Box::pin(async move {
                if let Some((entered, open)) = gate {
                    let _ = entered.send(());
                    let _ = open.await;
                }
            })
        }

        fn position(&self, _: &[u8]) -> Option<String> {
            None
        }

        fn notified(&self, _: &Message) -> Option<(Vec<u8>, String)> {
            None
        }
    }

    /// Seed 946 of the robustness suite: a node restarted at once and its persistent client
    /// reconnected to it while it adopted the client's row; the adopter, resumed after the
    /// client's CONNECT had taken the session from it, dropped the copy the CONNECT had just put
    /// in the broker (the client then got a new, empty session).
    #[tokio::test]
    async fn an_adoption_overtaken_by_its_clients_connect_leaves_the_clients_copy() {
        let rows = Arc::new(MemoryRows::default());
        let a = node(1, &rows);
        create(&a, 60).await;
        a.keep_observed("c", vec![b"k".to_vec()]).await.unwrap();
        // Node 1 runs again; its adopter takes the row over and waits in the restore of the
        // client's observed keys.
        let again = node(1, &rows);
        let broker = with_broker(&again);
        let (entered_tx, entered) = tokio::sync::oneshot::channel();
        let (open, open_rx) = tokio::sync::oneshot::channel();
        again.attach_observers(Arc::new(Gated(Mutex::new(Some((entered_tx, open_rx))))));
        let mut events = broker.events();
        let adopter = {
            let again = again.clone();
            tokio::spawn(async move { again.adopt_orphans().await })
        };
        entered.await.unwrap();
        let adopted_epoch = row_of(&rows).epoch;
        // Meanwhile the client's CONNECT takes the session here and puts it in the broker, as
        // `locate_elsewhere` does.
        let Ok(Located::Taken(session)) = again.locate("c", false, true, false, CONNECT).await
        else {
            panic!("the CONNECT takes the session over");
        };
        assert_eq!(row_of(&rows).epoch, adopted_epoch + 1);
        let adoption = broker.adopt_session("c".into(), *session).unwrap();
        if let Some(durable) = adoption.durable {
            durable.await.unwrap();
        }
        open.send(()).unwrap();
        assert!(
            adopter.await.unwrap().is_empty(),
            "the client took it first"
        );
        while let Ok(event) = events.try_recv() {
            assert!(
                !matches!(event, mqstate_broker::ClientEvent::SessionEnded { .. }),
                "the client's copy was dropped: {event:?}"
            );
        }
        assert_eq!(broker.session_count(), 1);
        assert_eq!(
            row_of(&rows).epoch,
            adopted_epoch + 1,
            "the CONNECT's claim stands"
        );
    }

    /// Issue 16, robustness seed 500764's mechanism: node 1 lost `c` to node 2 (its claim is
    /// fenced) and, before the drop of its copy came, a CONNECT of the client on node 1 took the
    /// session back and put the row's session in the broker. The drop names the copy of the
    /// claim that was lost, so the copy taken back stays. Before, the drop took whatever copy the
    /// broker held (this test failed with `forget_session` ignoring the copy named: the session
    /// taken back was gone, and the CONNECT would have got a fresh one or 0x89).
    #[tokio::test]
    async fn a_lost_claims_late_drop_leaves_the_copy_a_connect_here_took_back() {
        let rows = Arc::new(MemoryRows::default());
        create(&node(1, &rows), 60).await;
        // Node 1 runs again and adopts the row of its earlier run: the claim knows its copy.
        let a = node(1, &rows);
        let broker = with_broker(&a);
        assert_eq!(a.adopt_orphans().await.len(), 1);
        let (lost_epoch, adopted) = {
            let state = a.shared.lock();
            (state.entries["c"].epoch, state.entries["c"].copy)
        };
        let adopted = adopted.expect("the adoption's copy is the claim's");

        let b = node(2, &rows);
        let Ok(Located::Taken(session)) = b.locate("c", false, true, false, CONNECT).await else {
            panic!("node 2 takes the session over");
        };
        b.record(row::image_of(&"c".into(), &session))
            .await
            .unwrap();
        // Node 1's write was refused: its claim is fenced, the drop of its copy is on its way...
        let id: Arc<str> = "c".into();
        let lost = fence(&a.shared, &id, lost_epoch).expect("the claim held");
        assert_eq!(lost, Some(adopted));
        // ...when the client's CONNECT here takes the session back and puts it in the broker,
        // as `locate_elsewhere` does (the copy it finds there is stale: dropped).
        let Ok(Located::Taken(session)) = a.locate("c", false, true, true, CONNECT).await else {
            panic!("the CONNECT takes the session back");
        };
        assert!(broker.forget_session("c", adopted));
        let taken_back = broker.adopt_session(id.clone(), *session).unwrap();
        if let Some(durable) = taken_back.durable {
            durable.await.unwrap();
        }
        let mut events = broker.events();
        drop_lost(&a.shared, &id, lost);
        assert_eq!(broker.session_count(), 1, "the copy taken back stays");
        assert!(
            events.try_recv().is_err(),
            "no session ended after it was taken back"
        );
        assert_eq!(row_of(&rows).owner, 1);
    }

    /// A session's expiry is judged on the node's clock, which stamped its detach: a node whose
    /// clock runs 120 s ahead of the system's finds a session that expires after 60 s ended, its
    /// row deleted, not resumed. Before, the system's clock judged it: not ended.
    #[tokio::test]
    async fn a_sessions_expiry_is_judged_on_the_nodes_clock() {
        let rows = Arc::new(MemoryRows::default());
        let a = node(1, &rows);
        create(&a, 60).await;
        a.record(vec![SessionChange::Detached {
            client_id: "c".into(),
            expiry_secs: 60,
            at_ms: system_now_ms(),
        }])
        .await
        .unwrap();
        let b = node(2, &rows);
        let ahead: mqstate_broker::SharedClock = Arc::new(mqstate_clock::OffsetClock::new(
            mqstate_clock::system(),
            120_000,
        ));
        let broker = Broker::builder(mqstate_broker::BrokerConfig::default())
            .clock(ahead)
            .journal(Arc::new(b.clone()))
            .sessions_elsewhere(Arc::new(b.clone()))
            .build();
        b.attach_broker(broker);
        assert_eq!(
            b.locate("c", false, true, false, CONNECT).await,
            Ok(Located::Gone),
            "ended by the node's clock"
        );
        assert_eq!(value_of(&rows), None, "its row deleted");
    }

    #[tokio::test]
    async fn a_restarted_node_adopts_its_own_rows_and_an_expired_one_is_deleted() {
        let rows = Arc::new(MemoryRows::default());
        let a = node(1, &rows);
        create(&a, 60).await;
        // Node 1 runs again (up all along): nothing of this run holds the session.
        let again = node(1, &rows);
        let broker = with_broker(&again);
        assert_eq!(again.adopt_orphans().await.len(), 1);
        assert_eq!(broker.session_count(), 1);
        assert_eq!(row_of(&rows).owner, 1);

        // A session whose expiry passed while nobody held it: adopted, expired, its row deleted.
        let b = node(2, &rows);
        let broker = with_broker(&b);
        rows.1.lock().unwrap().push(1);
        let expired = node(1, &rows);
        assert_eq!(
            expired.locate("c", true, true, false, CONNECT).await,
            Ok(Located::Gone)
        );
        expired
            .record(vec![
                SessionChange::Created {
                    client_id: "c".into(),
                    expiry_secs: 1,
                },
                SessionChange::Detached {
                    client_id: "c".into(),
                    expiry_secs: 1,
                    at_ms: 1,
                },
            ])
            .await
            .unwrap();
        assert_eq!(b.adopt_orphans().await.len(), 1);
        assert_eq!(broker.session_count(), 0);
        assert_eq!(value_of(&rows), None, "deleted");
    }

    #[tokio::test]
    async fn the_will_row_of_a_clean_session_on_a_dead_node_is_settled_once() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let broker = with_broker(&b);
        connected_with_will(&a, 0, 30).await;
        let row = row_of(&rows);
        assert_eq!(row.session.expiry_secs, 0);
        assert!(row.session.connected_will.is_some(), "the will is kept");
        assert_eq!(
            row.session.will_at_end().map(|w| w.delay_secs),
            Some(30),
            "a clean session ends with its connection: its will is due then"
        );

        assert!(b.adopt_orphans().await.is_empty(), "node 1 is up");
        rows.1.lock().unwrap().push(1);
        assert_eq!(b.adopt_orphans().await, [Arc::<str>::from("c")]);
        assert_eq!(value_of(&rows), None, "settled: deleted");
        assert_eq!(broker.session_count(), 0, "nothing to resume");
        assert!(b.adopt_orphans().await.is_empty(), "settled once");
        // The old owner is fenced. (A delete of its would find the row gone and count as done:
        // the session ended either way.)
        assert!(a
            .record(vec![SessionChange::WillCancelled {
                client_id: "c".into()
            }])
            .await
            .is_err());
        assert_eq!(value_of(&rows), None, "still deleted");
    }

    #[tokio::test]
    async fn a_clean_start_settles_the_will_row_of_a_dead_node_and_not_of_a_live_one() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let _broker = with_broker(&b);
        connected_with_will(&a, 0, 30).await;
        // Node 1 is up: its connection was taken over by the claim and publishes the will, and
        // deletes the row; a clean start without a will of its own leaves the row to it.
        assert!(!held_by_nobody(&b.shared, &*rows, "c", &row_of(&rows)));
        assert_eq!(
            b.locate("c", true, false, false, CONNECT).await,
            Ok(Located::Here)
        );
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(value_of(&rows).is_some(), "left to node 1");
        rows.1.lock().unwrap().push(1);
        assert!(held_by_nobody(&b.shared, &*rows, "c", &row_of(&rows)));
        // The client is back on node 2 (no will of its own) before node 1's rows were settled.
        assert_eq!(
            b.locate("c", true, false, false, CONNECT).await,
            Ok(Located::Here)
        );
        for _ in 0..100 {
            if value_of(&rows).is_none() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(value_of(&rows), None, "deleted by the clean start");
        assert!(b.adopt_orphans().await.is_empty(), "nothing left to settle");
    }

    #[tokio::test]
    async fn a_clean_sessions_will_row_is_never_resumed() {
        let rows = Arc::new(MemoryRows::default());
        let (a, b) = (node(1, &rows), node(2, &rows));
        let broker = with_broker(&b);
        connected_with_will(&a, 0, 30).await;
        // Node 1 is up (its connection ended by the claim publishes the will there): Clean
        // Start 0 elsewhere finds the session ended, not a session to resume.
        assert_eq!(
            b.locate("c", false, false, false, CONNECT).await,
            Ok(Located::Gone)
        );
        assert_eq!(value_of(&rows), None, "deleted");
        assert_eq!(broker.session_count(), 0);
    }

    /// `node` locates client `c` (no session yet) and creates its session (`expiry_secs`; 0 is a
    /// clean session, located with Clean Start = 1), connected, with a retained will on `will/c`
    /// after `delay_secs`: all of it kept in its row.
    async fn connected_with_will(node: &ReplicatedSessions, expiry_secs: u32, delay_secs: u32) {
        let clean_start = expiry_secs == 0;
        assert_eq!(
            node.locate("c", clean_start, true, false, CONNECT).await,
            Ok(Located::Gone)
        );
        let will = mqstate_broker::will::Will {
            message: mqstate_broker::Message {
                topic: ByteString::from("will/c"),
                payload: bytes::Bytes::from_static(b"gone"),
                qos: QoS::AtLeastOnce,
                retain: true,
                properties: Default::default(),
            },
            delay_secs,
        };
        node.record(vec![
            SessionChange::Created {
                client_id: "c".into(),
                expiry_secs,
            },
            SessionChange::WillSet {
                client_id: "c".into(),
                will,
            },
        ])
        .await
        .unwrap();
    }

    /// Issue 16: a clean start on node 2 ends the session whose delayed will node 1 (up) holds,
    /// pending or due when the claim ends its connection: node 1 dropped it with its copy at the
    /// claim, so node 2 publishes it, once. A resume takes the session over and cancels the will
    /// (as on one node); a delay-0 will is the connection's to publish. Before, the clean start
    /// deleted the row and the will was lost.
    #[tokio::test]
    async fn a_clean_start_publishes_the_delayed_will_a_running_node_dropped() {
        for (delay_secs, detached, clean_start, published) in [
            (30, true, true, 1),
            (30, false, true, 1),
            (30, true, false, 0),
            (0, false, true, 0),
        ] {
            let rows = Arc::new(MemoryRows::default());
            let a = node(1, &rows);
            connected_with_will(&a, 60, delay_secs).await;
            if detached {
                let will = row_of(&rows).session.connected_will.unwrap();
                a.record(vec![
                    SessionChange::Detached {
                        client_id: "c".into(),
                        expiry_secs: 60,
                        at_ms: system_now_ms(),
                    },
                    SessionChange::WillScheduled {
                        client_id: "c".into(),
                        will,
                        at_ms: system_now_ms() + 30_000,
                    },
                ])
                .await
                .unwrap();
            }
            let (b, log) = node_with_log(2, &rows);
            let _broker = with_broker(&b);
            let located = b
                .locate("c", clean_start, true, false, CONNECT)
                .await
                .unwrap();
            assert_eq!(
                matches!(located, Located::Gone),
                clean_start,
                "delay {delay_secs}, detached {detached}, clean start {clean_start}"
            );
            assert_eq!(
                log.wills(),
                published,
                "delay {delay_secs}, detached {detached}, clean start {clean_start}"
            );
        }
    }

    /// Node 1 dies with client `c` connected (expiry 1 s, its will due at the expiry); node 2
    /// adopts the session and holds the rows' writes from then on. Returns node 2 with its
    /// broker and log once the session expired there (its end held on the way to the row).
    async fn expiring_on_its_adopter(
        rows: &Arc<MemoryRows>,
    ) -> (ReplicatedSessions, Broker, Arc<Local>) {
        connected_with_will(&node(1, rows), 1, 3600).await;
        rows.1.lock().unwrap().push(1);
        let (b, log) = node_with_log(2, rows);
        let broker = with_broker(&b);
        assert_eq!(b.adopt_orphans().await, [Arc::<str>::from("c")]);
        rows.hold();
        while broker.session_count() > 0 || rows.held() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (b, broker, log)
    }

    /// Lets the rows' writes land newest first (a later write overtakes an earlier one) until
    /// `task` is done.
    async fn land_newest_first<T>(rows: &MemoryRows, task: tokio::task::JoinHandle<T>) -> T {
        // What the task writes is queued before anything lands.
        tokio::time::sleep(Duration::from_millis(50)).await;
        while !task.is_finished() {
            rows.land_newest();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        task.await.unwrap()
    }

    /// Issue 16 (decision 0070): a client reconnecting to its session's adopter just as the
    /// session expires there finds it ended (Session Present = 0), its will published once and
    /// only after the row's delete landed, and its new session is the adopter's to write. Before,
    /// the will went out before the delete landed, the CONNECT's own delete of the row overtook
    /// the expiry's, and the expiry's refused delete then took the CONNECT's new claim for a
    /// take-over by another node: its new session was refused ("moved to another node"; CONNACK
    /// 0x80 in `tests/cluster_orphans.rs`).
    #[tokio::test]
    async fn a_connect_on_the_adopter_as_the_session_expires_there_finds_it_ended() {
        let rows = Arc::new(MemoryRows::default());
        let (b, _broker, log) = expiring_on_its_adopter(&rows).await;
        assert_eq!(log.wills(), 0, "no will before the session's end landed");

        let connect = tokio::spawn({
            let b = b.clone();
            async move { b.locate("c", false, true, false, CONNECT).await }
        });
        assert_eq!(land_newest_first(&rows, connect).await, Ok(Located::Gone));
        rows.stop_holding();
        log.until_a_will().await;
        assert_eq!(log.wills(), 1, "the will of the expired session, once");
        b.record(vec![SessionChange::Created {
            client_id: "c".into(),
            expiry_secs: 60,
        }])
        .await
        .expect("the new session is written");
        let row = row_of(&rows);
        assert_eq!((row.owner, row.session.expiry_secs), (2, 60));
    }

    /// The same with the client reconnecting to another node, whose delete of the ended row lands
    /// first: the adopter (up, so the other node leaves the will to it) publishes the will once
    /// its own delete finds the row gone. Before, its will went out before anything landed.
    #[tokio::test]
    async fn a_connect_elsewhere_as_the_session_expires_on_its_adopter_leaves_the_will_to_it() {
        let rows = Arc::new(MemoryRows::default());
        let (_b, _broker, log) = expiring_on_its_adopter(&rows).await;
        assert_eq!(log.wills(), 0, "no will before the session's end landed");
        let (c, c_log) = node_with_log(3, &rows);
        let _c_broker = with_broker(&c);
        let connect = tokio::spawn(async move { c.locate("c", false, true, false, CONNECT).await });
        assert_eq!(land_newest_first(&rows, connect).await, Ok(Located::Gone));
        rows.stop_holding();
        log.until_a_will().await;
        assert_eq!(
            (log.wills(), c_log.wills()),
            (1, 0),
            "published once, by the adopter"
        );
        assert_eq!(value_of(&rows), None);
    }

    impl SessionRow {
        fn subscriptions_len(&self) -> usize {
            self.session.subscriptions.len()
        }
    }
}
