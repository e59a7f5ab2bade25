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
//!
//! A write's change is logged with its request's identity and first reply (`mqstate_store`'s `I`
//! record, decision 0034), and a snapshot ends with the identities of the logged requests the
//! duplicate cache holds: a restarted node rebuilds the cache from both ([`crate::recovery`]).
//!
//! The log itself — appends, the durable index, the undo of what is not yet durable, degraded mode,
//! the snapshot schedule — is a [`DurableLog`] (`mqstate_wal::durable`). The modules here are split by
//! the state each owns: `request` (one request to its outcome), `log` (appends), `undo` (rollback),
//! `clock_ceiling` (the HLC ceiling in the metadata file), `snapshot_schedule` (encoding between
//! requests, the completer's hand-off), `snapshot_stream` (the snapshot's file, written as it is
//! encoded), `completer` (release in order), `notify_exec` (persistent notifications).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use mqstate_broker::{
    service::Acker, Broker, ClientEvent, Message, Principal, ServiceInbox, SharedClock,
};
use mqstate_protocol::{Hlc, RequestLimits};
use mqstate_store::{Delta, Expiration, KeyNotification, StateMachine};
use mqstate_wal::durable::sleep_until;
use mqstate_wal::{DurableLog, Lsn, Metadata, SnapshotSchedule, WalWriter};
use tokio::sync::{broadcast, mpsc};

use crate::access::KeyAccess;
use crate::dedup::{DedupCache, RecoveredRequests, DEFAULT_MAX_ENTRIES};
use crate::envelope::{ReplyBuilder, ReplyTopic};
use crate::metrics;
use crate::notify::NotifyConfig;
use crate::rate::RequestRates;

mod clock_ceiling;
mod completer;
mod key_order;
mod log;
mod notify_exec;
mod request;
mod routed;
mod snapshot_schedule;
pub mod snapshot_stream;
mod undo;
mod watching;

use clock_ceiling::ClockCeiling;
pub use clock_ceiling::{next_clock_ceiling, CLOCK_CEILING_LEASE_MS};
use completer::{Outcome, Queued, ReplyTo};
pub use completer::{Rollbacks, NOT_DURABLE_REPLY};
use snapshot_schedule::SnapshotInProgress;
pub use snapshot_schedule::{SNAPSHOT_CHUNK_BYTES, SNAPSHOT_CHUNK_KEYS};
use undo::Undo;
use watching::Watching;

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
    /// In a cluster: where GET/SET/DEL/VDEL execute (their partition's head); `None` on a single
    /// node, which executes everything here.
    pub router: Option<crate::router::Router>,
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
            router: None,
        }
    }
}

/// The recovered state the service starts from ([`crate::recovery`]).
pub struct Recovered {
    pub machine: StateMachine,
    pub wal: Arc<WalWriter>,
    /// The LSN the next appended record will get.
    pub next_lsn: Lsn,
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
    let log = DurableLog::new(
        "statestore",
        wal,
        next_lsn,
        SnapshotSchedule::new(config.snapshot_threshold_bytes, 0),
    );
    let (tx, rx) = mpsc::channel::<Queued>(COMPLETION_QUEUE_CAPACITY);
    let mut dedup = DedupCache::new(config.dedup_max_entries);
    if !requests.is_empty() {
        tracing::info!(
            requests = requests.len(),
            "duplicate-request cache rebuilt from the log"
        );
        dedup.restore(requests, broker.clock().now());
    }
    let dedup = Arc::new(Mutex::new(dedup));
    let replies = ReplyBuilder::new(&config.server_id);
    let completer = tokio::spawn(completer::complete(
        broker.clone(),
        rx,
        Arc::clone(&dedup),
        log.settler(),
    ));
    let rates = RequestRates::new(config.requests_per_second);
    let notify = notify_exec::start(&broker, config.notify.clone());
    let mut executor = Executor {
        clock: broker.clock().clone(),
        broker: broker.clone(),
        machine,
        log,
        snapshot: None,
        config,
        dedup,
        replies,
        tx,
        rates,
        ceiling: ClockCeiling::new(metadata, broker.clock().clone()),
        notify,
        pending_queue: None,
        expiry_held_until: None,
        key_order: key_order::KeyOrder::default(),
        catching_up: HashMap::new(),
        watching: Watching::default(),
    };
    executor.run(inbox, broker.events(), shutdown).await;
    drop(executor);
    let _ = completer.await;
}

