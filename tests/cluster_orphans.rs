//! Sessions whose node died are adopted (issue 16, decision 0054 "Orphaned sessions"), on three
//! real `mqstate serve` processes with a raw MQTT 5 client (Session Present and reason codes
//! packet by packet). Node 1 is killed with `kill -9` while four persistent sessions are
//! connected to it:
//!
//! * the wills of its clients — one without a delay, one with — reach a subscriber on node 2
//!   (the head of each session's partition adopts it once node 1's lease lapsed, and publishes the
//!   will that the row kept since CONNECT);
//! * a session with a short expiry expires on its adopter: a reconnect finds no session
//!   (Session Present = 0);
//! * a session with a long expiry, once adopted, has what is published for it meanwhile queued
//!   (each QoS 1 publish acknowledged 0x00), and its client reconnecting to node 3 gets it with
//!   Session Present = 1;
//! * a state-store observer (KEYNOTIFY) is registered again on the adopter: a change made after
//!   the adoption, while its client is away, is queued and reaches it on node 3.
//!
//! (Without adoption, no will comes, the short session is resumed with Session Present = 1, and
//! what was published after node 1's death matched nothing and is not delivered.)
//!
//! State-store observers keep every notification across their node's death (decision 0065):
//! the changes of their keys committed after node 1 died and before their session was adopted or
//! taken over reach them, in order, once each, whether the client comes back on another node
//! before the adoption or after it (the adopter queued them).
//!
//! And retained messages cleared or replaced while a node was down (decision 0057): after its
//! restart it holds neither the cleared message nor the replaced one, and does not bring them
//! back to the others.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use std::collections::BTreeMap;

use rumqttc::v5::mqttbytes::v5::{LastWill, LastWillProperties, Packet, PingReq, PubAck, Publish};
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::three_nodes;
use common::mqtt::Raw;
use common::state::{hlc_now, request_properties, set_note, StateClient, INVOKE_TOPIC, OK};

/// Hang guard of every wait (fail-over, adoption, expiry): generous, the machine is shared.
const WAIT: Duration = Duration::from_secs(120);

/// [`Raw::accept_within`] [`WAIT`].
async fn accepted(
    addr: SocketAddr,
    id: &str,
    clean_start: bool,
    expiry: u32,
    will: Option<LastWill>,
) -> (Raw, bool) {
    Raw::accept_within(addr, id, clean_start, expiry, will, WAIT).await
}

/// The will of `id`: on `will/<id>`, QoS 1, after `delay` seconds.
fn will_of(id: &str, delay: u32) -> Option<LastWill> {
    let properties = LastWillProperties {
        delay_interval: Some(delay),
        payload_format_indicator: None,
        message_expiry_interval: None,
        content_type: None,
        response_topic: None,
        correlation_data: None,
        user_properties: Vec::new(),
    };
    Some(LastWill::new(
        format!("will/{id}"),
        Bytes::from_static(b"gone"),
        QoS::AtLeastOnce,
        false,
        Some(properties),
    ))
}

