//! The broker's metrics, through the `metrics` facade (no-ops unless the binary installs a recorder):
//!
//! * `mqstate_connections_accepted_total` — TCP connections accepted, before any handshake.
//! * `mqstate_clients_connected` — clients past CONNACK and not yet disconnected.
//! * `mqstate_messages_received_total{qos}` — valid PUBLISH packets from clients (QoS 2 retries of a
//!   message already held are not counted again).
//! * `mqstate_messages_sent_total{qos}` — PUBLISH packets written to clients, at the delivery QoS;
//!   resends of in-flight messages after a reconnect are not counted again.
//!
//! The number of sessions is not counted here: [`crate::Broker::session_count`] reads it when asked.

use metrics::{counter, gauge};

use crate::message::QoS;

pub(crate) fn connection_accepted() {
    counter!("mqstate_connections_accepted_total").increment(1);
}

pub(crate) fn client_connected() {
    gauge!("mqstate_clients_connected").increment(1.0);
}

pub(crate) fn client_disconnected() {
    gauge!("mqstate_clients_connected").decrement(1.0);
}

pub(crate) fn message_received(qos: QoS) {
    counter!("mqstate_messages_received_total", "qos" => qos_label(qos)).increment(1);
}

/// Messages written in one pumped batch, reported once per batch rather than per message.
#[derive(Default)]
pub(crate) struct SentByQos([u64; 3]);

impl SentByQos {
    pub(crate) fn add(&mut self, qos: QoS) {
        self.0[qos as usize] += 1;
    }

    pub(crate) fn report(self) {
        for (qos, n) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
            .into_iter()
            .zip(self.0)
        {
            if n > 0 {
                counter!("mqstate_messages_sent_total", "qos" => qos_label(qos)).increment(n);
            }
        }
    }
}

fn qos_label(qos: QoS) -> &'static str {
    match qos {
        QoS::AtMostOnce => "0",
        QoS::AtLeastOnce => "1",
        QoS::ExactlyOnce => "2",
    }
}
