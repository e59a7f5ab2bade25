//! The state-store protocol byte for byte: hand-built RESP requests over raw MQTT 5 (rumqttc), asserting the
//! exact reply payloads and properties of every row and error text of `docs/protocol.md` §3, the RPC
//! envelope of §1, KEYNOTIFY topics and payloads of §6 and SCAN paging of §2. Every test runs its own server.

use crate::common;

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{ConnectProperties, Packet, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, StateError};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use common::state::{hlc, now_ms, parse_scan, resp, set_note};

const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
const NOTIFY_PREFIX: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/";
/// Every wait in this file is bounded by this; it is a hang guard, not a performance claim.
const WAIT: Duration = Duration::from_secs(10);
/// Message Expiry Interval the SDKs put on requests (their timeout); the duplicate cache lives this long.
const REQUEST_EXPIRY_SECS: u32 = 10;
/// Large enough for the 65,000-byte value test and its reply.
const CLIENT_MAX_PACKET_BYTES: u32 = 1024 * 1024;

const ERR_TS_FUTURE: &[u8] = b"-ERR the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized\r\n";
const ERR_FT_REQUIRED: &[u8] = b"-ERR a fencing token is required for this request\r\n";
const ERR_FT_FUTURE: &[u8] = b"-ERR the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized\r\n";
const ERR_FT_LOWER: &[u8] =
    b"-ERR the request fencing token is a lower version than the fencing token protecting the resource\r\n";
const ERR_QUOTA: &[u8] = b"-ERR the quota has been exceeded\r\n";
const ERR_SYNTAX: &[u8] = b"-ERR syntax error\r\n";
const ERR_UNKNOWN: &[u8] = b"-ERR unknown command\r\n";
const ERR_ARITY: &[u8] = b"-ERR wrong number of arguments\r\n";
const ERR_TS_MISSING: &[u8] = b"-ERR missing timestamp\r\n";
const ERR_TS_MALFORMED: &[u8] = b"-ERR malformed timestamp\r\n";
const ERR_KEY_EMPTY: &[u8] = b"-ERR the key length is zero\r\n";

// ---------------------------------------------------------------------------------------------------------
// Helpers: RESP, HLC text, hex
// ---------------------------------------------------------------------------------------------------------

/// The exact GET-hit reply for `value`.
fn bulk(value: &[u8]) -> Vec<u8> {
    let mut out = format!("${}\r\n", value.len()).into_bytes();
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
    out
}

/// Parses an HLC the server produced, asserting the exact text form; returns the ordering key.
fn parse_hlc(text: &str) -> (u64, u64, String) {
    let parts: Vec<&str> = text.split(':').collect();
    assert_eq!(parts.len(), 3, "HLC {text:?} must have exactly three parts");
    assert_eq!(
        parts[0].len(),
        15,
        "HLC {text:?}: wall clock must be 15 digits"
    );
    assert!(
        parts[1].len() >= 5,
        "HLC {text:?}: counter must be at least 5 digits"
    );
    assert!(
        !parts[2].is_empty(),
        "HLC {text:?}: node id must not be empty"
    );
    let counter: u64 = parts[1].parse().unwrap();
    assert!(
        counter <= i32::MAX as u64,
        "HLC {text:?}: counter must fit a signed 32-bit int"
    );
    (parts[0].parse().unwrap(), counter, parts[2].to_string())
}

fn hex_upper(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

fn notify_topic(client_id: &str, key: &[u8]) -> String {
    format!(
        "{NOTIFY_PREFIX}{}/command/notify/{}",
        hex_upper(client_id.as_bytes()),
        hex_upper(key)
    )
}

const NOTIFY_DELETE: &[u8] = b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n";

fn user_prop<'a>(props: &'a PublishProperties, name: &str) -> Option<&'a str> {
    let mut values = props
        .user_properties
        .iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str());
    let first = values.next();
    assert!(
        values.next().is_none(),
        "user property {name} must appear at most once"
    );
    first
}

fn assert_content_type(props: &PublishProperties) {
    if let Some(ct) = &props.content_type {
        assert_eq!(
            ct, "application/octet-stream",
            "content type must be absent or application/octet-stream"
        );
    }
}

// ---------------------------------------------------------------------------------------------------------
// Helpers: a raw MQTT 5 client
// ---------------------------------------------------------------------------------------------------------

/// What the event-loop pump forwards to the test.
#[derive(Debug)]
enum Inbound {
    ConnAck {
        session_present: bool,
    },
    SubAck,
    Publish(Publish),
    /// The server sent DISCONNECT (reason code as a byte).
    Disconnect {
        reason: u8,
        reason_string: Option<String>,
    },
    /// The connection ended without a DISCONNECT from the server.
    Closed(String),
}

/// One request's properties; `Req::new` fills in what every SDK sends.
struct Req {
    payload: Vec<u8>,
    qos: QoS,
    ts: Option<String>,
    ft: Option<String>,
    correlation: Option<Vec<u8>>,
    omit_correlation: bool,
    response_topic: Option<String>,
    /// `__protVer`; `None` leaves it out.
    version: Option<String>,
}

impl Req {
    fn new(args: &[&[u8]]) -> Req {
        Req::raw(resp(args))
    }
    fn raw(payload: Vec<u8>) -> Req {
        Req {
            payload,
            qos: QoS::AtLeastOnce,
            ts: Some(hlc(now_ms(), 0, "wire")),
            ft: None,
            correlation: None,
            omit_correlation: false,
            response_topic: None,
            version: Some("1.0".into()),
        }
    }
    fn version(mut self, version: Option<&str>) -> Req {
        self.version = version.map(str::to_string);
        self
    }
    fn ts(mut self, ts: Option<&str>) -> Req {
        self.ts = ts.map(str::to_string);
        self
    }
    fn ft(mut self, ft: &str) -> Req {
        self.ft = Some(ft.to_string());
        self
    }
    fn correlation(mut self, c: &[u8]) -> Req {
        self.correlation = Some(c.to_vec());
        self
    }
    fn without_correlation(mut self) -> Req {
        self.omit_correlation = true;
        self
    }
    fn qos(mut self, qos: QoS) -> Req {
        self.qos = qos;
        self
    }
    fn response_topic(mut self, topic: &str) -> Req {
        self.response_topic = Some(topic.to_string());
        self
    }
}

/// A publish the client received, numbered in arrival order.
#[derive(Debug, Clone)]
struct Received {
    seq: u64,
    publish: Publish,
}

impl Received {
    fn topic(&self) -> String {
        String::from_utf8(self.publish.topic.to_vec()).unwrap()
    }
    fn payload(&self) -> &[u8] {
        &self.publish.payload
    }
    fn props(&self) -> &PublishProperties {
        self.publish
            .properties
            .as_ref()
            .expect("publish from the state store must carry properties")
    }
    fn user(&self, name: &str) -> Option<&str> {
        user_prop(self.props(), name)
    }
    fn ts(&self) -> &str {
        self.user("__ts")
            .unwrap_or_else(|| panic!("__ts missing on {:?}", self.publish))
    }
}

struct Wire {
    client_id: String,
    response_topic: String,
    client: AsyncClient,
    events: mpsc::UnboundedReceiver<Inbound>,
    pump: JoinHandle<()>,
    pending: VecDeque<Received>,
    next_seq: u64,
}

