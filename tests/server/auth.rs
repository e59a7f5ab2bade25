//! Authentication and authorization against the real `mqstate serve`: password file (made with
//! `mqstate passwd`), `K8S-SAT` tokens, anonymous refusal, failure rate limiting, the ACL file for topics
//! (with %c/%u) and for state-store keys (through the official SDK), and the state store's built-in
//! topic rules, which hold with no configuration at all.

use crate::common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use azure_iot_operations_services::state_store::{self, ErrorKind, ServiceError, SetOptions};
use bytes::Bytes;
use common::sdk::SdkClient;
use rumqttc::v5::mqttbytes::v5::{
    ConnectProperties, ConnectReturnCode, Packet, PubAckReason, PublishProperties,
    SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, StateError};

const SERVICE_ID: &str = "FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";
/// Hang guard for every wait; not a performance claim.
const WAIT: Duration = Duration::from_secs(15);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn invoke_topic() -> String {
    format!("statestore/v1/{SERVICE_ID}/command/invoke")
}

fn hex_upper(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

fn notify_filter(client_id: &str) -> String {
    format!(
        "clients/statestore/v1/{SERVICE_ID}/{}/command/notify/+",
        hex_upper(client_id.as_bytes())
    )
}

/// `mqstate passwd ARGS...` with `stdin` as standard input; returns whether it succeeded.
fn passwd(args: &[&str], stdin: &str) -> bool {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("passwd")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn mqstate passwd");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait().unwrap().success()
}

/// A password file with alice/wonderland and bob/builder.
fn password_file(dir: &Path) -> PathBuf {
    let path = dir.join("passwd");
    let file = path.to_str().unwrap();
    assert!(passwd(
        &["-c", "--password-stdin", file, "alice"],
        "wonderland\n"
    ));
    assert!(passwd(&["--password-stdin", file, "bob"], "builder\n"));
    assert!(passwd(&["--password-stdin", file, "carol"], "x\n"));
    assert!(passwd(&["-D", file, "carol"], ""));
    assert!(!passwd(&["-D", file, "carol"], ""), "deleting twice fails");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("alice:$argon2id$"), "{text}");
    assert!(!text.contains("wonderland"), "no plain text password");
    path
}

