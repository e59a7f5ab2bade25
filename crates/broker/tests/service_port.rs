//! The system service port, as the state store uses it.

mod common;

use bytes::Bytes;
use common::*;
use mqstate_broker::{BrokerError, ClientEvent, Message, PublishProperties, QoS};
use rmqtt_codec::v5::{self, Packet};

fn message(topic: &str, payload: &'static [u8], qos: QoS) -> Message {
    Message {
        topic: topic.into(),
        payload: Bytes::from_static(payload),
        qos,
        retain: false,
        properties: Default::default(),
    }
}

#[tokio::test]
async fn claimed_topic_goes_to_the_service_and_puback_waits_for_its_ack() {
    let s = Server::default().await;
    let mut inbox = s.broker.claim_topic("svc/invoke").unwrap();
    assert_eq!(
        s.broker.claim_topic("svc/invoke").unwrap_err(),
        BrokerError::TopicAlreadyClaimed {
            topic: "svc/invoke".into()
        }
    );
    assert!(matches!(
        s.broker.claim_topic("svc/+"),
        Err(BrokerError::InvalidTopic { .. })
    ));

    // A subscriber to the claimed topic sees nothing.
    let (mut spy, _) = Raw::connect(s.addr, "spy", true, 0).await;
    spy.subscribe("svc/#", 1).await;

    let (mut client, _) = Raw::connect(s.addr, "caller", true, 0).await;
    let props = v5::PublishProperties {
        correlation_data: Some(Bytes::from_static(b"c1")),
        response_topic: Some("svc/reply".into()),
        user_properties: vec![("__ts".into(), "1:0:n".into())],
        ..Default::default()
    };
    client
        .publish_props("svc/invoke", b"SET k v", 1, 11, false, props)
        .await;
    let mut req = inbox.recv().await.unwrap();
    assert_eq!(&*req.client_id, "caller");
    assert_eq!(&req.message.payload[..], b"SET k v");
    assert_eq!(
        req.message.properties.correlation_data.as_deref(),
        Some(&b"c1"[..])
    );
    assert_eq!(
        req.message.properties.user_property("__ts").map(|v| &v[..]),
        Some("1:0:n")
    );
    assert!(!req.dup);

    // No PUBACK before the service acks.
    assert!(
        client.ping().await.is_empty(),
        "PUBACK sent before the service acked"
    );
    req.ack(0x00);
    match client.expect().await {
        Packet::PublishAck(a) => assert_eq!((a.packet_id.get(), u8::from(a.reason_code)), (11, 0)),
        other => panic!("expected PUBACK, got {other:?}"),
    }

    // Dropping a request unacked acks with 0x80.
    client.publish("svc/invoke", b"x", 1, 12, false).await;
    drop(inbox.recv().await.unwrap());
    match client.expect().await {
        Packet::PublishAck(a) => {
            assert_eq!((a.packet_id.get(), u8::from(a.reason_code)), (12, 0x80))
        }
        other => panic!("expected PUBACK, got {other:?}"),
    }
    assert!(
        spy.ping().await.is_empty(),
        "a claimed publish reached subscribers"
    );
}

#[tokio::test]
async fn take_ack_defers_the_ack_after_moving_the_message() {
    let s = Server::default().await;
    let mut inbox = s.broker.claim_topic("svc/q2").unwrap();
    let (mut client, _) = Raw::connect(s.addr, "caller", true, 0).await;
    client.publish("svc/q2", b"x", 2, 5, false).await;
    let mut req = inbox.recv().await.unwrap();
    let acker = req.take_ack();
    let _moved = req.message;
    acker.ack(0x00);
    assert!(matches!(client.expect().await, Packet::PublishReceived(a) if a.packet_id.get() == 5));
}

#[tokio::test]
async fn deliver_to_without_subscription_and_exactly_once_with_one() {
    let s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "target", true, 0).await;
    assert!(s
        .broker
        .deliver_to("target", message("notify/x", b"direct", QoS::AtLeastOnce)));
    let p = c.expect_publish().await;
    assert_eq!(
        (&p.topic[..], &p.payload[..], u8::from(p.qos)),
        ("notify/x", &b"direct"[..], 1)
    );
    c.puback(p.packet_id.unwrap()).await;

    let opts = v5::SubscriptionOptions {
        qos: qos(0),
        ..Default::default()
    };
    c.subscribe_opts("notify/#", opts, Some(7)).await;
    assert!(s
        .broker
        .deliver_to("target", message("notify/x", b"once", QoS::AtLeastOnce)));
    let p = c.expect_publish().await;
    assert_eq!(u8::from(p.qos), 0, "the subscription's maximum QoS applies");
    assert_eq!(
        p.properties
            .unwrap()
            .subscription_ids
            .iter()
            .map(|i| i.get())
            .collect::<Vec<_>>(),
        vec![7]
    );
    assert!(c.ping().await.is_empty(), "deliver_to delivered twice");

    assert!(!s
        .broker
        .deliver_to("nobody", message("x", b"x", QoS::AtMostOnce)));
}

