//! The state machine: executes commands against the keyspace with the server's HLC, fencing, quotas
//! and KEYNOTIFY registrations, and describes every effect as values (reply, `__ts`, delta,
//! notifications) for the caller to persist and publish.
//!
//! Every change goes through [`StateMachine::apply_delta`] — the same function recovery and
//! replication call — so executing commands and replaying their deltas cannot disagree.
//!
//! `execute` applies its delta to memory at once. The caller must make the delta durable before it
//! releases the reply or the notifications, and must hold back later replies (reads included) until
//! earlier deltas are durable; if persisting fails, this state machine is ahead of the disk and must
//! be discarded and rebuilt from the log.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::hlc::MAX_WALL_MS;
use mqstate_protocol::{
    Command, ErrorKind, Glob, Hlc, HybridClock, NotifyPayload, Reply, SetCondition,
};

use crate::change::Change;
use crate::codec::MAX_BUFFER_BYTES;
use crate::delta::Delta;
use crate::error::StoreError;
use crate::keyspace::{entry_bytes, Entry, Keyspace, NewEntry};
use crate::limits::Limits;
use crate::notify::{
    lock_key, Event, Notifications, QueueDelta, QueueUndo, RemoveError, NO_RESERVATION,
};
use crate::registrations::Registrations;

/// Fixed configuration of a state machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// The one stable HLC node id of the service (spec §4); must not contain `:`.
    pub node_id: Arc<str>,
    pub limits: Limits,
}

/// What a request carries besides its command. `__ts`/`__ft` arrive already parsed: text that does
/// not parse is answered `malformed timestamp` by the caller (see `Hlc::parse`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestContext {
    /// MQTT client id of the requester (KEYNOTIFY registrations belong to it).
    pub client_id: Arc<str>,
    /// The request's `__ts`.
    pub ts: Option<Hlc>,
    /// The request's `__ft`.
    pub fencing_token: Option<Hlc>,
    /// The server's wall clock, Unix milliseconds.
    pub now_ms: u64,
}

/// A notification to publish to one registered client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyNotification {
    pub client_id: Arc<str>,
    pub key: Bytes,
    pub payload: NotifyPayload,
    /// The `__ts` user property: the version of the change.
    pub version: Hlc,
}

/// The outcome of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execution {
    pub reply: Reply,
    /// The response `__ts` (spec §3): SET → new version or current HLC; GET hit → key version.
    pub ts: Option<Hlc>,
    /// The change to make durable (already applied in memory); `None` for reads and no-ops.
    pub delta: Option<Delta>,
    /// The change that puts the key back as it was before `delta` (the stored entry, expired or
    /// not, or its absence): what the caller applies if `delta` does not become durable. `Some`
    /// exactly when `delta` is.
    pub undo: Option<Delta>,
    /// Notifications caused by the change, in publishing order (before the reply).
    pub notifications: Vec<KeyNotification>,
}

impl Execution {
    fn reply(reply: Reply) -> Execution {
        Execution {
            reply,
            ts: None,
            delta: None,
            undo: None,
            notifications: Vec::new(),
        }
    }

    /// An execution with no effect but its reply.
    pub fn error(kind: ErrorKind) -> Execution {
        Execution::reply(Reply::Error(kind))
    }
}

/// The deletion of one expired key.
#[derive(Debug)]
pub struct Expiration {
    /// A [`Delta::Delete`] (already applied in memory).
    pub delta: Delta,
    /// The change that puts the key back as it was before `delta` (the expired entry): what the
    /// caller applies if `delta` does not become durable, as [`Execution::undo`].
    pub undo: Delta,
    pub notifications: Vec<KeyNotification>,
    /// When topics watch expiries: the record to log instead of `delta` (it contains it), and what
    /// takes its queue entries back (applied before `undo`: newest first).
    pub commit: Option<(QueueDelta, QueueUndo)>,
    /// Topics whose queue was full, so the expiry could not be queued there.
    pub dropped: Vec<String>,
}

/// The deterministic state-store core. See the module documentation for the durability contract.
#[derive(Debug, Clone)]
pub struct StateMachine {
    pub(crate) keyspace: Keyspace,
    pub(crate) clock: HybridClock,
    registrations: Registrations,
    pub(crate) notify: Notifications,
    pub(crate) config: StoreConfig,
}

impl StateMachine {
    /// An empty state machine.
    pub fn new(config: StoreConfig) -> Result<StateMachine, StoreError> {
        let clock = HybridClock::new(config.node_id.clone(), config.limits.max_clock_drift_ms)?;
        Ok(StateMachine {
            keyspace: Keyspace::default(),
            clock,
            registrations: Registrations::default(),
            notify: Notifications::default(),
            config,
        })
    }

