//! Session state: subscriptions, the outbound queue, in-flight QoS 1/2 messages and packet ids.
//!
//! [`SessionState`] is plain data; the connection task and the router share it through
//! [`SessionHandle`] under a short-lived mutex (never held across `.await`).
//!
//! Durability: a session with a Session Expiry Interval above 0, in a broker with a journal, notes
//! each change it makes (`crate::persist::SessionChange`) in a buffer; the lock guard hands the
//! buffer to the journal before the lock is released, so the journal sees the changes of a session
//! in the order they were made. Only QoS 1/2 messages are journalled.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::signal::Signal;
use bytestring::ByteString;
use mqstate_clock::{Clock, SharedClock};

use crate::codec::OutPublish;
use crate::message::{Message, QoS};
use crate::peers::PublishId;
use crate::persist::{wall, Durable, SessionChange, SessionJournal, StoredMessage, TakenId};
use crate::queue::{queued_bytes, MessageQueue, QueueLimit};
use crate::will::Will;

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
    /// Position in the session's queue (assigned when queued); names the message in the journal.
    pub seq: u64,
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
    /// The session took this (numbered, QoS 2) publish in already: not queued again.
    AlreadyTaken,
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
    /// By the filter exactly as subscribed (including any `$share/group/` prefix). Ordered, so
    /// that what is derived from it (a journal image, subscription ids) does not depend on a hash.
    pub subscriptions: BTreeMap<ByteString, SubscriptionOptions>,
    pub queue: MessageQueue,
    pub inflight: BTreeMap<u16, Inflight>,
    /// Inbound QoS 2 packet ids received (and routed) but not yet released by PUBREL.
    pub inbound_qos2: BTreeSet<u16>,
    pub next_packet_id: u16,
    /// Drop counts (saturating): 32 bits each keep the session handle within a smaller
    /// allocation class, which every connection pays for.
    pub dropped_qos0: u32,
    pub dropped_qos12: u32,
    pub dropped_too_large: u32,
    pub dropped_expired: u32,
    /// Sequence number of the next queued message.
    pub next_seq: u64,
    /// When the connection ended (wall-clock ms); `None` while connected.
    pub detached_at_ms: Option<u64>,
    /// What few sessions hold, boxed together so that the others pay one pointer for it.
    rare: Option<Box<Rare>>,
    /// A journal is installed and the session has not ended.
    pub(crate) journalled: bool,
    /// The journal holds this session (journalled and expiry > 0): changes are noted.
    pub(crate) in_journal: bool,
    /// Changes noted under the current lock, handed to the journal when it is released.
    pub(crate) changes: Vec<SessionChange>,
}

/// The parts of a session that few sessions have.
#[derive(Debug, Clone, Default)]
struct Rare {
    /// The will of the connected client, kept (and journalled) for a persistent session, and for
    /// a clean one where the journal keeps clean wills (then only it is journalled of the
    /// session: its "will row", decision 0063): if the node dies, whoever puts the session back
    /// publishes it (decision 0054).
    connected_will: Option<Will>,
    /// The numbered QoS 2 publishes taken in lately (a cluster node's sessions only).
    taken: TakenIds,
}

/// The numbers of the forwarded QoS 2 publishes a session took in, for as long as each may be
/// given again (decision 0066): in arrival order to forget them, and in a set to look them up.
#[derive(Debug, Clone, Default)]
struct TakenIds {
    order: VecDeque<TakenId>,
    ids: HashSet<PublishId>,
}

impl TakenIds {
    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    fn contains(&self, id: &PublishId) -> bool {
        self.ids.contains(id)
    }

    /// Adds `t`, forgetting what can no longer come again.
    fn insert(&mut self, t: TakenId) {
        while let Some(old) = self.order.front().filter(|old| !old.kept_at(t.at_ms)) {
            self.ids.remove(&old.id);
            self.order.pop_front();
        }
        if self.ids.insert(t.id) {
            self.order.push_back(t);
        }
        debug_assert_eq!(self.ids.len(), self.order.len());
    }
}

impl SessionState {
    pub fn new(client_id: Arc<str>, expiry_interval_secs: u32) -> Self {
        Self {
            client_id,
            expiry_interval_secs,
            subscriptions: BTreeMap::new(),
            queue: MessageQueue::default(),
            inflight: BTreeMap::new(),
            inbound_qos2: BTreeSet::new(),
            next_packet_id: 1,
            dropped_qos0: 0,
            dropped_qos12: 0,
            dropped_too_large: 0,
            dropped_expired: 0,
            next_seq: 0,
            detached_at_ms: None,
            rare: None,
            journalled: false,
            in_journal: false,
            changes: Vec::new(),
        }
    }