#[tokio::test]
async fn publish_and_deliver_to_keep_call_order() {
    let s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "ordered", true, 0).await;
    c.subscribe("resp/#", 1).await;
    for i in 0..20u8 {
        let payload: &'static [u8] = Box::leak(vec![i].into_boxed_slice());
        if i % 2 == 0 {
            s.broker
                .publish(message("resp/a", payload, QoS::AtLeastOnce));
        } else {
            s.broker
                .deliver_to("ordered", message("notify/b", payload, QoS::AtLeastOnce));
        }
    }
    for i in 0..20u8 {
        let p = c.expect_publish().await;
        assert_eq!(p.payload[0], i);
        c.puback(p.packet_id.unwrap()).await;
    }
}

#[tokio::test]
async fn service_publish_routes_with_properties() {
    let s = Server::default().await;
    let (mut c, _) = Raw::connect(s.addr, "sub", true, 0).await;
    c.subscribe("reply/+", 1).await;
    let mut m = message("reply/1", b"OK", QoS::AtLeastOnce);
    m.properties = PublishProperties {
        correlation_data: Some(Bytes::from_static(b"c9")),
        user_properties: vec![("__stat".into(), "200".into())],
        ..Default::default()
    };
    assert_eq!(s.broker.publish(m), 1);
    let p = c.expect_publish().await;
    let props = p.properties.unwrap();
    assert_eq!(props.correlation_data.as_deref(), Some(&b"c9"[..]));
    assert_eq!(props.user_properties, vec![("__stat".into(), "200".into())]);
}

#[tokio::test]
async fn disconnect_with_reason_and_lifecycle_events() {
    let s = Server::default().await;
    let mut events = s.broker.events();
    let (mut c, _) = Raw::connect(s.addr, "kicked", true, 0).await;
    wait_event(&mut events, |e| {
        *e == ClientEvent::Connected {
            client_id: "kicked".into(),
        }
    })
    .await;
    assert!(s.broker.disconnect("kicked", 0x98, Some("administrative")));
    match c.recv().await {
        Some(Packet::Disconnect(d)) => {
            assert_eq!(u8::from(d.reason_code), 0x98);
            assert_eq!(d.reason_string.as_deref(), Some("administrative"));
        }
        other => panic!("expected DISCONNECT 0x98, got {other:?}"),
    }
    wait_event(&mut events, |e| {
        *e == ClientEvent::Disconnected {
            client_id: "kicked".into(),
        }
    })
    .await;
    wait_event(&mut events, |e| {
        *e == ClientEvent::SessionEnded {
            client_id: "kicked".into(),
        }
    })
    .await;
    assert!(!s.broker.disconnect("kicked", 0x98, None));
}

#[tokio::test]
async fn full_inbox_back_pressures_instead_of_dropping() {
    let cfg = mqstate_broker::BrokerConfig {
        service_inbox_capacity: 1,
        ..Default::default()
    };
    let s = Server::start(cfg).await;
    let mut inbox = s.broker.claim_topic("svc/slow").unwrap();
    let (mut c, _) = Raw::connect(s.addr, "pusher", true, 0).await;
    for i in 1..=5 {
        c.publish("svc/slow", b"x", 1, i, false).await;
    }
    for i in 1..=5u16 {
        let mut req = inbox.recv().await.unwrap();
        req.ack(0);
        match c.expect().await {
            Packet::PublishAck(a) => assert_eq!(a.packet_id.get(), i),
            other => panic!("expected PUBACK, got {other:?}"),
        }
    }
}

/// A cluster node drops its copy of a session another node holds now (`forget_session`): the
/// client is told the session moved (0x8E) and its will is left to whoever holds the session
/// next. A client sent away while the node's lease has lapsed (`send_away`, 0x9C) and a service's
/// kick (`disconnect`) publish it as any abnormal end does.
#[tokio::test]
async fn a_session_that_moved_leaves_its_will_to_its_holder_and_other_ends_publish_it() {
    let source = std::sync::Arc::new(CopiesSource::default());
    let s = Server::serve(
        mqstate_broker::Broker::builder(mqstate_broker::BrokerConfig::default())
            .sessions_elsewhere(source.clone())
            .build(),
    )
    .await;
    let (mut watcher, _) = Raw::connect(s.addr, "watcher", true, 0).await;
    watcher.subscribe("will/#", 0).await;
    for (id, expected) in [("moved", 0x8E), ("away", 0x9C), ("kicked", 0x98)] {
        let mut connect = connect_packet(id, false, 60);
        connect.last_will = Some(will(&format!("will/{id}"), b"bye", 0, false, None));
        let (mut c, _) = Raw::connect_with(s.addr, connect).await;
        match id {
            "moved" => assert!(
                !s.broker.forget_session(id, source.last_copy(id)),
                "connected: not dropped yet"
            ),
            "away" => assert!(s.broker.send_away(id)),
            _ => assert!(s.broker.disconnect(id, 0x98, None)),
        }
        match c.recv().await {
            Some(Packet::Disconnect(d)) => assert_eq!(u8::from(d.reason_code), expected),
            other => panic!("expected DISCONNECT, got {other:?}"),
        }
    }
    // The moved client's will is left to the session's new holder; the client sent away ended
    // abnormally (its will is published once its end landed, at once here: `durable_sessions`
    // holds it back), as did the kicked one.
    let publish = watcher.expect_publish().await;
    assert_eq!(publish.topic, "will/away");
    let publish = watcher.expect_publish().await;
    assert_eq!(publish.topic, "will/kicked");
    // The client sent away resumes its session.
    let (_, ack) = Raw::connect(s.addr, "away", false, 60).await;
    assert!(ack.session_present);
}