fn options(port: u16, id: &str) -> MqttOptions {
    let mut o = MqttOptions::new(id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    o
}

/// Connects; `Ok` after CONNACK success, `Err` with the refusal code otherwise.
async fn connect(o: MqttOptions) -> Result<(AsyncClient, EventLoop), ConnectReturnCode> {
    let (client, mut events) = AsyncClient::new(o, 64);
    let first = tokio::time::timeout(WAIT, events.poll())
        .await
        .expect("no CONNACK in time");
    match first {
        Ok(Event::Incoming(Packet::ConnAck(_))) => Ok((client, events)),
        Err(ConnectionError::ConnectionRefused(code)) => Err(code),
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

async fn login(port: u16, id: &str, user: &str, password: &str) -> Result<(), ConnectReturnCode> {
    let mut o = options(port, id);
    o.set_credentials(user, password);
    connect(o).await.map(|_| ())
}

/// Polls until `pick` returns something, or the connection ends with an error (returned as `Err`).
async fn next<T>(
    events: &mut EventLoop,
    mut pick: impl FnMut(&Event) -> Option<T>,
) -> Result<T, ConnectionError> {
    tokio::time::timeout(WAIT, async {
        loop {
            let event = events.poll().await?;
            if let Some(t) = pick(&event) {
                return Ok(t);
            }
        }
    })
    .await
    .expect("nothing within the wait")
}

async fn subscribe_result(
    c: &AsyncClient,
    e: &mut EventLoop,
    filter: &str,
) -> Result<(), SubscribeReasonCode> {
    c.subscribe(filter, QoS::AtLeastOnce).await.unwrap();
    match next(e, |ev| {
        matches!(ev, Event::Incoming(Packet::SubAck(_))).then_some(())
    })
    .await
    {
        Ok(()) => Ok(()),
        Err(ConnectionError::MqttState(StateError::SubFail { reason })) => Err(reason),
        Err(other) => panic!("subscribe {filter}: {other}"),
    }
}

async fn publish_result(
    c: &AsyncClient,
    e: &mut EventLoop,
    topic: &str,
    properties: PublishProperties,
) -> Result<(), PubAckReason> {
    c.publish_with_properties(topic, QoS::AtLeastOnce, false, "x", properties)
        .await
        .unwrap();
    match next(e, |ev| {
        matches!(ev, Event::Incoming(Packet::PubAck(_))).then_some(())
    })
    .await
    {
        Ok(()) => Ok(()),
        Err(ConnectionError::MqttState(StateError::PubAckFail { reason })) => Err(reason),
        Err(other) => panic!("publish {topic}: {other}"),
    }
}

#[tokio::test]
async fn passwords_are_verified_and_anonymous_clients_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = password_file(dir.path());
    let server = common::Server::start_with(&["--password-file", file.to_str().unwrap()]);
    let port = server.port();
    assert_eq!(login(port, "a1", "alice", "wonderland").await, Ok(()));
    assert_eq!(login(port, "b1", "bob", "builder").await, Ok(()));
    assert_eq!(
        login(port, "a2", "alice", "wrong").await,
        Err(ConnectReturnCode::BadUserNamePassword)
    );
    assert_eq!(
        login(port, "c1", "carol", "x").await,
        Err(ConnectReturnCode::BadUserNamePassword),
        "deleted user"
    );
    assert_eq!(
        login(port, "m1", "mallory", "wonderland").await,
        Err(ConnectReturnCode::BadUserNamePassword),
        "unknown users look like wrong passwords"
    );
    assert_eq!(
        connect(options(port, "anon")).await.err(),
        Some(ConnectReturnCode::NotAuthorized),
        "anonymous refused once authentication is configured"
    );
}

#[tokio::test]
async fn failed_authentications_are_rate_limited_per_address() {
    let dir = tempfile::tempdir().unwrap();
    let file = password_file(dir.path());
    let server = common::Server::start_with(&[
        "--password-file",
        file.to_str().unwrap(),
        "--auth-failure-limit",
        "2",
        "--auth-failure-refill",
        "3600",
    ]);
    let port = server.port();
    for i in 0..2 {
        assert_eq!(
            login(port, &format!("g{i}"), "alice", "guess").await,
            Err(ConnectReturnCode::BadUserNamePassword)
        );
    }
    assert_eq!(
        login(port, "g-right", "alice", "wonderland").await,
        Err(ConnectReturnCode::NotAuthorized),
        "past the limit even the right password is refused"
    );
}

fn token(key: &str, exp_offset_secs: i64, aud: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let claims = serde_json::json!({
        "sub": "system:serviceaccount:default:app",
        "aud": aud,
        "iat": now,
        "exp": now + exp_offset_secs,
    });
    let pem = std::fs::read(fixture(key)).unwrap();
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
        &claims,
        &jsonwebtoken::EncodingKey::from_ec_pem(&pem).unwrap(),
    )
    .unwrap()
}

async fn with_token(
    port: u16,
    id: &str,
    method: &str,
    token: String,
) -> Result<(), ConnectReturnCode> {
    let mut o = options(port, id);
    let mut props = ConnectProperties::new();
    props.authentication_method = Some(method.into());
    props.authentication_data = Some(Bytes::from(token));
    o.set_connect_properties(props);
    connect(o).await.map(|_| ())
}

#[tokio::test]
async fn k8s_sat_tokens_are_verified() {
    let key = fixture("jwt-es256-public.pem");
    let server = common::Server::start_with(&[
        "--jwt-public-key",
        key.to_str().unwrap(),
        "--jwt-audience",
        "mqstate",
    ]);
    let port = server.port();
    let good = "jwt-es256-private.pem";
    assert_eq!(
        with_token(port, "t1", "K8S-SAT", token(good, 3600, "mqstate")).await,
        Ok(())
    );
    assert_eq!(
        with_token(port, "t2", "K8S-SAT", token(good, -3600, "mqstate")).await,
        Err(ConnectReturnCode::NotAuthorized),
        "expired"
    );
    assert_eq!(
        with_token(
            port,
            "t3",
            "K8S-SAT",
            token("jwt-es256-other-private.pem", 3600, "mqstate")
        )
        .await,
        Err(ConnectReturnCode::NotAuthorized),
        "signed by another key"
    );
    assert_eq!(
        with_token(port, "t4", "K8S-SAT", token(good, 3600, "someone-else")).await,
        Err(ConnectReturnCode::NotAuthorized),
        "wrong audience"
    );
    assert_eq!(
        with_token(port, "t5", "K8S-SAT", "not a jwt".into()).await,
        Err(ConnectReturnCode::NotAuthorized)
    );
    assert_eq!(
        with_token(port, "t6", "SCRAM-SHA-1", token(good, 3600, "mqstate")).await,
        Err(ConnectReturnCode::BadAuthenticationMethod)
    );
}

const TOPIC_ACL: &str = "\
pattern readwrite clients/%c/#
pattern read users/%u/#
user alice
topic write users/+/inbox
topic readwrite shared/#
topic deny shared/secret/#
";

/// A server with the test password file and `acl` as its ACL file, both written under `dir`.
fn start_with_passwords_and_acl(dir: &std::path::Path, acl: &str) -> common::Server {
    let file = password_file(dir);
    let acl_path = dir.join("acl");
    std::fs::write(&acl_path, acl).unwrap();
    common::Server::start_with(&[
        "--password-file",
        file.to_str().unwrap(),
        "--acl-file",
        acl_path.to_str().unwrap(),
    ])
}

#[tokio::test]
async fn acl_allows_and_denies_topics_with_substitution() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_with_passwords_and_acl(dir.path(), TOPIC_ACL);
    let port = server.port();
    let logged_in = |id: &str, user: &str, pw: &str| {
        let mut o = options(port, id);
        o.set_credentials(user, pw);
        connect(o)
    };

    // bob reads his own inbox (%u) and his client topics (%c) ...
    let (bob, mut bob_events) = logged_in("bob-1", "bob", "builder").await.unwrap();
    assert_eq!(
        subscribe_result(&bob, &mut bob_events, "users/bob/#").await,
        Ok(())
    );
    assert_eq!(
        subscribe_result(&bob, &mut bob_events, "clients/bob-1/+").await,
        Ok(())
    );
    // ... and alice may write to it.
    let (alice, mut alice_events) = logged_in("alice-1", "alice", "wonderland").await.unwrap();
    assert_eq!(
        publish_result(
            &alice,
            &mut alice_events,
            "users/bob/inbox",
            PublishProperties::default()
        )
        .await,
        Ok(())
    );
    let got = next(&mut bob_events, |ev| match ev {
        Event::Incoming(Packet::Publish(p)) => Some(p.topic.clone()),
        _ => None,
    })
    .await
    .unwrap();
    assert_eq!(&got[..], b"users/bob/inbox");

    // Denials: each ends the rumqttc connection, so each gets a fresh one.
    let (bob, mut e) = logged_in("bob-2", "bob", "builder").await.unwrap();
    assert_eq!(
        subscribe_result(&bob, &mut e, "users/alice/#").await,
        Err(SubscribeReasonCode::NotAuthorized),
        "%u is the user's own name only"
    );
    let (bob, mut e) = logged_in("bob-3", "bob", "builder").await.unwrap();
    assert_eq!(
        publish_result(
            &bob,
            &mut e,
            "users/alice/inbox",
            PublishProperties::default()
        )
        .await,
        Err(PubAckReason::NotAuthorized),
        "only alice's section grants writing inboxes"
    );
    let (bob, mut e) = logged_in("bob-4", "bob", "builder").await.unwrap();
    assert_eq!(
        publish_result(
            &bob,
            &mut e,
            "clients/alice-1/x",
            PublishProperties::default()
        )
        .await,
        Err(PubAckReason::NotAuthorized),
        "%c is the client's own id only"
    );
    let (alice, mut e) = logged_in("alice-2", "alice", "wonderland").await.unwrap();
    assert_eq!(
        publish_result(
            &alice,
            &mut e,
            "shared/secret/x",
            PublishProperties::default()
        )
        .await,
        Err(PubAckReason::NotAuthorized),
        "deny wins over readwrite"
    );
    let (alice, mut e) = logged_in("alice-3", "alice", "wonderland").await.unwrap();
    assert_eq!(
        subscribe_result(&alice, &mut e, "shared/#").await,
        Err(SubscribeReasonCode::NotAuthorized),
        "a subscription overlapping a denied filter is refused"
    );
}

