//! The driver of this node's replicas: one task owns every partition's [`Replica`] and carries out
//! what they ask — batches appended to the chain log (and `durable` once fsynced), messages sent
//! over the cluster transport, answers handed to the waiting requests, catch-up reported to the
//! control plane. Views come from the control plane's acting view (the lease rule: a replica
//! acts only while this node holds a lease for the view), checked at every tick and before every
//! request; ticks come from a timer.
//!
//! Group commit: each turn takes every input already queued (up to [`MAX_INPUTS_PER_TURN`]) before
//! it carries out the replicas' outputs, so the writes and messages that arrived together become
//! one log batch per partition (one group-commit fsync for all of them) and one message per peer
//! per partition, which [`Peers`] sends on in one frame per hop.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use mqstate_chain::{Answer, Config, Item, Key, Message, Output, Replica, Restored, View, Write};
use mqstate_clock::SharedClock;
use mqstate_cluster::transport::Request;
use mqstate_cluster::ClusterNode;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::batch::Peers;
use crate::compaction::Contents;
use crate::log::ChainLog;
use crate::notify::TrailNotes;
use crate::recent::Recent;
use crate::space::{self, CatchUp};
use crate::wire::{encode, DataRequest};
use crate::STEP_TIMEOUT;

/// How often replicas tick (resends, repair) and views are checked against the control plane.
pub const TICK: Duration = Duration::from_millis(100);
/// Inputs taken in one turn at most, so ticks and the log's durability reports are not starved.
pub const MAX_INPUTS_PER_TURN: usize = 1024;

enum Input {
    Read {
        partition: u32,
        key: Key,
        answer: oneshot::Sender<Answer>,
    },
    Write {
        partition: u32,
        write: Write,
        answer: oneshot::Sender<Answer>,
    },
    /// Someone waiting on `partition` gave up: forget the requests whose asker is gone.
    Cancel {
        partition: u32,
    },
    Receive {
        partition: u32,
        message: Message,
    },
    Durable {
        partition: u32,
        index: u64,
    },
    /// Look at the replica of `partition` (its rows) under the control plane's current view.
    Visit {
        partition: u32,
        visit: Visitor,
    },
}

/// A look at a replica: called with it and whether it acts as its partition's head now.
type Visitor = Box<dyn FnOnce(&Replica, bool) + Send>;

/// A handle on the driver task.
#[derive(Clone)]
pub struct Driver {
    tx: mpsc::UnboundedSender<Input>,
}

impl Driver {
    /// Starts the driver task; it runs until `stop` turns true, then closes the log.
    pub fn start(
        node: Arc<ClusterNode>,
        log: ChainLog,
        restored: BTreeMap<u32, Restored>,
        recent: Arc<Recent>,
        trail: TrailNotes,
        clock: SharedClock,
        stop: watch::Receiver<bool>,
    ) -> (Driver, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let actor = Actor {
            id: node.id(),
            node: Arc::clone(&node),
            log,
            restored,
            replicas: BTreeMap::new(),
            waiting: BTreeMap::new(),
            next_request: 1,
            peers: Peers::new(Arc::clone(&node)),
            tx: tx.clone(),
            catch_up: CatchUp::default(),
            failpoints: mqstate_wal::Failpoints::from_env(),
            recent,
            trail,
            clock,
        };
        let task = tokio::spawn(actor.run(rx, stop));
        (Driver { tx }, task)
    }

    /// A linearizable read of `key` at this node's replica of `partition` (the head answers;
    /// others answer `NotHead`). `Unavailable` if no answer within `timeout`.
    pub async fn read(&self, partition: u32, key: Key, timeout: Duration) -> Answer {
        let (answer, rx) = oneshot::channel();
        self.ask(
            partition,
            Input::Read {
                partition,
                key,
                answer,
            },
            rx,
            timeout,
        )
        .await
    }

    /// A write through the chain; `Unavailable` if no answer within `timeout` (its outcome is then
    /// unknown: it may still complete).
    pub async fn write(&self, partition: u32, write: Write, timeout: Duration) -> Answer {
        let (answer, rx) = oneshot::channel();
        self.ask(
            partition,
            Input::Write {
                partition,
                write,
                answer,
            },
            rx,
            timeout,
        )
        .await
    }

    async fn ask(
        &self,
        partition: u32,
        input: Input,
        rx: oneshot::Receiver<Answer>,
        timeout: Duration,
    ) -> Answer {
        if self.tx.send(input).is_err() {
            return Answer::Unavailable;
        }
        let mut rx = rx;
        match tokio::time::timeout(timeout, &mut rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Answer::Unavailable,
            Err(_) => {
                // The driver finds the answer channel closed and the replica forgets the request.
                drop(rx);
                let _ = self.tx.send(Input::Cancel { partition });
                Answer::Unavailable
            }
        }
    }

