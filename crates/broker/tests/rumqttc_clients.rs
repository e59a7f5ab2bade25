//! Interoperability with a real client library, MQTT 3.1.1 and MQTT 5.

mod common;

use std::time::Duration;

use common::*;

/// Polls an event loop until `pick` returns something.
async fn poll_until<T>(mut next: impl AsyncFnMut() -> Option<T>) -> T {
    tokio::time::timeout(GUARD, async {
        loop {
            if let Some(t) = next().await {
                return t;
            }
        }
    })
    .await
    .expect("event did not arrive")
}

#[tokio::test]
async fn mqtt311_publish_subscribe_and_persistent_session() {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let s = Server::default().await;

    let mut opts = MqttOptions::new("v3-sub", "127.0.0.1", s.addr.port());
    opts.set_clean_session(false)
        .set_keep_alive(Duration::from_secs(30));
    let (sub, mut sub_loop) = AsyncClient::new(opts.clone(), 16);
    sub.subscribe("v3/#", QoS::AtLeastOnce).await.unwrap();
    poll_until(async || match sub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::SubAck(_)) => Some(()),
        _ => None,
    })
    .await;

    let popts = MqttOptions::new("v3-pub", "127.0.0.1", s.addr.port());
    let (publ, mut pub_loop) = AsyncClient::new(popts, 16);
    publ.publish("v3/a", QoS::AtLeastOnce, false, "hello")
        .await
        .unwrap();
    poll_until(async || match pub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::PubAck(_)) => Some(()),
        _ => None,
    })
    .await;
    let got = poll_until(async || match sub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::Publish(p)) => Some(p),
        _ => None,
    })
    .await;
    assert_eq!(&got.payload[..], b"hello");
    assert_eq!(got.qos, QoS::AtLeastOnce);

    // The subscriber goes away; a message published meanwhile is delivered when it returns.
    drop(sub);
    drop(sub_loop);
    let mut events = s.broker.events();
    wait_event(&mut events, |e| matches!(e, mqstate_broker::ClientEvent::Disconnected { client_id } if &**client_id == "v3-sub")).await;
    publ.publish("v3/b", QoS::AtLeastOnce, false, "queued")
        .await
        .unwrap();
    poll_until(async || match pub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::PubAck(_)) => Some(()),
        _ => None,
    })
    .await;
    let (_sub, mut sub_loop) = AsyncClient::new(opts, 16);
    let present = poll_until(async || match sub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::ConnAck(a)) => Some(a.session_present),
        _ => None,
    })
    .await;
    assert!(present);
    let got = poll_until(async || match sub_loop.poll().await.unwrap() {
        Event::Incoming(Packet::Publish(p)) => Some(p),
        _ => None,
    })
    .await;
    assert_eq!(&got.payload[..], b"queued");
}

#[tokio::test]
async fn mqtt5_client_library_round_trip_qos2() {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    let s = Server::default().await;

    let (client, mut ev) =
        AsyncClient::new(MqttOptions::new("v5-lib", "127.0.0.1", s.addr.port()), 16);
    client.subscribe("lib/t", QoS::ExactlyOnce).await.unwrap();
    poll_until(async || match ev.poll().await.unwrap() {
        Event::Incoming(Packet::SubAck(_)) => Some(()),
        _ => None,
    })
    .await;
    client
        .publish("lib/t", QoS::ExactlyOnce, false, "exactly")
        .await
        .unwrap();
    let got = poll_until(async || match ev.poll().await.unwrap() {
        Event::Incoming(Packet::Publish(p)) => Some(p),
        _ => None,
    })
    .await;
    assert_eq!(&got.payload[..], b"exactly");
    assert_eq!(got.qos, QoS::ExactlyOnce);
    poll_until(async || match ev.poll().await.unwrap() {
        Event::Incoming(Packet::PubComp(_)) => Some(()),
        _ => None,
    })
    .await;
}