static NEXT_CORRELATION: AtomicU64 = AtomicU64::new(1);

async fn pump(mut eventloop: EventLoop, tx: mpsc::UnboundedSender<Inbound>) {
    loop {
        let inbound = match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => Inbound::ConnAck {
                session_present: ack.session_present,
            },
            Ok(Event::Incoming(Packet::SubAck(_))) => Inbound::SubAck,
            Ok(Event::Incoming(Packet::Publish(p))) => Inbound::Publish(p),
            Ok(Event::Incoming(Packet::Disconnect(d))) => {
                let reason_string = d.properties.and_then(|p| p.reason_string);
                let _ = tx.send(Inbound::Disconnect {
                    reason: d.reason_code as u8,
                    reason_string,
                });
                return;
            }
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => return,
            Ok(_) => continue,
            Err(ConnectionError::MqttState(StateError::ServerDisconnect {
                reason_code,
                reason_string,
            })) => {
                let _ = tx.send(Inbound::Disconnect {
                    reason: reason_code as u8,
                    reason_string,
                });
                return;
            }
            Err(e) => {
                // rumqttc would reconnect on the next poll; the tests want to see the loss instead.
                let _ = tx.send(Inbound::Closed(e.to_string()));
                return;
            }
        };
        if tx.send(inbound).is_err() {
            return;
        }
    }
}

impl Wire {
    /// Connects with a clean session and subscribes to this client's response topic.
    async fn connect(port: u16, client_id: &str) -> Wire {
        Wire::connect_with(port, client_id, true).await.0
    }

    /// Connects; returns the client and the CONNACK's Session Present flag.
    async fn connect_with(port: u16, client_id: &str, clean_start: bool) -> (Wire, bool) {
        let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
        options.set_clean_start(clean_start);
        let mut props = ConnectProperties::new();
        props.session_expiry_interval = Some(3600);
        props.max_packet_size = Some(CLIENT_MAX_PACKET_BYTES);
        options.set_connect_properties(props);
        options.set_request_channel_capacity(1024);
        let (client, eventloop) = AsyncClient::new(options, 1024);
        let (tx, events) = mpsc::unbounded_channel();
        let pump = tokio::spawn(pump(eventloop, tx));
        let mut wire = Wire {
            client_id: client_id.to_string(),
            response_topic: format!("clients/{client_id}/wire/response"),
            client,
            events,
            pump,
            pending: VecDeque::new(),
            next_seq: 0,
        };
        let session_present = match wire.next_event().await {
            Inbound::ConnAck { session_present } => session_present,
            other => panic!("{client_id}: expected CONNACK, got {other:?}"),
        };
        wire.client
            .subscribe(wire.response_topic.clone(), QoS::AtLeastOnce)
            .await
            .unwrap();
        loop {
            match wire.next_event().await {
                Inbound::SubAck => break,
                Inbound::Publish(p) => wire.stash(p),
                other => panic!("{client_id}: expected SUBACK, got {other:?}"),
            }
        }
        (wire, session_present)
    }

    async fn next_event(&mut self) -> Inbound {
        match tokio::time::timeout(WAIT, self.events.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => panic!("{}: connection pump ended", self.client_id),
            Err(_) => panic!("{}: nothing received within {WAIT:?}", self.client_id),
        }
    }

    fn stash(&mut self, publish: Publish) {
        self.pending.push_back(Received {
            seq: self.next_seq,
            publish,
        });
        self.next_seq += 1;
    }

    /// Publishes a request; returns its correlation data.
    async fn send(&mut self, req: Req) -> Vec<u8> {
        let correlation = req.correlation.clone().unwrap_or_else(|| {
            // 16 bytes like the SDKs; unique across connections, because a reconnecting client id that
            // reused correlation data would (rightly) get the cached reply of its earlier request.
            let n = NEXT_CORRELATION.fetch_add(1, Ordering::Relaxed);
            let mut c = n.to_be_bytes().to_vec();
            c.extend_from_slice(&[0xA5; 8]);
            c
        });
        let mut props = PublishProperties {
            response_topic: Some(
                req.response_topic
                    .clone()
                    .unwrap_or_else(|| self.response_topic.clone()),
            ),
            content_type: Some("application/octet-stream".into()),
            message_expiry_interval: Some(REQUEST_EXPIRY_SECS),
            ..Default::default()
        };
        if !req.omit_correlation {
            props.correlation_data = Some(Bytes::from(correlation.clone()));
        }
        props
            .user_properties
            .push(("__srcId".into(), self.client_id.clone()));
        if let Some(version) = &req.version {
            props
                .user_properties
                .push(("__protVer".into(), version.clone()));
        }
        if let Some(ts) = &req.ts {
            props.user_properties.push(("__ts".into(), ts.clone()));
        }
        if let Some(ft) = &req.ft {
            props.user_properties.push(("__ft".into(), ft.clone()));
        }
        self.client
            .publish_with_properties(INVOKE_TOPIC, req.qos, false, req.payload, props)
            .await
            .unwrap();
        correlation
    }

    /// Waits for the publish on `topic` that matches `pred`, keeping everything else pending.
    async fn wait_for(&mut self, what: &str, pred: impl Fn(&Received) -> bool) -> Received {
        if let Some(i) = self.pending.iter().position(&pred) {
            return self.pending.remove(i).unwrap();
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = match tokio::time::timeout(left, self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => panic!(
                    "{}: connection pump ended while waiting for {what}",
                    self.client_id
                ),
                Err(_) => panic!(
                    "{}: no {what} within {WAIT:?}; pending: {:?}",
                    self.client_id, self.pending
                ),
            };
            match event {
                Inbound::Publish(p) => {
                    self.stash(p);
                    if pred(self.pending.back().unwrap()) {
                        return self.pending.pop_back().unwrap();
                    }
                }
                other => panic!(
                    "{}: unexpected {other:?} while waiting for {what}",
                    self.client_id
                ),
            }
        }
    }

    /// The reply for `correlation` on this client's response topic.
    async fn reply(&mut self, correlation: &[u8]) -> Received {
        let topic = self.response_topic.clone();
        let reply = self
            .wait_for("reply", |r| {
                r.topic() == topic && r.props().correlation_data.as_deref() == Some(correlation)
            })
            .await;
        assert_envelope(&reply);
        reply
    }

    /// Sends and waits for the reply; asserts the envelope every response must have.
    async fn call_req(&mut self, req: Req) -> Received {
        let correlation = self.send(req).await;
        self.reply(&correlation).await
    }

    async fn call(&mut self, args: &[&[u8]]) -> Received {
        self.call_req(Req::new(args)).await
    }

    /// Sends and asserts the exact reply payload.
    async fn expect(&mut self, args: &[&[u8]], payload: &[u8]) -> Received {
        let reply = self.call(args).await;
        assert_payload(&reply, payload, args);
        reply
    }

    async fn expect_req(&mut self, req: Req, payload: &[u8]) -> Received {
        let what = String::from_utf8_lossy(&req.payload).into_owned();
        let reply = self.call_req(req).await;
        assert_eq!(
            Bytes::copy_from_slice(reply.payload()),
            Bytes::copy_from_slice(payload),
            "request {what:?}: wrong reply"
        );
        reply
    }

