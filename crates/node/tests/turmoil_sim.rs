//! The deterministic simulation of the whole cluster (issue 18, decision 0071): three turmoil
//! hosts each run a cluster member as `mqstate serve --node-id` assembles it — the state store's
//! recovery, the broker with its persistent sessions on the chains, the control plane and the
//! data plane (`mqstate_node::start`), the brokers' mesh, the orphan adopter, the state-store
//! service routed to the partitions' heads, the MQTT listener — on turmoil's simulated TCP, time
//! and skewed wall clocks. MQTT 5 clients on hosts of their own speak the AIO state-store protocol
//! (as `crates/statestore/tests/turmoil_sim.rs` does against one node) to a node the seed picks;
//! a connection that fails or a reply that does not come makes the client connect to another node
//! and send the request again with the same correlation data. The seed draws the faults: node
//! crashes and restarts (the disk stays), a node cut off from the others, messages between two
//! nodes held back, clients cut off from a node or their messages held. After the faults a last
//! client reads every key. Each key's history is checked as the other simulations check it
//! (`mqstate_wgl::kv`): linearizable, versions never backwards, the newest acknowledged write not
//! lost; a request without an answer may take effect at any time until the end of the run.
//! KEYNOTIFY observers with persistent sessions (as the robustness tool's) register every key on a
//! node and again on another when their connection fails; what they receive is checked with the
//! robustness tool's rules (`mqstate_wgl::notify`: per observer and key in version order, none
//! missing within a registration) and their sessions must survive the moves. Lock holders take a
//! lock with `SET NX` and write a fenced key with its version as their fencing token (`__ft`), now
//! and then with a stale one; the key model knows the fencing rule. Expiring writers write keys of
//! their own with `SET … PX` (0.1–2 s) and read them; the key model knows expiry, up to the spread
//! of the nodes' clocks (`mqstate_wgl::kv::KeyModel`). Will clients connect again and again with
//! a will per connection (clean or expiring sessions, will delays), leave with a DISCONNECT or
//! without; a recorder on a persistent session receives the wills, which are checked against what
//! the broker promises (`will_findings`), the documented limits counted apart.
//!
//! `MQSTATE_CLUSTER_FRONT_SIM_SEED=N` runs seed N alone; `MQSTATE_CLUSTER_FRONT_SIM_SEEDS=K` runs K seeds from
//! `MQSTATE_CLUSTER_FRONT_SIM_FIRST` (default 1; K default 2); `MQSTATE_CLUSTER_FRONT_SIM_CHAOS_SECS` sets the
//! simulated seconds of clients and faults (default 8), `MQSTATE_CLUSTER_FRONT_SIM_OBSERVERS` the
//! number of observers (default 2), `MQSTATE_CLUSTER_FRONT_SIM_LOCKS` of lock holders (default 2),
//! `MQSTATE_CLUSTER_FRONT_SIM_EXPIRERS` of expiring writers (default 2),
//! `MQSTATE_CLUSTER_FRONT_SIM_WILLS` of will clients (default 0: seeds 1–200 with two find wills
//! lost, not yet explained — decision 0071's amendment on wills; with all four 0 a seed runs as
//! before any existed). Each seed runs in a process of its own
//! (the test binary again), so a seed of a sweep replays alone. Two runs of a seed print the same
//! `trace`; `MQSTATE_CLUSTER_FRONT_SIM_DUMP=FILE` writes each seed's history to `FILE.<seed>`, and
//! `SIM=cluster REPLAY=1 scripts/sim-seeds.sh COUNT` runs each seed twice and compares the
//! histories byte for byte; `RUST_LOG` logs with the simulated time.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mqstate_broker::{Broker, BrokerConfig, SharedClock};
use mqstate_cli::rpc::{self, TIMESTAMP};
use mqstate_cli::wire::{self, Conn};
use mqstate_cluster::sim::{
    data_root, host, run_faults, sim_config, sim_ms, simulation, sweep, NodeFault, SimClock,
    SimConnect, SimListener, EPOCH_MS, PORT,
};
use mqstate_cluster::{MapConfig, NodeId};
use mqstate_node::{DataPlane, Network};
use mqstate_protocol::topic::{notified_key, INVOKE_TOPIC, NOTIFY_TOPIC_PREFIX};
use mqstate_protocol::{Hlc, NotifyPayload, RequestLimits};
use mqstate_replication::head::HeadConfig;
use mqstate_sessions::replicated::ReplicatedSessions;
use mqstate_statestore::service::{self, ServiceConfig};
use mqstate_store::{Limits, StoreConfig};
use mqstate_wal::{Committer, WalOptions};
use mqstate_wgl::kv::{self, Cmd, Figures, NodeOp, Outcome};
use mqstate_wgl::notify;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rumqttc::v5::mqttbytes::v5::{Filter, LastWill, LastWillProperties, Publish};
use rumqttc::v5::mqttbytes::QoS;

const NODES: [NodeId; 3] = [1, 2, 3];
const PARTITIONS: u32 = 4;
const LEASE_MS: u64 = 1_000;
const CLOCK_FACTOR_MS: u64 = 300;
const MQTT_PORT: u16 = 1883;
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
/// The lock the lock holders take (SET NX; its version is the holder's fencing token) and the key
/// they write with their token.
const LOCK_KEY: &str = "lock/0";
const FENCED_KEY: &str = "fenced/0";
/// Lock holders unless `MQSTATE_CLUSTER_FRONT_SIM_LOCKS` says how many (0: none); holder `i` is
/// client `LOCK_CLIENT + i`, apart from the clients the faults pick.
const LOCKS: u64 = 2;
const LOCK_CLIENT: u64 = 10;
/// The keys the expiring writers write, with `PX` (and without, now and then).
const TTL_KEYS: [&str; 2] = ["ttl/0", "ttl/1"];
/// Expiring writers unless `MQSTATE_CLUSTER_FRONT_SIM_EXPIRERS` says how many (0: none); writer
/// `i` is client `EXPIRE_CLIENT + i`.
const EXPIRERS: u64 = 2;
const EXPIRE_CLIENT: u64 = 20;
/// The expiries they give (ms of simulated time).
const PX_MS: std::ops::Range<u64> = 100..2_000;
const CLIENTS: u64 = 4;
/// The client id of the reads after the faults.
const FINAL_CLIENT: u64 = 99;
/// How long the observers keep observing after the clients' last request could have been sent.
const OBSERVE_AFTER: Duration = Duration::from_secs(5);
/// KEYNOTIFY observers unless `MQSTATE_CLUSTER_FRONT_SIM_OBSERVERS` says how many (0: none).
const OBSERVERS: u64 = 2;
/// A request's message expiry: the head remembers its first reply this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one attempt waits for the reply before the client connects again and resends it.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// A client sends a request again (same correlation data) only this long after the first attempt,
/// well within its expiry: a retry after it would run again, as the protocol says.
const RETRY_WITHIN: Duration = Duration::from_secs(3);
/// Every key must answer a read within this long after the faults stopped.
const READABLE_WITHIN: Duration = Duration::from_secs(30);
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

/// A log's options as `serve` gives them, except that nothing is written on a thread of its own
/// (it would run outside simulated time): the state store's executor writes its batches itself,
/// as in `serve` (decision 0069); the other logs are written by their callers.
fn wal(name: &'static str, committer: Committer) -> WalOptions {
    WalOptions {
        name,
        committer,
        ..WalOptions::default()
    }
}

