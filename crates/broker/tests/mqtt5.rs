//! MQTT 5 behaviour over real sockets.

mod common;

use common::*;
use mqstate_broker::{Broker, BrokerConfig, ClientEvent, ClientIds};
use rmqtt_codec::v5::{self, DisconnectReasonCode, Packet, RetainHandling, SubscriptionOptions};

#[tokio::test]
async fn empty_client_id_gets_an_assigned_one() {
    let s = Server::default().await;
    let (_c, ack) = Raw::connect(s.addr, "", true, 0).await;
    assert_eq!(u8::from(ack.reason_code), 0);
    let id = ack.assigned_client_id.expect("assigned id");
    assert!(id.starts_with("mqs-"));
    assert_eq!(
        ack.max_packet_size,
        Some(BrokerConfig::default().max_packet_size)
    );
    assert_eq!(
        ack.receive_max.get(),
        BrokerConfig::default().receive_maximum
    );
}

#[tokio::test]
async fn assigned_ids_come_from_the_seeded_source() {
    let mut ids = Vec::new();
    for seed in [42, 42, 43] {
        let broker = Broker::builder(BrokerConfig::default())
            .client_ids(ClientIds::seeded(seed))
            .build();
        let s = Server::serve(broker).await;
        let (_c, first) = Raw::connect(s.addr, "", true, 0).await;
        let (_d, second) = Raw::connect(s.addr, "", true, 0).await;
        ids.push((first.assigned_client_id, second.assigned_client_id));
    }
    assert_eq!(ids[0], ids[1], "the same seed assigns the same ids");
    assert_ne!(ids[0].0, ids[0].1);
    assert_ne!(ids[0], ids[2]);
}

#[tokio::test]
async fn session_present_and_queued_qos1_after_reconnect() {
    let s = Server::default().await;
    let (mut sub, ack) = Raw::connect(s.addr, "sub", true, 60).await;
    assert!(!ack.session_present);
    assert_eq!(
        sub.subscribe("t/#", 1).await,
        vec![v5::SubscribeAckReason::GrantedQos1]
    );
    sub.disconnect(DisconnectReasonCode::NormalDisconnection)
        .await;

    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    assert_eq!(publ.publish_acked("t/1", b"while away", 1).await, 0);
    publ.publish("t/1", b"qos0 while away", 0, 0, false).await;
    assert_eq!(publ.publish_acked("t/2", b"second", 2).await, 0);

    let (mut sub, ack) = Raw::connect(s.addr, "sub", false, 60).await;
    assert!(ack.session_present);
    let p1 = sub.expect_publish().await;
    let p2 = sub.expect_publish().await;
    assert_eq!(&p1.payload[..], b"while away");
    assert_eq!(
        &p2.payload[..],
        b"second",
        "offline sessions do not queue QoS 0"
    );

    // Clean start discards the session.
    drop(sub);
    let (_sub, ack) = Raw::connect(s.addr, "sub", true, 60).await;
    assert!(!ack.session_present);
}

#[tokio::test]
async fn unacked_inflight_is_resent_with_dup() {
    let s = Server::default().await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", true, 60).await;
    sub.subscribe("t", 1).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    publ.publish_acked("t", b"m", 1).await;
    let first = sub.expect_publish().await;
    assert!(!first.dup);
    drop(sub); // no PUBACK
    let (mut sub, ack) = Raw::connect(s.addr, "sub", false, 60).await;
    assert!(ack.session_present);
    let again = sub.expect_publish().await;
    assert!(again.dup);
    assert_eq!(again.packet_id, first.packet_id);
}

#[tokio::test]
async fn takeover_disconnects_the_old_connection_with_0x8e() {
    let s = Server::default().await;
    let (mut old, _) = Raw::connect(s.addr, "dup", true, 60).await;
    old.subscribe("x", 1).await;
    let (_new, ack) = Raw::connect(s.addr, "dup", false, 60).await;
    assert_eq!(u8::from(ack.reason_code), 0);
    assert!(
        ack.session_present,
        "the new connection inherits the session"
    );
    match old.recv().await {
        Some(Packet::Disconnect(d)) => assert_eq!(u8::from(d.reason_code), 0x8E),
        other => panic!("expected DISCONNECT 0x8E, got {other:?}"),
    }
}