    /// Sends `command key…` for every key pipelined (one round of group commit instead of one per
    /// key) and asserts every reply is `reply`.
    async fn for_all(&mut self, command: &[&[u8]], keys: &[Vec<u8>], reply: &[u8]) {
        let mut correlations = Vec::with_capacity(keys.len());
        for key in keys {
            let mut args = vec![command[0], key.as_slice()];
            args.extend_from_slice(&command[1..]);
            correlations.push((
                self.send(Req::new(&args)).await,
                args.iter().map(|a| a.to_vec()).collect::<Vec<_>>(),
            ));
        }
        for (correlation, args) in correlations {
            let got = self.reply(&correlation).await;
            let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
            assert_payload(&got, reply, &args);
        }
    }

    /// The next notification (any key) for this client.
    async fn notification(&mut self) -> Received {
        let n = self
            .wait_for("notification", |r| r.topic().starts_with(NOTIFY_PREFIX))
            .await;
        assert_content_type(n.props());
        assert_eq!(
            n.publish.qos,
            QoS::AtLeastOnce,
            "notifications are published with QoS 1"
        );
        assert!(!n.publish.retain, "notifications are not retained");
        n
    }

    /// Asserts nothing but replies arrived so far (call after a round trip that follows the action under test).
    fn assert_no_notification(&self) {
        let stray: Vec<_> = self
            .pending
            .iter()
            .filter(|r| r.topic().starts_with(NOTIFY_PREFIX))
            .collect();
        assert!(
            stray.is_empty(),
            "{}: unexpected notifications {stray:?}",
            self.client_id
        );
    }

    /// Disconnects normally and waits for the connection to end.
    async fn close(self) {
        self.client.disconnect().await.unwrap();
        tokio::time::timeout(WAIT, self.pump)
            .await
            .expect("disconnect in time")
            .unwrap();
    }
}

fn assert_payload(reply: &Received, payload: &[u8], args: &[&[u8]]) {
    assert_eq!(
        Bytes::copy_from_slice(reply.payload()),
        Bytes::copy_from_slice(payload),
        "request {:?}: wrong reply",
        args.iter()
            .map(|a| String::from_utf8_lossy(a))
            .collect::<Vec<_>>()
    );
}

/// What every state-store response carries (§1), errors included.
fn assert_envelope(reply: &Received) {
    let props = reply.props();
    assert_eq!(
        reply.user("__stat"),
        Some("200"),
        "__stat on {:?}",
        reply.publish
    );
    assert_eq!(
        reply.user("__protVer"),
        Some("1.0"),
        "__protVer on {:?}",
        reply.publish
    );
    assert!(
        reply.user("__srcId").is_some_and(|s| !s.is_empty()),
        "__srcId on {:?}",
        reply.publish
    );
    assert_content_type(props);
}

/// Runs a full SCAN, returning every page's keys; asserts at most `max_pages` pages.
async fn scan_all(wire: &mut Wire, glob: &[u8], max_pages: usize) -> Vec<Vec<Vec<u8>>> {
    let mut pages = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    loop {
        let reply = match &token {
            None => wire.call(&[b"SCAN", glob]).await,
            Some(t) => wire.call(&[b"SCAN", glob, t]).await,
        };
        let (keys, next) = parse_scan(reply.payload());
        pages.push(keys);
        assert!(
            pages.len() <= max_pages,
            "SCAN {:?} needed more than {max_pages} pages",
            String::from_utf8_lossy(glob)
        );
        match next {
            Some(t) => token = Some(t),
            None => return pages,
        }
    }
}

fn key_set(pages: &[Vec<Vec<u8>>]) -> BTreeSet<Vec<u8>> {
    let all: Vec<Vec<u8>> = pages.iter().flatten().cloned().collect();
    let set: BTreeSet<Vec<u8>> = all.iter().cloned().collect();
    assert_eq!(set.len(), all.len(), "SCAN returned a key twice: {all:?}");
    set
}

fn keys(names: &[&str]) -> BTreeSet<Vec<u8>> {
    names.iter().map(|k| k.as_bytes().to_vec()).collect()
}

// ---------------------------------------------------------------------------------------------------------
// §3 rows
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn set_get_del_rows_and_versions() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-rows").await;

    let request_ts = hlc(now_ms(), 7, "wire");
    let set = w
        .expect_req(
            Req::new(&[b"SET", b"k", b"v"]).ts(Some(&request_ts)),
            b"+OK\r\n",
        )
        .await;
    let v1 = parse_hlc(set.ts());
    assert!(
        v1 > parse_hlc(&request_ts),
        "SET version {} must exceed the request __ts {request_ts}",
        set.ts()
    );

    let get = w.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;
    assert_eq!(
        get.ts(),
        set.ts(),
        "GET must return the version SET returned"
    );

    let set2 = w.expect(&[b"SET", b"k", b"v2"], b"+OK\r\n").await;
    assert!(parse_hlc(set2.ts()) > v1, "a key's versions must increase");
    let get2 = w.expect(&[b"GET", b"k"], b"$2\r\nv2\r\n").await;
    assert_eq!(get2.ts(), set2.ts());
    assert_eq!(
        parse_hlc(set2.ts()).2,
        v1.2,
        "one stable node id for the service"
    );

    let miss = w.expect(&[b"GET", b"absent"], b"$-1\r\n").await;
    assert_eq!(miss.user("__ts"), None, "__ts must be absent on a GET miss");

    w.expect(&[b"DEL", b"k"], b":1\r\n").await;
    w.expect(&[b"DEL", b"k"], b":0\r\n").await;
    let miss = w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
    assert_eq!(
        miss.user("__ts"),
        None,
        "__ts must be absent on a GET miss of a deleted key"
    );
}

#[tokio::test]
async fn set_nx_and_nex_conditions() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-nx").await;

    w.expect(&[b"SET", b"k", b"v", b"NX"], b"+OK\r\n").await;
    let not_applied = w.expect(&[b"SET", b"k", b"other", b"NX"], b":-1\r\n").await;
    parse_hlc(not_applied.ts());
    w.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;

    // NEX: applies when absent or equal (lock renewal), not when different.
    w.expect(&[b"SET", b"k", b"v", b"NEX"], b"+OK\r\n").await;
    let not_applied = w
        .expect(&[b"SET", b"k", b"other", b"NEX"], b":-1\r\n")
        .await;
    parse_hlc(not_applied.ts());
    w.expect(&[b"SET", b"fresh", b"x", b"NEX"], b"+OK\r\n")
        .await;
    w.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;
    w.expect(&[b"GET", b"fresh"], b"$1\r\nx\r\n").await;

    // PX may follow the condition.
    w.expect(&[b"SET", b"px", b"1", b"NX", b"PX", b"60000"], b"+OK\r\n")
        .await;
    w.expect(&[b"SET", b"px", b"2", b"NEX", b"PX", b"60000"], b":-1\r\n")
        .await;
    w.expect(&[b"GET", b"px"], b"$1\r\n1\r\n").await;
}