    /// Runs `look` on the replica of `partition` in the driver task (after giving it the current
    /// view), with whether it acts as the head; `None` if the driver is gone. For scans of the
    /// rows (SCAN, expiry deadlines, a new head's take-over): `look` must be quick.
    pub async fn visit<R: Send + 'static>(
        &self,
        partition: u32,
        look: impl FnOnce(&Replica, bool) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = oneshot::channel();
        let visit: Visitor = Box::new(move |replica, head| {
            let _ = tx.send(look(replica, head));
        });
        self.tx.send(Input::Visit { partition, visit }).ok()?;
        rx.await.ok()
    }

    /// A chain message from a peer.
    pub fn receive(&self, partition: u32, message: Message) {
        let _ = self.tx.send(Input::Receive { partition, message });
    }
}

struct Actor {
    id: u64,
    node: Arc<ClusterNode>,
    log: ChainLog,
    /// What the log held at start, for replicas not created yet.
    restored: BTreeMap<u32, Restored>,
    replicas: BTreeMap<u32, Replica>,
    /// Requests waiting for their answer, by the replica's request id; in request order (what is
    /// forgotten or dropped goes in that order: deterministic under simulation).
    waiting: BTreeMap<u64, (u32, oneshot::Sender<Answer>)>,
    next_request: u64,
    peers: Peers,
    tx: mpsc::UnboundedSender<Input>,
    /// Catch-up of the two replicas (key spaces) of each partition.
    catch_up: CatchUp,
    failpoints: mqstate_wal::Failpoints,
    /// The requests of the rows persisted here, for the head's retries ([`crate::recent`]).
    recent: Arc<Recent>,
    /// The changes of observed keys persisted here, for observers that missed some ([`crate::trail`]).
    trail: TrailNotes,
    clock: SharedClock,
}

