//! Hostile clients against the real server (decision 0011): thousands of sockets that never send
//! CONNECT, a client that never reads, a flood of maximum-size packets. The server closes what it must,
//! its memory (VmRSS) stays bounded, and a well-behaved client keeps being served throughout.

use crate::common;

use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Guard against hangs only; nothing asserts on timing.
const GUARD: Duration = Duration::from_secs(20);
const SILENT_SOCKETS: usize = 2_500;
const MAX_PACKET: usize = 1024 * 1024;
const FLOOD_PACKETS: usize = 100;
/// Generous: the server idles at a few MiB; 100 MiB of flood may pass through a queue once.
const RSS_BOUND_KIB: u64 = 512 * 1024;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Soft limit on open files of this process (the test holds one per silent socket).
fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).map(str::to_owned))
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(1024)
}

/// A rumqttc client whose incoming publishes arrive on a channel.
struct Good {
    client: AsyncClient,
    publishes: mpsc::UnboundedReceiver<(String, usize)>,
}

impl Good {
    async fn connect(port: u16, id: &str, filter: &str) -> Good {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (tx, publishes) = mpsc::unbounded_channel();
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let mut ready_tx = Some(ready_tx);
        tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                match event {
                    Event::Incoming(Packet::SubAck(_)) => {
                        if let Some(r) = ready_tx.take() {
                            let _ = r.send(());
                        }
                    }
                    Event::Incoming(Packet::Publish(p)) => {
                        let topic = String::from_utf8_lossy(&p.topic).into_owned();
                        if tx.send((topic, p.payload.len())).is_err() {
                            return;
                        }
                    }
                    _ => {}
                }
            }
        });
        client.subscribe(filter, QoS::AtLeastOnce).await.unwrap();
        tokio::time::timeout(GUARD, ready)
            .await
            .expect("no SUBACK")
            .unwrap();
        Good { client, publishes }
    }

    async fn next(&mut self) -> (String, usize) {
        tokio::time::timeout(GUARD, self.publishes.recv())
            .await
            .expect("no publish arrived")
            .expect("client loop ended")
    }

    /// Publishes to its own subscription and waits for the message to come back.
    async fn round_trip(&mut self, topic: &str) {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, b"ping".to_vec())
            .await
            .unwrap();
        loop {
            let (got, _) = self.next().await;
            if got == topic {
                return;
            }
        }
    }
}

