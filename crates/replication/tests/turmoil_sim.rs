//! A deterministic simulation of the data plane (decision 0058): four turmoil hosts each run the
//! real node — the control plane ([`ClusterNode`], openraft), the chains ([`Replication`]: driver,
//! head, forwarding, remembered requests, the chain log on `mqstate-wal`, repair, re-entry) and a
//! front end that hands each request to [`Replication::execute`], as the state-store service's
//! router does — on turmoil's simulated TCP and time, with skewed wall clocks. The chain log's
//! writer runs inline ([`Committer::Caller`](mqstate_wal::Committer::Caller)) so that nothing runs outside simulated time. Nodes
//! 1–3 found the cluster; node 4 is added during the faults, and partitions move to it.
//!
//! Clients send SET, SET NX, GET, DEL and VDEL on a few keys, each to a node the seed picks; a
//! request without an answer (a timeout, a node gone, an `-ERR` of a request that ran out of time)
//! is "may or may not have happened". The seed also draws the faults: node crashes and restarts
//! (the disk stays), nodes cut off from the others, links that hold messages back, clock jumps.
//! After the faults a last client reads every key. Checked per key:
//!
//! * linearizable (Wing–Gong–Lowe over the store's semantics, versions included: a write's version
//!   is above every version the key had, a read sees the version of the write it reads);
//! * no version goes backwards in real time (an operation started after another returned never
//!   sees an older version; a SET started after it gets a newer one);
//! * no acknowledged write is lost: the last read shows the newest acknowledged SET, or a delete
//!   that may have come after it.
//!
//! `MQSTATE_DATA_SIM_SEED=N` runs seed N alone (a failure prints it); `MQSTATE_DATA_SIM_SEEDS=K`
//! runs K seeds from `MQSTATE_DATA_SIM_FIRST` (default 1; K default 6);
//! `MQSTATE_DATA_SIM_CHAOS_SECS` sets the simulated seconds of clients and faults (default 8).
//! Two runs of a seed print the same `trace`. `MQSTATE_DATA_SIM_DUMP=FILE` writes each seed's
//! history to `FILE.<seed>`; `MQSTATE_DATA_SIM_WATCH=1` prints each node's partitions every
//! simulated second; `RUST_LOG` logs with the simulated time, so two runs' logs diff line by line.
//! `scripts/sim-seeds.sh COUNT [FIRST]` runs many seeds in parallel; with `REPLAY=1` it runs each
//! twice and compares the histories byte for byte.
//!
//! Every key must be readable again within [`READABLE_WITHIN`] after the faults: a partition
//! left without a head fails the seed (seed 6 did, before the head's remembered requests came
//! with its recovery copy).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mqstate_clock::SharedClock;
use mqstate_cluster::sim::{
    add_node, data_root, host, run_faults, sim_config, sim_ms, sim_transport, simulation, sweep,
    NodeFault, SimClock, SimListener, EPOCH_MS, PORT,
};
use mqstate_cluster::transport::tcp::{serve, TcpTransport};
use mqstate_cluster::transport::{
    decode_body, encode_body, BoxFuture, Handler, Request, Response, Transport,
};
use mqstate_cluster::{ClusterNode, MapConfig, NodeId};
use mqstate_protocol::RequestLimits;
use mqstate_replication::head::{HeadConfig, KeyRequest};
use mqstate_replication::log::ChainLog;
use mqstate_replication::wire::{Executed, Routed};
use mqstate_replication::Replication;
use mqstate_store::StoreConfig;
use mqstate_wal::WalOptions;
use mqstate_wgl::kv::{self, Cmd, Figures, NodeOp, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Every node: the founders (1, 2, 3) form the cluster; node 4 starts with `--join` and is added
/// at a time the seed chooses, during the faults, so partitions move to it under load.
const NODES: [NodeId; 4] = [1, 2, 3, 4];
const FOUNDERS: [NodeId; 3] = [1, 2, 3];
const JOINER: NodeId = 4;
const PARTITIONS: u32 = 4;
/// The front end clients call (the cluster transport, Raft and chains, is on `sim::PORT`).
const FRONT_PORT: u16 = 7001;
const LEASE_MS: u64 = 1_000;
const CLOCK_FACTOR_MS: u64 = 300;
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const CLIENTS: u64 = 4;
/// A request's message expiry, which bounds how long the node it reached tries it.
const REQUEST_EXPIRY: Duration = Duration::from_secs(4);
/// How long a client waits for the front end's answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// After the faults: this long for node 4 to be added.
const SETTLE: Duration = Duration::from_secs(40);
/// After the faults: every key must be readable again within this (simulated) time, or the seed
/// fails. Every node is up again when the faults stop; a partition whose members all re-entered
/// their chain used to wait out the requests they might have forgotten (130 s, seed 6, until the
/// recovery copy carried the head's remembered requests: decision 0050).
const READABLE_WITHIN: Duration = Duration::from_secs(30);
/// Keys readable later than this after the faults are listed in the summary.
const SLOW_RECOVERY: Duration = Duration::from_secs(10);
/// States the linearizability search of one key may visit.
const SEARCH_BUDGET: usize = 4_000_000;

/// Log lines carry the simulated time.
struct SimTimer;

impl tracing_subscriber::fmt::time::FormatTime for SimTimer {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        write!(
            w,
            "{:>9.3}",
            turmoil::sim_elapsed().unwrap_or_default().as_secs_f64()
        )
    }
}