    /// The keys and their entries.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// The server clock (read-only; it advances through `execute`, `expire_due` and `apply_delta`).
    pub fn clock(&self) -> &HybridClock {
        &self.clock
    }

    /// Executes one command. Errors are replies (`-ERR …`) with no effect.
    pub fn execute(&mut self, command: Command, ctx: &RequestContext) -> Execution {
        self.try_execute(command, ctx)
            .unwrap_or_else(|kind| Execution::reply(Reply::Error(kind)))
    }

    fn try_execute(
        &mut self,
        command: Command,
        ctx: &RequestContext,
    ) -> Result<Execution, ErrorKind> {
        if matches!(command, Command::Set { .. }) && ctx.ts.is_none() {
            return Err(ErrorKind::MissingTimestamp);
        }
        if let Some(ts) = &ctx.ts {
            self.clock
                .check_drift(ts, ctx.now_ms)
                .map_err(|_| ErrorKind::TimestampTooFarInFuture)?;
        }
        if command.is_write() {
            if let Some(token) = &ctx.fencing_token {
                self.clock
                    .check_drift(token, ctx.now_ms)
                    .map_err(|_| ErrorKind::FencingTokenTooFarInFuture)?;
            }
        }
        if let Some(ts) = &ctx.ts {
            self.clock.observe(ts);
        }
        match command {
            Command::Set {
                key,
                value,
                condition,
                expiry_ms,
            } => self.set(key, value, condition, expiry_ms, ctx),
            Command::Get { key } => Ok(match self.keyspace.get_live(&key, ctx.now_ms) {
                Some(entry) => Execution {
                    ts: Some(entry.version()),
                    ..Execution::reply(Reply::Bulk(Bytes::copy_from_slice(entry.value())))
                },
                None => Execution::reply(Reply::Nil),
            }),
            Command::Del { key } => self.delete(key, None, ctx),
            Command::VDel { key, value } => self.delete(key, Some(value), ctx),
            Command::KeyNotify { key } => {
                let max = self.config.limits.max_registrations_per_client;
                if !self.registrations.register(&ctx.client_id, &key, max) {
                    return Err(ErrorKind::QuotaExceeded);
                }
                Ok(Execution::reply(Reply::Ok))
            }
            Command::KeyNotifyStop { key } => Ok(Execution::reply(
                if self.registrations.unregister(&ctx.client_id, &key) {
                    Reply::Ok
                } else {
                    Reply::Integer(0)
                },
            )),
            Command::Scan {
                pattern,
                continuation,
            } => self.scan(&pattern, continuation.as_deref(), ctx.now_ms),
        }
    }

    fn set(
        &mut self,
        key: Bytes,
        value: Bytes,
        condition: SetCondition,
        expiry_ms: Option<u64>,
        ctx: &RequestContext,
    ) -> Result<Execution, ErrorKind> {
        let stored = self.keyspace.get(&key);
        let current = stored.filter(|e| e.is_live(ctx.now_ms));
        let fencing_token = fence(
            current.and_then(|e| e.fencing_token()).as_ref(),
            ctx.fencing_token.as_ref(),
        )?;
        let applies = match (condition, current) {
            (SetCondition::Always, _) | (_, None) => true,
            (SetCondition::NotExists, Some(_)) => false,
            (SetCondition::NotExistsOrEqual, Some(entry)) => entry.value() == value,
        };
        if !applies {
            // "Current server HLC" (spec §3): already merged with the request's `__ts`.
            return Ok(Execution {
                ts: Some(self.clock.high_water()),
                ..Execution::reply(Reply::Integer(-1))
            });
        }
        self.check_quota(&key, &value)?;
        let previous_version = current.map(|e| e.version());
        let version = self.clock.now(ctx.now_ms);
        debug_assert!(ctx.ts.as_ref().is_none_or(|ts| version > *ts));
        debug_assert!(previous_version.is_none_or(|prev| version > prev));
        // The stored entry, expired or not: a rollback puts back exactly what was there.
        let undo = undo_of(&key, stored, &self.clock);
        let delta = Delta::Put {
            key: key.clone(),
            value: value.clone(),
            version: version.clone(),
            fencing_token,
            expires_at_ms: expiry_ms.map(|ms| ctx.now_ms.saturating_add(ms).min(MAX_WALL_MS)),
        };
        Ok(self.commit(
            delta,
            undo,
            NotifyPayload::Set(value),
            Reply::Ok,
            Some(version),
        ))
    }

