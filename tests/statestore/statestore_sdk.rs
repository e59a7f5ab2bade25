//! The official Rust SDK (`azure_iot_operations_services` 1.3.0) against a real `mqstate serve`: every
//! state-store command, fencing tokens, observe/notifications (including expiry-driven DELETE), the
//! leased-lock client, and a server restart that must keep the MQTT session (the SDK treats Session
//! Present = 0 as fatal). Each test has its own server, unique client ids and a time bound.

use crate::common;

use std::time::{Duration, SystemTime};

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::leased_lock::{self, lease, lock};
use azure_iot_operations_services::state_store::{
    Operation, ServiceError, SetCondition, SetOptions,
};
use common::sdk::{
    bounded, hlc_order, next_notification, service_error, token_at, with_condition, within,
    SdkClient, REQUEST_TIMEOUT,
};

/// Upper bound for a whole test: a hang guard, not a performance claim.
const TEST_BOUND: Duration = Duration::from_secs(90);
/// Spec §6: an expired key's DELETE notification arrives "within about a second" of its deadline.
const EXPIRY_NOTIFY_GRACE: Duration = Duration::from_millis(1500);

fn unconditional() -> SetOptions {
    SetOptions::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_get_del_vdel() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let c = SdkClient::connect(server.port(), "sdk-basic").await;

        let set = c.set(b"k", b"v", unconditional()).await;
        assert!(set.response);
        let v1 = set.version.expect("SET returns the new version");
        let get = c.get(b"k").await;
        assert_eq!(get.response.as_deref(), Some(&b"v"[..]));
        assert_eq!(
            get.version.as_ref(),
            Some(&v1),
            "GET returns the version SET returned"
        );

        let set2 = c
            .set(
                b"k",
                b"v2",
                SetOptions {
                    persist: true,
                    ..SetOptions::default()
                },
            )
            .await;
        assert!(set2.response);
        assert!(
            hlc_order(set2.version.as_ref().unwrap()) > hlc_order(&v1),
            "versions increase"
        );

        let miss = c.get(b"absent").await;
        assert_eq!(miss.response, None);
        assert_eq!(miss.version, None, "no version on a GET miss");

        assert_eq!(c.del(b"k", None).await.unwrap().response, 1);
        assert_eq!(c.del(b"k", None).await.unwrap().response, 0);
        assert_eq!(c.get(b"k").await.response, None);

        assert_eq!(c.vdel(b"k", b"v").await, 0);
        c.set(b"k", b"v", unconditional()).await;
        assert_eq!(c.vdel(b"k", b"other").await, -1);
        assert_eq!(c.get(b"k").await.response.as_deref(), Some(&b"v"[..]));
        assert_eq!(c.vdel(b"k", b"v").await, 1);
        assert_eq!(c.get(b"k").await.response, None);

        // Empty values and large keys and values round-trip through the SDK too.
        c.set(b"empty", b"", unconditional()).await;
        assert_eq!(c.get(b"empty").await.response, Some(Vec::new()));
        let big_key = vec![b'k'; 6_500];
        let big_value: Vec<u8> = (0..65_000u32).map(|i| (i % 253) as u8).collect();
        assert!(c.set(&big_key, &big_value, unconditional()).await.response);
        assert_eq!(c.get(&big_key).await.response, Some(big_value));

        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_conditions() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let c = SdkClient::connect(server.port(), "sdk-cond").await;

        assert!(
            c.set(
                b"nx",
                b"a",
                with_condition(SetCondition::OnlyIfDoesNotExist)
            )
            .await
            .response
        );
        let refused = c
            .set(
                b"nx",
                b"b",
                with_condition(SetCondition::OnlyIfDoesNotExist),
            )
            .await;
        assert!(!refused.response);
        assert_eq!(c.get(b"nx").await.response.as_deref(), Some(&b"a"[..]));

        let nex = with_condition(SetCondition::OnlyIfEqualOrDoesNotExist);
        assert!(
            c.set(b"nex", b"a", nex.clone()).await.response,
            "absent: applies"
        );
        assert!(
            c.set(b"nex", b"a", nex.clone()).await.response,
            "equal: applies"
        );
        assert!(
            !c.set(b"nex", b"b", nex).await.response,
            "different: not applied"
        );
        assert_eq!(c.get(b"nex").await.response.as_deref(), Some(&b"a"[..]));

        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_removes_the_key_and_notifies_delete() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let c = SdkClient::connect(server.port(), "sdk-expiry").await;
        let mut observation = c.observe(b"k").await;

        let expires = Duration::from_millis(400);
        let set = c
            .set(
                b"k",
                b"v",
                SetOptions {
                    expires: Some(expires),
                    ..SetOptions::default()
                },
            )
            .await;
        assert!(set.response);
        let n = next_notification(&mut observation).await;
        assert_eq!(n.operation, Operation::Set(b"v".to_vec()));
        // No reads from here on: only active expiry can produce the DELETE.
        let n = tokio::time::timeout(
            expires + EXPIRY_NOTIFY_GRACE,
            observation.recv_notification(),
        )
        .await
        .expect("expiry DELETE notification within ~1 s of the deadline")
        .expect("notification channel open")
        .0;
        assert_eq!(n.operation, Operation::Del);
        assert_eq!(n.key, b"k".to_vec());
        assert!(hlc_order(&n.version) > hlc_order(set.version.as_ref().unwrap()));
        assert_eq!(c.get(b"k").await.response, None);

        // A key with a long expiry is readable before it expires.
        let long = SetOptions {
            expires: Some(Duration::from_secs(60)),
            ..SetOptions::default()
        };
        c.set(b"long", b"v", long).await;
        assert_eq!(c.get(b"long").await.response.as_deref(), Some(&b"v"[..]));

        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let c = SdkClient::connect(server.port(), "sdk-fence").await;
        let t0 = token_at(0, 0);
        let t1 = token_at(5, 0);
        let t2 = token_at(5, 1);

        assert!(
            c.set_fenced(b"k", b"v1", Some(t1.clone()), unconditional())
                .await
                .unwrap()
                .response
        );
        let err = c
            .set_fenced(b"k", b"x", None, unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::MissingFencingToken),
            "{err:?}"
        );
        let err = c
            .set_fenced(b"k", b"x", Some(t0.clone()), unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
            "{err:?}"
        );
        assert!(
            c.set_fenced(b"k", b"v2", Some(t1.clone()), unconditional())
                .await
                .unwrap()
                .response
        );
        assert!(
            c.set_fenced(b"k", b"v3", Some(t2.clone()), unconditional())
                .await
                .unwrap()
                .response
        );
        let err = c
            .set_fenced(b"k", b"x", Some(t1.clone()), unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
            "{err:?}"
        );
        assert_eq!(c.get(b"k").await.response.as_deref(), Some(&b"v3"[..]));

        let future = HybridLogicalClock {
            timestamp: SystemTime::now() + Duration::from_secs(120),
            counter: 0,
            node_id: "sdk-test".into(),
        };
        let err = c
            .set_fenced(b"k", b"x", Some(future), unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::FencingTokenSkew),
            "{err:?}"
        );

        let err = c.del(b"k", None).await.unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::MissingFencingToken),
            "{err:?}"
        );
        assert_eq!(c.del(b"k", Some(t2)).await.unwrap().response, 1);
        // The token went away with the key.
        assert!(c.set(b"k", b"free", unconditional()).await.response);

        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_notifications_and_unobserve() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let watcher = SdkClient::connect(server.port(), "sdk-watcher").await;
        let writer = SdkClient::connect(server.port(), "sdk-writer").await;
        let mut observation = watcher.observe(b"k").await;

        let set = writer.set(b"k", b"v1", unconditional()).await;
        let n = next_notification(&mut observation).await;
        assert_eq!(n.key, b"k".to_vec());
        assert_eq!(n.operation, Operation::Set(b"v1".to_vec()));
        assert_eq!(
            Some(&n.version),
            set.version.as_ref(),
            "notification carries the change's version"
        );

        // A SET that is not applied notifies nothing; the next notification is the following change.
        assert!(
            !writer
                .set(b"k", b"x", with_condition(SetCondition::OnlyIfDoesNotExist))
                .await
                .response
        );
        assert_eq!(writer.vdel(b"k", b"mismatch").await, -1);
        // The watcher's own write notifies it too.
        let own = watcher.set(b"k", b"v2", unconditional()).await;
        let n = next_notification(&mut observation).await;
        assert_eq!(n.operation, Operation::Set(b"v2".to_vec()));
        assert_eq!(Some(&n.version), own.version.as_ref());

        assert_eq!(writer.del(b"k", None).await.unwrap().response, 1);
        let n = next_notification(&mut observation).await;
        assert_eq!(n.operation, Operation::Del);

        writer.set(b"k", b"v3", unconditional()).await;
        assert_eq!(writer.vdel(b"k", b"v3").await, 1);
        assert_eq!(
            next_notification(&mut observation).await.operation,
            Operation::Set(b"v3".to_vec())
        );
        assert_eq!(
            next_notification(&mut observation).await.operation,
            Operation::Del
        );

        let stopped = within(
            "unobserve",
            watcher.store.unobserve(b"k".to_vec(), REQUEST_TIMEOUT),
        )
        .await
        .unwrap();
        assert!(stopped.response, "unobserve of an observed key");
        let again = within(
            "unobserve",
            watcher.store.unobserve(b"k".to_vec(), REQUEST_TIMEOUT),
        )
        .await
        .unwrap();
        assert!(!again.response, "unobserve of a key no longer observed");

        watcher.shutdown().await;
        writer.shutdown().await;
    })
    .await;
}

