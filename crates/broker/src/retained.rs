//! Retained messages: the last retained message per topic.

use std::collections::HashMap;
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

#[derive(Default)]
pub(crate) struct RetainedStore {
    by_topic: HashMap<ByteString, Retained>,
}

impl RetainedStore {
    /// Applies a PUBLISH with RETAIN set: an empty payload deletes, anything else replaces.
    pub(crate) fn apply(&mut self, message: &Arc<Message>, received_at: Instant) {
        debug_assert!(message.retain);
        if message.payload.is_empty() {
            self.by_topic.remove(&message.topic);
        } else {
            self.by_topic.insert(
                message.topic.clone(),
                Retained {
                    message: message.clone(),
                    received_at,
                },
            );
        }
    }

    /// Takes `message` in unless a message is retained on its topic already; whether it did.
    pub(crate) fn adopt(&mut self, message: &Arc<Message>, received_at: Instant) -> bool {
        debug_assert!(message.retain && !message.payload.is_empty());
        if self.by_topic.contains_key(&message.topic) {
            return false;
        }
        self.apply(message, received_at);
        true
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
    }
}
