//! The deterministic simulation: three replicas of one partition, a control plane that changes
//! views the way `mqstate-cluster` does (survivors keep their order, a returning node re-enters at the
//! tail in the write view only, and enters the read view once it reports caught up; nobody acts while
//! a change is pending), clients that write and read through the head, and a seeded scheduler that
//! delivers messages in any order, drops some, fsyncs disks at random moments, and crashes one
//! replica at a time (power loss: unsynced batches are gone), restarting it quickly (same view) or
//! after it was removed.
//!
//! Each run records the clients' history and checks, per key: every acknowledged write survives
//! (the final read is at or above its version), versions never go backwards (in real-time order, and
//! in every replica's log), reads are linearizable (Wing–Gong–Lowe against a register), and at the
//! end every replica of the chain holds exactly the head's rows, none locked.
//!
//! `MQSTATE_CHAIN_SEEDS` (default 300) and `MQSTATE_CHAIN_STEPS` (default 4000) size the run;
//! `MQSTATE_CHAIN_SEED=N` runs one seed; `CHAIN_TRACE=1` prints its crashes and view changes.

mod harness;

use std::collections::{BTreeMap, BTreeSet};

use harness::{Cluster, Rng};
use mqstate_chain::{Answer, Config, Expect, NodeId, RequestId, Version, View, Write};
use mqstate_cluster::control::{Command, ControlState, MapConfig, Outcome};
use mqstate_wgl::register::{self as wgl, Kind};

const NODES: [NodeId; 3] = [1, 2, 3];
const KEYS: usize = 4;
const CLIENTS: usize = 6;
/// Steps without an answer after which a client gives up on an attempt (its write's outcome is then
/// unknown).
const TIMEOUT: u64 = 1500;

/// A row as compared across replicas: key, value, version, lock bit.
type RowView = (Vec<u8>, Option<Vec<u8>>, Version, bool);

#[derive(Debug, Clone)]
enum OpKind {
    Write(Option<u64>),
    Read,
}

#[derive(Debug, Clone)]
struct OpRec {
    key: usize,
    kind: OpKind,
    invoked: u64,
    returned: Option<u64>,
    /// A read's value.
    read: Option<Option<u64>>,
    version: Option<Version>,
    /// A read given up on: says nothing.
    abandoned: bool,
}

struct Attempt {
    request: RequestId,
    sent: u64,
}

struct Client {
    id: u64,
    clock: u64,
    op: Option<usize>,
    attempt: Option<Attempt>,
    target: Option<NodeId>,
}

struct Controller {
    view: View,
    up: BTreeSet<NodeId>,
    caught_up: BTreeSet<NodeId>,
    pending_until: Option<u64>,
}

impl Controller {
    fn desired(&self) -> View {
        let mut chain: Vec<NodeId> = self
            .view
            .chain
            .iter()
            .copied()
            .filter(|n| self.up.contains(n))
            .collect();
        for &n in &self.up {
            if !chain.contains(&n) {
                chain.push(n);
            }
        }
        let read_view = chain
            .iter()
            .copied()
            .filter(|n| self.view.read_view.contains(n) || self.caught_up.contains(n))
            .collect();
        View {
            id: self.view.id + 1,
            chain,
            read_view,
        }
    }

    fn differs(&self) -> bool {
        let d = self.desired();
        d.chain != self.view.chain || d.read_view != self.view.read_view
    }
}

/// Views from `mqstate-cluster`'s control-plane state machine on a simulated clock: every live
/// node renews its lease every lease/3 (an isolated one cannot), the leader ticks, and a node acts
/// under the partition's view only while its own lease is valid and no change is pending.
struct RaftControl {
    state: ControlState,
    /// When each node's current lease was granted, as the node knows it (lost at a crash).
    leases: BTreeMap<NodeId, u64>,
    /// The view each live node was last given.
    given: BTreeMap<NodeId, Option<View>>,
}

const MS_PER_STEP: u64 = 10;
const LEASE_MS: u64 = 300;
const CLOCK_FACTOR_MS: u64 = 100;