/// A cluster member, wired as `src/serve.rs` wires it (without the admin topic, metrics and TLS):
/// runs until its host crashes. `incarnation` is its mesh's, one per run of the host.
async fn node(
    id: NodeId,
    dir: PathBuf,
    skew_ms: Arc<AtomicI64>,
    incarnation: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let clock: SharedClock = Arc::new(SimClock { skew_ms });
    let store_config = StoreConfig {
        node_id: "mqstate".into(),
        limits: Limits::default(),
    };
    let (recovered, _) = mqstate_statestore::recovery::recover(
        &dir,
        wal("statestore", Committer::Owner),
        store_config.clone(),
        clock.now_ms(),
    )?;
    // Compaction is not simulated: its snapshots are encoded and written on blocking threads.
    let no_snapshots = u64::MAX;
    let (mut restored, session_log, appender) =
        mqstate_sessions::recover(&dir, wal("sessions", Committer::Caller), no_snapshots)?;
    let session_log = Arc::new(session_log);
    let replicated = ReplicatedSessions::new(id, session_log.clone());
    restored.sessions.clear();
    let broker = Broker::builder(BrokerConfig::default())
        .clock(clock.clone())
        .journal(Arc::new(replicated.clone()))
        .sessions_elsewhere(Arc::new(replicated.clone()))
        .build();
    replicated.attach_broker(broker.clone());
    broker.restore(restored);
    tokio::spawn(appender.run(broker.clone()));
    let inbox = broker.claim_topic(INVOKE_TOPIC)?;

    let map = MapConfig {
        partition_count: PARTITIONS,
        replication_factor: 3,
        lease_ms: LEASE_MS,
        clock_factor_ms: CLOCK_FACTOR_MS,
    };
    let config = sim_config(id, &NODES, dir.join("cluster"), map, clock.clone());
    let network = Network {
        listener: SimListener(turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?),
        connect: Arc::new(SimConnect),
        tls: None,
    };
    let data = DataPlane {
        wal: wal("chains", Committer::Caller),
        snapshot_threshold_bytes: no_snapshots,
        head: HeadConfig {
            store: store_config,
            limits: RequestLimits::default(),
            node: id,
        },
        clock: clock.clone(),
    };
    let mut running = mqstate_node::start(config, network, &dir, data).await?;
    running.attach_mesh(&broker, incarnation);
    replicated.attach_rows(running.session_rows());
    let _adopter = replicated.adopt_orphans_regularly();
    let service_config = ServiceConfig {
        router: Some(running.router(Some(&replicated))),
        ..ServiceConfig::default()
    };
    tokio::spawn(service::run(
        broker.clone(),
        inbox,
        recovered,
        service_config,
        std::future::pending(),
    ));
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", MQTT_PORT)).await?;
    // The host runs until it crashes, which drops its runtime and everything in it.
    let _running = running;
    mqstate_broker::serve_streams(|| listener.accept(), broker).await;
    Ok(())
}

/// The history; `-ERR` texts and refusals taken as "unknown" are its errors.
type Shared = Rc<RefCell<kv::History<NodeOp>>>;

/// A client's MQTT connection to a node, subscribed to its response topic.
struct Session {
    node: NodeId,
    conn: Conn<turmoil::net::TcpStream>,
}

/// Connects client `client` to a node drawn by `rng`.
async fn connect(client: u64, rng: &mut StdRng) -> Result<Session, String> {
    let node = NODES[rng.gen_range(0..NODES.len())];
    let handshake = async {
        let stream = turmoil::net::TcpStream::connect((host(node), MQTT_PORT))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let options = wire::Options {
            client_id: format!("c{client}"),
            keep_alive: Duration::from_secs(10),
            login: None,
            max_inflight: 1,
            resume: None,
            will: None,
        };
        let mut conn = Conn::start(stream, options)
            .await
            .map_err(|e| e.to_string())?;
        let topic = rpc::response_topic(&format!("c{client}"));
        conn.subscribe(vec![Filter::new(topic, QoS::AtLeastOnce)])
            .await?;
        Ok::<_, String>(conn)
    };
    let conn = tokio::time::timeout(CALL_TIMEOUT, handshake)
        .await
        .map_err(|_| "the handshake timed out".to_owned())??;
    Ok(Session { node, conn })
}

/// What one request's exchange gave.
enum Answer {
    Outcome(Outcome),
    /// An answer no state store gives (a bug): the seed fails.
    Wrong(String),
}

/// Sends one request on `session` and waits for its reply; the session is dropped (set to
/// `None`) when it failed or the reply did not come in time. `seq` makes the correlation data.
async fn exchange(
    session: &mut Option<Session>,
    history: &Shared,
    client: u64,
    seq: u64,
    key: &str,
    cmd: &Cmd,
    ts: &Hlc,
) -> Answer {
    let Some(Session { conn, .. }) = session.as_mut() else {
        return Answer::Outcome(Outcome::Unknown);
    };
    let run = async {
        let reply = rpc::exchange(
            conn,
            &format!("c{client}"),
            seq,
            Bytes::from(kv::resp(cmd, key)),
            ts,
            kv::fencing_token(cmd),
            CALL_TIMEOUT,
        )
        .await?;
        Ok(match reply {
            Ok(p) => {
                let ts = rpc::user_property(p.properties.as_ref(), TIMESTAMP);
                kv::outcome(cmd, &p.payload, ts)
            }
            Err(code) => Err(format!("PUBACK 0x{code:02x}")),
        })
    };
    let answer: Result<Result<Result<Outcome, String>, String>, _> =
        tokio::time::timeout(ATTEMPT_TIMEOUT, run).await;
    match answer {
        Ok(Ok(Ok(outcome))) => Answer::Outcome(outcome),
        Ok(Ok(Err(error)))
            if error.starts_with("unexpected reply") || error.contains("without a version") =>
        {
            Answer::Wrong(error)
        }
        // An `-ERR` or a refused PUBLISH: counted, and taken as unknown.
        Ok(Ok(Err(error))) => {
            history.borrow_mut().count_error(error);
            Answer::Outcome(Outcome::Unknown)
        }
        // The connection broke or the reply did not come: it may have run.
        Ok(Err(_)) | Err(_) => {
            *session = None;
            Answer::Outcome(Outcome::Unknown)
        }
    }
}

/// Why [`call`] did not record an operation's outcome.
enum CallError {
    /// No connection could be made: nothing was sent.
    NotConnected,
    /// An answer no state store gives: the seed fails.
    Wrong(String),
}

/// Sends one request, connecting first if need be, and records it. Without an answer, it is sent
/// again on a new connection (to a node drawn again) within [`RETRY_WITHIN`], as an AIO client
/// resends an unacknowledged request after a reconnect.
async fn call(
    session: &mut Option<Session>,
    rng: &mut StdRng,
    history: &Shared,
    client: u64,
    seq: u64,
    key: &'static str,
    cmd: Cmd,
) -> Result<Outcome, CallError> {
    if session.is_none() {
        *session = Some(
            connect(client, rng)
                .await
                .map_err(|_| CallError::NotConnected)?,
        );
    }
    let invoked = history.borrow_mut().tick();
    let invoked_ms = sim_ms();
    let first = tokio::time::Instant::now();
    let ts = Hlc {
        wall_ms: EPOCH_MS + sim_ms(),
        counter: 0,
        node_id: format!("c{client}").into(),
    };
    let mut node = session.as_ref().map_or(0, |s| s.node);
    let answer = loop {
        let answer = exchange(session, history, client, seq, key, &cmd, &ts).await;
        let retry = matches!(answer, Answer::Outcome(Outcome::Unknown)) && session.is_none();
        if !retry || first.elapsed() >= RETRY_WITHIN {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(again) = connect(client, rng).await {
            node = again.node;
            *session = Some(again);
        }
        if first.elapsed() >= RETRY_WITHIN {
            break answer;
        }
    };
    let (outcome, wrong) = match answer {
        Answer::Outcome(outcome) => (outcome, None),
        Answer::Wrong(error) => (Outcome::Unknown, Some(error)),
    };
    let returned = history.borrow_mut().returned(&outcome);
    // The model of an expiring key needs the simulated times; the other keys' operations record
    // none, so they are as they were before expiring keys existed.
    let returned_ms = if returned == mqstate_wgl::UNKNOWN {
        mqstate_wgl::UNKNOWN
    } else {
        sim_ms()
    };
    let ms = TTL_KEYS.contains(&key).then_some((invoked_ms, returned_ms));
    history.borrow_mut().ops.push(NodeOp {
        node,
        key,
        kv: kv::Op {
            client,
            cmd,
            invoked,
            returned,
            outcome: outcome.clone(),
            ms,
        },
    });
    match wrong {
        Some(error) => Err(CallError::Wrong(format!("c{client}: {error}"))),
        None => Ok(outcome),
    }
}

fn client_rng(seed: u64, id: u64) -> StdRng {
    StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(id))
}

