//! The authentication and authorization ports as a client sees them: refused CONNECTs carry only a
//! reason code, unauthorized PUBLISH/SUBSCRIBE get 0x87, repeated failures from one address are
//! rate-limited, re-authentication is refused, and services learn the publisher's identity.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use mqstate_broker::auth::{ConnectAttempt, Refusal};
use mqstate_broker::{Authenticator, Authorizer, BrokerConfig, Identity, Principal, Security};
use rmqtt_codec::v5::{self, Packet};

/// `alice`/`secret` by password; `K8S-SAT` with data `good-token` as `sa`; nothing else.
#[derive(Default)]
struct TestAuthenticator {
    calls: AtomicUsize,
}

impl Authenticator for TestAuthenticator {
    fn authenticate(&self, a: &ConnectAttempt) -> Result<Identity, Refusal> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let user = |name: &str| Identity {
            user: Some(name.into()),
            cert: None,
        };
        match (a.auth_method.as_deref(), a.username.as_deref()) {
            (Some("K8S-SAT"), _) if a.auth_data.as_deref() == Some(&b"good-token"[..]) => {
                Ok(user("sa"))
            }
            (Some("K8S-SAT"), _) => Err(Refusal::NotAuthorized),
            (Some(_), _) => Err(Refusal::BadAuthenticationMethod),
            (None, Some("alice")) if a.password.as_deref() == Some(&b"secret"[..]) => {
                Ok(user("alice"))
            }
            (None, Some(_)) => Err(Refusal::BadCredentials),
            (None, None) => Err(Refusal::NotAuthorized),
        }
    }
}

/// Publish and subscribe only under `users/<user>/` and `clients/<client id>/`.
struct OwnTopics;

impl OwnTopics {
    fn allowed(who: Principal<'_>, topic: &str) -> bool {
        let user = who.identity.user.as_deref().unwrap_or("-");
        topic.starts_with(&format!("users/{user}/"))
            || topic.starts_with(&format!("clients/{}/", who.client_id))
    }
}

impl Authorizer for OwnTopics {
    fn may_publish(&self, who: Principal<'_>, topic: &str) -> bool {
        Self::allowed(who, topic)
    }

    fn may_subscribe(&self, who: Principal<'_>, filter: &str) -> bool {
        Self::allowed(who, filter)
    }
}

async fn secured(config: BrokerConfig) -> (Server, Arc<TestAuthenticator>) {
    let authenticator = Arc::new(TestAuthenticator::default());
    let security = Security {
        authenticator: authenticator.clone(),
        authorizer: Arc::new(OwnTopics),
    };
    (Server::start_secured(config, security).await, authenticator)
}

fn login(id: &str, user: Option<&str>, password: Option<&'static [u8]>) -> v5::Connect {
    v5::Connect {
        username: user.map(Into::into),
        password: password.map(Bytes::from_static),
        ..connect_packet(id, true, 0)
    }
}

fn enhanced(id: &str, method: &str, data: &'static [u8]) -> v5::Connect {
    v5::Connect {
        auth_method: Some(method.into()),
        auth_data: Some(Bytes::from_static(data)),
        ..connect_packet(id, true, 0)
    }
}

/// Connects and returns the CONNACK reason code; a refused connection must then be closed.
async fn connack_code(s: &Server, connect: v5::Connect) -> (Raw, u8) {
    let (c, ack) = Raw::connect_with(s.addr, connect).await;
    (c, u8::from(ack.reason_code))
}

async fn assert_refused(s: &Server, connect: v5::Connect, code: u8) {
    let (mut c, ack) = Raw::connect_with(s.addr, connect).await;
    assert_eq!(u8::from(ack.reason_code), code);
    assert_eq!(
        ack.reason_string, None,
        "a refused CONNECT must not say why"
    );
    assert!(
        c.recv().await.is_none(),
        "connection must close after refusal"
    );
}

#[tokio::test]
async fn credentials_are_checked_and_refusals_leak_nothing() {
    let (s, _) = secured(BrokerConfig::default()).await;
    assert_refused(&s, login("c1", Some("alice"), Some(b"wrong")), 0x86).await;
    assert_refused(&s, login("c2", Some("mallory"), Some(b"secret")), 0x86).await;
    assert_refused(&s, login("c3", None, None), 0x87).await;
    assert_refused(&s, enhanced("c4", "SCRAM-SHA-256", b"x"), 0x8C).await;
    assert_refused(&s, enhanced("c5", "K8S-SAT", b"expired"), 0x87).await;
    assert_eq!(
        s.broker.session_count(),
        0,
        "no session for refused clients"
    );

    let (_c, code) = connack_code(&s, login("c6", Some("alice"), Some(b"secret"))).await;
    assert_eq!(code, 0x00);
    let (_c, ack) = Raw::connect_with(s.addr, enhanced("c7", "K8S-SAT", b"good-token")).await;
    assert_eq!(u8::from(ack.reason_code), 0x00);
    assert_eq!(
        ack.auth_method.as_deref(),
        Some("K8S-SAT"),
        "CONNACK echoes the accepted method"
    );
}

