//! State-store load: per connection, a sender keeps `--inflight` requests outstanding and a task on the
//! incoming side matches replies to them by correlation data, recording latency and reply kind.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use mqstate_protocol::topic::{INVOKE_TOPIC, NOTIFY_TOPIC_PREFIX};
use mqstate_protocol::{encode_request, HybridClock};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish};
use rumqttc::v5::mqttbytes::QoS;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;

use super::link::{self, Incoming, Sender};
use super::stats::{classify, Outcome};
use super::workload::{key_name, value_of_size, KeyChooser, Mix, Op};
use super::{BenchArgs, Shared};
use crate::client::error::CliError;
use crate::client::rpc;

/// One connection, connected and subscribed.
struct Connection {
    client_id: String,
    response_topic: String,
    notify_prefix: String,
    sender: Sender,
    incoming: Incoming,
}

pub struct Prepared {
    connections: Vec<Connection>,
    mix: Mix,
    chooser: Arc<KeyChooser>,
    value_size: usize,
    inflight: usize,
    timeout: std::time::Duration,
}

/// Opens every connection (before the clock starts, so connecting is not measured).
pub async fn prepare(args: &BenchArgs) -> Result<super::Prepared, CliError> {
    let chooser =
        KeyChooser::new(args.distribution, args.keys).map_err(|e| CliError::usage("--keys", e))?;
    let inflight = usize::from(args.inflight);
    let prefix = args.conn.client_id("mqstate-bench");
    let mut opening = JoinSet::new();
    for i in 0..args.connections {
        let client_id = format!("{prefix}-{i}");
        let response_topic = rpc::response_topic(&client_id);
        let notify_prefix = format!(
            "{NOTIFY_TOPIC_PREFIX}/{}/command/notify/",
            hex_upper(client_id.as_bytes())
        );
        let mut filters = vec![Filter::new(response_topic.as_str(), QoS::AtLeastOnce)];
        if args.mix.contains(Op::KeyNotify) {
            filters.push(Filter::new(format!("{notify_prefix}+"), QoS::AtLeastOnce));
        }
        let conn = args.conn.clone();
        let window = args.inflight;
        opening.spawn(async move {
            let (sender, incoming) = link::open(&conn, &client_id, filters, window).await?;
            Ok::<_, CliError>(Connection {
                client_id,
                response_topic,
                notify_prefix,
                sender,
                incoming,
            })
        });
    }
    let mut connections = Vec::with_capacity(usize::from(args.connections));
    while let Some(joined) = opening.join_next().await {
        connections.push(joined.map_err(|e| CliError::usage("bench", e.to_string()))??);
    }
    Ok(super::Prepared::Statestore(Prepared {
        connections,
        mix: args.mix.clone(),
        chooser: Arc::new(chooser),
        value_size: args.value_size,
        inflight,
        timeout: args.conn.timeout(),
    }))
}

/// Requests sent and not yet answered: correlation sequence → (send time, operation).
type Pending = Arc<Mutex<HashMap<u64, (Instant, Op)>>>;

impl Prepared {
    pub async fn run(self, shared: Arc<Shared>) -> Result<(), CliError> {
        let mut workers = JoinSet::new();
        for (i, connection) in self.connections.into_iter().enumerate() {
            let worker = Worker {
                shared: Arc::clone(&shared),
                mix: self.mix.clone(),
                chooser: Arc::clone(&self.chooser),
                value_size: self.value_size,
                inflight: self.inflight,
                timeout: self.timeout,
                seed: i as u64,
            };
            workers.spawn(worker.run(connection));
        }
        while workers.join_next().await.is_some() {}
        Ok(())
    }
}

struct Worker {
    shared: Arc<Shared>,
    mix: Mix,
    chooser: Arc<KeyChooser>,
    value_size: usize,
    inflight: usize,
    timeout: std::time::Duration,
    seed: u64,
}

impl Worker {
    async fn run(self, connection: Connection) {
        let Connection {
            client_id,
            response_topic,
            notify_prefix,
            sender,
            incoming,
        } = connection;
        let pending: Pending = Arc::default();
        let slots = Arc::new(Semaphore::new(self.inflight));
        let drained = Arc::new(Notify::new());
        let mut events = tokio::spawn(replies(
            incoming,
            Arc::clone(&self.shared),
            Arc::clone(&pending),
            Arc::clone(&slots),
            Arc::clone(&drained),
            response_topic.clone(),
            notify_prefix,
        ));
        let sent = self
            .send(&sender, &client_id, &response_topic, &pending, &slots)
            .await;
        if let Err(reason) = sent {
            self.shared
                .recorder
                .count(&format!("connection: {reason}"), true, 1);
        }
        // Wait for the outstanding replies, at most one reply timeout.
        let wait_drained = async {
            loop {
                let notified = drained.notified();
                if pending
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .is_empty()
                {
                    return;
                }
                notified.await;
            }
        };
        tokio::select! {
            () = wait_drained => {}
            () = tokio::time::sleep(self.timeout) => {}
            _ = &mut events => {}
        }
        let lost = pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len() as u64;
        if lost > 0 {
            self.shared.recorder.count("timeout", true, lost);
        }
        let _ = tokio::time::timeout(self.timeout, sender.disconnect()).await;
        let _ = tokio::time::timeout(self.timeout, &mut events).await;
        events.abort();
    }

