//! mqstate-replication: the state store replicated on chains, as a cluster node runs it.
//!
//! * [`head`] — a state-store command executed at a partition's head against the key's committed
//!   row, with the store's own semantics (pure).
//! * [`wire`] — the data plane's messages inside the cluster transport's frames.
//! * [`log`] — the replicas' log on `mqstate-wal` (`<data-dir>/chains/`), restored at start.
//! * [`compaction`] — snapshots of the replicas' images that let the log be purged.
//! * [`batch`] — chain messages to a peer, batched per hop (one frame, one call in flight).
//! * [`forward`] — state-store requests forwarded to their head, batched per peer.
//! * [`driver`] — the task that owns this node's replicas (`mqstate-chain`, sans-IO) and gives
//!   them disk, network, views and time.
//! * [`notify`] — KEYNOTIFY across nodes: observed keys sent to every member, committed changes
//!   from the head to the nodes observing them (decision 0046).
//! * [`expiry`] — PX deadlines of the partitions this node is head for; the expiry delete.
//! * [`scan`] — SCAN as one part per partition at its head, merged into a page.
//! * [`recent`] — the requests each partition ran lately, so a retry gets its first reply.
//! * [`rows`] — what a chain row (a store record) says: liveness, deadline, committed change.
//! * [`trail`] — the changes of observed keys each replica persisted, for observing nodes that
//!   missed some (a head lost with its outbox; decision 0061).
//!
//! [`Replication`] ties them together: a request received at any node goes to its key's
//! partition head (here, or forwarded over the cluster transport); the head reads the committed
//! row, executes, writes the new row through the chain and answers once the chain answered
//! `Written`. Architecture invariant: the protocol stays in `mqstate-chain`; this crate does I/O and
//! knows nothing of MQTT (the binary connects it to the state-store service's router port).

pub mod batch;
pub mod compaction;
pub mod driver;
pub mod expiry;
pub mod failpoint;
pub mod forward;
pub mod head;
pub mod log;
pub mod notify;
pub mod recent;
pub mod rows;
pub mod scan;
pub mod sessions;
pub mod space;
pub mod trail;
pub mod wire;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

// tokio's: simulated time moves it (turmoil, paused test time), as every timer here.
use tokio::time::Instant;

use mqstate_chain::{Answer, Expect, Restored, View, Write};
use mqstate_chain::{Key, Version};
use mqstate_clock::SharedClock;
use mqstate_cluster::partition::partition_of;
use mqstate_cluster::transport::{BoxFuture, Request, Response};
use mqstate_cluster::{ClusterNode, DataHandler};
use mqstate_protocol::{Glob, Hlc};
use mqstate_store::Change;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::Driver;
use crate::expiry::Deadlines;
use crate::forward::Forwarder;
use crate::head::{HeadConfig, KeyReply, KeyRequest, Step};
use crate::log::ChainLog;
use crate::notify::Notifier;
use crate::recent::Recent;
use crate::wire::{decode, encode, DataRequest, DataResponse, Executed, PartScan, ScanPage};

/// A request is retried (head unknown, no view yet, head changing) this often within its expiry.
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(50);
/// Longest a request is tried, whatever its expiry.
const MAX_TRY: Duration = Duration::from_secs(30);
/// How long one step at the head (a read, a chain write) may take.
pub(crate) const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// Executions at the head of one request, when other writes to its key keep winning.
pub(crate) const MAX_ATTEMPTS: usize = 16;

/// The data plane of a cluster node.
pub struct Replication {
    node: Arc<ClusterNode>,
    driver: Driver,
    forwarder: Forwarder,
    config: HeadConfig,
    clock: SharedClock,
    /// The highest HLC this node handed out at a head.
    floor: Mutex<Option<Hlc>>,
    pub notifier: Notifier,
    deadlines: Deadlines,
    /// The view under which this node last took each partition over as its head.
    taken_over: Mutex<BTreeMap<u32, u64>>,
    /// The requests this node's replicas saw executed lately ([`recent`]).
    recent: Arc<Recent>,
}

/// The running data plane; stop it with [`Running::stop`].
pub struct Running {
    pub replication: Arc<Replication>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    background: JoinHandle<()>,
}