#[tokio::test]
async fn fast_reconnect_loop_is_never_refused() {
    let s = Server::default().await;
    let mut conns = Vec::new();
    for i in 0..40 {
        let (c, ack) = Raw::connect(s.addr, "flappy", i % 3 == 0, 30).await;
        assert_eq!(u8::from(ack.reason_code), 0, "attempt {i} refused");
        conns.push(c);
    }
    // Concurrent connects with the same id also all succeed.
    let attempts: Vec<_> = (0..10)
        .map(|_| {
            let addr = s.addr;
            tokio::spawn(async move { Raw::connect(addr, "flappy", false, 30).await.1.reason_code })
        })
        .collect();
    for a in attempts {
        assert_eq!(u8::from(a.await.unwrap()), 0);
    }
}

#[tokio::test]
async fn session_expires_after_its_interval() {
    let s = Server::default().await;
    let mut events = s.broker.events();
    let (c, _) = Raw::connect(s.addr, "brief", true, 1).await;
    c.disconnect(DisconnectReasonCode::NormalDisconnection)
        .await;
    wait_event(
        &mut events,
        |e| matches!(e, ClientEvent::SessionEnded { client_id } if &**client_id == "brief"),
    )
    .await;
    let (_c, ack) = Raw::connect(s.addr, "brief", false, 1).await;
    assert!(!ack.session_present);
}

#[tokio::test]
async fn disconnect_with_session_expiry_zero_discards_the_session() {
    let s = Server::default().await;
    let (c, _) = Raw::connect(s.addr, "gone", true, 600).await;
    let mut d = v5::Disconnect::new(DisconnectReasonCode::NormalDisconnection);
    d.session_expiry_interval_secs = Some(0);
    let mut c = c;
    c.send(Packet::Disconnect(d)).await;
    c.read_to_close().await;
    let (_c, ack) = Raw::connect(s.addr, "gone", false, 600).await;
    assert!(!ack.session_present);
}

#[tokio::test]
async fn qos2_both_directions_exactly_once() {
    let s = Server::default().await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", true, 0).await;
    assert_eq!(
        sub.subscribe("q2", 2).await,
        vec![v5::SubscribeAckReason::GrantedQos2]
    );
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    publ.publish("q2", b"once", 2, 7, false).await;
    assert!(matches!(publ.expect().await, Packet::PublishReceived(a) if a.packet_id.get() == 7));
    // A retry before PUBREL must not be routed again.
    publ.publish("q2", b"once", 2, 7, false).await;
    assert!(matches!(publ.expect().await, Packet::PublishReceived(a) if a.packet_id.get() == 7));
    publ.send(Packet::PublishRelease(v5::PublishAck2 {
        packet_id: pid(7),
        reason_code: v5::PublishAck2Reason::Success,
        properties: vec![],
        reason_string: None,
    }))
    .await;
    assert!(matches!(publ.expect().await, Packet::PublishComplete(a) if a.packet_id.get() == 7));

    let p = sub.expect_publish().await;
    assert_eq!(u8::from(p.qos), 2);
    let id = p.packet_id.unwrap();
    sub.send(Packet::PublishReceived(v5::PublishAck {
        packet_id: id,
        reason_code: v5::PublishAckReason::Success,
        properties: vec![],
        reason_string: None,
    }))
    .await;
    assert!(matches!(sub.expect().await, Packet::PublishRelease(a) if a.packet_id == id));
    sub.send(Packet::PublishComplete(v5::PublishAck2 {
        packet_id: id,
        reason_code: v5::PublishAck2Reason::Success,
        properties: vec![],
        reason_string: None,
    }))
    .await;
    assert!(
        sub.ping().await.is_empty(),
        "the retried QoS 2 publish was delivered twice"
    );
}

#[tokio::test]
async fn delivered_qos_is_the_minimum_and_qos0_flows() {
    let s = Server::default().await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", true, 0).await;
    sub.subscribe("m", 1).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    publ.publish("m", b"two", 2, 1, false).await;
    publ.expect().await;
    publ.publish("m", b"zero", 0, 0, false).await;
    let p = sub.expect_publish().await;
    assert_eq!((u8::from(p.qos), &p.payload[..]), (1, &b"two"[..]));
    let p2 = sub.expect_publish().await;
    assert_eq!((u8::from(p2.qos), &p2.payload[..]), (0, &b"zero"[..]));
}

#[tokio::test]
async fn outbound_window_follows_the_client_receive_maximum() {
    let s = Server::default().await;
    let mut c = connect_packet("slow", true, 0);
    c.receive_max = Some(pid(2));
    let (mut sub, _) = Raw::connect_with(s.addr, c).await;
    sub.subscribe("w", 1).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    for i in 1..=5 {
        publ.publish_acked("w", b"x", i).await;
    }
    let a = sub.expect_publish().await;
    let _b = sub.expect_publish().await;
    assert!(
        sub.ping().await.is_empty(),
        "more than Receive Maximum in flight"
    );
    sub.puback(a.packet_id.unwrap()).await;
    let _c = sub.expect_publish().await;
    assert!(sub.ping().await.is_empty());
}