impl RaftControl {
    fn new() -> RaftControl {
        let mut state = ControlState::default();
        state.set_members(&NODES.iter().map(|&n| (n, format!("n{n}"))).collect());
        state.apply(&Command::Init {
            config: MapConfig {
                partition_count: 1,
                replication_factor: NODES.len() as u32,
                lease_ms: LEASE_MS,
                clock_factor_ms: CLOCK_FACTOR_MS,
            },
            now_ms: 0,
        });
        RaftControl {
            state,
            leases: BTreeMap::new(),
            given: BTreeMap::new(),
        }
    }

    /// The published view of the partition.
    fn published(&self) -> View {
        let p = &self.state.partitions[0];
        View {
            id: p.view,
            chain: p.chain.clone(),
            read_view: p.read_view.clone(),
        }
    }

    fn pending(&self) -> bool {
        self.state.partitions[0].pending.is_some()
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    seeds: u64,
    steps: u64,
    ops: u64,
    acked_writes: u64,
    reads: u64,
    unknown_writes: u64,
    crashes: u64,
    isolations: u64,
    quick_restarts: u64,
    view_changes: u64,
    delivered: u64,
    dropped: u64,
    repaired: u64,
    flushes: u64,
    rejected: u64,
    joins_caught_up: u64,
}

struct Sim {
    seed: u64,
    rng: Rng,
    c: Cluster,
    ctl: Controller,
    /// When set, views come from the real control plane and `ctl.view` mirrors its published view.
    raft: Option<RaftControl>,
    clients: Vec<Client>,
    ops: Vec<OpRec>,
    requests: BTreeMap<RequestId, usize>,
    next_request: RequestId,
    next_value: u64,
    step: u64,
    /// The crashed node and the step at which the control plane removes it.
    down: Vec<(NodeId, u64)>,
    /// How many replicas may be down at once: 1, or on odd seeds 2 (a chain of three tolerates two
    /// failures as long as one replica of the read view survives).
    max_down: usize,
    /// Nodes cut off from the other replicas (clients still reach them), and when the control plane
    /// removes them: an old head that is alive but no longer acts, and re-enters at the tail.
    isolated: Vec<(NodeId, u64)>,
    stopping: bool,
    drop_weight: usize,
    totals: Totals,
}

impl Sim {
    fn new(seed: u64, real_control_plane: bool) -> Sim {
        let mut rng = Rng::new(seed);
        let config = Config {
            copy_batch: 1 + rng.below(4),
            repair_batch: 1 + rng.below(8),
            resend_ticks: 2 + rng.below(4) as u64,
        };
        let mut c = Cluster::new(&NODES, config);
        let first = View {
            id: 1,
            chain: NODES.to_vec(),
            read_view: NODES.to_vec(),
        };
        c.publish(&first);
        let clients = (0..CLIENTS as u64)
            .map(|id| Client {
                id: 100 + id,
                clock: 0,
                op: None,
                attempt: None,
                target: None,
            })
            .collect();
        let drop_weight = [0, 1, 4][(seed % 3) as usize];
        Sim {
            seed,
            rng,
            c,
            ctl: Controller {
                view: first,
                up: NODES.iter().copied().collect(),
                caught_up: BTreeSet::new(),
                pending_until: None,
            },
            raft: real_control_plane.then(RaftControl::new),
            clients,
            ops: Vec::new(),
            requests: BTreeMap::new(),
            next_request: 1,
            next_value: 1,
            step: 0,
            down: Vec::new(),
            max_down: 1 + (seed % 2) as usize,
            isolated: Vec::new(),
            stopping: false,
            drop_weight,
            totals: Totals::default(),
        }
    }

    fn run(mut self, steps: u64) -> Totals {
        for step in 0..steps {
            self.step = step;
            self.one_step();
        }
        self.finish();
        self.check();
        let mut t = self.totals;
        t.seeds = 1;
        t.steps = steps;
        t.delivered = self.c.delivered;
        t.dropped = self.c.dropped;
        for id in self.c.alive_ids() {
            let s = self.c.replica(id).stats();
            t.repaired += s.repaired;
            t.flushes += s.flushes;
            t.rejected += s.rejected_messages;
        }
        t
    }

