//! A session's outbound queue: deliveries waiting to be sent, with the bytes they hold, so that a
//! session can be bounded by memory as well as by count (a stuck subscriber of large messages must
//! not hold a thousand maximum-size packets).

use std::collections::VecDeque;

use crate::session::Delivery;

/// How much one session may queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimit {
    pub messages: usize,
    /// Topic and payload bytes of the queued messages. A message larger than this still enters an
    /// empty queue: otherwise it could never be delivered at all.
    pub bytes: usize,
}

impl QueueLimit {
    /// Only the count is bounded.
    pub const fn messages(messages: usize) -> Self {
        QueueLimit {
            messages,
            bytes: usize::MAX,
        }
    }

    /// Whether a queue of `len` messages holding `bytes` takes one more of `extra` bytes.
    pub fn admits(&self, len: usize, bytes: usize, extra: usize) -> bool {
        len == 0 || (len < self.messages && bytes.saturating_add(extra) <= self.bytes)
    }
}

/// The bytes a delivery counts against [`QueueLimit::bytes`].
pub fn queued_bytes(d: &Delivery) -> usize {
    d.message.topic.len() + d.message.payload.len()
}

#[derive(Debug, Clone, Default)]
pub struct MessageQueue {
    items: VecDeque<Delivery>,
    bytes: usize,
}

impl MessageQueue {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Topic and payload bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether `d` fits under `limit` now.
    pub fn fits(&self, d: &Delivery, limit: QueueLimit) -> bool {
        limit.admits(self.items.len(), self.bytes, queued_bytes(d))
    }

    pub fn front(&self) -> Option<&Delivery> {
        self.items.front()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Delivery> {
        self.items.iter()
    }

    pub fn push_back(&mut self, d: Delivery) {
        self.bytes += queued_bytes(&d);
        self.items.push_back(d);
        self.debug_check();
    }

    pub fn push_front(&mut self, d: Delivery) {
        self.bytes += queued_bytes(&d);
        self.items.push_front(d);
        self.debug_check();
    }

    pub fn pop_front(&mut self) -> Option<Delivery> {
        let d = self.items.pop_front()?;
        self.bytes -= queued_bytes(&d);
        self.debug_check();
        Some(d)
    }

    /// Removes the oldest delivery `matching`, if any.
    pub fn remove_first(&mut self, matching: impl Fn(&Delivery) -> bool) -> Option<Delivery> {
        let i = self.items.iter().position(matching)?;
        let d = self.items.remove(i)?;
        self.bytes -= queued_bytes(&d);
        self.debug_check();
        Some(d)
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) && self.items.len() <= 64 {
            let bytes: usize = self.items.iter().map(queued_bytes).sum();
            debug_assert_eq!(bytes, self.bytes, "queued byte count out of sync");
        }
    }
}
