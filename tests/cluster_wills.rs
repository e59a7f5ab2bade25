//! One broker across nodes when a node dies (issue 16, decision 0063), on three real
//! `mqstate serve` processes with a raw MQTT 5 client:
//!
//! * the will of a **clean** session (session expiry 0) whose node is killed with `kill -9` is
//!   published, once, by the node that settles the dead node's rows — as one node publishes it
//!   when the connection ends; a client that disconnected normally has no will published; a
//!   client that reconnects elsewhere at once, clean and with a will of its own, does not take the
//!   old will row over before that will is published (decision 0066);
//! * a persistent session's pending delayed will on a running node goes out at once, once, when
//!   its client comes back clean on another node (the session ends: MQTT 5 publishes the will
//!   when its delay passes or its session ends, whichever is first);
//! * a retained message cleared while a node was down does not come back when that node rejoins
//!   after every node that saw the clear restarted (the clear is durable).
//!
//! (Before: the clean session's will died with its node — no row held it; the pending delayed
//! will was dropped by the node that held it when the clean start claimed the client id; and a
//! restarted node forgot the clears it had seen, so the rejoining node's stale copy came back
//! everywhere.)

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::cluster::{
    accepted, agreed, eventually, no_more_wills, retain_until_held, retained_after_restart,
    retained_at, route_heard, three_nodes, will_watcher, Node, FAILOVER_WAIT,
};
use common::mqtt::will_of;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_will_of_a_clean_session_on_a_dead_node_is_published_once() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();

    let mut watcher = will_watcher(n2, "will-watcher").await;

    // A clean client that leaves normally: its will is deleted with it (on one node too).
    let (quiet, _) = accepted(n1, "clean-quiet", true, 0, will_of("clean-quiet", 0)).await;
    quiet.disconnect().await;
    // Clean sessions connected to node 1 when it dies; a clean session ends with its connection,
    // so a will delay does not hold its will back (as on one node).
    let (at_once, present) = accepted(n1, "clean-now", true, 0, will_of("clean-now", 0)).await;
    assert!(!present);
    let (delayed, _) = accepted(n1, "clean-delay", true, 0, will_of("clean-delay", 3600)).await;
    // MQTT 5 Clean Start 0 with expiry 0: a clean session too.
    let (resumed, _) = accepted(n1, "clean-resume", false, 0, will_of("clean-resume", 0)).await;
    // Without a will: nothing kept, nothing published.
    let (plain, _) = accepted(n1, "clean-plain", true, 0, None).await;
    // Back on node 3 at once, clean and without a will (as the SDKs reconnect): before node 1
    // counts as down, so its will row is left to whoever settles node 1's rows.
    let (back, _) = accepted(n1, "clean-back", true, 0, will_of("clean-back", 0)).await;
    // Back on node 2 at once, clean and with a will of its own (a row of its own): the old will
    // row is not taken over before its will is published, once (decision 0066).
    let (back_will, _) = accepted(
        n1,
        "clean-back-will",
        true,
        0,
        will_of("clean-back-will", 0),
    )
    .await;

    tokio::task::block_in_place(|| nodes[0].server.kill9());
    drop((at_once, delayed, resumed, plain, back, back_will));
    let killed = Instant::now();
    let (back, _) = accepted(n3, "clean-back", true, 0, None).await;
    let (back_will, _) =
        accepted(n2, "clean-back-will", true, 0, will_of("clean-back-new", 0)).await;

    let everyone: BTreeSet<String> = [
        "clean-now",
        "clean-delay",
        "clean-resume",
        "clean-back",
        "clean-back-will",
    ]
    .iter()
    .map(|id| format!("will/{id}"))
    .collect();
    let mut wills = BTreeSet::new();
    while wills != everyone {
        assert!(
            killed.elapsed() < FAILOVER_WAIT,
            "wills after {FAILOVER_WAIT:?}: {wills:?}, not {everyone:?}"
        );
        let will = watcher.next_topic().await;
        eprintln!("{will} {:?} after kill -9 of node 1", killed.elapsed());
        assert!(
            everyone.contains(&will),
            "{will}: not the will of a client connected when node 1 died"
        );
        assert!(wills.insert(will.clone()), "{will} published twice");
    }

    // The rows are settled: a client id of node 1 reconnecting elsewhere has no session and
    // no will of the old connection comes again; a marker published after that comes next.
    let (again, present) = accepted(n3, "clean-resume", false, 0, None).await;
    assert!(!present, "a clean session ended with its node");
    again.disconnect().await;
    no_more_wills(
        &mut watcher,
        n3,
        "will-marker",
        "no will published twice or for a client that left normally",
    )
    .await;
    drop((watcher, back, back_will));
}