    fn one_step(&mut self) {
        if self.raft.is_some() {
            self.raft_step();
        } else {
            self.mini_step();
        }
        self.random_action();
        self.after_step();
    }

    fn raft_step(&mut self) {
        let now = self.step * MS_PER_STEP;
        let alive = self.c.alive_ids();
        let isolated: Vec<NodeId> = self.isolated.iter().map(|&(n, _)| n).collect();
        let Some(raft) = self.raft.as_mut() else {
            return;
        };
        let renew_every = LEASE_MS / 3 / MS_PER_STEP;
        for &n in &alive {
            if isolated.contains(&n) || !(self.step + n).is_multiple_of(renew_every) {
                continue;
            }
            let seen_epoch = raft.state.epoch;
            let outcome = raft.state.apply(&Command::Renew {
                node: n,
                seen_epoch,
                now_ms: now,
            });
            if matches!(outcome, Outcome::Granted { .. }) {
                raft.leases.insert(n, now);
            }
        }
        if self.step.is_multiple_of(5) {
            raft.state.apply(&Command::Tick { now_ms: now });
        }
        let published = raft.published();
        if published.id != self.ctl.view.id {
            self.totals.view_changes += 1;
            if std::env::var("CHAIN_TRACE").is_ok() {
                eprintln!(
                    "step {} view {:?} down {:?} isolated {:?}",
                    self.step, published, self.down, self.isolated
                );
            }
        }
        self.ctl.view = published.clone();
        self.ctl.pending_until = raft.pending().then_some(u64::MAX);
        let mut changes = Vec::new();
        for &n in &alive {
            let lease_valid = raft.leases.get(&n).is_some_and(|&at| now < at + LEASE_MS);
            let view = raft
                .state
                .acting_view(n, 0)
                .filter(|_| lease_valid)
                .map(|_| published.clone());
            if raft.given.get(&n) != Some(&view) {
                raft.given.insert(n, view.clone());
                changes.push((n, view));
            }
        }
        for (n, view) in changes {
            self.c.set_view(n, view);
        }
    }

    fn mini_step(&mut self) {
        if self
            .ctl
            .pending_until
            .is_some_and(|until| self.step >= until)
        {
            self.publish();
        }
        for (n, at) in self.down.clone().into_iter().chain(self.isolated.clone()) {
            if self.step >= at && self.ctl.up.contains(&n) {
                self.ctl.up.remove(&n);
                self.ctl.caught_up.remove(&n);
                self.request_change();
            }
        }
    }

    fn random_action(&mut self) {
        let roll = self.rng.below(100 + self.drop_weight);
        match roll {
            0..45 => {
                if !self.c.net.is_empty() {
                    let i = self.rng.below(self.c.net.len());
                    let (to, message) = &self.c.net[i];
                    let cut = self
                        .isolated
                        .iter()
                        .any(|&(n, _)| n == *to || n == message.from);
                    if cut {
                        self.c.drop_message(i);
                    } else {
                        self.c.deliver(i);
                    }
                }
            }
            45..60 => {
                let alive = self.c.alive_ids();
                let id = alive[self.rng.below(alive.len())];
                let pending = &self.c.nodes[&id].disk.pending;
                let upto = if pending.is_empty() || self.rng.chance(1, 2) {
                    None
                } else {
                    Some(pending[self.rng.below(pending.len())].0)
                };
                self.c.sync(id, upto);
            }
            60..68 => {
                let alive = self.c.alive_ids();
                let id = alive[self.rng.below(alive.len())];
                self.c.with(id, |r| r.tick());
            }
            68..97 => {
                let ci = self.rng.below(CLIENTS);
                self.client_step(ci);
            }
            97..100 => self.fault(),
            _ => {
                if !self.c.net.is_empty() {
                    let i = self.rng.below(self.c.net.len());
                    self.c.drop_message(i);
                }
            }
        }
    }

