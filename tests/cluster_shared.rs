//! Shared subscriptions whose members sit on different nodes, when a node fails (issue 16,
//! decision 0062), on three real `mqstate serve` processes with a raw MQTT 5 client.
//!
//! Node 1 hangs (SIGSTOP: calls to it go unanswered until the control plane counts it down) and
//! then dies (`kill -9`) while a publisher on node 2 publishes a numbered sequence to a shared
//! group, each message awaiting its acknowledgement. A member of the group has a persistent
//! session on node 1. What was acknowledged 0x00 reaches some member of the group: another live
//! member, or — when node 1 held the only members — node 1's session once adopted, back on
//! node 3 with Session Present = 1. (Before: a message whose group node 2 assigned to node 1 was
//! held but given again to no shared group, and a group held only by a node that was down
//! matched nothing: lost.)
//!
//! And a held publish whose redelivery misses a node (it hangs just then) is held again: the
//! sessions that node adopted get it once it answers again. At QoS 2 a held publish reaches a
//! session, and a shared group, once (decision 0066) — also when the node it missed took the
//! copy in after all (it hung past the call timeout, within a 20 s lease here).

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{Packet, PubAck, PubComp, PubRec};
use rumqttc::v5::mqttbytes::QoS;

use common::cluster::{
    accepted, adopted, agreed, eventually, nothing_lost, publish_for_a_while, start_founders_with,
    three_nodes, will_watcher, Node, FAILOVER_WAIT,
};
use common::mqtt::{will_of, Raw};

/// The node stops answering (SIGSTOP) without closing anything: calls to it hang until they
/// time out or the control plane counts it down.
fn freeze(node: &Node) {
    let status = Command::new("kill")
        .arg("-STOP")
        .arg(node.server.pid().to_string())
        .status()
        .expect("kill -STOP");
    assert!(status.success(), "kill -STOP failed");
}

/// The node answers again (SIGCONT).
fn resume(node: &Node) {
    let status = Command::new("kill")
        .arg("-CONT")
        .arg(node.server.pid().to_string())
        .status()
        .expect("kill -CONT");
    assert!(status.success(), "kill -CONT failed");
}

/// Persistent session `id` on `addr` in shared group `g` on `topic` (QoS `qos`), and on
/// `end/<id>` (non-shared: its marker tells the session's queue was read to the end).
async fn member(addr: SocketAddr, id: &str, topic: &str, qos: QoS) -> Raw {
    let (mut client, present) = accepted(addr, id, true, 3600, None).await;
    assert!(!present);
    client.subscribe(&format!("$share/g/{topic}"), qos).await;
    client
        .subscribe(&format!("end/{id}"), QoS::AtLeastOnce)
        .await;
    client
}

/// A spawned [`read_to_end`].
type Reader = tokio::task::JoinHandle<(Raw, Vec<String>)>;

/// Reads (and acknowledges, QoS 2 to PUBCOMP) every message until the marker on `end/<id>`;
/// the payloads of the others, in order (copies included).
async fn read_to_end(mut client: Raw, id: String) -> (Raw, Vec<String>) {
    let end = format!("end/{id}");
    let mut got = Vec::new();
    loop {
        match client.recv().await {
            Packet::Publish(p) => {
                match p.qos {
                    QoS::AtLeastOnce => {
                        client.send(Packet::PubAck(PubAck::new(p.pkid, None))).await
                    }
                    QoS::ExactlyOnce => {
                        client.send(Packet::PubRec(PubRec::new(p.pkid, None))).await
                    }
                    QoS::AtMostOnce => {}
                }
                if p.topic == end.as_bytes() {
                    return (client, got);
                }
                got.push(String::from_utf8_lossy(&p.payload).into_owned());
            }
            Packet::PubRel(rel) => {
                client
                    .send(Packet::PubComp(PubComp::new(rel.pkid, None)))
                    .await
            }
            Packet::PingResp(_) => {}
            other => panic!("{id}: unexpected {other:?}"),
        }
    }
}

/// Five publishers on `addr`, connected before the failure (a CONNECT waits for every live
/// node to hear of its client id).
async fn publishers(addr: SocketAddr) -> Vec<Raw> {
    let mut clients = Vec::new();
    for k in 0..5 {
        clients.push(accepted(addr, &format!("pub-{k}"), true, 0, None).await.0);
    }
    clients
}