/// The front end: what the state-store service's router does with a key command on a cluster
/// node (`src/cluster.rs`, `ChainRouter::execute`): hand it to [`Replication::execute`].
struct FrontEnd(Arc<Replication>);

impl Handler for FrontEnd {
    fn handle(&self, request: Request) -> BoxFuture<'_, Response> {
        Box::pin(async move {
            let Request::Data(body) = request else {
                return Response::Failed("the front end takes state-store requests only".into());
            };
            let limits = RequestLimits::default();
            let parsed = decode_body::<Routed>(&body).map(|r| KeyRequest::from_wire(r, &limits));
            let request = match parsed {
                Ok(Ok(request)) => request,
                Ok(Err(reply)) => return Response::Data(encode_body(&reply.to_wire())),
                Err(e) => return Response::Failed(format!("not a request: {e}")),
            };
            Response::Data(encode_body(&self.0.execute(request).await.to_wire()))
        })
    }
}

/// A node: control plane, data plane on a chain log in `dir`, the cluster listener and the front
/// end. Runs until the host crashes.
async fn node(
    id: NodeId,
    dir: PathBuf,
    skew_ms: Arc<AtomicI64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
    let front = turmoil::net::TcpListener::bind(("0.0.0.0", FRONT_PORT)).await?;
    let clock: SharedClock = Arc::new(SimClock { skew_ms });
    let map = MapConfig {
        partition_count: PARTITIONS,
        replication_factor: 3,
        lease_ms: LEASE_MS,
        clock_factor_ms: CLOCK_FACTOR_MS,
    };
    let config = sim_config(id, &FOUNDERS, dir.join("cluster"), map, Arc::clone(&clock));
    let transport = sim_transport();
    let node = Arc::new(ClusterNode::start(config, Arc::new(transport)).await?);
    let wal = WalOptions {
        name: "chains",
        committer: mqstate_wal::Committer::Caller,
        // Small segments: rotation and the prepared next segment run too.
        segment_soft_limit_bytes: 64 << 10,
        segment_hard_limit_bytes: 256 << 10,
        ..WalOptions::default()
    };
    // No compaction (`snapshot_every`): its snapshot is encoded and written on blocking threads.
    let (log, restored) = ChainLog::open(&dir, wal, clock.now_ms())?;
    let head = HeadConfig {
        store: StoreConfig {
            node_id: "mqstate".into(),
            limits: Default::default(),
        },
        limits: RequestLimits::default(),
        node: id,
    };
    let running = Replication::start(Arc::clone(&node), log, restored, head, clock);
    let replication = Arc::clone(&running.replication);
    tokio::spawn(serve(
        SimListener(listener),
        node.handler(),
        std::future::pending(),
    ));
    tokio::spawn(serve(
        SimListener(front),
        Arc::new(FrontEnd(replication)),
        std::future::pending(),
    ));
    if std::env::var_os("MQSTATE_DATA_SIM_WATCH").is_some() {
        // What this node sees of the partitions, every simulated second (to follow a finding).
        let node = Arc::clone(&node);
        tokio::spawn(async move {
            loop {
                let status = node.status();
                let parts: Vec<String> = status
                    .partitions
                    .iter()
                    .map(|p| {
                        format!(
                            "p{} v{} chain {:?} read {:?}{} acting {:?}",
                            p.id,
                            p.view,
                            p.chain,
                            p.read_view,
                            if p.pending { " pending" } else { "" },
                            node.acting_view(p.id)
                        )
                    })
                    .collect();
                println!("t={} n{id}: {}", sim_ms(), parts.join(" | "));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    // The host runs until it crashes, which drops its runtime and everything in it.
    let _running = running;
    std::future::pending::<()>().await;
    Ok(())
}

/// The history; `-ERR` texts taken as "unknown" are its errors.
type Shared = Rc<RefCell<kv::History<NodeOp>>>;

/// `-ERR` texts that do not say whether the request ran: the node gave up retrying it, but an
/// attempt may have reached the head.
fn indeterminate(error: &str) -> bool {
    error.starts_with("the cluster could not serve the request in time")
}

/// Sends one request to `node`'s front end and records it.
async fn call(
    transport: &TcpTransport,
    history: &Shared,
    client: u64,
    seq: u64,
    node: NodeId,
    key: &'static str,
    cmd: Cmd,
) -> Result<Outcome, String> {
    let now_ms = EPOCH_MS + sim_ms();
    let routed = Routed {
        client_id: format!("c{client}"),
        correlation: seq.to_be_bytes().to_vec(),
        key: key.as_bytes().to_vec(),
        payload: kv::resp(&cmd, key),
        ts: Some(format!("{now_ms:015}:{:05}:c{client}", 0)),
        fencing_token: None,
        expiry_ms: REQUEST_EXPIRY.as_millis() as u64,
        // Set by `Replication::execute`, as on a real front end.
        deadline_ms: 0,
    };
    let invoked = history.borrow_mut().tick();
    let answer = transport
        .call(
            &format!("{}:{FRONT_PORT}", host(node)),
            Request::Data(encode_body(&routed)),
            CALL_TIMEOUT,
        )
        .await;
    let result = match answer {
        Ok(Response::Data(body)) => match decode_body::<Executed>(&body) {
            Ok(executed) => match kv::outcome(&cmd, &executed.payload, executed.ts.as_deref()) {
                Ok(outcome) => Ok(outcome),
                Err(error) if indeterminate(&error) => {
                    history.borrow_mut().count_error(error);
                    Ok(Outcome::Unknown)
                }
                Err(error) => Err(error),
            },
            Err(e) => Err(format!("an answer that does not decode: {e}")),
        },
        Ok(other) => Err(format!("the front end answered {other:?}")),
        // Not reached, cut off, crashed, or no answer in time: it may have run.
        Err(_) => Ok(Outcome::Unknown),
    };
    let outcome = result.clone().unwrap_or(Outcome::Unknown);
    let returned = history.borrow_mut().returned(&outcome);
    history.borrow_mut().ops.push(NodeOp {
        node,
        key,
        kv: kv::Op {
            client,
            cmd,
            invoked,
            returned,
            outcome,
            ms: None,
        },
    });
    result
}

/// A client: requests on random keys to random nodes until `until`, one at a time.
async fn client(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
    joined: Rc<Cell<bool>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(id));
    let transport = sim_transport();
    // Values this client wrote, for its VDELs (the latest most often).
    let mut written: Vec<u64> = Vec::new();
    let mut seq = 0u64;
    // The cluster forms in the first second or two; requests before that wait in the nodes.
    tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1_500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        seq += 1;
        let key = KEYS[rng.gen_range(0..KEYS.len())];
        // Node 4 takes requests once it is a member.
        let up = if joined.get() {
            NODES.len()
        } else {
            FOUNDERS.len()
        };
        let node = NODES[rng.gen_range(0..up)];
        let cmd = kv::draw(&mut rng, id, seq, &mut written);
        if let Err(e) = call(&transport, &history, id, seq, node, key, cmd).await {
            return Err(format!("client {id}: {e}").into());
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..40))).await;
    }
    Ok(())
}