    fn after_step(&mut self) {
        for (node, view) in std::mem::take(&mut self.c.caught_up) {
            if let Some(raft) = self.raft.as_mut() {
                // The control plane ignores a report from a replaced view; counted only when it
                // can take effect.
                if view == raft.state.partitions[0].view && !raft.pending() {
                    raft.state.apply(&Command::CaughtUp {
                        node,
                        partitions: vec![(0, view)],
                    });
                    self.totals.joins_caught_up += 1;
                }
                continue;
            }
            if view == self.ctl.view.id && self.ctl.view.chain.contains(&node) {
                self.ctl.caught_up.insert(node);
                self.totals.joins_caught_up += 1;
                self.request_change();
            }
        }
        self.process_replies();
    }

    fn fault(&mut self) {
        if !self.down.is_empty() && self.rng.chance(1, 5) {
            let (n, _) = self.down[self.rng.below(self.down.len())];
            self.restart(n);
            return;
        }
        if !self.isolated.is_empty() && self.rng.chance(1, 5) {
            let (n, _) = self.isolated.remove(self.rng.below(self.isolated.len()));
            self.heal(n);
            return;
        }
        if self.down.len() + self.isolated.len() >= self.max_down
            || self.stopping
            || self.ctl.pending_until.is_some()
            || !self.rng.chance(1, 25)
        {
            return;
        }
        let n = NODES[self.rng.below(NODES.len())];
        let survivor = self
            .ctl
            .view
            .read_view
            .iter()
            .any(|&m| m != n && self.c.alive(m) && self.isolated.iter().all(|&(i, _)| i != m));
        let isolated = self.isolated.iter().any(|&(i, _)| i == n);
        if !self.c.alive(n) || isolated || !survivor {
            return;
        }
        let removal = self.step + 20 + self.rng.below(300) as u64;
        if self.rng.chance(1, 3) {
            self.totals.isolations += 1;
            self.isolated.push((n, removal));
            return;
        }
        self.c.crash(n);
        if std::env::var("CHAIN_TRACE").is_ok() {
            eprintln!("step {} crash {n}", self.step);
        }
        self.totals.crashes += 1;
        self.down.push((n, removal));
    }

    fn restart(&mut self, n: NodeId) {
        self.c.restart(n);
        self.down.retain(|&(m, _)| m != n);
        if let Some(raft) = self.raft.as_mut() {
            // A new process: no lease until it renews, no view given yet.
            raft.leases.remove(&n);
            raft.given.remove(&n);
            if raft.state.members[&n].up {
                self.totals.quick_restarts += 1;
            }
            return;
        }
        if self.ctl.up.contains(&n) {
            self.totals.quick_restarts += 1;
            if self.ctl.pending_until.is_none() {
                let view = self.ctl.view.clone();
                self.c.set_view(n, Some(view));
            }
        } else {
            self.ctl.up.insert(n);
            self.request_change();
        }
    }

    /// The cut-off node reaches the others again; if it was removed meanwhile, it re-enters at the
    /// tail.
    fn heal(&mut self, n: NodeId) {
        if self.raft.is_some() {
            return; // it renews again by itself
        }
        if !self.ctl.up.contains(&n) {
            self.ctl.up.insert(n);
            self.request_change();
        }
    }

    fn request_change(&mut self) {
        if self.ctl.pending_until.is_none() && self.ctl.differs() {
            // The lease rule: nobody acts under the old view from here on.
            self.c.pause();
            self.ctl.pending_until = Some(self.step + 5 + self.rng.below(40) as u64);
        }
    }

    fn publish(&mut self) {
        let view = self.ctl.desired();
        self.ctl.view = view.clone();
        self.ctl.pending_until = None;
        self.ctl
            .caught_up
            .retain(|n| view.chain.contains(n) && !view.read_view.contains(n));
        self.totals.view_changes += 1;
        self.c.publish(&view);
        self.request_change();
    }

