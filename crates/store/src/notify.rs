//! Persistent notifications (Ceph RGW's persistent bucket notifications, seed 004): topics and their
//! bounded two-phase queues, as deterministic state next to the keyspace.
//!
//! A **topic** names an endpoint and a filter (key glob, events). Each topic owns one **queue**. A
//! write that matches a topic first **reserves** a slot in its queue (a full queue refuses the
//! reservation, so the write is refused and changes nothing), then **commits** it (the notification
//! enters the queue in the same log record as the key change, so the two are atomic) or **aborts**
//! it. A reservation left behind by a crash between reserve and commit is aborted once its deadline
//! passes. The queue's owner lists entries from the front and **removes** them once its endpoint
//! acknowledged them — a removal is fenced by the owner's lock key (see [`lock_key`]).
//!
//! Every change is a [`QueueDelta`] applied through [`Notifications::apply`], which returns the
//! [`QueueUndo`] that restores the previous state (for writes rolled back after a failed commit).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::{Glob, Hlc};

use crate::delta::Delta;

pub(crate) mod record;

pub use record::{QueueDelta, NO_RESERVATION};

/// Longest topic name.
pub const TOPIC_NAME_MAX: usize = 128;
/// Longest endpoint URL.
pub const ENDPOINT_MAX: usize = 2048;
/// Longest key pattern.
pub const KEYS_PATTERN_MAX: usize = 1024;
/// Prefix of the lock keys that say which node owns which queue.
pub const LOCK_KEY_PREFIX: &str = "__mqstate/notify/";
/// Suffix of a lock key (the lock of RGW's queue `q` is `q_lock`).
pub const LOCK_KEY_SUFFIX: &str = "_lock";

/// The state-store key whose holder owns `topic`'s queue.
pub fn lock_key(topic: &str) -> Bytes {
    Bytes::from(format!("{LOCK_KEY_PREFIX}{topic}{LOCK_KEY_SUFFIX}"))
}

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Event {
    Set,
    Delete,
    Expire,
}

impl Event {
    pub const ALL: [Event; 3] = [Event::Set, Event::Delete, Event::Expire];

    /// The event's bit in [`TopicDef::events`].
    pub const fn bit(self) -> u8 {
        match self {
            Event::Set => 1,
            Event::Delete => 2,
            Event::Expire => 4,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Event::Set => "set",
            Event::Delete => "delete",
            Event::Expire => "expire",
        }
    }

    pub fn parse(text: &str) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.as_str() == text)
    }

    fn from_byte(byte: u8) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.bit() == byte)
    }
}

/// Every event bit.
pub const ALL_EVENTS: u8 = 1 | 2 | 4;

/// A topic as its creator defined it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDef {
    pub name: String,
    /// `http://…` or `mqtt://…`; interpreted by the delivery side only.
    pub endpoint: String,
    /// A SCAN-style glob on keys.
    pub keys: Bytes,
    /// A set of [`Event::bit`]s.
    pub events: u8,
    /// Entries plus reservations the queue may hold.
    pub max_queue: u32,
}

impl TopicDef {
    /// Checks what a creator may get wrong; the message says what and how to fix it.
    pub fn validate(&self) -> Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= TOPIC_NAME_MAX
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !name_ok {
            return Err(format!(
                "invalid topic name {:?}: use 1 to {TOPIC_NAME_MAX} letters, digits, '-', '_' or '.'",
                self.name
            ));
        }
        if self.endpoint.is_empty() || self.endpoint.len() > ENDPOINT_MAX {
            return Err(format!("the endpoint must be 1 to {ENDPOINT_MAX} bytes"));
        }
        if self.keys.is_empty() || self.keys.len() > KEYS_PATTERN_MAX {
            return Err(format!(
                "the key pattern must be 1 to {KEYS_PATTERN_MAX} bytes"
            ));
        }
        Glob::new(&self.keys).map_err(|e| format!("invalid key pattern: {e}"))?;
        if self.events == 0 || self.events & !ALL_EVENTS != 0 {
            return Err("events must be a non-empty subset of set, delete, expire".into());
        }
        if self.max_queue == 0 || self.max_queue > i32::MAX as u32 {
            return Err("max-queue must be at least 1".into());
        }
        Ok(())
    }
}

/// One committed notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    /// 1, 2, 3 … per topic, in commit order.
    pub seq: u64,
    pub key: Bytes,
    pub event: Event,
    /// The version of the change; its wall time is when the entry was committed.
    pub version: Hlc,
    /// The new value of a set.
    pub value: Option<Bytes>,
}

