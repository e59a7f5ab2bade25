//! Test support (feature `sim`): control-plane nodes in one process for the tests of this crate
//! and of the crates above it — over the in-memory transport ([`mem_node`]) or as turmoil hosts on
//! its simulated TCP and time ([`SimConnect`], [`SimListener`], [`SimClock`], [`sim_config`]).
//! Never part of a release build.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mqstate_clock::{Clock, SharedClock};

use crate::transport::mem::MemNetwork;
use crate::transport::socket::{Accept, BoxStream, Connect};
use crate::transport::tcp::TcpTransport;
use crate::transport::{AdminRequest, BoxFuture, Request, Response, Transport};
use crate::{ClusterNode, MapConfig, NodeConfig, NodeId, Status};

/// A node's config with the quick timings the in-process tests use (a 600 ms lease, 300 ms
/// election timeout) on the system clock; it joins when it lists no founders.
pub fn quick_config(
    id: NodeId,
    addr: String,
    peers: BTreeMap<NodeId, String>,
    dir: PathBuf,
    partition_count: u32,
) -> NodeConfig {
    NodeConfig {
        id,
        addr,
        join: peers.is_empty(),
        peers,
        dir,
        map: MapConfig {
            partition_count,
            replication_factor: 3,
            lease_ms: 600,
            clock_factor_ms: 200,
        },
        heartbeat: Duration::from_millis(50),
        election_timeout: Duration::from_millis(300),
        election_timeout_max: None,
        clock: mqstate_clock::system(),
        snapshot_every: crate::node::SNAPSHOT_EVERY_ENTRIES,
    }
}

/// A node's address on a [`MemNetwork`].
pub fn mem_addr(id: NodeId) -> String {
    format!("node-{id}")
}

/// Starts the node `config` describes over `net` and has it answer at its address there.
pub async fn mem_node(net: &MemNetwork, config: NodeConfig) -> ClusterNode {
    let addr = config.addr.clone();
    let node = ClusterNode::start(config, Arc::new(net.transport(&addr)))
        .await
        .expect("node starts");
    net.register(&addr, node.handler());
    node
}