    /// Notes a change for the journal if this session is journalled.
    pub(crate) fn note(&mut self, change: impl FnOnce(Arc<str>) -> SessionChange) {
        if self.in_journal {
            self.changes.push(change(self.client_id.clone()));
        }
    }

    /// Notes that a QoS 1/2 message left the session.
    fn note_removed(&mut self, d: &Delivery) {
        if d.qos != QoS::AtMostOnce {
            let seq = d.seq;
            self.note(|client_id| SessionChange::Removed { client_id, seq });
        }
    }

    /// Sets the Session Expiry Interval. The session enters the journal (as a full image, its
    /// times read from `clock`) when it becomes persistent, and leaves it (deleted) when it stops
    /// being persistent.
    pub(crate) fn set_expiry(&mut self, secs: u32, clock: &dyn Clock) {
        self.expiry_interval_secs = secs;
        let persistent = self.journalled && secs > 0;
        if persistent && !self.in_journal {
            self.in_journal = true;
            let image = self.image(clock.now(), clock.now_ms());
            self.changes.extend(image);
        } else if !persistent && self.in_journal {
            self.note(|client_id| SessionChange::Deleted { client_id });
            self.in_journal = false;
        }
    }

    /// A connection resumed the session with `expiry_secs`.
    pub(crate) fn attached(&mut self, expiry_secs: u32, clock: &dyn Clock) {
        self.detached_at_ms = None;
        self.drop_will_row();
        self.set_connected_will(None);
        let was_journalled = self.in_journal;
        self.set_expiry(expiry_secs, clock);
        if was_journalled {
            self.note(|client_id| SessionChange::Attached {
                client_id,
                expiry_secs,
            });
        }
    }

    /// The connection ended at `at_ms`.
    pub(crate) fn detached(&mut self, at_ms: u64) {
        self.detached_at_ms = Some(at_ms);
        self.set_connected_will(None);
        let expiry_secs = self.expiry_interval_secs;
        self.note(|client_id| SessionChange::Detached {
            client_id,
            expiry_secs,
            at_ms,
        });
    }

    /// The connected client's will (after `attached`, or on a new session): kept and journalled
    /// if the session is. A clean session's will is kept by a journal that keeps clean wills (a
    /// cluster node: the will must outlive the node, decision 0063), on its own.
    fn set_will(&mut self, will: Option<&Will>, clean_wills: bool) {
        let Some(will) = will else {
            return;
        };
        if self.in_journal {
            self.set_connected_will(Some(will));
            self.note(|client_id| SessionChange::WillSet {
                client_id,
                will: will.clone(),
            });
        } else if self.journalled && clean_wills {
            debug_assert_eq!(self.expiry_interval_secs, 0);
            self.set_connected_will(Some(will));
            self.changes.push(SessionChange::Created {
                client_id: self.client_id.clone(),
                expiry_secs: self.expiry_interval_secs,
            });
            self.changes.push(SessionChange::WillSet {
                client_id: self.client_id.clone(),
                will: will.clone(),
            });
        }
    }

    /// Whether the journal holds this clean session's will (and nothing else of it).
    fn has_will_row(&self) -> bool {
        self.journalled && !self.in_journal && self.connected_will().is_some()
    }

    /// The journal's copy of a clean session's will goes (its connection ended or was replaced).
    fn drop_will_row(&mut self) {
        if self.has_will_row() {
            self.set_connected_will(None);
            self.changes.push(SessionChange::Deleted {
                client_id: self.client_id.clone(),
            });
        }
    }

    /// The session ended: deleted from the journal, and nothing more is noted (a router that still
    /// holds the handle must not add messages to a later session of the same client).
    pub(crate) fn end(&mut self) {
        self.note(|client_id| SessionChange::Deleted { client_id });
        self.drop_will_row();
        self.in_journal = false;
        self.journalled = false;
    }

    /// Adds or replaces a subscription.
    pub(crate) fn subscribe(&mut self, filter: ByteString, options: SubscriptionOptions) {
        self.subscriptions.insert(filter.clone(), options);
        self.note(|client_id| SessionChange::Subscribed {
            client_id,
            filter,
            options,
        });
    }

    /// The client's QoS 2 PUBLISH `packet_id` was received and routed: until PUBREL releases the
    /// id, a retry of it is acknowledged and not routed again.
    pub(crate) fn receive_qos2(&mut self, packet_id: u16) {
        if self.inbound_qos2.insert(packet_id) {
            self.note(|client_id| SessionChange::Qos2Received {
                client_id,
                packet_id,
            });
        }
    }