/// Members on node 1 (persistent, away) and node 3 (connected); node 1 hangs, then dies. What
/// node 2 assigned to node 1 meanwhile reaches the member on node 3 or node 1's session once
/// adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_group_loses_nothing_acknowledged_when_a_members_node_dies() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let away = member(n1, "sh-away", "sh/a", QoS::AtLeastOnce).await;
    away.disconnect().await;
    let live = member(n3, "sh-live", "sh/a", QoS::AtLeastOnce).await;
    let reader = tokio::spawn(read_to_end(live, "sh-live".to_owned()));
    let clients = publishers(n2).await;

    freeze(&nodes[0]);
    let frozen = Instant::now();
    let (acked, mut publisher) =
        publish_for_a_while(clients, "sh/a", QoS::AtLeastOnce, frozen, 5).await;
    tokio::task::block_in_place(|| nodes[0].server.kill9());

    // Every acknowledged message is in a queue by now: each member's marker comes after.
    assert_eq!(
        publisher
            .publish("end/sh-live", QoS::AtLeastOnce, "end")
            .await,
        0x00
    );
    let (live, mut received) = reader.await.expect("sh-live reader");
    eprintln!("sh-live on node 3 received {}", received.len());
    let away = adopted(n3, "sh-away", frozen).await;
    assert_eq!(
        publisher
            .publish("end/sh-away", QoS::AtLeastOnce, "end")
            .await,
        0x00
    );
    let (away, from_away) = read_to_end(away, "sh-away".to_owned()).await;
    eprintln!("sh-away, adopted, received {}", from_away.len());
    received.extend(from_away);
    nothing_lost(&acked, &received);
    away.disconnect().await;
    live.disconnect().await;
    drop(publisher);
}

/// The only member of the group has a persistent session on node 1, which hangs, then dies:
/// what is published at QoS 2 meanwhile is held and reaches that session once adopted, back on
/// node 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_group_held_only_on_a_dead_node_gets_every_acknowledged_message_once_adopted() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let only = member(n1, "sh-only", "sh/b", QoS::ExactlyOnce).await;
    only.disconnect().await;
    let clients = publishers(n2).await;

    freeze(&nodes[0]);
    let frozen = Instant::now();
    let (acked, mut publisher) =
        publish_for_a_while(clients, "sh/b", QoS::ExactlyOnce, frozen, 5).await;
    tokio::task::block_in_place(|| nodes[0].server.kill9());

    let only = adopted(n3, "sh-only", frozen).await;
    assert_eq!(
        publisher
            .publish("end/sh-only", QoS::AtLeastOnce, "end")
            .await,
        0x00
    );
    let (only, received) = read_to_end(only, "sh-only".to_owned()).await;
    nothing_lost(&acked, &received);
    only.disconnect().await;
    drop(publisher);
}

/// Decision 0062 (c): six persistent sessions connected to node 1 subscribe (non-shared); node 1
/// hangs while node 2's publishers publish, so their messages are held. Once every session was
/// adopted (its will came), node 3 — the adopter of some — hangs too, past the call timeout, just
/// when the held messages are given again; then it answers again. Every session, resumed on
/// node 3, gets every message acknowledged 0x00. (Before: a redelivery node 3 did not answer was
/// not held again, lost for the sessions node 3 adopted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_publish_whose_redelivery_misses_a_node_is_held_again() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let mut watcher = will_watcher(n2, "c-watcher").await;
    let ids: Vec<String> = (0..6).map(|k| format!("c-sub-{k}")).collect();
    let mut subscribers = Vec::new();
    for id in &ids {
        let (mut client, _) = accepted(n1, id, true, 3600, will_of(id, 0)).await;
        client.subscribe("c/t", QoS::AtLeastOnce).await;
        client
            .subscribe(&format!("end/{id}"), QoS::AtLeastOnce)
            .await;
        subscribers.push(client);
    }
    let clients = publishers(n2).await;

    freeze(&nodes[0]);
    let frozen = Instant::now();
    let publishing = tokio::spawn(publish_for_a_while(
        clients,
        "c/t",
        QoS::AtLeastOnce,
        frozen,
        5,
    ));
    let mut wills = BTreeSet::new();
    while wills.len() < ids.len() {
        assert!(
            frozen.elapsed() < FAILOVER_WAIT,
            "wills after {FAILOVER_WAIT:?}: {wills:?}"
        );
        wills.insert(watcher.next_topic().await);
    }
    // Every session adopted; the held messages go again about now.
    freeze(&nodes[2]);
    eprintln!(
        "all adopted, node 3 hangs {:?} after node 1",
        frozen.elapsed()
    );
    // Past the mesh's call timeout (8 s): node 2's call to node 3 fails.
    tokio::time::sleep(Duration::from_secs(10)).await;
    resume(&nodes[2]);
    let (acked, mut publisher) = publishing.await.expect("publishing");
    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop(subscribers);

    for id in &ids {
        let client = adopted(n3, id, frozen).await;
        assert_eq!(
            publisher
                .publish(&format!("end/{id}"), QoS::AtLeastOnce, "end")
                .await,
            0x00
        );
        let (client, received) = read_to_end(client, id.clone()).await;
        eprint!("{id}: ");
        nothing_lost(&acked, &received);
        client.disconnect().await;
    }
    drop((publisher, watcher));
}

