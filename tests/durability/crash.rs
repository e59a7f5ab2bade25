//! Crash tests: nothing the server acknowledged may be lost, whatever moment it dies at.
//!
//! * `kill9_at_random_moments_loses_no_acknowledged_write`: a few clients SET their own keys with
//!   increasing values while the server is SIGKILLed at seeded random moments; after every restart
//!   each key holds its last acknowledged value and version, or a later write that was in flight.
//! * failpoints (`MQSTATE_FAILPOINT`, `crates/wal/src/failpoint.rs`): the server aborts inside the
//!   log writer or a snapshot (or loses its unsynced log writes first: power loss); it must start
//!   again with every acknowledged write.
//! * persistent sessions across a restart (graceful and kill -9).
//!
//! Reproduce a failing random run with `MQSTATE_CRASH_SEED=<seed printed by the test>`.

use crate::common;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rumqttc::v5::mqttbytes::v5::{ConnectProperties, Packet, Publish};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::sync::mpsc;

use common::state::{
    bulk, hlc, hlc_now, hlc_order, now_ms, reply_ts, send_request, StateClient, NIL, OK, WAIT,
};
use common::Server;

/// Seed of the kill schedule; `MQSTATE_CRASH_SEED` overrides it.
const DEFAULT_SEED: u64 = 0x6d71_7374_6174_6531;
/// Concurrent writers, each with its own keys.
const WRITERS: usize = 4;
const KEYS_PER_WRITER: usize = 8;
/// Kill-restart rounds, unless the budget runs out first.
const ROUNDS_MAX: usize = 8;
/// Wall-clock budget of the random-kill test (CI), checked between rounds.
const ROUNDS_BUDGET: Duration = Duration::from_secs(20);
/// The server is killed this long (ms, seeded random) after the writers start.
const KILL_AFTER_MS: std::ops::Range<u64> = 30..1000;
/// Writes per failpoint run before concluding the failpoint never fired.
const FAILPOINT_WRITES_MAX: usize = 2_000;
/// Keys written (and acknowledged) before a failpoint is armed.
const FAILPOINT_PRELOAD_KEYS: usize = 10;
/// Snapshot threshold small enough that a snapshot starts within a few dozen SETs.
const TINY_SNAPSHOT_BYTES: &str = "512";

// ---------------------------------------------------------------------------------------------
// A raw MQTT 5 client that never reconnects: a dead server ends its requests with `None`
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum Inbound {
    ConnAck { session_present: bool },
    SubAck,
    PubAck,
    Publish(Box<Publish>),
}

struct Reply {
    payload: Bytes,
    ts: Option<String>,
}

/// Connections made so far by this test process.
static CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

struct Mqtt {
    client: AsyncClient,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    response_topic: String,
    next_correlation: u64,
    node: String,
}