#[tokio::test]
async fn inbound_receive_maximum_exceeded_is_0x93() {
    let cfg = BrokerConfig {
        receive_maximum: 2,
        ..BrokerConfig::default()
    };
    let s = Server::start(cfg).await;
    let (mut c, ack) = Raw::connect(s.addr, "greedy", true, 0).await;
    assert_eq!(ack.receive_max.get(), 2);
    for i in 1..=3 {
        c.publish("r", b"x", 2, i, false).await;
    }
    let mut got = Vec::new();
    while let Some(p) = c.recv().await {
        got.push(p);
    }
    assert!(
        matches!(got.last(), Some(Packet::Disconnect(d)) if u8::from(d.reason_code) == 0x93),
        "{got:?}"
    );
}

#[tokio::test]
async fn client_maximum_packet_size_drops_big_messages() {
    let s = Server::default().await;
    let mut c = connect_packet("small", true, 0);
    c.max_packet_size = std::num::NonZeroU32::new(64);
    let (mut sub, _) = Raw::connect_with(s.addr, c).await;
    sub.subscribe("big", 1).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    publ.publish_acked("big", &[7u8; 200], 1).await;
    publ.publish_acked("big", b"small", 2).await;
    let p = sub.expect_publish().await;
    assert_eq!(&p.payload[..], b"small");
}

#[tokio::test]
async fn will_on_abnormal_close_and_0x04_not_on_normal() {
    let s = Server::default().await;
    let (mut watcher, _) = Raw::connect(s.addr, "watcher", true, 0).await;
    watcher.subscribe("will/#", 0).await;
    let mut events = s.broker.events();

    let will = |topic: &str| {
        let mut c = connect_packet("mortal", true, 0);
        c.last_will = Some(will(topic, b"bye", 0, false, None));
        c
    };

    let (c, _) = Raw::connect_with(s.addr, will("will/normal")).await;
    c.disconnect(DisconnectReasonCode::NormalDisconnection)
        .await;
    wait_event(&mut events, |e| {
        matches!(e, ClientEvent::Disconnected { .. })
    })
    .await;
    s.broker.publish(mqstate_broker::Message {
        topic: "will/marker".into(),
        payload: bytes::Bytes::from_static(b"m"),
        qos: mqstate_broker::QoS::AtMostOnce,
        retain: false,
        properties: Default::default(),
    });
    assert_eq!(
        &watcher.expect_publish().await.topic[..],
        "will/marker",
        "no will after a normal DISCONNECT"
    );

    let (c, _) = Raw::connect_with(s.addr, will("will/abnormal")).await;
    drop(c);
    assert_eq!(&watcher.expect_publish().await.topic[..], "will/abnormal");

    let (c, _) = Raw::connect_with(s.addr, will("will/asked")).await;
    c.disconnect(DisconnectReasonCode::DisconnectWithWillMessage)
        .await;
    assert_eq!(&watcher.expect_publish().await.topic[..], "will/asked");
}

// Paused time: the will's delay passes on the broker's clock, not on the wall.
#[tokio::test(start_paused = true)]
async fn delayed_will_fires_later_or_is_cancelled_by_reconnect() {
    let s = Server::default().await;
    let (mut watcher, _) = Raw::connect(s.addr, "watcher", true, 0).await;
    watcher.subscribe("lw/#", 0).await;
    let with_will = |id: &str, topic: &str, delay: u32| {
        let mut c = connect_packet(id, false, 60);
        c.last_will = Some(will(topic, b"late", 0, false, Some(delay)));
        c
    };
    // Cancelled: reconnect well within a long delay.
    let (c, _) = Raw::connect_with(s.addr, with_will("back", "lw/cancelled", 3600)).await;
    drop(c);
    let (_c, ack) = Raw::connect(s.addr, "back", false, 60).await;
    assert!(ack.session_present);
    // Fires: a 1 s delay with nobody coming back.
    let (c, _) = Raw::connect_with(s.addr, with_will("away", "lw/fired", 1)).await;
    drop(c);
    let p = watcher.expect_publish().await;
    assert_eq!(
        &p.topic[..],
        "lw/fired",
        "the cancelled will must not be published"
    );
}

