//! The running service: two tasks joined by an ordered queue.
//!
//! * The **executor** owns the deterministic [`StateMachine`]. For each request it checks the envelope,
//!   consults the duplicate cache, executes the command, and appends the resulting delta to the WAL —
//!   in execution order, so log order equals apply order. Expiry deadlines and session ends are handled
//!   here too, so the state machine has exactly one writer.
//! * The **completer** takes the executor's outcomes in the same order, waits until each one's log
//!   record is durable, and only then delivers the notifications, publishes the reply and acknowledges
//!   the publish. Reads travel the same queue, so a reply never reveals a write that is not yet durable,
//!   and a notification always precedes the reply of the write that caused it (spec §6). When a
//!   commit fails, the outcomes computed behind it before the executor rolled back are not released
//!   either ([`Rollbacks`]).
//!
//! Snapshots are encoded by the executor a chunk at a time between requests (decision 0014), each
//! chunk streamed to the snapshot's temporary file as it is encoded ([`snapshot_stream`]); its seal is
//! then queued to the completer like any outcome, so the file is completed and renamed into place
//! once every record it may reflect is durable, in the background.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use mqstate_broker::{
    service::Acker, Broker, ClientEvent, Identity, Message, Principal, ServiceInbox, ServiceRequest,
};
use mqstate_protocol::{parse_request, Command, ErrorKind, Hlc, Reply, RequestLimits};
use mqstate_store::{
    Change, Delta, Execution, KeyNotification, Progress, RequestContext, RequestRecord,
    SnapshotEncoder, StateMachine, StatePatch,
};
use mqstate_wal::{Metadata, PendingCommit, WalWriter};
use tokio::sync::{broadcast, mpsc};

use crate::access::KeyAccess;
use crate::dedup::{CachedReply, DedupCache, RecoveredRequests, Seen, DEFAULT_MAX_ENTRIES};
use crate::envelope::{Rejection, ReplyBuilder, ReplyTopic, Request};
use crate::metrics;
use crate::notify::NotifyConfig;
use crate::rate::RequestRates;

mod notify_exec;
pub mod snapshot_stream;

/// Outcomes queued between executor and completer; bounds memory when the disk is slow.
pub const COMPLETION_QUEUE_CAPACITY: usize = 8192;
/// Reason code of the DISCONNECT sent for a forbidden response topic (0x87 Not authorized).
pub const FORBIDDEN_RESPONSE_TOPIC_REASON: u8 = 0x87;
/// PUBACK reason when a request could not be made durable and no reply can say so (0x80
/// Unspecified error). A request with a response topic gets the `-ERR` reply and a successful
/// PUBACK instead: the request was handled, and clients (rumqttc, the AIO SDK) drop or fail the
/// exchange on a failed PUBACK before reading the reply (decision 0012).
pub const PUBACK_UNSPECIFIED_ERROR: u8 = 0x80;
/// PUBACK reason when the requester may not publish on its request's Response Topic (0x87 Not
/// authorized): the state store does not publish where the requester could not.
pub const PUBACK_NOT_AUTHORIZED: u8 = 0x87;
/// PUBACK reason when a request's Response Topic is not a valid topic name (0x90).
pub const PUBACK_TOPIC_NAME_INVALID: u8 = 0x90;

/// Where the reply to `who`'s request may go: a topic the client could publish on itself, or its
/// own state-store response topic (`clients/<own id>/…<service id>…`, which the built-in rules
/// reserve for exactly these replies; [`crate::guard`]). Notifications need no such check: they
/// go into the registering client's own session on its own notification topic.
fn reply_topic(broker: &Broker, who: Principal<'_>, topic: &str) -> ReplyTopic {
    if !broker.is_publishable_topic(topic) {
        ReplyTopic::Invalid
    } else if mqstate_protocol::topic::is_reserved_for_service(topic)
        || broker.may_publish(who, topic)
    {
        // A reserved topic that passed `is_forbidden_response_topic` is under the client's own
        // `clients/<id>/`: its SDK response topic.
        ReplyTopic::Allowed
    } else {
        ReplyTopic::NotAuthorized
    }
}

/// `result` label of a write that could not be made durable.
const NOT_DURABLE: &str = "not_durable";

/// Which changes go to the log (spec §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Every change is logged: the default.
    All,
    /// Only SETs carrying `aio-persistence: true` (and every delete) are logged, as AIO does.
    OptIn,
}

/// Settings of the service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// `__srcId` of replies.
    pub server_id: String,
    pub durability: Durability,
    /// Take a snapshot once this many bytes were logged since the last one.
    pub snapshot_threshold_bytes: u64,
    pub request_limits: RequestLimits,
    pub dedup_max_entries: usize,
    /// Which keys each client may read and write.
    pub key_access: KeyAccess,
    /// Requests executed per second per client (a burst of one second's worth); more are answered
    /// `-ERR the quota has been exceeded`. 0 (the default) disables the limit.
    pub requests_per_second: u32,
    /// Persistent notifications (topics, queues, delivery); `None` disables them.
    pub notify: Option<NotifyConfig>,
    /// Crash points of the service (`notify-after-reserve`).
    pub failpoints: mqstate_wal::Failpoints,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            server_id: "mqstate".into(),
            durability: Durability::All,
            snapshot_threshold_bytes: 64 * 1024 * 1024,
            request_limits: RequestLimits::default(),
            dedup_max_entries: DEFAULT_MAX_ENTRIES,
            key_access: KeyAccess::default(),
            requests_per_second: 0,
            notify: None,
            failpoints: mqstate_wal::Failpoints::default(),
        }
    }
}