/// Completes the QoS 2 flow of the next message (PUBREC, then PUBCOMP on PUBREL); its payload.
async fn take_qos2(client: &mut Raw) -> String {
    let payload = match client.recv().await {
        Packet::Publish(p) => {
            assert_eq!(p.qos, QoS::ExactlyOnce);
            client.send(Packet::PubRec(PubRec::new(p.pkid, None))).await;
            String::from_utf8_lossy(&p.payload).into_owned()
        }
        other => panic!("expected PUBLISH, got {other:?}"),
    };
    match client.recv().await {
        Packet::PubRel(rel) => {
            client
                .send(Packet::PubComp(PubComp::new(rel.pkid, None)))
                .await
        }
        other => panic!("expected PUBREL, got {other:?}"),
    }
    payload
}

/// Decision 0066 (0062's limit (a), case 1): a QoS 2 message held because node 1 hangs reaches
/// a session on node 3 at once; its client takes it (PUBCOMP), then resumes the session on
/// node 2 — put back there just before the held message goes again. It gets the message once.
/// (Before: the redelivery went to every session put back since the message arrived, and this
/// one got it a second time, as a new message.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_qos2_message_reaches_a_session_that_moved_exactly_once() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    // A persistent subscriber on node 1: what is published on x/t is planned for node 1 too.
    let (mut away, _) = accepted(n1, "x-away", true, 3600, None).await;
    away.subscribe("x/t", QoS::ExactlyOnce).await;
    let (mut moving, present) = accepted(n3, "x-moving", true, 3600, None).await;
    assert!(!present);
    moving.subscribe("x/t", QoS::ExactlyOnce).await;
    moving.subscribe("end/x-moving", QoS::AtLeastOnce).await;
    let (mut publisher, _) = accepted(n2, "x-pub", true, 0, None).await;

    freeze(&nodes[0]);
    let frozen = Instant::now();
    // Its copy for node 1 is not answered: held, given again once node 1's sessions were adopted.
    let publishing = tokio::spawn(async move {
        let code = publisher.publish("x/t", QoS::ExactlyOnce, "once").await;
        (code, publisher)
    });
    assert_eq!(take_qos2(&mut moving).await, "once");
    moving.disconnect().await;
    let moving = adopted(n2, "x-moving", frozen).await;
    eprintln!(
        "x-moving resumed on node 2 {:?} after node 1 hung",
        frozen.elapsed()
    );
    let (code, mut publisher) = publishing.await.expect("publisher");
    assert_eq!(code, 0x00);
    eprintln!("acknowledged {:?} after node 1 hung", frozen.elapsed());
    assert_eq!(
        publisher
            .publish("end/x-moving", QoS::AtLeastOnce, "end")
            .await,
        0x00
    );
    let (moving, again) = read_to_end(moving, "x-moving".into()).await;
    assert_eq!(
        again,
        Vec::<String>::new(),
        "a QoS 2 message delivered twice"
    );
    moving.disconnect().await;
    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop((away, publisher));
}