fn not_authorized(result: Result<impl std::fmt::Debug, state_store::Error>) -> bool {
    match result {
        Err(e) => matches!(
            e.kind(),
            ErrorKind::ServiceError(ServiceError::NotAuthorized)
        ),
        Ok(v) => panic!("expected -ERR not authorized, got {v:?}"),
    }
}

#[tokio::test]
async fn key_acl_through_the_official_sdk() {
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(
        &acl,
        format!(
            "pattern write {}\npattern read clients/%c/#\nkey readwrite %c/*\nclient sdk-keys\nkey read config/*\nkey deny config/private\n",
            invoke_topic()
        ),
    )
    .unwrap();
    let server = common::Server::start_with(&["--acl-file", acl.to_str().unwrap()]);
    let sdk = SdkClient::connect(server.port(), "sdk-keys").await;
    let store = &sdk.store;
    let t = Duration::from_secs(10);

    let set = store
        .set(
            b"sdk-keys/a".to_vec(),
            b"1".to_vec(),
            t,
            None,
            SetOptions::default(),
        )
        .await;
    assert!(set.is_ok(), "own prefix is writable: {set:?}");
    let got = store.get(b"sdk-keys/a".to_vec(), t).await.unwrap();
    assert_eq!(got.response, Some(b"1".to_vec()));

    assert!(
        not_authorized(
            store
                .set(
                    b"config/x".to_vec(),
                    b"1".to_vec(),
                    t,
                    None,
                    SetOptions::default()
                )
                .await
        ),
        "config/* is read-only"
    );
    assert!(
        store.get(b"config/x".to_vec(), t).await.is_ok(),
        "but readable"
    );
    assert!(
        not_authorized(store.get(b"config/private".to_vec(), t).await),
        "deny wins"
    );
    assert!(not_authorized(
        store.del(b"other/k".to_vec(), None, t).await
    ));
    assert!(
        not_authorized(store.observe(b"other/k".to_vec(), t).await),
        "KEYNOTIFY reads"
    );
}