impl Running {
    /// Stops the driver and closes the chain log (requests still waiting get `Unavailable`).
    pub async fn stop(self) {
        self.background.abort();
        let _ = self.background.await;
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// What the node holds to hand data requests over.
struct Attached(Weak<Replication>);

impl DataHandler for Attached {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>> {
        Box::pin(async move {
            match self.0.upgrade() {
                Some(replication) => replication.handle_data(request).await,
                None => encode(&DataResponse::Retry("this node is shutting down".into())),
            }
        })
    }
}

impl Replication {
    /// Starts the driver over the restored log and attaches the data plane to `node`.
    pub fn start(
        node: Arc<ClusterNode>,
        mut log: ChainLog,
        restored: BTreeMap<u32, Restored>,
        config: HeadConfig,
        clock: SharedClock,
    ) -> Running {
        let (stop, stopped) = watch::channel(false);
        let recent = Arc::new(Recent::default());
        for (partition, requests) in log.take_replayed_requests() {
            recent.remember(partition, requests, clock.now_ms());
        }
        for (&partition, image) in &restored {
            recent.note_restored(partition, image, clock.now_ms());
        }
        let notifier = Notifier::new(Arc::clone(&node), clock.now_ms());
        notifier.trail_notes().restore(log.take_replayed_trail());
        let (driver, task) = Driver::start(
            Arc::clone(&node),
            log,
            restored,
            Arc::clone(&recent),
            notifier.trail_notes(),
            Arc::clone(&clock),
            stopped,
        );
        let replication = Arc::new(Replication {
            node: Arc::clone(&node),
            driver,
            forwarder: Forwarder::new(Arc::clone(&node)),
            config,
            clock,
            floor: Mutex::new(None),
            notifier,
            deadlines: Deadlines::default(),
            taken_over: Mutex::new(BTreeMap::new()),
            recent,
        });
        // Weak: the node outlives nothing it hands requests to, and shuts down once we are gone.
        node.set_data_handler(Arc::new(Attached(Arc::downgrade(&replication))));
        let background = tokio::spawn(background(Arc::downgrade(&replication)));
        Running {
            replication,
            stop,
            task,
            background,
        }
    }

    /// Executes a state-store request for one key, at whichever node holds its partition's head,
    /// trying again while the partition has no head acting (a view change, a lease renewal), up to
    /// the request's expiry. A retry reaching a head after its first run, however many writes
    /// followed, gets the first reply ([`recent`]); no head starts it past its deadline.
    pub async fn execute(&self, mut request: KeyRequest) -> KeyReply {
        let started = Instant::now();
        let budget = Duration::from_millis(request.expiry_ms).min(MAX_TRY);
        let budget_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX);
        request.deadline_ms = self.clock.now_ms().saturating_add(budget_ms);
        loop {
            let last = match self.try_once(&request).await {
                Ok(executed) => return executed,
                Err(reason) => reason,
            };
            tokio::time::sleep(RETRY_EVERY).await;
            // Checked after the sleep, right before the next attempt: a node paused in between
            // wakes up past its budget and must not send the request again (seed 80144).
            if started.elapsed() >= budget || self.clock.now_ms() >= request.deadline_ms {
                tracing::debug!(client_id = %request.client_id, "state-store request not served in time: {last}");
                return KeyReply::error(&format!(
                    "the cluster could not serve the request in time ({last}); retry"
                ));
            }
        }
    }

    async fn try_once(&self, request: &KeyRequest) -> Result<KeyReply, String> {
        let count = self
            .node
            .partition_count()
            .ok_or("the cluster has not formed yet")?;
        let partition = partition_of(&request.key, count);
        let head = self
            .head_of(partition)
            .ok_or_else(|| format!("partition {partition} has no replica up"))?;
        if head == self.node.id() {
            return self.execute_here(partition, request).await;
        }
        let executed = self.forwarder.execute(head, request.to_wire()).await?;
        Ok(KeyReply::from_wire(executed))
    }

    /// The head of `partition` as this node last learnt it: the published chain, read view first
    /// (as the replicas order it).
    fn head_of(&self, partition: u32) -> Option<u64> {
        let p = self.node.partition(partition)?;
        View {
            id: p.view,
            chain: p.chain,
            read_view: p.read_view,
        }
        .readable_first()
        .head()
    }

    /// At the head: read the committed row, execute, write the new row through the chain.
    async fn execute_here(&self, partition: u32, request: &KeyRequest) -> Result<KeyReply, String> {
        for _ in 0..MAX_ATTEMPTS {
            let (value, version) = match self
                .driver
                .read(partition, request.key.to_vec(), STEP_TIMEOUT)
                .await
            {
                Answer::Value { value, version } => (value, version),
                other => return Err(not_served(partition, &other)),
            };
            // A retry of a request the chain ran before (its front end lost the answer in a
            // fail-over or a pause), though later writes replaced its row: its first reply. The
            // read above committed every write of the key so far, that request's included.
            let first = self
                .recent
                .first_reply(partition, &request.id, self.clock.now_ms());
            let first = first.map_err(|recent::Unsynced| format!(
                "partition {partition}: this head re-entered its chain and has not learnt the requests it ran yet"
            ))?;
            if let Some(first) = first {
                // Not answered before every member knows it: the entry may be a note still on its
                // way, or one an earlier head never saw acknowledged, and a late copy reaching the
                // next head must find it there too.
                self.note(partition, &first).await?;
                // Its head may have died between commit and hand-over (robustness seed 401).
                if let Some(row) = &value {
                    self.renotify_retry(request, row).await;
                }
                return Ok(KeyReply {
                    payload: first.reply,
                    ts: first.reply_ts,
                });
            }
            let floor = self.floor.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let (step, high) = head::step(
                &self.config,
                request,
                value.as_deref(),
                self.clock.now_ms(),
                floor.as_ref(),
            );
            if let Some(high) = high {
                let mut floor = self.floor.lock().unwrap_or_else(|p| p.into_inner());
                if floor.as_ref().is_none_or(|f| high > *f) {
                    *floor = Some(high);
                }
            }
            let (value_to_write, new_version, delta, reply) = match step {
                Step::Reply(reply) => {
                    if let Some(row) = &value {
                        self.renotify_retry(request, row).await;
                    }
                    return Ok(reply);
                }
                Step::Unwritten { reply, record } => {
                    // At once, so that a copy of the request arriving meanwhile finds it here;
                    // answered once every member holds it, so that the next head knows it too.
                    self.recent
                        .remember(partition, [record.clone()], self.clock.now_ms());
                    self.note(partition, &record).await?;
                    return Ok(reply);
                }
                Step::Write {
                    value,
                    version,
                    delta,
                    reply,
                } => (value, version, delta, reply),
            };
            let expect = match (&value, version) {
                (Some(_), Some(current)) => Expect::Version(current),
                _ => Expect::Absent,
            };
            let write = Write {
                key: request.key.to_vec(),
                value: Some(value_to_write),
                version: new_version,
                expect,
            };
            match self.driver.write(partition, write, STEP_TIMEOUT).await {
                Answer::Written { .. } => {
                    self.committed(partition, &delta, value.as_deref()).await;
                    return Ok(reply);
                }
                // Another write to the key came first: execute again on the row it left.
                Answer::ConditionFailed { .. } | Answer::StaleVersion { .. } => continue,
                other => return Err(not_served(partition, &other)),
            }
        }
        Err(format!(
            "partition {partition}: the key kept changing under {MAX_ATTEMPTS} attempts"
        ))
    }
}

impl Replication {
    /// A request another node forwarded to this one as its partition's head.
    async fn execute_forwarded(&self, routed: wire::Routed) -> Result<Executed, String> {
        let count = self
            .node
            .partition_count()
            .ok_or_else(|| "the cluster has not formed yet".to_owned())?;
        let request = match KeyRequest::from_wire(routed, &self.config.limits) {
            Ok(request) => request,
            Err(reply) => return Ok(reply.to_wire()),
        };
        let reply = self
            .execute_here(partition_of(&request.key, count), &request)
            .await?;
        Ok(reply.to_wire())
    }
}

impl Replication {
    /// Writes `record`, a request answered with no row of its own, through the chain of
    /// `partition` as a note ([`mqstate_chain::Item::Note`]): every member remembers it.
    async fn note(
        &self,
        partition: u32,
        record: &mqstate_store::RequestRecord,
    ) -> Result<(), String> {
        let note = recent::note_of(record);
        match self.driver.note(partition, note, STEP_TIMEOUT).await {
            Answer::Noted => Ok(()),
            other => Err(not_served(partition, &other)),
        }
    }
}

fn not_served(partition: u32, answer: &Answer) -> String {
    match answer {
        Answer::NotHead { head } => format!(
            "this node is not the head of partition {partition} (node {head:?} is, by its view)"
        ),
        Answer::Unavailable => {
            format!("partition {partition} is not available here now (no view held, or changing)")
        }
        other => format!("partition {partition}: unexpected answer {other:?}"),
    }
}

impl Replication {
    /// Answers a [`DataRequest`] from another node.
    pub async fn handle_data(&self, request: Vec<u8>) -> Vec<u8> {
        let response = match decode::<DataRequest>(&request) {
            Ok(DataRequest::Chains(messages)) => {
                for (partition, message) in messages {
                    self.driver.receive(partition, message);
                }
                DataResponse::Received
            }
            Ok(
                request @ (DataRequest::Interest { .. }
                | DataRequest::Notify(_)
                | DataRequest::Trail { .. }
                | DataRequest::TrailReach { .. }),
            ) => self
                .notifier
                .handle(request)
                .await
                .unwrap_or_else(|| DataResponse::Refused("not a notification request".into())),
            Ok(DataRequest::Current { key }) => DataResponse::Current(self.current_here(key).await),
            Ok(DataRequest::Scan { partitions, page }) => {
                DataResponse::Scanned(self.scan_here(partitions, &page).await)
            }
            Ok(DataRequest::Execute(routed)) => match self.execute_forwarded(routed).await {
                Ok(executed) => DataResponse::Executed(executed),
                Err(reason) => DataResponse::Retry(reason),
            },
            Ok(DataRequest::ExecuteMany(requests)) => {
                // Together, so their reads and chain writes share the driver's turns and batches.
                let executions = requests
                    .into_iter()
                    .map(|routed| self.execute_forwarded(routed));
                DataResponse::ExecutedMany(futures::future::join_all(executions).await)
            }
            Ok(DataRequest::Recent { partition }) => {
                DataResponse::Recent(self.recent.export(partition, self.clock.now_ms()))
            }
            Ok(DataRequest::RecentOfHead {
                partition,
                view,
                entries,
            }) => {
                if self.recent.import(partition, view, entries) {
                    tracing::debug!(partition, view, "remembered requests synced from the head");
                }
                DataResponse::Received
            }
            Ok(request @ (DataRequest::SessionRead { .. } | DataRequest::SessionWrite { .. })) => {
                self.handle_session(request).await
            }
            Err(e) => DataResponse::Refused(format!("data request does not decode: {e}")),
        };
        encode(&response)
    }
}

/// Partitions' expiry deadlines and take-overs checked this often (in driver ticks).
const TAKE_OVER_EVERY: u32 = 5;
/// Expiry deletes started per tick, at most.
const EXPIRE_PER_TICK: usize = 256;

/// What a node does besides answering requests: expiry deletes as their deadlines pass, taking
/// over partitions it became head of, sending its observed keys again.
async fn background(replication: Weak<Replication>) {
    let mut tick = tokio::time::interval(driver::TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let interest_every = (notify::INTEREST_EVERY.as_millis() / driver::TICK.as_millis()).max(1);
    for round in 0u64.. {
        tick.tick().await;
        let Some(replication) = replication.upgrade() else {
            return;
        };
        let due = replication
            .deadlines
            .take_due(replication.clock.now_ms(), EXPIRE_PER_TICK);
        for (partition, key) in due {
            let replication = Arc::clone(&replication);
            tokio::spawn(async move { replication.expire(partition, key).await });
        }
        if round % u64::from(TAKE_OVER_EVERY) == 0 {
            replication.take_over().await;
        }
        if round % u64::from(TAKE_OVER_EVERY) == 0 && !replication.recent.unsynced().is_empty() {
            let replication = Arc::clone(&replication);
            tokio::spawn(async move { replication.sync_recent().await });
        }
        if round % interest_every as u64 == 0 {
            let replication = Arc::clone(&replication);
            tokio::spawn(async move { replication.notifier.send_interest().await });
        }
    }
}

impl Replication {
    /// Connects this node's observers (the state-store service) to the changes committed anywhere.
    pub fn set_sink(&self, sink: Arc<dyn notify::Sink>) {
        self.notifier.set_sink(sink);
    }

    /// The partitions whose replica here re-entered its chain get the requests the other members
    /// remember ([`recent`]): every member that can vouch for its entries is asked, and their
    /// union is what the chain ran.
    async fn sync_recent(&self) {
        for (partition, cleared) in self.recent.unsynced() {
            let Some(p) = self.node.partition(space::control(partition)) else {
                continue;
            };
            let mut merged = Vec::new();
            let mut answered = false;
            for member in p.chain.iter().copied().filter(|&m| m != self.node.id()) {
                let Some(addr) = self.node.addr_of(member) else {
                    continue;
                };
                let frame = encode(&DataRequest::Recent { partition });
                let answer = self
                    .node
                    .transport()
                    .call(&addr, Request::Data(frame), STEP_TIMEOUT)
                    .await;
                if let Ok(Response::Data(bytes)) = answer {
                    if let Ok(DataResponse::Recent(Some(entries))) = decode(&bytes) {
                        merged.extend(entries);
                        answered = true;
                    }
                }
            }
            // Not if it re-entered again meanwhile: the members' entries may predate that.
            if answered && self.recent.import(partition, cleared, merged) {
                tracing::debug!(partition, "remembered requests synced from the chain");
            }
        }
    }

    /// A row was committed through the chain at this head, replacing the committed row `before`:
    /// its expiry deadline noted, its change notified to the nodes observing its key.
    async fn committed(&self, partition: u32, delta: &mqstate_store::Delta, before: Option<&[u8]>) {
        if let Some(deadline) = rows::deadline(delta) {
            self.deadlines
                .schedule(partition, delta.key().to_vec(), deadline);
        }
        if self.notifier.is_observed(delta.key()) {
            self.notifier
                .publish(rows::committed_after(delta, before))
                .await;
        }
    }

    /// `key` is observed here now (`true`) or no longer (`false`); a newly observed key starts
    /// from its committed version at its head ([`Notifier::observe`]). Resolves once the other
    /// members know (bounded).
    pub async fn watch(&self, key: Vec<u8>, observed: bool) {
        if !observed {
            return self.notifier.watch(key, false).await;
        }
        let start = self.current_version(key.clone());
        self.notifier.observe(key, start).await;
    }

    /// Where `key`'s notifications stand on this node ([`notify::Notifier::position`]).
    pub fn position(&self, key: &[u8]) -> Option<String> {
        self.notifier.position(key)
    }

    /// Hands `observer` the changes of `key` after its cursor `after` that it missed while its
    /// session moved here ([`notify::Notifier::catch_up`], decision 0065).
    pub async fn catch_up(&self, observer: Arc<str>, key: Vec<u8>, after: Option<String>) {
        self.notifier.catch_up(observer, key, after).await;
    }

    /// The version of `key`'s committed row, read at its partition's head (`None`: no row, or
    /// no head answered within [`notify::ACK_TIMEOUT`]).
    async fn current_version(&self, key: Vec<u8>) -> Option<String> {
        let count = self.node.partition_count()?;
        let partition = partition_of(&key, count);
        let frame = encode(&DataRequest::Current { key: key.clone() });
        let started = Instant::now();
        while started.elapsed() < notify::ACK_TIMEOUT {
            let answer = match self.head_of(partition) {
                Some(head) if head == self.node.id() => self.current_here(key.clone()).await,
                Some(head) => match self.node.addr_of(head) {
                    Some(addr) => match self
                        .node
                        .transport()
                        .call(&addr, Request::Data(frame.clone()), notify::ACK_TIMEOUT)
                        .await
                    {
                        Ok(Response::Data(bytes)) => match decode::<DataResponse>(&bytes) {
                            Ok(DataResponse::Current(answer)) => answer,
                            other => Err(format!("answered {other:?}")),
                        },
                        other => Err(format!("answered {other:?}")),
                    },
                    None => Err(format!("node {head} has no address")),
                },
                None => Err(format!("partition {partition} has no head")),
            };
            match answer {
                Ok(version) => return version,
                Err(e) => tracing::debug!(partition, "an observed key's version not read now: {e}"),
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
        None
    }

    /// The version of `key`'s committed row, if this node is its partition's head.
    async fn current_here(&self, key: Vec<u8>) -> Result<Option<String>, String> {
        let count = self.node.partition_count().ok_or("no cluster yet")?;
        let partition = partition_of(&key, count);
        match self.driver.read(partition, key, STEP_TIMEOUT).await {
            Answer::Value { value, .. } => Ok(value
                .and_then(|row| rows::delta_of(&row).ok())
                .map(|delta| delta.version().to_string())),
            other => Err(not_served(partition, &other)),
        }
    }

    /// A retry answered from the row it made (its first reply): its change is notified again, in
    /// case the head that wrote it failed before notifying (observers drop what they had).
    async fn renotify_retry(&self, request: &KeyRequest, row: &[u8]) {
        if !self.notifier.is_observed(&request.key) {
            return;
        }
        let Ok(change) = Change::decode(row) else {
            return;
        };
        if change.request().is_some_and(|first| first.id == request.id) {
            if let Ok(delta) = rows::delta_of(row) {
                let change = self.notifier.with_prev(rows::committed(&delta));
                self.notifier.publish(change).await;
            }
        }
    }

    fn raise_floor(&self, high: &Hlc) {
        let mut floor = self.floor.lock().unwrap_or_else(|p| p.into_inner());
        if floor.as_ref().is_none_or(|f| high > f) {
            *floor = Some(high.clone());
        }
    }

    /// The expiry of `key` at its deadline, if this node is still its partition's head and the
    /// row still holds that expired value: the store's delete through the chain, then notified.
    async fn expire(&self, partition: u32, key: Key) {
        for _ in 0..MAX_ATTEMPTS {
            let (row, version) = match self.driver.read(partition, key.clone(), STEP_TIMEOUT).await
            {
                Answer::Value {
                    value: Some(row),
                    version: Some(version),
                } => (row, version),
                // Deleted meanwhile, or not the head any more (the new head took the deadline over).
                Answer::Value { value: None, .. } | Answer::NotHead { .. } => return,
                _ => {
                    // No view held for a moment (a lease renewal, a change): try again later.
                    let retry = self.clock.now_ms().saturating_add(1_000);
                    self.deadlines.schedule(partition, key, retry);
                    return;
                }
            };
            let now_ms = self.clock.now_ms();
            match rows::delta_of(&row).ok().and_then(|d| rows::deadline(&d)) {
                Some(deadline) if deadline <= now_ms => {}
                Some(deadline) => return self.deadlines.schedule(partition, key, deadline),
                None => return,
            }
            let floor = self.floor.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some((value, delete)) =
                expiry::delete_of(&self.config.store, &row, now_ms, floor.as_ref())
            else {
                return;
            };
            self.raise_floor(delete.version());
            let write = Write {
                key: key.clone(),
                value: Some(value),
                version: Version {
                    wall_ms: delete.version().wall_ms,
                    counter: delete.version().counter,
                    node: self.config.node,
                },
                expect: Expect::Version(version),
            };
            match self.driver.write(partition, write, STEP_TIMEOUT).await {
                Answer::Written { .. } => {
                    if self.notifier.is_observed(&key) {
                        let change = rows::committed_after(&delete, Some(&row));
                        self.notifier.publish(change).await;
                    }
                    return;
                }
                Answer::ConditionFailed { .. } | Answer::StaleVersion { .. } => continue,
                other => {
                    tracing::debug!(partition, "expiry delete not written now: {other:?}");
                    let retry = self.clock.now_ms().saturating_add(1_000);
                    self.deadlines.schedule(partition, key, retry);
                    return;
                }
            }
        }
    }

    /// For each partition this node became the head of (a new view): the deadlines of its rows,
    /// and the writes its predecessor left locked — completed by the chain's repair, then notified
    /// here, since the head that started them never answered them.
    async fn take_over(&self) {
        let Some(count) = self.node.partition_count() else {
            return;
        };
        for partition in 0..count {
            let Some(p) = self.node.partition(partition) else {
                continue;
            };
            if self.head_of(partition) != Some(self.node.id()) {
                continue;
            }
            let view = p.view;
            let seen = self
                .taken_over
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&partition)
                == Some(&view);
            if seen {
                continue;
            }
            let looked = self
                .driver
                .visit(partition, move |replica, head| {
                    let acting = replica.view().map(|v| v.id);
                    (head && acting == Some(view)).then(|| {
                        let mut deadlines = Vec::new();
                        let mut locked = Vec::new();
                        for (key, row) in replica.rows() {
                            if row.locked {
                                locked.push(key.clone());
                            }
                            let deadline = row
                                .value
                                .as_deref()
                                .and_then(|v| rows::delta_of(v).ok())
                                .and_then(|d| rows::deadline(&d));
                            if let Some(deadline) = deadline {
                                deadlines.push((key.clone(), deadline));
                            }
                        }
                        (deadlines, locked)
                    })
                })
                .await
                .flatten();
            let Some((deadlines, locked)) = looked else {
                continue;
            };
            self.taken_over
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(partition, view);
            tracing::debug!(
                partition,
                view,
                deadlines = deadlines.len(),
                locked = locked.len(),
                "partition taken over as its head"
            );
            for (key, deadline) in deadlines {
                self.deadlines.schedule(partition, key, deadline);
            }
            for key in locked {
                if !self.notifier.is_observed(&key) {
                    continue;
                }
                // The read flushes the locked row through the chain (Flush2pc), then answers it.
                if let Answer::Value {
                    value: Some(row), ..
                } = self.driver.read(partition, key, STEP_TIMEOUT).await
                {
                    if let Ok(delta) = rows::delta_of(&row) {
                        let change = self.notifier.with_prev(rows::committed(&delta));
                        self.notifier.publish(change).await;
                    }
                }
            }
        }
    }

    /// One SCAN page over every partition, each part at its partition's head (here or asked of
    /// the node that is), tried again while some partition has no head acting, within `budget`.
    /// `pattern` was checked by the node that received the request; pages and visits per
    /// partition are the store's SCAN limits.
    pub async fn scan(
        &self,
        pattern: Vec<u8>,
        after: Option<Vec<u8>>,
        budget: Duration,
    ) -> Result<(Vec<Key>, Option<Key>), String> {
        let limits = &self.config.store.limits;
        let page = ScanPage {
            pattern,
            after,
            page_keys: u32::try_from(limits.scan_page_keys).unwrap_or(u32::MAX),
            visit_max: u32::try_from(limits.scan_visit_max).unwrap_or(u32::MAX),
        };
        let started = Instant::now();
        let budget = budget.min(MAX_TRY);
        let count = self
            .node
            .partition_count()
            .ok_or("the cluster has not formed yet")?;
        let mut parts: BTreeMap<u32, PartScan> = BTreeMap::new();
        loop {
            let missing: Vec<u32> = (0..count).filter(|p| !parts.contains_key(p)).collect();
            if missing.is_empty() {
                let page_keys = page.page_keys as usize;
                return Ok(scan::merge(parts.into_values().collect(), page_keys));
            }
            let mut by_head: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            for partition in &missing {
                if let Some(head) = self.head_of(*partition) {
                    by_head.entry(head).or_default().push(*partition);
                }
            }
            let mut calls = tokio::task::JoinSet::new();
            for (head, partitions) in by_head {
                if head == self.node.id() {
                    for (partition, part) in self.scan_here(partitions, &page).await {
                        if let Some(part) = part {
                            parts.insert(partition, part);
                        }
                    }
                    continue;
                }
                let Some(addr) = self.node.addr_of(head) else {
                    continue;
                };
                let transport = self.node.transport();
                let frame = encode(&DataRequest::Scan {
                    partitions,
                    page: page.clone(),
                });
                calls.spawn(async move {
                    transport
                        .call(&addr, Request::Data(frame), STEP_TIMEOUT)
                        .await
                });
            }
            while let Some(answer) = calls.join_next().await {
                if let Ok(Ok(Response::Data(bytes))) = answer {
                    if let Ok(DataResponse::Scanned(answered)) = decode::<DataResponse>(&bytes) {
                        for (partition, part) in answered {
                            if let Some(part) = part {
                                parts.insert(partition, part);
                            }
                        }
                    }
                }
            }
            if parts.len() as u32 == count {
                continue;
            }
            if started.elapsed() + RETRY_EVERY >= budget {
                return Err(format!(
                    "{} of {count} partitions had no head acting",
                    count as usize - parts.len()
                ));
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }

    /// The parts of a SCAN page of `partitions` whose head this node is now.
    async fn scan_here(
        &self,
        partitions: Vec<u32>,
        page: &ScanPage,
    ) -> Vec<(u32, Option<PartScan>)> {
        let glob = match Glob::new(&page.pattern) {
            Ok(glob) => glob,
            Err(e) => {
                // The receiving node checked the pattern: a bug, or a node of another version.
                tracing::warn!("SCAN pattern refused at the head: {e}");
                return partitions.into_iter().map(|p| (p, None)).collect();
            }
        };
        let now_ms = self.clock.now_ms();
        let mut answered = Vec::with_capacity(partitions.len());
        for partition in partitions {
            let (glob, page) = (glob.clone(), page.clone());
            let part = self
                .driver
                .visit(partition, move |replica, head| {
                    head.then(|| scan::part(replica.rows(), &glob, &page, now_ms))
                })
                .await
                .flatten();
            answered.push((partition, part));
        }
        answered
    }
}