/// Decision 0066 case 2 for a shared group (its open limit, closed by the amendment of 0066):
/// the group has a member on node 1 and one on node 3. Node 1 hangs just before a QoS 2 publish
/// on node 2, whose group node 2 assigns to node 1; it hangs past the mesh's call timeout (8 s)
/// but within its lease (20 s here), so node 2 counts the copy missed and holds it, and node 1,
/// answering again, takes the copy in: its member gets the message. After the adoption window
/// the held message goes again to the group. The group gets it once. (Before: the re-plan gave
/// the group, in turn, to node 3's member: the group got the message twice, once per member.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_groups_qos2_message_whose_copy_was_answered_too_late_reaches_the_group_once() {
    let (_root, nodes, [n1, n2, n3]) = three_nodes_with_a_long_lease();
    // Each SUBACK waits for the other nodes: node 2 knows both members' routes.
    let on_1 = member(n1, "late-1", "late/t", QoS::ExactlyOnce).await;
    let on_3 = member(n3, "late-3", "late/t", QoS::ExactlyOnce).await;
    let readers = [
        tokio::spawn(read_to_end(on_1, "late-1".to_owned())),
        tokio::spawn(read_to_end(on_3, "late-3".to_owned())),
    ];
    let publisher = accepted(n2, "late-pub", true, 0, None).await.0;

    // The group's first message: node 2 gives it to the first holder, node 1.
    let (publishing, frozen) =
        publish_qos2_while_node_1_hangs(&nodes, publisher, "late/t", "late").await;
    let (code, mut publisher) = publishing.await.expect("publisher");
    assert_eq!(code, 0x00);
    eprintln!("acknowledged {:?} after node 1 hung", frozen.elapsed());

    let readers = ["late-1", "late-3"].into_iter().zip(readers).collect();
    let received = end_readers(&mut publisher, readers).await;
    assert_eq!(
        received,
        ["late"],
        "the group got the QoS 2 message once per member"
    );
    drop((publisher, nodes));
}

/// Decision 0066, a shared group's member that took a held QoS 2 message in and then moved: as
/// above, node 1 takes in, too late, the copy of a group whose members are `mv-1` on node 1 and
/// `mv-3` on node 3; `mv-1`'s client takes the message (PUBCOMP) and resumes its session on
/// node 2 — the publisher's — before the held message goes again. Node 1 holds no member any
/// more; node 2 does, one that took the message in. The group gets it once. (Before: the group
/// went, in turn, to node 3: `mv-3` got it too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_groups_qos2_message_reaches_the_group_once_when_its_member_moved_to_the_origin() {
    let (_root, nodes, [n1, n2, n3]) = three_nodes_with_a_long_lease();
    let mut moving = member(n1, "mv-1", "mv/t", QoS::ExactlyOnce).await;
    let on_3 = member(n3, "mv-3", "mv/t", QoS::ExactlyOnce).await;
    let reader = tokio::spawn(read_to_end(on_3, "mv-3".to_owned()));
    let publisher = accepted(n2, "mv-pub", true, 0, None).await.0;

    let (publishing, frozen) =
        publish_qos2_while_node_1_hangs(&nodes, publisher, "mv/t", "mv").await;
    let mut received = vec![take_qos2(&mut moving).await];
    moving.disconnect().await;
    let moving = adopted(n2, "mv-1", frozen).await;
    eprintln!(
        "mv-1 resumed on node 2 {:?} after node 1 hung",
        frozen.elapsed()
    );
    let (code, mut publisher) = publishing.await.expect("publisher");
    assert_eq!(code, 0x00);
    eprintln!("acknowledged {:?} after node 1 hung", frozen.elapsed());

    let readers = vec![
        ("mv-1", tokio::spawn(read_to_end(moving, "mv-1".to_owned()))),
        ("mv-3", reader),
    ];
    received.extend(end_readers(&mut publisher, readers).await);
    assert_eq!(
        received,
        ["mv"],
        "the group got the QoS 2 message once per member"
    );
    drop((publisher, nodes));
}

/// Hangs node 1 for 9.5 s — past the mesh's call timeout (8 s), within its 20 s lease
/// ([`three_nodes_with_a_long_lease`]) — while `publisher` sends `payload` on `topic` at QoS 2, so
/// that node 2 holds the copy it could not hand to node 1. Returns the publish under way (its
/// reason code and the client, once acknowledged) and when node 1 froze.
async fn publish_qos2_while_node_1_hangs(
    nodes: &[Node],
    mut publisher: Raw,
    topic: &'static str,
    payload: &'static str,
) -> (tokio::task::JoinHandle<(u8, Raw)>, Instant) {
    freeze(&nodes[0]);
    let frozen = Instant::now();
    let publishing = tokio::spawn(async move {
        let code = publisher.publish(topic, QoS::ExactlyOnce, payload).await;
        (code, publisher)
    });
    tokio::time::sleep(Duration::from_millis(9_500)).await;
    resume(&nodes[0]);
    (publishing, frozen)
}