impl Actor {
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Input>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // In this order, not at random: deterministic under simulation. A tick is due
                // once per `TICK`, so it does not starve the inputs.
                biased;
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { break },
                _ = tick.tick() => self.tick().await,
                input = rx.recv() => match input {
                    Some(input) => self.turn(input, &mut rx).await,
                    None => break,
                },
            }
        }
        self.log.shutdown().await;
    }

    fn replica(&mut self, partition: u32) -> &mut Replica {
        let id = self.id;
        let restored = &mut self.restored;
        self.replicas
            .entry(partition)
            // Restored even with no records: this node may have forwarded rows of the partition
            // and lost them before their fsync, which the replica asks its successor for.
            .or_insert_with(|| {
                let restored = restored.remove(&partition).unwrap_or_default();
                Replica::restore(id, Config::default(), restored)
            })
    }

    /// Gives the replica the control plane's current answer: the view this node may act under
    /// now, or none.
    fn refresh_view(&mut self, partition: u32) {
        let view = self
            .node
            .acting_partition(space::control(partition))
            .map(|p| View {
                id: p.view,
                chain: p.chain,
                read_view: p.read_view,
            });
        self.replica(partition).set_view(view);
    }

    /// `first` and every input queued behind it, then the outputs of each partition they touched.
    async fn turn(&mut self, first: Input, rx: &mut mpsc::UnboundedReceiver<Input>) {
        let mut touched = BTreeSet::new();
        touched.insert(self.handle(first));
        for _ in 1..MAX_INPUTS_PER_TURN {
            let Ok(input) = rx.try_recv() else {
                break;
            };
            touched.insert(self.handle(input));
        }
        for partition in touched {
            self.carry_out(partition).await;
        }
        self.compact();
    }

    /// Between turns every replica's image is what the batches appended so far fold to: the
    /// moment a snapshot of the chain log may begin ([`crate::compaction`]).
    fn compact(&mut self) {
        if !self.log.snapshot_due() {
            return;
        }
        let mut images = self.restored.clone();
        for (&partition, replica) in &self.replicas {
            images.insert(partition, replica.image());
        }
        // Each noted as its rows were appended (or as its head answered it): the images fold
        // away the rows of all but each key's last.
        let requests = self.recent.live(self.clock.now_ms());
        self.log.snapshot(Contents { images, requests });
    }

    /// Gives `input` to its replica; returns the partition, whose outputs the caller carries out.
    fn handle(&mut self, input: Input) -> u32 {
        match input {
            Input::Read {
                partition,
                key,
                answer,
            } => {
                self.refresh_view(partition);
                let request = self.admit(partition, answer);
                self.replica(partition).read(request, key);
                partition
            }
            Input::Write {
                partition,
                write,
                answer,
            } => {
                self.refresh_view(partition);
                let request = self.admit(partition, answer);
                self.replica(partition).write(request, write);
                partition
            }
            Input::Cancel { partition } => {
                let gone: Vec<u64> = self
                    .waiting
                    .iter()
                    .filter(|(_, (p, answer))| *p == partition && answer.is_closed())
                    .map(|(&id, _)| id)
                    .collect();
                for id in gone {
                    self.waiting.remove(&id);
                    self.replica(partition).cancel(id);
                }
                partition
            }
            Input::Receive { partition, message } => {
                crate::failpoint::on_receive(&self.failpoints, &message);
                self.refresh_view(partition);
                self.replica(partition).receive(message);
                partition
            }
            Input::Durable { partition, index } => {
                self.replica(partition).durable(index);
                partition
            }
            Input::Visit { partition, visit } => {
                self.refresh_view(partition);
                let id = self.id;
                let replica = self.replica(partition);
                let head = replica
                    .view()
                    .is_some_and(|v| v.clone().readable_first().head() == Some(id));
                visit(replica, head);
                partition
            }
        }
    }

    fn admit(&mut self, partition: u32, answer: oneshot::Sender<Answer>) -> u64 {
        let request = self.next_request;
        self.next_request += 1;
        self.waiting.insert(request, (partition, answer));
        request
    }

    async fn tick(&mut self) {
        let Some(count) = self.node.partition_count() else {
            return;
        };
        for partition in (0..count).flat_map(space::replicas) {
            let involved = self.replicas.contains_key(&partition)
                || self.restored.contains_key(&partition)
                || self
                    .node
                    .partition(space::control(partition))
                    .is_some_and(|p| p.chain.contains(&self.id));
            if !involved {
                continue;
            }
            self.refresh_view(partition);
            self.replica(partition).tick();
            self.carry_out(partition).await;
        }
        self.compact();
    }

    /// Does what the replica of `partition` asks, in order.
    async fn carry_out(&mut self, partition: u32) {
        let outputs = self.replica(partition).take_outputs();
        for output in outputs {
            match output {
                Output::Persist { index, records } => {
                    self.recent.note(partition, &records, self.clock.now_ms());
                    self.trail.note(partition, &records, self.clock.now_ms());
                    match self.log.append(partition, records).await {
                        Ok(commit) => {
                            let tx = self.tx.clone();
                            let failed = self.log.failed();
                            tokio::spawn(async move {
                                match commit.await {
                                    Ok(_) => {
                                        let _ = tx.send(Input::Durable { partition, index });
                                    }
                                    // Never reported durable: the replica does not advance what
                                    // depends on it; the chain treats this node as slow, then
                                    // the control plane as failed. No snapshot may cover it.
                                    Err(e) => {
                                        failed();
                                        tracing::error!(
                                            partition,
                                            "a chain batch could not be made durable: {e}"
                                        )
                                    }
                                }
                            });
                        }
                        Err(e) => {
                            tracing::error!(partition, "a chain batch could not be appended: {e}")
                        }
                    }
                }
                Output::Send { to, message } => {
                    self.before_send(partition, &message);
                    if message
                        .items
                        .iter()
                        .any(|item| matches!(item, Item::CopyDone))
                    {
                        self.send_recent(partition, to, message.view);
                    }
                    self.peers.send(to, partition, message)
                }
                Output::Reply { request, answer } => {
                    if let Some((_, waiting)) = self.waiting.remove(&request) {
                        let _ = waiting.send(answer);
                    }
                }
                Output::CaughtUp { view } => {
                    let Some(partition) = self.catch_up.reached(partition, view) else {
                        continue;
                    };
                    let node = Arc::clone(&self.node);
                    tokio::spawn(async move { node.report_caught_up(partition, view).await });
                }
            }
        }
    }

    /// With the end of a recovery copy, this head's remembered requests of `partition` go to the
    /// replica that caught up ([`DataRequest::RecentOfHead`]): it needs them to act as head, and
    /// the members it would ask may all fail or re-enter first (data-plane simulation, seed 6).
    /// Nothing if this head cannot vouch for its own (it re-entered too and is not synced yet).
    fn send_recent(&self, partition: u32, to: u64, view: u64) {
        if partition & space::SESSIONS != 0 {
            return;
        }
        let Some(entries) = self.recent.export(partition, self.clock.now_ms()) else {
            return;
        };
        let Some(addr) = self.node.addr_of(to) else {
            return;
        };
        let frame = encode(&DataRequest::RecentOfHead {
            partition,
            view,
            entries,
        });
        let transport = self.node.transport();
        tokio::spawn(async move {
            if let Err(e) = transport
                .call(&addr, Request::Data(frame), STEP_TIMEOUT)
                .await
            {
                tracing::debug!(to, partition, "remembered requests not delivered: {e}");
            }
        });
    }

    /// The chain failpoints (`crate::failpoint`), checked before a chain message leaves.
    fn before_send(&self, partition: u32, message: &Message) {
        if self.failpoints.is_armed() {
            let chain = self
                .node
                .partition(space::control(partition))
                .map(|p| p.chain)
                .unwrap_or_default();
            let position = chain.iter().position(|&n| n == self.id);
            crate::failpoint::before_send(&self.failpoints, position, chain.len(), message);
        }
    }
}
