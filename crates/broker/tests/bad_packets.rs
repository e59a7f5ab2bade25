//! Protocol violations get the right DISCONNECT (v5) or CONNACK reason code, never a panic.

mod common;

use common::*;
use mqstate_broker::BrokerConfig;
use rmqtt_codec::v5::Packet;

async fn connected(s: &Server) -> Raw {
    Raw::connect(s.addr, "bad", true, 0).await.0
}

#[tokio::test]
async fn packet_too_large_is_0x95() {
    let s = Server::start(BrokerConfig {
        max_packet_size: 128,
        ..BrokerConfig::default()
    })
    .await;
    let mut c = connected(&s).await;
    c.publish("t", &[0u8; 300], 0, 0, false).await;
    assert_eq!(c.disconnect_reason().await, Some(0x95));
}

#[tokio::test]
async fn topic_alias_above_maximum_is_0x94() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    // PUBLISH QoS 0, topic "a", Topic Alias 100 (> the advertised 64).
    c.send_raw(b"\x30\x07\x00\x01a\x03\x23\x00\x64").await;
    assert_eq!(c.disconnect_reason().await, Some(0x94));
}

#[tokio::test]
async fn unknown_property_is_malformed_0x81() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    c.send_raw(b"\x30\x05\x00\x01a\x01\x7f").await;
    assert_eq!(c.disconnect_reason().await, Some(0x81));
}

#[tokio::test]
async fn second_connect_is_protocol_error_0x82() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    c.send(Packet::Connect(Box::new(connect_packet("bad", true, 0))))
        .await;
    assert_eq!(c.disconnect_reason().await, Some(0x82));
}

#[tokio::test]
async fn server_only_packet_from_client_is_0x82() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    c.send(Packet::PingResponse).await;
    assert_eq!(c.disconnect_reason().await, Some(0x82));
}

#[tokio::test]
async fn wildcard_in_publish_topic_is_0x90() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    c.publish("a/+", b"x", 0, 0, false).await;
    assert_eq!(c.disconnect_reason().await, Some(0x90));
}

#[tokio::test]
async fn unknown_alias_without_topic_is_0x82() {
    let s = Server::default().await;
    let mut c = connected(&s).await;
    // PUBLISH QoS 0, empty topic, Topic Alias 5 never set.
    c.send_raw(b"\x30\x06\x00\x00\x03\x23\x00\x05").await;
    assert_eq!(c.disconnect_reason().await, Some(0x82));
}

#[tokio::test]
async fn unsupported_protocol_level_gets_connack_0x84() {
    let s = Server::default().await;
    let mut c = Raw::open(s.addr).await;
    c.send_raw(b"\x10\x0d\x00\x04MQTT\x06\x02\x00\x3c\x00\x00\x00")
        .await;
    assert_eq!(c.read_to_close().await, b"\x20\x03\x00\x84\x00");
}

#[tokio::test]
async fn empty_client_id_without_clean_start_is_0x85() {
    let s = Server::default().await;
    let mut c = Raw::open(s.addr).await;
    c.send(Packet::Connect(Box::new(connect_packet("", false, 0))))
        .await;
    match c.recv().await {
        Some(Packet::ConnectAck(a)) => assert_eq!(u8::from(a.reason_code), 0x85),
        other => panic!("expected CONNACK 0x85, got {other:?}"),
    }
}

#[tokio::test]
async fn first_packet_not_connect_closes_silently() {
    let s = Server::default().await;
    let mut c = Raw::open(s.addr).await;
    c.send_raw(b"\xc0\x00").await;
    assert!(c.read_to_close().await.is_empty());
}

#[tokio::test]
async fn keep_alive_timeout_is_0x8d() {
    let s = Server::default().await;
    let mut connect = connect_packet("sleepy", true, 0);
    connect.keep_alive = 1;
    let (mut c, _) = Raw::connect_with(s.addr, connect).await;
    assert_eq!(c.disconnect_reason().await, Some(0x8D));
}

/// The keep-alive timer is moved on only when it fires (not at every packet): a client that keeps
/// talking past the first deadline must not be taken for a silent one.
#[tokio::test]
async fn keep_alive_is_renewed_by_traffic() {
    let s = Server::default().await;
    let mut connect = connect_packet("chatty", true, 0);
    connect.keep_alive = 1;
    let (mut c, _) = Raw::connect_with(s.addr, connect).await;
    // 1.5 s without a packet ends the connection; these pings span 2.4 s, 0.6 s apart.
    for _ in 0..4 {
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        assert!(c.ping().await.is_empty());
    }
    assert_eq!(c.disconnect_reason().await, Some(0x8D));
}

#[tokio::test]
async fn garbage_after_connect_never_kills_the_broker() {
    let s = Server::default().await;
    for junk in [
        &b"\xff\xff\xff\xff\xff"[..],
        b"\x62\x01\x00",
        b"\x82\x00",
        b"\x30\xff\xff\xff\x7f",
        b"\xe0\x01\x01",
    ] {
        let mut c = connected(&s).await;
        c.send_raw(junk).await;
        let _ = c.disconnect_reason().await;
    }
    // Still serving.
    let (_c, ack) = Raw::connect(s.addr, "after", true, 0).await;
    assert_eq!(u8::from(ack.reason_code), 0);
}

#[tokio::test]
async fn mqtt3_violation_closes_without_disconnect() {
    let s = Server::default().await;
    let mut c = Raw::open(s.addr).await;
    // MQTT 3.1.1 CONNECT, clean session, client id "v3".
    c.send_raw(b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02v3")
        .await;
    c.send_raw(b"\x30\x05\x00\x03a/#").await;
    let bytes = c.read_to_close().await;
    assert_eq!(
        bytes, b"\x20\x02\x00\x00",
        "only the CONNACK, no DISCONNECT for v3"
    );
}
