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
//! And retained messages cleared or replaced while a node was down (decisions 0057, 0072): after
//! its restart its first subscriber gets neither the cleared message nor the replaced one, and it
//! does not bring them back to the others.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAck, Publish};
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::{
    accepted, adopted, nothing_lost, publish_for_a_while, retain_until_held, retained_at,
    route_heard, three_nodes, will_watcher, FAILOVER_WAIT,
};
use common::mqtt::{will_of, Raw};
use common::state::{hlc_now, request_properties, set_note, StateClient, INVOKE_TOPIC, OK};

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

    let mut watcher = will_watcher(n2, "will-watcher").await;

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
            killed.elapsed() < FAILOVER_WAIT,
            "wills after {FAILOVER_WAIT:?}: {wills:?}, not {everyone:?}"
        );
        let will = watcher.next_topic().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_clears_and_replacements_reach_a_node_that_was_down() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let (mut publisher, _) = accepted(n1, "retainer", true, 0, None).await;
    // Node 3 holds both messages.
    retain_until_held(
        &mut publisher,
        &[("r/stale", "v1"), ("r/replaced", "v1")],
        n3,
    )
    .await;

    tokio::task::block_in_place(|| nodes[2].server.kill9());
    // While node 3 is down: one cleared, one replaced, and a marker (last in topic order) that
    // tells when node 3 took in the others' retained sets.
    publisher.retain("r/stale", "").await;
    publisher.retain("r/replaced", "v2").await;
    publisher.retain("r/zz-marker", "m").await;
    tokio::task::block_in_place(|| nodes[2].server.restart());

    let expected = BTreeMap::from([
        ("r/replaced".to_owned(), "v2".to_owned()),
        ("r/zz-marker".to_owned(), "m".to_owned()),
    ]);
    // The first subscriber on node 3 after its restart gets the cluster's set: node 3 serves
    // retained messages once the others' resyncs are in (decision 0072), never the cleared one.
    let restarted = Instant::now();
    assert_eq!(
        retained_at(n3, "r-after").await,
        expected,
        "node 3 after its restart"
    );
    eprintln!(
        "node 3 served the retained set {:?} after its restart",
        restarted.elapsed()
    );

    // Node 3's own stream reached node 1 (its resync first, then this route): what node 3 held
    // before did not come back on the others.
    let probe = route_heard(&mut publisher, n3).await;
    assert_eq!(retained_at(n1, "r-check-1").await, expected, "node 1");
    assert_eq!(retained_at(n2, "r-check-2").await, expected, "node 2");
    drop((probe, publisher));
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
    let mut publishers = vec![publisher];
    for k in 0..4 {
        publishers.push(
            accepted(n2, &format!("held-pub-{k}"), true, 0, None)
                .await
                .0,
        );
    }

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    let killed = Instant::now();
    let (after_kill, mut publisher) =
        publish_for_a_while(publishers, "held/t", QoS::AtLeastOnce, killed, 20).await;
    acked.extend(after_kill);

    // Back on node 3 once adopted (Session Present = 1).
    let mut subscriber = adopted(n3, "held-sub", killed).await;
    // A last message after the reconnect: queued behind whatever was queued for the session, so
    // once it arrives nothing queued is still coming.
    assert_eq!(
        publisher.publish("held/t", QoS::AtLeastOnce, "end").await,
        0x00
    );
    let mut received = Vec::new();
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
        received.push(payload);
    }
    nothing_lost(&acked, &received);
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
                assert!(
                    started.elapsed() < FAILOVER_WAIT,
                    "{id} not resumed on {addr}: {e}"
                );
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
        let note = observer.next_notification(FAILOVER_WAIT).await;
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
    let mut watcher = will_watcher(n2, "adopted-watcher").await;
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
    assert_eq!(watcher.next_topic().await, format!("will/{id}"));
    for round in 4..=5 {
        set_all(&mut writer, &format!("r{round}")).await;
    }

    let mut observer = resumed(n3, id).await;
    assert!(observer.session_present);
    set_all(&mut writer, "end").await;
    assert_eq!(values_until_end(&mut observer).await, every_round(5));
}