    /// DEL (`expected` = `None`) and VDEL.
    fn delete(
        &mut self,
        key: Bytes,
        expected: Option<Bytes>,
        ctx: &RequestContext,
    ) -> Result<Execution, ErrorKind> {
        let Some(current) = self.keyspace.get_live(&key, ctx.now_ms) else {
            return Ok(Execution::reply(Reply::Integer(0)));
        };
        fence(current.fencing_token().as_ref(), ctx.fencing_token.as_ref())?;
        if expected.is_some_and(|value| value != current.value()) {
            return Ok(Execution::reply(Reply::Integer(-1)));
        }
        let version = self.clock.now(ctx.now_ms);
        debug_assert!(version > current.version());
        let undo = undo_of(&key, Some(current), &self.clock);
        let delta = Delta::Delete { key, version };
        Ok(self.commit(delta, undo, NotifyPayload::Delete, Reply::Integer(1), None))
    }

    fn check_quota(&self, key: &[u8], value: &[u8]) -> Result<(), ErrorKind> {
        let limits = &self.config.limits;
        let fits = |len: usize, max: u64| len <= MAX_BUFFER_BYTES && (len as u64) <= max;
        let previous = self.keyspace.get(key);
        let new_key = previous.is_none();
        let total = self
            .keyspace
            .stored_bytes()
            .saturating_sub(previous.map_or(0, |e| entry_bytes(key, e.value())))
            .saturating_add(entry_bytes(key, value));
        let ok = fits(key.len(), limits.max_key_bytes)
            && fits(value.len(), limits.max_value_bytes)
            && (!new_key || (self.keyspace.len() as u64) < limits.max_keys)
            && total <= limits.max_total_bytes;
        if ok {
            Ok(())
        } else {
            Err(ErrorKind::QuotaExceeded)
        }
    }

    /// Applies `delta` and collects the notifications for the key's observers; `undo` restores
    /// the key as it was.
    fn commit(
        &mut self,
        delta: Delta,
        undo: Delta,
        payload: NotifyPayload,
        reply: Reply,
        ts: Option<Hlc>,
    ) -> Execution {
        let notifications = self.notifications(&delta, payload);
        self.apply_delta(&delta);
        Execution {
            reply,
            ts,
            delta: Some(delta),
            undo: Some(undo),
            notifications,
        }
    }

    fn notifications(&self, delta: &Delta, payload: NotifyPayload) -> Vec<KeyNotification> {
        self.registrations
            .observers(delta.key())
            .map(|client_id| KeyNotification {
                client_id: client_id.clone(),
                key: delta.key().clone(),
                payload: payload.clone(),
                version: delta.version().clone(),
            })
            .collect()
    }

    fn scan(
        &self,
        pattern: &[u8],
        after: Option<&[u8]>,
        now_ms: u64,
    ) -> Result<Execution, ErrorKind> {
        let limits = &self.config.limits;
        if pattern.len() > limits.scan_pattern_bytes_max {
            return Err(ErrorKind::SyntaxError);
        }
        let glob = Glob::new(pattern).map_err(|e| e.kind())?;
        let mut keys = Vec::new();
        let mut last_visited = None;
        for (visited, entry) in self.keyspace.iter_after(after).enumerate() {
            let key = entry.key();
            if entry.is_live(now_ms) && glob.matches(key) {
                keys.push(Bytes::copy_from_slice(key));
            }
            if keys.len() >= limits.scan_page_keys || visited + 1 >= limits.scan_visit_max {
                last_visited = Some(key);
                break;
            }
        }
        // The cursor is the last key examined: keys deleted behind it cannot come back, and the page
        // is the last one when nothing follows it.
        let continuation = last_visited
            .filter(|last| self.keyspace.iter_after(Some(last)).next().is_some())
            .map(Bytes::copy_from_slice);
        Ok(Execution::reply(Reply::Keys { keys, continuation }))
    }

    /// Registrations of a disconnected client are dropped (spec §6); returns how many.
    pub fn drop_client(&mut self, client_id: &str) -> usize {
        self.registrations.drop_client(client_id)
    }

    /// Whether any client observes `key` (a cluster node asks the partition heads for changes of
    /// the keys observed here).
    pub fn is_observed(&self, key: &[u8]) -> bool {
        self.registrations.observers(key).next().is_some()
    }

    /// The keys `client_id` observes, in key order.
    pub fn registered_keys(&self, client_id: &str) -> Vec<Bytes> {
        self.registrations.keys_of(client_id)
    }

