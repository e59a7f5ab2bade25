//! Robustness: flood the invoke topic with random payloads (seeded, bounded) interleaved with well-formed
//! requests. The server must stay up, answer every well-formed request correctly during the flood, and
//! still answer afterwards. Random payloads are biased towards almost-valid RESP to reach deep parser paths.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use common::state::{hlc, now_ms, resp};

const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
/// Fixed so that a failure reproduces; override with MQSTATE_FLOOD_SEED to explore.
const DEFAULT_SEED: u64 = 0x5EED_57A7_E570_4E00;
/// Random requests per run: enough to cover many parser paths, small enough for CI on 2 cores.
const FLOOD_REQUESTS: usize = 5_000;
/// One well-formed request (with a checked reply) after this many random ones.
const CHECK_EVERY: usize = 50;
/// Longest random payload.
const MAX_RANDOM_BYTES: usize = 512;
/// Hang guard for every wait, not a performance claim.
const WAIT: Duration = Duration::from_secs(10);
const RESPONSE_TOPIC: &str = "clients/flood/response";

struct Reply {
    correlation: Vec<u8>,
    payload: Vec<u8>,
    stat: Option<String>,
}

fn seed() -> u64 {
    std::env::var("MQSTATE_FLOOD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

const WORDS: &[&[u8]] = &[
    b"SET",
    b"GET",
    b"DEL",
    b"VDEL",
    b"KEYNOTIFY",
    b"SCAN",
    b"NX",
    b"NEX",
    b"PX",
    b"STOP",
    b"set",
    b"x",
];

/// A random payload: pure noise, a mutated valid request, or a request with random words and lengths.
fn random_payload(rng: &mut StdRng) -> Vec<u8> {
    match rng.gen_range(0..4) {
        0 => (0..rng.gen_range(0..MAX_RANDOM_BYTES))
            .map(|_| rng.gen())
            .collect(),
        1 => {
            let n = rng.gen_range(0..6);
            let args: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    if rng.gen_bool(0.6) {
                        WORDS[rng.gen_range(0..WORDS.len())].to_vec()
                    } else {
                        (0..rng.gen_range(0..16)).map(|_| rng.gen()).collect()
                    }
                })
                .collect();
            let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
            resp(&refs)
        }
        2 => {
            // A valid request with a few bytes flipped, inserted or cut.
            let key = format!("fuzz{}", rng.gen_range(0..8));
            let mut p = resp(&[b"SET", key.as_bytes(), b"value", b"PX", b"60000"]);
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..p.len());
                match rng.gen_range(0..3) {
                    0 => p[i] = rng.gen(),
                    1 => p.insert(i, rng.gen()),
                    _ => p.truncate(i),
                }
                if p.is_empty() {
                    break;
                }
            }
            p
        }
        _ => {
            // Lying headers: counts and lengths that overflow or disagree with the data.
            let lies: &[&[u8]] = &[
                b"*-1\r\n",
                b"*99999999999999999999\r\n$3\r\nGET\r\n",
                b"*2\r\n$-5\r\nGET\r\n",
                b"*2\r\n$3\r\nGET\r\n$4294967296\r\nk\r\n",
                b"*1\r\n$0\r\n\r\n",
                b"*0\r\n",
                b"*2\r\n*1\r\n$1\r\nk\r\n$1\r\nk\r\n",
            ];
            lies[rng.gen_range(0..lies.len())].to_vec()
        }
    }
}

/// A random request property set: sometimes a bad or missing `__ts`, sometimes a bad `__ft`.
fn random_properties(rng: &mut StdRng, correlation: Vec<u8>) -> PublishProperties {
    let mut props = PublishProperties {
        response_topic: Some(RESPONSE_TOPIC.into()),
        correlation_data: Some(Bytes::from(correlation)),
        message_expiry_interval: Some(3600),
        ..Default::default()
    };
    match rng.gen_range(0..5) {
        0 => {}
        1 => props
            .user_properties
            .push(("__ts".into(), "garbage".into())),
        2 => props
            .user_properties
            .push(("__ts".into(), hlc(now_ms() + 3_600_000, 0, "n"))),
        _ => props
            .user_properties
            .push(("__ts".into(), hlc(now_ms(), 0, "n"))),
    }
    if rng.gen_bool(0.1) {
        props
            .user_properties
            .push(("__ft".into(), "not:a:token:at:all".into()));
    }
    props
}

fn valid_props(correlation: Vec<u8>) -> PublishProperties {
    PublishProperties {
        response_topic: Some(RESPONSE_TOPIC.into()),
        correlation_data: Some(Bytes::from(correlation)),
        message_expiry_interval: Some(3600),
        content_type: Some("application/octet-stream".into()),
        user_properties: vec![("__ts".into(), hlc(now_ms(), 0, "flood"))],
        ..Default::default()
    }
}

