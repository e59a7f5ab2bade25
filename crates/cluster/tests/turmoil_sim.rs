//! A deterministic simulation of the control plane (decision 0036): the real
//! [`ClusterNode`]s (openraft, our state machine and Raft log on disk, the frame transport) run as
//! turmoil hosts on its simulated TCP and time, with skewed wall clocks. A seed chooses the
//! network's latencies and a schedule of faults: node crashes and restarts, nodes cut off
//! (partitions; what is in flight is lost) and links that hold messages back (delay). Every
//! other simulated millisecond each live node reports what it sees, and the harness checks:
//!
//! * at most one leader per term;
//! * the lease rule: no two nodes act on a partition under different views at the same time;
//! * one history: two nodes that applied the same log index hold the same partition map;
//! * nothing committed is lost: once the faults stop, every node converges on one leader, every
//!   member up — node 4 too, added by a membership change during the faults — every partition
//!   settled, and no partition's view below the highest any node ever applied.
//!
//! `MQSTATE_SIM_SEED=N` runs seed N alone (a failure prints it); `MQSTATE_SIM_SEEDS=K` runs K
//! seeds from `MQSTATE_SIM_FIRST` (default 1; K default 24); `MQSTATE_SIM_CHAOS_SECS` sets the
//! simulated seconds of faults (default 12).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use mqstate_cluster::sim::{
    add_node, data_root, host, sim_config, sim_transport, simulation, sweep, NodeFault, SimClock,
    SimListener, PORT,
};
use mqstate_cluster::status::PartitionStatus;
use mqstate_cluster::transport::tcp::serve;
use mqstate_cluster::{ClusterNode, MapConfig, NodeId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Every node: the founders (1, 2, 3) form the cluster; node 4 starts with `--join` and is added
/// (learner, then voter: joint consensus) at a time the seed chooses, during the faults.
const NODES: [NodeId; 4] = [1, 2, 3, 4];
const FOUNDERS: [NodeId; 3] = [1, 2, 3];
const JOINER: NodeId = 4;
const PARTITIONS: u32 = 4;
const LEASE_MS: u64 = 1_000;
/// Live nodes report what they see every this many simulated milliseconds, all at once.
const SAMPLE_EVERY_MS: u64 = 2;
const CLOCK_FACTOR_MS: u64 = 300;
/// Once the faults stop: this long for every node to converge.
const SETTLE: Duration = Duration::from_secs(30);

/// What a live node reported at one simulated millisecond.
#[derive(Debug, Clone)]
struct Sample {
    at_ms: u128,
    term: u64,
    leader: Option<NodeId>,
    applied: Option<u64>,
    partitions: Vec<PartitionStatus>,
    up: BTreeSet<NodeId>,
    members: BTreeSet<NodeId>,
    /// The view this node acts on each partition under, if any.
    acting: Vec<Option<u64>>,
}

type Samples = Rc<RefCell<BTreeMap<NodeId, Sample>>>;

fn observe(node: &ClusterNode, samples: &Samples) {
    let status = node.status();
    let sample = Sample {
        at_ms: turmoil::sim_elapsed().unwrap_or_default().as_millis(),
        term: status.term,
        leader: status.leader,
        applied: status.applied_index,
        acting: (0..status.partitions.len() as u32)
            .map(|p| node.acting_view(p))
            .collect(),
        up: status
            .members
            .iter()
            .filter(|m| m.state == "up")
            .map(|m| m.id)
            .collect(),
        members: status.members.iter().map(|m| m.id).collect(),
        partitions: status.partitions,
    };
    samples.borrow_mut().insert(node.id(), sample);
}

#[derive(Debug, Default)]
struct Figures {
    seeds: u64,
    simulated: Duration,
    steps: u64,
    faults: u64,
    terms: u64,
    view_changes: u64,
    samples: u64,
    /// A hash of everything the nodes reported, in order: equal for two runs of one seed when the
    /// run is reproduced exactly.
    trace: u64,
}

/// The checks over the samples as the run goes.
#[derive(Default)]
struct Checker {
    leader_of_term: BTreeMap<u64, NodeId>,
    digest_at: BTreeMap<u64, (u64, NodeId)>,
    highest_view: BTreeMap<u32, u64>,
    violations: Vec<String>,
}

fn digest(partitions: &[PartitionStatus]) -> u64 {
    let mut h = DefaultHasher::new();
    for p in partitions {
        (p.id, &p.chain, p.view, &p.read_view, p.pending).hash(&mut h);
    }
    h.finish()
}

impl Checker {
    /// Checks the samples; those taken at `now_ms` (the latest) are the ones "at the same time".
    fn check(&mut self, now_ms: u128, samples: &BTreeMap<NodeId, Sample>) {
        let mut acting: BTreeMap<u32, BTreeMap<u64, Vec<NodeId>>> = BTreeMap::new();
        for (&id, s) in samples {
            if s.leader == Some(id) {
                let first = *self.leader_of_term.entry(s.term).or_insert(id);
                if first != id {
                    self.violations.push(format!(
                        "t={now_ms} ms: two leaders in term {}: {first} and {id}",
                        s.term
                    ));
                }
            }
            if let Some(index) = s.applied {
                let d = digest(&s.partitions);
                let (seen, by) = *self.digest_at.entry(index).or_insert((d, id));
                if seen != d {
                    self.violations.push(format!(
                        "t={now_ms} ms: nodes {by} and {id} applied index {index} with different partition maps"
                    ));
                }
            }
            for p in &s.partitions {
                let high = self.highest_view.entry(p.id).or_insert(0);
                *high = (*high).max(p.view);
            }
            // Only samples taken this very millisecond count as "at the same time".
            if s.at_ms == now_ms {
                for (p, view) in s.acting.iter().enumerate() {
                    if let Some(view) = view {
                        acting
                            .entry(p as u32)
                            .or_default()
                            .entry(*view)
                            .or_default()
                            .push(id);
                    }
                }
            }
        }
        for (p, views) in acting {
            if views.len() > 1 {
                self.violations.push(format!(
                    "t={now_ms} ms: partition {p} acted on under several views at once: {views:?}"
                ));
            }
        }
    }

    /// Every node agrees, all up, all settled, nothing committed lost.
    fn converged(&self, samples: &BTreeMap<NodeId, Sample>) -> Result<(), String> {
        let all: BTreeSet<NodeId> = NODES.into_iter().collect();
        if samples.len() != NODES.len() {
            return Err(format!("only nodes {:?} report", samples.keys()));
        }
        let first = &samples[&NODES[0]];
        for (id, s) in samples {
            let settled = s.partitions.len() == PARTITIONS as usize
                && s.partitions
                    .iter()
                    .all(|p| !p.pending && p.read_view == p.chain);
            if s.leader.is_none()
                || s.leader != first.leader
                || s.members != all
                || s.up != all
                || !settled
                || s.partitions != first.partitions
            {
                return Err(format!("node {id} has not converged: {s:?}"));
            }
            for p in &s.partitions {
                if p.view < self.highest_view[&p.id] {
                    return Err(format!(
                        "node {id}: partition {} is at view {} below the applied view {}",
                        p.id, p.view, self.highest_view[&p.id]
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Runs one seed; returns its figures, or the violations with the seed to reproduce them.
fn run_seed(seed: u64, chaos: Duration, figures: &mut Figures) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let root = data_root();
    let mut sim = simulation(
        seed,
        chaos + SETTLE + Duration::from_secs(5),
        Duration::from_millis(rng.gen_range(2..30)),
    );
    let samples: Samples = Rc::default();
    for id in NODES {
        let dir: PathBuf = root.path().join(format!("n{id}"));
        let skew_ms = rng.gen_range(-(CLOCK_FACTOR_MS as i64) / 2..=CLOCK_FACTOR_MS as i64 / 2);
        let samples = samples.clone();
        sim.host(host(id), move || {
            let dir = dir.clone();
            let samples = samples.clone();
            async move {
                let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
                let map = MapConfig {
                    partition_count: PARTITIONS,
                    replication_factor: 3,
                    lease_ms: LEASE_MS,
                    clock_factor_ms: CLOCK_FACTOR_MS,
                };
                let clock = Arc::new(SimClock::fixed(skew_ms));
                let config = sim_config(id, &FOUNDERS, dir, map, clock);
                let transport = sim_transport();
                let node = ClusterNode::start(config, Arc::new(transport)).await?;
                tokio::spawn(serve(
                    SimListener(listener),
                    node.handler(),
                    std::future::pending(),
                ));
                loop {
                    observe(&node, &samples);
                    // Every node samples on the same simulated milliseconds, restarted or not.
                    let now = turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64;
                    let next = SAMPLE_EVERY_MS - now % SAMPLE_EVERY_MS;
                    tokio::time::sleep(Duration::from_millis(next)).await;
                }
            }
        });
    }

    // The membership change: asked of the founders in turn (only the leader accepts) until one
    // says it is done, starting at a time drawn from the seed.
    let added: Rc<RefCell<Option<u128>>> = Rc::default();
    let ask_at = Duration::from_millis(rng.gen_range(1_000..chaos.as_millis() as u64 / 2));
    {
        let added = added.clone();
        sim.client("admin", async move {
            tokio::time::sleep(ask_at).await;
            add_node(&FOUNDERS, JOINER, Duration::MAX).await;
            *added.borrow_mut() = Some(turmoil::sim_elapsed().unwrap_or_default().as_millis());
            Ok(())
        });
    }

    // The fault schedule, drawn up front from the seed.
    let mut schedule: Vec<(Duration, NodeFault)> = Vec::new();
    let mut at = Duration::from_millis(rng.gen_range(2_000..4_000));
    while at < chaos {
        let node = NODES[rng.gen_range(0..NODES.len())];
        let lasting = Duration::from_millis(rng.gen_range(300..6_000));
        let fault = match rng.gen_range(0..3) {
            0 => NodeFault::Crash(node, lasting),
            1 => NodeFault::Isolate(node, lasting),
            _ => NodeFault::hold(&NODES, node, rng.gen_range(1..NODES.len()), lasting),
        };
        schedule.push((at, fault));
        at += lasting + Duration::from_millis(rng.gen_range(200..3_000));
    }
    figures.faults += schedule.len() as u64;

    let mut checker = Checker::default();
    let mut schedule = schedule.into_iter().peekable();
    let mut ending: Option<(Duration, NodeFault)> = None;
    let mut views_seen: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    let end = chaos + SETTLE;
    let mut converged_at = None;
    let mut last_sampled_at = 0;
    while sim.elapsed() < end {
        sim.step()
            .map_err(|e| format!("seed {seed}: a host failed: {e}"))?;
        figures.steps += 1;
        let now = sim.elapsed();
        if let Some((until, fault)) = ending {
            if now >= until {
                fault.end(&mut sim, &NODES);
                ending = None;
            }
        }
        if ending.is_none() && schedule.peek().is_some_and(|(at, _)| now >= *at) {
            let (_, fault) = schedule.next().unwrap();
            let lasting = fault.start(&mut sim, &NODES);
            if let NodeFault::Crash(n, _) = fault {
                samples.borrow_mut().remove(&n);
            }
            ending = Some((now + lasting, fault));
        }
        let samples = samples.borrow();
        // The simulated millisecond the freshest samples were taken at (the step just run).
        let sampled_at = samples.values().map(|s| s.at_ms).max().unwrap_or(0);
        let fresh = sampled_at > last_sampled_at;
        last_sampled_at = sampled_at;
        if !fresh {
            continue;
        }
        for (id, s) in samples.iter().filter(|(_, s)| s.at_ms == sampled_at) {
            figures.samples += 1;
            let mut h = DefaultHasher::new();
            (
                figures.trace,
                id,
                s.at_ms,
                s.term,
                s.leader,
                s.applied,
                &s.acting,
            )
                .hash(&mut h);
            figures.trace = h.finish();
        }
        checker.check(sampled_at, &samples);
        for s in samples.values() {
            for p in &s.partitions {
                views_seen.entry(p.id).or_default().insert(p.view);
            }
        }
        if !checker.violations.is_empty() {
            break;
        }
        if now >= chaos
            && ending.is_none()
            && added.borrow().is_some()
            && checker.converged(&samples).is_ok()
        {
            converged_at = Some(now);
            break;
        }
    }
    figures.seeds += 1;
    figures.simulated += sim.elapsed();
    figures.terms += checker.leader_of_term.len() as u64;
    figures.view_changes += views_seen
        .values()
        .map(|v| v.len().saturating_sub(1) as u64)
        .sum::<u64>();
    if converged_at.is_none() && checker.violations.is_empty() {
        let why = match (*added.borrow(), checker.converged(&samples.borrow())) {
            (None, _) => format!("node {JOINER} was never added"),
            (Some(_), Err(why)) => why,
            (Some(_), Ok(())) => "converged at the very end".to_owned(),
        };
        checker.violations.push(format!(
            "no convergence {SETTLE:?} after the faults stopped: {why}"
        ));
    }
    if checker.violations.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "seed {seed} (reproduce: MQSTATE_SIM_SEED={seed} cargo test -p mqstate-cluster --test turmoil_sim -- --nocapture):\n  {}",
            checker.violations.join("\n  ")
        ))
    }
}

#[test]
fn the_control_plane_keeps_its_invariants_under_faults() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "off".to_owned()))
        .with_test_writer()
        .try_init();
    let sweep = sweep("MQSTATE_SIM", 24, 12, run_seed);
    let figures = &sweep.figures;
    println!(
        "turmoil sweep: {} seeds, {:.0} s simulated ({} steps of 1 ms), {} faults injected, {} terms with a leader, {} view changes, {} node samples checked, {} violating seeds, trace {:016x}; {:.1} s of real time",
        figures.seeds,
        figures.simulated.as_secs_f64(),
        figures.steps,
        figures.faults,
        figures.terms,
        figures.view_changes,
        figures.samples,
        sweep.failures.len(),
        figures.trace,
        sweep.real.as_secs_f64(),
    );
    assert!(sweep.failures.is_empty(), "{}", sweep.failures.join("\n"));
}
