//! Persistent notifications against a real `mqstate serve` and real endpoints: an HTTP server in the
//! test (which can acknowledge, refuse or hold pushes) and Mosquitto for the MQTT endpoint.

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::state::{StateClient, NIL, OK};
use common::Server;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::watch;

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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, mode_rx) = watch::channel(mode);
        let acked = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(Mutex::new(0));
        let (a, r) = (Arc::clone(&acked), Arc::clone(&received));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(
                    stream,
                    mode_rx.clone(),
                    Arc::clone(&a),
                    Arc::clone(&r),
                ));
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
    stream: tokio::net::TcpStream,
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
        if stream
            .get_mut()
            .write_all(response.as_bytes())
            .await
            .is_err()
        {
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

fn mqstate(server: &Server, args: &[&str]) -> std::process::Output {
    let (sub, rest) = args.split_first().unwrap();
    let (sub2, rest) = rest.split_first().unwrap();
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args([sub, sub2])
        .args(["--port", &server.port().to_string(), "--timeout", "10"])
        .args(rest)
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .output()
        .unwrap()
}

fn create(server: &Server, name: &str, endpoint: &str, extra: &[&str]) {
    let mut args = vec![
        "topic",
        "create",
        name,
        "--endpoint",
        endpoint,
        "--keys",
        "order:*",
    ];
    args.extend_from_slice(extra);
    let out = mqstate(server, &args);
    assert!(out.status.success(), "topic create: {out:?}");
}

fn stats(server: &Server, name: &str) -> Value {
    let out = mqstate(server, &["topic", "stats", name, "--json"]);
    assert!(out.status.success(), "topic stats: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

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
    assert!(mqstate(&server, &["topic", "rm", "orders"])
        .status
        .success());
    let listed = mqstate(&server, &["topic", "list", "--json"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed["topics"], serde_json::json!([]));
    assert_eq!(set(&mut client, "order:4", "v").await, OK);
    assert!(!mqstate(&server, &["topic", "stats", "orders"])
        .status
        .success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_reserve_and_commit_leaves_a_reservation_that_is_cleaned_up() {
    let hook = Hook::start(Mode::Ack).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = ["--notify-reservation-timeout-ms", "500"];
    let mut crashing = Server::start_in(
        &data,
        &args,
        &[("MQSTATE_FAILPOINT", "notify-after-reserve")],
    );
    create(&crashing, "orders", &hook.url(), &[]);
    // The SET reserves, its reservation becomes durable, and the process aborts before the write.
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
    let server = Server::start_in(&data, &args, &[]);
    let mut client = StateClient::connect(server.addr, "writer2").await;
    assert_eq!(
        client.request(&[b"GET", b"order:1"]).await,
        NIL,
        "the write never happened"
    );
    wait_until("the stale reservation to be aborted", || {
        stats(&server, "orders")["reserved"] == 0
    })
    .await;
    let cleaned = stats(&server, "orders");
    assert_eq!(
        (cleaned["entries"].as_u64(), cleaned["next_seq"].as_u64()),
        (Some(0), Some(1))
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
    let owner = stats(&server, "orders");
    assert_eq!(
        owner["owner"], "mqstate",
        "a new topic gets its owner at once: {owner}"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_an_mqtt_endpoint_at_qos_1() {
    let port = common::free_addr().port();
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
    )
    .unwrap();
    let mut mosquitto = Command::new("mosquitto")
        .arg("-c")
        .arg(&conf)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mosquitto (apt-get install mosquitto)");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_until("mosquitto", || std::net::TcpStream::connect(addr).is_ok()).await;
    let mut subscriber = common::mqtt::Client::connect(addr, "sub", false).await;
    subscriber.subscribe("changes/orders").await;
    let server = Server::start_with(FAST);
    create(
        &server,
        "mirror",
        &format!("mqtt://127.0.0.1:{port}/changes/orders"),
        &[],
    );
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
        stats(&server, "mirror")["entries"] == 0
    })
    .await;
    let _ = mosquitto.kill();
    let _ = mosquitto.wait();
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
