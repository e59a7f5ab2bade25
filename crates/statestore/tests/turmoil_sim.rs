//! The deterministic simulation of a node's front end (decision 0067): the real broker and
//! state-store service of a single node (`mqstate serve` without `--node-id`: recovery from its
//! log, the MQTT listener, the service on the invoke topic) on a turmoil host, with MQTT 5 clients
//! on hosts of their own speaking the AIO state-store protocol over simulated TCP: a request is a
//! QoS 1 PUBLISH of RESP to the invoke topic with a response topic, correlation data and the
//! `__srcId`/`__ts`/`__protVer` properties; the reply comes back on the response topic. The node
//! crashes and restarts (its disk stays, as after `kill -9`), clients are cut off from it and their
//! messages held, all drawn from the seed. Each key's history is checked as the data plane's
//! simulation checks it (`mqstate_wgl::kv`: linearizable, versions never backwards, the newest
//! acknowledged write not lost), and a seed replays exactly.
//!
//! `MQSTATE_FRONT_SIM_SEED=N` runs seed N alone; `MQSTATE_FRONT_SIM_SEEDS=K` runs K seeds from
//! `MQSTATE_FRONT_SIM_FIRST` (default 1; K default 6); `MQSTATE_FRONT_SIM_CHAOS_SECS` sets the
//! simulated seconds of clients and faults (default 8). Two runs of a seed print the same `trace`;
//! `MQSTATE_FRONT_SIM_DUMP=FILE` writes each seed's history to `FILE.<seed>`.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mqstate_broker::{Broker, BrokerConfig, SharedClock};
use mqstate_cli::rpc::{self, TIMESTAMP};
use mqstate_cli::wire::{self, Conn};
use mqstate_cluster::sim::{data_root, run_faults, sim_ms, simulation, sweep, SimClock, EPOCH_MS};
use mqstate_protocol::topic::INVOKE_TOPIC;
use mqstate_protocol::Hlc;
use mqstate_statestore::service::{self, ServiceConfig};
use mqstate_store::{Limits, StoreConfig};
use mqstate_wal::WalOptions;
use mqstate_wgl::kv::{self, Cmd, Figures, Keyed, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rumqttc::v5::mqttbytes::v5::Filter;
use rumqttc::v5::mqttbytes::QoS;

const NODE: &str = "node";
const MQTT_PORT: u16 = 1883;
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const CLIENTS: u64 = 4;
/// The client id of the reads after the faults.
const FINAL_CLIENT: u64 = 99;
/// A request's message expiry: the node remembers its first reply this long (the duplicate cache).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one attempt waits for the reply before the client reconnects and sends it again.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// A client sends a request again (same correlation data: the node answers a request it already
/// ran with its first reply) only this long after the first attempt, well within its expiry:
/// a retry after it would run again, as the protocol says.
const RETRY_WITHIN: Duration = Duration::from_secs(3);
/// Every key must answer a read within this long after the faults stopped.
const READABLE_WITHIN: Duration = Duration::from_secs(20);
const SEARCH_BUDGET: usize = 4_000_000;

/// The node: recovers the state store from its directory and serves MQTT until it crashes.
async fn node(dir: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let clock: SharedClock = Arc::new(SimClock::fixed(0));
    let wal = WalOptions {
        name: "statestore",
        // As `serve` opens it: the executor writes and fsyncs its own batches after each turn
        // (decision 0069), in its task, so a commit completes in simulated time (decision 0058).
        committer: mqstate_wal::Committer::Owner,
        ..WalOptions::default()
    };
    let store = StoreConfig {
        node_id: "mqstate".into(),
        limits: Limits::default(),
    };
    let (recovered, _) = mqstate_statestore::recovery::recover(&dir, wal, store, clock.now_ms())?;
    let broker = Broker::builder(BrokerConfig::default())
        .clock(clock)
        .build();
    let inbox = broker.claim_topic(INVOKE_TOPIC)?;
    tokio::spawn(service::run(
        broker.clone(),
        inbox,
        recovered,
        ServiceConfig::default(),
        std::future::pending(),
    ));
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", MQTT_PORT)).await?;
    mqstate_broker::serve_streams(|| listener.accept(), broker).await;
    Ok(())
}

/// An operation of the history, with its key.
#[derive(Debug, Clone)]
struct Op {
    key: &'static str,
    kv: kv::Op,
}

impl Keyed for Op {
    fn keyed(&self) -> (&'static str, &kv::Op) {
        (self.key, &self.kv)
    }
}

/// The history; `-ERR` texts and refusals taken as "unknown" are its errors.
type Shared = Rc<RefCell<kv::History<Op>>>;

/// A client's MQTT connection to the node, subscribed to its response topic.
type Session = Conn<turmoil::net::TcpStream>;

async fn connect(client: u64) -> Result<Session, String> {
    let handshake = async {
        let stream = turmoil::net::TcpStream::connect((NODE, MQTT_PORT))
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
    tokio::time::timeout(CALL_TIMEOUT, handshake)
        .await
        .map_err(|_| "the handshake timed out".to_owned())?
}

/// What one request's exchange gave.
enum Answer {
    Outcome(Outcome),
    /// An answer no state store gives (a bug): the seed fails.
    Wrong(String),
}

/// Sends one request on `conn` and waits for its reply; the connection is dropped (set to
/// `None`) when it failed or the reply did not come in time. `seq` makes the correlation data.
async fn exchange(
    conn: &mut Option<Session>,
    history: &Shared,
    client: u64,
    seq: u64,
    key: &str,
    cmd: &Cmd,
    ts: &Hlc,
) -> Answer {
    let Some(session) = conn.as_mut() else {
        return Answer::Outcome(Outcome::Unknown);
    };
    let run = async {
        let reply = rpc::exchange(
            session,
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
            *conn = None;
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
/// again on a new connection within [`RETRY_WITHIN`], as an AIO client resends an unacknowledged
/// request after a reconnect.
async fn call(
    conn: &mut Option<Session>,
    history: &Shared,
    client: u64,
    seq: u64,
    key: &'static str,
    cmd: Cmd,
) -> Result<Outcome, CallError> {
    if conn.is_none() {
        *conn = Some(connect(client).await.map_err(|_| CallError::NotConnected)?);
    }
    let invoked = history.borrow_mut().tick();
    let first = tokio::time::Instant::now();
    let ts = Hlc {
        wall_ms: EPOCH_MS + sim_ms(),
        counter: 0,
        node_id: format!("c{client}").into(),
    };
    let answer = loop {
        let answer = exchange(conn, history, client, seq, key, &cmd, &ts).await;
        let retry = matches!(answer, Answer::Outcome(Outcome::Unknown)) && conn.is_none();
        if !retry || first.elapsed() >= RETRY_WITHIN {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(session) = connect(client).await {
            *conn = Some(session);
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
    history.borrow_mut().ops.push(Op {
        key,
        kv: kv::Op {
            client,
            cmd,
            invoked,
            returned,
            outcome: outcome.clone(),
            ms: None,
        },
    });
    match wrong {
        Some(error) => Err(CallError::Wrong(format!("c{client}: {error}"))),
        None => Ok(outcome),
    }
}

/// A client: requests on random keys until `until`, one at a time, reconnecting as needed.
async fn client(
    id: u64,
    seed: u64,
    until: Duration,
    history: Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(id));
    let mut conn: Option<Session> = None;
    // Values this client wrote, for its VDELs (the latest most often).
    let mut written: Vec<u64> = Vec::new();
    let mut seq = 0u64;
    tokio::time::sleep(Duration::from_millis(rng.gen_range(100..500))).await;
    while turmoil::sim_elapsed().unwrap_or_default() < until {
        seq += 1;
        let key = KEYS[rng.gen_range(0..KEYS.len())];
        let cmd = kv::draw(&mut rng, id, seq, &mut written);
        match call(&mut conn, &history, id, seq, key, cmd).await {
            Ok(_) => {}
            Err(CallError::Wrong(e)) => return Err(e.into()),
            // The node is down or cut off: try again a little later.
            Err(CallError::NotConnected) => {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..40))).await;
    }
    Ok(())
}

/// After the faults: reads every key until it answers.
async fn final_reads(from: Duration, history: Shared) -> Result<(), Box<dyn std::error::Error>> {
    tokio::time::sleep(from).await;
    let started = tokio::time::Instant::now();
    let mut conn: Option<Session> = None;
    let mut seq = 0;
    for key in KEYS {
        loop {
            seq += 1;
            match call(&mut conn, &history, FINAL_CLIENT, seq, key, Cmd::Get).await {
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

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The node's process dies (its disk stays); it restarts after the given time.
    Crash(Duration),
    /// A client is cut off from the node (what is in flight is lost) for a while.
    Isolate(u64, Duration),
    /// Messages between a client and the node are held back for a while, then delivered.
    Hold(u64, Duration),
}

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::Crash(..) => "crash",
            Fault::Isolate(..) => "isolate",
            Fault::Hold(..) => "hold",
        }
    }
}

fn client_host(id: u64) -> String {
    format!("c{id}")
}

/// Runs one seed; its violations, if any, with how to reproduce them.
fn run_seed(seed: u64, chaos: Duration, figures: &mut Figures) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let root = data_root();
    let mut sim = simulation(
        seed,
        chaos + CALL_TIMEOUT + READABLE_WITHIN + Duration::from_secs(30),
        Duration::from_millis(rng.gen_range(2..20)),
    );
    let dir = root.path().join(NODE);
    sim.host(NODE, move || node(dir.clone()));
    let history: Shared = Rc::default();
    for id in 1..=CLIENTS {
        sim.client(client_host(id), client(id, seed, chaos, history.clone()));
    }
    sim.client(
        client_host(FINAL_CLIENT),
        final_reads(
            chaos + CALL_TIMEOUT + Duration::from_secs(2),
            history.clone(),
        ),
    );

    let mut schedule: Vec<(Duration, Fault)> = Vec::new();
    let mut at = Duration::from_millis(rng.gen_range(500..1_500));
    while at < chaos {
        let lasting = Duration::from_millis(rng.gen_range(300..3_000));
        let id = rng.gen_range(1..=CLIENTS);
        let fault = match rng.gen_range(0..3) {
            0 => Fault::Crash(lasting),
            1 => Fault::Isolate(id, lasting),
            _ => Fault::Hold(id, lasting),
        };
        schedule.push((at, fault));
        at += lasting + Duration::from_millis(rng.gen_range(100..1_000));
    }
    for (_, fault) in &schedule {
        *figures.faults.entry(fault.kind()).or_default() += 1;
    }
    let start_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Crash(lasting) => {
            sim.crash(NODE);
            lasting
        }
        Fault::Isolate(id, lasting) => {
            sim.partition(client_host(id), NODE);
            lasting
        }
        Fault::Hold(id, lasting) => {
            sim.hold(client_host(id), NODE);
            lasting
        }
    };
    let end_fault = |sim: &mut turmoil::Sim<'_>, fault: Fault| match fault {
        Fault::Crash(_) => sim.bounce(NODE),
        Fault::Isolate(id, _) => sim.repair(client_host(id), NODE),
        Fault::Hold(id, _) => sim.release(client_host(id), NODE),
    };
    let outcome = run_faults(&mut sim, chaos, schedule, start_fault, end_fault);
    let simulated = sim.elapsed();
    drop(sim);

    let history = history.borrow();
    figures.add(simulated, &history);
    history.dump("MQSTATE_FRONT_SIM_DUMP", seed);
    let findings = history.findings(outcome, &KEYS, FINAL_CLIENT, SEARCH_BUDGET);
    if findings.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "seed {seed} (reproduce: MQSTATE_FRONT_SIM_SEED={seed} cargo test -p mqstate-statestore --test turmoil_sim -- --nocapture):\n  {}",
            findings.join("\n  ")
        ))
    }
}

#[test]
fn a_node_front_end_is_linearizable_and_loses_no_acknowledged_write_under_faults() {
    let sweep = sweep("MQSTATE_FRONT_SIM", 6, 8, run_seed);
    println!(
        "{}",
        sweep.figures.summary(
            "front-end",
            "-ERR or refused",
            sweep.failures.len(),
            sweep.real
        )
    );
    for (error, n) in &sweep.figures.errors {
        println!("  {n} × {error} (taken as unknown)");
    }
    assert!(sweep.failures.is_empty(), "{}", sweep.failures.join("\n"));
}
