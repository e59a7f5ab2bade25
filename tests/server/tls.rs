//! TLS and WebSocket listeners of the real `mqstate serve`: TLS 1.2 and 1.3 with a real MQTT client
//! (rumqttc), refused certificates (unknown CA, expired, missing), mTLS identity as the client id,
//! reloading the certificate without dropping connections, MQTT over ws:// and wss://, and the CLI
//! (the AIO SDK's TLS) and `bench` (its own client over tokio-rustls) against a TLS listener. Every
//! certificate is made on the spot (`mqstate-testcerts`).

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_addr, Server};
use mqstate_testcerts::{Ca, Leaf};
use rumqttc::tokio_rustls::rustls::pki_types::PrivateKeyDer;
use rumqttc::tokio_rustls::rustls::{self as client_rustls, ClientConfig, RootCertStore};
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions};
use rumqttc::{TlsConfiguration, Transport};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::WebSocketStream;

/// Guard against hangs only; no test asserts on timing.
const GUARD: Duration = Duration::from_secs(20);

/// The server's certificate, for the names a client may dial it by.
fn server_leaf(ca: &Ca) -> Leaf {
    ca.leaf("mqstate test server", &["localhost", "127.0.0.1"], false)
}

/// Certificate files of a server, in a temporary directory.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        Files {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn write(&self, name: &str, content: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    fn server_pair(&self, leaf: &Leaf) -> (PathBuf, PathBuf) {
        (
            self.write("server.pem", &leaf.pem),
            self.write("server.key", &leaf.key_pem),
        )
    }
}

fn arg(path: &Path) -> String {
    path.display().to_string()
}

/// A server with one extra listener (`scheme://addr`) and TLS flags; returns it and that address.
fn start(scheme: &str, tls_args: &[String]) -> (Server, SocketAddr) {
    start_listener(scheme, "", tls_args)
}

/// Like [`start`], with per-listener options (`?key=value&...`) after the address.
fn start_listener(scheme: &str, options: &str, tls_args: &[String]) -> (Server, SocketAddr) {
    let addr = free_addr();
    let mut args = vec!["--listen".to_owned(), format!("{scheme}://{addr}{options}")];
    args.extend_from_slice(tls_args);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start_with(&args);
    // The harness waits for the plain listener; the extra one is bound right after it.
    let deadline = Instant::now() + GUARD;
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "{scheme} listener never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    (server, addr)
}

fn tls_args(cert: &Path, key: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--tls-cert".to_owned(),
        arg(cert),
        "--tls-key".to_owned(),
        arg(key),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A rumqttc TLS configuration trusting `ca`, limited to `versions`, optionally with a client cert.
fn client_tls(
    ca: &Ca,
    versions: &[&'static client_rustls::SupportedProtocolVersion],
    client: Option<&Leaf>,
) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let builder =
        ClientConfig::builder_with_protocol_versions(versions).with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some(leaf) => builder
            .with_client_auth_cert(
                vec![leaf.der.clone()],
                PrivateKeyDer::Pkcs8(leaf.key_der.clone().into()),
            )
            .unwrap(),
    };
    Arc::new(config)
}

const BOTH: &[&client_rustls::SupportedProtocolVersion] = &[
    &client_rustls::version::TLS13,
    &client_rustls::version::TLS12,
];

/// Connects over TLS; `Ok` carries the CONNACK's assigned client id, `Err` the refusal.
async fn connect(
    addr: SocketAddr,
    client_id: &str,
    tls: Arc<ClientConfig>,
) -> Result<(AsyncClient, EventLoop, Option<String>), ConnectionError> {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", addr.port());
    options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(tls)));
    let (client, mut events) = AsyncClient::new(options, 16);
    loop {
        match tokio::time::timeout(GUARD, events.poll()).await {
            Err(_) => panic!("no CONNACK or error within the guard time"),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                let assigned = ack.properties.and_then(|p| p.assigned_client_identifier);
                return Ok((client, events, assigned));
            }
            Ok(Ok(_)) => {}
        }
    }
}