/// Connects, subscribes to [`RESPONSE_TOPIC`] and forwards every reply (or the connection's loss).
async fn connect(
    port: u16,
    client_id: &str,
) -> (
    AsyncClient,
    mpsc::UnboundedReceiver<Result<Reply, String>>,
    JoinHandle<()>,
) {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options.set_request_channel_capacity(256);
    let (client, mut eventloop) = AsyncClient::new(options, 256);
    let (tx, replies) = mpsc::unbounded_channel::<Result<Reply, String>>();
    let pump = tokio::spawn(async move {
        loop {
            let reply = match eventloop.poll().await {
                // Random KEYNOTIFY/SET pairs may produce notifications; only replies matter here.
                Ok(Event::Incoming(Packet::Publish(p))) if p.topic == RESPONSE_TOPIC.as_bytes() => {
                    let props = p.properties.unwrap_or_default();
                    let stat = props
                        .user_properties
                        .iter()
                        .find(|(k, _)| k == "__stat")
                        .map(|(_, v)| v.clone());
                    let correlation = props
                        .correlation_data
                        .map(|c| c.to_vec())
                        .unwrap_or_default();
                    Ok(Reply {
                        correlation,
                        payload: p.payload.to_vec(),
                        stat,
                    })
                }
                Ok(_) => continue,
                Err(e) => Err(format!("connection to the server lost: {e}")),
            };
            let failed = reply.is_err();
            if tx.send(reply).is_err() || failed {
                return;
            }
        }
    });
    client
        .subscribe(RESPONSE_TOPIC, QoS::AtLeastOnce)
        .await
        .unwrap();
    (client, replies, pump)
}

/// A client that pipelines more requests than its session's outbound queue holds, while reading
/// replies all along, must still get every reply: the queue limit may slow the requester down (stop
/// reading its requests) but must not silently drop the answers it owes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn pipelined_burst_beyond_the_session_queue_gets_every_reply() {
    const QUEUE: usize = 100;
    const BURST: usize = 20 * QUEUE;
    let server = common::Server::start_with(&["--max-queued-messages", &QUEUE.to_string()]);
    let (client, mut replies, pump) = connect(server.port(), "burst").await;
    let value = vec![b'v'; 4_096];
    let set = resp(&[b"SET", b"k", &value]);
    client
        .publish_with_properties(
            INVOKE_TOPIC,
            QoS::AtLeastOnce,
            false,
            set,
            valid_props(b"set".to_vec()),
        )
        .await
        .unwrap();
    let mut outstanding: BTreeMap<Vec<u8>, ()> = BTreeMap::new();
    outstanding.insert(b"set".to_vec(), ());
    for i in 0..BURST {
        let correlation = (i as u64).to_be_bytes().to_vec();
        outstanding.insert(correlation.clone(), ());
        client
            .publish_with_properties(
                INVOKE_TOPIC,
                QoS::AtLeastOnce,
                false,
                resp(&[b"GET", b"k"]),
                valid_props(correlation),
            )
            .await
            .unwrap();
    }
    let want = [
        format!("${}\r\n", value.len()).into_bytes(),
        value,
        b"\r\n".to_vec(),
    ]
    .concat();
    while !outstanding.is_empty() {
        let reply = tokio::time::timeout(WAIT, replies.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} of {} replies never arrived (session queue {QUEUE}): replies were dropped",
                    outstanding.len(),
                    BURST + 1
                )
            })
            .expect("reply channel open")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            outstanding.remove(&reply.correlation).is_some(),
            "duplicate reply {:?}",
            reply.correlation
        );
        assert_eq!(reply.stat.as_deref(), Some("200"));
        if reply.correlation != b"set" {
            assert!(
                reply.payload == want,
                "GET answered {} bytes, not the value",
                reply.payload.len()
            );
        }
    }
    pump.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]