    /// Releases an inbound QoS 2 packet id (PUBREL, or a failed PUBREC ended the flow); returns
    /// whether it was in use.
    pub(crate) fn release_qos2(&mut self, packet_id: u16) -> bool {
        let known = self.inbound_qos2.remove(&packet_id);
        if known {
            self.note(|client_id| SessionChange::Qos2Released {
                client_id,
                packet_id,
            });
        }
        known
    }

    /// Removes a subscription; returns whether it existed.
    pub(crate) fn unsubscribe(&mut self, filter: &ByteString) -> bool {
        let existed = self.subscriptions.remove(filter).is_some();
        if existed {
            let filter = filter.clone();
            self.note(|client_id| SessionChange::Unsubscribed { client_id, filter });
        }
        existed
    }

    /// The changes that recreate this session from nothing: created, (detached), subscriptions,
    /// inbound QoS 2 packet ids awaiting PUBREL, then its QoS 1/2 messages in flight and queued.
    /// `now`/`now_ms` convert `Instant`s.
    pub(crate) fn image(&self, now: Instant, now_ms: u64) -> Vec<SessionChange> {
        let client_id = &self.client_id;
        let mut image = vec![SessionChange::Created {
            client_id: client_id.clone(),
            expiry_secs: self.expiry_interval_secs,
        }];
        if let Some(at_ms) = self.detached_at_ms {
            image.push(SessionChange::Detached {
                client_id: client_id.clone(),
                expiry_secs: self.expiry_interval_secs,
                at_ms,
            });
        }
        for (filter, options) in &self.subscriptions {
            image.push(SessionChange::Subscribed {
                client_id: client_id.clone(),
                filter: filter.clone(),
                options: *options,
            });
        }
        for &packet_id in &self.inbound_qos2 {
            image.push(SessionChange::Qos2Received {
                client_id: client_id.clone(),
                packet_id,
            });
        }
        for (&packet_id, f) in &self.inflight {
            let seq = f.delivery.seq;
            image.push(appended(client_id, &f.delivery, now, now_ms));
            image.push(SessionChange::Sent {
                client_id: client_id.clone(),
                seq,
                packet_id,
            });
            if f.phase == Phase::AwaitPubComp {
                image.push(SessionChange::Released {
                    client_id: client_id.clone(),
                    seq,
                });
            }
        }
        for d in self.queue.iter().filter(|d| d.qos != QoS::AtMostOnce) {
            image.push(appended(client_id, d, now, now_ms));
        }
        for t in self.rare.iter().flat_map(|rare| &rare.taken.order) {
            image.push(SessionChange::Took {
                client_id: client_id.clone(),
                id: t.id,
                at_ms: t.at_ms,
                keep_ms: t.keep_ms,
            });
        }
        if let (Some(will), None) = (self.connected_will(), self.detached_at_ms) {
            image.push(SessionChange::WillSet {
                client_id: client_id.clone(),
                will: will.clone(),
            });
        }
        image
    }

    pub(crate) fn connected_will(&self) -> Option<&Will> {
        self.rare.as_ref()?.connected_will.as_ref()
    }

    pub(crate) fn set_connected_will(&mut self, will: Option<&Will>) {
        match (will, &mut self.rare) {
            (None, None) => {}
            (None, Some(rare)) => {
                rare.connected_will = None;
                if rare.taken.is_empty() {
                    self.rare = None;
                }
            }
            (Some(will), rare) => {
                rare.get_or_insert_default().connected_will = Some(will.clone());
            }
        }
    }

    /// Puts back the numbers of the publishes a stored session took in, those that may still
    /// come again at `now_ms`.
    pub(crate) fn restore_taken(&mut self, stored: Vec<TakenId>, now_ms: u64) {
        for t in stored.into_iter().filter(|t| t.kept_at(now_ms)) {
            self.rare.get_or_insert_default().taken.insert(t);
        }
    }

    /// Whether the session took the publish numbered `id` in (within its settle bound).
    pub(crate) fn has_taken(&self, id: &PublishId) -> bool {
        self.rare
            .as_ref()
            .is_some_and(|rare| rare.taken.contains(id))
    }

    /// The session took the publish numbered `id` in at `at_ms`; it may come again for `keep_ms`.
    pub(crate) fn took(&mut self, id: PublishId, at_ms: u64, keep_ms: u64) {
        let t = TakenId { id, at_ms, keep_ms };
        self.rare.get_or_insert_default().taken.insert(t);
        self.note(|client_id| SessionChange::Took {
            client_id,
            id,
            at_ms,
            keep_ms,
        });
    }

