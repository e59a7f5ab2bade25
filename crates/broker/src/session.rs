//! Session state: subscriptions, the outbound queue, in-flight QoS 1/2 messages and packet ids.
//!
//! [`SessionState`] is plain data so that durability can persist it later; the connection task and
//! the router share it through [`SessionHandle`] under a short-lived mutex (never held across
//! `.await`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytestring::ByteString;
use tokio::sync::Notify;

use crate::codec::OutPublish;
use crate::message::{Message, QoS};

/// Options of one subscription, as granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriptionOptions {
    /// Granted (maximum) QoS.
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0 send retained on subscribe, 1 only for a new subscription, 2 never.
    pub retain_handling: u8,
    pub subscription_id: Option<u32>,
}

/// A message waiting for (or in) delivery to one client, with the per-subscriber QoS, retain flag
/// and subscription ids already decided.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Arc<Message>,
    pub qos: QoS,
    pub retain: bool,
    pub subscription_ids: Vec<u32>,
    /// When the broker received the message; the Message Expiry Interval counts from here.
    pub received_at: Instant,
}

impl Delivery {
    /// Remaining Message Expiry Interval at `now`: `Ok(None)` when the message does not expire,
    /// `Err(())` when it has expired.
    fn remaining_expiry(&self, now: Instant) -> Result<Option<u32>, ()> {
        let Some(interval) = self.message.properties.message_expiry_interval else {
            return Ok(None);
        };
        let elapsed = u32::try_from(now.saturating_duration_since(self.received_at).as_secs())
            .unwrap_or(u32::MAX);
        if elapsed >= interval {
            Err(())
        } else {
            Ok(Some(interval - elapsed))
        }
    }
}

/// Where an outbound QoS 1/2 message is in its flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// QoS 1 sent, waiting for PUBACK.
    AwaitPubAck,
    /// QoS 2 sent, waiting for PUBREC.
    AwaitPubRec,
    /// PUBREL sent, waiting for PUBCOMP.
    AwaitPubComp,
}

#[derive(Debug, Clone)]
pub struct Inflight {
    pub delivery: Delivery,
    pub phase: Phase,
}

/// What happened to a message offered to a full queue (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    Queued,
    /// The queue was full and the message was QoS 0: dropped.
    DroppedQos0,
    /// The queue was full; the oldest queued QoS 0 message was dropped to make room.
    EvictedQos0,
    /// The queue was full of QoS 1/2 messages: the new message was dropped (the queue keeps the
    /// oldest; the publisher is not told, as MQTT has no way to say one subscriber was full).
    DroppedNewest,
}

/// One step of the outbound pump, as the caller (the encoder) saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emit {
    Sent,
    /// Larger than the client's Maximum Packet Size: dropped for this client.
    TooLarge,
}

/// Persistent session state of one client (plain data).
#[derive(Debug, Clone)]
pub struct SessionState {
    pub client_id: Arc<str>,
    pub expiry_interval_secs: u32,
    /// By the filter exactly as subscribed (including any `$share/group/` prefix).
    pub subscriptions: HashMap<ByteString, SubscriptionOptions>,
    pub queue: VecDeque<Delivery>,
    pub inflight: BTreeMap<u16, Inflight>,
    /// Inbound QoS 2 packet ids received (and routed) but not yet released by PUBREL.
    pub inbound_qos2: BTreeSet<u16>,
    pub next_packet_id: u16,
    pub dropped_qos0: u64,
    pub dropped_qos12: u64,
    pub dropped_too_large: u64,
    pub dropped_expired: u64,
}

impl SessionState {
    pub fn new(client_id: Arc<str>, expiry_interval_secs: u32) -> Self {
        Self {
            client_id,
            expiry_interval_secs,
            subscriptions: HashMap::new(),
            queue: VecDeque::new(),
            inflight: BTreeMap::new(),
            inbound_qos2: BTreeSet::new(),
            next_packet_id: 1,
            dropped_qos0: 0,
            dropped_qos12: 0,
            dropped_too_large: 0,
            dropped_expired: 0,
        }
    }

    /// Queues `d`, applying the overflow policy at `max_queued`: QoS 0 goes first (the new one, or
    /// the oldest queued), then the newest QoS 1/2 message is dropped.
    pub fn enqueue(&mut self, d: Delivery, max_queued: usize) -> Enqueued {
        if self.queue.len() < max_queued {
            self.queue.push_back(d);
            return Enqueued::Queued;
        }
        if d.qos == QoS::AtMostOnce {
            self.dropped_qos0 += 1;
            return Enqueued::DroppedQos0;
        }
        if let Some(i) = self.queue.iter().position(|q| q.qos == QoS::AtMostOnce) {
            self.queue.remove(i);
            self.queue.push_back(d);
            self.dropped_qos0 += 1;
            return Enqueued::EvictedQos0;
        }
        self.dropped_qos12 += 1;
        Enqueued::DroppedNewest
    }