#[tokio::test]
async fn vdel_rows() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-vdel").await;

    w.expect(&[b"VDEL", b"k", b"v"], b":0\r\n").await;
    w.expect(&[b"SET", b"k", b"v"], b"+OK\r\n").await;
    w.expect(&[b"VDEL", b"k", b"nope"], b":-1\r\n").await;
    w.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;
    w.expect(&[b"VDEL", b"k", b"v"], b":1\r\n").await;
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn keynotify_rows() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-kn").await;

    w.expect(&[b"KEYNOTIFY", b"k", b"STOP"], b":0\r\n").await;
    w.expect(&[b"KEYNOTIFY", b"k"], b"+OK\r\n").await;
    w.expect(&[b"KEYNOTIFY", b"k"], b"+OK\r\n").await;
    w.expect(&[b"KEYNOTIFY", b"k", b"STOP"], b"+OK\r\n").await;
    w.expect(&[b"KEYNOTIFY", b"k", b"STOP"], b":0\r\n").await;
    // Registering a missing key produces no initial notification.
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
    w.assert_no_notification();
}

#[tokio::test]
async fn lower_case_command_and_option_words() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-lower").await;

    w.expect(&[b"set", b"k", b"v", b"nx", b"px", b"60000"], b"+OK\r\n")
        .await;
    w.expect(&[b"set", b"k", b"v", b"nex"], b"+OK\r\n").await;
    w.expect(&[b"get", b"k"], b"$1\r\nv\r\n").await;
    w.expect(&[b"keynotify", b"k"], b"+OK\r\n").await;
    w.expect(&[b"KeyNotify", b"k", b"stop"], b"+OK\r\n").await;
    w.expect(&[b"vdel", b"k", b"x"], b":-1\r\n").await;
    w.expect(&[b"Del", b"k"], b":1\r\n").await;
    let (keys, token) = parse_scan(w.call(&[b"scan", b"*"]).await.payload());
    assert!(
        keys.is_empty() && token.is_none(),
        "empty store scans empty"
    );
}

#[tokio::test]
async fn empty_values_round_trip() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-empty").await;

    w.expect(&[b"SET", b"k", b""], b"+OK\r\n").await;
    w.expect(&[b"GET", b"k"], b"$0\r\n\r\n").await;
    w.expect(&[b"SET", b"k", b"", b"NEX"], b"+OK\r\n").await;
    w.expect(&[b"VDEL", b"k", b"x"], b":-1\r\n").await;
    w.expect(&[b"VDEL", b"k", b""], b":1\r\n").await;
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn large_key_and_value() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-large").await;

    let key: Vec<u8> = (0..6_500u32).map(|i| b'a' + (i % 26) as u8).collect();
    let value: Vec<u8> = (0..65_000u32).map(|i| (i % 251) as u8).collect();
    w.expect(&[b"SET", &key, &value], b"+OK\r\n").await;
    w.expect(&[b"GET", &key], &bulk(&value)).await;
    w.expect(&[b"VDEL", &key, &value], b":1\r\n").await;
}

#[tokio::test]
async fn binary_keys_and_values_with_crlf_inside() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-binary").await;

    let key = b"\x00\r\n$3\r\nkey\xff";
    let value = b"\r\n*1\r\n\x00\xfe";
    w.expect(&[b"SET", key, value], b"+OK\r\n").await;
    w.expect(&[b"GET", key], &bulk(value)).await;
}

// ---------------------------------------------------------------------------------------------------------
// §3 error texts
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn argument_errors() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-args").await;

    w.expect(&[b"GET"], ERR_ARITY).await;
    w.expect(&[b"GET", b"k", b"extra"], ERR_ARITY).await;
    w.expect(&[b"SET", b"k"], ERR_ARITY).await;
    w.expect(&[b"DEL"], ERR_ARITY).await;
    w.expect(&[b"DEL", b"k", b"extra"], ERR_ARITY).await;
    w.expect(&[b"VDEL", b"k"], ERR_ARITY).await;
    w.expect(&[b"KEYNOTIFY"], ERR_ARITY).await;

    w.expect(&[b"SET", b"k", b"v", b"XX"], ERR_SYNTAX).await;
    w.expect(&[b"KEYNOTIFY", b"k", b"START"], ERR_SYNTAX).await;
    w.expect(&[b"SET", b"k", b"v", b"PX", b"soon"], ERR_SYNTAX)
        .await;
    w.expect(&[b"SET", b"k", b"v", b"PX", b"12x"], ERR_SYNTAX)
        .await;
    w.expect(
        &[b"SET", b"k", b"v", b"PX", b"99999999999999999999999999"],
        ERR_SYNTAX,
    )
    .await;
    w.expect(&[b"FLUSHALL", b"k"], ERR_UNKNOWN).await;
    w.expect(&[b"GETX", b"k"], ERR_UNKNOWN).await;
    w.expect(&[b"GET", b""], ERR_KEY_EMPTY).await;
    w.expect(&[b"SET", b"", b"v"], ERR_KEY_EMPTY).await;
    w.expect(&[b"DEL", b""], ERR_KEY_EMPTY).await;

    // None of the failed SETs wrote anything.
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn malformed_resp_is_a_syntax_error() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-resp").await;

    for payload in [
        b"hello".to_vec(),
        b"".to_vec(),
        b"*2\r\n$3\r\nGET\r\n".to_vec(),              // truncated
        b"*2\r\n$3\r\nGET\r\n$5\r\nk\r\n".to_vec(),   // length lies
        b"*1\r\n:5\r\n".to_vec(),                     // not a bulk string
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\nXX".to_vec(), // trailing bytes
        b"*99999999999999999999\r\n".to_vec(),        // overflowing count
    ] {
        w.expect_req(Req::raw(payload), ERR_SYNTAX).await;
    }
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn timestamp_errors() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-ts").await;

    w.expect_req(Req::new(&[b"SET", b"k", b"v"]).ts(None), ERR_TS_MISSING)
        .await;
    for bad in [
        "abc",
        "1:2",
        "1:2:3:4",
        "x:00000:node",
        "001696374425000:zz:node",
    ] {
        w.expect_req(
            Req::new(&[b"SET", b"k", b"v"]).ts(Some(bad)),
            ERR_TS_MALFORMED,
        )
        .await;
    }
    let future = hlc(now_ms() + 120_000, 0, "wire");
    w.expect_req(
        Req::new(&[b"SET", b"k", b"v"]).ts(Some(&future)),
        ERR_TS_FUTURE,
    )
    .await;
    // Any time in the past is fine.
    let past = hlc(now_ms() - 3_600_000, 0, "wire");
    w.expect_req(Req::new(&[b"SET", b"k", b"v"]).ts(Some(&past)), b"+OK\r\n")
        .await;

    w.expect_req(
        Req::new(&[b"SET", b"f", b"v"]).ft("not-an-hlc"),
        ERR_TS_MALFORMED,
    )
    .await;
    let future_ft = hlc(now_ms() + 120_000, 0, "lock");
    w.expect_req(
        Req::new(&[b"SET", b"f", b"v"]).ft(&future_ft),
        ERR_FT_FUTURE,
    )
    .await;
    w.expect(&[b"GET", b"f"], b"$-1\r\n").await;
}