#[tokio::test]
async fn built_in_rules_hold_without_configuration() {
    let server = common::Server::start();
    let port = server.port();

    // Another client's notifications: subscribing is refused, one's own is fine.
    let (c, mut e) = connect(options(port, "eve")).await.unwrap();
    assert_eq!(
        subscribe_result(&c, &mut e, &notify_filter("eve")).await,
        Ok(())
    );
    assert_eq!(
        subscribe_result(&c, &mut e, &notify_filter("victim")).await,
        Err(SubscribeReasonCode::NotAuthorized)
    );
    // Spoofing a notification or a state-store reply: publishing in the state store's namespace is refused.
    let (c, mut e) = connect(options(port, "eve-2")).await.unwrap();
    let spoofed = format!(
        "clients/statestore/v1/{SERVICE_ID}/{}/command/notify/6B",
        hex_upper(b"victim")
    );
    assert_eq!(
        publish_result(&c, &mut e, &spoofed, PublishProperties::default()).await,
        Err(PubAckReason::NotAuthorized)
    );
    let (c, mut e) = connect(options(port, "eve-3")).await.unwrap();
    let reply_topic =
        format!("clients/victim/services/statestore/v1/{SERVICE_ID}/command/invoke/response");
    assert_eq!(
        publish_result(&c, &mut e, &reply_topic, PublishProperties::default()).await,
        Err(PubAckReason::NotAuthorized)
    );
    // Having the state store reply into another client's response topic disconnects the requester.
    let (c, mut e) = connect(options(port, "eve-4")).await.unwrap();
    let props = PublishProperties {
        response_topic: Some(reply_topic.clone()),
        correlation_data: Some(Bytes::from_static(b"0123456789abcdef")),
        ..PublishProperties::default()
    };
    c.publish_with_properties(
        invoke_topic(),
        QoS::AtLeastOnce,
        false,
        "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n",
        props,
    )
    .await
    .unwrap();
    let end = next(&mut e, |ev| match ev {
        Event::Incoming(Packet::Disconnect(d)) => Some(d.reason_code as u8),
        _ => None,
    })
    .await;
    let code = match end {
        Ok(code) => code,
        Err(ConnectionError::MqttState(StateError::ServerDisconnect { reason_code, .. })) => {
            reason_code as u8
        }
        Err(other) => panic!("expected DISCONNECT, got {other}"),
    };
    assert_eq!(code, 0x87);

    // A client never receives another's notifications, even subscribed to everything.
    let (spy, mut spy_events) = connect(options(port, "spy")).await.unwrap();
    assert_eq!(subscribe_result(&spy, &mut spy_events, "#").await, Ok(()));
    let sdk = SdkClient::connect(port, "watcher").await;
    let store = &sdk.store;
    let t = Duration::from_secs(10);
    let mut observation = store.observe(b"k".to_vec(), t).await.unwrap().response;
    store
        .set(b"k".to_vec(), b"v".to_vec(), t, None, SetOptions::default())
        .await
        .unwrap();
    let notification = tokio::time::timeout(WAIT, observation.recv_notification())
        .await
        .expect("the watcher's own notification");
    assert!(notification.is_some());
    // The spy saw the watcher's traffic on its response topic (topic ACLs govern that) but never a
    // notification: its own publish, routed back through `#`, flushes anything queued before it.
    spy.publish("spy/ping", QoS::AtLeastOnce, false, "p")
        .await
        .unwrap();
    let mut seen = Vec::new();
    next(&mut spy_events, |ev| match ev {
        Event::Incoming(Packet::Publish(p)) => {
            seen.push(String::from_utf8_lossy(&p.topic).into_owned());
            (&p.topic[..] == b"spy/ping").then_some(())
        }
        _ => None,
    })
    .await
    .unwrap();
    assert!(
        !seen.iter().any(|t| t.starts_with("clients/statestore/")),
        "spy received a notification: {seen:?}"
    );
}

