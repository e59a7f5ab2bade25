//! A raw MQTT 5 state-store client for the integration tests (rumqttc, one request at a time).

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use tokio::sync::{mpsc, oneshot};

pub const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
/// Hang guard for every wait, not a performance claim.
pub const WAIT: Duration = Duration::from_secs(30);
pub const OK: &[u8] = b"+OK\r\n";
pub const NIL: &[u8] = b"$-1\r\n";

/// The GET reply payload for `value`.
pub fn bulk(value: &[u8]) -> bytes::Bytes {
    mqstate_protocol::Reply::Bulk(bytes::Bytes::copy_from_slice(value)).encode()
}

pub fn hlc_now() -> String {
    hlc_in(0)
}

/// A client timestamp `ahead_ms` ahead of this machine's wall clock.
pub fn hlc_in(ahead_ms: u64) -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + u128::from(ahead_ms);
    format!("{ms:015}:{:05}:test", 0)
}

/// The (wall ms, counter) of an HLC text, for comparing versions.
pub fn hlc_order(ts: &str) -> (u64, u32) {
    let mut parts = ts.split(':');
    let wall = parts.next().unwrap().parse().unwrap();
    let counter = parts.next().unwrap().parse().unwrap();
    (wall, counter)
}

/// The properties of a state-store request answered on `response_topic` with `correlation`,
/// stamped `__ts = ts`.
pub fn request_properties(
    response_topic: &str,
    correlation: &Bytes,
    ts: String,
) -> PublishProperties {
    PublishProperties {
        response_topic: Some(response_topic.to_owned()),
        correlation_data: Some(correlation.clone()),
        user_properties: vec![("__ts".to_owned(), ts)],
        ..PublishProperties::default()
    }
}

/// The `__ts` of a reply, if it has one.
pub fn reply_ts(props: &PublishProperties) -> Option<String> {
    props
        .user_properties
        .iter()
        .find(|(name, _)| name == "__ts")
        .map(|(_, value)| value.clone())
}

/// Connections made so far by this test process: each starts its correlation data at its own
/// number, since correlation data identifies a request across connections and restarts (a retry
/// carries the same and gets the first reply).
static CONNECTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub struct StateClient {
    client: AsyncClient,
    replies: mpsc::UnboundedReceiver<Publish>,
    response_topic: String,
    next_correlation: u64,
}

impl StateClient {
    pub async fn connect(addr: SocketAddr, id: &str) -> StateClient {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_keep_alive(Duration::from_secs(30));
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (tx, replies) = mpsc::unbounded_channel();
        let (subscribed_tx, subscribed_rx) = oneshot::channel();
        tokio::spawn(async move {
            let mut subscribed = Some(subscribed_tx);
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        if let Some(s) = subscribed.take() {
                            let _ = s.send(());
                        }
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let _ = tx.send(p);
                    }
                    Ok(_) => {}
                    // The server is gone: stop here rather than let rumqttc reconnect.
                    Err(_) => return,
                }
            }
        });
        let response_topic = format!("clients/{id}/statestore/response");
        client
            .subscribe(response_topic.clone(), QoS::AtLeastOnce)
            .await
            .unwrap();
        tokio::time::timeout(WAIT, subscribed_rx)
            .await
            .expect("SUBACK in time")
            .expect("connection alive until SUBACK");
        StateClient {
            client,
            replies,
            response_topic,
            next_correlation: CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32,
        }
    }

    /// One request; returns the reply payload.
    pub async fn request(&mut self, args: &[&[u8]]) -> Bytes {
        self.request_at(args, hlc_now()).await.0
    }

    /// One request stamped `__ts = ts`; returns the reply payload and the reply's `__ts`.
    pub async fn request_at(&mut self, args: &[&[u8]], ts: String) -> (Bytes, Option<String>) {
        self.next_correlation += 1;
        let correlation = Bytes::from(self.next_correlation.to_be_bytes().to_vec());
        self.request_as(args, &correlation, ts).await
    }

    /// One request with the given correlation data (a retry: the same as an earlier request's),
    /// stamped `__ts = ts`; returns the reply payload and the reply's `__ts`.
    pub async fn request_as(
        &mut self,
        args: &[&[u8]],
        correlation: &Bytes,
        ts: String,
    ) -> (Bytes, Option<String>) {
        let correlation = correlation.clone();
        let properties = request_properties(&self.response_topic, &correlation, ts);
        self.client
            .publish_with_properties(
                INVOKE_TOPIC,
                QoS::AtLeastOnce,
                false,
                mqstate_protocol::encode_request(args),
                properties,
            )
            .await
            .unwrap();
        loop {
            let publish = tokio::time::timeout(WAIT, self.replies.recv())
                .await
                .expect("reply in time")
                .expect("connection alive until the reply");
            let props = publish.properties.clone().unwrap_or_default();
            if props.correlation_data.as_ref() == Some(&correlation) {
                return (publish.payload, reply_ts(&props));
            }
        }
    }
}

/// Strict SCAN reply parser: (keys, continuation token).
pub fn parse_scan(payload: &[u8]) -> (Vec<Vec<u8>>, Option<Vec<u8>>) {
    fn line<'a>(buf: &mut &'a [u8]) -> &'a [u8] {
        let end = buf
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("CRLF-terminated line");
        let (head, tail) = buf.split_at(end);
        *buf = &tail[2..];
        head
    }
    fn bulk_string(buf: &mut &[u8]) -> Vec<u8> {
        let header = line(buf);
        assert_eq!(header[0], b'$', "bulk string expected");
        let len: usize = std::str::from_utf8(&header[1..]).unwrap().parse().unwrap();
        let value = buf[..len].to_vec();
        assert_eq!(&buf[len..len + 2], b"\r\n");
        *buf = &buf[len + 2..];
        value
    }
    let mut buf = payload;
    let outer = line(&mut buf);
    let outer_len = match outer {
        b"*1" => 1,
        b"*2" => 2,
        other => panic!(
            "SCAN reply must start with *1 or *2, got {:?}",
            String::from_utf8_lossy(other)
        ),
    };
    let inner = line(&mut buf);
    assert_eq!(inner[0], b'*', "SCAN reply: key array expected");
    let n: usize = std::str::from_utf8(&inner[1..]).unwrap().parse().unwrap();
    let keys = (0..n).map(|_| bulk_string(&mut buf)).collect();
    let token = (outer_len == 2).then(|| bulk_string(&mut buf));
    assert!(
        buf.is_empty(),
        "SCAN reply: trailing bytes {:?}",
        String::from_utf8_lossy(buf)
    );
    (keys, token)
}
