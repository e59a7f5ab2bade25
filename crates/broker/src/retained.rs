//! Retained messages: the last retained message per topic.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytestring::ByteString;

use crate::message::Message;
use crate::topic;

/// A retained message and when it was received (its expiry counts from then).
#[derive(Debug, Clone)]
pub(crate) struct Retained {
    pub message: Arc<Message>,
    pub received_at: Instant,
}

/// Clears a cluster node remembers at most (the oldest are forgotten first).
pub(crate) const CLEARS_KEPT: usize = 65_536;

/// How much later than a clear a copy of the very message that clear removed may read, and
/// still be refused as that message come back (decision 0072). A copy's time is read late by
/// up to two mesh calls (8 s each): the forward that brought it to the node that stamped it at
/// receipt, and the resync that carries it on, whose age is taken before its transit. So a node
/// that was down offers its copy of a message cleared moments after it went down with a time
/// that can read later than the clear; without this, the later-of rule took it back.
pub(crate) const CLEARED_COPY_WITHIN: Duration = Duration::from_secs(16);

#[derive(Default)]
pub(crate) struct RetainedStore {
    by_topic: HashMap<ByteString, Retained>,
    /// On a cluster node: when each topic's retained message was last cleared, so that a node
    /// that was away, and still holds the old message, learns the clear when it rejoins
    /// (decision 0057). Kept in memory, at most [`CLEARS_KEPT`], oldest forgotten first.
    clears: Option<Clears>,
}

#[derive(Default)]
struct Clears {
    at: HashMap<ByteString, Clear>,
    /// In the order noted; an entry whose time is no longer the topic's is skipped.
    order: VecDeque<(ByteString, Instant)>,
}

#[derive(Debug, Clone, Copy)]
struct Clear {
    at: Instant,
    /// The fingerprint of the message the clear removed here, if this node held one (not kept
    /// across a restart: the journal's tombstone has the time only).
    removed: Option<u64>,
}

impl Clears {
    fn note(&mut self, topic: &ByteString, at: Instant, removed: Option<u64>) {
        let known = self.at.get(topic).copied();
        if known.is_some_and(|known| known.at >= at) {
            return;
        }
        // A later clear of a topic nothing was retained on since: the message the earlier one
        // removed is still the last the topic had.
        let removed = removed.or(known.and_then(|k| k.removed));
        self.at.insert(topic.clone(), Clear { at, removed });
        self.order.push_back((topic.clone(), at));
        while self.at.len() > CLEARS_KEPT {
            let Some((topic, at)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&topic).is_some_and(|c| c.at == at) {
                self.at.remove(&topic);
            }
        }
        if self.order.len() > 2 * CLEARS_KEPT {
            let kept = &self.at;
            self.order
                .retain(|(topic, t)| kept.get(topic).is_some_and(|c| c.at == *t));
        }
    }

    /// Whether `message`, read as made at `at`, is older than the topic's clear, or is the very
    /// message the clear removed come back with a time read late (within
    /// [`CLEARED_COPY_WITHIN`]).
    fn refuse(&self, message: &Message, at: Instant) -> bool {
        self.at.get(&message.topic).is_some_and(|clear| {
            clear.at >= at
                || (clear.removed == Some(fingerprint(message))
                    && at < clear.at + CLEARED_COPY_WITHIN)
        })
    }
}

/// Tells one message from another (topic, payload, QoS, properties) in a clear's memory, without
/// keeping the message.
fn fingerprint(message: &Message) -> u64 {
    let mut hasher = DefaultHasher::new();
    message.hash(&mut hasher);
    hasher.finish()
}

impl RetainedStore {
    /// Remembers clears from now on (a cluster node).
    pub(crate) fn keep_clears(&mut self) {
        self.clears.get_or_insert_with(Clears::default);
    }

    /// Whether clears are remembered (and journalled with their time).
    pub(crate) fn keeps_clears(&self) -> bool {
        self.clears.is_some()
    }

    /// Remembers a clear read back from the journal, made at `at` (from now on, clears are
    /// remembered: only a cluster node's journal has them). Older than a retained message held
    /// for the topic: nothing to remember.
    pub(crate) fn restore_clear(&mut self, topic: &ByteString, at: Instant) {
        if self
            .by_topic
            .get(topic)
            .is_some_and(|r| r.received_at >= at)
        {
            return;
        }
        let removed = self.by_topic.remove(topic).map(|r| fingerprint(&r.message));
        self.clears
            .get_or_insert_with(Clears::default)
            .note(topic, at, removed);
    }