/// A client: requests on random keys until `until`, one at a time, reconnecting as needed.
async fn client(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, id);
    let mut session: Option<Session> = None;
    // Values this client wrote, for its VDELs (the latest most often).
    let mut written: Vec<u64> = Vec::new();
    let mut seq = 0u64;
    // The cluster forms in the first second or two; requests before that wait in the nodes.
    tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1_500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        seq += 1;
        let key = KEYS[rng.gen_range(0..KEYS.len())];
        let cmd = kv::draw(&mut rng, id, seq, &mut written);
        match call(&mut session, &mut rng, &history, id, seq, key, cmd).await {
            Ok(_) => {}
            Err(CallError::Wrong(e)) => return Err(e.into()),
            // The node is down or cut off: try again (elsewhere) a little later.
            Err(CallError::NotConnected) => {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..40))).await;
    }
    Ok(())
}

/// A lock holder, as the robustness tool's (without the lease's expiry): takes the lock with
/// `SET NX` (its version is the fencing token), then writes the fenced key with its token, reads
/// it, or releases the lock (`VDEL` of its value); now and then it writes once more with a token
/// it held before, as a holder that stalled past its hold would: refused if a newer holder wrote
/// since. Neither DEL nor an unfenced SET touches the fenced key (either would be refused).
async fn lock_holder(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, id);
    let mut session: Option<Session> = None;
    let mut seq = 0u64;
    // The lock's value while this client holds it, with its version: the fencing token.
    let mut holding: Option<(u64, Hlc)> = None;
    // The token of an earlier hold.
    let mut stale: Option<Hlc> = None;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1_500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        seq += 1;
        let value = id << 32 | seq;
        let (key, cmd) = match &holding {
            None => (LOCK_KEY, Cmd::Set { value, nx: true }),
            Some((held, token)) => match rng.gen_range(0..100) {
                0..60 => (
                    FENCED_KEY,
                    Cmd::FencedSet {
                        value,
                        token: token.clone(),
                    },
                ),
                60..75 => (FENCED_KEY, Cmd::Get),
                75..90 => (LOCK_KEY, Cmd::Vdel { value: *held }),
                _ => match &stale {
                    Some(old) => (
                        FENCED_KEY,
                        Cmd::FencedSet {
                            value,
                            token: old.clone(),
                        },
                    ),
                    None => (LOCK_KEY, Cmd::Get),
                },
            },
        };
        let outcome = match call(&mut session, &mut rng, &history, id, seq, key, cmd.clone()).await
        {
            Ok(outcome) => outcome,
            Err(CallError::Wrong(e)) => return Err(e.into()),
            Err(CallError::NotConnected) => {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await;
                continue;
            }
        };
        match (&cmd, outcome) {
            (Cmd::Set { .. }, Outcome::Written(token)) => holding = Some((value, token)),
            // Taken, perhaps by this client's own request whose answer never came: a read tells.
            (Cmd::Set { .. }, Outcome::NotApplied | Outcome::Unknown) => {
                seq += 1;
                let read = call(&mut session, &mut rng, &history, id, seq, key, Cmd::Get).await;
                if let Ok(Outcome::Hit(held, token)) = read {
                    if held >> 32 == id {
                        holding = Some((held, token));
                    }
                }
            }
            // Released, or no longer this client's; an unknown release is tried again later.
            (Cmd::Vdel { .. }, Outcome::Deleted(_)) => {
                stale = holding.take().map(|(_, token)| token);
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..40))).await;
    }
    Ok(())
}

/// An expiring writer: on the keys [`TTL_KEYS`], 25 % SET with `PX` (of [`PX_MS`]), 10 % SET NX
/// with `PX`, 5 % SET without, 50 % GET, 10 % DEL, with pauses of up to 300 ms, so reads fall
/// before, around and after the expiries.
async fn expirer(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, id);
    let mut session: Option<Session> = None;
    let mut seq = 0u64;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1_500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        seq += 1;
        let key = TTL_KEYS[rng.gen_range(0..TTL_KEYS.len())];
        let value = id << 32 | seq;
        let cmd = match rng.gen_range(0..100) {
            0..25 => Cmd::SetPx {
                value,
                nx: false,
                px_ms: rng.gen_range(PX_MS),
            },
            25..35 => Cmd::SetPx {
                value,
                nx: true,
                px_ms: rng.gen_range(PX_MS),
            },
            35..40 => Cmd::Set { value, nx: false },
            40..90 => Cmd::Get,
            _ => Cmd::Del,
        };
        match call(&mut session, &mut rng, &history, id, seq, key, cmd).await {
            Ok(_) => {}
            Err(CallError::Wrong(e)) => return Err(e.into()),
            Err(CallError::NotConnected) => {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..300))).await;
    }
    Ok(())
}

/// After the faults: reads every key of `keys` until it answers.
async fn final_reads(
    seed: u64,
    from: Duration,
    keys: Vec<&'static str>,
    history: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    tokio::time::sleep(from).await;
    let mut rng = client_rng(seed, FINAL_CLIENT);
    let started = tokio::time::Instant::now();
    let mut session: Option<Session> = None;
    let mut seq = 0;
    for key in keys {
        loop {
            seq += 1;
            match call(
                &mut session,
                &mut rng,
                &history,
                FINAL_CLIENT,
                seq,
                key,
                Cmd::Get,
            )
            .await
            {
                Ok(Outcome::Unknown) | Err(CallError::NotConnected) => {}
                Ok(_) => break,
                Err(CallError::Wrong(e)) => return Err(e.into()),
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
    Ok(())
}

/// The KEYNOTIFY observers' session expiry: longer than any run, so a reconnect always finds it.
const OBSERVER_SESSION_EXPIRY_SECS: u32 = 3_600;
/// How long an observer stays on a connection before it leaves it on its own (ms).
const OBSERVER_STAYS_MS: std::ops::Range<u64> = 1_000..6_000;
/// Observer `i`'s generator is [`client_rng`]`(seed, OBSERVER_RNG + i)`, apart from the clients'.
const OBSERVER_RNG: u64 = 1_000;

/// What the observers recorded, in the order it happened.
#[derive(Debug, Clone, Hash)]
enum Observed {
    /// `KEYNOTIFY key` on connection `epoch` answered `+OK` at `at` (a place of the history's
    /// clock, which orders it against the operations' invocations).
    Registered {
        observer: u64,
        epoch: u32,
        key: &'static str,
        at: u64,
    },
    /// A notification received on connection `epoch`, from `node`, at simulated millisecond `ms`.
    Notified {
        observer: u64,
        epoch: u32,
        node: NodeId,
        key: String,
        change: notify::Change<u64>,
        version: Option<Hlc>,
        ms: u64,
    },
    /// A reconnect of the observer's persistent session answered Session Present 0.
    SessionLost { observer: u64, epoch: u32 },
    /// A notification no state store sends (its topic, payload or value does not parse).
    Garbled { observer: u64, what: String },
}

type Watched = Rc<RefCell<Vec<Observed>>>;

fn observer_name(id: u64) -> String {
    format!("o{id}")
}

/// A KEYNOTIFY observer with a persistent session, as the robustness tool's: connects to a node
/// drawn by the seed, registers every key, records what arrives until `until`; when the
/// connection fails, connects to a node drawn anew and registers again (a KEYNOTIFY of a key the
/// session observes already is answered `+OK`). It also leaves a connection on its own after a
/// while (dropping it, as a lost connection), so its session moves between live nodes too: the
/// node it comes to catches up from the session's cursors (decision 0065).
async fn observer(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
    watched: Watched,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, OBSERVER_RNG + id);
    let mut epoch = 0u32;
    let mut seq = 0u64;
    // Whether a connection was accepted already: from then on the session must be there.
    let mut accepted = false;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(200..1_000))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        let node = NODES[rng.gen_range(0..NODES.len())];
        let leave = until.min(
            turmoil::sim_elapsed().unwrap_or_default()
                + Duration::from_millis(rng.gen_range(OBSERVER_STAYS_MS)),
        );
        epoch += 1;
        observe(
            id,
            node,
            epoch,
            &mut seq,
            &mut accepted,
            leave,
            &history,
            &watched,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(50..300))).await;
    }
    Ok(())
}