    /// The notifications of a change committed elsewhere (a cluster's partition head) for the
    /// clients observing its key here.
    pub fn notifications_of(&self, delta: &Delta) -> Vec<KeyNotification> {
        let payload = match delta {
            Delta::Put { value, .. } => NotifyPayload::Set(value.clone()),
            Delta::Delete { .. } => NotifyPayload::Delete,
        };
        self.notifications(delta, payload)
    }

    /// How many keys `client_id` observes.
    pub fn registration_count(&self, client_id: &str) -> usize {
        self.registrations.count(client_id)
    }

    /// The earliest expiry deadline; the caller's timer sleeps until then.
    pub fn next_deadline(&self) -> Option<u64> {
        self.keyspace.next_deadline()
    }

    /// Deletes keys whose deadline is at or before `now_ms` — at most `expire_batch_max` per call, so
    /// call again while [`next_deadline`](Self::next_deadline) `<= now_ms`. Each deletion gets a fresh
    /// version and DELETE notifications.
    pub fn expire_due(&mut self, now_ms: u64) -> Vec<Expiration> {
        let mut expired = Vec::new();
        while expired.len() < self.config.limits.expire_batch_max {
            let Some(key) = self
                .keyspace
                .first_expired(now_ms)
                .map(Bytes::copy_from_slice)
            else {
                break;
            };
            let undo = undo_of(&key, self.keyspace.get(&key), &self.clock);
            let version = self.clock.now(now_ms);
            let delta = Delta::Delete { key, version };
            let notifications = self.notifications(&delta, NotifyPayload::Delete);
            self.apply_delta(&delta);
            // An expiry cannot be refused: a full queue misses it (counted by the caller).
            let (room, dropped): (Vec<_>, Vec<_>) = self
                .notify
                .matching(delta.key(), Event::Expire)
                .map(|t| (Arc::clone(t.name()), t.is_full()))
                .partition(|(_, full)| !full);
            let commit = (!room.is_empty()).then(|| {
                let commit = QueueDelta::Commit {
                    change: delta.clone(),
                    event: Event::Expire,
                    commits: room.into_iter().map(|(t, _)| (t, NO_RESERVATION)).collect(),
                };
                let undo = self.notify.apply(&commit);
                (commit, undo)
            });
            expired.push(Expiration {
                delta,
                undo,
                notifications,
                commit,
                dropped: dropped.into_iter().map(|(t, _)| t.to_string()).collect(),
            });
        }
        expired
    }

    /// Topics and their queues.
    pub fn topics(&self) -> &Notifications {
        &self.notify
    }

    /// Reserves a slot in the queue of every topic a change of `key` by `event` notifies, until
    /// `deadline_ms`. `Ok(None)` when no topic matches; `Err(topic)` when a queue is full — then
    /// nothing was reserved.
    pub fn reserve(
        &mut self,
        key: &[u8],
        event: Event,
        deadline_ms: u64,
    ) -> Result<Option<(QueueDelta, QueueUndo)>, String> {
        if self.notify.is_empty() {
            return Ok(None);
        }
        let mut reservations = Vec::new();
        for topic in self.notify.matching(key, event) {
            if topic.is_full() {
                return Err(topic.def.name.clone());
            }
            reservations.push((
                Arc::clone(topic.name()),
                topic.next_reservation_id(),
                deadline_ms,
            ));
        }
        if reservations.is_empty() {
            return Ok(None);
        }
        let delta = QueueDelta::Reserve(reservations);
        let undo = self.notify.apply(&delta);
        Ok(Some((delta, undo)))
    }

    /// Commits the reservations of `reserve` with `change` (already applied by `execute`): the
    /// returned record holds both and is what the caller logs.
    pub fn commit_reserved(
        &mut self,
        change: &Delta,
        event: Event,
        reserve: &QueueDelta,
    ) -> (QueueDelta, QueueUndo) {
        let QueueDelta::Reserve(list) = reserve else {
            debug_assert!(false, "commit_reserved needs a Reserve");
            return (QueueDelta::Abort(Vec::new()), QueueUndo::Nothing);
        };
        let commit = QueueDelta::Commit {
            change: change.clone(),
            event,
            commits: list.iter().map(|(t, id, _)| (t.clone(), *id)).collect(),
        };
        let undo = self.notify.apply(&commit);
        (commit, undo)
    }

    /// Aborts reservations whose deadline passed (a crash between reserve and commit left them).
    pub fn abort_stale_reservations(&mut self, now_ms: u64) -> Option<(QueueDelta, QueueUndo)> {
        let stale = self.notify.stale_reservations(now_ms);
        if stale.is_empty() {
            return None;
        }
        let abort = QueueDelta::Abort(stale);
        let undo = self.notify.apply(&abort);
        Some((abort, undo))
    }