/// One unit of work for the completer, in execution order.
// `Reply` is the per-request variant and `Snapshot` the rare one: boxing `Reply` to shrink the enum would
// cost an allocation per request.
#[allow(clippy::large_enum_variant)]
enum Outcome {
    /// Publish `notifications` then `reply`, then ack — once `commit` (if any) is durable and no
    /// commit queued before it in its epoch failed; otherwise the not-durable reply, without the
    /// notifications ([`Rollbacks`]).
    Reply {
        commit: Option<PendingCommit>,
        notifications: Vec<(Arc<str>, Message)>,
        reply: Option<ReplyTo>,
        acker: Option<Acker>,
        /// For the request metrics; `None` for expiries and cached replies.
        timing: Option<Timing>,
    },
    /// Call `done` once `commit` (if any) is durable (`true`) or failed (`false`); `false` too when
    /// the outcome was computed on state being rolled back ([`Rollbacks`]).
    Internal {
        commit: Option<PendingCommit>,
        done: Box<dyn FnOnce(bool) + Send>,
    },
    /// Everything before this is durable once it is reached: complete the snapshot's file.
    Snapshot {
        seal: snapshot_stream::SnapshotSeal,
        /// The fields of the state known only at its end.
        patches: Vec<StatePatch>,
        last_index: u64,
        /// The snapshot may reflect every record below this LSN: unless all of them became
        /// durable, it is abandoned.
        reflects_below: u64,
    },
}

/// An outcome on its way to the completer, with the rollback epoch it was computed in.
struct Queued {
    /// How many rollbacks the executor had made when it computed the outcome; `None` for outcomes
    /// that do not depend on the keyspace (a cached reply, a rejected envelope).
    epoch: Option<u64>,
    outcome: Outcome,
}

/// The completer's view of failed commits: which outcomes were computed on state that is being
/// rolled back.
///
/// A commit that fails in epoch `e` means every change the executor made after it in epoch `e` is
/// undone (the writer refuses every record queued behind a failed one, and the executor rolls back
/// all undurable writes, then counts epoch `e + 1`). An outcome of epoch `e` queued behind the
/// failed commit may have read those changes — a GET of the refused SET's value, a VDEL that found
/// the key another refused VDEL had deleted — so it is not released: it becomes the not-durable
/// error, like the failed write itself (decision 0012).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rollbacks {
    /// The newest epoch in which a commit failed.
    failed_in: Option<u64>,
}

impl Rollbacks {
    /// A commit computed in `epoch` failed.
    pub fn commit_failed(&mut self, epoch: Option<u64>) {
        debug_assert!(
            epoch.is_some(),
            "only outcomes computed on the state commit"
        );
        self.failed_in = self.failed_in.max(epoch);
    }

    /// Whether an outcome computed in `epoch`, reached after every earlier one, may have seen a
    /// change that is rolled back. Epochs only grow along the queue, so an outcome of an epoch in
    /// which a commit already failed was computed after that commit, before the rollback.
    pub fn is_stale(&self, epoch: Option<u64>) -> bool {
        matches!((epoch, self.failed_in), (Some(e), Some(f)) if e <= f)
    }
}

/// A snapshot being encoded between requests (decision 0014).
struct SnapshotInProgress {
    encoder: SnapshotEncoder,
    /// Where the encoded chunks go.
    stream: snapshot_stream::SnapshotStream,
    /// The last record logged when encoding started: replay resumes after it.
    last_index: u64,
    /// Executor time spent encoding, over all chunks.
    encoding: Duration,
    chunks: u32,
}

/// Keys encoded per executor turn. A chunk of 1,024 small keys takes a few hundred microseconds, so a
/// request waits at most that long behind one, and a million keys need a thousand turns.
pub const SNAPSHOT_CHUNK_KEYS: usize = 1024;
/// Encoded bytes after which a chunk ends early, so large values do not make a chunk slow.
pub const SNAPSHOT_CHUNK_BYTES: usize = 256 * 1024;

/// What the completer needs to count a request once its outcome is known.
struct Timing {
    command: &'static str,
    /// `ok`, `error` or `not_durable`; a failed commit turns it into `not_durable`.
    result: &'static str,
    received: Instant,
}

struct ReplyTo {
    client_id: Arc<str>,
    correlation: Bytes,
    message: Message,
    /// The `__ts` of `message`, for the duplicate-request cache.
    version: Option<Hlc>,
    /// The request's change was logged with its identity ([`mqstate_store::RequestRecord`]): once
    /// durable, a snapshot keeps the identity for the duplicate cache of a restarted node.
    logged: bool,
}

impl ReplyTo {
    /// The reply to `request` with `payload` and `__ts` `version`.
    fn new(
        replies: &ReplyBuilder,
        request: &Request,
        payload: Bytes,
        version: Option<Hlc>,
        expiry: Duration,
    ) -> ReplyTo {
        ReplyTo {
            client_id: request.client_id.clone(),
            correlation: request.correlation_data.clone(),
            message: replies.reply(request, payload, version.as_ref(), expiry),
            version,
            logged: false,
        }
    }
}

/// Reply to a write that could not be logged (disk full, I/O error). Not one of the spec's texts: the
/// spec has none for this, and clients surface any `-ERR` text to the application.
pub const NOT_DURABLE_REPLY: &[u8] =
    b"-ERR the write could not be made durable on the server's disk; retry later\r\n";

/// The reply a write gets instead of `reply` when its log record did not become durable: same
/// envelope, the error payload, and no `__ts` (no version was stored).
fn not_durable(mut reply: Message) -> Message {
    reply.payload = Bytes::from_static(NOT_DURABLE_REPLY);
    reply
        .properties
        .user_properties
        .retain(|(name, _)| name != crate::envelope::prop::TIMESTAMP);
    reply
}