    /// Applies a PUBLISH with RETAIN set: an empty payload deletes, anything else replaces.
    pub(crate) fn apply(&mut self, message: &Arc<Message>, received_at: Instant) {
        debug_assert!(message.retain);
        if message.payload.is_empty() {
            let removed = self.by_topic.remove(&message.topic);
            if let Some(clears) = &mut self.clears {
                clears.note(
                    &message.topic,
                    received_at,
                    removed.map(|r| fingerprint(&r.message)),
                );
            }
        } else {
            if let Some(clears) = &mut self.clears {
                clears.at.remove(&message.topic);
            }
            self.by_topic.insert(
                message.topic.clone(),
                Retained {
                    message: message.clone(),
                    received_at,
                },
            );
        }
    }

    /// Takes in a retained message (or, with an empty payload, a clear) that another node holds,
    /// received there at `received_at`, if it is newer than what this node holds or remembers
    /// clearing on its topic (the later one wins; the message a clear removed here loses to it
    /// unless it reads more than [`CLEARED_COPY_WITHIN`] later); whether it did.
    pub(crate) fn adopt(&mut self, message: &Arc<Message>, received_at: Instant) -> bool {
        debug_assert!(message.retain);
        let held = self.by_topic.get(&message.topic);
        if held.is_some_and(|r| r.received_at >= received_at || r.message == *message) {
            return false;
        }
        if message.payload.is_empty() {
            let removed = self.by_topic.remove(&message.topic);
            if let Some(clears) = &mut self.clears {
                clears.note(
                    &message.topic,
                    received_at,
                    removed.as_ref().map(|r| fingerprint(&r.message)),
                );
            }
            return removed.is_some();
        }
        if self
            .clears
            .as_ref()
            .is_some_and(|c| c.refuse(message, received_at))
        {
            return false;
        }
        self.apply(message, received_at);
        true
    }

    /// The clears remembered, with when they were made.
    pub(crate) fn clears(&self) -> Vec<(ByteString, Instant)> {
        let Some(clears) = &self.clears else {
            return Vec::new();
        };
        let mut all: Vec<_> = clears.at.iter().map(|(t, c)| (t.clone(), c.at)).collect();
        all.sort_unstable();
        all
    }

    /// Retained messages whose topic matches `filter`, dropping expired ones, by topic (they go to
    /// the subscriber, and into its session's journal, in this order).
    ///
    /// This scans all retained topics: subscribing is rare next to publishing, and the retained set
    /// is usually small. A trie over retained topics is the upgrade if that stops being true.
    pub(crate) fn matching(&mut self, filter: &str, now: Instant) -> Vec<Retained> {
        self.drop_expired(now);
        let mut found: Vec<Retained> = self
            .by_topic
            .values()
            .filter(|r| topic::matches(filter, &r.message.topic))
            .cloned()
            .collect();
        by_topic(&mut found);
        found
    }

    /// Every retained message that has not expired, by topic.
    pub(crate) fn all(&mut self, now: Instant) -> Vec<Retained> {
        self.drop_expired(now);
        let mut all: Vec<Retained> = self.by_topic.values().cloned().collect();
        by_topic(&mut all);
        all
    }

    fn drop_expired(&mut self, now: Instant) {
        self.by_topic.retain(|_, r| {
            r.message
                .properties
                .message_expiry_interval
                .is_none_or(|secs| {
                    now.saturating_duration_since(r.received_at).as_secs() < u64::from(secs)
                })
        });
    }
}

