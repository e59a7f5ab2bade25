//! The keyspace: key → [`Entry`], plus an ordered `(deadline, key)` index so the next deadline and
//! each expired key cost `O(log n)` — expiry never scans all keys.
//!
//! The keyspace stores what deltas say; whether an entry is *live* depends on the caller's `now_ms`.
//! An expired entry stays until its Delete delta is applied, but every command treats it as absent.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use bytes::Bytes;
use mqstate_protocol::Hlc;

/// A stored value with its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub value: Bytes,
    /// Version of the write that produced this entry.
    pub version: Hlc,
    /// The newest fencing token that protected a write to this key.
    pub fencing_token: Option<Hlc>,
    /// Absolute deadline (Unix ms); the entry is expired from this instant on.
    pub expires_at_ms: Option<u64>,
}

impl Entry {
    /// Whether the entry still exists at `now_ms`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|deadline| now_ms < deadline)
    }
}

/// Bytes a key and its value count against the memory quota.
pub fn entry_bytes(key: &[u8], value: &[u8]) -> u64 {
    (key.len() as u64).saturating_add(value.len() as u64)
}

/// Keys, their entries and the expiry index, kept consistent by the only two mutators.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keyspace {
    entries: BTreeMap<Bytes, Entry>,
    deadlines: BTreeSet<(u64, Bytes)>,
    stored_bytes: u64,
}

impl Keyspace {
    /// Inserts or replaces `key`, returning the previous entry.
    ///
    /// Key and value are copied into allocations of their own: what arrives is usually a slice of a
    /// network read buffer or of a log segment, and storing the slice would keep that whole buffer
    /// alive for as long as the key lives (one small key could pin kilobytes, a replayed key a segment).
    pub fn insert(&mut self, key: Bytes, mut entry: Entry) -> Option<Entry> {
        debug_assert!(!key.is_empty(), "keys are never empty");
        let key = Bytes::copy_from_slice(&key);
        entry.value = Bytes::copy_from_slice(&entry.value);
        if let Some(deadline) = entry.expires_at_ms {
            self.deadlines.insert((deadline, key.clone()));
        }
        self.stored_bytes = self
            .stored_bytes
            .saturating_add(entry_bytes(&key, &entry.value));
        let previous = self.entries.insert(key.clone(), entry);
        if let Some(old) = &previous {
            self.forget(&key, old);
        }
        self.debug_check();
        previous
    }