/// Ends each `(id, reader)` of [`read_to_end`] with a QoS 1 message on `end/<id>`, and returns
/// what they received before it, reader by reader.
async fn end_readers(publisher: &mut Raw, readers: Vec<(&str, Reader)>) -> Vec<String> {
    let mut received = Vec::new();
    for (id, reader) in readers {
        assert_eq!(
            publisher
                .publish(&format!("end/{id}"), QoS::AtLeastOnce, "end")
                .await,
            0x00
        );
        let (client, got) = reader.await.expect("reader");
        eprintln!("{id} received {got:?}");
        received.extend(got);
        client.disconnect().await;
    }
    received
}

/// Three nodes whose control-plane lease is 20 s: a node may hang past the mesh's call timeout
/// (8 s) without being counted down.
fn three_nodes_with_a_long_lease() -> (tempfile::TempDir, Vec<Node>, [SocketAddr; 3]) {
    let root = tempfile::tempdir().expect("a temporary directory");
    let addrs: Vec<SocketAddr> = (0..3).map(|_| common::free_addr()).collect();
    let nodes = tokio::task::block_in_place(|| {
        let nodes = start_founders_with(root.path(), &addrs, &["--cluster-lease", "20"], |_| {
            Vec::new()
        });
        let refs: Vec<&Node> = nodes.iter().collect();
        eventually("three nodes agree", || agreed(&refs, &[1, 2, 3]));
        nodes
    });
    let addrs = [0, 1, 2].map(|i| nodes[i].server.addr);
    (root, nodes, addrs)
}

/// Decision 0066 case 2 at QoS 2 for a session: node 1 hangs just before a QoS 2 publish on
/// node 2 reaches its persistent session `c2-away` (away), past the call timeout but within its
/// lease: node 2 holds the message; node 1, answering again, takes the copy in (queued in the
/// session's row, with its number), then dies. The session is adopted with the message queued,
/// and the held message goes again to the sessions put back since — this one. It gets the
/// message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_qos2_message_its_dead_node_took_in_too_late_reaches_the_adopted_session_once() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes_with_a_long_lease();
    let (mut away, present) = accepted(n1, "c2-away", true, 3600, None).await;
    assert!(!present);
    away.subscribe("c2/t", QoS::ExactlyOnce).await;
    away.subscribe("end/c2-away", QoS::AtLeastOnce).await;
    away.disconnect().await;
    // Hears, on node 1, when node 1 took the copy in.
    let (mut probe, _) = accepted(n1, "c2-probe", true, 0, None).await;
    probe.subscribe("c2/t", QoS::AtMostOnce).await;
    let publisher = accepted(n2, "c2-pub", true, 0, None).await.0;

    let (publishing, frozen) =
        publish_qos2_while_node_1_hangs(&nodes, publisher, "c2/t", "m").await;
    match probe.recv().await {
        Packet::Publish(p) => assert_eq!(&p.payload[..], b"m"),
        other => panic!("c2-probe: unexpected {other:?}"),
    }
    eprintln!(
        "node 1 took the copy in {:?} after it hung",
        frozen.elapsed()
    );
    // The batch is answered once the copy is durable in the session's row; the answer is lost.
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| nodes[0].server.kill9());
    let (code, mut publisher) = publishing.await.expect("publisher");
    assert_eq!(code, 0x00);
    eprintln!("acknowledged {:?} after node 1 hung", frozen.elapsed());

    let away = adopted(n3, "c2-away", frozen).await;
    assert_eq!(
        publisher
            .publish("end/c2-away", QoS::AtLeastOnce, "end")
            .await,
        0x00
    );
    let (away, received) = read_to_end(away, "c2-away".to_owned()).await;
    assert_eq!(received, ["m"], "a QoS 2 message delivered twice, or lost");
    away.disconnect().await;
    drop((publisher, probe));
}
