//! Test harness: a real broker on a loopback port, and a raw MQTT 5 client built on the codec
//! crate so tests can send exactly the packets they mean (including bad ones).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::num::NonZeroU16;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use mqstate_broker::{Broker, BrokerConfig, Security};
use rmqtt_codec::types::QoS as CQoS;
use rmqtt_codec::v5::{self, Packet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::codec::{Decoder, Encoder};

/// Guard against hangs only; no test asserts on timing.
pub const GUARD: Duration = Duration::from_secs(10);

pub struct Server {
    pub broker: Broker,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start(config: BrokerConfig) -> Self {
        Self::serve(Broker::new(config)).await
    }

    pub async fn start_secured(config: BrokerConfig, security: Security) -> Self {
        Self::serve(Broker::builder(config).security(security).build()).await
    }

    /// Serves an already built (e.g. journalled or restored) broker.
    pub async fn serve(broker: Broker) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(mqstate_broker::serve(
            listener,
            broker.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            broker,
            addr,
            stop: Some(stop),
            task,
        }
    }

    pub async fn default() -> Self {
        Self::start(BrokerConfig::default()).await
    }

    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub fn pid(n: u16) -> NonZeroU16 {
    NonZeroU16::new(n).unwrap()
}

pub fn qos(n: u8) -> CQoS {
    CQoS::try_from(n).unwrap()
}

pub struct Raw {
    pub stream: TcpStream,
    codec: v5::Codec,
    buf: BytesMut,
}

impl Raw {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        Self {
            stream,
            codec: v5::Codec::new(0, 0),
            buf: BytesMut::new(),
        }
    }

    pub async fn send(&mut self, p: Packet) {
        let mut out = BytesMut::new();
        self.codec.encode(p, &mut out).unwrap();
        self.stream.write_all(&out).await.unwrap();
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Next packet, or `None` if the server closed the connection.
    pub async fn recv(&mut self) -> Option<Packet> {
        tokio::time::timeout(GUARD, async {
            loop {
                if let Some((p, _)) = self.codec.decode(&mut self.buf).unwrap() {
                    return Some(p);
                }
                match self.stream.read_buf(&mut self.buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => {}
                }
            }
        })
        .await
        .expect("no packet within the guard timeout")
    }

    pub async fn expect(&mut self) -> Packet {
        self.recv().await.expect("connection closed")
    }

    pub async fn expect_publish(&mut self) -> rmqtt_codec::types::Publish {
        match self.expect().await {
            Packet::Publish(p) => *p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    /// Reads raw bytes until the server closes.
    /// Reads until the server closes; returns the reason code of the DISCONNECT it sent, if any.
    pub async fn disconnect_reason(&mut self) -> Option<u8> {
        let mut last = None;
        while let Some(p) = self.recv().await {
            if let Packet::Disconnect(d) = p {
                last = Some(u8::from(d.reason_code));
            }
        }
        last
    }

    pub async fn read_to_close(&mut self) -> Vec<u8> {
        let mut out = self.buf.to_vec();
        tokio::time::timeout(GUARD, self.stream.read_to_end(&mut out))
            .await
            .expect("server did not close")
            .ok();
        out
    }

    pub async fn connect_with(addr: SocketAddr, connect: v5::Connect) -> (Self, v5::ConnectAck) {
        let mut c = Self::open(addr).await;
        c.send(Packet::Connect(Box::new(connect))).await;
        match c.expect().await {
            Packet::ConnectAck(ack) => (c, *ack),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    pub async fn connect(
        addr: SocketAddr,
        id: &str,
        clean_start: bool,
        expiry_secs: u32,
    ) -> (Self, v5::ConnectAck) {
        Self::connect_with(addr, connect_packet(id, clean_start, expiry_secs)).await
    }

    pub async fn subscribe(&mut self, filter: &str, q: u8) -> Vec<v5::SubscribeAckReason> {
        let opts = v5::SubscriptionOptions {
            qos: qos(q),
            ..Default::default()
        };
        self.subscribe_opts(filter, opts, None).await
    }

    pub async fn subscribe_opts(
        &mut self,
        filter: &str,
        opts: v5::SubscriptionOptions,
        id: Option<u32>,
    ) -> Vec<v5::SubscribeAckReason> {
        self.send(Packet::Subscribe(v5::Subscribe {
            packet_id: pid(1000),
            id: id.and_then(std::num::NonZeroU32::new),
            user_properties: vec![],
            topic_filters: vec![(filter.into(), opts)],
        }))
        .await;
        match self.expect().await {
            Packet::SubscribeAck(ack) => ack.status,
            other => panic!("expected SUBACK, got {other:?}"),
        }
    }

    pub async fn publish(
        &mut self,
        topic: &str,
        payload: &'static [u8],
        q: u8,
        packet_id: u16,
        retain: bool,
    ) {
        self.publish_props(
            topic,
            payload,
            q,
            packet_id,
            retain,
            v5::PublishProperties::default(),
        )
        .await;
    }

    pub async fn publish_props(
        &mut self,
        topic: &str,
        payload: &'static [u8],
        q: u8,
        packet_id: u16,
        retain: bool,
        properties: v5::PublishProperties,
    ) {
        self.send(Packet::Publish(Box::new(rmqtt_codec::types::Publish {
            dup: false,
            retain,
            qos: qos(q),
            topic: topic.into(),
            packet_id: (q > 0).then(|| pid(packet_id)),
            payload: Bytes::from_static(payload),
            properties: Some(properties),
        })))
        .await;
    }

    /// Publishes QoS 1 and waits for the PUBACK; returns its reason code.
    pub async fn publish_acked(
        &mut self,
        topic: &str,
        payload: &'static [u8],
        packet_id: u16,
    ) -> u8 {
        self.publish(topic, payload, 1, packet_id, false).await;
        match self.expect().await {
            Packet::PublishAck(a) => {
                assert_eq!(a.packet_id.get(), packet_id);
                a.reason_code.into()
            }
            other => panic!("expected PUBACK, got {other:?}"),
        }
    }

    pub async fn puback(&mut self, packet_id: NonZeroU16) {
        self.send(Packet::PublishAck(v5::PublishAck {
            packet_id,
            reason_code: v5::PublishAckReason::Success,
            properties: vec![],
            reason_string: None,
        }))
        .await;
    }

    /// PINGREQ and wait for PINGRESP, returning everything received before it.
    pub async fn ping(&mut self) -> Vec<Packet> {
        self.send(Packet::PingRequest).await;
        let mut before = Vec::new();
        loop {
            match self.expect().await {
                Packet::PingResponse => return before,
                other => before.push(other),
            }
        }
    }

    pub async fn disconnect(mut self, reason: v5::DisconnectReasonCode) {
        self.send(Packet::Disconnect(v5::Disconnect::new(reason)))
            .await;
        // Wait for the server to close so the disconnect is fully processed.
        let _ = self.read_to_close().await;
    }
}

/// A will of `message` on `topic`, sent `delay_secs` after the connection is lost (at once if
/// `None`); no properties.
pub fn will(
    topic: &str,
    message: &'static [u8],
    q: u8,
    retain: bool,
    delay_secs: Option<u32>,
) -> v5::LastWill {
    v5::LastWill {
        qos: qos(q),
        retain,
        topic: topic.into(),
        message: Bytes::from_static(message),
        will_delay_interval_sec: delay_secs,
        correlation_data: None,
        message_expiry_interval: None,
        content_type: None,
        user_properties: Vec::new(),
        is_utf8_payload: None,
        response_topic: None,
    }
}

pub fn connect_packet(id: &str, clean_start: bool, expiry_secs: u32) -> v5::Connect {
    v5::Connect {
        clean_start,
        keep_alive: 60,
        session_expiry_interval_secs: expiry_secs,
        client_id: id.into(),
        ..v5::Connect::default()
    }
}

/// Waits for a lifecycle event matching `pred`.
pub async fn wait_event(
    rx: &mut tokio::sync::broadcast::Receiver<mqstate_broker::ClientEvent>,
    pred: impl Fn(&mqstate_broker::ClientEvent) -> bool,
) {
    tokio::time::timeout(GUARD, async {
        loop {
            let e = rx.recv().await.unwrap();
            if pred(&e) {
                return;
            }
        }
    })
    .await
    .expect("event did not arrive");
}

/// A cluster node's session source that finds every session here (`Located::Here`, or, once,
/// the session the test hands it: `Located::Taken`), says that everything landed, and remembers
/// the copy each CONNECT would put in, so that a test can name a copy
/// (`Broker::forget_session`).
#[derive(Default)]
pub struct CopiesSource {
    /// Per locate, in order: the client id and the copy its CONNECT puts in if it creates one.
    pub copies: std::sync::Mutex<Vec<(String, mqstate_broker::CopyId)>>,
    /// Handed to the next CONNECT that finds a copy here, as taken from another node.
    pub taken: std::sync::Mutex<Option<mqstate_broker::StoredSession>>,
}

impl CopiesSource {
    /// The copy the last CONNECT of `client_id` put in, if it created one.
    pub fn last_copy(&self, client_id: &str) -> mqstate_broker::CopyId {
        let copies = self.copies.lock().unwrap();
        let found = copies.iter().rev().find(|(id, _)| id == client_id);
        found
            .map(|(_, copy)| *copy)
            .expect("a CONNECT of the client")
    }
}

impl mqstate_broker::SessionSource for CopiesSource {
    fn locate(
        &self,
        client_id: &str,
        _: bool,
        _: bool,
        held_here: bool,
        copy: mqstate_broker::CopyId,
    ) -> mqstate_broker::Locating {
        self.copies
            .lock()
            .unwrap()
            .push((client_id.to_owned(), copy));
        let taken = held_here
            .then(|| self.taken.lock().unwrap().take())
            .flatten();
        Box::pin(async move {
            Ok(match taken {
                Some(session) => mqstate_broker::Located::Taken(Box::new(session)),
                None => mqstate_broker::Located::Here,
            })
        })
    }

    fn landed(&self, _: &str) -> mqstate_broker::Landing {
        Box::pin(async { true })
    }
}
