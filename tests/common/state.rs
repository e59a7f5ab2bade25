//! A raw MQTT 5 state-store client for the integration tests (rumqttc, one request at a time).

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{ConnectProperties, Packet, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use rumqttc::Outgoing;
use tokio::sync::mpsc;

pub const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
/// Hang guard for every wait, not a performance claim.
pub const WAIT: Duration = Duration::from_secs(30);
pub const OK: &[u8] = b"+OK\r\n";
pub const NIL: &[u8] = b"$-1\r\n";

/// The GET reply payload for `value`.
pub fn bulk(value: &[u8]) -> bytes::Bytes {
    mqstate_protocol::Reply::Bulk(bytes::Bytes::copy_from_slice(value)).encode()
}

/// The payload of the KEYNOTIFY notification of a SET to `value`.
pub fn set_note(value: &[u8]) -> Vec<u8> {
    let mut out = b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n".to_vec();
    out.extend_from_slice(&bulk(value));
    out
}

/// A RESP array of bulk strings, as every client sends it (written out here rather than with the
/// server's own encoder, so that the wire tests do not share its mistakes).
pub fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// This machine's wall clock, in milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// HLC text form `%015d:%05d:%s` (spec §4).
pub fn hlc(wall_ms: u64, counter: u32, node: &str) -> String {
    format!("{wall_ms:015}:{counter:05}:{node}")
}

pub fn hlc_now() -> String {
    hlc_in(0)
}

/// A client timestamp `ahead_ms` ahead of this machine's wall clock.
pub fn hlc_in(ahead_ms: u64) -> String {
    hlc(now_ms() + ahead_ms, 0, "test")
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

/// Publishes the state-store request `args` (QoS 1 to the invoke topic) with the envelope of
/// [`request_properties`].
pub async fn send_request(
    client: &AsyncClient,
    args: &[&[u8]],
    response_topic: &str,
    correlation: &Bytes,
    ts: String,
) -> Result<(), rumqttc::v5::ClientError> {
    client
        .publish_with_properties(
            INVOKE_TOPIC,
            QoS::AtLeastOnce,
            false,
            mqstate_protocol::encode_request(args),
            request_properties(response_topic, correlation, ts),
        )
        .await
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
    /// KEYNOTIFY notifications, kept apart from the replies.
    notifications: mpsc::UnboundedReceiver<Publish>,
    response_topic: String,
    next_correlation: u64,
    /// The CONNACK's Session Present.
    pub session_present: bool,
}

/// What the event loop tells the connecting side.
enum Connecting {
    ConnAck {
        session_present: bool,
    },
    SubAck,
    /// The connection ended before it was ready.
    Ended(String),
}

impl Connecting {
    async fn next(events: &mut mpsc::UnboundedReceiver<Connecting>) -> Result<Connecting, String> {
        match tokio::time::timeout(WAIT, events.recv()).await {
            Ok(Some(Connecting::Ended(e))) => Err(e),
            Ok(Some(event)) => Ok(event),
            Ok(None) => Err("the event loop ended".to_owned()),
            Err(_) => Err("no answer in time".to_owned()),
        }
    }
}

impl StateClient {
    pub async fn connect(addr: SocketAddr, id: &str) -> StateClient {
        let options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        StateClient::try_connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("{id} could not connect to {addr}: {e}"))
    }

    /// Connects with a persistent session (clean start off, expiring an hour after it ends);
    /// `Err` with the reason if the connection ends before it is ready (a node still failing over
    /// answers 0x88 Server unavailable).
    pub async fn try_connect_persistent(addr: SocketAddr, id: &str) -> Result<StateClient, String> {
        let mut options = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        options.set_clean_start(false);
        options.set_connect_properties(ConnectProperties {
            session_expiry_interval: Some(3600),
            ..ConnectProperties::new()
        });
        StateClient::try_connect_with(options).await
    }

    async fn try_connect_with(mut options: MqttOptions) -> Result<StateClient, String> {
        options.set_keep_alive(Duration::from_secs(30));
        let response_topic = format!("clients/{}/statestore/response", options.client_id());
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let (reply_tx, replies) = mpsc::unbounded_channel();
        let (note_tx, notifications) = mpsc::unbounded_channel();
        let (connecting_tx, mut connecting) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let event = match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => Connecting::ConnAck {
                        session_present: ack.session_present,
                    },
                    Ok(Event::Incoming(Packet::SubAck(_))) => Connecting::SubAck,
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let to = if p.topic.windows(16).any(|w| w == b"/command/notify/") {
                            &note_tx
                        } else {
                            &reply_tx
                        };
                        let _ = to.send(p);
                        continue;
                    }
                    // Disconnected on purpose (`disconnect`): stop here, or rumqttc would
                    // connect again.
                    Ok(Event::Outgoing(Outgoing::Disconnect)) => return,
                    Ok(_) => continue,
                    // The server is gone: stop here rather than let rumqttc reconnect.
                    Err(e) => Connecting::Ended(format!("{e:?}")),
                };
                let ended = matches!(event, Connecting::Ended(_));
                let _ = connecting_tx.send(event);
                if ended {
                    return;
                }
            }
        });
        let Connecting::ConnAck { session_present } = Connecting::next(&mut connecting).await?
        else {
            return Err("a SUBACK before the CONNACK".to_owned());
        };
        // A session that was present still has its subscription.
        if !session_present {
            client
                .subscribe(response_topic.clone(), QoS::AtLeastOnce)
                .await
                .map_err(|e| format!("{e:?}"))?;
            let Connecting::SubAck = Connecting::next(&mut connecting).await? else {
                return Err("a second CONNACK".to_owned());
            };
        }
        Ok(StateClient {
            client,
            replies,
            notifications,
            response_topic,
            next_correlation: CONNECTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32,
            session_present,
        })
    }

    /// The next KEYNOTIFY notification within `bound`. One sent again (DUP: in flight when the
    /// node holding the session died, as QoS 1 allows) is skipped.
    pub async fn next_notification(&mut self, bound: Duration) -> Publish {
        loop {
            let note = tokio::time::timeout(bound, self.notifications.recv())
                .await
                .expect("a notification in time")
                .expect("connection alive");
            if !note.dup {
                return note;
            }
            eprintln!("a notification sent again: {:?}", note.payload);
        }
    }

    /// A notification received already, if any.
    pub fn received_notification(&mut self) -> Option<Publish> {
        self.notifications.try_recv().ok()
    }

    /// Disconnects (a persistent session stays).
    pub async fn disconnect(self) {
        self.client.disconnect().await.unwrap();
        // The event loop sends DISCONNECT and ends; give it the chance before dropping.
        let mut notifications = self.notifications;
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while notifications.recv().await.is_some() {}
        })
        .await;
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
        send_request(&self.client, args, &self.response_topic, &correlation, ts)
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
