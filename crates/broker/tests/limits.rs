//! Each client limit is enforced and answered with its reason code (decision 0011).

mod common;

use std::time::Duration;

use common::*;
use mqstate_broker::{BrokerConfig, ClientEvent};
use rmqtt_codec::v5::{self, ConnectAckReason, Packet, SubscribeAckReason};

/// CONNECTs until one is accepted: a closed connection frees its place once its task has ended.
async fn connect_when_room(s: &Server, id: &str) -> Raw {
    tokio::time::timeout(GUARD, async {
        loop {
            let (c, ack) = Raw::connect(s.addr, id, true, 0).await;
            if ack.reason_code == ConnectAckReason::Success {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("no room for a new connection")
}

#[tokio::test]
async fn connections_over_the_total_limit_get_connack_0x97_and_handshakes_count() {
    let s = Server::start(BrokerConfig {
        max_connections: 2,
        ..BrokerConfig::default()
    })
    .await;
    let (a, ack) = Raw::connect(s.addr, "a", true, 0).await;
    assert_eq!(ack.reason_code, ConnectAckReason::Success);
    // A socket that has not sent CONNECT yet holds a place too.
    let silent = Raw::open(s.addr).await;
    let (_, refused) = Raw::connect(s.addr, "c", true, 0).await;
    assert_eq!(refused.reason_code, ConnectAckReason::QuotaExceeded);
    assert!(refused
        .reason_string
        .as_deref()
        .is_some_and(|r| r.contains("connection limit")));

    drop(silent);
    let _c = connect_when_room(&s, "c").await;
    a.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let _d = connect_when_room(&s, "d").await;
}

#[tokio::test]
async fn connections_over_the_per_address_limit_get_connack_0x97() {
    let s = Server::start(BrokerConfig {
        max_connections_per_address: 1,
        ..BrokerConfig::default()
    })
    .await;
    let (_a, ack) = Raw::connect(s.addr, "a", true, 0).await;
    assert_eq!(ack.reason_code, ConnectAckReason::Success);
    let (_, refused) = Raw::connect(s.addr, "b", true, 0).await;
    assert_eq!(refused.reason_code, ConnectAckReason::QuotaExceeded);
    assert!(refused
        .reason_string
        .as_deref()
        .is_some_and(|r| r.contains("from this address")));
}

#[tokio::test]
async fn subscriptions_over_the_session_limit_get_suback_0x97() {
    let s = Server::start(BrokerConfig {
        max_subscriptions_per_session: 2,
        ..BrokerConfig::default()
    })
    .await;
    let (mut c, _) = Raw::connect(s.addr, "subs", true, 0).await;
    assert_eq!(c.subscribe("a", 1).await, [SubscribeAckReason::GrantedQos1]);
    assert_eq!(c.subscribe("b", 0).await, [SubscribeAckReason::GrantedQos0]);
    assert_eq!(
        c.subscribe("c", 0).await,
        [SubscribeAckReason::QuotaExceeded]
    );
    // Replacing an existing subscription is not a new one.
    assert_eq!(c.subscribe("a", 0).await, [SubscribeAckReason::GrantedQos0]);
    // The refused filter was not subscribed: nothing arrives on it, the others still work.
    c.publish("c", b"no", 0, 0, false).await;
    c.publish("b", b"yes", 0, 0, false).await;
    assert_eq!(c.expect_publish().await.topic, "b");

    c.send(Packet::Unsubscribe(v5::Unsubscribe {
        packet_id: pid(7),
        user_properties: vec![],
        topic_filters: vec!["b".into()],
    }))
    .await;
    assert!(matches!(c.expect().await, Packet::UnsubscribeAck(_)));
    assert_eq!(c.subscribe("c", 0).await, [SubscribeAckReason::GrantedQos0]);
}

fn topic_limited() -> BrokerConfig {
    BrokerConfig {
        max_topic_length: 16,
        max_topic_levels: 3,
        ..BrokerConfig::default()
    }
}

#[tokio::test]
async fn publish_topics_over_the_length_or_level_limit_get_disconnect_0x90() {
    let s = Server::start(topic_limited()).await;
    let (mut ok, _) = Raw::connect(s.addr, "ok", true, 0).await;
    assert_eq!(ok.publish_acked("a/b/c", b"x", 1).await, 0x00);

    let (mut deep, _) = Raw::connect(s.addr, "deep", true, 0).await;
    deep.publish("a/b/c/d", b"x", 0, 0, false).await;
    assert_eq!(deep.disconnect_reason().await, Some(0x90));

    let (mut long, _) = Raw::connect(s.addr, "long", true, 0).await;
    long.publish("seventeen-bytes-x", b"x", 1, 1, false).await;
    assert_eq!(long.disconnect_reason().await, Some(0x90));
}

#[tokio::test]
async fn filters_over_the_limit_get_suback_0x8f_and_will_topics_connack_0x90() {
    let s = Server::start(topic_limited()).await;
    let (mut c, _) = Raw::connect(s.addr, "filters", true, 0).await;
    assert_eq!(
        c.subscribe("a/+/#", 0).await,
        [SubscribeAckReason::GrantedQos0]
    );
    assert_eq!(
        c.subscribe("a/+/c/d", 0).await,
        [SubscribeAckReason::TopicFilterInvalid]
    );
    assert_eq!(
        c.subscribe("$share/g/seventeen-bytes-x", 0).await,
        [SubscribeAckReason::TopicFilterInvalid]
    );

    let mut connect = connect_packet("will", true, 0);
    connect.last_will = Some(will("a/b/c/d", b"gone", 0, false, None));
    let (_, ack) = Raw::connect_with(s.addr, connect).await;
    assert_eq!(ack.reason_code, ConnectAckReason::TopicNameInvalid);
}

#[tokio::test]
async fn a_client_that_never_reads_is_disconnected_and_others_go_on() {
    let s = Server::start(BrokerConfig {
        slow_consumer_timeout: Duration::from_millis(500),
        ..BrokerConfig::default()
    })
    .await;
    let mut events = s.broker.events();
    let (mut stuck, _) = Raw::connect(s.addr, "stuck", true, 0).await;
    assert_eq!(
        stuck.subscribe("flood", 0).await,
        [SubscribeAckReason::GrantedQos0]
    );
    // `stuck` reads nothing more: once the socket buffers are full the broker's writes stall.
    let (mut bystander, _) = Raw::connect(s.addr, "bystander", true, 0).await;
    let (mut flooder, _) = Raw::connect(s.addr, "flooder", true, 0).await;
    static CHUNK: [u8; 64 * 1024] = [7u8; 64 * 1024];
    let flooding = async {
        // Enough to fill any loopback socket buffers many times over; stops once `stuck` is gone
        // (possibly mid-packet, which is why the flooder is not used afterwards).
        for _ in 0..2_000 {
            flooder.publish("flood", &CHUNK, 0, 0, false).await;
        }
    };
    let disconnected = wait_event(
        &mut events,
        |e| matches!(e, ClientEvent::Disconnected { client_id } if &**client_id == "stuck"),
    );
    tokio::select! {
        () = disconnected => {}
        () = async { flooding.await; std::future::pending::<()>().await } => {}
    }
    drop(flooder);
    // Other clients were never held up: they still get answers.
    assert!(bystander.ping().await.is_empty());
    let (mut other, _) = Raw::connect(s.addr, "other", true, 0).await;
    assert_eq!(other.publish_acked("x", b"y", 1).await, 0x00);
    drop(stuck);
}

static BIG: [u8; 400] = [b'x'; 400];

#[tokio::test]
async fn an_offline_session_queues_up_to_its_byte_bound_and_drops_the_rest() {
    let s = Server::start(BrokerConfig {
        max_queued_bytes: 1000,
        ..BrokerConfig::default()
    })
    .await;
    let (mut sub, _) = Raw::connect(s.addr, "away", true, 300).await;
    assert_eq!(
        sub.subscribe("q", 1).await,
        [SubscribeAckReason::GrantedQos1]
    );
    sub.disconnect(v5::DisconnectReasonCode::NormalDisconnection)
        .await;
    let (mut publisher, _) = Raw::connect(s.addr, "publisher", true, 0).await;
    // 1 topic byte + 400 payload bytes each: two fit under 1,000 bytes, the other two do not.
    for packet_id in 1..=4 {
        // Dropping for one subscriber is not the publisher's failure (MQTT cannot say so).
        assert_eq!(publisher.publish_acked("q", &BIG, packet_id).await, 0);
    }
    let (mut sub, ack) = Raw::connect(s.addr, "away", false, 300).await;
    assert!(ack.session_present);
    for _ in 0..2 {
        assert_eq!(sub.expect_publish().await.payload.len(), 400);
    }
    let later = sub.ping().await;
    assert!(
        !later.iter().any(|p| matches!(p, Packet::Publish(_))),
        "only two messages fit the byte bound, got more: {later:?}"
    );
}
