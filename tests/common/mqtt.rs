//! A plain MQTT 5 client for the integration tests (rumqttc): PUBACK reason codes, received
//! publishes, optionally a persistent session.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{ConnectProperties, Packet, PubAckReason, Publish};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, MqttOptions, StateError};
use tokio::sync::mpsc;

use super::state::WAIT;

/// An MQTT client that reports PUBACK reason codes and received publishes.
pub struct Client {
    pub client: AsyncClient,
    acks: mpsc::UnboundedReceiver<PubAckReason>,
    subacks: mpsc::UnboundedReceiver<()>,
    received: mpsc::UnboundedReceiver<Publish>,
}

impl Client {
    /// Connects; a `persistent` client keeps its session for an hour (clean start off).
    pub async fn connect(addr: SocketAddr, id: &str, persistent: bool) -> Client {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_keep_alive(Duration::from_secs(30));
        if persistent {
            options.set_clean_start(false);
            options.set_connect_properties(ConnectProperties {
                session_expiry_interval: Some(3600),
                ..ConnectProperties::new()
            });
        }
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (ack_tx, acks) = mpsc::unbounded_channel();
        let (publish_tx, received) = mpsc::unbounded_channel();
        let (suback_tx, subacks) = mpsc::unbounded_channel();
        let (connected_tx, mut connected) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        let _ = connected_tx.send(Ok(()));
                    }
                    Ok(Event::Incoming(Packet::PubAck(ack))) => {
                        let _ = ack_tx.send(ack.reason);
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let _ = publish_tx.send(p);
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        let _ = suback_tx.send(());
                    }
                    Ok(_) => {}
                    // rumqttc reports a failed PUBACK as an error and reconnects on the next poll
                    // (the publisher's session is not persistent, so nothing is lost by that).
                    Err(ConnectionError::MqttState(StateError::PubAckFail { reason })) => {
                        let _ = ack_tx.send(reason);
                    }
                    Err(error) => {
                        // Says why, if it happens before CONNACK (a test then fails with it).
                        let _ = connected_tx.send(Err(format!("{error:?}")));
                        return;
                    }
                }
            }
        });
        let connected = tokio::time::timeout(WAIT, connected.recv())
            .await
            .expect("CONNACK in time")
            .expect("the event loop reports CONNACK or its error");
        if let Err(error) = connected {
            panic!("{id}: the connection ended before CONNACK: {error}");
        }
        Client {
            client,
            acks,
            subacks,
            received,
        }
    }

    pub async fn subscribe(&mut self, topic: &str) {
        self.client
            .subscribe(topic, QoS::AtLeastOnce)
            .await
            .unwrap();
        tokio::time::timeout(WAIT, self.subacks.recv())
            .await
            .expect("SUBACK in time")
            .expect("connection alive until SUBACK");
    }

    /// Publishes at QoS 1 and returns the PUBACK's reason.
    pub async fn publish(&mut self, topic: &str, payload: Bytes) -> PubAckReason {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
            .unwrap();
        tokio::time::timeout(WAIT, self.acks.recv())
            .await
            .expect("PUBACK in time")
            .expect("connection alive until PUBACK")
    }

    pub async fn next_message(&mut self) -> Bytes {
        tokio::time::timeout(WAIT, self.received.recv())
            .await
            .expect("a queued message in time")
            .expect("connection alive")
            .payload
    }
}