    /// Queues `d`, applying the overflow policy at `limit`: QoS 0 goes first (the new one, or
    /// the oldest queued ones), then the newest QoS 1/2 message is dropped. `clock` dates the
    /// journal record of a persistent session's message.
    pub fn enqueue(&mut self, mut d: Delivery, limit: QueueLimit, clock: &dyn Clock) -> Enqueued {
        let outcome = if self.queue.fits(&d, limit) {
            Enqueued::Queued
        } else if d.qos == QoS::AtMostOnce {
            self.dropped_qos0 = self.dropped_qos0.saturating_add(1);
            return Enqueued::DroppedQos0;
        } else if self.make_room_evicting_qos0(&d, limit) {
            Enqueued::EvictedQos0
        } else {
            self.dropped_qos12 = self.dropped_qos12.saturating_add(1);
            return Enqueued::DroppedNewest;
        };
        d.seq = self.next_seq;
        self.next_seq += 1;
        if self.in_journal && d.qos != QoS::AtMostOnce {
            let change = appended(&self.client_id, &d, clock.now(), clock.now_ms());
            self.changes.push(change);
        }
        self.queue.push_back(d);
        outcome
    }

    /// Evicts the oldest queued QoS 0 messages until `d` fits, if evicting them all would be enough
    /// (otherwise evicts nothing).
    fn make_room_evicting_qos0(&mut self, d: &Delivery, limit: QueueLimit) -> bool {
        let (qos0_count, qos0_bytes) = self
            .queue
            .iter()
            .filter(|q| q.qos == QoS::AtMostOnce)
            .fold((0usize, 0usize), |(n, b), q| (n + 1, b + queued_bytes(q)));
        let would_fit = limit.admits(
            self.queue.len() - qos0_count,
            self.queue.bytes() - qos0_bytes,
            queued_bytes(d),
        );
        if !would_fit {
            return false;
        }
        while !self.queue.fits(d, limit) {
            if self
                .queue
                .remove_first(|q| q.qos == QoS::AtMostOnce)
                .is_none()
            {
                break;
            }
            self.dropped_qos0 = self.dropped_qos0.saturating_add(1);
        }
        debug_assert!(self.queue.fits(d, limit));
        true
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
    /// Messages queued at or after `before_seq` (if given) stay queued.
    pub(crate) fn pump(
        &mut self,
        now: Instant,
        receive_max: u16,
        before_seq: Option<u64>,
        mut emit: impl FnMut(&OutPublish<'_>) -> Option<Emit>,
    ) {
        while let Some(front) = self.queue.front() {
            if front.qos != QoS::AtMostOnce && self.inflight.len() >= usize::from(receive_max) {
                return;
            }
            if before_seq.is_some_and(|before| front.seq >= before) {
                return;
            }
            let Some(d) = self.queue.pop_front() else {
                return;
            };
            let Ok(expiry_secs) = d.remaining_expiry(now) else {
                self.dropped_expired = self.dropped_expired.saturating_add(1);
                self.note_removed(&d);
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
                Some(Emit::TooLarge) => {
                    self.dropped_too_large = self.dropped_too_large.saturating_add(1);
                    self.note_removed(&d);
                }
                Some(Emit::Sent) => {
                    if let Some(id) = packet_id {
                        let phase = if d.qos == QoS::AtLeastOnce {
                            Phase::AwaitPubAck
                        } else {
                            Phase::AwaitPubRec
                        };
                        let seq = d.seq;
                        self.note(|client_id| SessionChange::Sent {
                            client_id,
                            seq,
                            packet_id: id,
                        });
                        self.inflight.insert(id, Inflight { delivery: d, phase });
                    }
                }
            }
        }
    }

    /// PUBACK for `id`; returns whether it matched a message in flight.
    pub fn on_puback(&mut self, id: u16) -> bool {
        self.complete(id, Phase::AwaitPubAck)
    }

    /// Ends the flow of `id` if it is in `phase`.
    fn complete(&mut self, id: u16, phase: Phase) -> bool {
        if !self.inflight.get(&id).is_some_and(|f| f.phase == phase) {
            return false;
        }
        if let Some(done) = self.inflight.remove(&id) {
            self.note_removed(&done.delivery);
        }
        true
    }

    /// Drops a message in flight (it cannot be sent to this client).
    pub(crate) fn drop_inflight(&mut self, id: u16) {
        if let Some(dropped) = self.inflight.remove(&id) {
            self.dropped_too_large = self.dropped_too_large.saturating_add(1);
            self.note_removed(&dropped.delivery);
        }
    }

    /// PUBREC for `id`: `Some(true)` means send PUBREL, `Some(false)` the flow ended with an error
    /// reason, `None` the id is unknown.
    pub fn on_pubrec(&mut self, id: u16, reason_code: u8) -> Option<bool> {
        let entry = self.inflight.get_mut(&id)?;
        match entry.phase {
            Phase::AwaitPubRec | Phase::AwaitPubComp if reason_code < 0x80 => {
                if entry.phase == Phase::AwaitPubRec {
                    entry.phase = Phase::AwaitPubComp;
                    let seq = entry.delivery.seq;
                    self.note(|client_id| SessionChange::Released { client_id, seq });
                }
                Some(true)
            }
            Phase::AwaitPubRec => {
                self.complete(id, Phase::AwaitPubRec);
                Some(false)
            }
            _ => None,
        }
    }

    /// PUBCOMP for `id`; returns whether it completed a QoS 2 flow.
    pub fn on_pubcomp(&mut self, id: u16) -> bool {
        self.complete(id, Phase::AwaitPubComp)
    }
}

/// The journal form of a queued message.
fn appended(client_id: &Arc<str>, d: &Delivery, now: Instant, now_ms: u64) -> SessionChange {
    SessionChange::Appended {
        client_id: client_id.clone(),
        seq: d.seq,
        message: StoredMessage {
            message: d.message.clone(),
            qos: d.qos,
            retain: d.retain,
            subscription_ids: d.subscription_ids.clone(),
            received_at_ms: wall::to_ms(d.received_at, now, now_ms),
        },
    }
}

/// A session shared between its connection (if any), the router and the registry.
pub(crate) struct SessionHandle {
    pub client_id: Arc<str>,
    state: Mutex<SessionState>,
    journal: Option<Arc<dyn SessionJournal>>,
    /// Dates what the journal records (a journal stores wall-clock ms).
    clock: SharedClock,
    /// Wakes the owning connection when messages were queued.
    pub wake: Signal,
    /// Whether a connection owns the session; offline sessions do not queue QoS 0.
    online: AtomicBool,
}

/// The locked state of a session. Changes noted while it is held go to the journal when it is
/// dropped (or earlier, with [`SessionGuard::commit`] when the caller must wait for durability).
pub(crate) struct SessionGuard<'a> {
    state: MutexGuard<'a, SessionState>,
    journal: Option<&'a dyn SessionJournal>,
}

impl SessionGuard<'_> {
    /// The connected client's will (after `attached`, or on a new session), kept as
    /// [`SessionState::set_will`] says.
    pub(crate) fn set_will(&mut self, will: Option<&Will>) {
        let clean_wills = self.journal.is_some_and(|j| j.keeps_clean_wills());
        self.state.set_will(will, clean_wills);
    }

