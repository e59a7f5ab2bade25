//! Plain MQTT publish/subscribe load: publishers send timestamped payloads to one topic tree, every
//! subscriber receives every message; we measure delivered messages/s and end-to-end latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::Filter;
use rumqttc::v5::mqttbytes::QoS;
use tokio::task::JoinSet;

use super::link::{self, Incoming, Sender};
use super::stats::Outcome;
use super::{BenchArgs, Shared};
use crate::client::error::CliError;

pub struct Prepared {
    topic_root: String,
    qos: QoS,
    payload: usize,
    publishers: Vec<(Sender, Incoming)>,
    subscribers: Vec<(Sender, Incoming)>,
    timeout: Duration,
}

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
    let mut subscribers = Vec::new();
    for i in 0..args.subscribers {
        let filter = Filter::new(format!("{topic_root}/#"), qos);
        let client_id = format!("{prefix}-sub-{i}");
        // Subscribers publish nothing: the window is irrelevant.
        subscribers.push(link::open(&args.conn, &client_id, vec![filter], 1).await?);
    }
    let mut publishers = Vec::new();
    for i in 0..args.publishers {
        let client_id = format!("{prefix}-pub-{i}");
        publishers.push(link::open(&args.conn, &client_id, Vec::new(), args.inflight).await?);
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
        for (sender, mut incoming) in self.subscribers {
            let shared = Arc::clone(&shared);
            let delivered = Arc::clone(&delivered);
            let prefix = self.topic_root.clone();
            subscribers.spawn(async move {
                loop {
                    match incoming.recv().await {
                        Ok(p) if p.topic.starts_with(prefix.as_bytes()) => {
                            delivered.fetch_add(1, Ordering::Relaxed);
                            let now = SystemTime::now();
                            if let Some(sent) = sent_us(&p.payload) {
                                if sent >= measure_from_us {
                                    let latency =
                                        Duration::from_micros(unix_us(now).saturating_sub(sent));
                                    let outcome = Outcome {
                                        label: "delivered".into(),
                                        is_error: false,
                                    };
                                    shared.recorder.record(latency, &outcome);
                                    shared.completed_at(Instant::now());
                                }
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            shared.recorder.count(&format!("connection: {e}"), true, 1);
                            break;
                        }
                    }
                }
                drop(sender);
            });
        }
        let published = Arc::new(AtomicU64::new(0));
        let mut publishers = JoinSet::new();
        for (i, (sender, incoming)) in self.publishers.into_iter().enumerate() {
            let shared = Arc::clone(&shared);
            let published = Arc::clone(&published);
            let topic = format!("{}/{i}", self.topic_root);
            let (qos, size, timeout) = (self.qos, self.payload, self.timeout);
            publishers.spawn(async move {
                while shared.take_ticket() {
                    let payload = stamped_payload(size, unix_us(SystemTime::now()));
                    if let Err(e) = sender.publish(topic.as_str(), qos, payload, None).await {
                        shared.recorder.count(&format!("connection: {e}"), true, 1);
                        break;
                    }
                    published.fetch_add(1, Ordering::Relaxed);
                }
                // DISCONNECT goes out after the queued publishes.
                let _ = tokio::time::timeout(timeout, sender.disconnect()).await;
                drop(incoming);
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