    /// A free packet id (1..=65535, not in flight), advancing the cursor.
    fn allocate_packet_id(&mut self) -> Option<u16> {
        for _ in 0..=u16::MAX {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if id != 0 && !self.inflight.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Moves queued messages into flight while the window (`receive_max` unacknowledged QoS 1/2)
    /// allows, handing each to `emit` until it returns `false` for "stop" (buffer full). Expired
    /// messages are dropped; messages `emit` rejects as too large are dropped for this client.
    pub(crate) fn pump(
        &mut self,
        now: Instant,
        receive_max: u16,
        mut emit: impl FnMut(&OutPublish<'_>) -> Option<Emit>,
    ) {
        while let Some(front) = self.queue.front() {
            if front.qos != QoS::AtMostOnce && self.inflight.len() >= usize::from(receive_max) {
                return;
            }
            let Some(d) = self.queue.pop_front() else {
                return;
            };
            let Ok(expiry_secs) = d.remaining_expiry(now) else {
                self.dropped_expired += 1;
                continue;
            };
            let packet_id = if d.qos == QoS::AtMostOnce {
                None
            } else {
                match self.allocate_packet_id() {
                    Some(id) => Some(id),
                    None => {
                        self.queue.push_front(d);
                        return;
                    }
                }
            };
            let out = OutPublish {
                message: &d.message,
                qos: d.qos,
                retain: d.retain,
                dup: false,
                packet_id,
                subscription_ids: &d.subscription_ids,
                expiry_secs,
            };
            match emit(&out) {
                None => {
                    // The encoder's buffer is full: keep the message for the next round.
                    self.queue.push_front(d);
                    return;
                }
                Some(Emit::TooLarge) => self.dropped_too_large += 1,
                Some(Emit::Sent) => {
                    if let Some(id) = packet_id {
                        let phase = if d.qos == QoS::AtLeastOnce {
                            Phase::AwaitPubAck
                        } else {
                            Phase::AwaitPubRec
                        };
                        self.inflight.insert(id, Inflight { delivery: d, phase });
                    }
                }
            }
        }
    }

    /// PUBACK for `id`; returns whether it matched a message in flight.
    pub fn on_puback(&mut self, id: u16) -> bool {
        if self
            .inflight
            .get(&id)
            .is_some_and(|f| f.phase == Phase::AwaitPubAck)
        {
            self.inflight.remove(&id);
            return true;
        }
        false
    }

    /// PUBREC for `id`: `Some(true)` means send PUBREL, `Some(false)` the flow ended with an error
    /// reason, `None` the id is unknown.
    pub fn on_pubrec(&mut self, id: u16, reason_code: u8) -> Option<bool> {
        let entry = self.inflight.get_mut(&id)?;
        match entry.phase {
            Phase::AwaitPubRec | Phase::AwaitPubComp if reason_code < 0x80 => {
                entry.phase = Phase::AwaitPubComp;
                Some(true)
            }
            Phase::AwaitPubRec => {
                self.inflight.remove(&id);
                Some(false)
            }
            _ => None,
        }
    }

    /// PUBCOMP for `id`; returns whether it completed a QoS 2 flow.
    pub fn on_pubcomp(&mut self, id: u16) -> bool {
        if self
            .inflight
            .get(&id)
            .is_some_and(|f| f.phase == Phase::AwaitPubComp)
        {
            self.inflight.remove(&id);
            return true;
        }
        false
    }
}

/// A session shared between its connection (if any), the router and the registry.
pub(crate) struct SessionHandle {
    pub client_id: Arc<str>,
    state: Mutex<SessionState>,
    /// Wakes the owning connection when messages were queued.
    pub wake: Notify,
    /// Whether a connection owns the session; offline sessions do not queue QoS 0.
    online: AtomicBool,
}

impl SessionHandle {
    pub(crate) fn new(client_id: Arc<str>, expiry_interval_secs: u32) -> Self {
        Self {
            state: Mutex::new(SessionState::new(client_id.clone(), expiry_interval_secs)),
            client_id,
            wake: Notify::new(),
            online: AtomicBool::new(false),
        }
    }

    /// Locks the state. A poisoned lock means a panic elsewhere mid-update; the state is still the
    /// best we have, so we carry on with it rather than take the broker down.
    pub(crate) fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_online(&self, online: bool) {
        self.online.store(online, Ordering::Release);
    }

    /// Queues a delivery and wakes the connection. Offline sessions skip QoS 0 (MQTT allows it and
    /// it keeps away sessions from filling with stale telemetry).
    pub(crate) fn deliver(&self, d: Delivery, max_queued: usize) -> Enqueued {
        if d.qos == QoS::AtMostOnce && !self.online.load(Ordering::Acquire) {
            return Enqueued::DroppedQos0;
        }
        let outcome = self.lock().enqueue(d, max_queued);
        if outcome != Enqueued::DroppedQos0 && outcome != Enqueued::DroppedNewest {
            self.wake.notify_one();
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::Duration;

    fn delivery(qos: QoS, n: u8) -> Delivery {
        Delivery {
            message: Arc::new(Message {
                topic: "t".into(),
                payload: Bytes::from(vec![n]),
                qos,
                retain: false,
                properties: Default::default(),
            }),
            qos,
            retain: false,
            subscription_ids: Vec::new(),
            received_at: Instant::now(),
        }
    }

    #[test]
    fn overflow_drops_qos0_first_then_newest() {
        let mut s = SessionState::new("c".into(), 0);
        assert_eq!(s.enqueue(delivery(QoS::AtMostOnce, 0), 2), Enqueued::Queued);
        assert_eq!(
            s.enqueue(delivery(QoS::AtLeastOnce, 1), 2),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(delivery(QoS::AtMostOnce, 2), 2),
            Enqueued::DroppedQos0
        );
        assert_eq!(
            s.enqueue(delivery(QoS::AtLeastOnce, 3), 2),
            Enqueued::EvictedQos0
        );
        assert_eq!(
            s.enqueue(delivery(QoS::ExactlyOnce, 4), 2),
            Enqueued::DroppedNewest
        );
        let payloads: Vec<u8> = s.queue.iter().map(|d| d.message.payload[0]).collect();
        assert_eq!(payloads, vec![1, 3]);
        assert_eq!((s.dropped_qos0, s.dropped_qos12), (2, 1));
    }

    #[test]
    fn pump_respects_receive_maximum_and_acks_open_the_window() {
        let mut s = SessionState::new("c".into(), 0);
        for n in 0..4 {
            s.enqueue(delivery(QoS::AtLeastOnce, n), 10);
        }
        let mut sent = Vec::new();
        s.pump(Instant::now(), 2, |p| {
            sent.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(sent, vec![Some(1), Some(2)]);
        assert_eq!(s.queue.len(), 2);
        assert!(s.on_puback(1));
        assert!(!s.on_puback(1));
        s.pump(Instant::now(), 2, |p| {
            sent.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(sent, vec![Some(1), Some(2), Some(3)]);
    }

    #[test]
    fn qos2_flow_and_too_large_and_expiry() {
        let mut s = SessionState::new("c".into(), 0);
        s.enqueue(delivery(QoS::ExactlyOnce, 0), 10);
        s.pump(Instant::now(), 10, |_| Some(Emit::Sent));
        assert_eq!(s.on_pubrec(1, 0), Some(true));
        assert!(!s.on_puback(1));
        assert!(s.on_pubcomp(1));
        assert!(s.inflight.is_empty());

        s.enqueue(delivery(QoS::AtLeastOnce, 1), 10);
        s.pump(Instant::now(), 10, |_| Some(Emit::TooLarge));
        assert!(s.inflight.is_empty());
        assert_eq!(s.dropped_too_large, 1);

        let mut old = delivery(QoS::AtLeastOnce, 2);
        let mut msg = (*old.message).clone();
        msg.properties.message_expiry_interval = Some(5);
        old.message = Arc::new(msg);
        let now = Instant::now();
        old.received_at = now.checked_sub(Duration::from_secs(6)).unwrap();
        s.enqueue(old, 10);
        s.pump(now, 10, |_| panic!("expired message must not be sent"));
        assert_eq!(s.dropped_expired, 1);
    }

    #[test]
    fn expiry_is_decremented() {
        let mut d = delivery(QoS::AtLeastOnce, 0);
        let mut msg = (*d.message).clone();
        msg.properties.message_expiry_interval = Some(10);
        d.message = Arc::new(msg);
        let later = d.received_at + Duration::from_secs(3);
        assert_eq!(d.remaining_expiry(later), Ok(Some(7)));
        assert_eq!(
            d.remaining_expiry(d.received_at + Duration::from_secs(10)),
            Err(())
        );
    }

    #[test]
    fn packet_ids_skip_those_in_flight_and_wrap() {
        let mut s = SessionState::new("c".into(), 0);
        s.next_packet_id = u16::MAX;
        s.enqueue(delivery(QoS::AtLeastOnce, 0), 10);
        s.enqueue(delivery(QoS::AtLeastOnce, 1), 10);
        let mut ids = Vec::new();
        s.pump(Instant::now(), 10, |p| {
            ids.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(ids, vec![Some(u16::MAX), Some(1)]);
    }
}