/// After the faults: reads every key until it answers, from each node in turn; sets
/// `readable_after` to how long that took.
async fn final_reads(
    from: Duration,
    history: Shared,
    readable_after: Rc<Cell<Duration>>,
) -> Result<(), Box<dyn std::error::Error>> {
    tokio::time::sleep(from).await;
    let transport = sim_transport();
    let started = tokio::time::Instant::now();
    let mut seq = 0;
    for key in KEYS {
        let mut attempt = 0usize;
        loop {
            seq += 1;
            attempt += 1;
            let node = NODES[attempt % NODES.len()];
            match call(&transport, &history, FINAL_CLIENT, seq, node, key, Cmd::Get).await {
                Ok(Outcome::Unknown) => {}
                Ok(_) => break,
                Err(e) => return Err(format!("final read of {key}: {e}").into()),
            }
            if started.elapsed() > READABLE_WITHIN {
                return Err(format!(
                    "{key} is still not readable {READABLE_WITHIN:?} after the faults stopped"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    readable_after.set(started.elapsed());
    Ok(())
}

/// Adds node 4 to the cluster at `at`.
async fn add_joiner(
    at: Duration,
    joined: Rc<Cell<bool>>,
) -> Result<(), Box<dyn std::error::Error>> {
    tokio::time::sleep(at).await;
    if !add_node(&FOUNDERS, JOINER, SETTLE).await {
        return Err(format!("node {JOINER} was not added in {SETTLE:?}").into());
    }
    joined.set(true);
    Ok(())
}

/// The client id of the reads after the faults.
const FINAL_CLIENT: u64 = 99;

#[derive(Debug, Clone, Copy)]
enum Fault {
    Node(NodeFault),
    /// The node's wall clock jumps to another offset within the bound the leases assume.
    Jump(NodeId, i64),
}

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::Node(fault) => fault.kind(),
            Fault::Jump(..) => "clock jump",
        }
    }
}

/// Runs one seed; its violations, if any, with how to reproduce them. A seed whose keys became
/// readable only after [`SLOW_RECOVERY`] goes into `slow`, with how long it took.
fn run_seed(
    seed: u64,
    chaos: Duration,
    figures: &mut Figures,
    slow: &mut Vec<(u64, Duration)>,
) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let root = data_root();
    let mut sim = simulation(
        seed,
        chaos + READABLE_WITHIN + Duration::from_secs(30),
        Duration::from_millis(rng.gen_range(2..20)),
    );
    let mut skews = BTreeMap::new();
    for id in NODES {
        let dir = root.path().join(host(id));
        let skew = rng.gen_range(-(CLOCK_FACTOR_MS as i64) / 2..=CLOCK_FACTOR_MS as i64 / 2);
        let skew = Arc::new(AtomicI64::new(skew));
        skews.insert(id, Arc::clone(&skew));
        sim.host(host(id), move || node(id, dir.clone(), Arc::clone(&skew)));
    }
    let history: Shared = Rc::default();
    let readable_after: Rc<Cell<Duration>> = Rc::default();
    let joined: Rc<Cell<bool>> = Rc::default();
    for id in 1..=CLIENTS {
        sim.client(
            format!("c{id}"),
            client(id, seed, chaos, history.clone(), joined.clone()),
        );
    }
    // The membership change: asked of the founders in turn (only the leader accepts) until one
    // says it is done.
    let add_at = Duration::from_millis(rng.gen_range(1_000..chaos.as_millis() as u64 / 2));
    sim.client("admin", add_joiner(add_at, joined.clone()));
    // The last reads begin once the faults are over and the clients done.
    sim.client(
        "final",
        final_reads(
            chaos + CALL_TIMEOUT + Duration::from_secs(2),
            history.clone(),
            readable_after.clone(),
        ),
    );

    let mut schedule: Vec<(Duration, Fault)> = Vec::new();
    let mut at = Duration::from_millis(rng.gen_range(1_500..2_500));
    while at < chaos {
        let node = NODES[rng.gen_range(0..NODES.len())];
        let lasting = Duration::from_millis(rng.gen_range(300..3_000));
        let fault = match rng.gen_range(0..4) {
            0 => Fault::Node(NodeFault::Crash(node, lasting)),
            1 => Fault::Node(NodeFault::Isolate(node, lasting)),
            2 => Fault::Node(NodeFault::hold(
                &NODES,
                node,
                rng.gen_range(1..NODES.len()),
                lasting,
            )),
            _ => Fault::Jump(
                node,
                rng.gen_range(-(CLOCK_FACTOR_MS as i64) / 2..=CLOCK_FACTOR_MS as i64 / 2),
            ),
        };
        schedule.push((at, fault));
        at += lasting + Duration::from_millis(rng.gen_range(100..1_000));
    }
    for (_, fault) in &schedule {
        *figures.faults.entry(fault.kind()).or_default() += 1;
    }

    let start_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Node(fault) => fault.start(sim, &NODES),
        Fault::Jump(n, skew) => {
            skews[&n].store(skew, Ordering::Relaxed);
            Duration::ZERO
        }
    };
    let end_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Node(fault) => fault.end(sim, &NODES),
        Fault::Jump(..) => {}
    };
    let outcome = run_faults(&mut sim, chaos, schedule, start_fault, end_fault);
    let simulated = sim.elapsed();
    drop(sim);

    let history = history.borrow();
    figures.add(simulated, &history);
    history.dump("MQSTATE_DATA_SIM_DUMP", seed);
    if readable_after.get() > SLOW_RECOVERY {
        slow.push((seed, readable_after.get()));
    }
    let findings = history.findings(outcome, &KEYS, FINAL_CLIENT, SEARCH_BUDGET);
    if findings.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "seed {seed} (reproduce: MQSTATE_DATA_SIM_SEED={seed} cargo test -p mqstate-replication --test turmoil_sim -- --nocapture):\n  {}",
            findings.join("\n  ")
        ))
    }
}

#[test]
fn the_data_plane_is_linearizable_and_loses_no_acknowledged_write_under_faults() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "off".to_owned()))
        // Simulated time in the lines, not real: two runs of a seed log the same text (diff them).
        .with_timer(SimTimer)
        .with_test_writer()
        .try_init();
    let mut slow = Vec::new();
    let sweep = sweep("MQSTATE_DATA_SIM", 6, 8, |seed, chaos, figures| {
        run_seed(seed, chaos, figures, &mut slow)
    });
    println!(
        "{}",
        sweep
            .figures
            .summary("data-plane", "-ERR", sweep.failures.len(), sweep.real)
    );
    for (seed, after) in &slow {
        println!(
            "  seed {seed}: a key became readable only {:.0} s after the faults stopped",
            after.as_secs_f64()
        );
    }
    if sweep.seeds.len() == 1 {
        for (error, n) in &sweep.figures.errors {
            println!("  {n} × -ERR {error} (taken as unknown)");
        }
    }
    assert!(sweep.failures.is_empty(), "{}", sweep.failures.join("\n"));
}