impl QueueEntry {
    /// What the entry counts against the queue's bytes.
    pub fn bytes(&self) -> u64 {
        (self.key.len() + self.value.as_ref().map_or(0, Bytes::len)) as u64
    }
}

/// A topic with its queue.
#[derive(Debug, Clone)]
pub struct Topic {
    pub def: TopicDef,
    /// `def.name`, shared by the queue deltas and undos that name the topic.
    name: Arc<str>,
    glob: Glob,
    entries: VecDeque<QueueEntry>,
    /// The seq the next committed entry gets.
    next_seq: u64,
    /// Reservation id → deadline (Unix ms) after which it is stale.
    reservations: BTreeMap<u64, u64>,
    next_reservation_id: u64,
    bytes: u64,
}

impl Topic {
    fn new(def: TopicDef) -> Option<Topic> {
        let glob = Glob::new(&def.keys).ok()?;
        Some(Topic {
            name: Arc::from(def.name.as_str()),
            def,
            glob,
            entries: VecDeque::new(),
            next_seq: 1,
            reservations: BTreeMap::new(),
            next_reservation_id: 1,
            bytes: 0,
        })
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub fn matches(&self, key: &[u8], event: Event) -> bool {
        self.def.events & event.bit() != 0 && self.glob.matches(key)
    }

    /// Entries and reservations: what `max_queue` bounds.
    pub fn used(&self) -> u64 {
        self.entries.len() as u64 + self.reservations.len() as u64
    }

    pub fn is_full(&self) -> bool {
        self.used() >= u64::from(self.def.max_queue)
    }

    pub fn entries(&self) -> &VecDeque<QueueEntry> {
        &self.entries
    }

    pub fn reserved(&self) -> usize {
        self.reservations.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The id the next reservation gets.
    pub fn next_reservation_id(&self) -> u64 {
        self.next_reservation_id
    }

    /// Entries after `after_seq`, at most `max`.
    pub fn list(&self, after_seq: u64, max: usize) -> Vec<QueueEntry> {
        let start = self.entries.partition_point(|e| e.seq <= after_seq);
        self.entries.iter().skip(start).take(max).cloned().collect()
    }

    fn push(&mut self, entry: QueueEntry) {
        debug_assert_eq!(entry.seq, self.next_seq);
        self.bytes += entry.bytes();
        self.next_seq = entry.seq + 1;
        self.entries.push_back(entry);
        self.debug_check();
    }

    /// The queue's invariants, checked after each change in debug builds (a walk of the queue):
    /// its byte count is the sum of its entries', and their seqs ascend below the next seq.
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let sum: u64 = self.entries.iter().map(QueueEntry::bytes).sum();
            debug_assert_eq!(self.bytes, sum, "topic {}: byte count", self.def.name);
            debug_assert!(
                self.entries
                    .iter()
                    .zip(self.entries.iter().skip(1))
                    .all(|(a, b)| a.seq < b.seq)
                    && self.entries.back().is_none_or(|e| e.seq < self.next_seq),
                "topic {}: entry seqs must ascend below the next seq",
                self.def.name
            );
        }
    }
}

/// A reservation a commit released: (id, deadline).
pub type Reservation = (u64, u64);

/// What restores the state a [`QueueDelta`] changed (in memory only; never logged).
#[derive(Debug)]
pub enum QueueUndo {
    /// Forget reservations a `Reserve` made.
    Unreserve(Vec<(Arc<str>, u64)>),
    /// Put back reservations an `Abort` removed: (topic, id, deadline).
    Rereserve(Vec<(Arc<str>, u64, u64)>),
    /// Take back the last entry of each topic, and give back its reservation (id, deadline).
    Uncommit(Vec<(Arc<str>, Option<Reservation>)>),
    /// Put back removed entries at the front.
    Unremove(String, Vec<QueueEntry>),
    /// Put back the topic as it was (`None`: it did not exist).
    Restore(String, Option<Box<Topic>>),
    /// Put back the definition a create replaced (`None`: the topic did not exist).
    Redefine(String, Option<TopicDef>),
    Nothing,
}

/// Why a removal was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoveError {
    NoSuchTopic,
    /// The lock key is gone, expired, held by another holder, or newer than the token allows.
    Fenced,
}