/// Waits for the next will published to `watcher` (acknowledged); its topic.
async fn next_will(watcher: &mut Raw) -> String {
    loop {
        match watcher.recv().await {
            Packet::Publish(p) => {
                if p.qos == QoS::AtLeastOnce {
                    watcher
                        .send(Packet::PubAck(PubAck::new(p.pkid, None)))
                        .await;
                }
                return String::from_utf8_lossy(&p.topic).into_owned();
            }
            Packet::PingResp(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// `observer` (subscribed to its response topic) sends KEYNOTIFY `key` and waits for `+OK`.
async fn keynotify(observer: &mut Raw, id: &str, key: &[u8]) {
    let response_topic = format!("clients/{id}/statestore/response");
    observer.subscribe(&response_topic, QoS::AtLeastOnce).await;
    // One per key: a request with the same correlation data would be answered from the
    // duplicate cache without being executed.
    let correlation = Bytes::from([b"keynotify-", key].concat());
    let properties = request_properties(&response_topic, &correlation, hlc_now());
    let mut p = Publish::new(
        INVOKE_TOPIC,
        QoS::AtLeastOnce,
        mqstate_protocol::encode_request(&[b"KEYNOTIFY", key]),
        Some(properties),
    );
    p.pkid = observer.pkid();
    observer.send(Packet::Publish(p)).await;
    loop {
        match observer.recv().await {
            Packet::Publish(reply) => {
                if reply.qos == QoS::AtLeastOnce {
                    observer
                        .send(Packet::PubAck(PubAck::new(reply.pkid, None)))
                        .await;
                }
                assert_eq!(&reply.payload[..], OK, "KEYNOTIFY answered");
                return;
            }
            Packet::PubAck(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_of_a_dead_node_are_adopted_with_wills_expiry_and_queues() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();

    let (mut watcher, _) = accepted(n2, "will-watcher", true, 0, None).await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;

    // Four persistent sessions connected to node 1 when it dies.
    let (at_once, _) = accepted(n1, "will-now", false, 3600, will_of("will-now", 0)).await;
    let (delayed, _) = accepted(n1, "will-later", false, 3600, will_of("will-later", 2)).await;
    // Its will (delay 1 s) tells when it was adopted.
    let (mut long, present) =
        accepted(n1, "orphan-long", false, 3600, will_of("orphan-long", 1)).await;
    assert!(!present);
    long.subscribe("o/long", QoS::AtLeastOnce).await;
    // Expires 5 s after its adoption; its will (delay above the expiry) goes with it.
    let (short, _) = accepted(n1, "orphan-short", false, 5, will_of("orphan-short", 3600)).await;
    // A state-store observer; its will tells when it was adopted.
    let (mut observer, _) = accepted(
        n1,
        "orphan-observer",
        false,
        3600,
        will_of("orphan-observer", 0),
    )
    .await;
    keynotify(&mut observer, "orphan-observer", b"orphan/k").await;
    let mut writer = StateClient::connect(n2, "orphan-writer").await;

    let (mut publisher, _) = accepted(n2, "orphan-publisher", true, 0, None).await;
    assert_eq!(
        publisher
            .publish("o/long", QoS::AtLeastOnce, "before")
            .await,
        0x00,
        "routed to the session on node 1 and stored in its row"
    );

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop((at_once, delayed, long, short, observer));
    let killed = Instant::now();

    let mut wills = BTreeSet::new();
    let mut want = BTreeSet::from(["before".to_owned()]);
    let everyone: BTreeSet<String> = [
        "will-now",
        "will-later",
        "orphan-long",
        "orphan-short",
        "orphan-observer",
    ]
    .iter()
    .map(|id| format!("will/{id}"))
    .collect();
    while wills != everyone {
        assert!(
            killed.elapsed() < WAIT,
            "wills after {WAIT:?}: {wills:?}, not {everyone:?}"
        );
        let will = next_will(&mut watcher).await;
        eprintln!("{will} {:?} after kill -9 of node 1", killed.elapsed());
        if will == "will/orphan-long" {
            // Adopted: what is published for it from now on is queued for it.
            for i in 0..3 {
                let payload = format!("after-adoption-{i}");
                assert_eq!(
                    publisher
                        .publish("o/long", QoS::AtLeastOnce, &payload)
                        .await,
                    0x00
                );
                want.insert(payload);
            }
        }
        if will == "will/orphan-observer" {
            // Adopted, its registration in force on the adopter: the change is queued for it.
            assert_eq!(
                &writer.request(&[b"SET", b"orphan/k", b"after"]).await[..],
                OK
            );
        }
        wills.insert(will);
    }

    // The short session expired on its adopter.
    let (short, present) = accepted(n3, "orphan-short", false, 5, None).await;
    assert!(!present, "the short session expired: Session Present = 0");
    short.disconnect().await;

    // The long one comes back on node 3 with everything queued for it.
    let (mut long, present) = accepted(n3, "orphan-long", false, 3600, None).await;
    assert!(present, "Session Present = 1 after adoption");
    let received = long.receive_all(&want).await;
    eprintln!("received on node 3: {:?}", received.received);
    long.disconnect().await;

    // The observer comes back on node 3: the change made after the adoption is there.
    let (mut observer, present) = accepted(n3, "orphan-observer", false, 3600, None).await;
    assert!(present);
    loop {
        let p = match observer.recv().await {
            Packet::Publish(p) => p,
            other => panic!("unexpected {other:?}"),
        };
        if p.qos == QoS::AtLeastOnce {
            observer
                .send(Packet::PubAck(PubAck::new(p.pkid, None)))
                .await;
        }
        let topic = String::from_utf8_lossy(&p.topic).into_owned();
        if topic.contains("/command/notify/") {
            assert_eq!(
                p.payload.to_vec(),
                set_note(b"after"),
                "notified on {topic}"
            );
            break;
        }
    }
    drop((publisher, watcher, writer));
}

/// Publishes `payload` retained at QoS 1 (empty: clears the topic) and waits for the PUBACK.
async fn retain(c: &mut Raw, topic: &str, payload: &str) {
    let mut p = Publish::new(
        topic,
        QoS::AtLeastOnce,
        Bytes::from(payload.to_owned()),
        None,
    );
    p.retain = true;
    p.pkid = c.pkid();
    let pkid = p.pkid;
    c.send(Packet::Publish(p)).await;
    match c.recv().await {
        Packet::PubAck(ack) if ack.pkid == pkid => {}
        other => panic!("expected PUBACK {pkid}, got {other:?}"),
    }
}

/// The retained messages a new subscriber to `r/#` on `addr` gets: topic → payload (they come
/// in topic order, before the answer to a ping sent after the SUBACK).
async fn retained_at(addr: SocketAddr, id: &str) -> BTreeMap<String, String> {
    let (mut c, _) = accepted(addr, id, true, 0, None).await;
    c.subscribe("r/#", QoS::AtMostOnce).await;
    c.send(Packet::PingReq(PingReq)).await;
    let mut got = BTreeMap::new();
    loop {
        match c.recv().await {
            Packet::PingResp(_) => break,
            Packet::Publish(p) => {
                got.insert(
                    String::from_utf8_lossy(&p.topic).into_owned(),
                    String::from_utf8_lossy(&p.payload).into_owned(),
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    c.disconnect().await;
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_clears_and_replacements_reach_a_node_that_was_down() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let (mut publisher, _) = accepted(n1, "retainer", true, 0, None).await;
    // Node 3 holds both messages (the nodes' mesh forms in the background: publish again
    // until it does).
    let both = BTreeMap::from([
        ("r/replaced".to_owned(), "v1".to_owned()),
        ("r/stale".to_owned(), "v1".to_owned()),
    ]);
    let started = Instant::now();
    for attempt in 0.. {
        retain(&mut publisher, "r/stale", "v1").await;
        retain(&mut publisher, "r/replaced", "v1").await;
        if retained_at(n3, &format!("r-before-{attempt}")).await == both {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "node 3 never got the retained messages"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    tokio::task::block_in_place(|| nodes[2].server.kill9());
    // While node 3 is down: one cleared, one replaced, and a marker (last in topic order) that
    // tells when node 3 took in the others' retained sets.
    retain(&mut publisher, "r/stale", "").await;
    retain(&mut publisher, "r/replaced", "v2").await;
    retain(&mut publisher, "r/zz-marker", "m").await;
    tokio::task::block_in_place(|| nodes[2].server.restart());

    let expected = BTreeMap::from([
        ("r/replaced".to_owned(), "v2".to_owned()),
        ("r/zz-marker".to_owned(), "m".to_owned()),
    ]);
    let restarted = Instant::now();
    for attempt in 0.. {
        let got = retained_at(n3, &format!("r-after-{attempt}")).await;
        if got.contains_key("r/zz-marker") {
            assert_eq!(got, expected, "node 3 after its restart");
            eprintln!(
                "node 3 learned the retained set {:?} after its restart",
                restarted.elapsed()
            );
            break;
        }
        assert!(
            restarted.elapsed() < WAIT,
            "node 3 never learned the retained set: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Node 3's own stream reached node 1 (its resync first, then this route): what node 3 held
    // before did not come back on the others.
    let (mut probe, _) = accepted(n3, "r-probe", true, 0, None).await;
    probe.subscribe("probe3", QoS::AtMostOnce).await;
    let started = Instant::now();
    loop {
        let mut p = Publish::new("probe3", QoS::AtMostOnce, Bytes::from_static(b"p"), None);
        p.pkid = 0;
        publisher.send(Packet::Publish(p)).await;
        let heard = tokio::time::timeout(Duration::from_millis(300), probe.recv()).await;
        if let Ok(Packet::Publish(_)) = heard {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "node 3's routes never reached node 1"
        );
    }
    assert_eq!(retained_at(n1, "r-check-1").await, expected, "node 1");
    assert_eq!(retained_at(n2, "r-check-2").await, expected, "node 2");
    drop((probe, publisher));
}

/// Publishes `<prefix>0`, `<prefix>1`, … at QoS 1 on `held/t`, each awaiting its PUBACK, until 5 s
/// after `since` (at least 20); the client, how many, and those acknowledged 0x00.
async fn publish_sequence(
    mut publisher: Raw,
    prefix: String,
    since: Instant,
) -> (Raw, usize, Vec<String>) {
    let mut ok = Vec::new();
    let mut i = 0;
    while since.elapsed() < Duration::from_secs(5) || i < 20 {
        assert!(since.elapsed() < WAIT, "publishing for {WAIT:?}");
        let payload = format!("{prefix}{i}");
        let code = publisher
            .publish("held/t", QoS::AtLeastOnce, &payload)
            .await;
        assert!(
            code == 0x00 || code == 0x10,
            "PUBACK of {payload}: reason {code:#04x}"
        );
        if code == 0x00 {
            ok.push(payload);
        }
        i += 1;
    }
    (publisher, i, ok)
}

/// Issue 16: what a publisher got PUBACK 0x00 for is not lost for a persistent session whose
/// node died, though it was published before that session was adopted (decision 0057, "held
/// publishes"). A subscriber on node 1 disconnects, node 1 is killed, and a publisher on node 2
/// publishes a numbered sequence of QoS 1 messages at once, for ~5 s, each awaiting its PUBACK
/// (four more join it 0.25 s apart);
/// the subscriber, back on node 3 once its session was adopted, gets every message acknowledged
/// 0x00 (duplicates allowed at QoS 1). (Before: those published until node 2 skipped node 1 were
/// forwarded to the dead node and acknowledged; the next ones, until the adoption, matched
/// nothing; both lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_acknowledged_while_a_dead_nodes_session_awaits_adoption_are_not_lost() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();

    let (mut subscriber, present) = accepted(n1, "held-sub", false, 3600, None).await;
    assert!(!present);
    subscriber.subscribe("held/t", QoS::AtLeastOnce).await;
    subscriber.disconnect().await;
    let (mut publisher, _) = accepted(n2, "held-pub", true, 0, None).await;
    assert_eq!(
        publisher
            .publish("held/t", QoS::AtLeastOnce, "before")
            .await,
        0x00
    );
    let mut acked = BTreeSet::from(["before".to_owned()]);

    // Four more publishers starting 0.25 s apart, so that some publish while node 2 still
    // forwards to node 1 and others after it skipped node 1 but before the adoption.
    let mut others = Vec::new();
    for k in 0..4 {
        others.push(
            accepted(n2, &format!("held-pub-{k}"), true, 0, None)
                .await
                .0,
        );
    }

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    let killed = Instant::now();
    let mut tasks = vec![tokio::spawn(publish_sequence(
        publisher,
        "m".to_owned(),
        killed,
    ))];
    for (k, publisher) in others.into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(250)).await;
        tasks.push(tokio::spawn(publish_sequence(
            publisher,
            format!("p{k}-"),
            killed,
        )));
    }
    let mut published = 0;
    let mut publisher = None;
    for task in tasks {
        let (client, count, ok) = task.await.expect("publisher task");
        published += count;
        acked.extend(ok);
        publisher.get_or_insert(client);
    }
    let mut publisher = publisher.expect("a publisher");
    eprintln!(
        "{published} published in {:?} after kill -9, {} acknowledged 0x00",
        killed.elapsed(),
        acked.len() - 1
    );

    // Back on node 3 once adopted (Session Present = 1).
    let mut subscriber = loop {
        assert!(
            killed.elapsed() < WAIT,
            "held-sub not adopted after {WAIT:?}"
        );
        let (client, present) = accepted(n3, "held-sub", false, 3600, None).await;
        if present {
            break client;
        }
        client.disconnect().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A last message after the reconnect: queued behind whatever was queued for the session, so
    // once it arrives nothing queued is still coming.
    assert_eq!(
        publisher.publish("held/t", QoS::AtLeastOnce, "end").await,
        0x00
    );
    let mut got = BTreeSet::new();
    let mut copies = 0;
    loop {
        let p = subscriber.next_publish().await;
        if p.qos == QoS::AtLeastOnce {
            subscriber
                .send(Packet::PubAck(PubAck::new(p.pkid, None)))
                .await;
        }
        let payload = String::from_utf8_lossy(&p.payload).into_owned();
        if payload == "end" {
            break;
        }
        copies += 1;
        got.insert(payload);
    }
    let lost: Vec<&String> = acked.difference(&got).collect();
    eprintln!(
        "received {} messages ({copies} copies) of {} acknowledged",
        got.len(),
        acked.len()
    );
    assert!(
        lost.is_empty(),
        "{} acknowledged 0x00 and lost, among them {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    subscriber.disconnect().await;
    drop(publisher);
}

/// The observed keys of the tests below: some of their partitions are headed by node 1, some not.
const OBSERVED: [&str; 4] = ["moved/a", "moved/b", "moved/c", "moved/d"];

/// SETs every observed key to `value` through `writer`.
async fn set_all(writer: &mut StateClient, value: &str) {
    for key in OBSERVED {
        assert_eq!(
            &writer
                .request(&[b"SET", key.as_bytes(), value.as_bytes()])
                .await[..],
            OK,
            "SET {key} {value}"
        );
    }
}

/// `id`'s persistent session, taken over on `addr` (tried again while the cluster fails over).
async fn resumed(addr: SocketAddr, id: &str) -> StateClient {
    let started = Instant::now();
    loop {
        match StateClient::try_connect_persistent(addr, id).await {
            Ok(client) => return client,
            Err(e) => {
                assert!(started.elapsed() < WAIT, "{id} not resumed on {addr}: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// The key a notification's topic names (upper-case hex after `/command/notify/`).
fn key_of(topic: &[u8]) -> String {
    let topic = String::from_utf8_lossy(topic);
    let (_, hex) = topic
        .split_once("/command/notify/")
        .expect("a notification topic");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    String::from_utf8(bytes).expect("a text key")
}

/// The value a SET notification carries (its last bulk string).
fn value_of(payload: &[u8]) -> String {
    assert!(
        payload.starts_with(b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n"),
        "a SET notification"
    );
    let text = String::from_utf8_lossy(payload);
    let parts: Vec<&str> = text.split("\r\n").collect();
    parts[parts.len() - 2].to_owned()
}

/// `observer`'s notifications until every observed key was set to `end` (a final SET that
/// follows all the others): each key's values, in the order received.
async fn values_until_end(observer: &mut StateClient) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while OBSERVED
        .iter()
        .any(|key| seen.get(*key).and_then(|v| v.last()).map(String::as_str) != Some("end"))
    {
        let note = observer.next_notification(WAIT).await;
        seen.entry(key_of(&note.topic))
            .or_default()
            .push(value_of(&note.payload));
    }
    seen
}

/// Each observed key's expected values: `rounds` SETs (`r1`, `r2`, …), then `end`.
fn every_round(rounds: usize) -> BTreeMap<String, Vec<String>> {
    OBSERVED
        .iter()
        .map(|key| {
            let mut values: Vec<String> = (1..=rounds).map(|r| format!("r{r}")).collect();
            values.push("end".to_owned());
            (key.to_string(), values)
        })
        .collect()
}

/// Issue 16: "State-store observers (KEYNOTIFY) keep their registrations and receive every
/// notification when they reconnect to another node after their node died." The observer's node
/// is killed; a writer on node 2 sets its keys four times at once (before the session is adopted
/// or taken over: one key was set before the KEYNOTIFY, the others never); the observer comes
/// back on node 3 and gets every change, in order, once. (Before decision 0065 the changes made
/// before the adoption or take-over were not delivered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_back_on_another_node_gets_what_was_changed_while_its_node_was_dead() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let mut writer = StateClient::connect(n2, "moved-writer").await;
    assert_eq!(
        &writer
            .request(&[b"SET", OBSERVED[0].as_bytes(), b"r0"])
            .await[..],
        OK
    );
    let mut observer = resumed(n1, "moved-observer").await;
    for key in OBSERVED {
        assert_eq!(
            &observer.request(&[b"KEYNOTIFY", key.as_bytes()]).await[..],
            OK
        );
    }

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop(observer);
    for round in 1..=4 {
        set_all(&mut writer, &format!("r{round}")).await;
    }

    let mut observer = resumed(n3, "moved-observer").await;
    assert!(observer.session_present, "its session came along");
    set_all(&mut writer, "end").await;
    assert_eq!(values_until_end(&mut observer).await, every_round(4));
}

/// The same, with the session adopted while its client is away: the adopter queues the changes
/// made before the adoption (caught up from the replicas' trails) ahead of those made after it,
/// and the client coming back on node 3 gets each once (the cursor moved with what was queued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_observer_is_queued_what_was_changed_before_its_adoption() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let (mut watcher, _) = accepted(n2, "adopted-watcher", true, 0, None).await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;
    let mut writer = StateClient::connect(n2, "adopted-writer").await;
    // Its will (no delay) tells when it was adopted.
    let id = "adopted-observer";
    let (mut observer, _) = accepted(n1, id, false, 3600, will_of(id, 0)).await;
    for key in OBSERVED {
        keynotify(&mut observer, id, key.as_bytes()).await;
    }

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop(observer);
    for round in 1..=3 {
        set_all(&mut writer, &format!("r{round}")).await;
    }
    assert_eq!(next_will(&mut watcher).await, format!("will/{id}"));
    for round in 4..=5 {
        set_all(&mut writer, &format!("r{round}")).await;
    }

    let mut observer = resumed(n3, id).await;
    assert!(observer.session_present);
    set_all(&mut writer, "end").await;
    assert_eq!(values_until_end(&mut observer).await, every_round(5));
}