    fn client_step(&mut self, ci: usize) {
        let step = self.step;
        let client = &mut self.clients[ci];
        if let Some(attempt) = &client.attempt {
            if step.saturating_sub(attempt.sent) > TIMEOUT {
                self.abandon(ci);
            }
            return;
        }
        if client.op.is_none() {
            if self.stopping {
                return;
            }
            let key = self.rng.below(KEYS);
            let kind = if self.rng.chance(1, 2) {
                OpKind::Read
            } else if self.rng.chance(1, 10) {
                OpKind::Write(None)
            } else {
                self.next_value += 1;
                OpKind::Write(Some(self.next_value))
            };
            self.ops.push(OpRec {
                key,
                kind,
                invoked: step,
                returned: None,
                read: None,
                version: None,
                abandoned: false,
            });
            self.clients[ci].op = Some(self.ops.len() - 1);
        }
        self.send(ci);
    }

    /// Gives up on the client's attempt: a write's outcome is now unknown; a read says nothing.
    fn abandon(&mut self, ci: usize) {
        let client = &mut self.clients[ci];
        if let Some(op) = client.op.take() {
            if matches!(self.ops[op].kind, OpKind::Read) {
                self.ops[op].abandoned = true;
            }
        }
        client.attempt = None;
        client.target = None;
    }

    fn send(&mut self, ci: usize) {
        let target = match self.clients[ci].target.take() {
            Some(t) => t,
            None => NODES[self.rng.below(NODES.len())],
        };
        let request = self.next_request;
        self.next_request += 1;
        self.requests.insert(request, ci);
        let client = &mut self.clients[ci];
        let Some(op) = client.op else {
            return;
        };
        client.attempt = Some(Attempt {
            request,
            sent: self.step,
        });
        let rec = &self.ops[op];
        let key = format!("key{}", rec.key).into_bytes();
        match rec.kind {
            OpKind::Read => {
                self.c.with(target, |r| r.read(request, key));
            }
            OpKind::Write(value) => {
                client.clock += 1;
                let write = Write {
                    key,
                    value: value.map(|v| v.to_be_bytes().to_vec()),
                    version: Version {
                        wall_ms: client.clock,
                        counter: 0,
                        node: client.id,
                    },
                    expect: Expect::Any,
                };
                self.c.with(target, |r| r.write(request, write));
            }
        }
    }

    fn process_replies(&mut self) {
        for (request, answer) in std::mem::take(&mut self.c.replies) {
            let Some(ci) = self.requests.remove(&request) else {
                continue;
            };
            let client = &mut self.clients[ci];
            if client.attempt.as_ref().map(|a| a.request) != Some(request) {
                continue; // a late answer to an attempt given up on
            }
            client.attempt = None;
            let Some(op) = client.op else {
                continue;
            };
            match answer {
                Answer::Written { version } => {
                    // The promise: every replica of the write view has fsynced it.
                    let key = format!("key{}", self.ops[op].key).into_bytes();
                    for &n in &self.ctl.view.chain {
                        let on_disk = self.c.nodes[&n].disk.durable_versions.get(&key);
                        assert!(
                            on_disk >= Some(&version),
                            "seed {}: write {version:?} acknowledged while node {n} of {:?} has {on_disk:?} on disk",
                            self.seed,
                            self.ctl.view
                        );
                    }
                    client.clock = client.clock.max(version.wall_ms);
                    client.op = None;
                    self.ops[op].returned = Some(self.step);
                    self.ops[op].version = Some(version);
                }
                Answer::Value { value, version } => {
                    if let Some(v) = version {
                        client.clock = client.clock.max(v.wall_ms);
                    }
                    client.op = None;
                    let value = value.map(|bytes| {
                        u64::from_be_bytes(bytes.as_slice().try_into().expect("8 bytes"))
                    });
                    self.ops[op].returned = Some(self.step);
                    self.ops[op].read = Some(value);
                    self.ops[op].version = version;
                }
                Answer::NotHead { head } => client.target = head,
                Answer::Unavailable => {}
                Answer::StaleVersion { current } => {
                    client.clock = client.clock.max(current.wall_ms);
                }
                Answer::ConditionFailed { .. } => {
                    panic!("seed {}: no conditions are used", self.seed)
                }
            }
        }
    }

