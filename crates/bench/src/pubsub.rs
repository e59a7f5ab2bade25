//! Plain MQTT publish/subscribe load: publishers send timestamped payloads to one topic tree, every
//! subscriber receives every message; we measure delivered messages/s and end-to-end latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::Filter;
use rumqttc::v5::mqttbytes::QoS;
use tokio::task::JoinSet;

use super::stats::Outcome;
use super::{BenchArgs, Shared};
use mqstate_cli::dial::Connection;
use mqstate_cli::error::CliError;
use mqstate_cli::wire::{self, Turn};

pub struct Prepared {
    topic_root: String,
    qos: QoS,
    payload: usize,
    publishers: Vec<Connection>,
    subscribers: Vec<Connection>,
    timeout: Duration,
}

/// PUBLISHes a publisher queues per turn before it looks at what the server sent: bounds the write
/// buffer of QoS 0 publishers, whose only other limit is the socket.
const PUBLISHES_PER_TURN: usize = 64;

fn unix_us(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A payload of `size` bytes starting with the send time (µs since the Unix epoch, big-endian).
fn stamped_payload(size: usize, sent_us: u64) -> Bytes {
    debug_assert!(size >= super::MIN_PAYLOAD_BYTES);
    let mut out = BytesMut::with_capacity(size);
    out.put_u64(sent_us);
    out.resize(size, b'.');
    out.freeze()
}

fn sent_us(payload: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(payload.get(..8)?.try_into().ok()?))
}

pub async fn prepare(args: &BenchArgs) -> Result<super::Prepared, CliError> {
    let prefix = args.conn.client_id("mqstate-bench");
    let topic_root = format!("mqstate-bench/{prefix}");
    let qos = if args.qos == 0 {
        QoS::AtMostOnce
    } else {
        QoS::AtLeastOnce
    };
    let timeout = args.conn.timeout();
    // With `--servers`, subscribers and publishers take the servers in turn, publishers starting
    // one further along, so that on a cluster most copies cross between nodes.
    let dialers = super::statestore::dialers(args)?;
    let dialer = |i: usize| &dialers[i % dialers.len()];
    let mut subscribers = Vec::new();
    for i in 0..args.subscribers {
        let filter = Filter::new(format!("{topic_root}/#"), qos);
        let client_id = format!("{prefix}-sub-{i}");
        // Subscribers publish nothing: the window is irrelevant.
        subscribers.push(dialer(i as usize).open(&client_id, vec![filter], 1).await?);
    }
    let mut publishers = Vec::new();
    for i in 0..args.publishers {
        let client_id = format!("{prefix}-pub-{i}");
        publishers.push(
            dialer(i as usize + 1)
                .open(&client_id, Vec::new(), args.inflight)
                .await?,
        );
    }
    Ok(super::Prepared::Pubsub(Prepared {
        topic_root,
        qos,
        payload: args.payload,
        publishers,
        subscribers,
        timeout,
    }))
}