/// The recovered state the service starts from.
pub struct Recovered {
    pub machine: StateMachine,
    pub wal: Arc<WalWriter>,
    /// The LSN the next appended record will get.
    pub next_lsn: u64,
    /// The log's metadata file, its `hlc_high_water_ms` (the clock ceiling) already above
    /// `machine`'s clock.
    pub metadata: Metadata,
    /// The requests of the snapshot and the replayed records, for the duplicate cache.
    pub requests: RecoveredRequests,
}

/// Runs the service until `shutdown` resolves.
pub async fn run(
    broker: Broker,
    inbox: ServiceInbox,
    recovered: Recovered,
    config: ServiceConfig,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let Recovered {
        machine,
        wal,
        next_lsn,
        metadata,
        requests,
    } = recovered;
    let (tx, rx) = mpsc::channel::<Queued>(COMPLETION_QUEUE_CAPACITY);
    let (failure_tx, failures) = mpsc::unbounded_channel();
    let durable_lsn = Arc::new(AtomicU64::new(next_lsn));
    let mut dedup = DedupCache::new(config.dedup_max_entries);
    if !requests.is_empty() {
        tracing::info!(
            requests = requests.len(),
            "duplicate-request cache rebuilt from the log"
        );
        dedup.restore(requests, Instant::now());
    }
    let dedup = Arc::new(Mutex::new(dedup));
    let replies = ReplyBuilder::new(&config.server_id);
    let completer = tokio::spawn(complete(
        broker.clone(),
        rx,
        Arc::clone(&dedup),
        Arc::clone(&durable_lsn),
        failure_tx,
    ));
    let rates = RequestRates::new(config.requests_per_second);
    let notify = notify_exec::start(&broker, config.notify.clone());
    let mut executor = Executor {
        broker: broker.clone(),
        machine,
        wal,
        next_lsn,
        logged_since_snapshot: 0,
        snapshot: None,
        config,
        dedup,
        replies,
        tx,
        undo: VecDeque::new(),
        durable_lsn,
        failures,
        degraded: None,
        rates,
        metadata,
        ceiling_failed_at: None,
        notify,
        pending_queue: None,
        rollbacks: 0,
    };
    executor.run(inbox, broker.events(), shutdown).await;
    drop(executor);
    let _ = completer.await;
}

struct Executor {
    broker: Broker,
    machine: StateMachine,
    wal: Arc<WalWriter>,
    next_lsn: u64,
    logged_since_snapshot: u64,
    snapshot: Option<SnapshotInProgress>,
    config: ServiceConfig,
    dedup: Arc<Mutex<DedupCache<Acker>>>,
    replies: ReplyBuilder,
    tx: mpsc::Sender<Queued>,
    /// For each logged but not yet durable write: its LSN and the delta that restores the key's
    /// previous state. A failed commit rolls the keyspace back to what the disk holds.
    undo: VecDeque<(u64, notify_exec::Undo)>,
    /// LSNs below this are durable (written by the completer).
    durable_lsn: Arc<AtomicU64>,
    /// The completer reports a failed commit here, with the epoch it was computed in.
    failures: mpsc::UnboundedReceiver<u64>,
    /// Set while the log refuses writes; when the last attempt to recover was made.
    degraded: Option<Instant>,
    rates: RequestRates,
    /// The metadata on disk. Its `hlc_high_water_ms` is the clock ceiling: every timestamp that
    /// leaves the service has a wall time below it, so a restart that resumes the clock at the
    /// ceiling never hands out an older one, whatever was deleted or the wall clock did.
    metadata: Metadata,
    /// When raising the ceiling last failed (disk full); it is retried at most once per
    /// [`LOG_RETRY_INTERVAL`].
    ceiling_failed_at: Option<Instant>,
    /// Persistent notifications, when enabled.
    notify: Option<notify_exec::NotifySide>,
    /// The queue side of the request being handled: set by `execute`, taken by `handle`.
    pending_queue: Option<notify_exec::PendingQueue>,
    /// Rollbacks made so far: the epoch outcomes are tagged with ([`Rollbacks`]).
    rollbacks: u64,
}

/// How far ahead of the clock the ceiling is set: the metadata file is rewritten about once per
/// this much clock advance (decision 0012).
pub const CLOCK_CEILING_LEASE_MS: u64 = 10_000;

/// The clock ceiling to persist when the clock's wall time reached `high_water_ms` at `now_ms`.
pub fn next_clock_ceiling(high_water_ms: u64, now_ms: u64) -> u64 {
    high_water_ms
        .max(now_ms)
        .saturating_add(CLOCK_CEILING_LEASE_MS)
}