/// How long the test waits for a will that is due at once (its delay is far longer).
const PROMPT_WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_start_elsewhere_publishes_a_pending_delayed_will_once() {
    let (_root, _nodes, [n1, n2, n3]) = three_nodes();
    let mut watcher = will_watcher(n2, "delay-watcher").await;

    // Persistent sessions on node 1 whose clients vanish (no DISCONNECT): their wills wait 120 s
    // there, while node 1 stays up.
    let (sdk, _) = accepted(n1, "delay-sdk", false, 300, will_of("delay-sdk", 120)).await;
    let (own, _) = accepted(n1, "delay-own", false, 300, will_of("delay-own", 120)).await;
    drop((sdk, own));
    // Back on node 3 with Clean Start = 1: one as the SDKs reconnect (expiry 0, no will: the
    // CONNACK does not wait for the old row), one with a session of its own (expiry 300).
    let (sdk, present) = accepted(n3, "delay-sdk", true, 0, None).await;
    assert!(!present, "a clean start discards the session");
    let (own, present) = accepted(n3, "delay-own", true, 300, None).await;
    assert!(!present, "a clean start discards the session");
    let back = Instant::now();

    let everyone: BTreeSet<String> = ["will/delay-sdk", "will/delay-own"]
        .iter()
        .map(|t| (*t).to_owned())
        .collect();
    let mut wills = BTreeSet::new();
    while wills != everyone {
        let Ok(will) = tokio::time::timeout(PROMPT_WAIT, watcher.next_topic()).await else {
            panic!("wills {PROMPT_WAIT:?} after the clean starts: {wills:?}, not {everyone:?}");
        };
        eprintln!("{will} {:?} after the clean start", back.elapsed());
        assert!(everyone.contains(&will), "{will}: not a pending will");
        assert!(wills.insert(will.clone()), "{will} published twice");
    }

    // No will comes again: a marker published now is the next thing the watcher hears.
    no_more_wills(
        &mut watcher,
        n3,
        "delay-marker",
        "each pending will published once",
    )
    .await;
    drop((watcher, sdk, own));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_clear_survives_the_restart_of_every_node_that_saw_it() {
    let (_root, mut nodes, [n1, n2, n3]) = three_nodes();
    let (mut publisher, _) = accepted(n1, "retainer", true, 0, None).await;
    // Node 3 holds the message.
    retain_until_held(&mut publisher, &[("r/gone", "v1")], n3).await;

    // Stopped (not killed): what it holds is in its journal.
    tokio::task::block_in_place(|| nodes[2].server.stop());
    // Cleared while node 3 is down, and a marker (last in topic order) that tells when node 3
    // took in the others' retained sets.
    publisher.retain("r/gone", "").await;
    publisher.retain("r/zz-marker", "m").await;
    drop(publisher);
    // Every node that saw the clear restarts, together (one after the other, the second would
    // learn the clear back from the first): only their journals remember it now.
    tokio::task::block_in_place(|| {
        nodes[0].server.kill9();
        nodes[1].server.kill9();
        nodes[0].server.restart();
        nodes[1].server.restart();
        nodes[2].server.restart();
        let refs: Vec<&Node> = nodes.iter().collect();
        let (_, took) = eventually("the restarted nodes agree", || agreed(&refs, &[1, 2, 3]));
        eprintln!("the cluster is back in {took:?}");
    });

    let expected = BTreeMap::from([("r/zz-marker".to_owned(), "m".to_owned())]);
    retained_after_restart(n3, &expected).await;

    // Node 3's own resync reached node 1 (it precedes this route on its stream): its stale
    // copy did not come back on the others.
    let (mut publisher, _) = accepted(n1, "prober", true, 0, None).await;
    let probe = route_heard(&mut publisher, n3).await;
    assert_eq!(retained_at(n1, "r-check-1").await, expected, "node 1");
    assert_eq!(retained_at(n2, "r-check-2").await, expected, "node 2");
    drop((probe, publisher));
}