/// One connection of observer `id` to `node`, until it fails or the simulated time is `leave`.
#[allow(clippy::too_many_arguments)]
async fn observe(
    id: u64,
    node: NodeId,
    epoch: u32,
    seq: &mut u64,
    accepted: &mut bool,
    leave: Duration,
    history: &Shared,
    watched: &Watched,
) {
    let name = observer_name(id);
    let handshake = async {
        let stream = turmoil::net::TcpStream::connect((host(node), MQTT_PORT))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let options = wire::Options {
            client_id: name.clone(),
            keep_alive: Duration::from_secs(10),
            login: None,
            max_inflight: 8,
            resume: Some(OBSERVER_SESSION_EXPIRY_SECS),
            will: None,
        };
        let mut conn = Conn::start(stream, options)
            .await
            .map_err(|e| e.to_string())?;
        if *accepted && !conn.session_present() {
            watched.borrow_mut().push(Observed::SessionLost {
                observer: id,
                epoch,
            });
        }
        *accepted = true;
        let topic = rpc::response_topic(&name);
        conn.subscribe(vec![Filter::new(topic, QoS::AtLeastOnce)])
            .await?;
        Ok::<_, String>(conn)
    };
    let Ok(Ok(mut conn)) = tokio::time::timeout(CALL_TIMEOUT, handshake).await else {
        return;
    };
    let record = |p: &Publish| record_notification(id, epoch, node, p, watched);
    for key in KEYS {
        *seq += 1;
        let ts = Hlc {
            wall_ms: EPOCH_MS + sim_ms(),
            counter: 0,
            node_id: name.clone().into(),
        };
        let correlation = rpc::correlation(*seq);
        let properties = rpc::request_properties(
            &name,
            &rpc::response_topic(&name),
            correlation.clone(),
            &ts,
            None,
            CALL_TIMEOUT,
        );
        let mut publish = wire::publish(
            &Bytes::from_static(INVOKE_TOPIC.as_bytes()),
            QoS::AtLeastOnce,
            mqstate_protocol::encode_request(&["KEYNOTIFY", key]),
            Some(properties),
        );
        let registered = async {
            while !conn.window_open() {
                pump(&mut conn, &record, None).await?;
            }
            conn.publish(&mut publish)?;
            conn.flush().await?;
            loop {
                if let Some(reply) = pump(&mut conn, &record, Some(&correlation)).await? {
                    return Ok::<_, String>(reply);
                }
            }
        };
        match tokio::time::timeout(ATTEMPT_TIMEOUT, registered).await {
            Ok(Ok(reply)) if reply.payload.as_ref() == b"+OK\r\n" => {
                let at = history.borrow_mut().tick();
                watched.borrow_mut().push(Observed::Registered {
                    observer: id,
                    epoch,
                    key,
                    at,
                });
            }
            Ok(Ok(reply)) => {
                history.borrow_mut().count_error(format!(
                    "KEYNOTIFY: {}",
                    String::from_utf8_lossy(&reply.payload).trim_end()
                ));
                return;
            }
            Ok(Err(_)) | Err(_) => return,
        }
    }
    while turmoil::sim_elapsed().unwrap_or_default() < leave {
        if pump(&mut conn, &record, None).await.is_err() {
            return;
        }
    }
    // The session stays on the server (the connection is dropped without a DISCONNECT).
}

/// One turn of an observer's connection: every PUBLISH that came is acknowledged, notifications are
/// recorded, and the reply with correlation data `wanted` is handed back if it came.
async fn pump(
    conn: &mut Conn<turmoil::net::TcpStream>,
    record: &impl Fn(&Publish),
    wanted: Option<&Bytes>,
) -> Result<Option<Publish>, String> {
    let mut reply = None;
    if let wire::Turn::Input = conn.read().await? {
        while let Some(p) = conn.next()? {
            conn.acknowledge(&p)?;
            if p.topic.starts_with(NOTIFY_TOPIC_PREFIX.as_bytes()) {
                record(&p);
            } else if wanted.is_some()
                && p.properties
                    .as_ref()
                    .and_then(|p| p.correlation_data.as_ref())
                    == wanted
            {
                reply = Some(p);
            }
            // Else a late reply to an earlier KEYNOTIFY of this observer.
        }
    }
    conn.flush().await?;
    Ok(reply)
}

/// Records a notification observer `id` received on connection `epoch` from `node`.
fn record_notification(id: u64, epoch: u32, node: NodeId, p: &Publish, watched: &Watched) {
    let topic = String::from_utf8_lossy(&p.topic);
    let key = notified_key(&topic).and_then(|k| String::from_utf8(k).ok());
    let change = match NotifyPayload::parse(&p.payload) {
        Ok(NotifyPayload::Set(value)) => std::str::from_utf8(&value)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(notify::Change::Set),
        Ok(NotifyPayload::Delete) => Some(notify::Change::Delete),
        Err(_) => None,
    };
    let (Some(key), Some(change)) = (key, change) else {
        watched.borrow_mut().push(Observed::Garbled {
            observer: id,
            what: format!("{topic} {:?}", p.payload),
        });
        return;
    };
    let version =
        rpc::user_property(p.properties.as_ref(), TIMESTAMP).and_then(|ts| Hlc::parse(ts).ok());
    watched.borrow_mut().push(Observed::Notified {
        observer: id,
        epoch,
        node,
        key,
        change,
        version,
        ms: sim_ms(),
    });
}

/// The findings of the observers' records: the rules of `mqstate_wgl::notify` against the
/// acknowledged SETs of `history`, a lost persistent session, a notification that does not parse.
fn observer_findings(history: &kv::History<NodeOp>, watched: &[Observed]) -> Vec<String> {
    let mut findings = Vec::new();
    let names: BTreeMap<u64, String> = watched
        .iter()
        .map(|o| match o {
            Observed::Registered { observer, .. }
            | Observed::Notified { observer, .. }
            | Observed::SessionLost { observer, .. }
            | Observed::Garbled { observer, .. } => (*observer, observer_name(*observer)),
        })
        .collect();
    let mut notes = Vec::new();
    let mut registrations = Vec::new();
    for o in watched {
        match o {
            Observed::Registered {
                observer,
                epoch,
                key,
                at,
            } => registrations.push(notify::Registered {
                observer: &names[observer],
                epoch: *epoch,
                key,
                at: *at,
            }),
            Observed::Notified {
                observer,
                epoch,
                key,
                change,
                version,
                ..
            } => notes.push(notify::Note {
                observer: &names[observer],
                epoch: *epoch,
                key,
                change,
                version: version.as_ref(),
            }),
            Observed::SessionLost { observer, epoch } => findings.push(format!(
                "session-present: {} lost its persistent session at connection {epoch}",
                names[observer]
            )),
            Observed::Garbled { observer, what } => findings.push(format!(
                "protocol: {} got a notification that does not parse: {what}",
                names[observer]
            )),
        }
    }
    let writes: Vec<notify::Write<'_, u64>> = history
        .ops
        .iter()
        .enumerate()
        .filter_map(|(id, op)| match (&op.kv.cmd, &op.kv.outcome) {
            (Cmd::Set { value, .. }, Outcome::Written(version)) => Some(notify::Write {
                id,
                key: op.key,
                invoked: op.kv.invoked,
                version,
                value,
            }),
            _ => None,
        })
        .collect();
    for f in notify::check(&notes, &registrations, &writes) {
        findings.push(format!("{} {}: {}", f.check, f.key, f.detail));
    }
    findings
}

/// Will clients unless `MQSTATE_CLUSTER_FRONT_SIM_WILLS` says how many (0: none, and no recorder):
/// client `w<i>`, its generator `client_rng(seed, WILL_RNG + i)`; the recorder's is
/// `client_rng(seed, WILL_RNG)`. Off by default until the lost wills that seeds 1–200 show are
/// explained (decision 0071's amendment on wills).
const WILLS: u64 = 0;
const WILL_RNG: u64 = 2_000;
/// The wills' topics are `will/w<i>`; the recorder subscribes to `will/#`.
const WILL_TOPIC_PREFIX: &str = "will/";
/// How long the recorder keeps recording after the will clients stopped: longer than any will
/// delay or session expiry they set, plus an adoption after a node's death.
const RECORD_AFTER: Duration = Duration::from_secs(20);
/// A fault of a will client's node within this long after its connection ended (or its will
/// arrived) makes a will published after a DISCONNECT, twice, lost or early a known limit.
const FAULT_REACH: Duration = Duration::from_secs(3);

