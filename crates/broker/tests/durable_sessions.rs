//! Durable sessions through the journal port, with an in-memory journal: what is recorded, when
//! acknowledgements wait for it, and what a broker restored from it gives back.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use mqstate_broker::persist::{decode_changes, encode_changes};
use mqstate_broker::{
    Broker, BrokerConfig, BrokerError, Durable, JournalError, Restored, SessionChange,
    SessionJournal,
};
use mqstate_clock::OffsetClock;
use rmqtt_codec::v5::{self, Packet};
use tokio::sync::watch;

/// Records every change (through the binary encoding) and resolves `Durable` only while open.
struct MemoryJournal {
    changes: Mutex<Vec<SessionChange>>,
    open: watch::Sender<bool>,
    /// While set, every record fails (after being kept: a change may land though its writer
    /// reported a failure).
    failing: std::sync::atomic::AtomicBool,
}

impl MemoryJournal {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            changes: Mutex::new(Vec::new()),
            open: watch::Sender::new(true),
            failing: Default::default(),
        })
    }

    fn set_failing(&self, failing: bool) {
        self.failing
            .store(failing, std::sync::atomic::Ordering::Relaxed);
    }

    fn set_open(&self, open: bool) {
        self.open.send_replace(open);
    }

    fn replay(&self) -> Restored {
        let mut restored = Restored::default();
        for change in self.changes.lock().unwrap().iter().cloned() {
            restored.apply(change);
        }
        restored
    }
}

impl SessionJournal for MemoryJournal {
    fn record(&self, changes: Vec<SessionChange>) -> Durable {
        let decoded = decode_changes(&encode_changes(&changes)).expect("round trip");
        assert_eq!(decoded, changes);
        self.changes.lock().unwrap().extend(decoded);
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Box::pin(async { Err(JournalError("the disk failed".into())) });
        }
        let mut open = self.open.subscribe();
        Box::pin(async move {
            open.wait_for(|open| *open)
                .await
                .map(drop)
                .map_err(|_| JournalError("journal dropped".into()))
        })
    }
}

async fn journalled(journal: &Arc<MemoryJournal>) -> Server {
    Server::serve(
        Broker::builder(BrokerConfig::default())
            .journal(journal.clone())
            .build(),
    )
    .await
}

#[tokio::test]
async fn puback_waits_until_the_queued_message_is_durable() {
    let journal = MemoryJournal::new();
    let s = journalled(&journal).await;
    let (mut sub, ack) = Raw::connect(s.addr, "durable", false, 600).await;
    assert!(!ack.session_present);
    sub.subscribe("d/#", 1).await;
    sub.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    // A clean session's subscription is not journalled and does not hold anything up.
    let (mut clean, _) = Raw::connect(s.addr, "clean", true, 0).await;
    clean.subscribe("c/#", 1).await;

    journal.set_open(false);
    let (mut publisher, _) = Raw::connect(s.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("c/x", b"fast", 1).await, 0);
    publisher.publish("d/x", b"durable", 1, 2, false).await;
    let before = publisher.ping().await;
    assert!(
        before.is_empty(),
        "PUBACK sent before the queued message was durable: {before:?}"
    );
    journal.set_open(true);
    match publisher.expect().await {
        Packet::PublishAck(a) => assert_eq!(a.packet_id.get(), 2),
        other => panic!("expected PUBACK, got {other:?}"),
    }
    let changes = journal.changes.lock().unwrap().clone();
    assert!(changes.iter().any(|c| matches!(
        c,
        SessionChange::Appended { client_id, message, .. }
            if &**client_id == "durable" && &message.message.payload[..] == b"durable"
    )));
    assert!(
        !changes.iter().any(
            |c| matches!(c, SessionChange::Created { client_id, .. } if &**client_id == "clean")
        ),
        "expiry-0 sessions are not journalled"
    );
}

/// A CONNECT refused because its new session could not be made durable leaves no session
/// behind: the client's next attempt is answered Session Present = 0, as if the refused one
/// never came (decision 0070). Before, the refused CONNECT's session stayed in the broker and the
/// retry resumed it (Session Present = 1).
#[tokio::test]
async fn a_refused_connect_leaves_no_session_for_the_retry_to_resume() {
    let journal = MemoryJournal::new();
    let s = journalled(&journal).await;
    journal.set_failing(true);
    let (_refused, ack) = Raw::connect(s.addr, "refused", false, 600).await;
    assert_eq!(ack.reason_code, v5::ConnectAckReason::UnspecifiedError);
    journal.set_failing(false);
    let (retry, ack) = Raw::connect(s.addr, "refused", false, 600).await;
    assert_eq!(ack.reason_code, v5::ConnectAckReason::Success);
    assert!(
        !ack.session_present,
        "nothing of the refused CONNECT stayed"
    );
    retry
        .disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    // Its session goes from the journal too (the refused one's `Created` may have landed).
    assert!(journal.replay().sessions.contains_key("refused"));
    let changes = journal.changes.lock().unwrap().clone();
    let deleted = changes.iter().position(
        |c| matches!(c, SessionChange::Deleted { client_id } if &**client_id == "refused"),
    );
    let created_again = changes.iter().rposition(
        |c| matches!(c, SessionChange::Created { client_id, .. } if &**client_id == "refused"),
    );
    assert!(deleted.is_some() && deleted < created_again, "{changes:?}");
}