    async fn send(
        &self,
        sender: &Sender,
        client_id: &str,
        response_topic: &str,
        pending: &Pending,
        slots: &Arc<Semaphore>,
    ) -> Result<(), String> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ rand::random::<u64>());
        let value: Bytes = value_of_size(self.value_size, &mut rng);
        let mut clock: HybridClock = rpc::client_clock(client_id);
        let mut seq = 0u64;
        loop {
            tokio::select! {
                permit = slots.acquire() => match permit {
                    // Given back by the event loop task when the reply arrives.
                    Ok(permit) => permit.forget(),
                    Err(_) => return Ok(()),
                },
                () = self.shared.stopped() => return Ok(()),
            }
            if !self.shared.take_ticket() {
                return Ok(());
            }
            let op = self.mix.pick(&mut rng);
            let key = key_name(self.chooser.pick(&mut rng));
            seq += 1;
            let ts = clock.now(rpc::now_ms());
            let properties = rpc::request_properties(
                client_id,
                response_topic,
                rpc::correlation(seq),
                &ts,
                None,
                self.timeout,
            );
            let payload = encode_request(&op.request(&key, &value));
            pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(seq, (Instant::now(), op));
            sender
                .publish(INVOKE_TOPIC, QoS::AtLeastOnce, payload, Some(properties))
                .await?;
        }
    }
}

/// The incoming side of one connection: matches replies, counts notifications, ends with the connection.
async fn replies(
    mut incoming: Incoming,
    shared: Arc<Shared>,
    pending: Pending,
    slots: Arc<Semaphore>,
    drained: Arc<Notify>,
    response_topic: String,
    notify_prefix: String,
) {
    loop {
        match incoming.recv().await {
            Ok(publish) => {
                if publish.topic.as_ref() == response_topic.as_bytes() {
                    on_reply(&shared, &pending, &slots, &drained, &publish);
                } else if publish.topic.starts_with(notify_prefix.as_bytes()) {
                    shared.recorder.count("notification", false, 1);
                }
            }
            Err(e) => {
                if !shared.stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    shared.recorder.count(&format!("connection: {e}"), true, 1);
                }
                break;
            }
        }
    }
    // Unblock the sender: nothing more will be answered on this connection.
    slots.close();
    drained.notify_waiters();
}

fn on_reply(
    shared: &Shared,
    pending: &Pending,
    slots: &Semaphore,
    drained: &Notify,
    publish: &Publish,
) {
    let now = Instant::now();
    let properties = publish.properties.as_ref();
    let Some(seq) = properties
        .and_then(|p| p.correlation_data.as_deref())
        .and_then(rpc::correlation_seq)
    else {
        shared
            .recorder
            .count("reply without our correlation data", true, 1);
        return;
    };
    let (entry, empty) = {
        let mut map = pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = map.remove(&seq);
        (entry, map.is_empty())
    };
    let Some((sent, _op)) = entry else {
        // A duplicate (a retried PUBLISH answered twice) or a reply after its timeout.
        shared.recorder.count("duplicate or late reply", true, 1);
        return;
    };
    slots.add_permits(1);
    if empty {
        drained.notify_waiters();
    }
    let outcome: Outcome = classify(
        rpc::user_property(properties, rpc::STATUS),
        &publish.payload,
    );
    if shared.measuring(sent) {
        shared.recorder.record(now - sent, &outcome);
        shared.completed_at(now);
    }
}

/// Upper-case base16, as notification topics spell client ids (spec §6).
fn hex_upper(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_topics_use_upper_case_hex() {
        assert_eq!(hex_upper(b"client-id1"), "636C69656E742D696431");
        let topic = mqstate_protocol::topic::notify_topic(b"client-id1", b"SOMEKEY");
        assert!(topic.starts_with(&format!(
            "{NOTIFY_TOPIC_PREFIX}/{}/command/notify/",
            hex_upper(b"client-id1")
        )));
    }
}