/// How a will client's connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Ending {
    /// Its CONNECT got no CONNACK in time: the server may have taken it (and its will) all the same.
    NotAcked,
    /// A normal DISCONNECT, and the server closed the connection after it.
    Disconnected,
    /// A DISCONNECT was sent but the server's close did not follow: it may not have arrived.
    Unconfirmed,
    /// The client dropped the connection without a DISCONNECT.
    Dropped,
    /// The connection failed, or the server sent DISCONNECT.
    Failed,
}

/// One connection of a will client: its will is `w<client>/<epoch>`.
#[derive(Debug, Clone, Hash)]
struct WillEpoch {
    client: u64,
    epoch: u32,
    node: NodeId,
    delay_s: u32,
    /// 0: a clean start; else the session's expiry, resumed if the server has it.
    expiry_s: u32,
    session_present: bool,
    ending: Ending,
    /// Simulated ms of the CONNECT, of the end, and of the last bytes the server sent on it.
    connect_ms: u64,
    ended_ms: u64,
    heard_ms: u64,
}

impl WillEpoch {
    fn payload(&self) -> String {
        format!("{}/{}", will_name(self.client), self.epoch)
    }
}

/// What the recorder saw.
#[derive(Debug, Clone, Hash)]
enum WillSeen {
    /// Its subscription to `will/#` was acknowledged (the first time).
    Subscribed {
        ms: u64,
    },
    /// Its connection to `node` was accepted and subscribed (the session is served there).
    Connected {
        node: NodeId,
        ms: u64,
    },
    Will {
        payload: String,
        dup: bool,
        ms: u64,
    },
    /// Its persistent session was not there when it came back.
    SessionLost {
        ms: u64,
    },
}

#[derive(Debug, Default, Hash)]
struct WillRecords {
    epochs: Vec<WillEpoch>,
    seen: Vec<WillSeen>,
}

type Wills = Rc<RefCell<WillRecords>>;

fn will_name(id: u64) -> String {
    format!("w{id}")
}

/// A client with a will: connects to a node drawn by the seed (a clean session, or one that
/// outlives the connection by 1 or 3 s and is resumed when there; a will delay of 0, 1 or 2 s),
/// stays 0.2–1.5 s, pinging every 0.75 s, then leaves with a normal DISCONNECT (40 %) or drops the
/// connection without one, and comes back 0.05–1.5 s later, until `until`.
async fn will_client(
    id: u64,
    seed: u64,
    until: Duration,
    wills: Wills,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, WILL_RNG + id);
    let name = will_name(id);
    let mut epoch = 0u32;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1_500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        epoch += 1;
        let node = NODES[rng.gen_range(0..NODES.len())];
        let delay_s = [0, 0, 1, 2][rng.gen_range(0..4)];
        let expiry_s = [0, 0, 1, 3][rng.gen_range(0..4)];
        let stay = Duration::from_millis(rng.gen_range(200..1_500));
        let disconnect = rng.gen_bool(0.4);
        let pause = Duration::from_millis(rng.gen_range(50..1_500));
        let mut record = WillEpoch {
            client: id,
            epoch,
            node,
            delay_s,
            expiry_s,
            session_present: false,
            ending: Ending::NotAcked,
            connect_ms: sim_ms(),
            ended_ms: 0,
            heard_ms: 0,
        };
        let properties = (delay_s > 0).then_some(LastWillProperties {
            delay_interval: Some(delay_s),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: None,
            response_topic: None,
            correlation_data: None,
            user_properties: Vec::new(),
        });
        let will = LastWill::new(
            format!("{WILL_TOPIC_PREFIX}{name}"),
            record.payload(),
            QoS::AtLeastOnce,
            false,
            properties,
        );
        let handshake = async {
            let stream = turmoil::net::TcpStream::connect((host(node), MQTT_PORT))
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let options = wire::Options {
                client_id: name.clone(),
                keep_alive: Duration::from_secs(1),
                login: None,
                max_inflight: 1,
                resume: (expiry_s > 0).then_some(expiry_s),
                will: Some(will),
            };
            Conn::start(stream, options)
                .await
                .map_err(|e| e.to_string())
        };
        // Refused, failed or timed out: the record stays `NotAcked`.
        if let Ok(Ok(mut conn)) = tokio::time::timeout(CALL_TIMEOUT, handshake).await {
            record.session_present = conn.session_present();
            record.heard_ms = sim_ms();
            let leave = turmoil::sim_elapsed().unwrap_or_default() + stay;
            record.ending = loop {
                if turmoil::sim_elapsed().unwrap_or_default() >= leave {
                    break if !disconnect {
                        drop(conn);
                        Ending::Dropped
                    } else {
                        match tokio::time::timeout(ATTEMPT_TIMEOUT, conn.disconnect()).await {
                            Ok(Ok(())) => Ending::Disconnected,
                            _ => Ending::Unconfirmed,
                        }
                    };
                }
                let turn = async {
                    let turn = conn.read().await?;
                    if turn == wire::Turn::Input {
                        // Only PINGRESPs come (a DISCONNECT is an error).
                        while conn.next()?.is_some() {}
                    }
                    conn.flush().await?;
                    Ok::<_, String>(turn)
                };
                match turn.await {
                    Ok(wire::Turn::Input) => record.heard_ms = sim_ms(),
                    Ok(wire::Turn::Tick) => {}
                    Err(_) => break Ending::Failed,
                }
            };
        }
        record.ended_ms = sim_ms();
        wills.borrow_mut().epochs.push(record);
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

/// The recorder of the wills: a persistent session subscribed to `will/#` at QoS 1, which moves
/// to a node drawn anew when its connection fails, until `until`.
async fn will_recorder(
    seed: u64,
    until: Duration,
    wills: Wills,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = client_rng(seed, WILL_RNG);
    let mut accepted = false;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(200..1_000))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        let node = NODES[rng.gen_range(0..NODES.len())];
        let handshake = async {
            let stream = turmoil::net::TcpStream::connect((host(node), MQTT_PORT))
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let options = wire::Options {
                client_id: "r1".into(),
                keep_alive: Duration::from_secs(10),
                login: None,
                max_inflight: 8,
                resume: Some(OBSERVER_SESSION_EXPIRY_SECS),
                will: None,
            };
            let mut conn = Conn::start(stream, options)
                .await
                .map_err(|e| e.to_string())?;
            if accepted && !conn.session_present() {
                wills
                    .borrow_mut()
                    .seen
                    .push(WillSeen::SessionLost { ms: sim_ms() });
            }
            let filter = format!("{WILL_TOPIC_PREFIX}#");
            conn.subscribe(vec![Filter::new(filter, QoS::AtLeastOnce)])
                .await?;
            if !accepted {
                wills
                    .borrow_mut()
                    .seen
                    .push(WillSeen::Subscribed { ms: sim_ms() });
            }
            wills
                .borrow_mut()
                .seen
                .push(WillSeen::Connected { node, ms: sim_ms() });
            accepted = true;
            Ok::<_, String>(conn)
        };
        if let Ok(Ok(mut conn)) = tokio::time::timeout(CALL_TIMEOUT, handshake).await {
            while turmoil::sim_elapsed().unwrap_or_default() < until {
                let turn = async {
                    if let wire::Turn::Input = conn.read().await? {
                        while let Some(p) = conn.next()? {
                            conn.acknowledge(&p)?;
                            wills.borrow_mut().seen.push(WillSeen::Will {
                                payload: String::from_utf8_lossy(&p.payload).into_owned(),
                                dup: p.dup,
                                ms: sim_ms(),
                            });
                        }
                    }
                    conn.flush().await
                };
                if turn.await.is_err() {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(50..300))).await;
    }
    Ok(())
}

