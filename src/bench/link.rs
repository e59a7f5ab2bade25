//! One bench connection, whichever client carries it: our own [`wire`] client on plain TCP (with
//! TCP_NODELAY, so the figures are the server's), rumqttc when `--tls` is given — TLS needs the rustls
//! configuration rumqttc builds from `--ca`/`--cert`/`--key`, and its latencies then include rumqttc's
//! Nagle delay (`docs/decisions/0013-bench-client.md`).

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{Filter, Login, Packet, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event};
use tokio::sync::mpsc;

use super::wire;
use crate::client::connection::{ConnectionArgs, KEEP_ALIVE};
use crate::client::error::CliError;
use crate::client::rpc;

/// Requests queued between a rumqttc client and its event loop.
const RUMQTTC_CHANNEL_CAPACITY: usize = 1024;

/// Opens a connection for `client_id`, subscribed to `filters`, with at most `max_inflight` of our
/// QoS 1 publishes awaiting PUBACK (fewer if the server's Receive Maximum says so).
pub async fn open(
    conn: &ConnectionArgs,
    client_id: &str,
    filters: Vec<Filter>,
    max_inflight: u16,
) -> Result<(Sender, Incoming), CliError> {
    if conn.tls {
        return open_rumqttc(conn, client_id, filters, max_inflight).await;
    }
    let options = wire::Options {
        client_id: client_id.to_owned(),
        keep_alive: KEEP_ALIVE,
        login: conn
            .credentials()?
            .map(|(user, password)| Login::new(user, password)),
        max_inflight,
        filters,
    };
    let link = wire::connect(&conn.addr(), options, conn.timeout())
        .await
        .map_err(|reason| CliError::Connect {
            addr: conn.addr(),
            reason,
        })?;
    Ok((Sender::Wire(link.sender), Incoming::Wire(link.incoming)))
}

async fn open_rumqttc(
    conn: &ConnectionArgs,
    client_id: &str,
    filters: Vec<Filter>,
    max_inflight: u16,
) -> Result<(Sender, Incoming), CliError> {
    let mut options = conn.mqtt_options(client_id)?;
    options.set_outgoing_inflight_upper_limit(max_inflight);
    let connected = rpc::open(options, filters, RUMQTTC_CHANNEL_CAPACITY, conn.timeout()).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    for early in connected.early {
        let _ = tx.send(Ok(early));
    }
    let mut eventloop = connected.eventloop;
    // Polls without ever blocking on the receiver, so publishes queued by the sender always drain; ends
    // with the connection (after DISCONNECT, or once every sender is dropped).
    tokio::spawn(async move {
        loop {
            let reason = match eventloop.poll().await {
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    let _ = tx.send(Ok(publish));
                    continue;
                }
                Ok(Event::Incoming(Packet::Disconnect(d))) => {
                    format!("server sent DISCONNECT {:?}", d.reason_code)
                }
                Ok(_) => continue,
                Err(e) => e.to_string(),
            };
            let _ = tx.send(Err(reason));
            return;
        }
    });
    Ok((Sender::Rumqttc(connected.client), Incoming::Rumqttc(rx)))
}

#[derive(Clone)]
pub enum Sender {
    Wire(wire::Sender),
    Rumqttc(AsyncClient),
}

impl Sender {
    pub async fn publish(
        &self,
        topic: &str,
        qos: QoS,
        payload: Bytes,
        properties: Option<PublishProperties>,
    ) -> Result<(), String> {
        match self {
            Sender::Wire(sender) => sender.publish(topic, qos, payload, properties).await,
            Sender::Rumqttc(client) => match properties {
                Some(p) => client
                    .publish_with_properties(topic, qos, false, payload, p)
                    .await
                    .map_err(|e| e.to_string()),
                None => client
                    .publish(topic, qos, false, payload)
                    .await
                    .map_err(|e| e.to_string()),
            },
        }
    }

    /// Sends DISCONNECT after everything already queued.
    pub async fn disconnect(&self) {
        match self {
            Sender::Wire(sender) => sender.disconnect().await,
            Sender::Rumqttc(client) => {
                let _ = client.disconnect().await;
            }
        }
    }
}

pub enum Incoming {
    Wire(wire::Incoming),
    Rumqttc(mpsc::UnboundedReceiver<Result<Publish, String>>),
}

impl Incoming {
    /// The next PUBLISH from the server, or why the connection ended.
    pub async fn recv(&mut self) -> Result<Publish, String> {
        match self {
            Incoming::Wire(incoming) => incoming.recv().await,
            Incoming::Rumqttc(rx) => rx
                .recv()
                .await
                .unwrap_or_else(|| Err("connection closed".into())),
        }
    }
}