fn by_topic(retained: &mut [Retained]) {
    retained.sort_unstable_by(|a, b| a.message.topic.cmp(&b.message.topic));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::QoS;
    use bytes::Bytes;

    fn msg(topic: &str, payload: &'static [u8]) -> Arc<Message> {
        Arc::new(Message {
            topic: topic.into(),
            payload: Bytes::from_static(payload),
            qos: QoS::AtMostOnce,
            retain: true,
            properties: Default::default(),
        })
    }

    #[test]
    fn set_replace_delete() {
        let mut store = RetainedStore::default();
        let now = Instant::now();
        store.apply(&msg("a/b", b"1"), now);
        store.apply(&msg("a/b", b"2"), now);
        store.apply(&msg("a/c", b"3"), now);
        let got = store.matching("a/b", now);
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].message.payload[..], b"2");
        assert_eq!(store.matching("a/+", now).len(), 2);
        store.apply(&msg("a/b", b""), now);
        assert_eq!(store.matching("a/+", now).len(), 1);
        assert_eq!(store.matching("#", now).len(), 1);
        assert!(
            store.clears().is_empty(),
            "a single node remembers no clears"
        );
    }

    /// What a node that was away holds, and what the others tell it at resync: the later one
    /// wins, a clear included (decision 0057).
    #[test]
    fn the_later_of_a_message_and_a_clear_wins() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        let mut here = RetainedStore::default();
        here.keep_clears();
        here.apply(&msg("a", b"old"), at(10));
        here.apply(&msg("b", b"kept"), at(10));
        // A clear made at 20 elsewhere removes the message of 10; one of 5 does not.
        assert!(here.adopt(&msg("a", b""), at(20)));
        assert!(!here.adopt(&msg("b", b""), at(5)));
        assert!(here.matching("a", at(30)).is_empty());
        assert_eq!(here.clears(), [(ByteString::from("a"), at(20))]);
        // A stale copy (older than the clear) does not come back; a newer message does.
        assert!(!here.adopt(&msg("a", b"old"), at(10)));
        assert!(here.matching("a", at(30)).is_empty());
        assert!(here.adopt(&msg("a", b"new"), at(25)));
        assert_eq!(&here.matching("a", at(30))[0].message.payload[..], b"new");
        // A replacement made while away wins over the old message; the same one is not taken again.
        assert!(here.adopt(&msg("b", b"replaced"), at(15)));
        assert!(!here.adopt(&msg("b", b"replaced"), at(16)));
        assert!(!here.adopt(&msg("b", b"older"), at(12)));
        assert_eq!(
            &here.matching("b", at(30))[0].message.payload[..],
            b"replaced"
        );
    }

    /// Issue 16 (decision 0072): a node that was down offers, at its resync, its copy of a
    /// message cleared moments after it went down, with a time read later than the clear (its
    /// receipt of the forward, then the resync's transit). A node whose clear removed that very
    /// message refuses it; another message, or the same one again well after, still wins.
    #[test]
    fn the_message_a_clear_removed_does_not_come_back_with_a_time_read_late() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut here = RetainedStore::default();
        here.keep_clears();
        for topic in ["a", "b", "c"] {
            here.apply(&msg(topic, b"v1"), at(0));
            here.apply(&msg(topic, b""), at(21));
        }
        // The away node's copy, read as received 39 ms after the clear.
        assert!(!here.adopt(&msg("a", b"v1"), at(60)));
        assert!(here.matching("a", at(100)).is_empty());
        // A clear again (nothing held since) still knows which message the topic last had.
        here.apply(&msg("a", b""), at(30));
        assert!(!here.adopt(&msg("a", b"v1"), at(60)));
        // Another message made after the clear wins, as before.
        assert!(here.adopt(&msg("b", b"v2"), at(60)));
        assert_eq!(&here.matching("b", at(100))[0].message.payload[..], b"v2");
        // The same message retained again well after the clear wins too.
        let again = at(21) + CLEARED_COPY_WITHIN + Duration::from_millis(1);
        assert!(here.adopt(&msg("c", b"v1"), again));
        assert_eq!(&here.matching("c", again)[0].message.payload[..], b"v1");
        // A clear of a topic this node held nothing for: the later-of rule only.
        let mut other = RetainedStore::default();
        other.keep_clears();
        other.apply(&msg("a", b""), at(21));
        assert!(other.adopt(&msg("a", b"v1"), at(60)));
    }

    #[test]
    fn clears_are_bounded() {
        let t0 = Instant::now();
        let mut store = RetainedStore::default();
        store.keep_clears();
        for i in 0..CLEARS_KEPT + 10 {
            let at = t0 + std::time::Duration::from_millis(i as u64);
            store.apply(&msg(&format!("t/{i}"), b""), at);
        }
        let clears = store.clears();
        assert_eq!(clears.len(), CLEARS_KEPT);
        assert!(
            !clears.iter().any(|(t, _)| t == "t/0"),
            "the oldest forgotten"
        );
    }
}