const REPLY_ACL: &str = "\
pattern write statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke
pattern readwrite clients/%c/#
key readwrite *
user alice
topic readwrite sensors/#
";

/// A raw state-store request (QoS 1) from `c` answered on `response_topic`; `Err` is the PUBACK's
/// refusal.
async fn invoke(
    c: &AsyncClient,
    e: &mut EventLoop,
    response_topic: &str,
    payload: &'static str,
) -> Result<(), PubAckReason> {
    let properties = PublishProperties {
        response_topic: Some(response_topic.into()),
        correlation_data: Some(Bytes::from_static(b"0123456789abcdef")),
        user_properties: vec![("__ts".into(), common::state::hlc_now())],
        ..PublishProperties::default()
    };
    c.publish_with_properties(invoke_topic(), QoS::AtLeastOnce, false, payload, properties)
        .await
        .unwrap();
    match next(e, |ev| {
        matches!(ev, Event::Incoming(Packet::PubAck(_))).then_some(())
    })
    .await
    {
        Ok(()) => Ok(()),
        Err(ConnectionError::MqttState(StateError::PubAckFail { reason })) => Err(reason),
        Err(other) => panic!("request answered on {response_topic}: {other}"),
    }
}

/// The next publish `e` receives: (topic, payload).
async fn next_publish(e: &mut EventLoop) -> (String, Bytes) {
    next(e, |ev| match ev {
        Event::Incoming(Packet::Publish(p)) => Some((
            String::from_utf8(p.topic.to_vec()).unwrap(),
            p.payload.clone(),
        )),
        _ => None,
    })
    .await
    .unwrap()
}

/// Issue 11 item 1: the state store is no confused deputy. A reply goes only where the requester
/// could publish itself (its own state-store response topic aside), else the request is refused
/// with PUBACK 0x87 and nothing is published.
#[tokio::test]
async fn the_state_store_replies_only_where_the_requester_may_publish() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_with_passwords_and_acl(dir.path(), REPLY_ACL);
    let port = server.port();
    let logged_in = |id: &str, user: &str, pw: &str| {
        let mut o = options(port, id);
        o.set_credentials(user, pw);
        connect(o)
    };
    let (alice, mut alice_events) = logged_in("alice-1", "alice", "wonderland").await.unwrap();
    assert_eq!(
        subscribe_result(&alice, &mut alice_events, "sensors/secret/#").await,
        Ok(())
    );

    // bob may publish under clients/bob-1/: his SET is answered there.
    let (bob, mut e) = logged_in("bob-1", "bob", "builder").await.unwrap();
    assert_eq!(
        subscribe_result(&bob, &mut e, "clients/bob-1/#").await,
        Ok(())
    );
    let set = "*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$4\r\nOPEN\r\n";
    assert_eq!(invoke(&bob, &mut e, "clients/bob-1/r", set).await, Ok(()));
    let (topic, payload) = next_publish(&mut e).await;
    assert_eq!(
        (&topic[..], &payload[..]),
        ("clients/bob-1/r", &b"+OK\r\n"[..])
    );

    // He may not publish on sensors/secret/door, so neither may his reply.
    let get = "*2\r\n$3\r\nGET\r\n$1\r\nx\r\n";
    let (bob, mut e) = logged_in("bob-2", "bob", "builder").await.unwrap();
    assert_eq!(
        invoke(&bob, &mut e, "sensors/secret/door", get).await,
        Err(PubAckReason::NotAuthorized)
    );
    let (bob, mut e) = logged_in("bob-3", "bob", "builder").await.unwrap();
    assert_eq!(
        publish_result(
            &bob,
            &mut e,
            "sensors/secret/door",
            PublishProperties::default()
        )
        .await,
        Err(PubAckReason::NotAuthorized),
        "his own publish there is refused the same way"
    );
    // KEYNOTIFY too: no registration without a reply he could have sent.
    let keynotify = "*2\r\n$9\r\nKEYNOTIFY\r\n$1\r\nx\r\n";
    let (bob, mut e) = logged_in("bob-4", "bob", "builder").await.unwrap();
    assert_eq!(
        invoke(&bob, &mut e, "sensors/secret/door", keynotify).await,
        Err(PubAckReason::NotAuthorized)
    );

    // alice, who may publish there, gets her reply there; and it is the first thing she receives:
    // nothing of bob's reached sensors/secret/.
    assert_eq!(
        invoke(&alice, &mut alice_events, "sensors/secret/door", get).await,
        Ok(())
    );
    let (topic, payload) = next_publish(&mut alice_events).await;
    assert_eq!(topic, "sensors/secret/door");
    assert_eq!(&payload[..], b"$4\r\nOPEN\r\n");
}

