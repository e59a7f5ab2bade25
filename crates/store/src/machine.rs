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

use crate::codec::MAX_BUFFER_BYTES;
use crate::delta::Delta;
use crate::error::StoreError;
use crate::keyspace::{entry_bytes, Keyspace, NewEntry};
use crate::limits::Limits;
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
    /// Notifications caused by the change, in publishing order (before the reply).
    pub notifications: Vec<KeyNotification>,
}

impl Execution {
    fn reply(reply: Reply) -> Execution {
        Execution {
            reply,
            ts: None,
            delta: None,
            notifications: Vec::new(),
        }
    }
}

/// The deletion of one expired key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiration {
    /// A [`Delta::Delete`] (already applied in memory).
    pub delta: Delta,
    pub notifications: Vec<KeyNotification>,
}

/// The deterministic state-store core. See the module documentation for the durability contract.
#[derive(Debug, Clone)]
pub struct StateMachine {
    pub(crate) keyspace: Keyspace,
    pub(crate) clock: HybridClock,
    registrations: Registrations,
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
        let current = self.keyspace.get_live(&key, ctx.now_ms);
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
        let delta = Delta::Put {
            key: key.clone(),
            value: value.clone(),
            version: version.clone(),
            fencing_token,
            expires_at_ms: expiry_ms.map(|ms| ctx.now_ms.saturating_add(ms).min(MAX_WALL_MS)),
        };
        Ok(self.commit(delta, NotifyPayload::Set(value), Reply::Ok, Some(version)))
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
        let delta = Delta::Delete { key, version };
        Ok(self.commit(delta, NotifyPayload::Delete, Reply::Integer(1), None))
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

    /// Applies `delta` and collects the notifications for the key's observers.
    fn commit(
        &mut self,
        delta: Delta,
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
            let version = self.clock.now(now_ms);
            let delta = Delta::Delete { key, version };
            let notifications = self.notifications(&delta, NotifyPayload::Delete);
            self.apply_delta(&delta);
            expired.push(Expiration {
                delta,
                notifications,
            });
        }
        expired
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
