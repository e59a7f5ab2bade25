//! Retained messages: the last retained message per topic.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

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
    at: HashMap<ByteString, Instant>,
    /// In the order noted; an entry whose time is no longer the topic's is skipped.
    order: VecDeque<(ByteString, Instant)>,
}

impl Clears {
    fn note(&mut self, topic: &ByteString, at: Instant) {
        if self.at.get(topic).is_some_and(|known| *known >= at) {
            return;
        }
        self.at.insert(topic.clone(), at);
        self.order.push_back((topic.clone(), at));
        while self.at.len() > CLEARS_KEPT {
            let Some((topic, at)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&topic) == Some(&at) {
                self.at.remove(&topic);
            }
        }
        if self.order.len() > 2 * CLEARS_KEPT {
            let at = &self.at;
            self.order.retain(|(topic, t)| at.get(topic) == Some(t));
        }
    }
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
        self.by_topic.remove(topic);
        self.clears
            .get_or_insert_with(Clears::default)
            .note(topic, at);
    }

    /// Applies a PUBLISH with RETAIN set: an empty payload deletes, anything else replaces.
    pub(crate) fn apply(&mut self, message: &Arc<Message>, received_at: Instant) {
        debug_assert!(message.retain);
        if message.payload.is_empty() {
            self.by_topic.remove(&message.topic);
            if let Some(clears) = &mut self.clears {
                clears.note(&message.topic, received_at);
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
    /// clearing on its topic (the later one wins); whether it did.
    pub(crate) fn adopt(&mut self, message: &Arc<Message>, received_at: Instant) -> bool {
        debug_assert!(message.retain);
        let held = self.by_topic.get(&message.topic);
        if held.is_some_and(|r| r.received_at >= received_at || r.message == *message) {
            return false;
        }
        if message.payload.is_empty() {
            if let Some(clears) = &mut self.clears {
                clears.note(&message.topic, received_at);
            }
            return self.by_topic.remove(&message.topic).is_some();
        }
        let cleared = self.clears.as_ref().and_then(|c| c.at.get(&message.topic));
        if cleared.is_some_and(|at| *at >= received_at) {
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
        let mut all: Vec<_> = clears.at.iter().map(|(t, at)| (t.clone(), *at)).collect();
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
