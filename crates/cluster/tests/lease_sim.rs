//! A deterministic, seeded simulation of the control plane's lease rule: nodes with skewed clocks
//! renew leases through a leader over a network that delays, drops and partitions messages; nodes
//! crash and restart; leaders change. Raft itself is abstracted to what it guarantees (one history
//! of committed states; each node has applied a prefix of it, which only grows; a new leader has
//! all of it). After every simulated millisecond-step it checks the rule: no two nodes act on the
//! same partition under different views at the same time.
//!
//! Seeds: `LEASE_SIM_SEEDS` (default 60) starting at `LEASE_SIM_FIRST_SEED` (default 1).

use std::collections::BTreeMap;

use mqstate_cluster::control::{Command, ControlState, MapConfig, Outcome};
use mqstate_cluster::NodeId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LEASE_MS: u64 = 3_000;
const CLOCK_FACTOR_MS: u64 = 1_000;
const PARTITIONS: u32 = 8;
const STEP_MS: u64 = 10;
const SIMULATED_MS: u64 = 90_000;

#[derive(Debug, Clone, Copy)]
enum Message {
    RenewRequest {
        node: NodeId,
        sent_local_ms: u64,
        seen_epoch: u64,
    },
    RenewReply {
        node: NodeId,
        sent_local_ms: u64,
        lease_ms: u64,
        epoch: u64,
    },
}

struct SimNode {
    /// Offset of this node's clock from true time (|offset| ≤ clock factor / 2).
    clock_offset_ms: i64,
    alive: bool,
    /// How much of the committed history this node has applied.
    applied: usize,
    valid_until_local_ms: Option<u64>,
    lease_epoch: u64,
    next_renewal_ms: u64,
}

struct Sim {
    rng: StdRng,
    now_ms: u64,
    /// Every committed state, in order; `history[i]` after the i-th command.
    history: Vec<ControlState>,
    nodes: BTreeMap<NodeId, SimNode>,
    leader: Option<NodeId>,
    /// Nodes cut off from everyone else.
    isolated: Vec<NodeId>,
    in_flight: Vec<(u64, Message)>,
    violations: Vec<String>,
}