fn lock_client(c: &SdkClient, name: &[u8]) -> lock::Client {
    lock::Client::new(c.store.clone(), name.to_vec(), c.id.as_bytes().to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_acquire_renew_fenced_write_release() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let c = SdkClient::connect(server.port(), "sdk-lock").await;
        let lock = lock_client(&c, b"the-lock");

        let token = within(
            "lock",
            lock.lock(Duration::from_secs(10), REQUEST_TIMEOUT, None),
        )
        .await
        .unwrap();
        assert_eq!(lock.current_lock_fencing_token().as_ref(), Some(&token));
        assert_eq!(
            c.get(b"the-lock").await.response,
            Some(c.id.as_bytes().to_vec())
        );
        assert!(
            c.set_fenced(b"resource", b"a", Some(token.clone()), unconditional())
                .await
                .unwrap()
                .response
        );

        // Renewal: the holder locks again and gets a newer token from the same service node.
        let renewed = within(
            "renew",
            lock.lock(Duration::from_secs(10), REQUEST_TIMEOUT, None),
        )
        .await
        .unwrap();
        assert!(
            hlc_order(&renewed) > hlc_order(&token),
            "renewal yields a newer token"
        );
        assert_eq!(
            renewed.node_id, token.node_id,
            "one stable node id for the service"
        );
        assert!(
            c.set_fenced(b"resource", b"b", Some(renewed.clone()), unconditional())
                .await
                .unwrap()
                .response
        );
        let err = c
            .set_fenced(b"resource", b"stale", Some(token), unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
            "{err:?}"
        );
        let err = c
            .set_fenced(b"resource", b"unfenced", None, unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::MissingFencingToken),
            "{err:?}"
        );

        within("unlock", lock.unlock(REQUEST_TIMEOUT))
            .await
            .unwrap();
        assert_eq!(c.get(b"the-lock").await.response, None);
        assert_eq!(
            c.get(b"resource").await.response.as_deref(),
            Some(&b"b"[..])
        );

        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_contention_between_two_clients() {
    let server = common::Server::start();
    bounded(TEST_BOUND, async {
        let a = SdkClient::connect(server.port(), "sdk-lock-a").await;
        let b = SdkClient::connect(server.port(), "sdk-lock-b").await;
        let lock_a = lock_client(&a, b"shared-lock");
        let lock_b = lock_client(&b, b"shared-lock");

        let token_a = within(
            "lock A",
            lock_a.lock(Duration::from_secs(10), REQUEST_TIMEOUT, None),
        )
        .await
        .unwrap();
        // One attempt by B fails while A holds the lock.
        let probe = lease::Client::new(
            b.store.clone(),
            b"shared-lock".to_vec(),
            b.id.as_bytes().to_vec(),
        )
        .unwrap();
        let err = within(
            "probe",
            probe.acquire(Duration::from_secs(10), REQUEST_TIMEOUT, None),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err.kind(), leased_lock::ErrorKind::LeaseAlreadyHeld),
            "{err:?}"
        );

        // B waits for the lock (observing its key) while A works and then releases.
        let waiter = tokio::spawn(async move {
            let token = lock_b
                .lock(Duration::from_secs(10), REQUEST_TIMEOUT, None)
                .await;
            (lock_b, token)
        });
        assert!(
            a.set_fenced(
                b"resource",
                b"from-a",
                Some(token_a.clone()),
                unconditional()
            )
            .await
            .unwrap()
            .response
        );
        assert_eq!(
            a.get(b"shared-lock").await.response,
            Some(a.id.as_bytes().to_vec()),
            "A still holds the lock"
        );
        within("unlock A", lock_a.unlock(REQUEST_TIMEOUT))
            .await
            .unwrap();

        let (lock_b, token_b) = within("B acquires after A released", waiter).await.unwrap();
        let token_b = token_b.unwrap();
        assert!(hlc_order(&token_b) > hlc_order(&token_a));
        assert_eq!(
            b.get(b"shared-lock").await.response,
            Some(b.id.as_bytes().to_vec())
        );
        assert!(
            b.set_fenced(b"resource", b"from-b", Some(token_b), unconditional())
                .await
                .unwrap()
                .response
        );
        let err = a
            .set_fenced(b"resource", b"late-a", Some(token_a), unconditional())
            .await
            .unwrap_err();
        assert!(
            matches!(service_error(&err), ServiceError::FencingTokenLowerVersion),
            "{err:?}"
        );
        assert_eq!(
            a.get(b"resource").await.response.as_deref(),
            Some(&b"from-b"[..])
        );
        within("unlock B", lock_b.unlock(REQUEST_TIMEOUT))
            .await
            .unwrap();

        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

/// How the restart tests take the server down.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// SIGTERM: the server flushes and exits cleanly.
    Graceful,
    /// SIGKILL: only what was durable before the kill survives.
    Kill,
}

/// A client writes, the server goes down and comes back on the same address and data directory; the
/// SDK must reconnect with Session Present = 1 (else it ends the session) and find its data.
async fn restart_keeps_session_and_data(stop: Stop, client_id: &str) {
    let mut server = common::Server::start();
    let mut c = SdkClient::connect(server.port(), client_id).await;
    let set = c.set(b"durable", b"v", unconditional()).await;
    assert!(set.response);

    // The harness blocks (waits for the process); keep the SDK's tasks running meanwhile.
    tokio::task::block_in_place(|| match stop {
        Stop::Graceful => {
            let status = server.stop();
            assert!(status.success(), "graceful stop exited with {status}");
        }
        Stop::Kill => server.kill9(),
    });
    within("disconnect noticed", c.monitor.disconnected()).await;
    tokio::task::block_in_place(|| server.restart());
    c.wait_connected().await;

    bounded(TEST_BOUND, async {
        let get = c.get(b"durable").await;
        assert_eq!(
            get.response.as_deref(),
            Some(&b"v"[..]),
            "{stop:?}: acknowledged write lost"
        );
        assert_eq!(
            get.version, set.version,
            "{stop:?}: the version survives the restart"
        );
        let after = c.set(b"durable", b"v2", unconditional()).await;
        assert!(
            hlc_order(after.version.as_ref().unwrap()) > hlc_order(set.version.as_ref().unwrap())
        );
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_restart_keeps_session_and_data() {
    restart_keeps_session_and_data(Stop::Graceful, "sdk-restart-term").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_restart_keeps_session_and_data() {
    restart_keeps_session_and_data(Stop::Kill, "sdk-restart-kill").await;
}