#[tokio::test]
async fn a_broker_restored_from_the_journal_resumes_sessions_messages_and_retained() {
    let journal = MemoryJournal::new();
    let mut s = journalled(&journal).await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", false, 600).await;
    let opts = v5::SubscriptionOptions {
        qos: qos(1),
        ..Default::default()
    };
    sub.subscribe_opts("t/#", opts, Some(7)).await;
    let (mut publisher, _) = Raw::connect(s.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("t/1", b"first", 1).await, 0);
    // Received and never acknowledged: in flight at the "crash".
    let first = sub.expect_publish().await;
    let first_id = first.packet_id.unwrap();
    drop(sub);
    assert_eq!(publisher.publish_acked("t/2", b"second", 2).await, 0);
    publisher.publish("r/x", b"kept", 1, 3, true).await;
    assert!(matches!(publisher.expect().await, Packet::PublishAck(_)));
    s.shutdown();

    let restored = journal.replay();
    assert_eq!(restored.sessions.len(), 1, "{restored:?}");
    let broker = Broker::new(BrokerConfig::default());
    let report = broker.restore(restored);
    assert_eq!(
        (report.sessions, report.messages, report.retained),
        (1, 2, 1)
    );
    let s2 = Server::serve(broker).await;
    let (mut sub, ack) = Raw::connect(s2.addr, "sub", false, 600).await;
    assert!(ack.session_present, "Session Present after the restore");
    let again = sub.expect_publish().await;
    assert!(again.dup, "an in-flight message goes again with DUP");
    assert_eq!(again.packet_id, Some(first_id));
    assert_eq!(&again.payload[..], b"first");
    let second = sub.expect_publish().await;
    assert_eq!(&second.payload[..], b"second");
    assert_eq!(
        second
            .properties
            .as_ref()
            .map(|p| p.subscription_ids.clone()),
        Some(vec![std::num::NonZeroU32::new(7).unwrap()]),
        "subscription ids survive"
    );
    // The subscription itself survived: new messages still arrive.
    let (mut publisher, _) = Raw::connect(s2.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("t/3", b"third", 1).await, 0);
    sub.puback(again.packet_id.unwrap()).await;
    sub.puback(second.packet_id.unwrap()).await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"third");

    let (mut late, _) = Raw::connect(s2.addr, "late", true, 0).await;
    late.subscribe("r/#", 1).await;
    let kept = late.expect_publish().await;
    assert!(kept.retain);
    assert_eq!(&kept.payload[..], b"kept");
}

#[tokio::test]
async fn restore_drops_sessions_that_expired_while_down_and_publishes_due_wills() {
    let journal = MemoryJournal::new();
    let mut s = journalled(&journal).await;
    let with_will = |id: &str, expiry: u32, delay: u32| {
        let mut c = connect_packet(id, false, expiry);
        c.last_will = Some(will(&format!("will/{id}"), b"gone", 1, true, Some(delay)));
        c
    };
    // Both connections end abnormally with a delayed will pending.
    let (short, _) = Raw::connect_with(s.addr, with_will("short", 60, 30)).await;
    let (long, _) = Raw::connect_with(s.addr, with_will("long", 3600, 600)).await;
    drop((short, long));
    let mut events = s.broker.events();
    for _ in 0..2 {
        wait_event(&mut events, |e| {
            matches!(e, mqstate_broker::ClientEvent::Disconnected { .. })
        })
        .await;
    }
    s.shutdown();

    // Two minutes later: "short" expired (and its will is due), "long" lives on with its will pending.
    let restored = journal.replay();
    assert!(restored.sessions["long"].will.is_some());
    let two_minutes_later = OffsetClock::new(mqstate_clock::system(), 120_000);
    let broker = Broker::builder(BrokerConfig::default())
        .clock(Arc::new(two_minutes_later))
        .build();
    let report = broker.restore(restored);
    assert_eq!(
        (report.sessions, report.expired, report.wills_published),
        (1, 1, 1)
    );
    assert_eq!(broker.session_count(), 1);
    let s2 = Server::serve(broker).await;
    let (mut watcher, _) = Raw::connect(s2.addr, "watcher", true, 0).await;
    watcher.subscribe("will/#", 1).await;
    let will = watcher.expect_publish().await;
    assert_eq!(&will.topic[..], "will/short");
    let (_, ack) = Raw::connect(s2.addr, "long", false, 3600).await;
    assert!(ack.session_present, "the unexpired session is resumed");
}