impl Sim {
    fn new(seed: u64, n: NodeId) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut state = ControlState::default();
        state.set_members(&(1..=n).map(|id| (id, format!("n{id}"))).collect());
        state.apply(&Command::Init {
            config: MapConfig {
                partition_count: PARTITIONS,
                replication_factor: 3,
                lease_ms: LEASE_MS,
                clock_factor_ms: CLOCK_FACTOR_MS,
            },
            now_ms: 0,
        });
        let half = (CLOCK_FACTOR_MS / 2) as i64;
        let nodes = (1..=n)
            .map(|id| {
                (
                    id,
                    SimNode {
                        clock_offset_ms: rng.gen_range(-half..=half),
                        alive: true,
                        applied: 0,
                        valid_until_local_ms: None,
                        lease_epoch: 0,
                        next_renewal_ms: rng.gen_range(0..LEASE_MS / 3),
                    },
                )
            })
            .collect();
        Sim {
            rng,
            now_ms: 0,
            history: vec![state],
            nodes,
            leader: Some(1),
            isolated: Vec::new(),
            in_flight: Vec::new(),
            violations: Vec::new(),
        }
    }

    fn local_ms(&self, id: NodeId) -> u64 {
        (self.now_ms as i64 + self.nodes[&id].clock_offset_ms).max(0) as u64
    }

    fn head(&self) -> &ControlState {
        self.history
            .last()
            .expect("history starts with the initial state")
    }

    fn reachable(&self, a: NodeId, b: NodeId) -> bool {
        a == b || (!self.isolated.contains(&a) && !self.isolated.contains(&b))
    }

    fn commit(&mut self, command: Command) -> Outcome {
        let mut next = self.head().clone();
        let outcome = next.apply(&command);
        self.history.push(next);
        if let Some(leader) = self.leader {
            self.nodes.get_mut(&leader).expect("leader exists").applied = self.history.len() - 1;
        }
        outcome
    }

    fn send(&mut self, from: NodeId, to: NodeId, message: Message) {
        let lost = !self.reachable(from, to) || self.rng.gen_bool(0.05);
        if !lost {
            let delay = self.rng.gen_range(1..200);
            self.in_flight.push((self.now_ms + delay, message));
        }
    }

    fn perturb(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        // Crashes and restarts.
        if self.rng.gen_bool(0.002) {
            let id = ids[self.rng.gen_range(0..ids.len())];
            let node = self.nodes.get_mut(&id).expect("node exists");
            node.alive = !node.alive;
            node.valid_until_local_ms = None; // a crash forgets the lease (restarts act only after renewing)
            if !node.alive && self.leader == Some(id) {
                self.leader = None;
            }
        }
        // Partitions come and go.
        if self.rng.gen_bool(0.001) {
            self.isolated.clear();
            if self.rng.gen_bool(0.7) {
                let id = ids[self.rng.gen_range(0..ids.len())];
                self.isolated.push(id);
                if self.leader == Some(id) {
                    // The old leader keeps believing for a while; Raft's new leader has everything
                    // committed. Modelled as: leadership moves, the old one can commit nothing more.
                    self.leader = None;
                }
            }
        }
        // A majority side without a leader elects one.
        if self.leader.is_none() && self.rng.gen_bool(0.01) {
            let candidates: Vec<NodeId> = ids
                .iter()
                .copied()
                .filter(|id| self.nodes[id].alive && !self.isolated.contains(id))
                .collect();
            if candidates.len() * 2 > ids.len() {
                let id = candidates[self.rng.gen_range(0..candidates.len())];
                self.leader = Some(id);
                self.nodes.get_mut(&id).expect("node exists").applied = self.history.len() - 1;
            }
        }
    }

    fn step(&mut self) {
        self.now_ms += STEP_MS;
        self.perturb();
        // Replication: connected live nodes apply more of the history.
        let head = self.history.len() - 1;
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for &id in &ids {
            let connected = self.leader.is_some_and(|leader| self.reachable(leader, id));
            if self.nodes[&id].alive && connected && self.rng.gen_bool(0.5) {
                let node = self.nodes.get_mut(&id).expect("node exists");
                node.applied = (node.applied + self.rng.gen_range(1..=3)).min(head);
            }
        }
        // Deliveries.
        let now = self.now_ms;
        let (due, later): (Vec<_>, Vec<_>) =
            self.in_flight.drain(..).partition(|(at, _)| *at <= now);
        self.in_flight = later;
        for (_, message) in due {
            match message {
                Message::RenewRequest {
                    node,
                    sent_local_ms,
                    seen_epoch,
                } => {
                    let Some(leader) = self.leader else { continue };
                    if !self.reachable(node, leader) {
                        continue;
                    }
                    let leader_now = self.local_ms(leader);
                    if let Outcome::Granted { lease_ms, epoch } = self.commit(Command::Renew {
                        node,
                        seen_epoch,
                        now_ms: leader_now,
                    }) {
                        self.send(
                            leader,
                            node,
                            Message::RenewReply {
                                node,
                                sent_local_ms,
                                lease_ms,
                                epoch,
                            },
                        );
                    }
                }
                Message::RenewReply {
                    node,
                    sent_local_ms,
                    lease_ms,
                    epoch,
                } => {
                    let n = self.nodes.get_mut(&node).expect("node exists");
                    if n.alive {
                        n.valid_until_local_ms = Some(sent_local_ms + lease_ms);
                        n.lease_epoch = epoch;
                    }
                }
            }
        }
        // Renewals.
        for &id in &ids {
            let due = self.nodes[&id].alive && self.now_ms >= self.nodes[&id].next_renewal_ms;
            if !due {
                continue;
            }
            self.nodes
                .get_mut(&id)
                .expect("node exists")
                .next_renewal_ms = self.now_ms + LEASE_MS / 3;
            if let Some(leader) = self.leader {
                let seen_epoch = self.history[self.nodes[&id].applied].epoch;
                let sent_local_ms = self.local_ms(id);
                self.send(
                    id,
                    leader,
                    Message::RenewRequest {
                        node: id,
                        sent_local_ms,
                        seen_epoch,
                    },
                );
            }
        }
        // The leader's step.
        if let Some(leader) = self.leader {
            if self.now_ms.is_multiple_of(100) {
                let now_ms = self.local_ms(leader);
                let mut probe = self.head().clone();
                probe.apply(&Command::Tick { now_ms });
                probe.now_ms = self.head().now_ms;
                if probe != *self.head() {
                    self.commit(Command::Tick { now_ms });
                }
            }
        }
        self.check();
    }

    fn check(&mut self) {
        for p in 0..PARTITIONS {
            let mut acting: Vec<(NodeId, u64)> = Vec::new();
            for (&id, node) in &self.nodes {
                let lease_valid = node
                    .valid_until_local_ms
                    .is_some_and(|until| self.local_ms(id) < until)
                    && self.history[node.applied].epoch >= node.lease_epoch;
                if !node.alive || !lease_valid {
                    continue;
                }
                if let Some(view) = self.history[node.applied].acting_view(id, p) {
                    acting.push((id, view));
                }
            }
            if acting.windows(2).any(|w| w[0].1 != w[1].1) {
                self.violations.push(format!(
                    "t={} ms partition {p}: nodes act under different views {acting:?}",
                    self.now_ms
                ));
            }
        }
    }
}

fn seeds() -> std::ops::Range<u64> {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let first = env("LEASE_SIM_FIRST_SEED", 1);
    first..first + env("LEASE_SIM_SEEDS", 60)
}

#[test]
fn no_two_nodes_act_on_a_partition_under_different_views() {
    let mut views_published = 0u64;
    let mut acting_checks = 0u64;
    for seed in seeds() {
        let nodes = 3 + seed % 3;
        let mut sim = Sim::new(seed, nodes);
        while sim.now_ms < SIMULATED_MS {
            sim.step();
        }
        assert!(
            sim.violations.is_empty(),
            "seed {seed}: {}",
            sim.violations[..sim.violations.len().min(5)].join("\n")
        );
        views_published += sim
            .head()
            .partitions
            .iter()
            .map(|p| p.view - 1)
            .sum::<u64>();
        acting_checks += sim.history.len() as u64;
    }
    // The simulation must exercise view changes, or it proves nothing.
    assert!(
        views_published > 100,
        "only {views_published} view changes over all seeds"
    );
    assert!(acting_checks > 0);
}