#[tokio::test]
async fn retained_set_replace_delete_and_retain_handling() {
    let s = Server::default().await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    publ.publish("r/a", b"1", 1, 1, true).await;
    publ.expect().await;
    publ.publish("r/a", b"2", 1, 2, true).await;
    publ.expect().await;
    publ.publish("r/b", b"3", 1, 3, true).await;
    publ.expect().await;
    publ.publish("r/b", b"", 1, 4, true).await;
    publ.expect().await;

    let (mut sub, _) = Raw::connect(s.addr, "sub", true, 0).await;
    sub.subscribe("r/+", 1).await;
    let p = sub.expect_publish().await;
    assert!(p.retain);
    assert_eq!(&p.payload[..], b"2");
    assert!(
        sub.ping().await.is_empty(),
        "deleted retained message was delivered"
    );

    // Retain handling 1: only for a new subscription.
    let opts = SubscriptionOptions {
        qos: qos(1),
        retain_handling: RetainHandling::AtSubscribeNew,
        ..Default::default()
    };
    sub.subscribe_opts("r/+", opts, None).await;
    assert!(
        sub.ping().await.is_empty(),
        "existing subscription got retained messages with handling 1"
    );
    // Retain handling 2: never.
    let opts = SubscriptionOptions {
        qos: qos(1),
        retain_handling: RetainHandling::NoAtSubscribe,
        ..Default::default()
    };
    sub.subscribe_opts("r/#", opts, None).await;
    assert!(sub.ping().await.is_empty());

    // Live delivery: retain flag cleared unless Retain As Published.
    publ.publish("r/a", b"live", 0, 0, true).await;
    let p = sub.expect_publish().await;
    assert!(!p.retain);
    let (mut rap, _) = Raw::connect(s.addr, "rap", true, 0).await;
    let opts = SubscriptionOptions {
        qos: qos(0),
        retain_as_published: true,
        retain_handling: RetainHandling::NoAtSubscribe,
        ..Default::default()
    };
    rap.subscribe_opts("r/a", opts, None).await;
    publ.publish("r/a", b"live2", 0, 0, true).await;
    assert!(rap.expect_publish().await.retain);
}

#[tokio::test]
async fn shared_subscription_round_robin() {
    let s = Server::default().await;
    let (mut a, _) = Raw::connect(s.addr, "a", true, 0).await;
    let (mut b, _) = Raw::connect(s.addr, "b", true, 0).await;
    a.subscribe("$share/g/jobs/+", 1).await;
    b.subscribe("$share/g/jobs/+", 1).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    for i in 1..=4 {
        publ.publish_acked("jobs/x", b"j", i).await;
    }
    for member in [&mut a, &mut b] {
        let p1 = member.expect_publish().await;
        let p2 = member.expect_publish().await;
        member.puback(p1.packet_id.unwrap()).await;
        member.puback(p2.packet_id.unwrap()).await;
        assert!(
            member.ping().await.is_empty(),
            "a group member got more than its share"
        );
    }
}

#[tokio::test]
async fn no_local_and_subscription_ids() {
    let s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "self", true, 0).await;
    let opts = SubscriptionOptions {
        qos: qos(0),
        no_local: true,
        ..Default::default()
    };
    c.subscribe_opts("nl", opts, Some(5)).await;
    c.subscribe_opts(
        "nl/#",
        SubscriptionOptions {
            qos: qos(0),
            ..Default::default()
        },
        Some(9),
    )
    .await;
    c.publish("nl", b"mine", 0, 0, false).await;
    let p = c.expect_publish().await;
    let ids: Vec<u32> = p
        .properties
        .unwrap()
        .subscription_ids
        .iter()
        .map(|i| i.get())
        .collect();
    assert_eq!(ids, vec![9], "No Local suppressed subscription 5 but not 9");
    assert!(c.ping().await.is_empty(), "one delivery per client");

    let (mut other, _) = Raw::connect(s.addr, "other", true, 0).await;
    other.publish("nl", b"theirs", 0, 0, false).await;
    let p = c.expect_publish().await;
    let mut ids: Vec<u32> = p
        .properties
        .unwrap()
        .subscription_ids
        .iter()
        .map(|i| i.get())
        .collect();
    ids.sort();
    assert_eq!(ids, vec![5, 9]);
    assert!(
        c.ping().await.is_empty(),
        "overlapping subscriptions deliver once"
    );
}

