//! Persistent notifications against a real `mqstate serve` and real endpoints: an HTTP server in the
//! test (which can acknowledge, refuse or hold pushes) and Mosquitto for the MQTT endpoint.

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::state::{now_ms, StateClient, NIL, OK};
use common::topic::{cli, create, stats};
use common::Server;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

use mqstate_testcerts::{Ca, Leaf};

/// Hang guard of the polling waits below, not a performance claim.
const DEADLINE: Duration = Duration::from_secs(60);

/// How the test endpoint answers a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ack,
    /// 503: the endpoint is down.
    Fail,
    /// Keep the request open until the mode changes.
    Hold,
}

/// An HTTP endpoint that records every batch it acknowledged (and every one it received).
struct Hook {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    acked: Arc<Mutex<Vec<Value>>>,
    received: Arc<Mutex<usize>>,
}

impl Hook {
    async fn start(mode: Mode) -> Hook {
        Hook::start_tls(mode, None).await
    }

    /// An endpoint that speaks HTTPS with `tls`'s certificate (its `url` is still `http://…`).
    async fn start_tls(mode: Mode, tls: Option<TlsAcceptor>) -> Hook {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, mode_rx) = watch::channel(mode);
        let acked = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(Mutex::new(0));
        let (a, r) = (Arc::clone(&acked), Arc::clone(&received));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (mode, a, r) = (mode_rx.clone(), Arc::clone(&a), Arc::clone(&r));
                match &tls {
                    None => {
                        tokio::spawn(serve(stream, mode, a, r));
                    }
                    Some(tls) => {
                        let tls = tls.clone();
                        tokio::spawn(async move {
                            // A client that refuses our certificate ends here.
                            if let Ok(stream) = tls.accept(stream).await {
                                serve(stream, mode, a, r).await;
                            }
                        });
                    }
                }
            }
        });
        Hook {
            addr,
            mode,
            acked,
            received,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    fn received(&self) -> usize {
        *self.received.lock().unwrap()
    }

    /// Every acknowledged record, in arrival order.
    fn records(&self) -> Vec<Value> {
        let batches = self.acked.lock().unwrap();
        batches
            .iter()
            .flat_map(|b| b["records"].as_array().cloned().unwrap_or_default())
            .collect()
    }
}

async fn serve(
    stream: impl AsyncRead + AsyncWrite + Unpin,
    mut mode: watch::Receiver<Mode>,
    acked: Arc<Mutex<Vec<Value>>>,
    received: Arc<Mutex<usize>>,
) {
    let mut stream = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if stream.read_exact(&mut body).await.is_err() {
            return;
        }
        *received.lock().unwrap() += 1;
        let now = loop {
            let current = *mode.borrow_and_update();
            if current != Mode::Hold {
                break current;
            }
            if mode.changed().await.is_err() {
                return;
            }
        };
        let status = match now {
            Mode::Ack => {
                acked
                    .lock()
                    .unwrap()
                    .push(serde_json::from_slice(&body).unwrap());
                "200 OK"
            }
            _ => "503 Service Unavailable",
        };
        let response = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
        let out = stream.get_mut();
        if out.write_all(response.as_bytes()).await.is_err() || out.flush().await.is_err() {
            return;
        }
    }
}

/// Settings that make tests quick: short retries, and a walk that renews well within the lock expiry.
const FAST: &[&str] = &[
    "--notify-retry-min-ms",
    "50",
    "--notify-retry-max-ms",
    "200",
];

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < DEADLINE, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn set(client: &mut StateClient, key: &str, value: &str) -> bytes::Bytes {
    client
        .request(&[b"SET", key.as_bytes(), value.as_bytes()])
        .await
}