/// Subscribes, publishes and waits for its own message.
async fn pub_sub(client: &AsyncClient, events: &mut EventLoop, topic: &str) {
    client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    let payload = format!("hello on {topic}");
    let mut published = false;
    let received = tokio::time::timeout(GUARD, async {
        loop {
            match events.poll().await.expect("connection failed") {
                Event::Incoming(Packet::SubAck(_)) if !published => {
                    client
                        .publish(topic, QoS::AtLeastOnce, false, payload.clone())
                        .await
                        .unwrap();
                    published = true;
                }
                Event::Incoming(Packet::Publish(p)) => return p.payload,
                _ => {}
            }
        }
    })
    .await
    .expect("own publish did not come back");
    assert_eq!(&received[..], payload.as_bytes());
}

#[tokio::test]
async fn tls_1_2_and_1_3_clients_publish_and_subscribe() {
    let ca = Ca::new("test CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let (_server, addr) = start("tls", &tls_args(&cert, &key, &[]));
    // A client that never starts its handshake holds up nobody (it runs in its own task).
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    for (name, version) in [
        ("tls13", &client_rustls::version::TLS13),
        ("tls12", &client_rustls::version::TLS12),
    ] {
        let (client, mut events, _) = connect(addr, name, client_tls(&ca, &[version], None))
            .await
            .unwrap_or_else(|e| panic!("{name} refused: {e}"));
        pub_sub(&client, &mut events, &format!("t/{name}")).await;
    }
}

#[tokio::test]
async fn certificates_from_an_unknown_ca_or_expired_or_missing_are_refused() {
    let ca = Ca::new("test CA");
    let other = Ca::new("someone else's CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let client_ca = files.write("clients.pem", &ca.pem);
    let (_server, addr) = start(
        "tls",
        &tls_args(&cert, &key, &["--tls-client-ca", &arg(&client_ca)]),
    );

    // The client does not trust the server's CA.
    assert!(connect(addr, "c1", client_tls(&other, BOTH, None))
        .await
        .is_err());
    // mTLS required: no certificate, an expired one, one from another CA.
    assert!(connect(addr, "c2", client_tls(&ca, BOTH, None))
        .await
        .is_err());
    let expired = ca.leaf("old-sensor", &[], true);
    assert!(connect(addr, "c3", client_tls(&ca, BOTH, Some(&expired)))
        .await
        .is_err());
    let foreign = other.leaf("intruder", &[], false);
    assert!(connect(addr, "c4", client_tls(&ca, BOTH, Some(&foreign)))
        .await
        .is_err());
    // ... while a valid certificate works, over TLS 1.2 too.
    let good = ca.leaf("sensor-1", &[], false);
    for versions in [BOTH, &[&client_rustls::version::TLS12][..]] {
        let (client, mut events, _) = connect(addr, "c5", client_tls(&ca, versions, Some(&good)))
            .await
            .expect("valid client certificate refused");
        pub_sub(&client, &mut events, "t/mtls").await;
    }
}

#[tokio::test]
async fn certificate_identity_becomes_the_client_id() {
    let ca = Ca::new("test CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let client_ca = files.write("clients.pem", &ca.pem);
    let device = ca.leaf("sensor-7", &["device-7.example.com"], false);

    let (server, addr) = start(
        "tls",
        &tls_args(
            &cert,
            &key,
            &[
                "--tls-client-ca",
                &arg(&client_ca),
                "--use-identity-as-client-id",
            ],
        ),
    );
    let (client, mut events, assigned) =
        connect(addr, "asked-for", client_tls(&ca, BOTH, Some(&device)))
            .await
            .expect("mTLS connect");
    assert_eq!(
        assigned.as_deref(),
        Some("sensor-7"),
        "subject CN is the id"
    );
    pub_sub(&client, &mut events, "t/id").await;
    drop(server);

    // SAN identity, set for this listener only; client certificates optional, so a client without
    // one connects at TLS level but cannot have an identity as its client id: CONNACK 0x87.
    let options = format!(
        "?client_ca={}&client_auth=optional&identity=san&use_identity_as_client_id=true",
        arg(&client_ca)
    );
    let (_server, addr) = start_listener("tls", &options, &tls_args(&cert, &key, &[]));
    let (_, _, assigned) = connect(addr, "", client_tls(&ca, BOTH, Some(&device)))
        .await
        .expect("mTLS connect");
    assert_eq!(assigned.as_deref(), Some("device-7.example.com"));
    match connect(addr, "no-cert", client_tls(&ca, BOTH, None)).await {
        Err(ConnectionError::ConnectionRefused(code)) => {
            assert_eq!(code, ConnectReturnCode::NotAuthorized)
        }
        Err(other) => panic!("expected CONNACK 0x87, got {other}"),
        Ok(_) => panic!("a client without a certificate got a certificate identity"),
    }
}

#[tokio::test]
async fn new_certificate_is_loaded_on_sighup_and_on_change_without_dropping_connections() {
    let first_ca = Ca::new("first CA");
    let second_ca = Ca::new("second CA");
    let third_ca = Ca::new("third CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&first_ca));
    let (server, addr) = start("tls", &tls_args(&cert, &key, &[]));
    let (old_client, mut old_events, _) = connect(addr, "old", client_tls(&first_ca, BOTH, None))
        .await
        .expect("connect with the first certificate");

    // A half-written pair (new certificate, old key) is refused and the old pair stays in use.
    let second = server_leaf(&second_ca);
    files.write("server.pem", &second.pem);
    server.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(connect(addr, "new1", client_tls(&first_ca, BOTH, None))
        .await
        .is_ok());

    // The complete pair + SIGHUP: new handshakes use it.
    files.write("server.key", &second.key_pem);
    server.signal("HUP");
    wait_until_trusted(addr, &second_ca).await;
    assert!(connect(addr, "new2", client_tls(&first_ca, BOTH, None))
        .await
        .is_err());

    // A change of the files alone is noticed too.
    files.server_pair(&server_leaf(&third_ca));
    wait_until_trusted(addr, &third_ca).await;

    // The connection made before both reloads still works.
    pub_sub(&old_client, &mut old_events, "t/old").await;
}

async fn wait_until_trusted(addr: SocketAddr, ca: &Ca) {
    let deadline = Instant::now() + GUARD;
    while connect(addr, "probe", client_tls(ca, BOTH, None))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "new certificate never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---- WebSocket ----

fn remaining_length(len: usize) -> u8 {
    u8::try_from(len)
        .ok()
        .filter(|l| *l < 128)
        .expect("test packets are small")
}

fn string(s: &str) -> Vec<u8> {
    let mut out = u16::try_from(s.len()).unwrap().to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn connect_packet(client_id: &str) -> Vec<u8> {
    // MQTT 5, clean start, keep-alive 60, no properties.
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0x02, 0, 60, 0];
    body.extend(string(client_id));
    packet(0x10, body)
}

fn subscribe_packet(filter: &str) -> Vec<u8> {
    let mut body = vec![0, 1, 0];
    body.extend(string(filter));
    body.push(0);
    packet(0x82, body)
}

fn publish_packet(topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut body = string(topic);
    body.push(0);
    body.extend_from_slice(payload);
    packet(0x30, body)
}

fn packet(first: u8, body: Vec<u8>) -> Vec<u8> {
    let mut out = vec![first, remaining_length(body.len())];
    out.extend(body);
    out
}

/// MQTT bytes over a client WebSocket, and the packets read from it.
struct WsClient<S> {
    ws: WebSocketStream<S>,
    buf: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> WsClient<S> {
    async fn open(
        stream: S,
        url: &str,
        subprotocol: Option<&str>,
    ) -> Result<Self, tungstenite::Error> {
        let mut request = url.into_client_request().unwrap();
        if let Some(p) = subprotocol {
            request
                .headers_mut()
                .insert("Sec-WebSocket-Protocol", p.parse().unwrap());
        }
        let (ws, response) = tokio_tungstenite::client_async(request, stream).await?;
        assert_eq!(response.headers()["Sec-WebSocket-Protocol"], "mqtt");
        Ok(WsClient {
            ws,
            buf: Vec::new(),
        })
    }

    async fn send(&mut self, bytes: Vec<u8>) {
        use futures::SinkExt;
        self.ws.send(Message::Binary(bytes.into())).await.unwrap();
    }

    /// The next packet: (first byte, body). Packets are small, so one length byte.
    async fn recv(&mut self) -> (u8, Vec<u8>) {
        use futures::StreamExt;
        tokio::time::timeout(GUARD, async {
            loop {
                if self.buf.len() >= 2 && self.buf.len() >= 2 + usize::from(self.buf[1]) {
                    let len = usize::from(self.buf[1]);
                    let body = self.buf[2..2 + len].to_vec();
                    let first = self.buf[0];
                    self.buf.drain(..2 + len);
                    return (first, body);
                }
                match self.ws.next().await {
                    Some(Ok(Message::Binary(b))) => self.buf.extend_from_slice(&b),
                    other => panic!("expected a binary frame, got {other:?}"),
                }
            }
        })
        .await
        .expect("no packet within the guard time")
    }

    /// CONNECT split over two frames, SUBSCRIBE in the second; then publish to itself.
    async fn round_trip(&mut self, client_id: &str, topic: &str) {
        let connect = connect_packet(client_id);
        self.send(connect[..5].to_vec()).await;
        let mut rest = connect[5..].to_vec();
        rest.extend(subscribe_packet(topic));
        self.send(rest).await;
        let (connack, body) = self.recv().await;
        assert_eq!((connack, body[1]), (0x20, 0), "CONNACK success");
        assert_eq!(self.recv().await.0, 0x90, "SUBACK");
        self.send(publish_packet(topic, b"over websocket")).await;
        let (publish, body) = self.recv().await;
        assert_eq!(publish & 0xF0, 0x30);
        assert!(body.ends_with(b"over websocket"));
    }

    /// DISCONNECT, then the server closes the WebSocket with a Close frame.
    async fn disconnect(mut self) {
        use futures::StreamExt;
        self.send(vec![0xE0, 0]).await;
        let next = tokio::time::timeout(GUARD, self.ws.next()).await.unwrap();
        assert!(matches!(next, Some(Ok(Message::Close(_)))), "{next:?}");
    }
}

#[tokio::test]
async fn mqtt_over_websocket_needs_subprotocol_mqtt_and_carries_packets_across_frames() {
    let (_server, addr) = start("ws", &[]);
    let url = format!("ws://{addr}/mqtt");
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    match WsClient::open(tcp, &url, None).await {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), 400),
        Err(e) => panic!("expected HTTP 400, got {e}"),
        Ok(_) => panic!("upgrade without subprotocol mqtt accepted"),
    }
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut client = WsClient::open(tcp, &url, Some("mqttv3.1, mqtt"))
        .await
        .expect("upgrade");
    client.round_trip("ws-client", "t/ws").await;
    client.disconnect().await;

    // MQTT travels in binary frames only: a text frame closes the connection.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut texter = WsClient::open(tcp, &url, Some("mqtt"))
        .await
        .expect("upgrade");
    texter.round_trip("ws-texter", "t/text").await;
    {
        use futures::{SinkExt, StreamExt};
        texter.ws.send(Message::text("PINGREQ?")).await.unwrap();
        let end = tokio::time::timeout(GUARD, texter.ws.next()).await.unwrap();
        assert!(
            matches!(end, None | Some(Err(_)) | Some(Ok(Message::Close(_)))),
            "expected the connection to close, got {end:?}"
        );
    }
}

#[tokio::test]
async fn mqtt_over_secure_websocket() {
    let ca = Ca::new("test CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let (_server, addr) = start("wss", &tls_args(&cert, &key, &[]));

    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .expect("TLS handshake");
    let mut client = WsClient::open(
        tls,
        &format!("wss://localhost:{}/mqtt", addr.port()),
        Some("mqtt"),
    )
    .await
    .expect("upgrade");
    client.round_trip("wss-client", "t/wss").await;
    client.disconnect().await;
}

// ---- the CLI over TLS ----

fn cli(addr: SocketAddr, args: &[&str], tls: &[String]) -> std::process::Output {
    let (subcommand, rest) = args.split_first().unwrap();
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg(subcommand)
        .args(["--host", "localhost", "--port", &addr.port().to_string()])
        .args(["--timeout", "10", "--tls"])
        .args(tls)
        .args(rest)
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .env_remove("AIO_MQTT_USE_TLS")
        .env_remove("AIO_TLS_CA_FILE")
        .env_remove("AIO_TLS_CERT_FILE")
        .env_remove("AIO_TLS_KEY_FILE")
        .env_remove("AIO_MQTT_CLIENT_ID")
        .output()
        .expect("run mqstate")
}

#[test]
fn cli_works_over_tls_and_mtls() {
    let ca = Ca::new("test CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let ca_file = files.write("ca.pem", &ca.pem);
    let client = ca.leaf("cli-user", &[], false);
    let client_cert = files.write("client.pem", &client.pem);
    let client_key = files.write("client.key", &client.key_pem);
    let (_server, addr) = start(
        "tls",
        &tls_args(&cert, &key, &["--tls-client-ca", &arg(&ca_file)]),
    );
    let trust = vec!["--ca".to_owned(), arg(&ca_file)];
    let mut with_cert = trust.clone();
    with_cert.extend(["--cert".to_owned(), arg(&client_cert)]);
    with_cert.extend(["--key".to_owned(), arg(&client_key)]);

    let set = cli(addr, &["set", "greeting", "over tls"], &with_cert);
    assert!(set.status.success(), "{set:?}");
    let get = cli(addr, &["get", "greeting"], &with_cert);
    assert!(get.status.success(), "{get:?}");
    assert_eq!(String::from_utf8_lossy(&get.stdout), "over tls");
    let keys = cli(addr, &["scan", "*"], &with_cert);
    assert!(keys.status.success(), "{keys:?}");
    assert!(String::from_utf8_lossy(&keys.stdout).contains("greeting"));
    // mTLS is required on this listener: without a client certificate the CLI fails.
    let refused = cli(addr, &["get", "greeting"], &trust);
    assert!(!refused.status.success(), "{refused:?}");
}

#[test]
fn cli_tls_failures_name_the_cause_and_mtls_identity_needs_no_client_id() {
    let ca = Ca::new("test CA");
    let other_ca = Ca::new("some other CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let ca_file = files.write("ca.pem", &ca.pem);
    let other_ca_file = files.write("other-ca.pem", &other_ca.pem);
    let client = ca.leaf("sensor-9", &[], false);
    let (_server, addr) = start(
        "tls",
        &tls_args(
            &cert,
            &key,
            &[
                "--tls-client-ca",
                &arg(&ca_file),
                "--use-identity-as-client-id",
            ],
        ),
    );
    let untrusted = cli(
        addr,
        &["get", "k"],
        &["--ca".to_owned(), arg(&other_ca_file)],
    );
    assert_eq!(untrusted.status.code(), Some(2), "{untrusted:?}");
    let text = String::from_utf8_lossy(&untrusted.stderr);
    assert!(text.contains("not trusted"), "{text}");
    assert!(text.contains("--ca"), "{text}");

    let no_cert = cli(addr, &["get", "k"], &["--ca".to_owned(), arg(&ca_file)]);
    assert_eq!(no_cert.status.code(), Some(2), "{no_cert:?}");
    let text = String::from_utf8_lossy(&no_cert.stderr);
    assert!(text.contains("--cert"), "{text}");

    // The certificate's CN becomes the client id; the CLI follows the id the CONNACK announces, so
    // its replies come back without --client-id.
    let with_cert = vec![
        "--ca".to_owned(),
        arg(&ca_file),
        "--cert".to_owned(),
        arg(&files.write("client.pem", &client.pem)),
        "--key".to_owned(),
        arg(&files.write("client.key", &client.key_pem)),
    ];
    let set = cli(addr, &["set", "by-identity", "v"], &with_cert);
    assert!(set.status.success(), "{set:?}");
    let get = cli(addr, &["get", "by-identity", "--json"], &with_cert);
    assert!(get.status.success(), "{get:?}");
    assert!(String::from_utf8_lossy(&get.stdout).contains("\"value\":\"v\""));
}

#[test]
fn bench_runs_over_tls_and_mtls() {
    let ca = Ca::new("test CA");
    let files = Files::new();
    let (cert, key) = files.server_pair(&server_leaf(&ca));
    let ca_file = files.write("ca.pem", &ca.pem);
    let client = ca.leaf("bench-user", &[], false);
    let (_server, addr) = start(
        "tls",
        &tls_args(&cert, &key, &["--tls-client-ca", &arg(&ca_file)]),
    );
    let report = files.dir.path().join("report.json");
    let with_cert = vec![
        "--ca".to_owned(),
        arg(&ca_file),
        "--cert".to_owned(),
        arg(&files.write("client.pem", &client.pem)),
        "--key".to_owned(),
        arg(&files.write("client.key", &client.key_pem)),
    ];
    let run = |tls: &[String]| {
        cli(
            addr,
            &[
                "bench",
                "--requests",
                "300",
                "--connections",
                "2",
                "--inflight",
                "4",
                "--mix",
                "set=50,get=50",
                "--json",
                &arg(&report),
            ],
            tls,
        )
    };
    let out = run(&with_cert);
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(report["ops"], 300, "{report:#}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report:#}");
    // mTLS is required on this listener: without a client certificate no connection opens.
    let refused = run(&with_cert[..2]);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains(&addr.port().to_string()),
        "the error names the address: {refused:?}"
    );
}