#[tokio::test]
async fn topic_alias_and_properties_forwarded() {
    let s = Server::default().await;
    let (mut sub, _) = Raw::connect(s.addr, "sub", true, 0).await;
    sub.subscribe("alias/t", 0).await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    let props = v5::PublishProperties {
        topic_alias: Some(pid(3)),
        correlation_data: Some(bytes::Bytes::from_static(b"corr")),
        content_type: Some("text/plain".into()),
        response_topic: Some("reply/here".into()),
        user_properties: vec![("k".into(), "v".into())],
        is_utf8_payload: true,
        message_expiry_interval: std::num::NonZeroU32::new(100),
        subscription_ids: vec![],
    };
    publ.publish_props("alias/t", b"1", 0, 0, false, props)
        .await;
    let aliased = v5::PublishProperties {
        topic_alias: Some(pid(3)),
        ..Default::default()
    };
    publ.publish_props("", b"2", 0, 0, false, aliased).await;
    let p1 = sub.expect_publish().await;
    let p2 = sub.expect_publish().await;
    assert_eq!(&p2.topic[..], "alias/t");
    assert_eq!(&p2.payload[..], b"2");
    let props = p1.properties.unwrap();
    assert_eq!(props.correlation_data.as_deref(), Some(&b"corr"[..]));
    assert_eq!(props.content_type.as_deref(), Some("text/plain"));
    assert_eq!(props.response_topic.as_deref(), Some("reply/here"));
    assert_eq!(props.user_properties, vec![("k".into(), "v".into())]);
    assert!(props.is_utf8_payload);
    assert!(props
        .message_expiry_interval
        .is_some_and(|e| e.get() <= 100));
    assert!(props.topic_alias.is_none(), "aliases are per hop");
}

#[tokio::test]
async fn unsubscribe_reason_codes_and_bad_filters() {
    let s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "u", true, 0).await;
    c.subscribe("a/b", 0).await;
    assert_eq!(
        c.subscribe("a/#/b", 0).await,
        vec![v5::SubscribeAckReason::TopicFilterInvalid]
    );
    c.send(Packet::Unsubscribe(v5::Unsubscribe {
        packet_id: pid(9),
        user_properties: vec![],
        topic_filters: vec!["a/b".into(), "never".into()],
    }))
    .await;
    match c.expect().await {
        Packet::UnsubscribeAck(a) => {
            let codes: Vec<u8> = a.status.into_iter().map(u8::from).collect();
            assert_eq!(codes, vec![0x00, 0x11]);
        }
        other => panic!("expected UNSUBACK, got {other:?}"),
    }
}

#[tokio::test]
async fn shutdown_sends_server_shutting_down() {
    let mut s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "bye", true, 0).await;
    s.shutdown();
    match c.recv().await {
        Some(Packet::Disconnect(d)) => assert_eq!(u8::from(d.reason_code), 0x8B),
        other => panic!("expected DISCONNECT 0x8B, got {other:?}"),
    }
}

#[tokio::test]
async fn server_keep_alive_is_announced() {
    let cfg = BrokerConfig {
        server_keep_alive_secs: Some(5),
        ..BrokerConfig::default()
    };
    let s = Server::start(cfg).await;
    let (_c, ack) = Raw::connect(s.addr, "ka", true, 0).await;
    assert_eq!(ack.server_keepalive_sec, Some(5));
}

#[tokio::test]
async fn session_expiry_above_the_maximum_is_clamped_in_connack() {
    let cfg = BrokerConfig {
        session_expiry_max_secs: 100,
        ..BrokerConfig::default()
    };
    let s = Server::start(cfg).await;
    let (_c, ack) = Raw::connect(s.addr, "long", true, 5000).await;
    assert_eq!(ack.session_expiry_interval_secs, Some(100));
}

// Paused time: the broker reads tokio's clock, so the wait past the expiry takes no real time.
#[tokio::test(start_paused = true)]
async fn expired_messages_are_not_delivered() {
    let s = Server::default().await;
    let (mut sub, _) = Raw::connect(s.addr, "late", true, 60).await;
    sub.subscribe("exp", 1).await;
    sub.disconnect(DisconnectReasonCode::NormalDisconnection)
        .await;
    let (mut publ, _) = Raw::connect(s.addr, "pub", true, 0).await;
    let short = v5::PublishProperties {
        message_expiry_interval: std::num::NonZeroU32::new(1),
        ..Default::default()
    };
    publ.publish_props("exp", b"stale", 1, 1, false, short)
        .await;
    publ.expect().await;
    publ.publish_acked("exp", b"fresh", 2).await;
    // Wait past the 1 s expiry (the assertion is on content, not on timing).
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    let (mut sub, _) = Raw::connect(s.addr, "late", false, 60).await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"fresh");
}