impl Mqtt {
    /// Connects; returns the client and CONNACK's Session Present, or `None` if the server is gone.
    async fn connect(
        addr: SocketAddr,
        id: &str,
        session_expiry_secs: Option<u32>,
    ) -> Option<(Mqtt, bool)> {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_keep_alive(Duration::from_secs(30));
        if let Some(secs) = session_expiry_secs {
            options.set_clean_start(false);
            let mut properties = ConnectProperties::new();
            properties.session_expiry_interval = Some(secs);
            options.set_connect_properties(properties);
        }
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (tx, mut inbound) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let forwarded = match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => Inbound::ConnAck {
                        session_present: ack.session_present,
                    },
                    Ok(Event::Incoming(Packet::SubAck(_))) => Inbound::SubAck,
                    Ok(Event::Incoming(Packet::PubAck(_))) => Inbound::PubAck,
                    Ok(Event::Incoming(Packet::Publish(p))) => Inbound::Publish(Box::new(p)),
                    Ok(_) => continue,
                    // The server is gone: stop here rather than let rumqttc reconnect.
                    Err(_) => return,
                };
                if tx.send(forwarded).is_err() {
                    return;
                }
            }
        });
        let session_present = match tokio::time::timeout(WAIT, inbound.recv())
            .await
            .expect("CONNACK in time")?
        {
            Inbound::ConnAck { session_present } => session_present,
            other => panic!("expected CONNACK first, got {other:?}"),
        };
        let mqtt = Mqtt {
            client,
            inbound,
            response_topic: format!("clients/{id}/statestore/response"),
            // Correlation data identifies a request across connections and restarts (a retry
            // carries the same), so no two connections of this test use the same.
            next_correlation: CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32,
            node: id.to_owned(),
        };
        Some((mqtt, session_present))
    }

    /// Next inbound event of the kind `pick` accepts (others are dropped); `None` if the server is gone.
    async fn next<T>(&mut self, mut pick: impl FnMut(Inbound) -> Option<T>) -> Option<T> {
        loop {
            let inbound = tokio::time::timeout(WAIT, self.inbound.recv())
                .await
                .expect("server answered in time")?;
            if let Some(picked) = pick(inbound) {
                return Some(picked);
            }
        }
    }

    async fn subscribe(&mut self, topic: &str) -> Option<()> {
        self.client.subscribe(topic, QoS::AtLeastOnce).await.ok()?;
        self.next(|i| matches!(i, Inbound::SubAck).then_some(()))
            .await
    }

    /// Subscribes to the response topic; needed once per connection before `request`.
    async fn ready_for_requests(&mut self) -> Option<()> {
        let topic = self.response_topic.clone();
        self.subscribe(&topic).await
    }

    /// QoS 1 publish, waiting for PUBACK.
    async fn publish(&mut self, topic: &str, payload: &[u8]) -> Option<()> {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload.to_vec())
            .await
            .ok()?;
        self.next(|i| matches!(i, Inbound::PubAck).then_some(()))
            .await
    }

    /// One state-store request; `None` if the server went away before replying.
    async fn request(&mut self, args: &[&[u8]]) -> Option<Reply> {
        self.next_correlation += 1;
        let correlation = Bytes::from(self.next_correlation.to_be_bytes().to_vec());
        let ts = hlc(now_ms(), 0, &self.node);
        send_request(&self.client, args, &self.response_topic, &correlation, ts)
            .await
            .ok()?;
        self.next(|i| match i {
            Inbound::Publish(p) => {
                let props = p.properties.clone().unwrap_or_default();
                (props.correlation_data.as_ref() == Some(&correlation)).then(|| Reply {
                    payload: p.payload.clone(),
                    ts: reply_ts(&props),
                })
            }
            _ => None,
        })
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// What was acknowledged, and what the server may hold after a crash
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct KeyState {
    /// Last acknowledged value and its version (`__ts` of the +OK).
    acked: Option<(String, String)>,
    /// Values sent after the last acknowledgement and never answered: each may or may not be durable.
    in_flight: Vec<String>,
}

#[derive(Debug, Default)]
struct Ledger {
    keys: BTreeMap<String, KeyState>,
    acks: usize,
}

impl Ledger {
    fn sending(&mut self, key: &str, value: &str) {
        self.keys
            .entry(key.to_owned())
            .or_default()
            .in_flight
            .push(value.to_owned());
    }

    fn acknowledged(&mut self, key: &str, value: &str, reply: &Reply) {
        assert_eq!(reply.payload.as_ref(), OK, "SET {key} {value}");
        let ts = reply
            .ts
            .clone()
            .unwrap_or_else(|| panic!("SET {key}: +OK without __ts"));
        let state = self.keys.entry(key.to_owned()).or_default();
        // Writes to one key are sequential, so everything in flight before this one is superseded.
        state.in_flight.clear();
        state.acked = Some((value.to_owned(), ts));
        self.acks += 1;
    }

    /// GETs every key from a freshly restarted server and checks it against the acknowledgements.
    async fn check(&mut self, addr: SocketAddr, context: &str) {
        let (mut reader, _) = Mqtt::connect(addr, "crash-reader", None)
            .await
            .expect("connect after restart");
        reader
            .ready_for_requests()
            .await
            .expect("subscribe after restart");
        for (key, state) in &mut self.keys {
            let reply = reader
                .request(&[b"GET", key.as_bytes()])
                .await
                .expect("GET reply");
            let got = reply.payload.as_ref();
            if got == NIL {
                assert!(
                    state.acked.is_none(),
                    "{context}: key {key} lost; expected {:?} (acknowledged), got nil",
                    state.acked
                );
                continue;
            }
            let ts = reply
                .ts
                .clone()
                .unwrap_or_else(|| panic!("{context}: GET {key} hit without __ts"));
            if let Some((value, acked_ts)) = &state.acked {
                if got == bulk(value.as_bytes()) {
                    assert_eq!(
                        &ts, acked_ts,
                        "{context}: key {key} = {value}: version differs from the acknowledged one"
                    );
                    continue;
                }
            }
            let Some(value) = state
                .in_flight
                .iter()
                .find(|v| got == bulk(v.as_bytes()))
                .cloned()
            else {
                panic!(
                    "{context}: key {key}: expected the acknowledged {:?} or one of the in-flight {:?}, got {:?}",
                    state.acked,
                    state.in_flight,
                    String::from_utf8_lossy(got)
                );
            };
            if let Some((_, acked_ts)) = &state.acked {
                assert!(
                    hlc_order(&ts) > hlc_order(acked_ts),
                    "{context}: key {key}: in-flight {value} has version {ts}, not after the acknowledged {acked_ts}"
                );
            }
            // It survived a restart, so from now on it counts as acknowledged.
            state.in_flight.clear();
            state.acked = Some((value, ts));
        }
    }
}

/// One writer: SETs its keys round-robin with increasing values until the server goes away.
async fn writer(addr: SocketAddr, id: usize, mut seq: u64, ledger: Arc<Mutex<Ledger>>) -> u64 {
    let Some((mut mqtt, _)) = Mqtt::connect(addr, &format!("crash-writer-{id}"), None).await else {
        return seq;
    };
    if mqtt.ready_for_requests().await.is_none() {
        return seq;
    }
    loop {
        let key = format!("w{id}-k{}", seq % KEYS_PER_WRITER as u64);
        let value = format!("w{id}-v{seq}");
        seq += 1;
        ledger.lock().unwrap().sending(&key, &value);
        match mqtt
            .request(&[b"SET", key.as_bytes(), value.as_bytes()])
            .await
        {
            Some(reply) => ledger.lock().unwrap().acknowledged(&key, &value, &reply),
            None => return seq,
        }
    }
}

fn seed() -> u64 {
    std::env::var("MQSTATE_CRASH_SEED")
        .ok()
        .map(|s| s.parse().expect("MQSTATE_CRASH_SEED must be a u64"))
        .unwrap_or(DEFAULT_SEED)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_at_random_moments_loses_no_acknowledged_write() {
    let seed = seed();
    eprintln!("crash test seed {seed} (set MQSTATE_CRASH_SEED to reproduce)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut server = Server::start();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut next_seq = [0u64; WRITERS];
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS_MAX && started.elapsed() < ROUNDS_BUDGET {
        rounds += 1;
        let writers: Vec<_> = (0..WRITERS)
            .map(|id| tokio::spawn(writer(server.addr, id, next_seq[id], Arc::clone(&ledger))))
            .collect();
        tokio::time::sleep(Duration::from_millis(rng.gen_range(KILL_AFTER_MS))).await;
        tokio::task::block_in_place(|| server.kill9());
        for (id, handle) in writers.into_iter().enumerate() {
            next_seq[id] = tokio::time::timeout(WAIT, handle)
                .await
                .expect("writer ends")
                .expect("writer ok");
        }
        tokio::task::block_in_place(|| server.restart());
        // Every writer has ended, so the ledger is ours alone while checking.
        let mut taken = std::mem::take(&mut *ledger.lock().unwrap());
        taken
            .check(server.addr, &format!("seed {seed} round {rounds}"))
            .await;
        *ledger.lock().unwrap() = taken;
    }
    let acks = ledger.lock().unwrap().acks;
    eprintln!("{rounds} kill/restart rounds, {acks} acknowledged SETs checked");
    assert!(
        acks > 0,
        "the writers never got a SET acknowledged, so nothing was tested"
    );
}

// ---------------------------------------------------------------------------------------------
// Retried requests across a crash
// ---------------------------------------------------------------------------------------------

/// Last index of the snapshot in `data_dir`, once there is one (`storage-format.md`: bytes 4..12).
fn snapshot_last_index(data_dir: &Path) -> Option<i64> {
    let bytes = std::fs::read(data_dir.join("mqstate.snapshot")).ok()?;
    Some(i64::from_be_bytes(bytes.get(4..12)?.try_into().ok()?))
}

/// A write's log record carries its request's identity and first reply, so a retry of the request
/// (same client id, same correlation data) after a kill -9 and a restart gets the first reply and is
/// not executed again: rebuilt from the replayed log, and from the snapshot once the record is
/// behind it. Executed twice, the SET NX would answer `:-1` the second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_retried_after_kill9_gets_its_first_reply_and_is_not_executed_again() {
    let no_snapshot: &[&str] = &[];
    let snapshot_soon: &[&str] = &["--snapshot-threshold-bytes", TINY_SNAPSHOT_BYTES];
    for (case, flags) in [
        ("from the log", no_snapshot),
        ("from the snapshot", snapshot_soon),
    ] {
        let mut server = Server::start_with(flags);
        let correlation = Bytes::from(format!("set-nx-once {case}"));
        let set_nx: &[&[u8]] = &[b"SET", b"once", b"first", b"NX"];
        let mut client = StateClient::connect(server.addr, "retrier").await;
        let (first, first_ts) = client.request_as(set_nx, &correlation, hlc_now()).await;
        assert_eq!(&first[..], OK, "{case}: the first SET NX");
        if flags == snapshot_soon {
            // The SET's record is LSN 0, so any snapshot covers it and replay starts after it.
            for i in 0..20 {
                let key = format!("filler-{i}");
                assert_eq!(
                    &client.request(&[b"SET", key.as_bytes(), b"x"]).await[..],
                    OK
                );
            }
            let deadline = Instant::now() + WAIT;
            while snapshot_last_index(server.data_dir()).is_none() {
                assert!(Instant::now() < deadline, "{case}: no snapshot was written");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        tokio::task::block_in_place(|| {
            server.kill9();
            server.restart();
        });
        let mut client = StateClient::connect(server.addr, "retrier").await;
        let (retried, retried_ts) = client.request_as(set_nx, &correlation, hlc_now()).await;
        assert_eq!(
            String::from_utf8_lossy(&retried),
            String::from_utf8_lossy(OK),
            "{case}: the retry gets the first reply (executed again it answers :-1)"
        );
        assert_eq!(retried_ts, first_ts, "{case}: with the first reply's __ts");
        // The same command as a new request executes: the key exists, so NX refuses it.
        assert_eq!(&client.request(set_nx).await[..], b":-1\r\n", "{case}");
        assert_eq!(
            client.request(&[b"GET", b"once"]).await,
            bulk(b"first"),
            "{case}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Failpoints: the server aborts at a named point inside the log or a snapshot
// ---------------------------------------------------------------------------------------------

/// `mqstate serve` outside the harness, so the failpoint variable reaches only this process.
fn spawn_serve(
    dir: &Path,
    addr: SocketAddr,
    failpoint: Option<&str>,
    extra_args: &[&str],
) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mqstate"));
    cmd.arg("serve")
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--data-dir")
        .arg(dir)
        .args(extra_args)
        .env(
            "MQSTATE_LOG",
            std::env::var("MQSTATE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env_remove("MQSTATE_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(name) = failpoint {
        cmd.env("MQSTATE_FAILPOINT", name);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + WAIT;
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("mqstate serve (failpoint {failpoint:?}) exited during start-up: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "mqstate serve did not start listening on {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Writes sequentially until the server dies or `max` writes were acknowledged.
async fn write_until_dead(addr: SocketAddr, ledger: &mut Ledger, prefix: &str, max: usize) {
    let (mut mqtt, _) = Mqtt::connect(addr, &format!("{prefix}-writer"), None)
        .await
        .expect("connect");
    mqtt.ready_for_requests().await.expect("subscribe");
    for i in 0..max {
        let (key, value) = (format!("{prefix}-k{i}"), format!("{prefix}-v{i}"));
        ledger.sending(&key, &value);
        match mqtt
            .request(&[b"SET", key.as_bytes(), value.as_bytes()])
            .await
        {
            Some(reply) => ledger.acknowledged(&key, &value, &reply),
            None => return,
        }
    }
}

/// Preloads acknowledged keys, restarts with `failpoint` armed, writes until the server aborts
/// there, then restarts it disarmed and checks every acknowledged write.
async fn crash_at_failpoint(failpoint: &str, extra_args: &[&str]) {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("data");
    let addr = common::free_addr();
    let mut ledger = Ledger::default();

    let mut child = tokio::task::block_in_place(|| spawn_serve(&dir, addr, None, extra_args));
    write_until_dead(addr, &mut ledger, "before", FAILPOINT_PRELOAD_KEYS).await;
    assert_eq!(ledger.acks, FAILPOINT_PRELOAD_KEYS, "preload acknowledged");
    child.kill().unwrap();
    child.wait().unwrap();

    let mut child =
        tokio::task::block_in_place(|| spawn_serve(&dir, addr, Some(failpoint), extra_args));
    // Keys and the client id are named after the point, not after a marker's path.
    let label = failpoint.split('@').next().unwrap_or(failpoint);
    write_until_dead(addr, &mut ledger, label, FAILPOINT_WRITES_MAX).await;
    let status = tokio::task::block_in_place(|| common::wait_exit(&mut child, failpoint));
    assert_eq!(
        status.signal(),
        Some(6),
        "failpoint {failpoint}: expected the server to abort (SIGABRT) there, got {status}; \
         is MQSTATE_FAILPOINT read by `serve` (WalOptions.failpoints = Failpoints::from_env())?"
    );

    let verify = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["data", "verify"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "failpoint {failpoint}: the crash left damage: {}",
        String::from_utf8_lossy(&verify.stderr)
    );
    let mut child = tokio::task::block_in_place(|| spawn_serve(&dir, addr, None, extra_args));
    ledger
        .check(addr, &format!("after failpoint {failpoint}"))
        .await;
    child.kill().unwrap();
    child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_after_write_before_fsync_loses_no_acknowledged_write() {
    crash_at_failpoint("after-write-before-fsync", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_mid_snapshot_loses_no_acknowledged_write() {
    crash_at_failpoint(
        "mid-snapshot",
        &["--snapshot-threshold-bytes", TINY_SNAPSHOT_BYTES],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_before_snapshot_rename_loses_no_acknowledged_write() {
    crash_at_failpoint(
        "before-rename",
        &["--snapshot-threshold-bytes", TINY_SNAPSHOT_BYTES],
    )
    .await;
}

/// Power loss: the writes since the last fsync vanish from the segment, then the process aborts
/// (`power-loss@<marker>`, armed from the start here by creating the marker first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_loss_before_fsync_loses_no_acknowledged_write() {
    let markers = tempfile::tempdir().unwrap();
    let marker = markers.path().join("power-loss");
    std::fs::write(&marker, b"").unwrap();
    crash_at_failpoint(&format!("power-loss@{}", marker.display()), &[]).await;
}

// ---------------------------------------------------------------------------------------------
// Persistent sessions
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_session_and_queued_message_survive_a_restart() {
    const TOPIC: &str = "crash/session";
    const SESSION_EXPIRY_SECS: u32 = 3600;
    let mut server = Server::start();

    let (mut subscriber, _) = Mqtt::connect(server.addr, "durable-sub", Some(SESSION_EXPIRY_SECS))
        .await
        .unwrap();
    subscriber.subscribe(TOPIC).await.unwrap();
    subscriber.client.disconnect().await.unwrap();
    drop(subscriber);

    let (mut publisher, _) = Mqtt::connect(server.addr, "durable-pub", None)
        .await
        .unwrap();
    publisher
        .publish(TOPIC, b"queued while away")
        .await
        .expect("PUBACK for the queued message");
    drop(publisher);

    tokio::task::block_in_place(|| {
        assert!(server.stop().success(), "graceful stop");
        server.restart();
    });
    let (mut subscriber, session_present) =
        Mqtt::connect(server.addr, "durable-sub", Some(SESSION_EXPIRY_SECS))
            .await
            .unwrap();
    assert!(
        session_present,
        "CONNACK Session Present must be 1 after a restart"
    );
    let delivered = subscriber
        .next(|i| match i {
            Inbound::Publish(p) => Some(p),
            _ => None,
        })
        .await
        .expect("the queued QoS 1 message is delivered after the restart");
    assert_eq!(delivered.topic.as_ref(), TOPIC.as_bytes());
    assert_eq!(delivered.payload.as_ref(), b"queued while away");
}

/// A publisher keeps publishing numbered QoS 1 messages to an offline persistent subscriber while
/// the server is SIGKILLed at a seeded random moment: every message the publisher got a PUBACK for
/// must be delivered to the subscriber after the restart, with Session Present = 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_loses_no_acknowledged_message_of_a_persistent_session() {
    const TOPIC: &str = "crash/queued";
    const SESSION_EXPIRY_SECS: u32 = 3600;
    let seed = seed();
    let kill_after = Duration::from_millis(StdRng::seed_from_u64(seed).gen_range(KILL_AFTER_MS));
    eprintln!("seed {seed}: kill after {kill_after:?}");
    let mut server = Server::start();

    let (mut subscriber, _) = Mqtt::connect(server.addr, "queued-sub", Some(SESSION_EXPIRY_SECS))
        .await
        .unwrap();
    subscriber.subscribe(TOPIC).await.unwrap();
    subscriber.client.disconnect().await.unwrap();
    drop(subscriber);

    let acked = Arc::new(Mutex::new(Vec::new()));
    let publishing = {
        let acked = Arc::clone(&acked);
        let addr = server.addr;
        tokio::spawn(async move {
            let (mut publisher, _) = Mqtt::connect(addr, "queued-pub", None).await?;
            // Below the session queue limit (default 1000), past which the overflow policy drops
            // the newest QoS 1 messages (acknowledged to the publisher, never delivered).
            for n in 0u32..900 {
                publisher.publish(TOPIC, n.to_string().as_bytes()).await?;
                acked.lock().unwrap().push(n);
            }
            Some(())
        })
    };
    tokio::time::sleep(kill_after).await;
    tokio::task::block_in_place(|| server.kill9());
    let _ = tokio::time::timeout(WAIT, publishing).await;
    let acked = acked.lock().unwrap().clone();
    tokio::task::block_in_place(|| server.restart());

    let (mut subscriber, session_present) =
        Mqtt::connect(server.addr, "queued-sub", Some(SESSION_EXPIRY_SECS))
            .await
            .unwrap();
    assert!(
        session_present,
        "seed {seed}: Session Present after kill -9"
    );
    let mut delivered = std::collections::BTreeSet::new();
    while !acked.iter().all(|n| delivered.contains(n)) {
        let p = subscriber
            .next(|i| match i {
                Inbound::Publish(p) => Some(p),
                _ => None,
            })
            .await
            .expect("server stays up");
        let n: u32 = std::str::from_utf8(&p.payload).unwrap().parse().unwrap();
        delivered.insert(n);
    }
    eprintln!("seed {seed}: {} acknowledged, all delivered", acked.len());
}

/// A retained message survives kill -9; a delayed will pending at a graceful shutdown is published
/// after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_message_and_pending_will_survive_restarts() {
    use common::mqtt::will_after;
    use rumqttc::v5::mqttbytes::v5::LastWill;

    let mut server = Server::start();
    let (mut publisher, _) = Mqtt::connect(server.addr, "retainer", None).await.unwrap();
    publisher
        .client
        .publish("crash/retained", QoS::AtLeastOnce, true, b"kept".to_vec())
        .await
        .unwrap();
    publisher
        .next(|i| matches!(i, Inbound::PubAck).then_some(()))
        .await
        .expect("PUBACK of the retained message");
    drop(publisher);
    tokio::task::block_in_place(|| {
        server.kill9();
        server.restart();
    });
    let (mut reader, _) = Mqtt::connect(server.addr, "reader", None).await.unwrap();
    reader.subscribe("crash/retained").await.unwrap();
    let kept = reader
        .next(|i| match i {
            Inbound::Publish(p) => Some(p),
            _ => None,
        })
        .await
        .expect("the retained message after kill -9");
    assert_eq!(kept.payload.as_ref(), b"kept");
    drop(reader);

    // A client with a persistent session and a will delayed by 2 s is connected at shutdown.
    let mut options = MqttOptions::new("willer", server.addr.ip().to_string(), server.addr.port());
    options.set_clean_start(false);
    let mut properties = ConnectProperties::new();
    properties.session_expiry_interval = Some(3600);
    options.set_connect_properties(properties);
    options.set_last_will(LastWill::new(
        "crash/will",
        "willer is gone",
        QoS::AtLeastOnce,
        // Retained, so a watcher sees it even if it came due before the watcher subscribed.
        true,
        Some(will_after(2)),
    ));
    let (_willer, mut eventloop) = AsyncClient::new(options, 8);
    let (connected_tx, connected) = tokio::sync::oneshot::channel();
    let mut connected_tx = Some(connected_tx);
    tokio::spawn(async move {
        while let Ok(event) = eventloop.poll().await {
            if let Event::Incoming(Packet::ConnAck(_)) = event {
                if let Some(tx) = connected_tx.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    tokio::time::timeout(WAIT, connected)
        .await
        .expect("willer connected in time")
        .unwrap();
    tokio::task::block_in_place(|| {
        assert!(server.stop().success(), "graceful stop");
        server.restart();
    });
    let (mut watcher, _) = Mqtt::connect(server.addr, "watcher", None).await.unwrap();
    watcher.subscribe("crash/will").await.unwrap();
    let will = watcher
        .next(|i| match i {
            Inbound::Publish(p) => Some(p),
            _ => None,
        })
        .await
        .expect("the delayed will after the restart");
    assert_eq!(will.payload.as_ref(), b"willer is gone");
}