/// The node faults of a run: the node, and the simulated ms it started and ended.
type NodeFaults = Vec<(NodeId, u64, u64)>;
/// The end of an interval that lasts to the end of the run.
const UNTIL_END: u64 = u64::MAX;

/// The checks of the wills against what the broker promises (decisions 0057, 0063, 0070): never
/// published after a normal DISCONNECT; published once the connection is lost and the session
/// ended or the will delay passed, unless a resumed session cancelled it; never while the server
/// still answers the connection; once. A case that a documented limit explains (its node crashed,
/// was cut off or had its links held, from the connection until [`FAULT_REACH`] after the will or
/// the end; a delayed will lost to a clean start on another node) is counted, not failed; the
/// rest are findings.
fn will_findings(records: &WillRecords, faults: &NodeFaults, counts: &mut Counts) -> Vec<String> {
    let mut findings = Vec::new();
    let mut count = |name: &str| *counts.entry(name.to_owned()).or_default() += 1;
    let mut receipts: BTreeMap<&str, Vec<(bool, u64)>> = BTreeMap::new();
    let mut subscribed = None;
    // Where the recorder's session was served, from when.
    let mut recorder: Vec<(NodeId, u64)> = Vec::new();
    for seen in &records.seen {
        match seen {
            WillSeen::Subscribed { ms } => subscribed = Some(*ms),
            WillSeen::Connected { node, ms } => recorder.push((*node, *ms)),
            WillSeen::Will { payload, dup, ms } => {
                receipts.entry(payload).or_default().push((*dup, *ms))
            }
            WillSeen::SessionLost { ms } => findings.push(format!(
                "will session-present: the recorder lost its persistent session at {ms} ms"
            )),
        }
    }
    let epochs: BTreeMap<String, &WillEpoch> =
        records.epochs.iter().map(|e| (e.payload(), e)).collect();
    for payload in receipts.keys() {
        if !epochs.contains_key(*payload) {
            findings.push(format!("will: {payload:?} is no will a client set"));
        }
    }
    for (i, e) in records.epochs.iter().enumerate() {
        count("will connections");
        let payload = e.payload();
        let got = receipts.get(payload.as_str()).map_or(&[][..], |r| &r[..]);
        let published = got.iter().filter(|(dup, _)| !dup).count();
        let last_ms = got.iter().map(|(_, ms)| *ms).max().unwrap_or(e.ended_ms);
        let reach = FAULT_REACH.as_millis() as u64;
        let faulted = faults.iter().any(|&(node, from, to)| {
            node == e.node && from <= last_ms.max(e.ended_ms) + reach && to >= e.connect_ms
        });
        let known =
            |what: &str, excused: bool, findings: &mut Vec<String>, count: &mut dyn FnMut(&str)| {
                if faulted || excused {
                    count(&format!("known limit: {what}"));
                } else {
                    findings.push(format!("will {what}: {payload} ({e:?}) received {got:?}"));
                }
            };
        if !got.is_empty() {
            count("wills received");
        }
        // The next CONNECT of the client may have resumed the session and cancelled the will.
        let next = records.epochs[i + 1..]
            .iter()
            .find(|n| n.client == e.client);
        let cancellable = e.expiry_s > 0
            && next.is_some_and(|n| {
                n.expiry_s > 0 && (n.ending == Ending::NotAcked || n.session_present)
            });
        let observable = subscribed.is_some_and(|ms| ms < e.connect_ms);
        // A delayed will whose session a clean start on another node ended may be lost when the
        // session had expired by that node's clock and not yet by its owner's (decision 0063).
        let elsewhere = e.delay_s > 0
            && e.expiry_s > 0
            && next.is_some_and(|n| n.node != e.node && n.expiry_s == 0);
        // The recorder's session was served by a node that faulted while the will was due: the
        // will may have been published and lost on its way (seed 75: a node cut off from the
        // mesh, its session adopted from the row without it). Reported apart, still a finding.
        let due_by = e.ended_ms + u64::from(e.delay_s.max(e.expiry_s)) * 1000 + reach;
        let recorder_faulted = recorder.iter().enumerate().any(|(j, &(node, from))| {
            let to = recorder.get(j + 1).map_or(UNTIL_END, |&(_, next)| next);
            from <= due_by
                && to >= e.ended_ms
                && faults.iter().any(|&(n, f_from, f_to)| {
                    n == node && f_from <= due_by.min(to) && f_to >= e.ended_ms.max(from)
                })
        });
        let lost = if recorder_faulted {
            "lost (the recorder's node faulted meanwhile)"
        } else {
            "lost"
        };
        match e.ending {
            Ending::Disconnected if !got.is_empty() => known(
                "published after a normal DISCONNECT",
                false,
                &mut findings,
                &mut count,
            ),
            Ending::Dropped | Ending::Failed if got.is_empty() && observable && !cancellable => {
                known(lost, elsewhere, &mut findings, &mut count)
            }
            Ending::Dropped | Ending::Failed if cancellable && got.is_empty() => {
                count("wills cancelled by a resumed session")
            }
            _ => {}
        }
        if published > 1 {
            known("published twice", false, &mut findings, &mut count);
        }
        // The server answered the connection after its will had arrived.
        if e.ending != Ending::NotAcked && got.iter().any(|(_, ms)| *ms < e.heard_ms) {
            known(
                "published while its connection was still answered",
                false,
                &mut findings,
                &mut count,
            );
        }
    }
    findings
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Node(NodeFault),
    /// A client is cut off from a node (what is in flight is lost) for a while.
    Cut(u64, NodeId, Duration),
    /// Messages between a client and a node are held back for a while, then delivered.
    Hold(u64, NodeId, Duration),
}

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::Node(fault) => fault.kind(),
            Fault::Cut(..) => "client cut off",
            Fault::Hold(..) => "client held",
        }
    }
}

fn client_host(id: u64) -> String {
    format!("c{id}")
}

/// What a seed's extra clients did, by name (notifications observed, expiring SETs, ...), for the
/// sweep's summary.
type Counts = BTreeMap<String, u64>;