#[tokio::test]
async fn fencing_tokens() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-ft").await;
    let base = now_ms() - 10_000;
    let t1 = hlc(base, 0, "lock");
    let t0 = hlc(base - 1, 5, "lock");
    let t2 = hlc(base + 1, 0, "lock");

    // No token on the key yet: the write applies and stores the token.
    w.expect_req(Req::new(&[b"SET", b"k", b"v1"]).ft(&t1), b"+OK\r\n")
        .await;
    w.expect(&[b"SET", b"k", b"x"], ERR_FT_REQUIRED).await;
    w.expect_req(Req::new(&[b"SET", b"k", b"x"]).ft(&t0), ERR_FT_LOWER)
        .await;
    w.expect_req(Req::new(&[b"SET", b"k", b"v2"]).ft(&t1), b"+OK\r\n")
        .await;
    // A newer token replaces the stored one.
    w.expect_req(Req::new(&[b"SET", b"k", b"v3"]).ft(&t2), b"+OK\r\n")
        .await;
    w.expect_req(Req::new(&[b"SET", b"k", b"x"]).ft(&t1), ERR_FT_LOWER)
        .await;
    // GET never needs a token.
    w.expect(&[b"GET", b"k"], b"$2\r\nv3\r\n").await;

    // DEL and VDEL follow the same checks.
    w.expect(&[b"DEL", b"k"], ERR_FT_REQUIRED).await;
    w.expect(&[b"VDEL", b"k", b"v3"], ERR_FT_REQUIRED).await;
    w.expect_req(Req::new(&[b"DEL", b"k"]).ft(&t1), ERR_FT_LOWER)
        .await;
    w.expect_req(Req::new(&[b"VDEL", b"k", b"v3"]).ft(&t0), ERR_FT_LOWER)
        .await;
    w.expect(&[b"GET", b"k"], b"$2\r\nv3\r\n").await;
    w.expect_req(Req::new(&[b"VDEL", b"k", b"v3"]).ft(&t2), b":1\r\n")
        .await;

    // The token went away with the key.
    w.expect(&[b"SET", b"k", b"free"], b"+OK\r\n").await;
    w.expect(&[b"DEL", b"k"], b":1\r\n").await;

    // Same for DEL with a token.
    w.expect_req(Req::new(&[b"SET", b"d", b"v"]).ft(&t1), b"+OK\r\n")
        .await;
    w.expect_req(Req::new(&[b"DEL", b"d"]).ft(&t2), b":1\r\n")
        .await;
    w.expect(&[b"SET", b"d", b"free"], b"+OK\r\n").await;
}

#[tokio::test]
async fn fencing_token_from_a_lock_key() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-lock").await;

    let acquired = w
        .expect(
            &[b"SET", b"LockName", b"Client1", b"NEX", b"PX", b"10000"],
            b"+OK\r\n",
        )
        .await;
    let token = acquired.ts().to_string();
    w.expect_req(
        Req::new(&[b"SET", b"protected", b"a"]).ft(&token),
        b"+OK\r\n",
    )
    .await;
    // Renewal by the holder: NEX with the same value applies and yields a newer token.
    let renewed = w
        .expect(
            &[b"SET", b"LockName", b"Client1", b"NEX", b"PX", b"10000"],
            b"+OK\r\n",
        )
        .await;
    assert!(parse_hlc(renewed.ts()) > parse_hlc(&token));
    w.expect(
        &[b"SET", b"LockName", b"Client2", b"NEX", b"PX", b"10000"],
        b":-1\r\n",
    )
    .await;
    w.expect_req(
        Req::new(&[b"SET", b"protected", b"b"]).ft(renewed.ts()),
        b"+OK\r\n",
    )
    .await;
    w.expect_req(
        Req::new(&[b"SET", b"protected", b"c"]).ft(&token),
        ERR_FT_LOWER,
    )
    .await;
    w.expect(&[b"GET", b"protected"], b"$1\r\nb\r\n").await;
}

#[tokio::test]
async fn key_quota() {
    let server = common::Server::start_with(&["--max-keys", "3"]);
    let mut w = Wire::connect(server.port(), "wire-quota").await;

    for k in [&b"a"[..], b"b", b"c"] {
        w.expect(&[b"SET", k, b"v"], b"+OK\r\n").await;
    }
    w.expect(&[b"SET", b"d", b"v"], ERR_QUOTA).await;
    w.expect(&[b"GET", b"d"], b"$-1\r\n").await;
    // Overwriting an existing key does not add one.
    w.expect(&[b"SET", b"a", b"v2"], b"+OK\r\n").await;
    w.expect(&[b"DEL", b"a"], b":1\r\n").await;
    w.expect(&[b"SET", b"d", b"v"], b"+OK\r\n").await;
    w.expect(&[b"SET", b"e", b"v"], ERR_QUOTA).await;
}

// ---------------------------------------------------------------------------------------------------------
// §1 RPC envelope
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn reply_echoes_correlation_and_carries_envelope() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-env").await;

    // Opaque correlation data of unusual lengths is echoed byte for byte.
    for correlation in [vec![0u8], vec![0xFF; 3], (0..64).collect::<Vec<u8>>()] {
        let reply = w
            .call_req(Req::new(&[b"GET", b"k"]).correlation(&correlation))
            .await;
        assert_eq!(
            reply.props().correlation_data.as_deref(),
            Some(&correlation[..])
        );
        assert_eq!(
            reply.publish.qos,
            QoS::AtLeastOnce,
            "responses are published with QoS 1"
        );
    }
    // Error replies carry the full envelope too (asserted in `reply`).
    w.expect(&[b"NOPE"], ERR_UNKNOWN).await;
}

#[tokio::test]
async fn qos0_request_is_answered_with_status_400() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-qos0").await;

    let correlation = w
        .send(Req::new(&[b"SET", b"k", b"v"]).qos(QoS::AtMostOnce))
        .await;
    let topic = w.response_topic.clone();
    let reply = w
        .wait_for("400 reply", |r| {
            r.topic() == topic && r.props().correlation_data.as_deref() == Some(&correlation[..])
        })
        .await;
    assert_eq!(reply.user("__stat"), Some("400"));
    assert!(
        reply.user("__stMsg").is_some_and(|m| !m.is_empty()),
        "__stMsg must explain the 400"
    );
    // The request was not executed.
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn unsupported_protocol_version_is_answered_with_status_505() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-version").await;
    // The AIO RPC convention (the SDKs' executors): a major version not spoken, or a version that
    // does not parse, gets 505 with the supported major versions and the requested version.
    for requested in ["99.0", "2.1", "one"] {
        let correlation = w
            .send(Req::new(&[b"SET", b"k", b"v"]).version(Some(requested)))
            .await;
        let topic = w.response_topic.clone();
        let reply = w
            .wait_for("505 reply", |r| {
                r.topic() == topic
                    && r.props().correlation_data.as_deref() == Some(&correlation[..])
            })
            .await;
        assert_eq!(reply.user("__stat"), Some("505"), "__protVer {requested}");
        assert_eq!(reply.user("__supProtMajVer"), Some("1"));
        assert_eq!(reply.user("__requestProtVer"), Some(requested));
        assert_eq!(reply.user("__protVer"), Some("1.0"));
        assert!(reply.user("__stMsg").is_some_and(|m| m.contains(requested)));
        assert!(reply.payload().is_empty());
    }
    // None of them ran; a minor version above ours, or no __protVer at all (1.0), is served.
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
    w.expect_req(
        Req::new(&[b"SET", b"k", b"v"]).version(Some("1.9")),
        b"+OK\r\n",
    )
    .await;
    w.expect_req(Req::new(&[b"GET", b"k"]).version(None), &bulk(b"v"))
        .await;
}

