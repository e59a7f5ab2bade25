//! A cluster node that just started holds a new subscription's retained messages until the other
//! nodes' retained sets are in (decision 0072, `Peers::retained_ready`), and nothing else: the
//! same connection's publishes, pings and other SUBSCRIBEs go on meanwhile.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use mqstate_broker::{Forward, GroupKey, PeerId, Peers, Plan, Settled};
use rmqtt_codec::v5::{self, Packet};
use tokio::sync::watch;

/// A peers port with no other node holding a route, whose retained set is ready once `ready` is.
struct Starting {
    ready: watch::Receiver<bool>,
}

impl Peers for Starting {
    fn subscribed(&self, _: &str, _: Option<&str>) -> Option<Settled> {
        None
    }
    fn unsubscribed(&self, _: &str, _: Option<&str>) {}
    fn plan(&self, _: &str, _: bool) -> Plan {
        Plan::default()
    }
    fn forward(&self, _: Vec<(PeerId, Vec<GroupKey>)>, _: Forward<'_>) -> Option<Settled> {
        None
    }
    fn claim(&self, _: &str) -> Option<Settled> {
        None
    }
    fn retained_ready(&self) -> Option<Settled> {
        if *self.ready.borrow() {
            return None;
        }
        let mut ready = self.ready.clone();
        Some(Box::pin(async move {
            let _ = ready.wait_for(|ready| *ready).await;
        }))
    }
    fn redelivered_within(&self) -> Duration {
        Duration::from_secs(60)
    }
}

fn subscribe(packet_id: u16, filter: &str, retain_handling: u8) -> Packet {
    let opts = v5::SubscriptionOptions {
        qos: qos(1),
        retain_handling: match retain_handling {
            0 => v5::RetainHandling::AtSubscribe,
            _ => v5::RetainHandling::NoAtSubscribe,
        },
        ..Default::default()
    };
    Packet::Subscribe(v5::Subscribe {
        packet_id: pid(packet_id),
        id: None,
        user_properties: vec![],
        topic_filters: vec![(filter.into(), opts)],
    })
}

fn suback_id(packet: Packet) -> u16 {
    match packet {
        Packet::SubscribeAck(ack) => ack.packet_id.get(),
        other => panic!("expected SUBACK, got {other:?}"),
    }
}

#[tokio::test]
async fn a_subscription_waiting_for_the_retained_set_holds_nothing_else() {
    let s = Server::default().await;
    let (release, ready) = watch::channel(false);
    assert!(s.broker.attach_peers(Arc::new(Starting { ready })));

    let (mut publisher, _) = Raw::connect(s.addr, "retainer", true, 0).await;
    publisher.publish("r/a", b"v1", 1, 1, true).await;
    assert!(matches!(publisher.expect().await, Packet::PublishAck(_)));

    let (mut client, _) = Raw::connect(s.addr, "starting", true, 0).await;
    client.send(subscribe(1, "r/#", 0)).await;
    // Its own publish is acknowledged, a SUBSCRIBE that gets no retained messages is answered,
    // and a ping too, while the first SUBSCRIBE waits.
    assert_eq!(client.publish_acked("x/t", b"p", 7).await, 0x00);
    client.send(subscribe(2, "other/#", 2)).await;
    assert_eq!(suback_id(client.expect().await), 2);
    assert!(
        client.ping().await.is_empty(),
        "SUBACK 1 before the set is in"
    );

    release.send_replace(true);
    assert_eq!(suback_id(client.expect().await), 1);
    let retained = client.expect_publish().await;
    assert_eq!(
        (&*retained.topic, &retained.payload[..]),
        ("r/a", &b"v1"[..])
    );
    assert!(retained.retain);
}