/// Decision 0054: a persistent session's will is in the journal while its client is connected
/// (`WillSet`), so a crash of the server does not lose it: the restored session counts as
/// disconnected at the restart, and its will is published after its delay (or at once).
#[tokio::test]
async fn the_will_of_a_client_connected_at_a_crash_is_published_after_the_restart() {
    let journal = MemoryJournal::new();
    let s = journalled(&journal).await;
    let with_will = |id: &str, delay: u32| {
        let mut c = connect_packet(id, false, 3600);
        c.last_will = Some(will(&format!("will/{id}"), b"gone", 1, false, Some(delay)));
        c
    };
    // A persistent watcher, so the wills are queued for it whenever they are published.
    let (mut watcher, _) = Raw::connect(s.addr, "watcher", false, 3600).await;
    watcher.subscribe("will/#", 1).await;
    let (now, _) = Raw::connect_with(s.addr, with_will("now", 0)).await;
    let (later, _) = Raw::connect_with(s.addr, with_will("later", 1)).await;
    // A crash: the journal as it is, with every client connected (no detach recorded).
    let restored = journal.replay();
    drop((now, later, watcher, s));
    assert!(restored.sessions["now"].connected_will.is_some());
    assert!(restored.sessions["later"].detached_at_ms.is_none());

    let restarted = MemoryJournal::new();
    let broker = Broker::builder(BrokerConfig::default())
        .journal(restarted.clone())
        .build();
    let report = broker.restore(restored);
    assert_eq!((report.sessions, report.wills_published), (3, 1));
    // The delayed one is pending, and journalled as such (a second crash keeps it).
    let scheduled = restarted.changes.lock().unwrap().iter().any(
        |c| matches!(c, SessionChange::WillScheduled { client_id, .. } if &**client_id == "later"),
    );
    assert!(scheduled, "the pending will is journalled");
    let s2 = Server::serve(broker).await;
    let (mut watcher, ack) = Raw::connect(s2.addr, "watcher", false, 3600).await;
    assert!(ack.session_present);
    let mut topics = Vec::new();
    for _ in 0..2 {
        let will = watcher.expect_publish().await;
        topics.push(will.topic.to_string());
    }
    topics.sort();
    assert_eq!(topics, ["will/later", "will/now"]);
}

async fn pubrel(c: &mut Raw, packet_id: u16) {
    c.send(Packet::PublishRelease(v5::PublishAck2 {
        packet_id: pid(packet_id),
        reason_code: v5::PublishAck2Reason::Success,
        properties: vec![],
        reason_string: None,
    }))
    .await;
}

/// A retry of a QoS 2 publish, as a client re-sends it after reconnecting.
async fn publish_dup(c: &mut Raw, topic: &str, payload: &'static [u8], packet_id: u16) {
    c.send(Packet::Publish(Box::new(rmqtt_codec::types::Publish {
        dup: true,
        retain: false,
        qos: qos(2),
        topic: topic.into(),
        packet_id: Some(pid(packet_id)),
        payload: bytes::Bytes::from_static(payload),
        properties: Some(v5::PublishProperties::default()),
    })))
    .await;
}

/// The packet id and reason code of the next packet, which must be a PUBREC.
async fn expect_pubrec(c: &mut Raw) -> (u16, u8) {
    match c.expect().await {
        Packet::PublishReceived(a) => (a.packet_id.get(), a.reason_code.into()),
        other => panic!("expected PUBREC, got {other:?}"),
    }
}

/// The packet id and reason code of the next packet, which must be a PUBCOMP.
async fn expect_pubcomp(c: &mut Raw) -> (u16, u8) {
    match c.expect().await {
        Packet::PublishComplete(a) => (a.packet_id.get(), a.reason_code.into()),
        other => panic!("expected PUBCOMP, got {other:?}"),
    }
}