/// Which requests need `__ts` (docs/statestore.md): SET only, as the AIO state store protocol says
/// ("in GET, DEL and VDEL requests the client does not specify __ts"); the official SDKs send it
/// on every request, and wherever it comes it is parsed, drift-checked and merged into the clock.
#[tokio::test]
async fn only_set_needs_a_timestamp_but_every_timestamp_is_checked() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-ts-rule").await;
    w.expect_req(Req::new(&[b"SET", b"k", b"v"]).ts(None), ERR_TS_MISSING)
        .await;
    w.expect(&[b"SET", b"k", b"v"], b"+OK\r\n").await;
    let hit = bulk(b"v");
    let without_ts: [(&[&[u8]], &[u8]); 5] = [
        (&[b"GET", b"k"], &hit),
        (&[b"KEYNOTIFY", b"k"], b"+OK\r\n"),
        (&[b"VDEL", b"k", b"other"], b":-1\r\n"),
        (&[b"SCAN", b"nothing*"], b"*1\r\n*0\r\n"),
        (&[b"DEL", b"k"], b":1\r\n"),
    ];
    for (args, reply) in without_ts {
        w.expect_req(Req::new(args).ts(None), reply).await;
    }
    let future = hlc(now_ms() + 120_000, 0, "wire");
    let commands: [&[&[u8]]; 3] = [&[b"GET", b"k"], &[b"DEL", b"k"], &[b"KEYNOTIFY", b"k"]];
    for args in commands {
        w.expect_req(Req::new(args).ts(Some("garbage")), ERR_TS_MALFORMED)
            .await;
        w.expect_req(Req::new(args).ts(Some(&future)), ERR_TS_FUTURE)
            .await;
    }
}