    /// Hands the changes noted so far to the journal; `None` if there were none.
    pub(crate) fn commit(&mut self) -> Option<Durable> {
        let journal = self.journal?;
        if self.state.changes.is_empty() {
            return None;
        }
        Some(journal.record(std::mem::take(&mut self.state.changes)))
    }
}

impl std::ops::Deref for SessionGuard<'_> {
    type Target = SessionState;
    fn deref(&self) -> &SessionState {
        &self.state
    }
}

impl std::ops::DerefMut for SessionGuard<'_> {
    fn deref_mut(&mut self) -> &mut SessionState {
        &mut self.state
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        // Not awaited: only changes MQTT acknowledges are waited for, via `commit`.
        drop(self.commit());
    }
}

impl SessionHandle {
    /// A new session; with a journal, it is journalled from the moment its expiry is above 0.
    pub(crate) fn new(
        client_id: Arc<str>,
        expiry_interval_secs: u32,
        journal: Option<Arc<dyn SessionJournal>>,
        clock: SharedClock,
    ) -> Self {
        let mut state = SessionState::new(client_id.clone(), 0);
        state.journalled = journal.is_some();
        state.set_expiry(expiry_interval_secs, &*clock);
        Self {
            state: Mutex::new(state),
            journal,
            clock,
            client_id,
            wake: Signal::default(),
            online: AtomicBool::new(false),
        }
    }

    /// A session read back from the journal (already in it: nothing is recorded).
    pub(crate) fn restored(
        state: SessionState,
        journal: Option<Arc<dyn SessionJournal>>,
        clock: SharedClock,
    ) -> Self {
        Self {
            client_id: state.client_id.clone(),
            state: Mutex::new(state),
            journal,
            clock,
            wake: Signal::default(),
            online: AtomicBool::new(false),
        }
    }