/// Every topic, by name.
#[derive(Debug, Clone, Default)]
pub struct Notifications {
    topics: BTreeMap<String, Topic>,
}

impl Notifications {
    pub fn get(&self, name: &str) -> Option<&Topic> {
        self.topics.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Topic> {
        self.topics.values()
    }

    pub fn is_empty(&self) -> bool {
        self.topics.is_empty()
    }

    /// The topics a change of `key` by `event` notifies. Lock keys notify no topic: their renewals
    /// would fill the queues they guard.
    pub fn matching<'a>(&'a self, key: &'a [u8], event: Event) -> impl Iterator<Item = &'a Topic> {
        let lock = key.starts_with(LOCK_KEY_PREFIX.as_bytes());
        self.topics
            .values()
            .filter(move |t| !lock && t.matches(key, event))
    }

    /// The earliest reservation deadline.
    pub fn next_reservation_deadline(&self) -> Option<u64> {
        self.topics
            .values()
            .flat_map(|t| t.reservations.values().copied())
            .min()
    }

    /// Reservations whose deadline is at or before `now_ms`.
    pub fn stale_reservations(&self, now_ms: u64) -> Vec<(Arc<str>, u64)> {
        let mut stale = Vec::new();
        for topic in self.topics.values() {
            for (&id, &deadline) in &topic.reservations {
                if deadline <= now_ms {
                    stale.push((Arc::clone(&topic.name), id));
                }
            }
        }
        stale
    }

    /// The deadline of one reservation.
    pub fn reservation_deadline(&self, topic: &str, id: u64) -> Option<u64> {
        self.topics.get(topic)?.reservations.get(&id).copied()
    }

    /// Applies one change (replay applies the `key` part of a commit itself, see
    /// `StateMachine::apply_change`). Deltas naming topics that do not exist (deleted since) change
    /// nothing.
    pub fn apply(&mut self, delta: &QueueDelta) -> QueueUndo {
        match delta {
            QueueDelta::CreateTopic(def) => match self.topics.get_mut(&def.name) {
                Some(topic) => {
                    let Ok(glob) = Glob::new(&def.keys) else {
                        return QueueUndo::Nothing;
                    };
                    let previous = std::mem::replace(&mut topic.def, def.clone());
                    topic.glob = glob;
                    QueueUndo::Redefine(def.name.clone(), Some(previous))
                }
                None => match Topic::new(def.clone()) {
                    Some(topic) => {
                        self.topics.insert(def.name.clone(), topic);
                        QueueUndo::Redefine(def.name.clone(), None)
                    }
                    None => QueueUndo::Nothing,
                },
            },
            QueueDelta::DeleteTopic(name) => {
                let removed = self.topics.remove(name).map(Box::new);
                QueueUndo::Restore(name.clone(), removed)
            }
            QueueDelta::Reserve(reservations) => {
                let mut made = Vec::new();
                for (name, id, deadline) in reservations {
                    if let Some(topic) = self.topics.get_mut(&**name) {
                        if *id >= topic.next_reservation_id {
                            topic.next_reservation_id = id + 1;
                        }
                        topic.reservations.insert(*id, *deadline);
                        made.push((name.clone(), *id));
                    }
                }
                QueueUndo::Unreserve(made)
            }
            QueueDelta::Abort(reservations) => {
                let mut removed = Vec::new();
                for (name, id) in reservations {
                    if let Some(topic) = self.topics.get_mut(&**name) {
                        if let Some(deadline) = topic.reservations.remove(id) {
                            removed.push((name.clone(), *id, deadline));
                        }
                    }
                }
                QueueUndo::Rereserve(removed)
            }
            QueueDelta::Commit {
                change,
                event,
                commits,
            } => {
                let mut committed = Vec::new();
                for (name, reservation) in commits {
                    let Some(topic) = self.topics.get_mut(&**name) else {
                        continue;
                    };
                    let released = topic
                        .reservations
                        .remove(reservation)
                        .map(|deadline| (*reservation, deadline));
                    // A commit logged without a reservation record of its own (the write path's
                    // reservation lives in memory only): replay moves the ids on as reserving did.
                    if *reservation != NO_RESERVATION && *reservation >= topic.next_reservation_id {
                        topic.next_reservation_id = reservation + 1;
                    }
                    let value = match change {
                        Delta::Put { value, .. } => Some(value.clone()),
                        Delta::Delete { .. } => None,
                    };
                    let seq = topic.next_seq;
                    topic.push(QueueEntry {
                        seq,
                        key: change.key().clone(),
                        event: *event,
                        version: change.version().clone(),
                        value,
                    });
                    committed.push((name.clone(), released));
                }
                QueueUndo::Uncommit(committed)
            }
            QueueDelta::Remove { topic, up_to_seq } => {
                let Some(t) = self.topics.get_mut(topic) else {
                    return QueueUndo::Nothing;
                };
                let mut removed = Vec::new();
                while t.entries.front().is_some_and(|e| e.seq <= *up_to_seq) {
                    if let Some(entry) = t.entries.pop_front() {
                        t.bytes -= entry.bytes();
                        removed.push(entry);
                    }
                }
                t.debug_check();
                QueueUndo::Unremove(topic.clone(), removed)
            }
        }
    }

    /// Restores what [`apply`](Self::apply) changed; undos are applied newest first.
    pub fn undo(&mut self, undo: QueueUndo) {
        match undo {
            QueueUndo::Unreserve(made) => {
                for (name, id) in made {
                    if let Some(topic) = self.topics.get_mut(&*name) {
                        topic.reservations.remove(&id);
                        if topic.next_reservation_id == id + 1 {
                            topic.next_reservation_id = id;
                        }
                    }
                }
            }
            QueueUndo::Rereserve(removed) => {
                for (name, id, deadline) in removed {
                    if let Some(topic) = self.topics.get_mut(&*name) {
                        topic.reservations.insert(id, deadline);
                    }
                }
            }
            QueueUndo::Uncommit(committed) => {
                for (name, released) in committed {
                    if let Some(topic) = self.topics.get_mut(&*name) {
                        if let Some(entry) = topic.entries.pop_back() {
                            topic.bytes -= entry.bytes();
                            topic.next_seq = entry.seq;
                        }
                        if let Some((id, deadline)) = released {
                            topic.reservations.insert(id, deadline);
                        }
                        topic.debug_check();
                    }
                }
            }
            QueueUndo::Unremove(name, removed) => {
                if let Some(topic) = self.topics.get_mut(&name) {
                    for entry in removed.into_iter().rev() {
                        topic.bytes += entry.bytes();
                        topic.entries.push_front(entry);
                    }
                    topic.debug_check();
                }
            }
            QueueUndo::Restore(name, topic) => match topic {
                Some(topic) => {
                    self.topics.insert(name, *topic);
                }
                None => {
                    self.topics.remove(&name);
                }
            },
            QueueUndo::Redefine(name, previous) => match previous {
                Some(def) => {
                    if let (Some(topic), Ok(glob)) =
                        (self.topics.get_mut(&name), Glob::new(&def.keys))
                    {
                        topic.def = def;
                        topic.glob = glob;
                    }
                }
                None => {
                    self.topics.remove(&name);
                }
            },
            QueueUndo::Nothing => {}
        }
    }

    /// Rebuilds a topic from a snapshot.
    pub(crate) fn restore_topic(
        &mut self,
        def: TopicDef,
        next_seq: u64,
        next_reservation_id: u64,
        reservations: BTreeMap<u64, u64>,
        entries: VecDeque<QueueEntry>,
    ) -> Result<(), &'static str> {
        let mut topic = Topic::new(def).ok_or("invalid key pattern")?;
        if entries.iter().any(|e| e.seq >= next_seq)
            || entries
                .iter()
                .zip(entries.iter().skip(1))
                .any(|(a, b)| a.seq >= b.seq)
        {
            return Err("entry seqs must ascend below the next seq");
        }
        topic.bytes = entries.iter().map(QueueEntry::bytes).sum();
        topic.entries = entries;
        topic.next_seq = next_seq;
        topic.next_reservation_id = next_reservation_id;
        topic.reservations = reservations;
        self.topics.insert(topic.def.name.clone(), topic);
        Ok(())
    }

    pub(crate) fn topic_parts(
        topic: &Topic,
    ) -> (
        &TopicDef,
        u64,
        u64,
        &BTreeMap<u64, u64>,
        &VecDeque<QueueEntry>,
    ) {
        (
            &topic.def,
            topic.next_seq,
            topic.next_reservation_id,
            &topic.reservations,
            &topic.entries,
        )
    }
}

pub(crate) fn event_from_byte(byte: u8) -> Option<Event> {
    Event::from_byte(byte)
}

#[cfg(test)]
mod tests;