    /// Heal, let everything complete, then read every key at the head.
    fn finish(&mut self) {
        self.stopping = true;
        for (n, _) in self.down.clone() {
            self.restart(n);
        }
        for (n, _) in std::mem::take(&mut self.isolated) {
            self.heal(n);
        }
        let mut converged = false;
        for _ in 0..300 {
            self.step += 1;
            if self.raft.is_some() {
                for _ in 0..10 {
                    self.step += 1;
                    self.raft_step();
                    self.after_step();
                }
            } else if self.ctl.pending_until.is_some() {
                self.publish();
            }
            self.c.settle(30);
            self.after_step();
            for ci in 0..CLIENTS {
                if self.clients[ci].op.is_some() && self.clients[ci].attempt.is_none() {
                    self.send(ci);
                }
            }
            self.c.settle(30);
            self.after_step();
            if self.ctl.pending_until.is_none() && self.c.net.is_empty() {
                // Whatever is still unanswered now was lost with a message or a crash.
                for ci in 0..CLIENTS {
                    if self.clients[ci].attempt.is_some() {
                        self.abandon(ci);
                    }
                }
            }
            let quiet = self
                .c
                .alive_ids()
                .iter()
                .all(|&id| self.c.replica(id).is_quiet());
            let busy_clients = self.clients.iter().any(|c| c.op.is_some());
            let settled = match &self.raft {
                Some(raft) => {
                    !raft.pending()
                        && raft.state.members.values().all(|m| m.up)
                        && self.ctl.view.chain.len() == NODES.len()
                }
                None => !self.ctl.differs(),
            };
            if self.ctl.pending_until.is_none()
                && settled
                && self.ctl.view.read_view == self.ctl.view.chain
                && quiet
                && !busy_clients
                && self.c.net.is_empty()
            {
                converged = true;
                break;
            }
        }
        assert!(
            converged,
            "seed {}: the chain did not converge (view {:?}, pending {:?}, clients busy {}, net {})\n{:#?}",
            self.seed,
            self.ctl.view,
            self.ctl.pending_until,
            self.clients.iter().filter(|c| c.op.is_some()).count(),
            self.c.net.len(),
            self.c
                .alive_ids()
                .iter()
                .map(|&id| self.c.replica(id))
                .collect::<Vec<_>>()
        );
        let head = self.ctl.view.chain[0];
        for key in 0..KEYS {
            self.step += 1;
            let invoked = self.step;
            let request = self.next_request;
            self.next_request += 1;
            self.c
                .with(head, |r| r.read(request, format!("key{key}").into_bytes()));
            self.c.settle(10);
            self.step += 1;
            let Some(Answer::Value { value, version }) = self.c.answer(request) else {
                panic!(
                    "seed {}: the final read of key{key} was not answered",
                    self.seed
                );
            };
            let value =
                value.map(|b| u64::from_be_bytes(b.as_slice().try_into().expect("8 bytes")));
            self.ops.push(OpRec {
                key,
                kind: OpKind::Read,
                invoked,
                returned: Some(self.step),
                read: Some(value),
                version,
                abandoned: false,
            });
        }
    }