/// How often a degraded log is asked to recover (disk space may have come back).
pub const LOG_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// How often the duplicate-request cache forgets expired requests without waiting for new ones,
/// so an idle server does not hold a busy period's cache.
pub const DEDUP_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Executor {
    async fn run(
        &mut self,
        mut inbox: ServiceInbox,
        mut events: broadcast::Receiver<ClientEvent>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        // Keys whose deadline passed while the server was down go first (spec: expired on start).
        self.expire().await;
        let mut sweep = tokio::time::interval(DEDUP_SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut internal, mut admin) = self.notify_inboxes();
        loop {
            let stale_at = self.stale_reservation_deadline();
            let deadline = self.machine.next_deadline().map(|ms| {
                let wait = Duration::from_millis(ms.saturating_sub(unix_now_ms()));
                tokio::time::Instant::now() + wait
            });
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                request = inbox.recv() => match request {
                    Some(request) => self.handle(request).await,
                    None => break,
                },
                event = events.recv() => match event {
                    // Spec §6 (AIO behaviour): registrations end with the connection; clients
                    // re-register after reconnecting.
                    Ok(ClientEvent::Disconnected { client_id } | ClientEvent::SessionEnded { client_id }) => {
                        self.machine.drop_client(&client_id);
                        self.rates.forget(&client_id);
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "state store missed session events; registrations of ended sessions may linger until their next notification");
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                },
                // Every commit behind a failed one fails too; the first failure of an epoch rolls
                // back all of them, and the rest (computed before that rollback) must not roll back
                // writes made since.
                Some(epoch) = self.failures.recv() => if epoch == self.rollbacks {
                    self.roll_back_undurable();
                },
                Some(request) = recv_some(&mut internal) => self.handle_internal(request).await,
                Some(request) = recv_some(&mut admin) => self.handle_admin(request).await,
                () = sleep_until(stale_at) => self.abort_stale_reservations().await,
                () = sleep_until(deadline) => self.expire().await,
                _ = sweep.tick() => self
                    .dedup
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .sweep(Instant::now()),
                // Lowest priority: an idle executor encodes chunk after chunk; a busy one a chunk
                // after each request or event (below). Yielding, not `ready()`: a task that is never
                // pending keeps its worker thread, and the tasks queued behind it (connections, the
                // completer) would wait for the whole snapshot. While the file is behind, it waits.
                () = snapshot_turn(self.snapshot.as_ref()), if self.snapshot.is_some() => {}
            }
            self.advance_snapshot().await;
        }
    }

    async fn handle(&mut self, mut service_request: ServiceRequest) {
        let acker = service_request.take_ack();
        let who = Principal {
            client_id: &service_request.client_id,
            identity: &service_request.identity,
        };
        let request = match Request::from_message(
            service_request.client_id.clone(),
            &service_request.message,
            |topic| reply_topic(&self.broker, who, topic),
        ) {
            Ok(request) => request,
            Err(rejection) => {
                return self
                    .reject(&service_request.client_id, rejection, acker)
                    .await
            }
        };
        let seen = {
            let mut dedup = self.dedup.lock().unwrap_or_else(|p| p.into_inner());
            dedup.check(
                &request.client_id,
                &request.correlation_data,
                request.expiry,
                Instant::now(),
                acker,
            )
        };
        let acker = match seen {
            Seen::New(acker) => acker,
            Seen::Pending => {
                metrics::request_counted(metrics::UNPARSED, "duplicate");
                return;
            }
            Seen::Done(reply, acker) => {
                metrics::request_counted(metrics::UNPARSED, "duplicate");
                let reply = ReplyTo::new(
                    &self.replies,
                    &request,
                    reply.payload,
                    reply.version,
                    request.expiry,
                );
                // The first reply, already released: the keyspace has no say in it.
                self.send_stateless_reply(reply, acker).await;
                return;
            }
        };
        let started = Instant::now();
        let (command, executed) = self.execute(&request, &service_request.identity).await;
        let expiry_left = request.expiry.saturating_sub(started.elapsed());
        if let Some(notify_exec::PendingQueue::Full(topic)) = &self.pending_queue {
            let payload = notify_exec::queue_full_reply(topic);
            self.pending_queue = None;
            let reply = ReplyTo::new(&self.replies, &request, payload, None, expiry_left);
            return self
                .send(Outcome::Reply {
                    commit: None,
                    notifications: Vec::new(),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: Some(Timing {
                        command,
                        result: "error",
                        received: started,
                    }),
                })
                .await;
        }
        let Some((execution, persist, undo)) = executed else {
            let reply = ReplyTo::new(
                &self.replies,
                &request,
                Bytes::from_static(NOT_DURABLE_REPLY),
                None,
                expiry_left,
            );
            self.send(Outcome::Reply {
                commit: None,
                notifications: Vec::new(),
                reply: Some(reply),
                acker: Some(acker),
                timing: Some(Timing {
                    command,
                    result: NOT_DURABLE,
                    received: started,
                }),
            })
            .await;
            return;
        };
        let payload = execution.reply.encode();
        let identity = || RequestRecord {
            client_id: request.client_id.clone(),
            correlation: request.correlation_data.clone(),
            expires_at_ms: unix_now_ms()
                .saturating_add(u64::try_from(request.expiry.as_millis()).unwrap_or(u64::MAX)),
            reply: payload.clone(),
            reply_ts: execution.ts.clone(),
        };
        let commit = match (self.pending_queue.take(), execution.delta.as_ref(), undo) {
            (Some(pending), _, undo) => self.log_notified(pending, undo, &identity()).await,
            (None, Some(delta), Some(undo)) if persist || matches!(delta, Delta::Delete { .. }) => {
                let logged = self
                    .log_requested(&Change::Key(delta.clone()), &identity())
                    .await;
                match &logged {
                    Ok(_) => self.push_undo(notify_exec::Undo::Key(undo)),
                    Err(_) => self.machine.apply_delta(&undo),
                }
                logged
            }
            _ => Ok(None),
        };
        let reply_to = |payload: Bytes, version| {
            ReplyTo::new(&self.replies, &request, payload, version, expiry_left)
        };
        let timing = |result| {
            Some(Timing {
                command,
                result,
                received: started,
            })
        };
        // A change was logged, hence with the request's identity.
        let logged = matches!(commit, Ok(Some(_))) && execution.delta.is_some();
        let outcome = match commit {
            Ok(commit) => {
                let mut reply = reply_to(payload, execution.ts.clone());
                reply.logged = logged;
                Outcome::Reply {
                    commit,
                    notifications: self.notifications(&execution.notifications),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: timing(match execution.reply {
                        Reply::Error(_) => "error",
                        _ => "ok",
                    }),
                }
            }
            Err(message) => {
                tracing::error!(client_id = %request.client_id, "state store write refused: {message}");
                let reply = reply_to(Bytes::from_static(NOT_DURABLE_REPLY), None);
                Outcome::Reply {
                    commit: None,
                    notifications: Vec::new(),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: timing(NOT_DURABLE),
                }
            }
        };
        self.send(outcome).await;
    }

    /// Executes a request; returns its metrics label and the execution, whether its change is to be
    /// logged, and the delta that would undo it (for writes).
    /// `None` when the command is a write and the log refuses writes.
    async fn execute(
        &mut self,
        request: &Request,
        identity: &Identity,
    ) -> (&'static str, Option<(Execution, bool, Option<Delta>)>) {
        if !self.rates.allow(&request.client_id, Instant::now()) {
            return (
                metrics::UNPARSED,
                Some((error_execution(ErrorKind::QuotaExceeded), false, None)),
            );
        }
        let now_ms = unix_now_ms();
        let parsed = parse_request(&request.payload, &self.config.request_limits)
            .map_err(|e| e.kind())
            .and_then(Command::parse);
        let label = metrics::command_label(parsed.as_ref().ok());
        let (ts, ft) = match (&request.timestamp, &request.fencing_token) {
            (Ok(ts), Ok(ft)) => (ts.clone(), ft.clone()),
            (Err(kind), _) | (_, Err(kind)) => {
                return (label, Some((error_execution(*kind), false, None)))
            }
        };
        let command = match parsed {
            Ok(command) => command,
            Err(kind) => return (label, Some((error_execution(kind), false, None))),
        };
        let who = Principal {
            client_id: &request.client_id,
            identity,
        };
        let keys = Arc::clone(&self.config.key_access.0);
        let allowed = match &command {
            Command::Get { key } | Command::KeyNotify { key } | Command::KeyNotifyStop { key } => {
                keys.may_read(who, key)
            }
            Command::Set { key, .. } | Command::Del { key } | Command::VDel { key, .. } => {
                keys.may_write(who, key)
            }
            // Filtered below instead: a SCAN returns what the client may read.
            Command::Scan { .. } => true,
        };
        if !allowed {
            tracing::debug!(client_id = %request.client_id, user = ?identity.user, "state store request not authorized");
            return (
                label,
                Some((error_execution(ErrorKind::NotAuthorized), false, None)),
            );
        }
        let is_scan = matches!(command, Command::Scan { .. });
        let written_key = match &command {
            Command::Set { key, .. } | Command::Del { key } | Command::VDel { key, .. } => {
                Some(key.clone())
            }
            _ => None,
        };
        if written_key.is_some() && !self.log_accepts_writes().await {
            return (label, None);
        }
        let undo = written_key.map(|key| self.undo_delta(key));
        let context = RequestContext {
            client_id: request.client_id.clone(),
            ts,
            fencing_token: ft,
            now_ms,
        };
        let persist = self.config.durability == Durability::All || request.persist;
        let event = notify_exec::event_of(&command);
        let reserved = match self.reserve(written_key_of(&command), event, now_ms) {
            Ok(reserved) => reserved,
            Err(topic) => {
                self.pending_queue = Some(notify_exec::PendingQueue::Full(topic));
                return (
                    label,
                    Some((error_execution(ErrorKind::QuotaExceeded), false, None)),
                );
            }
        };
        let mut execution = self.machine.execute(command, &context);
        if let Some(reserved) = reserved {
            self.pending_queue = Some(self.settle(reserved, event, &execution));
        }
        if let (true, Reply::Keys { keys: found, .. }) = (is_scan, &mut execution.reply) {
            found.retain(|key| keys.may_read(who, key));
        }
        if execution.delta.is_some() {
            self.report_keyspace_size();
        }
        (label, Some((execution, persist, undo)))
    }

    fn report_keyspace_size(&self) {
        let keyspace = self.machine.keyspace();
        metrics::keyspace_size(keyspace.len(), keyspace.stored_bytes());
    }

    /// The delta that puts `key` back as it is now.
    fn undo_delta(&self, key: Bytes) -> Delta {
        match self.machine.keyspace().get(&key) {
            Some(entry) => Delta::Put {
                key,
                value: Bytes::copy_from_slice(entry.value()),
                version: entry.version(),
                fencing_token: entry.fencing_token(),
                expires_at_ms: entry.expires_at_ms(),
            },
            None => Delta::Delete {
                key,
                version: self.machine.clock().high_water(),
            },
        }
    }

    /// A commit failed: everything after the last durable record is gone from the log (the writer cuts
    /// it back), so take it out of memory too, newest first.
    fn roll_back_undurable(&mut self) {
        let durable = self.durable_lsn.load(Acquire);
        let mut rolled_back = 0usize;
        while let Some((lsn, undo)) = self.undo.pop_back() {
            if lsn < durable {
                self.undo.push_back((lsn, undo));
                break;
            }
            self.apply_undo(undo);
            rolled_back += 1;
        }
        // It may hold rolled-back writes, and the LSNs it was started at are handed out again.
        if self.snapshot.take().is_some() {
            metrics::snapshot_finished(false);
            tracing::warn!("snapshot in progress abandoned after the log write failure");
        }
        self.next_lsn = durable;
        self.rollbacks += 1;
        self.degraded = Some(Instant::now());
        self.report_keyspace_size();
        tracing::error!(rolled_back, durable_lsn = durable, "log write failed: undurable writes rolled back; writes are refused until the log recovers, reads go on");
    }

    /// While degraded, asks the writer to recover at most once per [`LOG_RETRY_INTERVAL`].
    async fn log_accepts_writes(&mut self) -> bool {
        let Some(last_try) = self.degraded else {
            return true;
        };
        if last_try.elapsed() < LOG_RETRY_INTERVAL {
            return false;
        }
        match self.wal.retry().await {
            Ok(()) => {
                tracing::info!("log recovered; accepting writes again");
                self.degraded = None;
                true
            }
            Err(e) => {
                tracing::warn!("log still refuses writes: {e}");
                self.degraded = Some(Instant::now());
                false
            }
        }
    }

    fn notifications(&self, notifications: &[KeyNotification]) -> Vec<(Arc<str>, Message)> {
        notifications
            .iter()
            .map(|n| {
                (
                    n.client_id.clone(),
                    self.replies
                        .notification(&n.client_id, &n.key, n.payload.encode(), &n.version),
                )
            })
            .collect()
    }

    /// Appends a delta; returns the future of its durability.
    async fn log(&mut self, delta: &Delta) -> Result<Option<PendingCommit>, String> {
        let bytes = delta.encode().map_err(|e| e.to_string())?;
        self.log_bytes(bytes).await
    }

    /// Appends `change` made by `request`, with the request's identity (so a retry is answered,
    /// not executed, by a node that learns the change from the log); returns the future of its
    /// durability.
    async fn log_requested(
        &mut self,
        change: &Change,
        request: &RequestRecord,
    ) -> Result<Option<PendingCommit>, String> {
        let bytes = change
            .encode()
            .and_then(|change| request.encode_with(&change))
            .map_err(|e| e.to_string())?;
        self.log_bytes(bytes).await
    }

    /// Appends an encoded record; returns the future of its durability.
    async fn log_bytes(&mut self, bytes: Vec<u8>) -> Result<Option<PendingCommit>, String> {
        let len = bytes.len() as u64;
        let commit = self
            .wal
            .append(0, Bytes::from(bytes))
            .await
            .map_err(|e| e.to_string())?;
        self.next_lsn += 1;
        self.logged_since_snapshot += len;
        Ok(Some(commit))
    }

    async fn expire(&mut self) {
        for expiration in self.machine.expire_due(unix_now_ms()) {
            self.count_dropped(&expiration.dropped);
            let logged = match &expiration.commit {
                Some(commit) => {
                    let logged = self.log_queue(commit).await;
                    self.notify_queued();
                    logged
                }
                None => self.log(&expiration.delta).await,
            };
            let commit = match logged {
                Ok(commit) => commit,
                Err(message) => {
                    tracing::error!("expiry delete not durable: {message}");
                    None
                }
            };
            let notifications = self.notifications(&expiration.notifications);
            self.send(Outcome::Reply {
                commit,
                notifications,
                reply: None,
                acker: None,
                timing: None,
            })
            .await;
        }
        self.report_keyspace_size();
    }

    /// Starts a snapshot once enough was logged since the last one, and encodes the next chunk of
    /// the one in progress into its file (unless the file is behind); when it is complete, queues
    /// its seal behind the records it may reflect.
    async fn advance_snapshot(&mut self) {
        let Some(mut progress) = self.snapshot.take().or_else(|| self.start_snapshot()) else {
            return;
        };
        if !progress.stream.has_room() {
            self.snapshot = Some(progress);
            return;
        }
        let started = Instant::now();
        let stepped =
            progress
                .encoder
                .step(&self.machine, SNAPSHOT_CHUNK_KEYS, SNAPSHOT_CHUNK_BYTES);
        let chunk = progress.encoder.take_encoded();
        progress.encoding += started.elapsed();
        progress.chunks += 1;
        if progress.stream.push(chunk).is_err() {
            // The file failed; its task reported it.
            return;
        }
        let finished = match stepped {
            Ok(Progress::Continue) => {
                self.snapshot = Some(progress);
                return;
            }
            Ok(Progress::Done) => progress.encoder.finish_streamed(&self.machine),
            Err(e) => Err(e),
        };
        let end = match finished {
            Ok(end) => end,
            Err(e) => {
                metrics::snapshot_finished(false);
                return tracing::error!("snapshot not taken: {e}");
            }
        };
        if progress.stream.push_waiting(end.rest).await.is_err() {
            return;
        }
        metrics::snapshot_phase("encode", progress.encoding);
        tracing::debug!(
            last_index = progress.last_index,
            chunks = progress.chunks,
            encoding_ms = progress.encoding.as_millis() as u64,
            "snapshot encoded"
        );
        self.send(Outcome::Snapshot {
            seal: progress.stream.end(),
            patches: end.patches,
            last_index: progress.last_index,
            reflects_below: self.next_lsn,
        })
        .await;
    }

    fn start_snapshot(&mut self) -> Option<SnapshotInProgress> {
        if self.logged_since_snapshot < self.config.snapshot_threshold_bytes || self.next_lsn == 0 {
            return None;
        }
        self.logged_since_snapshot = 0;
        let last_index = self.next_lsn - 1;
        match SnapshotEncoder::new(&self.machine) {
            Ok(encoder) => Some(SnapshotInProgress {
                encoder,
                stream: snapshot_stream::start(&self.wal, last_index),
                last_index,
                encoding: Duration::ZERO,
                chunks: 0,
            }),
            Err(e) => {
                metrics::snapshot_finished(false);
                tracing::error!("snapshot not taken: {e}");
                None
            }
        }
    }

    async fn reject(&mut self, client_id: &Arc<str>, rejection: Rejection, acker: Acker) {
        match rejection {
            Rejection::NoResponseTopic => {
                metrics::request_counted(metrics::UNPARSED, "dropped");
                tracing::debug!(%client_id, "state store request without a response topic dropped");
                acker.ack(0x00);
            }
            Rejection::ForbiddenResponseTopic(topic) => {
                metrics::request_counted(metrics::UNPARSED, "forbidden");
                tracing::info!(%client_id, %topic, "disconnecting client: state store response topic is reserved");
                self.broker.disconnect(
                    client_id,
                    FORBIDDEN_RESPONSE_TOPIC_REASON,
                    Some(&format!(
                        "response topic {topic} is reserved for the state store"
                    )),
                );
            }
            Rejection::ResponseTopicRefused {
                response_topic,
                why,
            } => {
                let (result, code, reason) = match why {
                    ReplyTopic::NotAuthorized => (
                        "response_topic_not_authorized",
                        PUBACK_NOT_AUTHORIZED,
                        "the client may not publish on it itself",
                    ),
                    _ => (
                        "response_topic_invalid",
                        PUBACK_TOPIC_NAME_INVALID,
                        "it is not a valid topic name",
                    ),
                };
                metrics::request_counted(metrics::UNPARSED, result);
                tracing::info!(%client_id, topic = %response_topic, "state store request refused: the reply cannot go to its Response Topic: {reason}");
                acker.ack(code);
            }
            Rejection::UnsupportedVersion {
                response_topic,
                correlation_data,
                requested,
            } => {
                metrics::request_counted(metrics::UNPARSED, "unsupported_version");
                tracing::debug!(%client_id, %requested, "state store request with an unsupported __protVer");
                let reply = ReplyTo {
                    client_id: client_id.clone(),
                    correlation: correlation_data.clone(),
                    message: self.replies.unsupported_version(
                        response_topic,
                        correlation_data,
                        requested,
                    ),
                    version: None,
                    logged: false,
                };
                self.send_stateless_reply(reply, acker).await;
            }
            Rejection::BadRequest {
                response_topic,
                correlation_data,
                message,
            } => {
                metrics::request_counted(metrics::UNPARSED, "bad_request");
                let reply =
                    self.replies
                        .bad_request(response_topic, correlation_data.clone(), message);
                // Not cached: without correlation data there is nothing to match a retry by.
                let reply = ReplyTo {
                    client_id: client_id.clone(),
                    correlation: correlation_data.unwrap_or_default(),
                    message: reply,
                    version: None,
                    logged: false,
                };
                self.send_stateless_reply(reply, acker).await;
            }
        }
    }

    /// Keeps the clock ceiling above the clock: called before any outcome (which may carry a
    /// timestamp) leaves the executor.
    async fn raise_clock_ceiling(&mut self) {
        let high_water_ms = self.machine.clock().high_water().wall_ms;
        if high_water_ms < self.metadata.hlc_high_water_ms {
            return;
        }
        if self
            .ceiling_failed_at
            .is_some_and(|at| at.elapsed() < LOG_RETRY_INTERVAL)
        {
            return;
        }
        let raised = Metadata {
            hlc_high_water_ms: next_clock_ceiling(high_water_ms, unix_now_ms()),
            ..self.metadata.clone()
        };
        match self.wal.write_metadata(raised.clone()).await {
            Ok(()) => {
                self.metadata = raised;
                self.ceiling_failed_at = None;
            }
            Err(e) => {
                // Replies go on (reads must survive a full disk); only a crash before the disk
                // recovers, followed by a wall clock stepping back, could then reissue a timestamp.
                tracing::error!("cannot raise the HLC ceiling in the metadata file: {e}");
                self.ceiling_failed_at = Some(Instant::now());
            }
        }
    }

    /// Queues an outcome computed on the current state: it is not released if a commit queued
    /// before it fails ([`Rollbacks`]).
    async fn send(&mut self, outcome: Outcome) {
        self.queue(Some(self.rollbacks), outcome).await;
    }

    /// Queues an outcome that does not depend on the state (a cached reply, a rejection).
    async fn send_stateless(&mut self, outcome: Outcome) {
        self.queue(None, outcome).await;
    }

    /// [`Executor::send_stateless`] of a reply alone: no change to commit, nothing to notify.
    async fn send_stateless_reply(&mut self, reply: ReplyTo, acker: Acker) {
        self.send_stateless(Outcome::Reply {
            commit: None,
            notifications: Vec::new(),
            reply: Some(reply),
            acker: Some(acker),
            timing: None,
        })
        .await;
    }

    async fn queue(&mut self, epoch: Option<u64>, outcome: Outcome) {
        self.raise_clock_ceiling().await;
        if self.tx.send(Queued { epoch, outcome }).await.is_err() {
            tracing::error!("state store completer stopped; outcome dropped");
        }
    }
}