async fn random_payload_flood_keeps_the_server_answering() {
    let server = common::Server::start();
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);

    let (client, mut replies, pump) = connect(server.port(), "flood").await;

    // Correlation ids: random requests are tagged 'R', checked ones 'C'; expected replies per checked id.
    let mut expected: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    // Unanswered random requests: correlation -> what was sent, for the failure message.
    let mut random_outstanding: BTreeMap<Vec<u8>, String> = BTreeMap::new();
    let mut first_checked: Option<(String, String)> = None;
    for i in 0..FLOOD_REQUESTS {
        let correlation = [b"R".as_slice(), &(i as u64).to_be_bytes()].concat();
        let payload = random_payload(&mut rng);
        let props = random_properties(&mut rng, correlation.clone());
        random_outstanding.insert(
            correlation,
            format!(
                "#{i}: {:?} {:?}",
                String::from_utf8_lossy(&payload),
                props.user_properties
            ),
        );
        client
            .publish_with_properties(INVOKE_TOPIC, QoS::AtLeastOnce, false, payload, props)
            .await
            .unwrap();

        if i % CHECK_EVERY == 0 {
            // A SET of a fresh key then a GET of it: both replies are fully determined.
            let n = i / CHECK_EVERY;
            let key = format!("checked/{n}");
            let value = format!("value-{n}-{}", rng.gen::<u32>());
            first_checked.get_or_insert_with(|| (key.clone(), value.clone()));
            for (tag, payload, reply) in [
                (
                    b'S',
                    resp(&[b"SET", key.as_bytes(), value.as_bytes()]),
                    b"+OK\r\n".to_vec(),
                ),
                (
                    b'G',
                    resp(&[b"GET", key.as_bytes()]),
                    [format!("${}\r\n{value}\r\n", value.len()).into_bytes()].concat(),
                ),
            ] {
                let correlation = [&[b'C', tag][..], &(n as u64).to_be_bytes()].concat();
                expected.insert(correlation.clone(), reply);
                client
                    .publish_with_properties(
                        INVOKE_TOPIC,
                        QoS::AtLeastOnce,
                        false,
                        payload,
                        valid_props(correlation),
                    )
                    .await
                    .unwrap();
            }
        }
    }

    // Every random request with a correlation gets exactly one reply with __stat; every checked one the
    // exact payload. Collect until every request has been answered.
    let mut outstanding = expected.clone();
    while !random_outstanding.is_empty() || !outstanding.is_empty() {
        let Reply { correlation, payload, stat } = tokio::time::timeout(WAIT, replies.recv())
            .await
            .unwrap_or_else(|_| {
                let first: Vec<&String> = random_outstanding.values().take(5).collect();
                panic!(
                    "seed {seed}: server stopped answering: {} random and {} checked requests unanswered; \
                     first unanswered: {first:#?}",
                    random_outstanding.len(),
                    outstanding.len()
                )
            })
            .expect("reply channel open")
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        match correlation.first() {
            Some(b'R') => {
                assert!(
                    random_outstanding.remove(&correlation).is_some(),
                    "seed {seed}: duplicate reply for random request {correlation:?}"
                );
                // Every state-store response carries __stat 200, -ERR replies included (spec §1).
                assert_eq!(
                    stat.as_deref(),
                    Some("200"),
                    "seed {seed}: reply {payload:?}"
                );
            }
            Some(b'C') => {
                let want = outstanding.remove(&correlation).unwrap_or_else(|| {
                    panic!("seed {seed}: duplicate or unknown reply for checked request {correlation:?}")
                });
                assert_eq!(
                    stat.as_deref(),
                    Some("200"),
                    "seed {seed}: checked request {correlation:?}"
                );
                assert_eq!(
                    Bytes::from(payload),
                    Bytes::from(want),
                    "seed {seed}: checked request {correlation:?} answered wrongly during the flood"
                );
            }
            _ => panic!("seed {seed}: reply with unexpected correlation {correlation:?}"),
        }
    }

    // Afterwards, a fresh client is served normally.
    let (after_tx, mut after_rx) = mpsc::unbounded_channel();
    let mut options = MqttOptions::new("flood-after", "127.0.0.1", server.port());
    options.set_request_channel_capacity(16);
    let (after, mut after_loop) = AsyncClient::new(options, 16);
    tokio::spawn(async move {
        while let Ok(event) = after_loop.poll().await {
            if let Event::Incoming(Packet::Publish(p)) = event {
                if after_tx.send(p.payload.to_vec()).is_err() {
                    return;
                }
            }
        }
    });
    after
        .subscribe(RESPONSE_TOPIC, QoS::AtLeastOnce)
        .await
        .unwrap();
    let (key, value) = first_checked.expect("at least one checked request");
    after
        .publish_with_properties(
            INVOKE_TOPIC,
            QoS::AtLeastOnce,
            false,
            resp(&[b"GET", key.as_bytes()]),
            valid_props(b"after".to_vec()),
        )
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, after_rx.recv())
        .await
        .expect("reply after the flood")
        .unwrap();
    assert_eq!(
        Bytes::from(got),
        Bytes::from(format!("${}\r\n{value}\r\n", value.len())),
        "seed {seed}: GET {key} after the flood"
    );
    pump.abort();
}