struct Executor {
    /// The node's clock (the broker's): wall time for the state machine, instants for the caches.
    clock: SharedClock,
    broker: Broker,
    machine: StateMachine,
    /// The log of every change, in apply order, with the undo of each one not yet durable.
    log: DurableLog<undo::Undo>,
    snapshot: Option<SnapshotInProgress>,
    config: ServiceConfig,
    dedup: Arc<Mutex<DedupCache<Acker>>>,
    replies: ReplyBuilder,
    tx: mpsc::Sender<Queued>,
    rates: RequestRates,
    ceiling: ClockCeiling,
    /// Persistent notifications, when enabled.
    notify: Option<notify_exec::NotifySide>,
    /// The queue side of the request being handled: set by `execute`, taken by `handle`.
    pending_queue: Option<notify_exec::PendingQueue>,
    /// No expiry before then: the last one's append was refused.
    expiry_held_until: Option<tokio::time::Instant>,
    /// A client's routed key commands, in arrival order per key.
    key_order: key_order::KeyOrder,
    /// Clients whose session was taken over here, per key, until the changes they missed meanwhile
    /// are handed over (decision 0065): their cursor, and the notifications held back till then.
    catching_up: HashMap<(Arc<str>, Bytes), CatchingUp>,
    /// Keys newly observed here whose watch the other nodes do not know of yet.
    watching: Watching,
}

/// A client catching up on a key: its cursor (the last change it got), the notifications of the
/// key held back for it meanwhile.
struct CatchingUp {
    after: Option<Hlc>,
    held: Vec<KeyNotification>,
}

/// How long a session taken over here may take to reach the broker before the changes its client
/// missed are handed over anyway (the take-over's CONNACK, or the adoption, put it there).
const SESSION_WAIT: Duration = Duration::from_secs(10);

/// Most requests the executor handles in one turn (so in one log batch) before it looks at its
/// other inputs again.
pub const TURN_REQUESTS_MAX: usize = 256;