    fn check(&mut self) {
        let seed = self.seed;
        // Every replica of the chain holds exactly the head's rows, none locked.
        let head = self.ctl.view.chain[0];
        let rows = |id: NodeId| -> Vec<RowView> {
            self.c
                .replica(id)
                .rows()
                .iter()
                .map(|(k, r)| (k.clone(), r.value.clone(), r.version, r.locked))
                .collect()
        };
        let head_rows = rows(head);
        assert!(head_rows.iter().all(|r| !r.3), "seed {seed}: a lock left");
        for &id in &self.ctl.view.chain {
            assert_eq!(
                rows(id),
                head_rows,
                "seed {seed}: node {id} differs from the head"
            );
        }

        for key in 0..KEYS {
            let ops: Vec<&OpRec> = self
                .ops
                .iter()
                .filter(|o| o.key == key && !o.abandoned)
                .filter(|o| matches!(o.kind, OpKind::Write(_)) || o.returned.is_some())
                .collect();
            for o in &ops {
                self.totals.ops += 1;
                match (&o.kind, o.returned) {
                    (OpKind::Write(_), Some(_)) => self.totals.acked_writes += 1,
                    (OpKind::Write(_), None) => self.totals.unknown_writes += 1,
                    (OpKind::Read, _) => self.totals.reads += 1,
                }
            }
            // Durability: the final read is at or above every acknowledged write.
            let final_read = ops.last().expect("the final read");
            for o in &ops {
                if let (OpKind::Write(value), Some(_), Some(v)) = (&o.kind, o.returned, o.version) {
                    assert!(
                        final_read.version >= Some(v),
                        "seed {seed}: acknowledged write {value:?}@{v:?} of key{key} lost (final {:?})",
                        final_read.version
                    );
                }
            }
            // Versions never go backwards in real-time order.
            for a in &ops {
                let (Some(ra), Some(va)) = (a.returned, a.version) else {
                    continue;
                };
                for b in &ops {
                    if b.invoked > ra && b.returned.is_some() {
                        assert!(
                            b.version >= Some(va),
                            "seed {seed}: key{key} went back from {va:?} to {:?}",
                            b.version
                        );
                    }
                }
            }
            // Linearizable as a register.
            let history: Vec<wgl::Op> = ops
                .iter()
                .map(|o| wgl::Op {
                    kind: match o.kind {
                        OpKind::Write(v) => Kind::Write(v),
                        OpKind::Read => Kind::Read(o.read.flatten()),
                    },
                    invoked: o.invoked,
                    returned: o.returned.unwrap_or(u64::MAX),
                })
                .collect();
            if let Err(e) = wgl::check(&history, None, 2_000_000) {
                panic!("seed {seed}: key{key}: {e}\n{ops:#?}");
            }
        }
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn simulated_chains_keep_every_acknowledged_write_and_stay_linearizable() {
    simulate(false, 300);
}

/// The same, with the views, leases and failure detection of `mqstate-cluster`'s control plane.
#[test]
fn simulated_chains_under_the_real_control_plane() {
    simulate(true, 150);
}

fn simulate(real_control_plane: bool, default_seeds: u64) {
    let steps = env("MQSTATE_CHAIN_STEPS", 4000);
    let seeds: Vec<u64> = match std::env::var("MQSTATE_CHAIN_SEED") {
        Ok(one) => vec![one.parse().expect("a seed number")],
        Err(_) => (0..env("MQSTATE_CHAIN_SEEDS", default_seeds)).collect(),
    };
    let mut all = Totals::default();
    for seed in seeds {
        let t = Sim::new(seed, real_control_plane).run(steps);
        all.seeds += t.seeds;
        all.steps += t.steps;
        all.ops += t.ops;
        all.acked_writes += t.acked_writes;
        all.reads += t.reads;
        all.unknown_writes += t.unknown_writes;
        all.crashes += t.crashes;
        all.isolations += t.isolations;
        all.quick_restarts += t.quick_restarts;
        all.view_changes += t.view_changes;
        all.delivered += t.delivered;
        all.dropped += t.dropped;
        all.repaired += t.repaired;
        all.flushes += t.flushes;
        all.rejected += t.rejected;
        all.joins_caught_up += t.joins_caught_up;
    }
    println!("{all:#?}");
    // The run exercised what it claims to check.
    assert!(all.acked_writes > 0 && all.reads > 0);
    if all.seeds >= 50 {
        assert!(all.crashes > 0 && all.quick_restarts > 0 && all.view_changes > 0);
        assert!(all.isolations > 0);
        assert!(all.joins_caught_up > 0 && all.dropped > 0 && all.repaired > 0);
    }
}