/// Checks that every seq 1..=n arrived for the right key, in order of first arrival; returns the
/// number of duplicates.
fn check_in_order(records: &[Value], n: u64) -> usize {
    let mut seen = BTreeSet::new();
    let mut first = Vec::new();
    for record in records {
        let seq = record["seq"].as_u64().unwrap();
        if seen.insert(seq) {
            first.push(seq);
            assert_eq!(record["key"], format!("order:{seq}"), "{record}");
            assert_eq!(record["value"], format!("v{seq}"), "{record}");
            assert_eq!(record["event"], "set");
        }
    }
    assert_eq!(
        first,
        (1..=n).collect::<Vec<_>>(),
        "every change, in commit order"
    );
    records.len() - first.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_down_then_up_gets_every_change_in_order() {
    let hook = Hook::start(Mode::Fail).await;
    let server = Server::start_with(FAST);
    create(&server, "orders", &hook.url(), &[]);
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=30 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    assert_eq!(set(&mut client, "unrelated", "x").await, OK);
    wait_until("failed pushes", || hook.received() >= 2).await;
    let down = stats(&server, "orders");
    assert_eq!(down["entries"], 30);
    assert_eq!(down["reserved"], 0);
    let bytes: usize = (1..=30)
        .map(|i| format!("order:{i}").len() + format!("v{i}").len())
        .sum();
    assert_eq!(down["bytes"], bytes, "keys + values of the queued entries");
    assert!(down["oldest_age_ms"].is_u64(), "{down}");
    assert_eq!(down["owner"], "mqstate", "{down}");
    let expires = down["lock_expires"].as_u64().expect("lock_expires");
    assert!(expires > now_ms(), "the owner's lock is live: {down}");
    assert!(
        down["last_error"].as_str().unwrap().contains("503"),
        "{down}"
    );
    assert!(down["failed_pushes"].as_u64().unwrap() >= 1);
    hook.set(Mode::Ack);
    wait_until("the queue to drain", || {
        stats(&server, "orders")["entries"] == 0
    })
    .await;
    let duplicates = check_in_order(&hook.records(), 30);
    println!("endpoint down then up: 30 changes, {duplicates} duplicates");
    let up = stats(&server, "orders");
    assert_eq!(up["delivered"], 30);
    assert_eq!(up["last_error"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_the_write_and_nothing_else() {
    let hook = Hook::start(Mode::Fail).await;
    let server = Server::start_with(FAST);
    create(&server, "orders", &hook.url(), &["--max-queue", "3"]);
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=3 {
        assert_eq!(set(&mut client, &format!("order:{i}"), "v").await, OK);
    }
    assert_eq!(
        set(&mut client, "order:4", "v").await,
        &b"-ERR notification queue full: orders\r\n"[..]
    );
    assert_eq!(
        client.request(&[b"GET", b"order:4"]).await,
        NIL,
        "the refused write changed nothing"
    );
    assert_eq!(
        client.request(&[b"DEL", b"order:1"]).await,
        &b"-ERR notification queue full: orders\r\n"[..],
        "a delete is refused too"
    );
    assert_eq!(
        client.request(&[b"GET", b"order:1"]).await,
        common::state::bulk(b"v")
    );
    assert_eq!(
        set(&mut client, "unrelated", "x").await,
        OK,
        "keys no topic matches are unaffected"
    );
    let full = stats(&server, "orders");
    assert_eq!(
        (full["entries"].as_u64(), full["reserved"].as_u64()),
        (Some(3), Some(0))
    );
    // Deleting the topic deletes its queue; writes no longer reserve anything.
    assert!(cli(&server, &["topic", "rm", "orders"]).status.success());
    let listed = cli(&server, &["topic", "list", "--json"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed["topics"], serde_json::json!([]));
    assert_eq!(set(&mut client, "order:4", "v").await, OK);
    assert!(!cli(&server, &["topic", "stats", "orders"]).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_reserve_and_commit_leaves_nothing_behind() {
    let hook = Hook::start(Mode::Ack).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut crashing =
        Server::start_in(&data, &[], &[("MQSTATE_FAILPOINT", "notify-after-reserve")]);
    create(&crashing, "orders", &hook.url(), &[]);
    // The SET reserves its slot and executes, in memory, and the process aborts before the record
    // that commits both is logged (decision 0038: the reservation is not logged on its own).
    let mut client = StateClient::connect(crashing.addr, "writer").await;
    let pending = tokio::spawn(async move {
        let _ = set(&mut client, "order:1", "lost").await;
    });
    let status = crashing.wait_exit();
    assert!(
        !status.success(),
        "the failpoint aborts the server: {status}"
    );
    pending.abort();
    let server = Server::start_in(&data, &[], &[]);
    let mut client = StateClient::connect(server.addr, "writer2").await;
    assert_eq!(
        client.request(&[b"GET", b"order:1"]).await,
        NIL,
        "the write never happened"
    );
    let after = stats(&server, "orders");
    assert_eq!(
        (
            after["reserved"].as_u64(),
            after["entries"].as_u64(),
            after["next_seq"].as_u64()
        ),
        (Some(0), Some(0), Some(1)),
        "no reservation, no entry, no seq used: {after}"
    );
    assert_eq!(set(&mut client, "order:1", "v1").await, OK);
    wait_until("delivery", || hook.records().len() == 1).await;
    assert_eq!(check_in_order(&hook.records(), 1), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_killed_while_pushing_resumes_after_restart() {
    let hook = Hook::start(Mode::Hold).await;
    let mut server = Server::start_with(FAST);
    create(&server, "orders", &hook.url(), &[]);
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=5 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    wait_until("a push in flight", || hook.received() >= 1).await;
    server.kill9();
    hook.set(Mode::Ack); // the held push is answered to a dead socket
    server.restart();
    // The lock still names the dead process; the restarted node takes its own lock over at once.
    wait_until("the queue to drain after the restart", || {
        stats(&server, "orders")["entries"] == 0
    })
    .await;
    let duplicates = check_in_order(&hook.records(), 5);
    println!("owner killed while pushing: 5 changes, {duplicates} duplicates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_cannot_remove_entries_another_owner_holds() {
    // Single node: the other owner is a client taking the expired lock with the same SET … NEX PX
    // a second node would send. A long walk keeps this node from renewing in between.
    let hook = Hook::start(Mode::Hold).await;
    let args = [
        "--notify-walk-interval-ms",
        "600000",
        "--notify-lock-expiry-ms",
        "1000",
    ];
    let server = Server::start_with(&args);
    create(&server, "orders", &hook.url(), &[]);
    // The only walk so far ran at start-up, before the topic existed, and the next is 10 minutes
    // away: an owner now means the create took the lock itself.
    wait_until("a new topic to get its owner at once", || {
        stats(&server, "orders")["owner"] == "mqstate"
    })
    .await;
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=3 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    wait_until("a push in flight", || hook.received() >= 1).await;
    server.signal("STOP");
    tokio::time::sleep(Duration::from_millis(1500)).await; // longer than the lock expiry
    server.signal("CONT");
    let lock = b"__mqstate/notify/orders_lock";
    let taken = client
        .request(&[b"SET", lock, b"other-node/c0ffee", b"NEX", b"PX", b"600000"])
        .await;
    assert_eq!(taken, OK, "the expired lock is free for another owner");
    hook.set(Mode::Ack); // the paused owner's push is acknowledged now
    wait_until("the deposed owner's removal attempt", || {
        stats(&server, "orders")["fenced_removals"] == 1
    })
    .await;
    let after = stats(&server, "orders");
    assert_eq!(after["entries"], 3, "the new owner's entries stay: {after}");
    assert_eq!(after["owner"], "other-node");
    assert_eq!(after["delivered"], 0);
}

/// A Mosquitto broker, killed when dropped.
struct Mosquitto(std::process::Child);

impl Mosquitto {
    /// Mosquitto with the configuration `conf` (written to a file in `dir`), once it listens on
    /// every port of `ports`.
    async fn start(dir: &std::path::Path, conf: &str, ports: &[u16]) -> Mosquitto {
        let path = dir.join("mosquitto.conf");
        std::fs::write(&path, conf).unwrap();
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("mosquitto (apt-get install mosquitto)");
        let mosquitto = Mosquitto(child);
        wait_until("mosquitto", || {
            ports
                .iter()
                .all(|port| std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok())
        })
        .await;
        mosquitto
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Three SETs through `server` reach `subscriber` (on `changes/orders`) through the endpoint
/// `mirror`, in order, and its queue empties once they were acknowledged.
async fn three_orders_mirrored(server: &Server, subscriber: &mut common::mqtt::Client) {
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=3 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    let mut records = Vec::new();
    for _ in 0..3 {
        records.push(serde_json::from_slice::<Value>(&subscriber.next_message().await).unwrap());
    }
    assert_eq!(check_in_order(&records, 3), 0);
    wait_until("removal after PUBACK", || {
        stats(server, "mirror")["entries"] == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_an_mqtt_endpoint_at_qos_1() {
    let port = common::free_addr().port();
    let dir = tempfile::tempdir().unwrap();
    let _mosquitto = Mosquitto::start(
        dir.path(),
        &format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        &[port],
    )
    .await;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut subscriber = common::mqtt::Client::connect(addr, "sub", false).await;
    subscriber.subscribe("changes/orders").await;
    let server = Server::start_with(FAST);
    create(
        &server,
        "mirror",
        &format!("mqtt://127.0.0.1:{port}/changes/orders"),
        &[],
    );
    three_orders_mirrored(&server, &mut subscriber).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_expiries_and_binary_values_are_notified_as_documented() {
    let hook = Hook::start(Mode::Ack).await;
    let server = Server::start_with(FAST);
    create(
        &server,
        "orders",
        &hook.url(),
        &["--events", "set,delete,expire"],
    );
    create(&server, "sets", &hook.url(), &["--events", "set"]);
    let mut client = StateClient::connect(server.addr, "writer").await;
    assert_eq!(
        client.request(&[b"SET", b"order:bin", &[0xff, 0x00]]).await,
        OK
    );
    assert_eq!(
        client.request(&[b"DEL", b"order:bin"]).await,
        &b":1\r\n"[..]
    );
    assert_eq!(
        client
            .request(&[b"SET", b"order:ttl", b"x", b"PX", b"200"])
            .await,
        OK
    );
    wait_until(
        "set, delete, expire on orders and the two sets on sets",
        || hook.records().len() == 6,
    )
    .await;
    let records = hook.records();
    let orders: Vec<&Value> = records.iter().filter(|r| r["topic"] == "orders").collect();
    let events: Vec<(&str, u64)> = orders
        .iter()
        .map(|r| (r["event"].as_str().unwrap(), r["seq"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        events,
        vec![("set", 1), ("delete", 2), ("set", 3), ("expire", 4)]
    );
    assert_eq!(orders[0]["value_base64"], "/wA=");
    assert!(orders[0].get("value").is_none());
    assert!(orders[1].get("value").is_none() && orders[1].get("value_base64").is_none());
    assert_eq!(orders[3]["key"], "order:ttl");
    let sets: Vec<&str> = records
        .iter()
        .filter(|r| r["topic"] == "sets")
        .map(|r| r["event"].as_str().unwrap())
        .collect();
    assert_eq!(sets, vec!["set", "set"], "a topic gets only its events");
}

/// The value of one Prometheus series (`name{labels}` as rendered), if present.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_topic_metrics_are_on_the_prometheus_endpoint() {
    let hook = Hook::start(Mode::Fail).await;
    let metrics = common::free_addr();
    let mut args = FAST.to_vec();
    let listen = metrics.to_string();
    args.extend(["--metrics-listen", &listen]);
    let server = Server::start_with(&args);
    create(&server, "orders", &hook.url(), &[]);
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=3 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    wait_until("failed pushes", || hook.received() >= 2).await;
    // Nobody runs `topic stats` here: the gauges are the executor's own.
    let series = |name: &str| format!("{name}{{topic=\"orders\"}}");
    let scrape = move || common::http_get(metrics, "/metrics").1;
    wait_until("the queue's gauges", || {
        let text = scrape();
        sample(&text, &series("mqstate_notify_queue_entries")) == Some(3.0)
            && sample(&text, &series("mqstate_notify_queue_bytes")) == Some(3.0 * 9.0)
    })
    .await;
    let down = scrape();
    assert_eq!(
        sample(&down, &series("mqstate_notify_queue_reserved")),
        Some(0.0)
    );
    assert!(sample(&down, &series("mqstate_notify_oldest_entry_age_ms")).is_some());
    assert!(sample(&down, &series("mqstate_notify_failed_pushes_total")).unwrap() >= 1.0);
    assert!(
        sample(&down, &series("mqstate_notify_retried_total")).unwrap() >= 3.0,
        "each failed push of the 3 entries retries them: {down}"
    );
    hook.set(Mode::Ack);
    wait_until("delivery counted and the queue empty", || {
        let text = scrape();
        sample(&text, &series("mqstate_notify_delivered_total")) == Some(3.0)
            && sample(&text, &series("mqstate_notify_queue_entries")) == Some(0.0)
    })
    .await;
}

/// A test CA and a certificate it signed for 127.0.0.1, as PEM files in a directory anyone may read
/// (Mosquitto started as root reads its files as the `mosquitto` user).
struct TestCerts {
    dir: tempfile::TempDir,
    leaf: Leaf,
}

impl TestCerts {
    fn new() -> TestCerts {
        use std::os::unix::fs::PermissionsExt;
        let ca = Ca::new("notify test CA");
        let leaf = ca.leaf("127.0.0.1", &["127.0.0.1"], false);
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for (name, pem) in [
            ("ca.pem", &ca.pem),
            ("cert.pem", &leaf.pem),
            ("key.pem", &leaf.key_pem),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        TestCerts { dir, leaf }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    fn acceptor(&self) -> TlsAcceptor {
        let provider = Arc::new(rustls::crypto::ring::default_provider());

        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![self.leaf.der.clone()], self.leaf.key())
            .unwrap();
        TlsAcceptor::from(Arc::new(config))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_endpoints_are_verified_against_the_ca_file() {
    let trusted = TestCerts::new();
    let stranger = TestCerts::new();
    let hook = Hook::start_tls(Mode::Ack, Some(trusted.acceptor())).await;
    let impostor = Hook::start_tls(Mode::Ack, Some(stranger.acceptor())).await;
    let mut args = FAST.to_vec();
    let ca = trusted.path("ca.pem");
    args.extend(["--notify-tls-ca-file", &ca]);
    let server = Server::start_with(&args);
    create(
        &server,
        "orders",
        &format!("https://{}/hook", hook.addr),
        &[],
    );
    let mut client = StateClient::connect(server.addr, "writer").await;
    for i in 1..=3 {
        assert_eq!(
            set(&mut client, &format!("order:{i}"), &format!("v{i}")).await,
            OK
        );
    }
    wait_until("delivery over TLS", || hook.records().len() >= 3).await;
    assert_eq!(check_in_order(&hook.records(), 3), 0);
    wait_until("the queue to drain", || {
        stats(&server, "orders")["entries"] == 0
    })
    .await;
    // A certificate from a CA we were not told to trust is refused: nothing is delivered, the
    // entries stay and the error says why.
    create(
        &server,
        "orders",
        &format!("https://{}/hook", impostor.addr),
        &[],
    );
    assert_eq!(set(&mut client, "order:4", "v4").await, OK);
    wait_until("a refused handshake", || {
        stats(&server, "orders")["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("certificate"))
    })
    .await;
    assert_eq!(stats(&server, "orders")["entries"], 1);
    assert_eq!(impostor.received(), 0, "nothing was sent to the impostor");
}

#[test]
fn a_ca_file_that_is_no_certificate_stops_the_server_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("ca.pem");
    std::fs::write(&bad, "not a certificate\n").unwrap();
    let (stderr, status) = common::serve_stderr(
        &["--notify-tls-ca-file", bad.to_str().unwrap()],
        &[],
        "mqstate ready",
    );
    let status = status.expect("the server must refuse to start");
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("notify_tls_ca_file"), "{stderr}");
    assert!(stderr.contains("no PEM CERTIFICATE"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_an_mqtts_endpoint() {
    let certs = TestCerts::new();
    let (plain, tls) = (common::free_addr().port(), common::free_addr().port());
    let _mosquitto = Mosquitto::start(
        certs.dir.path(),
        &format!(
            "listener {plain} 127.0.0.1\nallow_anonymous true\n\
             listener {tls} 127.0.0.1\ncertfile {}\nkeyfile {}\n",
            certs.path("cert.pem"),
            certs.path("key.pem")
        ),
        &[plain, tls],
    )
    .await;
    let addr: SocketAddr = format!("127.0.0.1:{plain}").parse().unwrap();
    let mut subscriber = common::mqtt::Client::connect(addr, "sub", false).await;
    subscriber.subscribe("changes/orders").await;
    let mut args = FAST.to_vec();
    let ca = certs.path("ca.pem");
    args.extend(["--notify-tls-ca-file", &ca]);
    let server = Server::start_with(&args);
    create(
        &server,
        "mirror",
        &format!("mqtts://127.0.0.1:{tls}/changes/orders"),
        &[],
    );
    three_orders_mirrored(&server, &mut subscriber).await;
}
