//! An official AIO SDK application through `kill -9` of the node it is connected to (issue 16):
//! the application — a state-store client, a leased lock and a key observation on one MQTT
//! session — reaches the cluster through one front address (as through a load balancer); its
//! node is killed and the front leads to another node. The SDK reconnects with the same client
//! id and treats Session Present = 0 as fatal: the session must be found on the survivor, the
//! requests under way complete, the lock is renewed with a newer fencing token, and the
//! application goes on writing, reading and observing.

use crate::common;

use std::future::Future;
use std::time::{Duration, SystemTime};

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::leased_lock::lock;
use azure_iot_operations_services::state_store::{KeyObservation, Operation, SetOptions};
use common::cluster::{formed_cluster, AGREEMENT_TIMEOUT};
use common::proxy::Front;
use common::sdk::{within, SdkClient, REQUEST_TIMEOUT};

/// A hang guard for the whole test, not a performance claim: three processes on a loaded machine.
const TEST_BOUND: Duration = Duration::from_secs(300);
/// How long the application keeps retrying one operation that fails while the cluster fails
/// over (the SDK's own request timeout is [`REQUEST_TIMEOUT`]).
const RETRY_BOUND: Duration = Duration::from_secs(60);

async fn bounded<T>(test: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, test)
        .await
        .expect("test exceeded its time bound")
}

fn order(h: &HybridLogicalClock) -> (SystemTime, u64, String) {
    (h.timestamp, h.counter, h.node_id.clone())
}

/// What an application does with an operation that failed during a fail-over: tries it again,
/// within a bound. Returns the result and how many tries failed.
async fn retried<T, E: std::fmt::Debug, F: Future<Output = Result<T, E>>>(
    what: &str,
    mut op: impl FnMut() -> F,
) -> (T, u32) {
    let started = std::time::Instant::now();
    let mut failed = 0;
    loop {
        match op().await {
            Ok(value) => return (value, failed),
            Err(e) => {
                failed += 1;
                eprintln!("{what}: try {failed} failed: {e:?}");
                assert!(
                    started.elapsed() < RETRY_BOUND,
                    "{what}: still failing: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn next_notification(
    observation: &mut KeyObservation,
) -> azure_iot_operations_services::state_store::KeyNotification {
    tokio::time::timeout(AGREEMENT_TIMEOUT, observation.recv_notification())
        .await
        .expect("a notification")
        .expect("notification channel open")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_application_survives_kill_9_of_its_node() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = tokio::task::block_in_place(|| formed_cluster(root.path()));
    let front = Front::start(nodes[0].server.addr).await;

    let mut app = bounded(SdkClient::connect(front.port(), "fo-app")).await;
    let writer = bounded(SdkClient::connect(nodes[2].server.port(), "fo-writer")).await;
    let lock = lock::Client::new(
        app.store.clone(),
        b"fo/lock".to_vec(),
        app.id.as_bytes().to_vec(),
    )
    .unwrap();
    let (token, mut observation) = bounded(async {
        let token = within(
            "lock",
            lock.lock(Duration::from_secs(30), REQUEST_TIMEOUT, None),
        )
        .await
        .unwrap();
        assert!(
            app.set_fenced(
                b"fo/resource",
                b"before",
                Some(token.clone()),
                SetOptions::default()
            )
            .await
            .unwrap()
            .response
        );
        let observation = app.observe(b"fo/watched").await;
        writer
            .set(b"fo/watched", b"w0", SetOptions::default())
            .await;
        (token, observation)
    })
    .await;
    let first = bounded(next_notification(&mut observation)).await;
    assert_eq!(first.operation, Operation::Set(b"w0".to_vec()));

    // Requests under way while the node dies: the SDK re-sends what was not acknowledged once it
    // is connected again, and every one completes.
    let store = app.store.clone();
    let in_flight = tokio::spawn(async move {
        let mut versions = Vec::new();
        for i in 0..20u32 {
            let value = format!("v{i}").into_bytes();
            let (set, _) = retried("SET under way", || {
                store.set(
                    b"fo/counter".to_vec(),
                    value.clone(),
                    REQUEST_TIMEOUT,
                    None,
                    SetOptions::default(),
                )
            })
            .await;
            assert!(set.response);
            versions.push(set.version.expect("a SET's version"));
        }
        versions
    });
    // Let a few complete before the kill (not a timing assertion: any number is correct).
    tokio::time::sleep(Duration::from_millis(300)).await;
    nodes[0].server.kill9();
    front.switch(nodes[1].server.addr);

    bounded(async {
        within("the SDK notices the kill", app.monitor.disconnected()).await;
        // Fails at once if the SDK ended the session (Session Present = 0 on reconnect).
        tokio::time::timeout(AGREEMENT_TIMEOUT, app.wait_connected())
            .await
            .expect("reconnected through the front");

        let versions = within("the requests under way", in_flight)
            .await
            .expect("every SET under way completed");
        for pair in versions.windows(2) {
            assert!(order(&pair[1]) > order(&pair[0]), "versions grow: {pair:?}");
        }
        assert_eq!(
            app.get(b"fo/counter").await.response.as_deref(),
            Some(&b"v19"[..])
        );

        // The lock: renewed (the same holder), with a newer fencing token, which fences the old.
        let (renewed, _) = retried("renew the lock", || {
            lock.lock(Duration::from_secs(30), REQUEST_TIMEOUT, None)
        })
        .await;
        assert!(order(&renewed) > order(&token));
        assert!(
            app.set_fenced(
                b"fo/resource",
                b"after",
                Some(renewed.clone()),
                SetOptions::default()
            )
            .await
            .unwrap()
            .response
        );
        assert!(app
            .set_fenced(
                b"fo/resource",
                b"stale",
                Some(token.clone()),
                SetOptions::default()
            )
            .await
            .is_err());
        assert_eq!(
            app.get(b"fo/resource").await.response.as_deref(),
            Some(&b"after"[..])
        );

        // Observing: the SDK drops its observations when its connection drops and the
        // application observes again; writes through the third node reach it on its new node.
        let (again, _) = retried("observe again", || {
            app.store.observe(b"fo/watched".to_vec(), REQUEST_TIMEOUT)
        })
        .await;
        let mut observation = again.response;
        writer
            .set(b"fo/watched", b"w1", SetOptions::default())
            .await;
        let n = next_notification(&mut observation).await;
        assert_eq!(n.operation, Operation::Set(b"w1".to_vec()));
        assert!(order(&n.version) > order(&first.version));

        within("unlock", lock.unlock(REQUEST_TIMEOUT))
            .await
            .unwrap();
        assert_eq!(app.get(b"fo/lock").await.response, None);
        app.shutdown().await;
        writer.shutdown().await;
    })
    .await;
}