/// Runs one seed with the `extra` clients; its violations, if any, with how to reproduce them.
/// Gives what the extra clients did.
fn run_seed(
    seed: u64,
    chaos: Duration,
    extra: Extra,
    figures: &mut Figures,
) -> Result<Counts, String> {
    let Extra {
        observers,
        locks,
        expirers,
        wills,
    } = extra;
    let mut rng = StdRng::seed_from_u64(seed);
    let root = data_root();
    let mut sim = simulation(
        seed,
        chaos + CALL_TIMEOUT + READABLE_WITHIN + Duration::from_secs(30),
        Duration::from_millis(rng.gen_range(2..20)),
    );
    let mut skews = BTreeMap::new();
    for id in NODES {
        let dir = root.path().join(host(id));
        let skew = rng.gen_range(-(CLOCK_FACTOR_MS as i64) / 2..=CLOCK_FACTOR_MS as i64 / 2);
        let skew = Arc::new(AtomicI64::new(skew));
        skews.insert(id, Arc::clone(&skew));
        // Each run of the host gets the next incarnation; the seed makes them differ between runs
        // of the simulation as a real node's clock and process id do.
        let first = rng.gen::<u32>() as u64;
        let boots = Arc::new(AtomicU64::new(0));
        sim.host(host(id), move || {
            let incarnation = (first + boots.fetch_add(1, Ordering::Relaxed)) << 16 | id;
            node(id, dir.clone(), Arc::clone(&skew), incarnation)
        });
    }
    let history: Shared = Rc::default();
    let offsets = skews.values().map(|s| s.load(Ordering::Relaxed));
    history.borrow_mut().clock_spread_ms = offsets
        .clone()
        .max()
        .unwrap_or(0)
        .abs_diff(offsets.min().unwrap_or(0));
    for id in 1..=CLIENTS {
        sim.client(client_host(id), client(id, seed, chaos, history.clone()));
    }
    let mut keys = KEYS.to_vec();
    if locks > 0 {
        keys.extend([LOCK_KEY, FENCED_KEY]);
    }
    if expirers > 0 {
        keys.extend(TTL_KEYS);
    }
    sim.client(
        client_host(FINAL_CLIENT),
        final_reads(
            seed,
            chaos + CALL_TIMEOUT + Duration::from_secs(2),
            keys.clone(),
            history.clone(),
        ),
    );
    // Drawn from generators of their own, as the observers are.
    for id in LOCK_CLIENT + 1..=LOCK_CLIENT + locks {
        sim.client(
            client_host(id),
            lock_holder(id, seed, chaos, history.clone()),
        );
    }
    for id in EXPIRE_CLIENT + 1..=EXPIRE_CLIENT + expirers {
        sim.client(client_host(id), expirer(id, seed, chaos, history.clone()));
    }
    let will_records: Wills = Rc::default();
    if wills > 0 {
        sim.client(
            "r1",
            will_recorder(seed, chaos + RECORD_AFTER, will_records.clone()),
        );
    }
    for id in 1..=wills {
        sim.client(
            will_name(id),
            will_client(id, seed, chaos, will_records.clone()),
        );
    }
    // Drawn from generators of their own: without observers, a seed runs as it did before them.
    let watched: Watched = Rc::default();
    for id in 1..=observers {
        sim.client(
            observer_name(id),
            observer(
                id,
                seed,
                chaos + CALL_TIMEOUT + OBSERVE_AFTER,
                history.clone(),
                watched.clone(),
            ),
        );
    }

    let mut schedule: Vec<(Duration, Fault)> = Vec::new();
    let mut at = Duration::from_millis(rng.gen_range(1_500..2_500));
    while at < chaos {
        let node = NODES[rng.gen_range(0..NODES.len())];
        let lasting = Duration::from_millis(rng.gen_range(300..3_000));
        let client = rng.gen_range(1..=CLIENTS);
        let fault = match rng.gen_range(0..5) {
            0 => Fault::Node(NodeFault::Crash(node, lasting)),
            1 => Fault::Node(NodeFault::Isolate(node, lasting)),
            2 => Fault::Node(NodeFault::hold(
                &NODES,
                node,
                rng.gen_range(1..NODES.len()),
                lasting,
            )),
            3 => Fault::Cut(client, node, lasting),
            _ => Fault::Hold(client, node, lasting),
        };
        schedule.push((at, fault));
        at += lasting + Duration::from_millis(rng.gen_range(100..1_000));
    }
    for (_, fault) in &schedule {
        *figures.faults.entry(fault.kind()).or_default() += 1;
    }
    let node_faults: NodeFaults = schedule
        .iter()
        .flat_map(|(at, fault)| {
            let (nodes, lasting) = match fault {
                Fault::Node(NodeFault::Crash(n, lasting) | NodeFault::Isolate(n, lasting)) => {
                    (vec![*n], *lasting)
                }
                Fault::Node(NodeFault::Hold(a, b, lasting)) => (vec![*a, *b], *lasting),
                Fault::Cut(..) | Fault::Hold(..) => (Vec::new(), Duration::ZERO),
            };
            let from = at.as_millis() as u64;
            let to = (*at + lasting).as_millis() as u64;
            nodes.into_iter().map(move |n| (n, from, to))
        })
        .collect();
    let start_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Node(fault) => fault.start(sim, &NODES),
        Fault::Cut(client, node, lasting) => {
            sim.partition(client_host(client), host(node));
            lasting
        }
        Fault::Hold(client, node, lasting) => {
            sim.hold(client_host(client), host(node));
            lasting
        }
    };
    let end_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Node(fault) => fault.end(sim, &NODES),
        Fault::Cut(client, node, _) => sim.repair(client_host(client), host(node)),
        Fault::Hold(client, node, _) => sim.release(client_host(client), host(node)),
    };
    let outcome = run_faults(&mut sim, chaos, schedule, start_fault, end_fault);
    let simulated = sim.elapsed();
    drop(sim);

    let history = history.borrow();
    let watched = watched.borrow();
    figures.add(simulated, &history);
    history.dump("MQSTATE_CLUSTER_FRONT_SIM_DUMP", seed);
    if observers > 0 {
        // The observers' records are part of the run: in its trace and after its operations in
        // the dump.
        let mut hasher = DefaultHasher::new();
        (figures.trace, &*watched).hash(&mut hasher);
        figures.trace = std::hash::Hasher::finish(&hasher);
        if let Ok(path) = std::env::var("MQSTATE_CLUSTER_FRONT_SIM_DUMP") {
            let text: String = watched.iter().map(|o| format!("{o:?}\n")).collect();
            let appended = std::fs::OpenOptions::new()
                .append(true)
                .open(format!("{path}.{seed}"))
                .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
            // Only a tool for comparing runs: a failed write shows as a difference.
            let _ = appended;
        }
    }
    let will_records = will_records.borrow();
    if wills > 0 {
        // The wills' records are part of the run, as the observers' are.
        let mut hasher = DefaultHasher::new();
        (figures.trace, &*will_records).hash(&mut hasher);
        figures.trace = std::hash::Hasher::finish(&hasher);
        if let Ok(path) = std::env::var("MQSTATE_CLUSTER_FRONT_SIM_DUMP") {
            let text: String = (will_records.epochs.iter().map(|e| format!("{e:?}\n")))
                .chain(will_records.seen.iter().map(|s| format!("{s:?}\n")))
                .collect();
            let appended = std::fs::OpenOptions::new()
                .append(true)
                .open(format!("{path}.{seed}"))
                .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
            // Only a tool for comparing runs: a failed write shows as a difference.
            let _ = appended;
        }
    }
    let mut findings = history.findings(outcome, &keys, FINAL_CLIENT, SEARCH_BUDGET);
    findings.extend(observer_findings(&history, &watched));
    let mut counts = Counts::new();
    if wills > 0 {
        findings.extend(will_findings(&will_records, &node_faults, &mut counts));
    }
    let mut count = |name: &str, n: usize| {
        if n > 0 {
            counts.insert(name.to_owned(), n as u64);
        }
    };
    count(
        "notifications observed",
        watched
            .iter()
            .filter(|o| matches!(o, Observed::Notified { .. }))
            .count(),
    );
    let ttl = |op: &&NodeOp| TTL_KEYS.contains(&op.key);
    count(
        "expiring SETs acknowledged",
        history
            .ops
            .iter()
            .filter(ttl)
            .filter(|op| {
                matches!(
                    (&op.kv.cmd, &op.kv.outcome),
                    (Cmd::SetPx { .. }, Outcome::Written(_))
                )
            })
            .count(),
    );
    count(
        "reads of an expiring key that missed",
        history
            .ops
            .iter()
            .filter(ttl)
            .filter(|op| op.kv.outcome == Outcome::Miss)
            .count(),
    );
    if findings.is_empty() {
        Ok(counts)
    } else {
        Err(format!(
            "seed {seed} (reproduce: MQSTATE_CLUSTER_FRONT_SIM_SEED={seed} cargo test -p mqstate-node --test turmoil_sim -- --nocapture):\n  {}",
            findings.join("\n  ")
        ))
    }
}

const TEST: &str = "the_cluster_is_linearizable_and_loses_no_acknowledged_write_under_faults";
const OBSERVERS_VAR: &str = "MQSTATE_CLUSTER_FRONT_SIM_OBSERVERS";
const LOCKS_VAR: &str = "MQSTATE_CLUSTER_FRONT_SIM_LOCKS";
const EXPIRERS_VAR: &str = "MQSTATE_CLUSTER_FRONT_SIM_EXPIRERS";
const WILLS_VAR: &str = "MQSTATE_CLUSTER_FRONT_SIM_WILLS";

/// The clients beside the four of every run: KEYNOTIFY observers, lock holders and expiring
/// writers.
#[derive(Debug, Clone, Copy)]
struct Extra {
    observers: u64,
    locks: u64,
    expirers: u64,
    wills: u64,
}