impl Prepared {
    pub async fn run(self, shared: Arc<Shared>) -> Result<(), CliError> {
        let delivered = Arc::new(AtomicU64::new(0));
        let subscriber_count = self.subscribers.len() as u64;
        let measure_from_us = unix_us(
            SystemTime::now()
                + shared
                    .measure_from
                    .saturating_duration_since(Instant::now()),
        );
        let mut subscribers = JoinSet::new();
        for link in self.subscribers {
            let subscriber = Subscriber {
                shared: Arc::clone(&shared),
                delivered: Arc::clone(&delivered),
                prefix: self.topic_root.clone(),
                measure_from_us,
            };
            subscribers.spawn(async move {
                let Err(e) = subscriber.drive(link).await;
                subscriber
                    .shared
                    .recorder
                    .count(&format!("connection: {e}"), true, 1);
            });
        }
        let published = Arc::new(AtomicU64::new(0));
        let mut publishers = JoinSet::new();
        for (i, mut link) in self.publishers.into_iter().enumerate() {
            let shared = Arc::clone(&shared);
            let published = Arc::clone(&published);
            let topic = Bytes::from(format!("{}/{i}", self.topic_root));
            let (qos, size, timeout) = (self.qos, self.payload, self.timeout);
            publishers.spawn(async move {
                let driven =
                    publish_until_stopped(&mut link, &shared, &published, &topic, qos, size);
                match driven.await {
                    // DISCONNECT goes out after the queued publishes.
                    Ok(()) => drop(tokio::time::timeout(timeout, link.disconnect()).await),
                    Err(e) => shared.recorder.count(&format!("connection: {e}"), true, 1),
                }
            });
        }
        while publishers.join_next().await.is_some() {}
        // Every subscriber should see every message; wait for the stragglers at most one timeout.
        let expected = published.load(Ordering::Relaxed) * subscriber_count;
        let deadline = Instant::now() + self.timeout;
        while delivered.load(Ordering::Relaxed) < expected && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let got = delivered.load(Ordering::Relaxed);
        if got < expected {
            shared.recorder.count("not delivered", true, expected - got);
        }
        subscribers.abort_all();
        Ok(())
    }
}

/// Publishes stamped payloads while the run hands out tickets: for QoS 1 as many as the window holds,
/// then waits for PUBACKs; for QoS 0 as fast as the socket takes them.
async fn publish_until_stopped(
    link: &mut Connection,
    shared: &Shared,
    published: &AtomicU64,
    topic: &Bytes,
    qos: QoS,
    size: usize,
) -> Result<(), String> {
    loop {
        // Publishers subscribe to nothing: this takes in PUBACKs (and fails on a DISCONNECT).
        while link.next()?.is_some() {}
        let mut queued = 0;
        while queued < PUBLISHES_PER_TURN && (qos == QoS::AtMostOnce || link.window_open()) {
            if !shared.take_ticket() {
                return link.flush().await;
            }
            let payload = stamped_payload(size, unix_us(SystemTime::now()));
            link.publish(&mut wire::publish(topic, qos, payload, None))?;
            published.fetch_add(1, Ordering::Relaxed);
            queued += 1;
        }
        link.flush().await?;
        if qos == QoS::AtLeastOnce && !link.window_open() {
            // A silent server: give up on the tick after the run is over.
            if link.read().await? == Turn::Tick && shared.is_stopped() {
                return Ok(());
            }
        } else {
            // Room to publish more: look at what arrived without waiting for anything, then let the
            // subscribers (maybe on this very thread) have their turn before flooding on.
            tokio::select! {
                biased;
                turn = link.read() => drop(turn?),
                () = std::future::ready(()) => {}
            }
            tokio::task::yield_now().await;
        }
    }
}

/// The task that owns one subscribing connection; it runs until aborted or the connection fails.
struct Subscriber {
    shared: Arc<Shared>,
    delivered: Arc<AtomicU64>,
    prefix: String,
    measure_from_us: u64,
}

impl Subscriber {
    async fn drive(&self, mut link: Connection) -> Result<std::convert::Infallible, String> {
        loop {
            while let Some(publish) = link.next()? {
                link.acknowledge(&publish)?;
                if publish.topic.starts_with(self.prefix.as_bytes()) {
                    self.on_message(&publish.payload);
                }
            }
            link.flush().await?;
            link.read().await?;
        }
    }

    fn on_message(&self, payload: &[u8]) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
        let now = SystemTime::now();
        let Some(sent) = sent_us(payload) else {
            return;
        };
        if sent >= self.measure_from_us {
            let latency = Duration::from_micros(unix_us(now).saturating_sub(sent));
            let outcome = Outcome {
                label: "delivered".into(),
                is_error: false,
            };
            self.shared.recorder.record(latency, &outcome);
            self.shared.completed_at(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_carries_the_send_time() {
        let p = stamped_payload(64, 1_700_000_000_123_456);
        assert_eq!(p.len(), 64);
        assert_eq!(sent_us(&p), Some(1_700_000_000_123_456));
        assert_eq!(sent_us(b"short"), None);
    }
}