    /// Locks the state. A poisoned lock means a panic elsewhere mid-update; the state is still the
    /// best we have, so we carry on with it rather than take the broker down.
    pub(crate) fn lock(&self) -> SessionGuard<'_> {
        SessionGuard {
            state: self.state.lock().unwrap_or_else(|p| p.into_inner()),
            journal: self.journal.as_deref(),
        }
    }

    /// Whether the session took the publish numbered `id` in (decision 0066).
    pub(crate) fn has_taken(&self, id: &PublishId) -> bool {
        self.lock().has_taken(id)
    }

    pub(crate) fn set_online(&self, online: bool) {
        self.online.store(online, Ordering::Release);
    }

    /// Queues a delivery and wakes the connection. Offline sessions skip QoS 0 (MQTT allows it and
    /// it keeps away sessions from filling with stale telemetry). A QoS 2 publish `numbered`
    /// (its number, and how long it may come again) is skipped if the session took it in
    /// already, and remembered if it is queued (decision 0066). Returns the outcome and, if the
    /// message entered the journal, when it is durable.
    pub(crate) fn deliver(
        &self,
        d: Delivery,
        limit: QueueLimit,
        numbered: Option<(PublishId, Duration)>,
    ) -> (Enqueued, Option<Durable>) {
        if d.qos == QoS::AtMostOnce && !self.online.load(Ordering::Acquire) {
            return (Enqueued::DroppedQos0, None);
        }
        let (outcome, durable) = {
            let mut state = self.lock();
            if numbered.is_some_and(|(id, _)| state.has_taken(&id)) {
                return (Enqueued::AlreadyTaken, None);
            }
            let outcome = state.enqueue(d, limit, &*self.clock);
            if let (Some((id, keep)), Enqueued::Queued | Enqueued::EvictedQos0) =
                (numbered, outcome)
            {
                let keep_ms = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX);
                state.took(id, self.clock.now_ms(), keep_ms);
            }
            (outcome, state.commit())
        };
        if outcome != Enqueued::DroppedQos0 && outcome != Enqueued::DroppedNewest {
            self.wake.notify();
        }
        (outcome, durable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_handle_fits_a_320_byte_allocation() {
        // Every connection holds one; with the `Arc`'s counts it was 328 bytes (a 384-byte
        // allocation) before the drop counts became 32-bit.
        assert!(std::mem::size_of::<SessionHandle>() + 16 <= 320);
    }
    use bytes::Bytes;
    use mqstate_clock::SystemClock;
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
            seq: 0,
        }
    }

    #[test]
    fn overflow_drops_qos0_first_then_newest() {
        let mut s = SessionState::new("c".into(), 0);
        assert_eq!(
            s.enqueue(
                delivery(QoS::AtMostOnce, 0),
                QueueLimit::messages(2),
                &SystemClock
            ),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(
                delivery(QoS::AtLeastOnce, 1),
                QueueLimit::messages(2),
                &SystemClock
            ),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(
                delivery(QoS::AtMostOnce, 2),
                QueueLimit::messages(2),
                &SystemClock
            ),
            Enqueued::DroppedQos0
        );
        assert_eq!(
            s.enqueue(
                delivery(QoS::AtLeastOnce, 3),
                QueueLimit::messages(2),
                &SystemClock
            ),
            Enqueued::EvictedQos0
        );
        assert_eq!(
            s.enqueue(
                delivery(QoS::ExactlyOnce, 4),
                QueueLimit::messages(2),
                &SystemClock
            ),
            Enqueued::DroppedNewest
        );
        let payloads: Vec<u8> = s.queue.iter().map(|d| d.message.payload[0]).collect();
        assert_eq!(payloads, vec![1, 3]);
        assert_eq!((s.dropped_qos0, s.dropped_qos12), (2, 1));
    }

    /// Room for three of the 10-byte messages the byte-bound tests queue (topic "t" + 9 bytes).
    const THIRTY_BYTES: QueueLimit = QueueLimit {
        messages: 100,
        bytes: 30,
    };

    fn sized(qos: QoS, n: u8, payload_len: usize) -> Delivery {
        let mut d = delivery(qos, n);
        Arc::make_mut(&mut d.message).payload = Bytes::from(vec![n; payload_len]);
        d
    }

    #[test]
    fn the_byte_bound_evicts_as_much_qos0_as_needed_then_drops_the_newest() {
        // Topic "t" (1 byte) + payload: each message below counts 1 + 9 = 10 bytes.
        let limit = THIRTY_BYTES;
        let mut s = SessionState::new("c".into(), 0);
        for (qos, n) in [
            (QoS::AtMostOnce, 0),
            (QoS::AtMostOnce, 1),
            (QoS::AtLeastOnce, 2),
        ] {
            assert_eq!(
                s.enqueue(sized(qos, n, 9), limit, &SystemClock),
                Enqueued::Queued
            );
        }
        assert_eq!(s.queue.bytes(), 30);
        assert_eq!(
            s.enqueue(sized(QoS::AtMostOnce, 3, 9), limit, &SystemClock),
            Enqueued::DroppedQos0
        );
        // 20 bytes do not fit beside 30: both queued QoS 0 messages make room.
        assert_eq!(
            s.enqueue(sized(QoS::AtLeastOnce, 4, 19), limit, &SystemClock),
            Enqueued::EvictedQos0
        );
        assert_eq!(s.queue.bytes(), 30);
        // Nothing left to evict: the newest QoS 1/2 message is dropped, the queue kept.
        assert_eq!(
            s.enqueue(sized(QoS::ExactlyOnce, 5, 1), limit, &SystemClock),
            Enqueued::DroppedNewest
        );
        let queued: Vec<u8> = s.queue.iter().map(|d| d.message.payload[0]).collect();
        assert_eq!(queued, vec![2, 4]);
        assert_eq!((s.dropped_qos0, s.dropped_qos12), (3, 1));
    }

    #[test]
    fn qos0_is_not_evicted_when_that_would_not_make_room() {
        let limit = THIRTY_BYTES;
        let mut s = SessionState::new("c".into(), 0);
        assert_eq!(
            s.enqueue(sized(QoS::AtMostOnce, 0, 9), limit, &SystemClock),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(sized(QoS::AtLeastOnce, 1, 19), limit, &SystemClock),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(sized(QoS::AtLeastOnce, 2, 19), limit, &SystemClock),
            Enqueued::DroppedNewest
        );
        assert_eq!(
            s.queue.len(),
            2,
            "the QoS 0 message stays: evicting it would not help"
        );
    }

    #[test]
    fn a_message_larger_than_the_byte_bound_still_enters_an_empty_queue() {
        let limit = THIRTY_BYTES;
        let mut s = SessionState::new("c".into(), 0);
        assert_eq!(
            s.enqueue(sized(QoS::AtLeastOnce, 0, 100), limit, &SystemClock),
            Enqueued::Queued
        );
        assert_eq!(
            s.enqueue(sized(QoS::AtLeastOnce, 1, 1), limit, &SystemClock),
            Enqueued::DroppedNewest
        );
        let mut sent = 0;
        s.pump(Instant::now(), 10, None, |_| {
            sent += 1;
            Some(Emit::Sent)
        });
        assert_eq!((sent, s.queue.bytes()), (1, 0));
    }

    #[test]
    fn pump_respects_receive_maximum_and_acks_open_the_window() {
        let mut s = SessionState::new("c".into(), 0);
        for n in 0..4 {
            s.enqueue(
                delivery(QoS::AtLeastOnce, n),
                QueueLimit::messages(10),
                &SystemClock,
            );
        }
        let mut sent = Vec::new();
        s.pump(Instant::now(), 2, None, |p| {
            sent.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(sent, vec![Some(1), Some(2)]);
        assert_eq!(s.queue.len(), 2);
        assert!(s.on_puback(1));
        assert!(!s.on_puback(1));
        s.pump(Instant::now(), 2, None, |p| {
            sent.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(sent, vec![Some(1), Some(2), Some(3)]);
    }

    #[test]
    fn qos2_flow_and_too_large_and_expiry() {
        let mut s = SessionState::new("c".into(), 0);
        s.enqueue(
            delivery(QoS::ExactlyOnce, 0),
            QueueLimit::messages(10),
            &SystemClock,
        );
        s.pump(Instant::now(), 10, None, |_| Some(Emit::Sent));
        assert_eq!(s.on_pubrec(1, 0), Some(true));
        assert!(!s.on_puback(1));
        assert!(s.on_pubcomp(1));
        assert!(s.inflight.is_empty());

        s.enqueue(
            delivery(QoS::AtLeastOnce, 1),
            QueueLimit::messages(10),
            &SystemClock,
        );
        s.pump(Instant::now(), 10, None, |_| Some(Emit::TooLarge));
        assert!(s.inflight.is_empty());
        assert_eq!(s.dropped_too_large, 1);

        let mut old = delivery(QoS::AtLeastOnce, 2);
        let mut msg = (*old.message).clone();
        msg.properties.message_expiry_interval = Some(5);
        old.message = Arc::new(msg);
        let now = Instant::now();
        old.received_at = now.checked_sub(Duration::from_secs(6)).unwrap();
        s.enqueue(old, QueueLimit::messages(10), &SystemClock);
        s.pump(now, 10, None, |_| {
            panic!("expired message must not be sent")
        });
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
    fn inbound_qos2_ids_are_journalled_only_for_persistent_sessions() {
        let mut clean = SessionState::new("c".into(), 0);
        clean.journalled = true;
        clean.set_expiry(0, &SystemClock);
        clean.receive_qos2(5);
        assert!(clean.release_qos2(5));
        assert!(clean.changes.is_empty(), "{:?}", clean.changes);

        let mut s = SessionState::new("p".into(), 0);
        s.journalled = true;
        s.set_expiry(60, &SystemClock);
        s.changes.clear();
        s.receive_qos2(5);
        s.receive_qos2(5);
        s.receive_qos2(6);
        assert!(s.release_qos2(5));
        assert!(!s.release_qos2(5), "a second PUBREL finds nothing");
        let id = |packet_id| (Arc::<str>::from("p"), packet_id);
        let noted: Vec<_> = s
            .changes
            .drain(..)
            .map(|c| match c {
                SessionChange::Qos2Received {
                    client_id,
                    packet_id,
                } => ('Q', (client_id, packet_id)),
                SessionChange::Qos2Released {
                    client_id,
                    packet_id,
                } => ('q', (client_id, packet_id)),
                other => panic!("unexpected change {other:?}"),
            })
            .collect();
        assert_eq!(noted, vec![('Q', id(5)), ('Q', id(6)), ('q', id(5))]);
        let image = s.image(SystemClock.now(), SystemClock.now_ms());
        assert!(image.contains(&SessionChange::Qos2Received {
            client_id: "p".into(),
            packet_id: 6
        }));
        let mut restored = crate::persist::Restored::default();
        for change in image {
            restored.apply(change);
        }
        assert_eq!(
            restored.sessions["p"].inbound_qos2,
            BTreeSet::from([6]),
            "the image restores the ids in use"
        );
    }

    #[test]
    fn a_numbered_qos2_publish_is_taken_in_once_and_its_number_moves_with_the_session() {
        let clock: SharedClock = Arc::new(SystemClock);
        let handle = SessionHandle::new("n".into(), 60, None, clock.clone());
        handle.set_online(true);
        let id = PublishId {
            node: 1,
            incarnation: 2,
            seq: 3,
        };
        let numbered = Some((id, Duration::from_secs(60)));
        let limit = QueueLimit::messages(10);
        let first = handle.deliver(delivery(QoS::ExactlyOnce, 0), limit, numbered);
        assert_eq!(first.0, Enqueued::Queued);
        let again = handle.deliver(delivery(QoS::ExactlyOnce, 0), limit, numbered);
        assert_eq!(again.0, Enqueued::AlreadyTaken);
        let other = Some((PublishId { seq: 4, ..id }, Duration::from_secs(60)));
        assert_eq!(
            handle
                .deliver(delivery(QoS::ExactlyOnce, 1), limit, other)
                .0,
            Enqueued::Queued
        );
        assert_eq!(handle.lock().queue.len(), 2);

        // The image carries the numbers; put back, a session still skips the publish, until the
        // number can no longer come again.
        let (now, now_ms) = (clock.now(), clock.now_ms());
        let image = handle.lock().image(now, now_ms);
        let mut restored = crate::persist::Restored::default();
        for change in image {
            restored.apply(change);
        }
        let taken = restored.sessions["n"].taken.clone();
        assert_eq!(taken.len(), 2);
        let mut back = SessionState::new("n".into(), 60);
        back.restore_taken(taken.clone(), now_ms);
        assert!(back.has_taken(&id));
        let mut late = SessionState::new("n".into(), 60);
        late.restore_taken(taken, now_ms + 61_000);
        assert!(!late.has_taken(&id));
    }

    #[test]
    fn packet_ids_skip_those_in_flight_and_wrap() {
        let mut s = SessionState::new("c".into(), 0);
        s.next_packet_id = u16::MAX;
        s.enqueue(
            delivery(QoS::AtLeastOnce, 0),
            QueueLimit::messages(10),
            &SystemClock,
        );
        s.enqueue(
            delivery(QoS::AtLeastOnce, 1),
            QueueLimit::messages(10),
            &SystemClock,
        );
        let mut ids = Vec::new();
        s.pump(Instant::now(), 10, None, |p| {
            ids.push(p.packet_id);
            Some(Emit::Sent)
        });
        assert_eq!(ids, vec![Some(u16::MAX), Some(1)]);
    }
}