impl Extra {
    /// [`OBSERVERS`], [`LOCKS`] and [`EXPIRERS`] unless the environment says otherwise.
    fn from_env() -> Extra {
        Extra {
            observers: mqstate_cluster::sim::env_u64(OBSERVERS_VAR).unwrap_or(OBSERVERS),
            locks: mqstate_cluster::sim::env_u64(LOCKS_VAR).unwrap_or(LOCKS),
            expirers: mqstate_cluster::sim::env_u64(EXPIRERS_VAR).unwrap_or(EXPIRERS),
            wills: mqstate_cluster::sim::env_u64(WILLS_VAR).unwrap_or(WILLS),
        }
    }
}
/// Set in the process that runs one seed for a sweep (see [`run_apart`]).
const ONE_SEED: &str = "MQSTATE_CLUSTER_FRONT_SIM_ONE";
/// The fault kinds a seed reports, as [`Figures::faults`] names them.
const FAULT_KINDS: [&str; 5] = ["crash", "isolate", "hold", "client cut off", "client held"];

/// Runs one seed in a process of its own (this test binary again, with [`ONE_SEED`] set) and adds
/// what it reports to `figures`. A seed's history depends on what ran before it in the same
/// process (decision 0071), so each seed starts from a new process: a seed of a sweep is then
/// reproduced by running it alone.
fn run_apart(
    seed: u64,
    chaos: Duration,
    extra: Extra,
    figures: &mut Figures,
    counts: &mut Counts,
) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("seed {seed}: no test binary: {e}"))?;
    let output = std::process::Command::new(exe)
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(ONE_SEED, seed.to_string())
        .env(
            "MQSTATE_CLUSTER_FRONT_SIM_CHAOS_SECS",
            chaos.as_secs().to_string(),
        )
        .env(OBSERVERS_VAR, extra.observers.to_string())
        .env(LOCKS_VAR, extra.locks.to_string())
        .env(EXPIRERS_VAR, extra.expirers.to_string())
        .env(WILLS_VAR, extra.wills.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("seed {seed}: cannot run it: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut reported = false;
    let mut failure = None;
    for line in stdout.lines() {
        let mut words = line.splitn(2, ' ');
        match (words.next(), words.next()) {
            (Some("sim-seed"), Some(rest)) => {
                let n: Vec<u64> = rest
                    .split(' ')
                    .map(|w| u64::from_str_radix(w, 16).unwrap_or(0))
                    .collect();
                let [ms, ops, acked, unknown, trace] = n[..] else {
                    return Err(format!(
                        "seed {seed}: a report line that does not parse: {line}"
                    ));
                };
                figures.seeds += 1;
                figures.simulated += Duration::from_millis(ms);
                figures.ops += ops;
                figures.acked += acked;
                figures.unknown += unknown;
                let mut hasher = DefaultHasher::new();
                (figures.trace, trace).hash(&mut hasher);
                figures.trace = std::hash::Hasher::finish(&hasher);
                reported = true;
            }
            (Some("sim-fault"), Some(rest)) => {
                let (n, kind) = rest.split_once(' ').unwrap_or(("0", rest));
                if let Some(kind) = FAULT_KINDS.iter().find(|k| **k == kind) {
                    *figures.faults.entry(kind).or_default() += n.parse::<u64>().unwrap_or(0);
                }
            }
            (Some("sim-error"), Some(rest)) => {
                let (n, error) = rest.split_once(' ').unwrap_or(("0", rest));
                *figures.errors.entry(error.to_owned()).or_default() +=
                    n.parse::<u64>().unwrap_or(0);
            }
            (Some("sim-failure"), Some(rest)) => failure = Some(rest.replace('\u{1f}', "\n")),
            (Some("sim-count"), Some(rest)) => {
                let (n, name) = rest.split_once(' ').unwrap_or(("0", rest));
                *counts.entry(name.to_owned()).or_default() += n.parse::<u64>().unwrap_or(0);
            }
            (Some("running" | "test"), _) | (Some("" | "ok"), None) => {}
            _ => println!("{line}"),
        }
    }
    match (failure, reported) {
        (Some(failure), _) => Err(failure),
        (None, true) => Ok(()),
        (None, false) => Err(format!(
            "seed {seed}: its process ended ({}) without a report",
            output.status
        )),
    }
}

/// The process of one seed ([`run_apart`]): runs it and reports its figures on stdout.
fn run_one(seed: u64) {
    let chaos = Duration::from_secs(
        mqstate_cluster::sim::env_u64("MQSTATE_CLUSTER_FRONT_SIM_CHAOS_SECS").unwrap_or(8),
    );
    let extra = Extra::from_env();
    let mut figures = Figures::default();
    let outcome = run_seed(seed, chaos, extra, &mut figures);
    // The test harness's "test … " has no line end of its own yet.
    println!();
    for (kind, n) in &figures.faults {
        println!("sim-fault {n} {kind}");
    }
    for (error, n) in &figures.errors {
        println!("sim-error {n} {}", error.replace('\n', " "));
    }
    match outcome {
        Ok(counts) => {
            for (name, n) in counts {
                println!("sim-count {n} {name}");
            }
        }
        Err(findings) => println!("sim-failure {}", findings.replace('\n', "\u{1f}")),
    }
    println!(
        "sim-seed {:x} {:x} {:x} {:x} {:x}",
        figures.simulated.as_millis(),
        figures.ops,
        figures.acked,
        figures.unknown,
        figures.trace
    );
}

#[test]
fn the_cluster_is_linearizable_and_loses_no_acknowledged_write_under_faults() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "off".to_owned()))
        // Simulated time in the lines, not real: two runs of a seed log the same text (diff them).
        .with_timer(SimTimer)
        .with_test_writer()
        .try_init();
    if let Some(seed) = mqstate_cluster::sim::env_u64(ONE_SEED) {
        run_one(seed);
        return;
    }
    let mut counts = Counts::new();
    let extra = Extra::from_env();
    let sweep = sweep("MQSTATE_CLUSTER_FRONT_SIM", 2, 8, |seed, chaos, figures| {
        run_apart(seed, chaos, extra, figures, &mut counts)
    });
    let counts: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    println!(
        "{}; {}",
        sweep.figures.summary(
            "cluster",
            "-ERR or refused",
            sweep.failures.len(),
            sweep.real
        ),
        counts.join(", ")
    );
    for (error, n) in &sweep.figures.errors {
        println!("  {n} × {error} (taken as unknown)");
    }
    assert!(sweep.failures.is_empty(), "{}", sweep.failures.join("\n"));
}

/// Seeds 24 and 133 with two observers and no lock holders: an observer's session moved to
/// another node with a change in flight (sent, not acknowledged), the new node sent the changes
/// queued after it with packet ids from 1 up, the connection was lost, and the next one got the
/// messages in flight again by packet id: the newer changes first, then the older one
/// (`notification-order`, the 3-node soak's shape). Both failed before `resend_inflight`
/// (`crates/broker/src/connection.rs`) resent in the order of first sending.
#[test]
fn an_observer_gets_its_changes_in_order_when_its_session_moves_with_one_in_flight() {
    let extra = Extra {
        observers: 2,
        locks: 0,
        expirers: 0,
        wills: 0,
    };
    let mut figures = Figures::default();
    let mut counts = Counts::new();
    let failures: Vec<String> = [24, 133]
        .into_iter()
        .filter_map(|seed| {
            run_apart(
                seed,
                Duration::from_secs(8),
                extra,
                &mut figures,
                &mut counts,
            )
            .err()
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        counts.contains_key("notifications observed"),
        "the observers received nothing"
    );
}

/// Seed 3 with the two will clients alone: w2's session (expiry 1 s, will delay 1 s) expired on
/// n2 as its next CONNECT, a clean start, arrived there; the CONNECT's take-over deleted the row
/// first, so the expiry, its own delete refused and its journal entry replaced, took the session
/// for taken over by another node and did not publish the will: lost. Failed before a take-over
/// here that deletes this node's own row tells the expiry the session ended
/// (`Status::taken_here`, `crates/sessions/src/replicated.rs`).
#[test]
fn a_will_is_published_when_a_clean_start_on_its_node_races_its_session_expiry() {
    let extra = Extra {
        observers: 0,
        locks: 0,
        expirers: 0,
        wills: 2,
    };
    let mut figures = Figures::default();
    let mut counts = Counts::new();
    let outcome = run_apart(3, Duration::from_secs(8), extra, &mut figures, &mut counts);
    assert_eq!(outcome, Ok(()));
    assert!(
        counts.contains_key("wills received"),
        "the recorder received no will"
    );
}
