//! Issue 11 item 10: the paho interop sequence `client_topic_alias`, against the real server with
//! its session log, repeated. A client whose session outlives its connection (Session Expiry
//! 99999), subscribed to its own topic with QoS 2, publishes QoS 1 with Topic Alias 1 and then with
//! an empty topic and the alias: both PUBACKs (which wait for the session log to be durable) and
//! both forwarded copies must arrive. Reconnected without Clean Start, the aliases are gone: the
//! empty topic with alias 1 ends the connection (DISCONNECT 0x82). Raw bytes, so nothing in a
//! client library hides what the server sends.

use crate::common;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Hang guard only.
const WAIT: Duration = Duration::from_secs(30);
const ROUNDS: u16 = 100;

fn var_int(mut v: usize, out: &mut Vec<u8>) {
    loop {
        let mut b = (v % 128) as u8;
        v /= 128;
        if v > 0 {
            b |= 0x80;
        }
        out.push(b);
        if v == 0 {
            return;
        }
    }
}

fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    var_int(body.len(), &mut out);
    out.extend_from_slice(body);
    out
}

fn string(s: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

fn connect(client_id: &str, clean_start: bool) -> Vec<u8> {
    let mut body = Vec::new();
    string(b"MQTT", &mut body);
    body.push(5);
    body.push(if clean_start { 0x02 } else { 0x00 });
    body.extend_from_slice(&60u16.to_be_bytes());
    // Session Expiry Interval 99999, Topic Alias Maximum 0 (no server-to-client aliases).
    let props = [0x11, 0x00, 0x01, 0x86, 0x9F, 0x22, 0x00, 0x00];
    body.push(props.len() as u8);
    body.extend_from_slice(&props);
    string(client_id.as_bytes(), &mut body);
    packet(0x10, &body)
}

fn subscribe(filter: &str, packet_id: u16) -> Vec<u8> {
    let mut body = packet_id.to_be_bytes().to_vec();
    body.push(0);
    string(filter.as_bytes(), &mut body);
    body.push(2);
    packet(0x82, &body)
}

fn publish(topic: &str, alias: Option<u16>, packet_id: u16, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    string(topic.as_bytes(), &mut body);
    body.extend_from_slice(&packet_id.to_be_bytes());
    match alias {
        Some(a) => {
            body.push(3);
            body.push(0x23);
            body.extend_from_slice(&a.to_be_bytes());
        }
        None => body.push(0),
    }
    body.extend_from_slice(payload);
    packet(0x32, &body)
}

fn puback(packet_id: u16) -> Vec<u8> {
    packet(0x40, &packet_id.to_be_bytes())
}

struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(port: u16, connect: Vec<u8>) -> (Conn, u8) {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut c = Conn {
            stream,
            buf: Vec::new(),
        };
        c.send(&connect).await;
        let (first, body) = c.next().await.expect("CONNACK");
        assert_eq!(first, 0x20);
        assert_eq!(body[1], 0, "CONNACK reason");
        (c, body[0])
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next packet (first byte, body), or `None` once the server closed.
    async fn next(&mut self) -> Option<(u8, Vec<u8>)> {
        tokio::time::timeout(WAIT, async {
            loop {
                if self.buf.len() >= 2 {
                    let mut len = 0usize;
                    let mut i = 1;
                    let mut complete = false;
                    while i < self.buf.len() && i <= 4 {
                        len |= usize::from(self.buf[i] & 0x7f) << (7 * (i - 1));
                        i += 1;
                        if self.buf[i - 1] & 0x80 == 0 {
                            complete = true;
                            break;
                        }
                    }
                    if complete && self.buf.len() >= i + len {
                        let first = self.buf[0];
                        let body = self.buf[i..i + len].to_vec();
                        self.buf.drain(..i + len);
                        return Some((first, body));
                    }
                }
                let mut chunk = [0u8; 4096];
                match self.stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .expect("nothing from the server within the guard time")
    }

    /// Publishes QoS 1 and waits, as paho's test does, for the forwarded copy only; by then the
    /// PUBACK must have arrived. (The test disconnects as soon as it has the copy: a PUBACK still
    /// owed then is lost with the connection, paho re-sends the publish on its next connection —
    /// empty topic and Topic Alias included — and the server, which does not know the alias on
    /// that connection, ends it.)
    async fn publish_and_receive(
        &mut self,
        topic: &str,
        alias: Option<u16>,
        packet_id: u16,
        payload: &[u8],
        what: &str,
    ) {
        self.send(&publish(topic, alias, packet_id, payload)).await;
        let mut acked = false;
        loop {
            let (first, body) = self
                .next()
                .await
                .unwrap_or_else(|| panic!("{what}: connection closed"));
            match first >> 4 {
                4 => {
                    assert_eq!(u16::from_be_bytes([body[0], body[1]]), packet_id, "{what}");
                    assert!(body.len() < 3 || body[2] == 0, "{what}: PUBACK {body:02x?}");
                    acked = true;
                }
                3 => {
                    assert!(body.ends_with(payload), "{what}: forwarded {body:02x?}");
                    assert!(
                        acked,
                        "{what}: the publisher got its own message back before its PUBACK"
                    );
                    let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
                    if (first >> 1) & 3 > 0 {
                        let id = u16::from_be_bytes([body[2 + topic_len], body[3 + topic_len]]);
                        self.send(&puback(id)).await;
                    }
                    return;
                }
                other => panic!("{what}: unexpected packet type {other}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_topic_alias_sequence_in_a_durable_session_never_loses_a_puback() {
    let server = common::Server::start();
    let port = server.port();
    for round in 0..ROUNDS {
        let what = |step: &str| format!("round {round}, {step}");
        let (mut c, _) = Conn::open(port, connect("client topic alias a", true)).await;
        c.send(&subscribe("TopicA", 1)).await;
        let (first, _) = c.next().await.expect("SUBACK");
        assert_eq!(first, 0x90);
        c.publish_and_receive("TopicA", Some(1), 2, b"topic alias 1", &what("alias set"))
            .await;
        c.publish_and_receive("", Some(1), 3, b"topic alias 2", &what("alias used"))
            .await;
        c.send(&[0xE0, 0x00]).await;
        assert!(c.next().await.is_none(), "closed after DISCONNECT");

        // The session (and its subscription) lives on; the aliases do not.
        let (mut c, flags) = Conn::open(port, connect("client topic alias a", false)).await;
        assert_eq!(flags & 1, 1, "{}: session present", what("reconnect"));
        c.publish_and_receive("TopicA", None, 4, b"topic alias 3", &what("no alias"))
            .await;
        c.send(&publish("", Some(1), 5, b"topic alias 4")).await;
        let (first, body) = c.next().await.expect("DISCONNECT");
        assert_eq!((first, body[0]), (0xE0, 0x82), "{}", what("stale alias"));
        assert!(c.next().await.is_none());
    }
}