    /// Creates a topic or replaces its definition.
    pub fn define_topic(&mut self, def: crate::notify::TopicDef) -> (QueueDelta, QueueUndo) {
        let delta = QueueDelta::CreateTopic(def);
        let undo = self.notify.apply(&delta);
        (delta, undo)
    }

    /// Deletes a topic and its queue; `None` if there is no such topic.
    pub fn delete_topic(&mut self, name: &str) -> Option<(QueueDelta, QueueUndo)> {
        self.notify.get(name)?;
        let delta = QueueDelta::DeleteTopic(name.to_owned());
        let undo = self.notify.apply(&delta);
        Some((delta, undo))
    }

    /// Removes the entries of `topic` up to `up_to_seq`, for the holder of its lock: the lock key
    /// must be live, hold `holder`, and be at least as new as `token` (the version the holder's
    /// lock SET returned). A deposed owner is refused, so it cannot remove what its successor holds.
    pub fn remove_acknowledged(
        &mut self,
        topic: &str,
        up_to_seq: u64,
        holder: &[u8],
        token: &Hlc,
        now_ms: u64,
    ) -> Result<(QueueDelta, QueueUndo), RemoveError> {
        self.notify.get(topic).ok_or(RemoveError::NoSuchTopic)?;
        let lock = self.keyspace.get_live(&lock_key(topic), now_ms);
        let holds = lock.is_some_and(|l| l.value() == holder && l.version() >= *token);
        if !holds {
            return Err(RemoveError::Fenced);
        }
        let delta = QueueDelta::Remove {
            topic: topic.to_owned(),
            up_to_seq,
        };
        let undo = self.notify.apply(&delta);
        Ok((delta, undo))
    }

    /// Restores what a queue change did (after a failed commit; newest first).
    pub fn undo_queue(&mut self, undo: QueueUndo) {
        self.notify.undo(undo);
    }

    /// Applies a log record as recorded (recovery and replication).
    pub fn apply_change(&mut self, change: &Change) {
        match change {
            Change::Key(delta) => self.apply_delta(delta),
            Change::Requested { change, .. } => self.apply_change(change),
            Change::Queue(delta) => {
                if let QueueDelta::Commit { change, .. } = delta {
                    self.apply_delta(change);
                }
                self.notify.apply(delta);
            }
        }
    }

    /// Raises the clock to `seen` without issuing anything: a restart restores the persisted
    /// high-water mark this way, so no timestamp handed out before it is handed out again.
    pub fn observe_clock(&mut self, seen: &Hlc) {
        self.clock.observe(seen);
    }

    /// Applies a delta exactly as recorded (no conditions, quotas or notifications) and raises the
    /// clock to its version. Replaying a log of deltas on an empty state machine rebuilds the keyspace.
    pub fn apply_delta(&mut self, delta: &Delta) {
        match delta {
            Delta::Put {
                key,
                value,
                version,
                fencing_token,
                expires_at_ms,
            } => {
                self.keyspace.insert(
                    key,
                    NewEntry {
                        value,
                        version,
                        fencing_token: fencing_token.as_ref(),
                        expires_at_ms: *expires_at_ms,
                    },
                );
            }
            Delta::Delete { key, .. } => {
                self.keyspace.remove(key);
            }
        }
        self.clock.observe(delta.version());
    }
}

/// The delta that puts `key` back as `stored` has it. A key that is absent comes back deleted at
/// the clock's high-water mark, which applying it leaves where it is.
fn undo_of(key: &Bytes, stored: Option<Entry<'_>>, clock: &HybridClock) -> Delta {
    match stored {
        Some(entry) => Delta::Put {
            key: key.clone(),
            value: Bytes::copy_from_slice(entry.value()),
            version: entry.version(),
            fencing_token: entry.fencing_token(),
            expires_at_ms: entry.expires_at_ms(),
        },
        None => Delta::Delete {
            key: key.clone(),
            version: clock.high_water(),
        },
    }
}

/// The fencing rule of spec §5: the token to store on success.
fn fence(stored: Option<&Hlc>, request: Option<&Hlc>) -> Result<Option<Hlc>, ErrorKind> {
    match (stored, request) {
        (None, request) => Ok(request.cloned()),
        (Some(_), None) => Err(ErrorKind::FencingTokenRequired),
        (Some(stored), Some(request)) if request < stored => {
            Err(ErrorKind::FencingTokenLowerVersion)
        }
        (Some(stored), Some(request)) => Ok(Some(stored.max(request).clone())),
    }
}

#[cfg(test)]
mod tests;