fn varint(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn string(s: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

fn packet(first: u8, body: Vec<u8>) -> Vec<u8> {
    let mut out = vec![first];
    varint(body.len(), &mut out);
    out.extend(body);
    out
}

/// MQTT 5 CONNECT with a QoS 0 will on `will_topic`, then SUBSCRIBE `filter` (QoS 0).
fn connect_and_subscribe(id: &str, will_topic: &str, filter: &str) -> Vec<u8> {
    let mut connect = Vec::new();
    string(b"MQTT", &mut connect);
    connect.extend_from_slice(&[5, 0x02 | 0x04, 0, 60, 0]); // clean start + will, keep alive 60
    string(id.as_bytes(), &mut connect);
    connect.push(0); // will properties
    string(will_topic.as_bytes(), &mut connect);
    string(b"gone", &mut connect);
    let mut subscribe = vec![0, 1, 0]; // packet id 1, no properties
    string(filter.as_bytes(), &mut subscribe);
    subscribe.push(0);
    let mut out = packet(0x10, connect);
    out.extend(packet(0x82, subscribe));
    out
}

/// Reads (and drops) packets until a SUBACK has been read.
async fn read_until_suback(stream: &mut TcpStream) {
    let mut buf = Vec::new();
    tokio::time::timeout(GUARD, async {
        loop {
            let mut at = 0;
            while at + 2 <= buf.len() {
                let (mut len, mut shift, mut i) = (0usize, 0, at + 1);
                while i < buf.len() && buf[i] & 0x80 != 0 {
                    len |= usize::from(buf[i] & 0x7F) << shift;
                    shift += 7;
                    i += 1;
                }
                if i >= buf.len() {
                    break;
                }
                len |= usize::from(buf[i]) << shift;
                if buf[at] == 0x90 {
                    return;
                }
                at = i + 1 + len;
            }
            let mut chunk = [0u8; 256];
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before SUBACK");
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("no SUBACK");
}

/// A QoS 0 PUBLISH of exactly `MAX_PACKET` bytes.
fn max_size_publish(topic: &str) -> Vec<u8> {
    let mut header = Vec::new();
    string(topic.as_bytes(), &mut header);
    header.push(0); // no properties
    let remaining = MAX_PACKET - 1 - 3; // fixed header: type byte + 3-byte remaining length
    let mut body = header;
    body.resize(remaining, 0x5A);
    let out = packet(0x30, body);
    assert_eq!(out.len(), MAX_PACKET);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_leave_memory_bounded_and_others_served() {
    let server = common::Server::start_with(&[
        "--connect-timeout",
        "1",
        "--slow-consumer-timeout",
        "2",
        "--max-packet-size",
        &MAX_PACKET.to_string(),
    ]);
    let pid = server.pid();
    let port = server.port();
    let mut good = Good::connect(port, "good", "good/#").await;
    good.round_trip("good/start").await;
    let idle_kib = rss_kib(pid);
    let mut peak_kib = idle_kib;

    // 1. Thousands of sockets that never send CONNECT.
    let silent_count = SILENT_SOCKETS.min(open_files_limit() / 2);
    let mut silent = Vec::with_capacity(silent_count);
    for _ in 0..silent_count {
        silent.push(TcpStream::connect(server.addr).await.unwrap());
    }
    peak_kib = peak_kib.max(rss_kib(pid));
    // While they are open, a well-behaved client still connects and is served.
    let mut late = Good::connect(port, "late", "late/#").await;
    late.round_trip("late/hello").await;
    // The connect timeout closes every one of them.
    for mut s in silent {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(GUARD, s.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            Ok(Ok(_)) => panic!("a socket that never sent CONNECT got data"),
            Err(_) => panic!("a socket that never sent CONNECT was not closed"),
        }
    }

    // 2. A client that never reads, subscribed to a flood of maximum-size packets.
    let mut will_watcher = Good::connect(port, "watcher", "will/#").await;
    let mut stuck = TcpStream::connect(server.addr).await.unwrap();
    stuck
        .write_all(&connect_and_subscribe("stuck", "will/stuck", "flood/#"))
        .await
        .unwrap();
    // From here on `stuck` reads nothing.
    read_until_suback(&mut stuck).await;
    let mut flooder = TcpStream::connect(server.addr).await.unwrap();
    flooder
        .write_all(&connect_and_subscribe("flooder", "will/flooder", "none"))
        .await
        .unwrap();

    let big = max_size_publish("flood/x");
    let flood = tokio::spawn(async move {
        for _ in 0..FLOOD_PACKETS {
            if flooder.write_all(&big).await.is_err() {
                break;
            }
        }
        flooder
    });
    // 3. During the flood the well-behaved client keeps publishing and receiving.
    for i in 0..20 {
        good.round_trip(&format!("good/during/{i}")).await;
        peak_kib = peak_kib.max(rss_kib(pid));
    }
    // The client that never reads is disconnected by the server (its will says so).
    let (topic, _) = will_watcher.next().await;
    assert_eq!(topic, "will/stuck");
    let flooder = tokio::time::timeout(GUARD, flood)
        .await
        .expect("the flood was not taken")
        .unwrap();
    peak_kib = peak_kib.max(rss_kib(pid));
    good.round_trip("good/after-flood").await;
    let end_kib = rss_kib(pid);
    eprintln!(
        "VmRSS: idle {idle_kib} KiB, peak {peak_kib} KiB, end {end_kib} KiB \
         ({silent_count} silent sockets, {FLOOD_PACKETS} x {MAX_PACKET} B flood)"
    );
    assert!(
        peak_kib < RSS_BOUND_KIB,
        "server RSS peaked at {peak_kib} KiB (bound {RSS_BOUND_KIB} KiB)"
    );
    drop((stuck, flooder));
}

/// Bytes that are not MQTT, sent where a CONNECT should come: the connection is closed and the
/// log says why, naming the peer.
#[test]
fn garbage_instead_of_connect_is_closed_with_a_log_line_naming_the_problem() {
    let addr = common::free_addr();
    let listen = addr.to_string();
    let server = std::thread::spawn(move || {
        common::serve_stderr(
            &["--listen", &listen],
            &[("MQSTATE_LOG", "info")],
            "handshake refused",
        )
    });
    let deadline = std::time::Instant::now() + common::START_TIMEOUT;
    let mut socket = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "no server: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    use std::io::{Read, Write};
    socket.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    socket.set_read_timeout(Some(GUARD)).unwrap();
    let mut reply = Vec::new();
    let _ = socket.read_to_end(&mut reply);
    assert!(reply.is_empty(), "no reply to garbage: {reply:?}");
    let (stderr, status) = server.join().unwrap();
    assert!(status.is_none(), "the server is still up: {stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("handshake refused"))
        .unwrap_or_else(|| panic!("no log line: {stderr}"));
    assert!(line.contains("not an MQTT CONNECT"), "{line}");
    assert!(line.contains("127.0.0.1"), "{line}");
}