/// How often the duplicate-request cache forgets expired requests without waiting for new ones,
/// so an idle server does not hold a busy period's cache.
pub const DEDUP_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

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
        self.log.commit_queued();
        let mut sweep = tokio::time::interval(DEDUP_SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut internal, mut admin) = self.notify_inboxes();
        let mut changes = self.config.router.as_ref().and_then(|r| r.0.take_changes());
        let mut restored = self
            .config
            .router
            .as_ref()
            .and_then(|r| r.0.take_restored());
        loop {
            let stale_at = self.stale_reservation_deadline();
            let deadline = self.expiry_deadline();
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                request = inbox.recv() => match request {
                    Some(request) => {
                        self.handle(request).await;
                        self.take_turn(&mut inbox).await;
                    }
                    None => break,
                },
                event = events.recv() => match event {
                    // On a cluster node a client's registrations end with its session: they are
                    // kept with a persistent session and follow it to another node (decision 0054).
                    Ok(ClientEvent::Disconnected { client_id }) if self.config.router.is_some() => {
                        self.rates.forget(&client_id);
                    }
                    // Spec §6 (AIO behaviour): registrations end with the connection; clients
                    // re-register after reconnecting.
                    Ok(ClientEvent::Disconnected { client_id } | ClientEvent::SessionEnded { client_id }) => {
                        self.drop_client(&client_id);
                        self.rates.forget(&client_id);
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "state store missed session events; registrations of ended sessions may linger until their next notification");
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                },
                Some(epoch) = self.log.next_failure() => self.roll_back_undurable(epoch),
                Some(request) = recv_some(&mut internal) => self.handle_internal(request).await,
                Some(change) = recv_change(&mut changes) => self.notify_cluster_change(change).await,
                Some(observer) = recv_restored(&mut restored) => self.restore_observer(observer),
                Some(request) = recv_some(&mut admin) => self.handle_admin(request).await,
                () = sleep_until(stale_at) => self.abort_stale_reservations().await,
                () = sleep_until(deadline) => self.expire().await,
                _ = sweep.tick() => {
                    self.dedup
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .sweep(self.clock.now());
                    self.report_queues();
                }
                // Lowest priority: an idle executor encodes chunk after chunk; a busy one a chunk
                // after each request or event (below). Yielding, not `ready()`: a task that is never
                // pending keeps its worker thread, and the tasks queued behind it (connections, the
                // completer) would wait for the whole snapshot. While the file is behind, it waits.
                () = snapshot_schedule::turn(self.snapshot.as_ref()), if self.snapshot.is_some() => {}
            }
            self.advance_snapshot().await;
            // The end of a turn: what it logged is written and fsynced as one batch, here, when
            // the log's owner commits (decision 0069).
            self.log.commit_queued();
        }
    }

    /// Takes into the current turn (so into its log batch: one write, one fsync) every request that
    /// arrives while the tasks already runnable on this worker run: the connections woken by the
    /// same readiness event each bring one. Yields until a yield brings nothing new, or the turn
    /// is full. Without it, the first connection's request would wake this task ahead of the
    /// others (tokio runs a task woken by the running one next), and each batch would be one
    /// request with a fsync of its own.
    async fn take_turn(&mut self, inbox: &mut ServiceInbox) {
        let mut turn = 1;
        while turn < TURN_REQUESTS_MAX {
            match inbox.try_recv() {
                Ok(request) => {
                    self.handle(request).await;
                    // A snapshot under way keeps its pace of a chunk per request.
                    self.advance_snapshot().await;
                    turn += 1;
                }
                Err(_) if !self.log.awaits_commit() => return,
                Err(_) => {
                    tokio::task::yield_now().await;
                    if inbox.is_empty() {
                        return;
                    }
                }
            }
        }
    }

    /// A client's registrations end; on a cluster node, keys no client here observes any more are
    /// no longer asked of the other nodes.
    fn drop_client(&mut self, client_id: &str) {
        let Some(router) = self.config.router.clone() else {
            self.machine.drop_client(client_id);
            return;
        };
        let keys = self.machine.registered_keys(client_id);
        self.machine.drop_client(client_id);
        self.catching_up
            .retain(|(client, _), _| **client != *client_id);
        let unobserved: Vec<_> = keys
            .into_iter()
            .filter(|key| !self.machine.is_observed(key))
            .collect();
        if !unobserved.is_empty() {
            tokio::spawn(async move {
                for key in unobserved {
                    router.0.watch(key, false).await;
                }
            });
        }
    }

    /// The registrations of a session taken over here: in force once the other nodes know of the
    /// keys newly observed here (then `done`, and the client gets its CONNACK).
    fn restore_observer(&mut self, observer: crate::router::RestoredObserver) {
        let Some(router) = self.config.router.clone() else {
            let _ = observer.done.send(());
            return;
        };
        let context = mqstate_store::RequestContext {
            client_id: observer.client_id.clone(),
            ts: None,
            fencing_token: None,
            now_ms: self.clock.now_ms(),
        };
        let mut newly_observed = Vec::new();
        let mut in_flight = Vec::new();
        let mut cursors = Vec::new();
        for (key, after) in observer.keys {
            // Its notifications wait for what it missed (decision 0065), and for its session to
            // be in the broker. A restore of the same client still catching up (an adoption
            // overtaken by the client's CONNECT) keeps what it held: those changes are owed too.
            let cursor = after.as_deref().and_then(|a| Hlc::parse(a).ok());
            self.catching_up
                .entry((observer.client_id.clone(), key.clone()))
                .and_modify(|c| c.after.clone_from(&cursor))
                .or_insert(CatchingUp {
                    after: cursor,
                    held: Vec::new(),
                });
            cursors.push((key.clone(), after));
            let was_observed = self.machine.is_observed(&key);
            let command = mqstate_protocol::Command::KeyNotify { key: key.clone() };
            if let mqstate_protocol::Reply::Error(e) = self.machine.execute(command, &context).reply
            {
                tracing::warn!(client_id = %observer.client_id, "a kept registration not restored: {e:?}");
            }
            if !was_observed && self.machine.is_observed(&key) {
                newly_observed.push(self.watching.begin(key));
            } else if let Some(rx) = self.watching.on_its_way(&key) {
                in_flight.push(rx);
            }
        }
        tracing::debug!(client_id = %observer.client_id, keys = newly_observed.len(), "registrations of a session taken over restored");
        let broker = self.broker.clone();
        let client_id = observer.client_id;
        tokio::spawn(async move {
            for announcing in newly_observed {
                announcing.send(&router).await;
            }
            // A key another restore began observing is not in force before its watch is: until
            // then its changes pass this node by (seed 920 of the robustness suite: a CONNECT
            // that overtook its session's adoption got its CONNACK and caught up while the
            // adoption's watch was still on its way, and missed the changes between).
            for rx in in_flight {
                watching::in_force(rx).await;
            }
            let _ = observer.done.send(());
            let waiting = tokio::time::Instant::now();
            while !broker.has_session(&client_id) && waiting.elapsed() < SESSION_WAIT {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let mut catch_ups = tokio::task::JoinSet::new();
            for (key, after) in cursors {
                let (router, client_id) = (router.clone(), client_id.clone());
                catch_ups.spawn(async move { router.0.catch_up(client_id, key, after).await });
            }
            while catch_ups.join_next().await.is_some() {}
        });
    }

    /// The changes `client_id` missed of `key` while its session moved here, then those held back
    /// for it since, in version order, once each; its notifications of the key flow from now on.
    async fn finish_catch_up(&mut self, client_id: Arc<str>, key: Bytes, missed: &[Delta]) {
        let Some(CatchingUp { after, held }) = self.catching_up.remove(&(client_id.clone(), key))
        else {
            return;
        };
        let mut owed: Vec<KeyNotification> = missed
            .iter()
            .flat_map(|delta| self.machine.notifications_of(delta))
            .filter(|n| n.client_id == client_id)
            .chain(held)
            .filter(|n| after.as_ref().is_none_or(|after| n.version > *after))
            .collect();
        owed.sort_by(|a, b| a.version.cmp(&b.version));
        owed.dedup_by(|a, b| a.version == b.version);
        if owed.is_empty() {
            return;
        }
        tracing::debug!(%client_id, missed = missed.len(), owed = owed.len(), "notifications of a session taken over caught up");
        let notifications = self.notifications(&owed);
        self.send_stateless_notifications(notifications).await;
    }

    /// Changes committed at a partition's head for keys observed here: notifications queued like
    /// a local write's (ahead of any reply released after them), then `done`.
    async fn notify_cluster_change(&mut self, change: crate::router::ClusterChange) {
        if let Some((client_id, key)) = change.catch_up {
            self.finish_catch_up(client_id, key, &change.changes).await;
            let _ = change.done.send(());
            return;
        }
        let mut notifications: Vec<_> = change
            .changes
            .iter()
            .flat_map(|delta| self.machine.notifications_of(delta))
            .collect();
        if !self.catching_up.is_empty() {
            notifications.retain_mut(|n| {
                let Some(catching_up) = self
                    .catching_up
                    .get_mut(&(n.client_id.clone(), n.key.clone()))
                else {
                    return true;
                };
                catching_up.held.push(n.clone());
                false
            });
        }
        if !notifications.is_empty() {
            let notifications = self.notifications(&notifications);
            self.send_stateless_notifications(notifications).await;
        }
        let _ = change.done.send(());
    }

    fn report_keyspace_size(&self) {
        let keyspace = self.machine.keyspace();
        metrics::keyspace_size(keyspace.len(), keyspace.stored_bytes());
    }

    /// Deletes the keys whose deadline passed. An expiry is a write like any other: made only
    /// while the log takes writes, and undone (newest first) unless its record is logged; once
    /// logged its undo is kept, so the rollback of a failed commit takes it back too. An expiry
    /// left applied in memory would number queue entries that recovery never sees (a restart
    /// renumbers them, and fenced removals logged with the old numbers remove undelivered
    /// entries: docs/robustness.md, seed 1000). An undone key is expired again once the log
    /// recovers: its deadline stays passed.
    async fn expire(&mut self) {
        if !self.log_accepts_writes().await {
            return;
        }
        let mut expirations = self.machine.expire_due(self.clock.now_ms()).into_iter();
        while let Some(expiration) = expirations.next() {
            let Expiration {
                delta,
                undo,
                notifications,
                commit,
                dropped,
            } = expiration;
            self.count_dropped(&dropped);
            let (record, queue_undo) = commit.unzip();
            let logged = match &record {
                Some(record) => self.log_queue(record).await,
                None => self.log(&delta).await,
            };
            let undo = Undo::of_expiry(undo, queue_undo);
            let commit = match logged {
                Ok(commit) => {
                    self.log.push_undo(undo);
                    if record.is_some() {
                        self.notify_queued();
                    }
                    commit
                }
                Err(message) => {
                    // The rest of the batch is applied in memory on top of this one.
                    let later: Vec<_> = expirations.by_ref().collect();
                    for later in later.into_iter().rev() {
                        let queue_undo = later.commit.map(|(_, undo)| undo);
                        self.apply_undo(Undo::of_expiry(later.undo, queue_undo));
                    }
                    self.apply_undo(undo);
                    // Most failures degrade the log, which holds expiries back; this holds them
                    // back from a writer that refuses appends without failing a commit (a stopped one).
                    self.expiry_held_until =
                        Some(self.clock.tokio_now() + mqstate_wal::durable::RETRY_INTERVAL);
                    tracing::error!("expiry delete not logged, undone until the log takes writes again: {message}");
                    break;
                }
            };
            let notifications = self.notifications(&notifications);
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

    /// When the next expiry is due: the earliest deadline, but while the log refuses writes no
    /// sooner than its next attempt to recover (an expiry waits for the log).
    fn expiry_deadline(&self) -> Option<tokio::time::Instant> {
        let ms = self.machine.next_deadline()?;
        let wait = Duration::from_millis(ms.saturating_sub(self.clock.now_ms()));
        let retry = self
            .log
            .health()
            .retry_at()
            .map(tokio::time::Instant::from_std);
        let due = self.clock.tokio_now() + wait;
        Some(
            [retry, self.expiry_held_until]
                .into_iter()
                .flatten()
                .fold(due, Ord::max),
        )
    }

    /// before it fails ([`Rollbacks`]).
    async fn send(&mut self, outcome: Outcome) {
        self.queue(Some(self.log.epoch()), outcome).await;
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

    /// [`Executor::send_stateless`] of notifications alone: no change to commit, no reply.
    async fn send_stateless_notifications(&mut self, notifications: Vec<(Arc<str>, Message)>) {
        self.send_stateless(Outcome::Reply {
            commit: None,
            notifications,
            reply: None,
            acker: None,
            timing: None,
        })
        .await;
    }

    async fn queue(&mut self, epoch: Option<u64>, outcome: Outcome) {
        let high_water_ms = self.machine.clock().high_water().wall_ms;
        self.ceiling.raise(self.log.wal(), high_water_ms).await;
        if self.tx.capacity() == 0 {
            // The completer waits for commits that only this task's turn would write.
            self.log.commit_queued();
        }
        if self.tx.send(Queued { epoch, outcome }).await.is_err() {
            tracing::error!("state store completer stopped; outcome dropped");
        }
    }
}

/// The next change of a cluster node's inbox; never resolves on a single node.
async fn recv_change(
    inbox: &mut Option<crate::router::ClusterChanges>,
) -> Option<crate::router::ClusterChange> {
    match inbox {
        Some(inbox) => inbox.recv().await,
        None => std::future::pending().await,
    }
}

/// The next request of an optional inbox; never resolves without one.
/// The next session taken over here with registrations; never resolves on a single node.
async fn recv_restored(
    inbox: &mut Option<crate::router::RestoredObservers>,
) -> Option<crate::router::RestoredObserver> {
    match inbox {
        Some(inbox) => inbox.recv().await,
        None => std::future::pending().await,
    }
}

async fn recv_some<T>(inbox: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match inbox {
        Some(inbox) => inbox.recv().await,
        None => std::future::pending().await,
    }
}