fn qos2_ids(journal: &MemoryJournal, of: &str) -> Vec<(char, u16)> {
    journal
        .changes
        .lock()
        .unwrap()
        .iter()
        .filter_map(|c| match c {
            SessionChange::Qos2Received {
                client_id,
                packet_id,
            } if &**client_id == of => Some(('Q', *packet_id)),
            SessionChange::Qos2Released {
                client_id,
                packet_id,
            } if &**client_id == of => Some(('q', *packet_id)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn inbound_qos2_ids_survive_a_restore_so_pubrel_completes_and_a_retry_is_not_routed_twice() {
    let journal = MemoryJournal::new();
    let mut s = journalled(&journal).await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", false, 600).await;
    sub.subscribe("q/#", 2).await;
    sub.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let (mut publisher, _) = Raw::connect(s.addr, "pub", false, 600).await;

    // Nobody subscribes to q-none, yet the PUBREC still waits: it promises the id is kept.
    journal.set_open(false);
    publisher.publish("q-none", b"none", 2, 6, false).await;
    publisher.publish("q/1", b"released", 2, 7, false).await;
    publisher.publish("q/2", b"retried", 2, 8, false).await;
    let before = publisher.ping().await;
    assert!(
        before.is_empty(),
        "PUBREC sent before the packet id was durable: {before:?}"
    );
    journal.set_open(true);
    let mut recs = vec![
        expect_pubrec(&mut publisher).await,
        expect_pubrec(&mut publisher).await,
        expect_pubrec(&mut publisher).await,
    ];
    recs.sort_unstable();
    assert_eq!(recs, vec![(6, 0), (7, 0), (8, 0)]);
    pubrel(&mut publisher, 6).await;
    assert_eq!(expect_pubcomp(&mut publisher).await, (6, 0));
    assert_eq!(
        qos2_ids(&journal, "pub"),
        vec![('Q', 6), ('Q', 7), ('Q', 8), ('q', 6)]
    );
    // The "crash": 7 got its PUBREC (PUBREL comes after the restart), 8's PUBREC was "lost".
    drop(publisher);
    s.shutdown();

    let restored = journal.replay();
    assert_eq!(
        restored.sessions["pub"].inbound_qos2,
        std::collections::BTreeSet::from([7, 8])
    );
    let broker = Broker::builder(BrokerConfig::default())
        .journal(journal.clone())
        .build();
    broker.restore(restored);
    let s2 = Server::serve(broker).await;
    let (mut publisher, ack) = Raw::connect(s2.addr, "pub", false, 600).await;
    assert!(ack.session_present);
    pubrel(&mut publisher, 7).await;
    assert_eq!(
        expect_pubcomp(&mut publisher).await,
        (7, 0),
        "PUBREL after the restore completes with Success, not 0x92"
    );
    publish_dup(&mut publisher, "q/2", b"retried", 8).await;
    assert_eq!(expect_pubrec(&mut publisher).await, (8, 0));
    pubrel(&mut publisher, 8).await;
    assert_eq!(expect_pubcomp(&mut publisher).await, (8, 0));
    // A released id is free again: a new publish with it is routed, not taken for a retry.
    publisher.publish("q/3", b"reused", 2, 7, false).await;
    assert_eq!(expect_pubrec(&mut publisher).await, (7, 0));

    let (mut sub, ack) = Raw::connect(s2.addr, "sub", false, 600).await;
    assert!(ack.session_present);
    let mut got = Vec::new();
    for _ in 0..3 {
        let p = sub.expect_publish().await;
        got.push(String::from_utf8(p.payload.to_vec()).unwrap());
    }
    assert_eq!(got, vec!["released", "retried", "reused"]);
    let more = sub.ping().await;
    assert!(
        more.is_empty(),
        "the retried QoS 2 publish was delivered twice: {more:?}"
    );
}

#[tokio::test]
async fn pubcomp_waits_for_the_release_and_clean_sessions_journal_no_ids() {
    let journal = MemoryJournal::new();
    let s = journalled(&journal).await;
    let (mut publisher, _) = Raw::connect(s.addr, "pub", false, 600).await;
    publisher.publish("t", b"x", 2, 3, false).await;
    assert_eq!(expect_pubrec(&mut publisher).await, (3, 0));
    journal.set_open(false);
    pubrel(&mut publisher, 3).await;
    let before = publisher.ping().await;
    assert!(
        before.is_empty(),
        "PUBCOMP sent before the release of the id was durable: {before:?}"
    );
    journal.set_open(true);
    assert_eq!(expect_pubcomp(&mut publisher).await, (3, 0));
    assert_eq!(qos2_ids(&journal, "pub"), vec![('Q', 3), ('q', 3)]);

    // A clean session neither records ids nor waits for the journal.
    journal.set_open(false);
    let (mut clean, _) = Raw::connect(s.addr, "clean", true, 0).await;
    clean.publish("t", b"y", 2, 3, false).await;
    assert_eq!(expect_pubrec(&mut clean).await, (3, 0));
    pubrel(&mut clean, 3).await;
    assert_eq!(expect_pubcomp(&mut clean).await, (3, 0));
    assert!(qos2_ids(&journal, "clean").is_empty());
}

/// Completes each record's durability from a writer thread a moment later, in order, as the
/// session log's fsync thread does.
struct ThreadJournal {
    tx: Mutex<std::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>>,
}

impl ThreadJournal {
    fn new() -> Arc<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
        std::thread::spawn(move || {
            while let Ok(done) = rx.recv() {
                // A batch of whatever else is queued, as group commit does.
                let mut batch = vec![done];
                batch.extend(rx.try_iter());
                std::thread::sleep(std::time::Duration::from_micros(300));
                for done in batch {
                    let _ = done.send(());
                }
            }
        });
        Arc::new(Self { tx: Mutex::new(tx) })
    }
}

impl SessionJournal for ThreadJournal {
    fn record(&self, changes: Vec<SessionChange>) -> Durable {
        drop(changes);
        let (done, rx) = tokio::sync::oneshot::channel();
        let _ = self.tx.lock().unwrap().send(done);
        Box::pin(async move { rx.await.map_err(|_| JournalError("writer gone".into())) })
    }
}

/// A QoS 1 PUBLISH with `topic` and Topic Alias 1.
fn aliased(topic: &str, packet_id: u16, payload: &'static [u8]) -> Packet {
    Packet::Publish(Box::new(rmqtt_codec::types::Publish {
        dup: false,
        retain: false,
        qos: qos(1),
        topic: topic.into(),
        packet_id: Some(pid(packet_id)),
        payload: bytes::Bytes::from_static(payload),
        properties: Some(v5::PublishProperties {
            topic_alias: std::num::NonZeroU16::new(1),
            ..Default::default()
        }),
    }))
}

/// Issue 11 item 10, the paho interop `client_topic_alias` sequence: a client subscribed to its own
/// topic (QoS 2) in a session that outlives its connection publishes QoS 1 with a topic alias, then
/// with an empty topic and the alias. Each PUBACK waits for the journal; it must still reach the
/// client before the client's own copy of the message, every time (the full story, with the real
/// session log: `tests/durability/topic_alias_durable.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_alias_publishes_in_a_durable_session_are_always_acknowledged() {
    let journal = ThreadJournal::new();
    let s = Server::serve(
        Broker::builder(BrokerConfig::default())
            .journal(journal.clone())
            .build(),
    )
    .await;
    for round in 0..100u16 {
        let (mut c, _) = Raw::connect(s.addr, "alias", true, 99_999).await;
        c.subscribe("alias/t", 2).await;
        for (n, (topic, payload)) in [("alias/t", &b"one"[..]), ("", b"two")]
            .into_iter()
            .enumerate()
        {
            let packet_id = 2 * round % 60_000 + n as u16 + 1;
            c.send(aliased(topic, packet_id, payload)).await;
            let (mut acked, mut forwarded) = (false, false);
            while !(acked && forwarded) {
                match c.recv().await {
                    Some(Packet::PublishAck(a)) => {
                        assert_eq!(a.packet_id.get(), packet_id, "round {round}");
                        assert_eq!(u8::from(a.reason_code), 0, "round {round}");
                        acked = true;
                    }
                    Some(Packet::Publish(p)) => {
                        assert_eq!(&p.payload[..], payload, "round {round}");
                        assert!(acked, "round {round}: own copy before the PUBACK");
                        if let Some(id) = p.packet_id {
                            c.puback(id).await;
                        }
                        forwarded = true;
                    }
                    other => panic!("round {round}: unexpected {other:?}"),
                }
            }
        }
        c.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
            .await;
    }
}

#[tokio::test]
async fn a_session_handed_over_to_a_running_broker_keeps_its_subscriptions_and_messages() {
    let (journal_a, journal_b) = (MemoryJournal::new(), MemoryJournal::new());
    let a = journalled(&journal_a).await;
    let b = journalled(&journal_b).await;
    let (mut mover, _) = Raw::connect(a.addr, "mover", false, 600).await;
    mover.subscribe("h/#", 1).await;
    mover
        .disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let (mut publisher, _) = Raw::connect(a.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("h/1", b"one", 1).await, 0);
    assert_eq!(publisher.publish_acked("h/2", b"two", 2).await, 0);

    let stored = a.broker.export_session("mover").expect("exported");
    assert_eq!(stored.messages.len(), 2);
    assert_eq!(stored.subscriptions.len(), 1);
    assert_eq!(a.broker.session_count(), 1, "only the publisher's is left");
    assert!(
        !journal_a.replay().sessions.contains_key("mover"),
        "the old node's journal no longer restores it"
    );
    // The old node has nothing of it any more.
    let (_, ack) = Raw::connect(a.addr, "mover", false, 600).await;
    assert!(!ack.session_present);

    let adoption = b
        .broker
        .adopt_session("mover".into(), stored)
        .expect("adopted");
    assert_eq!((adoption.report.sessions, adoption.report.messages), (1, 2));
    adoption.durable.expect("journalled").await.unwrap();
    let recorded = journal_b.replay();
    assert_eq!(recorded.sessions["mover"].messages.len(), 2, "{recorded:?}");
    assert_eq!(recorded.sessions["mover"].subscriptions.len(), 1);

    let (mut mover, ack) = Raw::connect(b.addr, "mover", false, 600).await;
    assert!(ack.session_present, "the adopted session is resumed");
    let one = mover.expect_publish().await;
    let two = mover.expect_publish().await;
    assert_eq!(
        (&one.payload[..], &two.payload[..]),
        (&b"one"[..], &b"two"[..])
    );
    mover.puback(one.packet_id.unwrap()).await;
    mover.puback(two.packet_id.unwrap()).await;
    let (mut publisher, _) = Raw::connect(b.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("h/3", b"three", 1).await, 0);
    assert_eq!(&mover.expect_publish().await.payload[..], b"three");
}

#[tokio::test]
async fn a_connected_session_is_not_exported_and_an_existing_one_is_not_replaced() {
    let journal = MemoryJournal::new();
    let s = journalled(&journal).await;
    assert!(matches!(
        s.broker.export_session("nobody"),
        Err(BrokerError::NoSuchSession { .. })
    ));
    let (mut c, _) = Raw::connect(s.addr, "c", false, 600).await;
    c.subscribe("mine/#", 1).await;
    assert!(matches!(
        s.broker.export_session("c"),
        Err(BrokerError::SessionConnected { .. })
    ));
    let stranger = mqstate_broker::StoredSession {
        expiry_secs: 600,
        ..Default::default()
    };
    assert!(matches!(
        s.broker.adopt_session("c".into(), stranger),
        Err(BrokerError::SessionExists { .. })
    ));
    // The refused adoption left the live session alone.
    let (mut publisher, _) = Raw::connect(s.addr, "pub", true, 0).await;
    assert_eq!(publisher.publish_acked("mine/1", b"still", 1).await, 0);
    assert_eq!(&c.expect_publish().await.payload[..], b"still");
}

// Paused time: the delayed will comes due on the broker's clock.
#[tokio::test(start_paused = true)]
async fn a_handed_over_delayed_will_is_published_by_the_node_that_adopted_it() {
    let a = journalled(&MemoryJournal::new()).await;
    let b = journalled(&MemoryJournal::new()).await;
    let mut events = a.broker.events();
    let mut c = connect_packet("leaver", false, 600);
    c.last_will = Some(will("will/leaver", b"gone", 1, false, Some(5)));
    let (leaver, _) = Raw::connect_with(a.addr, c).await;
    drop(leaver);
    wait_event(&mut events, |e| {
        matches!(e, mqstate_broker::ClientEvent::Disconnected { .. })
    })
    .await;
    let stored = a.broker.export_session("leaver").expect("exported");
    assert!(
        stored.will.is_some(),
        "the pending will goes with the session"
    );
    let (mut watcher_a, _) = Raw::connect(a.addr, "watcher", true, 0).await;
    watcher_a.subscribe("will/#", 1).await;
    let (mut watcher_b, _) = Raw::connect(b.addr, "watcher", true, 0).await;
    watcher_b.subscribe("will/#", 1).await;
    b.broker
        .adopt_session("leaver".into(), stored)
        .expect("adopted");
    let will = watcher_b.expect_publish().await;
    assert_eq!(&will.topic[..], "will/leaver");
    assert!(
        watcher_a.ping().await.is_empty(),
        "the old node's timer found no session and published nothing"
    );
}

/// A cluster node's view of where sessions are, reduced to its answer on whether what the node
/// recorded of a session landed in the session's row (`landed`): held until the test gives it
/// (`true`: landed; `false`: another node took the session over first).
struct GatedSource(watch::Sender<Option<bool>>);

impl mqstate_broker::SessionSource for GatedSource {
    fn locate(
        &self,
        _: &str,
        _: bool,
        _: bool,
        _: bool,
        _: mqstate_broker::CopyId,
    ) -> mqstate_broker::Locating {
        Box::pin(async { Ok(mqstate_broker::Located::Here) })
    }

    fn landed(&self, _: &str) -> mqstate_broker::Landing {
        let mut landed = self.0.subscribe();
        Box::pin(async move {
            match landed.wait_for(Option::is_some).await {
                Ok(answer) => answer.unwrap_or(false),
                Err(_) => false,
            }
        })
    }
}

/// A cluster node's broker (a journal, and a session source gated by the test), a watcher on
/// `will/#` and the `mark` topic, and the client `c` connected with a will on `will/c`
/// (`delay_secs` after its connection ends) and a session of 60 s.
async fn cluster_node_with_a_will(delay_secs: Option<u32>) -> (Server, Arc<GatedSource>, Raw, Raw) {
    let source = Arc::new(GatedSource(watch::Sender::new(None)));
    let s = Server::serve(
        Broker::builder(BrokerConfig::default())
            .journal(MemoryJournal::new())
            .sessions_elsewhere(source.clone())
            .build(),
    )
    .await;
    let (mut watcher, _) = Raw::connect(s.addr, "watcher", true, 0).await;
    watcher.subscribe("will/#", 0).await;
    watcher.subscribe("mark", 0).await;
    let mut connect = connect_packet("c", true, 60);
    connect.last_will = Some(will("will/c", b"bye", 0, false, delay_secs));
    let (c, _) = Raw::connect_with(s.addr, connect).await;
    (s, source, watcher, c)
}

/// Publishes on `mark` and returns the topic of the first message the watcher gets after: `mark`
/// if no will came first.
async fn first_after_mark(s: &Server, watcher: &mut Raw) -> String {
    let (mut marker, _) = Raw::connect(s.addr, "marker", true, 0).await;
    marker.publish("mark", b"m", 0, 0, false).await;
    watcher.expect_publish().await.topic.to_string()
}

/// Decision 0057's amendment: a cluster node whose lease lapsed sends its clients away (0x9C).
/// The server ended the connection, so the will is due — but only once the end landed in the
/// session's row: until then another node may be adopting the session, and then the will is
/// that node's. Before, a client sent away left its will to an adopter, and it was never
/// published when nobody adopted the session and the client did not come back (this test's
/// `landed` case failed: no will).
#[tokio::test]
async fn a_client_sent_away_has_its_will_published_once_its_end_landed_unless_taken_over() {
    for landed in [true, false] {
        let (s, source, mut watcher, mut c) = cluster_node_with_a_will(None).await;
        let mut events = s.broker.events();
        assert!(s.broker.send_away("c"));
        assert_eq!(c.disconnect_reason().await, Some(0x9C));
        wait_event(&mut events, |e| {
            matches!(e, mqstate_broker::ClientEvent::Disconnected { client_id } if &**client_id == "c")
        })
        .await;
        assert_eq!(
            first_after_mark(&s, &mut watcher).await,
            "mark",
            "no will before the end landed"
        );
        source.0.send_replace(Some(landed));
        if landed {
            let will = watcher.expect_publish().await;
            assert_eq!(will.topic, "will/c", "the will once the end landed");
        } else {
            let next = first_after_mark(&s, &mut watcher).await;
            assert_eq!(
                next, "mark",
                "another node took the session: its will is not ours"
            );
        }
    }
}

/// A delayed will that came due on a cluster node is published only once its publication landed
/// in the session's row: another node that took the session over first (adopted it while this
/// node was cut off, or a CONNECT of the client claimed it) holds the will, or the client is
/// back. Before, it was published all the same (this test's `false` case failed: a will twice).
#[tokio::test]
async fn a_delayed_will_due_on_a_cluster_node_waits_for_its_row_and_yields_to_a_takeover() {
    for landed in [false, true] {
        let (s, source, mut watcher, c) = cluster_node_with_a_will(Some(1)).await;
        drop(c);
        // Past the will's delay.
        tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
        assert_eq!(
            first_after_mark(&s, &mut watcher).await,
            "mark",
            "not before it landed"
        );
        source.0.send_replace(Some(landed));
        if landed {
            assert_eq!(watcher.expect_publish().await.topic, "will/c");
        } else {
            let next = first_after_mark(&s, &mut watcher).await;
            assert_eq!(next, "mark", "taken over: the will is not published here");
        }
    }
}

/// A session source whose `locate` finds the copy here, but has that copy dropped before
/// answering (as another node's claim of the client id can drop it between the locate and the
/// attach). Remembers the copy the first CONNECT put in.
#[derive(Default)]
struct DroppingSource(
    std::sync::OnceLock<Broker>,
    Mutex<Option<mqstate_broker::CopyId>>,
);

impl mqstate_broker::SessionSource for DroppingSource {
    fn locate(
        &self,
        client_id: &str,
        _: bool,
        _: bool,
        held_here: bool,
        copy: mqstate_broker::CopyId,
    ) -> mqstate_broker::Locating {
        let mut held = self.1.lock().unwrap();
        match (held_here, *held, self.0.get()) {
            (true, Some(held), Some(broker)) => {
                assert!(broker.forget_session(client_id, held), "the copy was here");
            }
            _ => *held = Some(copy),
        }
        Box::pin(async { Ok(mqstate_broker::Located::Here) })
    }

    fn landed(&self, _: &str) -> mqstate_broker::Landing {
        Box::pin(async { true })
    }
}

/// Robustness seed 500764 (`session-present`): a CONNECT whose session was located here, then
/// dropped before it attached, got a fresh session — Session Present 0 for a session that
/// existed, and a `Created` that would overwrite its row. It is refused now (0x89, retryable).
/// Before, the second CONNECT was accepted with Session Present 0.
#[tokio::test]
async fn a_connect_whose_located_session_is_dropped_before_it_attaches_is_refused() {
    let source = Arc::new(DroppingSource::default());
    let broker = Broker::builder(BrokerConfig::default())
        .journal(MemoryJournal::new())
        .sessions_elsewhere(source.clone())
        .build();
    assert!(source.0.set(broker.clone()).is_ok());
    let s = Server::serve(broker).await;
    let (c, ack) = Raw::connect(s.addr, "c", true, 60).await;
    assert!(!ack.session_present);
    c.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let mut again = Raw::open(s.addr).await;
    again
        .send(Packet::Connect(Box::new(connect_packet("c", false, 60))))
        .await;
    match again.expect().await {
        Packet::ConnectAck(ack) => assert_eq!(u8::from(ack.reason_code), 0x89, "{ack:?}"),
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

/// A journal (in memory) that, once armed, delivers a drop of a session's copy when the
/// durability of its next record is awaited: late, after the change recorded was made (a
/// cluster node's `lose`, whose drop of the copy it lost comes after its state lock is released).
struct LateDrop {
    journal: Arc<MemoryJournal>,
    armed: Mutex<Option<(Broker, &'static str, mqstate_broker::CopyId)>>,
}

impl SessionJournal for LateDrop {
    fn record(&self, changes: Vec<SessionChange>) -> Durable {
        let durable = self.journal.record(changes);
        let late = self.armed.lock().unwrap().take();
        Box::pin(async move {
            if let Some((broker, client_id, copy)) = late {
                broker.forget_session(client_id, copy);
            }
            durable.await
        })
    }
}

/// Issue 16, robustness seed 500764's mechanism: a cluster node lost a session and, before its
/// drop of its copy arrived, a CONNECT of the client took the session back and put the row's
/// session in the broker. The drop names the old copy, so the new one stays: the CONNECT gets
/// Session Present 1 with the queue. Before, the drop took whatever copy was held (this test
/// failed with `forget_session` ignoring the copy named: CONNACK 0x89, the guard of bcd7f4a).
#[tokio::test]
async fn a_late_drop_of_an_older_copy_leaves_the_copy_taken_in_for_a_connect() {
    let source = Arc::new(CopiesSource::default());
    let journal = Arc::new(LateDrop {
        journal: MemoryJournal::new(),
        armed: Mutex::new(None),
    });
    let s = Server::serve(
        Broker::builder(BrokerConfig::default())
            .journal(journal.clone())
            .sessions_elsewhere(source.clone())
            .build(),
    )
    .await;
    let (c, _) = Raw::connect(s.addr, "c", false, 60).await;
    c.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let old = source.last_copy("c");

    // The session as another node left it in its row: one message queued.
    let queued = mqstate_broker::persist::StoredMessage {
        message: Arc::new(mqstate_broker::Message {
            topic: "n/k".into(),
            payload: bytes::Bytes::from_static(b"queued"),
            qos: mqstate_broker::QoS::AtLeastOnce,
            retain: false,
            properties: Default::default(),
        }),
        qos: mqstate_broker::QoS::AtLeastOnce,
        retain: false,
        subscription_ids: Vec::new(),
        received_at_ms: s.broker.clock().now_ms(),
    };
    let mut row = mqstate_broker::StoredSession {
        expiry_secs: 60,
        detached_at_ms: Some(s.broker.clock().now_ms()),
        ..Default::default()
    };
    row.messages.insert(
        0,
        mqstate_broker::persist::StoredEntry {
            message: queued,
            packet_id: None,
            released: false,
        },
    );
    *source.taken.lock().unwrap() = Some(row);
    *journal.armed.lock().unwrap() = Some((s.broker.clone(), "c", old));

    let (mut c, ack) = Raw::connect(s.addr, "c", false, 60).await;
    assert!(ack.session_present, "the session taken in is resumed");
    assert_ne!(source.last_copy("c"), old);
    assert!(
        journal.armed.lock().unwrap().is_none(),
        "the late drop came"
    );
    let publish = c.expect_publish().await;
    assert_eq!(&publish.payload[..], b"queued");
}