#[tokio::test]
async fn unauthorized_publish_and_subscribe_get_0x87() {
    let (s, _) = secured(BrokerConfig::default()).await;
    let (mut watcher, _) =
        Raw::connect_with(s.addr, login("w", Some("alice"), Some(b"secret"))).await;
    assert_eq!(
        watcher.subscribe("users/alice/#", 1).await,
        vec![v5::SubscribeAckReason::GrantedQos1]
    );
    assert_eq!(
        watcher.subscribe("users/bob/#", 1).await,
        vec![v5::SubscribeAckReason::NotAuthorized]
    );
    assert_eq!(
        watcher.subscribe("$share/g/users/bob/#", 1).await,
        vec![v5::SubscribeAckReason::NotAuthorized],
        "shared subscriptions are checked on their filter"
    );

    let (mut alice, _) =
        Raw::connect_with(s.addr, login("p", Some("alice"), Some(b"secret"))).await;
    assert_eq!(alice.publish_acked("users/bob/x", b"no", 1).await, 0x87);
    // QoS 2: PUBREC 0x87 ends the flow.
    alice.publish("users/bob/x", b"no", 2, 2, false).await;
    match alice.expect().await {
        Packet::PublishReceived(a) => assert_eq!(u8::from(a.reason_code), 0x87),
        other => panic!("expected PUBREC, got {other:?}"),
    }
    // QoS 0: dropped silently; the connection stays up.
    alice.publish("users/bob/zero", b"no", 0, 0, false).await;
    assert_eq!(alice.publish_acked("clients/p/ok", b"yes", 3).await, 0x00);
    assert_eq!(alice.publish_acked("users/alice/t", b"yes", 4).await, 0x00);

    let got = watcher.expect_publish().await;
    assert_eq!(&got.topic[..], "users/alice/t");
    assert!(watcher.ping().await.is_empty(), "nothing else was routed");
}

#[tokio::test]
async fn unauthorized_will_topic_refuses_the_connect() {
    let (s, _) = secured(BrokerConfig::default()).await;
    let mut connect = login("willy", Some("alice"), Some(b"secret"));
    connect.last_will = Some(will("users/bob/status", b"gone", 1, false, None));
    assert_refused(&s, connect, 0x87).await;
}

#[tokio::test]
async fn repeated_failures_from_one_address_are_refused_without_checking() {
    let config = BrokerConfig {
        auth_failure_burst: 3,
        auth_failure_refill: Duration::from_secs(3600),
        ..BrokerConfig::default()
    };
    let (s, authenticator) = secured(config).await;
    for i in 0..3 {
        assert_refused(
            &s,
            login(&format!("g{i}"), Some("alice"), Some(b"guess")),
            0x86,
        )
        .await;
    }
    assert_eq!(authenticator.calls.load(Ordering::SeqCst), 3);
    // Even the right password is refused now, and the authenticator is not asked.
    assert_refused(&s, login("g-right", Some("alice"), Some(b"secret")), 0x87).await;
    assert_eq!(authenticator.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn re_authentication_is_refused_with_disconnect() {
    let (s, _) = secured(BrokerConfig::default()).await;
    let (mut c, ack) = Raw::connect_with(s.addr, enhanced("re", "K8S-SAT", b"good-token")).await;
    assert_eq!(u8::from(ack.reason_code), 0x00);
    c.send(Packet::Auth(v5::Auth {
        reason_code: v5::AuthReasonCode::ReAuth,
        auth_method: Some("K8S-SAT".into()),
        auth_data: Some(Bytes::from_static(b"good-token")),
        ..v5::Auth::default()
    }))
    .await;
    match c.expect().await {
        Packet::Disconnect(d) => {
            assert_eq!(u8::from(d.reason_code), 0x87);
            assert!(d
                .reason_string
                .is_some_and(|r| r.contains("re-authentication")));
        }
        other => panic!("expected DISCONNECT, got {other:?}"),
    }
}

#[tokio::test]
async fn services_see_the_publishers_identity() {
    let (s, _) = secured(BrokerConfig::default()).await;
    let mut inbox = s.broker.claim_topic("clients/svc/invoke").unwrap();
    let (mut c, _) = Raw::connect_with(s.addr, login("svc", Some("alice"), Some(b"secret"))).await;
    c.publish("clients/svc/invoke", b"req", 1, 1, false).await;
    let req = tokio::time::timeout(GUARD, inbox.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&*req.client_id, "svc");
    assert_eq!(req.identity.user.as_deref(), Some("alice"));
}

#[tokio::test]
async fn default_security_lets_everyone_in() {
    let s = Server::start_secured(BrokerConfig::default(), Security::default()).await;
    let (mut c, code) = connack_code(&s, login("anon", None, None)).await;
    assert_eq!(code, 0x00);
    assert_eq!(c.publish_acked("any/topic", b"x", 1).await, 0x00);
    assert_eq!(
        c.subscribe("#", 1).await,
        vec![v5::SubscribeAckReason::GrantedQos1]
    );
}

/// Lets everyone in, slowly (like a password hash), and records how many calls overlapped.
#[derive(Default)]
struct SlowAuthenticator {
    running: AtomicUsize,
    most: AtomicUsize,
}

impl Authenticator for SlowAuthenticator {
    fn authenticate(&self, _: &ConnectAttempt) -> Result<Identity, Refusal> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        self.running.fetch_sub(1, Ordering::SeqCst);
        Ok(Identity::default())
    }
}

#[tokio::test]
async fn a_burst_of_connects_authenticates_on_at_most_one_thread_per_core() {
    let authenticator = Arc::new(SlowAuthenticator::default());
    let security = Security {
        authenticator: authenticator.clone(),
        authorizer: Arc::new(mqstate_broker::auth::AllowAll),
    };
    let s = Server::start_secured(BrokerConfig::default(), security).await;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let clients = (0..cores * 4 + 4).map(|i| {
        let addr = s.addr;
        tokio::spawn(async move {
            Raw::connect_with(addr, login(&format!("burst-{i}"), None, None)).await
        })
    });
    for client in clients.collect::<Vec<_>>() {
        let (_c, ack) = client.await.unwrap();
        assert_eq!(u8::from(ack.reason_code), 0x00);
    }
    let most = authenticator.most.load(Ordering::SeqCst);
    assert!(
        (1..=cores).contains(&most),
        "{most} authentications ran at once on {cores} cores"
    );
}