/// Polls `check` until it holds; panics naming `what` after 30 s (on tokio's clock).
pub async fn eventually(what: &str, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within 30 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The state `status` gives member `id` ("up", "down", …), if it is a member.
pub fn state_of(status: &Status, id: NodeId) -> Option<&str> {
    status
        .members
        .iter()
        .find(|m| m.id == id)
        .map(|m| m.state.as_str())
}

/// The cluster port of every simulated host.
pub const PORT: u16 = 7000;
/// The simulation's wall clock starts here (2026-01-01).
pub const EPOCH_MS: u64 = 1_767_225_600_000;

/// The turmoil host name of node `id`.
pub fn host(id: NodeId) -> String {
    format!("n{id}")
}

/// Node `id`'s cluster address in the simulation.
pub fn addr(id: NodeId) -> String {
    format!("{}:{PORT}", host(id))
}

/// Simulated milliseconds since the simulation began (0 outside one).
pub fn sim_ms() -> u64 {
    turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64
}

/// A simulated node's config: it founds the cluster with `founders`, or joins when it is not one
/// of them. Its election timeout is its own and pinned (see [`NodeConfig::election_timeout_max`]).
pub fn sim_config(
    id: NodeId,
    founders: &[NodeId],
    dir: PathBuf,
    map: MapConfig,
    clock: SharedClock,
) -> NodeConfig {
    let join = !founders.contains(&id);
    let election = Duration::from_millis(250 + 60 * id);
    NodeConfig {
        id,
        addr: addr(id),
        peers: if join {
            BTreeMap::new()
        } else {
            founders.iter().map(|&n| (n, addr(n))).collect()
        },
        join,
        dir,
        map,
        heartbeat: Duration::from_millis(50),
        election_timeout: election,
        election_timeout_max: Some(election + Duration::from_millis(1)),
        clock,
        snapshot_every: crate::node::SNAPSHOT_EVERY_ENTRIES,
    }
}

/// The cluster transport over turmoil's simulated TCP.
pub fn sim_transport() -> TcpTransport {
    TcpTransport::over(Arc::new(SimConnect), None)
}

/// Asks `founders` in turn (only the leader accepts) to add node `joiner`, a round every 0.5 s,
/// until one says it is done; false if none did before a round began `within` after the first.
pub async fn add_node(founders: &[NodeId], joiner: NodeId, within: Duration) -> bool {
    let transport = sim_transport();
    let started = tokio::time::Instant::now();
    while started.elapsed() < within {
        for &id in founders {
            let request = Request::Admin(AdminRequest::AddNode {
                id: joiner,
                addr: addr(joiner),
            });
            match transport
                .call(&addr(id), request, Duration::from_secs(30))
                .await
            {
                Ok(Response::AdminDone) => return true,
                // A retry after a change that committed but whose answer was lost.
                Ok(Response::Failed(reason)) if reason.contains("already a member") => return true,
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// turmoil's simulated TCP behind the transport's socket port.
pub struct SimConnect;

impl Connect for SimConnect {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, std::io::Result<BoxStream>> {
        Box::pin(async move {
            let stream = turmoil::net::TcpStream::connect(addr).await?;
            Ok(Box::new(stream) as BoxStream)
        })
    }
}

pub struct SimListener(pub turmoil::net::TcpListener);

impl Accept for SimListener {
    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            let (stream, peer) = self.0.accept().await?;
            Ok((Box::new(stream) as BoxStream, peer.to_string()))
        })
    }
}

/// A node's wall clock: the simulation's, off by a skew the harness may change (a clock jump);
/// monotonic time is tokio's (the host's simulated clock).
#[derive(Debug)]
pub struct SimClock {
    pub skew_ms: Arc<AtomicI64>,
}

impl SimClock {
    /// A clock off by `skew_ms` for good.
    pub fn fixed(skew_ms: i64) -> SimClock {
        SimClock {
            skew_ms: Arc::new(AtomicI64::new(skew_ms)),
        }
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        (EPOCH_MS as i64 + sim_ms() as i64 + self.skew_ms.load(Ordering::Relaxed)) as u64
    }

    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// The number in the environment variable `name`, if set; panics naming it if not a number.
pub fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// A directory for the simulated nodes' disks: on tmpfs when there is one, since they fsync
/// every append.
pub fn data_root() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(dir) = tempfile::tempdir_in(shm) {
            return dir;
        }
    }
    tempfile::tempdir().expect("a temporary directory")
}

/// The simulation of `seed`, of `duration` at most in steps of 1 ms, its messages taking 1 ms to
/// `max_latency`.
pub fn simulation<'a>(seed: u64, duration: Duration, max_latency: Duration) -> turmoil::Sim<'a> {
    turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(duration)
        .tick_duration(Duration::from_millis(1))
        // Held links queue every message until released.
        .tcp_capacity(1 << 16)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(max_latency)
        .build()
}

/// What [`sweep`] ran: the seeds, the figures the runs added to, each failing seed's findings, and
/// how long it all took in real time.
pub struct Sweep<F> {
    pub seeds: Vec<u64>,
    pub figures: F,
    pub failures: Vec<String>,
    pub real: Duration,
}

/// Runs a simulation's seeds: `<prefix>_SEED` alone when it is set, else `<prefix>_SEEDS` of them
/// (default `count`) from `<prefix>_FIRST` (default 1). `run` runs one seed, with the simulated
/// time of clients and faults (`<prefix>_CHAOS_SECS`, default `chaos_secs`), adds to the figures,
/// and gives its findings if it fails.
pub fn sweep<F: Default>(
    prefix: &str,
    count: u64,
    chaos_secs: u64,
    mut run: impl FnMut(u64, Duration, &mut F) -> Result<(), String>,
) -> Sweep<F> {
    let chaos = Duration::from_secs(env_u64(&format!("{prefix}_CHAOS_SECS")).unwrap_or(chaos_secs));
    let seeds: Vec<u64> = match env_u64(&format!("{prefix}_SEED")) {
        Some(seed) => vec![seed],
        None => {
            let first = env_u64(&format!("{prefix}_FIRST")).unwrap_or(1);
            let count = env_u64(&format!("{prefix}_SEEDS")).unwrap_or(count);
            (first..first + count).collect()
        }
    };
    let started = std::time::Instant::now();
    let mut figures = F::default();
    let failures = seeds
        .iter()
        .filter_map(|&seed| run(seed, chaos, &mut figures).err())
        .collect();
    Sweep {
        seeds,
        figures,
        failures,
        real: started.elapsed(),
    }
}

/// A fault among simulated nodes (each on its host, [`host`]).
#[derive(Debug, Clone, Copy)]
pub enum NodeFault {
    /// The node's process dies (its disk stays); it restarts after the given time.
    Crash(NodeId, Duration),
    /// The node is cut off from the other nodes (what is in flight is lost) for a while.
    Isolate(NodeId, Duration),
    /// Messages between two nodes are held back for a while, then delivered.
    Hold(NodeId, NodeId, Duration),
}

impl NodeFault {
    /// Messages between `node` and the node `offset` places after it in `nodes` (cyclically) held
    /// back for `lasting`.
    pub fn hold(nodes: &[NodeId], node: NodeId, offset: usize, lasting: Duration) -> NodeFault {
        let at = nodes.iter().position(|&n| n == node).unwrap_or(0);
        NodeFault::Hold(node, nodes[(at + offset) % nodes.len()], lasting)
    }

    pub fn kind(&self) -> &'static str {
        match self {
            NodeFault::Crash(..) => "crash",
            NodeFault::Isolate(..) => "isolate",
            NodeFault::Hold(..) => "hold",
        }
    }

    /// Injects the fault among `nodes`; how long it lasts.
    pub fn start(self, sim: &mut turmoil::Sim<'_>, nodes: &[NodeId]) -> Duration {
        match self {
            NodeFault::Crash(n, lasting) => {
                sim.crash(host(n));
                lasting
            }
            NodeFault::Isolate(n, lasting) => {
                for other in nodes.iter().filter(|&&o| o != n) {
                    sim.partition(host(n), host(*other));
                }
                lasting
            }
            NodeFault::Hold(a, b, lasting) => {
                sim.hold(host(a), host(b));
                lasting
            }
        }
    }

    /// Undoes the fault: the node restarts, its links come back, held messages are delivered.
    pub fn end(self, sim: &mut turmoil::Sim<'_>, nodes: &[NodeId]) {
        match self {
            NodeFault::Crash(n, _) => sim.bounce(host(n)),
            NodeFault::Isolate(n, _) => {
                for other in nodes.iter().filter(|&&o| o != n) {
                    sim.repair(host(n), host(*other));
                }
            }
            NodeFault::Hold(a, b, _) => sim.release(host(a), host(b)),
        }
    }
}

/// Steps `sim` until it is done or a host fails, running the faults of `schedule` (each with the
/// time it starts at, in order) one at a time: `start` injects one and says how long it lasts;
/// `end` undoes it when that is over, or at `chaos`, when every fault is over.
pub fn run_faults<'a, F: Copy>(
    sim: &mut turmoil::Sim<'a>,
    chaos: Duration,
    schedule: Vec<(Duration, F)>,
    mut start: impl FnMut(&mut turmoil::Sim<'a>, F) -> Duration,
    mut end: impl FnMut(&mut turmoil::Sim<'a>, F),
) -> Result<(), String> {
    let mut schedule = schedule.into_iter().peekable();
    let mut ending: Option<(Duration, F)> = None;
    loop {
        if sim.step().map_err(|e| format!("{e}"))? {
            return Ok(());
        }
        let now = sim.elapsed();
        if let Some((until, fault)) = ending {
            if now >= until || now >= chaos {
                end(sim, fault);
                ending = None;
            }
        }
        if ending.is_none() && now < chaos && schedule.peek().is_some_and(|(at, _)| now >= *at) {
            if let Some((_, fault)) = schedule.next() {
                ending = Some((now + start(sim, fault), fault));
            }
        }
    }
}