#[tokio::test]
async fn response_topic_with_wildcards_disconnects() {
    let server = common::Server::start();
    for (id, topic) in [
        ("wire-wild-1", "clients/wire-wild-1/#"),
        ("wire-wild-2", "clients/+/r"),
    ] {
        let mut w = Wire::connect(server.port(), id).await;
        w.send(Req::new(&[b"GET", b"k"]).response_topic(topic))
            .await;
        match w.next_event().await {
            Inbound::Disconnect {
                reason,
                reason_string,
            } => {
                assert_eq!(reason, 0x82, "{topic}");
                assert!(reason_string.is_some_and(|r| r.contains("wildcards")));
            }
            other => panic!("expected DISCONNECT for {topic}, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn missing_correlation_is_answered_with_status_400() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-nocorr").await;

    let topic = format!("clients/{}/wire/nocorr", w.client_id);
    w.client
        .subscribe(topic.clone(), QoS::AtLeastOnce)
        .await
        .unwrap();
    match w.next_event().await {
        Inbound::SubAck => {}
        other => panic!("expected SUBACK, got {other:?}"),
    }
    w.send(
        Req::new(&[b"SET", b"k", b"v"])
            .without_correlation()
            .response_topic(&topic),
    )
    .await;
    let reply = w.wait_for("400 reply", |r| r.topic() == topic).await;
    assert_eq!(reply.user("__stat"), Some("400"));
    assert!(
        reply.user("__stMsg").is_some_and(|m| !m.is_empty()),
        "__stMsg must explain the 400"
    );
    assert_eq!(reply.props().correlation_data, None);
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

async fn assert_forbidden_response_topic(port: u16, client_id: &str, response_topic: &str) {
    let mut w = Wire::connect(port, client_id).await;
    w.send(Req::new(&[b"GET", b"k"]).response_topic(response_topic))
        .await;
    match w.next_event().await {
        Inbound::Disconnect {
            reason,
            reason_string,
        } => {
            assert!(
                reason >= 0x80,
                "response topic {response_topic}: DISCONNECT reason {reason:#04x} must be >= 0x80"
            );
            assert!(
                reason_string.is_some_and(|s| !s.is_empty()),
                "response topic {response_topic}: DISCONNECT must carry a reason string"
            );
        }
        Inbound::Closed(e) => {
            panic!("response topic {response_topic}: connection closed without DISCONNECT: {e}")
        }
        Inbound::Publish(p) => {
            panic!("response topic {response_topic}: expected DISCONNECT, got {p:?}")
        }
        other => panic!("response topic {response_topic}: expected DISCONNECT, got {other:?}"),
    }
}

#[tokio::test]
async fn forbidden_response_topics_disconnect_the_client() {
    let server = common::Server::start();
    assert_forbidden_response_topic(server.port(), "wire-forbid-1", INVOKE_TOPIC).await;
    assert_forbidden_response_topic(
        server.port(),
        "wire-forbid-2",
        "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/evil/command/notify/00",
    )
    .await;
    // The server is still fine for others.
    let mut w = Wire::connect(server.port(), "wire-forbid-3").await;
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
}

#[tokio::test]
async fn duplicate_request_replays_the_cached_reply() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-dup").await;

    // A retried SET NX keeps its +OK.
    let first = w
        .expect_req(
            Req::new(&[b"SET", b"nx", b"v", b"NX"]).correlation(b"dup-nx-0000000001"),
            b"+OK\r\n",
        )
        .await;
    let again = w
        .expect_req(
            Req::new(&[b"SET", b"nx", b"v", b"NX"]).correlation(b"dup-nx-0000000001"),
            b"+OK\r\n",
        )
        .await;
    assert_eq!(
        again.ts(),
        first.ts(),
        "the replay is the cached reply, version included"
    );

    // A replayed SET is not executed again: it must not overwrite a later write.
    let c1 = b"dup-set-000000001";
    let set1 = w
        .expect_req(Req::new(&[b"SET", b"k", b"v1"]).correlation(c1), b"+OK\r\n")
        .await;
    w.expect(&[b"SET", b"k", b"v2"], b"+OK\r\n").await;
    let replay = w
        .expect_req(Req::new(&[b"SET", b"k", b"v1"]).correlation(c1), b"+OK\r\n")
        .await;
    assert_eq!(replay.ts(), set1.ts());
    w.expect(&[b"GET", b"k"], b"$2\r\nv2\r\n").await;

    // The same correlation from another client is a different request.
    let mut other = Wire::connect(server.port(), "wire-dup-other").await;
    other
        .expect_req(
            Req::new(&[b"SET", b"nx", b"v", b"NX"]).correlation(b"dup-nx-0000000001"),
            b":-1\r\n",
        )
        .await;
}

// ---------------------------------------------------------------------------------------------------------
// §6 notifications
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn keynotify_topics_payloads_and_order() {
    let server = common::Server::start();
    // The client subscribes to nothing but its response topic: delivery must not need a subscription.
    let mut w = Wire::connect(server.port(), "client-id1").await;
    let key = b"SOMEKEY";
    w.expect(&[b"KEYNOTIFY", key], b"+OK\r\n").await;

    let set = w.expect(&[b"SET", key, b"hello"], b"+OK\r\n").await;
    let n = w.notification().await;
    assert_eq!(
        n.topic(),
        "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/636C69656E742D696431/command/notify/534F4D454B4559"
    );
    assert_eq!(n.payload(), &set_note(b"hello")[..]);
    assert_eq!(
        n.ts(),
        set.ts(),
        "notification __ts is the version of the change"
    );
    assert!(
        n.seq < set.seq,
        "the notification must be published before the reply"
    );

    let set_empty = w.expect(&[b"SET", key, b""], b"+OK\r\n").await;
    let n = w.notification().await;
    assert_eq!(n.payload(), &set_note(b"")[..]);
    assert_eq!(n.ts(), set_empty.ts());

    // Not notified: a SET not applied, DEL/VDEL of a missing key, a VDEL mismatch.
    w.expect(&[b"SET", key, b"x", b"NX"], b":-1\r\n").await;
    w.expect(&[b"VDEL", key, b"mismatch"], b":-1\r\n").await;
    w.expect(&[b"DEL", b"other"], b":0\r\n").await;
    w.assert_no_notification();

    let del = w.expect(&[b"DEL", key], b":1\r\n").await;
    let n = w.notification().await;
    assert_eq!(n.payload(), NOTIFY_DELETE);
    assert!(n.seq < del.seq);
    parse_hlc(n.ts());

    w.expect(&[b"DEL", key], b":0\r\n").await;
    w.expect(&[b"VDEL", key, b"x"], b":0\r\n").await;
    w.expect(&[b"SET", key, b"v"], b"+OK\r\n").await;
    assert_eq!(w.notification().await.payload(), &set_note(b"v")[..]);
    let vdel = w.expect(&[b"VDEL", key, b"v"], b":1\r\n").await;
    let n = w.notification().await;
    assert_eq!(n.payload(), NOTIFY_DELETE);
    assert!(n.seq < vdel.seq);

    // After STOP nothing more arrives.
    w.expect(&[b"KEYNOTIFY", key, b"STOP"], b"+OK\r\n").await;
    w.expect(&[b"SET", key, b"after"], b"+OK\r\n").await;
    w.expect(&[b"GET", key], b"$5\r\nafter\r\n").await;
    w.assert_no_notification();
}

#[tokio::test]
async fn keynotify_binary_key_topic_is_upper_case_hex() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-hex").await;
    let key = b"\x00\xab\xcd/+#z";
    w.expect(&[b"KEYNOTIFY", key], b"+OK\r\n").await;
    w.expect(&[b"SET", key, b"v"], b"+OK\r\n").await;
    let n = w.notification().await;
    assert_eq!(n.topic(), notify_topic("wire-hex", key));
    assert!(n.topic().ends_with("/command/notify/00ABCD2F2B237A"));
}

#[tokio::test]
async fn notifications_go_to_each_observer_exactly_once() {
    let server = common::Server::start();
    let mut watcher = Wire::connect(server.port(), "wire-watcher").await;
    let mut writer = Wire::connect(server.port(), "wire-writer").await;
    // The watcher also has a subscription matching its notification topic: still exactly one copy.
    // (Only its own notification topics: subscribing to others' is refused.)
    watcher
        .client
        .subscribe(
            format!("{NOTIFY_PREFIX}{}/#", hex_upper(b"wire-watcher")),
            QoS::AtLeastOnce,
        )
        .await
        .unwrap();
    match watcher.next_event().await {
        Inbound::SubAck => {}
        other => panic!("expected SUBACK, got {other:?}"),
    }
    watcher.expect(&[b"KEYNOTIFY", b"k"], b"+OK\r\n").await;

    let set1 = writer.expect(&[b"SET", b"k", b"1"], b"+OK\r\n").await;
    let set2 = writer.expect(&[b"SET", b"k", b"2"], b"+OK\r\n").await;
    let n1 = watcher.notification().await;
    let n2 = watcher.notification().await;
    assert_eq!(n1.topic(), notify_topic("wire-watcher", b"k"));
    assert_eq!((n1.payload(), n1.ts()), (&set_note(b"1")[..], set1.ts()));
    assert_eq!((n2.payload(), n2.ts()), (&set_note(b"2")[..], set2.ts()));
    // A round trip after the writes: a duplicate would be queued before this reply.
    watcher.expect(&[b"GET", b"k"], b"$1\r\n2\r\n").await;
    watcher.assert_no_notification();
    // The writer does not observe the key and gets nothing.
    writer.expect(&[b"GET", b"k"], b"$1\r\n2\r\n").await;
    writer.assert_no_notification();
}

#[tokio::test]
async fn registrations_are_dropped_on_disconnect() {
    let server = common::Server::start();
    let mut watcher = Wire::connect(server.port(), "wire-leaver").await;
    watcher.expect(&[b"KEYNOTIFY", b"k"], b"+OK\r\n").await;
    watcher.close().await;

    // The session survives (clean start 0, expiry 3600) but the registration does not.
    let (mut watcher, session_present) =
        Wire::connect_with(server.port(), "wire-leaver", false).await;
    assert!(
        session_present,
        "the session must survive a normal disconnect with session expiry 3600"
    );
    let mut writer = Wire::connect(server.port(), "wire-leaver-writer").await;
    writer.expect(&[b"SET", b"k", b"v"], b"+OK\r\n").await;
    watcher.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;
    watcher.assert_no_notification();
    watcher
        .expect(&[b"KEYNOTIFY", b"k", b"STOP"], b":0\r\n")
        .await;
}

#[tokio::test]
async fn expiry_is_active_and_notifies_delete() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-expiry").await;
    w.expect(&[b"KEYNOTIFY", b"k"], b"+OK\r\n").await;

    let set = w
        .expect(&[b"SET", b"k", b"v", b"PX", b"300"], b"+OK\r\n")
        .await;
    assert_eq!(w.notification().await.payload(), &set_note(b"v")[..]);
    // No reads: only an active expiry can produce this DELETE (WAIT bounds the test, not the server).
    let n = w.notification().await;
    assert_eq!(n.payload(), NOTIFY_DELETE);
    assert!(
        parse_hlc(n.ts()) > parse_hlc(set.ts()),
        "the expiry's version follows the SET's"
    );
    w.expect(&[b"GET", b"k"], b"$-1\r\n").await;
    // An expired key is unprotected and absent for NX.
    w.expect(&[b"SET", b"k", b"again", b"NX"], b"+OK\r\n").await;
}

// ---------------------------------------------------------------------------------------------------------
// §2 SCAN
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn scan_pages_through_100_keys() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-scan").await;
    let keys100: Vec<Vec<u8>> = (0..100)
        .map(|i| format!("scan/{i:03}").into_bytes())
        .collect();
    w.for_all(&[b"SET", b"v"], &keys100, b"+OK\r\n").await;
    let expected: BTreeSet<Vec<u8>> = keys100.into_iter().collect();
    w.expect(&[b"SET", b"other", b"v"], b"+OK\r\n").await;

    let pages = scan_all(&mut w, b"scan/*", 64).await;
    assert_eq!(key_set(&pages), expected);
    let pages = scan_all(&mut w, b"*", 64).await;
    assert_eq!(key_set(&pages).len(), 101);
}