#[test]
fn anonymous_listener_beyond_loopback_is_refused_unless_asked_for() {
    // Refused before any socket is opened, so no traffic leaves loopback.
    let (stderr, status) = common::serve_stderr(&["--listen", "0.0.0.0:0"], &[], "mqstate ready");
    let status = status.expect("the server must refuse to start");
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("allow_anonymous"), "{stderr}");
    assert!(stderr.contains("password_file"), "{stderr}");

    // Loopback needs no configuration at all.
    let (stderr, status) = common::serve_stderr(
        &["--listen", "127.0.0.1:0"],
        &[("MQSTATE_LOG", "info")],
        "mqstate ready",
    );
    assert!(status.is_none(), "exited: {status:?} {stderr}");
    assert!(stderr.contains("mqstate ready"), "{stderr}");
}

/// `mqstate topic …` is admin-only under an ACL: only a user granted `write` on the admin topic can
/// create, read or delete notification topics; the others are refused and change nothing.
#[test]
fn topic_commands_are_admin_only_under_an_acl() {
    let dir = tempfile::tempdir().unwrap();
    let acl = "pattern readwrite clients/%c/#\nuser alice\ntopic write mqstate/admin/v1/notify\n";
    let server = start_with_passwords_and_acl(dir.path(), acl);
    let topic = |user: &str, password: &str, args: &[&str]| {
        let file = dir.path().join(format!("{user}.pw"));
        std::fs::write(&file, format!("{password}\n")).unwrap();
        Command::new(env!("CARGO_BIN_EXE_mqstate"))
            .arg("topic")
            .args(args)
            .args(["--port", &server.port().to_string(), "--timeout", "5"])
            .args([
                "--username",
                user,
                "--password-file",
                file.to_str().unwrap(),
            ])
            .env_remove("AIO_BROKER_HOSTNAME")
            .env_remove("AIO_BROKER_TCP_PORT")
            .env_remove("AIO_MQTT_CLIENT_ID")
            .output()
            .unwrap()
    };
    let create = [
        "create",
        "orders",
        "--endpoint",
        "http://127.0.0.1:9/hook",
        "--keys",
        "order:*",
    ];
    let refused = topic("bob", "builder", &create);
    assert!(!refused.status.success(), "{refused:?}");
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        text.contains("refused the request (reason code 0x87)"),
        "the broker's PUBACK 0x87 is reported at once, not as a timeout: {text}"
    );
    let listed = topic("alice", "wonderland", &["list", "--json"]);
    assert!(listed.status.success(), "{listed:?}");
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(
        listed["topics"],
        serde_json::json!([]),
        "bob created nothing"
    );
    assert!(topic("alice", "wonderland", &create).status.success());
    assert!(!topic("bob", "builder", &["stats", "orders"])
        .status
        .success());
    assert!(!topic("bob", "builder", &["rm", "orders"]).status.success());
    assert!(topic("alice", "wonderland", &["get", "orders"])
        .status
        .success());
}