fn error_execution(kind: ErrorKind) -> Execution {
    Execution {
        reply: Reply::Error(kind),
        ts: None,
        delta: None,
        notifications: Vec::new(),
    }
}

/// The key a command writes, if it writes one.
fn written_key_of(command: &Command) -> Option<&Bytes> {
    match command {
        Command::Set { key, .. } | Command::Del { key } | Command::VDel { key, .. } => Some(key),
        _ => None,
    }
}

/// The next request of an optional inbox; never resolves without one.
async fn recv_some<T>(inbox: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match inbox {
        Some(inbox) => inbox.recv().await,
        None => std::future::pending().await,
    }
}

/// An executor turn for the snapshot in progress: at once (after yielding) if its file can take a
/// chunk, else once it can.
async fn snapshot_turn(snapshot: Option<&SnapshotInProgress>) {
    match snapshot {
        Some(progress) if !progress.stream.has_room() => progress.stream.room().await,
        _ => tokio::task::yield_now().await,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Requests of the duplicate cache encoded per batch at the end of a snapshot (the cache is locked
/// for one batch at a time).
const SNAPSHOT_REQUEST_BATCH: usize = 1024;

/// The end of a snapshot's state, encoded a batch at a time on the thread writing it: the requests
/// of the duplicate cache whose changes are logged. Every request whose record the snapshot may hold
/// has completed when the snapshot is sealed (the completer goes in order); later ones are harmless
/// (their records are replayed after the snapshot anyway).
fn logged_requests_of(dedup: Arc<Mutex<DedupCache<Acker>>>) -> snapshot_stream::RequestBatches {
    Box::new(move |encoder, after| {
        dedup
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .for_each_logged_request(
                after,
                SNAPSHOT_REQUEST_BATCH,
                Instant::now(),
                unix_now_ms(),
                |request| {
                    if let Err(e) = encoder.push(&request) {
                        tracing::warn!(client_id = %request.client_id, "request left out of the snapshot: {e}");
                    }
                },
            )
    })
}

/// Awaits a commit. On failure reports it to the executor, which rolls back, and returns the epoch
/// the failed write was computed in.
async fn settle(
    commit: Option<PendingCommit>,
    epoch: Option<u64>,
    durable_lsn: &AtomicU64,
    failures: &mpsc::UnboundedSender<u64>,
) -> Result<(), Option<u64>> {
    let Some(commit) = commit else {
        return Ok(());
    };
    match commit.await {
        Ok(lsn) => {
            debug_assert!(
                lsn >= durable_lsn.load(Acquire),
                "commits complete in LSN order"
            );
            durable_lsn.store(lsn + 1, Release);
            Ok(())
        }
        Err(e) => {
            tracing::error!("state store write not durable: {e}");
            if let Some(epoch) = epoch {
                let _ = failures.send(epoch);
            }
            Err(epoch)
        }
    }
}

async fn complete(
    broker: Broker,
    mut rx: mpsc::Receiver<Queued>,
    dedup: Arc<Mutex<DedupCache<Acker>>>,
    durable_lsn: Arc<AtomicU64>,
    failures: mpsc::UnboundedSender<u64>,
) {
    let mut rollbacks = Rollbacks::default();
    while let Some(Queued { epoch, outcome }) = rx.recv().await {
        match outcome {
            Outcome::Snapshot {
                seal,
                patches,
                last_index,
                reflects_below,
            } => {
                if durable_lsn.load(Acquire) < reflects_below {
                    metrics::snapshot_finished(false);
                    tracing::warn!(
                        last_index,
                        "snapshot not written: it may hold writes whose log records did not become durable"
                    );
                    continue;
                }
                // In the background: appends and completions go on while the file is completed.
                seal.commit(logged_requests_of(Arc::clone(&dedup)), patches);
            }
            Outcome::Internal { commit, done } => {
                let settled = settle(commit, epoch, &durable_lsn, &failures).await;
                if let Err(failed_in) = settled {
                    rollbacks.commit_failed(failed_in);
                }
                done(settled.is_ok() && !rollbacks.is_stale(epoch));
            }
            Outcome::Reply {
                commit,
                notifications,
                reply,
                acker,
                timing,
            } => {
                let settled = settle(commit, epoch, &durable_lsn, &failures).await;
                if let Err(failed_in) = settled {
                    rollbacks.commit_failed(failed_in);
                }
                // A failed write, or anything computed on its rolled-back state: the error reply.
                let released = settled.is_ok() && !rollbacks.is_stale(epoch);
                let (reply, reason) = if released {
                    for (client_id, message) in notifications {
                        broker.deliver_to(&client_id, message);
                    }
                    let sent =
                        reply.map(|r| (r.client_id, r.correlation, r.message, r.version, r.logged));
                    (sent, 0x00)
                } else {
                    match reply.map(|r| {
                        (
                            r.client_id,
                            r.correlation,
                            not_durable(r.message),
                            None,
                            false,
                        )
                    }) {
                        Some(failed) => (Some(failed), 0x00),
                        None => (None, PUBACK_UNSPECIFIED_ERROR),
                    }
                };
                if let Some((client_id, correlation, message, version, logged)) = reply {
                    let cached = CachedReply {
                        payload: message.payload.clone(),
                        version,
                    };
                    let waiting = dedup.lock().unwrap_or_else(|p| p.into_inner()).complete(
                        &client_id,
                        &correlation,
                        cached,
                        logged,
                    );
                    broker.publish(message);
                    for retry in waiting {
                        retry.ack(reason);
                    }
                }
                if let Some(acker) = acker {
                    acker.ack(reason);
                }
                if let Some(timing) = timing {
                    let result = if released { timing.result } else { NOT_DURABLE };
                    metrics::request_completed(timing.command, result, timing.received.elapsed());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rollbacks;

    #[test]
    fn outcomes_of_an_epoch_with_a_failed_commit_are_stale() {
        let mut rollbacks = Rollbacks::default();
        assert!(!rollbacks.is_stale(Some(0)), "nothing failed yet");
        rollbacks.commit_failed(Some(0));
        assert!(rollbacks.is_stale(Some(0)), "computed before the rollback");
        assert!(!rollbacks.is_stale(Some(1)), "computed after the rollback");
        assert!(!rollbacks.is_stale(None), "independent of the state");
        // Later failures of the same epoch (every commit behind the first fails) change nothing.
        rollbacks.commit_failed(Some(0));
        assert!(!rollbacks.is_stale(Some(1)));
        rollbacks.commit_failed(Some(1));
        assert!(rollbacks.is_stale(Some(1)));
        assert!(!rollbacks.is_stale(Some(2)));
    }
}