#[tokio::test]
async fn scan_glob_semantics() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-glob").await;
    for k in [
        "a/b/c", "abc", "abd", "ab", "xbc", "^bc", "star*", "starX", "q?", "[x]",
    ] {
        w.expect(&[b"SET", k.as_bytes(), b"v"], b"+OK\r\n").await;
    }
    let cases: &[(&str, &[&str])] = &[
        ("a*", &["a/b/c", "abc", "abd", "ab"]),
        ("a*c", &["a/b/c", "abc"]),
        ("ab?", &["abc", "abd"]),
        ("ab", &["ab"]),
        ("b", &[]),
        ("[ax]bc", &["abc", "xbc"]),
        ("[a-c]b[c-c]", &["abc"]),
        ("[!a]bc", &["xbc", "^bc"]),
        ("[^a]bc", &["abc", "^bc"]),
        ("star[*]", &["star*"]),
        ("star*", &["star*", "starX"]),
        ("q[?]", &["q?"]),
        ("[[]x]", &["[x]"]),
        (
            "*",
            &[
                "a/b/c", "abc", "abd", "ab", "xbc", "^bc", "star*", "starX", "q?", "[x]",
            ],
        ),
    ];
    for (glob, want) in cases {
        let pages = scan_all(&mut w, glob.as_bytes(), 64).await;
        assert_eq!(key_set(&pages), keys(want), "SCAN {glob:?}");
    }
}

#[tokio::test]
async fn scan_never_returns_keys_deleted_between_pages() {
    let server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-scandel").await;
    let keys100: Vec<Vec<u8>> = (0..100).map(|i| format!("k{i:03}").into_bytes()).collect();
    w.for_all(&[b"SET", b"v"], &keys100, b"+OK\r\n").await;
    let (first, mut token) = parse_scan(w.call(&[b"SCAN", b"k*"]).await.payload());
    let mut seen: BTreeSet<Vec<u8>> = first.iter().cloned().collect();
    assert_eq!(seen.len(), first.len());
    // Delete every key not yet returned, plus the odd ones among those already seen.
    let deleted: BTreeSet<Vec<u8>> = (0..100)
        .map(|i| format!("k{i:03}").into_bytes())
        .enumerate()
        .filter(|(i, key)| !seen.contains(key) || i % 2 == 1)
        .map(|(_, key)| key)
        .collect();
    let to_delete: Vec<Vec<u8>> = deleted.iter().cloned().collect();
    w.for_all(&[b"DEL"], &to_delete, b":1\r\n").await;
    let mut pages = 1;
    while let Some(t) = token {
        let (keys, next) = parse_scan(w.call(&[b"SCAN", b"k*", &t]).await.payload());
        for key in keys {
            assert!(
                !deleted.contains(&key),
                "SCAN returned deleted key {:?}",
                String::from_utf8_lossy(&key)
            );
            assert!(seen.insert(key), "SCAN returned a key twice");
        }
        token = next;
        pages += 1;
        assert!(pages <= 64, "SCAN k* needed more than 64 pages");
    }
    let survivors: BTreeSet<Vec<u8>> = (0..100)
        .map(|i| format!("k{i:03}").into_bytes())
        .filter(|k| !deleted.contains(k))
        .collect();
    assert!(
        survivors.is_subset(&seen),
        "every surviving key was returned"
    );
}

// ---------------------------------------------------------------------------------------------------------
// Durability and sessions across restarts (§7)
// ---------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn acknowledged_writes_survive_kill9() {
    let mut server = common::Server::start();
    let mut w = Wire::connect(server.port(), "wire-durable").await;
    let set = w.expect(&[b"SET", b"k", b"v"], b"+OK\r\n").await;
    w.expect_req(
        Req::new(&[b"SET", b"fenced", b"v"]).ft(&hlc(now_ms() - 1_000, 0, "lock")),
        b"+OK\r\n",
    )
    .await;
    w.expect(&[b"SET", b"gone", b"v"], b"+OK\r\n").await;
    w.expect(&[b"DEL", b"gone"], b":1\r\n").await;
    server.kill9();
    server.restart();

    let mut w = Wire::connect(server.port(), "wire-durable-2").await;
    let get = w.expect(&[b"GET", b"k"], b"$1\r\nv\r\n").await;
    assert_eq!(get.ts(), set.ts(), "the version survives the restart");
    w.expect(&[b"GET", b"gone"], b"$-1\r\n").await;
    // The fencing token is durable state of the key too.
    w.expect(&[b"SET", b"fenced", b"x"], ERR_FT_REQUIRED).await;
    let after = w.expect(&[b"SET", b"k", b"v2"], b"+OK\r\n").await;
    assert!(
        parse_hlc(after.ts()) > parse_hlc(set.ts()),
        "versions keep increasing after a restart"
    );
}

#[tokio::test]
async fn session_survives_a_server_restart() {
    let mut server = common::Server::start();
    let (w, _) = Wire::connect_with(server.port(), "wire-session", false).await;
    w.close().await;
    server.stop();
    server.restart();
    let (_w, session_present) = Wire::connect_with(server.port(), "wire-session", false).await;
    assert!(
        session_present,
        "CONNACK Session Present must be 1 after a restart (SDKs treat 0 as fatal)"
    );
}

#[tokio::test]
async fn requests_over_the_per_client_rate_get_quota_exceeded_and_others_are_served() {
    let server = common::Server::start_with(&["--statestore-requests-per-second", "3"]);
    let mut greedy = Wire::connect(server.port(), "wire-greedy").await;
    let mut sent = Vec::new();
    for _ in 0..50 {
        sent.push(greedy.send(Req::new(&[b"SET", b"rate-k", b"v"])).await);
    }
    let (mut ok, mut limited) = (0, 0);
    for correlation in sent {
        match greedy.reply(&correlation).await.payload() {
            b"+OK\r\n" => ok += 1,
            b"-ERR the quota has been exceeded\r\n" => limited += 1,
            other => panic!("unexpected reply {:?}", String::from_utf8_lossy(other)),
        }
    }
    assert!(ok >= 3, "the burst is served ({ok} served)");
    assert!(limited > 0, "requests beyond the rate are refused");
    // The limit is per client: another one is served at once.
    let mut modest = Wire::connect(server.port(), "wire-modest").await;
    modest.expect(&[b"GET", b"rate-k"], b"$1\r\nv\r\n").await;
}

/// A client's pipelined SET then GET of a key run in that order on the router path too, where
/// each request waits in a task of its own (decision 0064): the GET reads the SET's value. Before
/// the fix a GET could reach the head first and answer nil (the flood test, on a chain of one).
#[tokio::test]
async fn pipelined_set_then_get_of_a_key_run_in_order_on_a_chain_of_one() {
    let server = common::Server::start_chain_of_one();
    let mut w = Wire::connect(server.port(), "wire-order").await;
    let mut sent = Vec::new();
    for i in 0..100 {
        let (key, value) = (format!("order/{i}"), format!("value-{i}"));
        let set = w
            .send(Req::new(&[b"SET", key.as_bytes(), value.as_bytes()]))
            .await;
        let get = w.send(Req::new(&[b"GET", key.as_bytes()])).await;
        sent.push((set, get, value));
    }
    for (set, get, value) in sent {
        assert_eq!(w.reply(&set).await.payload(), b"+OK\r\n");
        let got = w.reply(&get).await;
        assert_eq!(
            String::from_utf8_lossy(got.payload()),
            format!("${}\r\n{value}\r\n", value.len()),
            "the GET pipelined behind the SET of {value}"
        );
    }
}