    /// Removes `key`, returning its entry.
    pub fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let previous = self.entries.remove(key);
        if let Some(old) = &previous {
            self.forget(key, old);
        }
        self.debug_check();
        previous
    }

    fn forget(&mut self, key: &[u8], old: &Entry) {
        if let Some(deadline) = old.expires_at_ms {
            // A replaced entry with the same deadline shares the index slot with its successor.
            let still_used = self
                .entries
                .get(key)
                .is_some_and(|e| e.expires_at_ms == Some(deadline));
            if !still_used {
                self.deadlines
                    .remove(&(deadline, Bytes::copy_from_slice(key)));
            }
        }
        self.stored_bytes = self
            .stored_bytes
            .saturating_sub(entry_bytes(key, &old.value));
    }

    /// The stored entry, live or expired.
    pub fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// The entry if it is live at `now_ms`.
    pub fn get_live(&self, key: &[u8], now_ms: u64) -> Option<&Entry> {
        self.entries.get(key).filter(|e| e.is_live(now_ms))
    }

    /// Number of stored keys (expired but not yet deleted ones included).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of [`entry_bytes`] over stored keys.
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// The earliest deadline of any stored key.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.first().map(|(deadline, _)| *deadline)
    }

    /// The key with the earliest deadline, if that deadline is at or before `now_ms`.
    pub fn first_expired(&self, now_ms: u64) -> Option<&Bytes> {
        self.deadlines
            .first()
            .filter(|(deadline, _)| *deadline <= now_ms)
            .map(|(_, key)| key)
    }

    /// All entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&Bytes, &Entry)> {
        self.entries.iter()
    }

    /// Entries with keys strictly after `after` (all of them when `None`), in key order.
    pub fn iter_after<'a>(
        &'a self,
        after: Option<&'a [u8]>,
    ) -> impl Iterator<Item = (&'a Bytes, &'a Entry)> {
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.entries.range::<[u8], _>((start, Bound::Unbounded))
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) && self.entries.len() <= 64 {
            let with_deadline = self
                .entries
                .values()
                .filter(|e| e.expires_at_ms.is_some())
                .count();
            debug_assert_eq!(
                with_deadline,
                self.deadlines.len(),
                "expiry index out of sync"
            );
            let bytes: u64 = self
                .entries
                .iter()
                .map(|(k, e)| entry_bytes(k, &e.value))
                .sum();
            debug_assert_eq!(bytes, self.stored_bytes, "byte count out of sync");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(value: &'static str, expires_at_ms: Option<u64>) -> Entry {
        Entry {
            value: Bytes::from_static(value.as_bytes()),
            version: Hlc::new(1, 0, Arc::from("n")),
            fencing_token: None,
            expires_at_ms,
        }
    }

    #[test]
    fn stored_keys_and_values_do_not_share_the_request_buffer() {
        let request = Bytes::from(b"SET some-key some-value".to_vec());
        let mut ks = Keyspace::default();
        let mut e = entry("", None);
        e.value = request.slice(13..);
        ks.insert(request.slice(4..12), e);
        let (key, stored) = ks.entries.iter().next().unwrap();
        assert_eq!(
            (&key[..], &stored.value[..]),
            (&b"some-key"[..], &b"some-value"[..])
        );
        let buffer = request.as_ptr_range();
        assert!(!buffer.contains(&key.as_ptr()));
        assert!(!buffer.contains(&stored.value.as_ptr()));
    }

    fn k(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn expiry_index_follows_replacements_and_removals() {
        let mut ks = Keyspace::default();
        ks.insert(k("a"), entry("1", Some(50)));
        ks.insert(k("b"), entry("22", Some(20)));
        ks.insert(k("c"), entry("333", None));
        assert_eq!(ks.next_deadline(), Some(20));
        assert_eq!(ks.stored_bytes(), 2 + 3 + 4);
        ks.insert(k("b"), entry("2", Some(70)));
        assert_eq!(ks.next_deadline(), Some(50));
        ks.insert(k("a"), entry("1", Some(50)));
        assert_eq!(ks.next_deadline(), Some(50));
        ks.insert(k("a"), entry("1", None));
        assert_eq!(ks.next_deadline(), Some(70));
        assert_eq!(ks.first_expired(69), None);
        assert_eq!(ks.first_expired(70), Some(&k("b")));
        ks.remove(b"b");
        assert_eq!(ks.next_deadline(), None);
        assert_eq!(ks.stored_bytes(), 2 + 4);
        assert_eq!(ks.remove(b"zz"), None);
    }

    #[test]
    fn liveness_is_relative_to_now() {
        let mut ks = Keyspace::default();
        ks.insert(k("a"), entry("1", Some(100)));
        assert!(ks.get_live(b"a", 99).is_some());
        assert!(ks.get_live(b"a", 100).is_none());
        assert!(ks.get(b"a").is_some());
    }

    #[test]
    fn iter_after_is_exclusive() {
        let mut ks = Keyspace::default();
        for key in ["a", "b", "c"] {
            ks.insert(k(key), entry("v", None));
        }
        let keys: Vec<_> = ks.iter_after(Some(b"a")).map(|(k, _)| k.clone()).collect();
        assert_eq!(keys, vec![k("b"), k("c")]);
        let keys: Vec<_> = ks.iter_after(Some(b"bb")).map(|(k, _)| k.clone()).collect();
        assert_eq!(keys, vec![k("c")]);
        assert_eq!(ks.iter_after(None).count(), 3);
    }
}
