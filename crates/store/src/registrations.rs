//! KEYNOTIFY registrations per (client id, key), indexed both ways so that finding a key's observers
//! and dropping a disconnected client are both cheap. Session state: not replicated, not snapshotted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Registrations {
    by_key: BTreeMap<Bytes, BTreeSet<Arc<str>>>,
    by_client: BTreeMap<Arc<str>, BTreeSet<Bytes>>,
}

impl Registrations {
    /// Registers; `false` when the client already holds `max_per_client` other registrations.
    pub(crate) fn register(
        &mut self,
        client: &Arc<str>,
        key: &Bytes,
        max_per_client: usize,
    ) -> bool {
        let keys = self.by_client.entry(client.clone()).or_default();
        if !keys.contains(key) && keys.len() >= max_per_client {
            if keys.is_empty() {
                self.by_client.remove(client);
            }
            return false;
        }
        keys.insert(key.clone());
        self.by_key
            .entry(key.clone())
            .or_default()
            .insert(client.clone());
        true
    }

    /// Unregisters; `false` when there was no such registration.
    pub(crate) fn unregister(&mut self, client: &Arc<str>, key: &[u8]) -> bool {
        let Some(keys) = self.by_client.get_mut(client) else {
            return false;
        };
        if !keys.remove(key) {
            return false;
        }
        if keys.is_empty() {
            self.by_client.remove(client);
        }
        if let Some(clients) = self.by_key.get_mut(key) {
            clients.remove(client);
            if clients.is_empty() {
                self.by_key.remove(key);
            }
        }
        true
    }

    /// Drops all of a client's registrations, returning how many there were.
    pub(crate) fn drop_client(&mut self, client: &str) -> usize {
        let Some(keys) = self.by_client.remove(client) else {
            return 0;
        };
        for key in &keys {
            if let Some(clients) = self.by_key.get_mut(key) {
                clients.remove(client);
                if clients.is_empty() {
                    self.by_key.remove(key);
                }
            }
        }
        keys.len()
    }

    /// Clients observing `key`, in client-id order.
    pub(crate) fn observers(&self, key: &[u8]) -> impl Iterator<Item = &Arc<str>> {
        self.by_key.get(key).into_iter().flatten()
    }

    /// The keys `client` observes, in key order.
    pub(crate) fn keys_of(&self, client: &str) -> Vec<Bytes> {
        self.by_client
            .get(client)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub(crate) fn count(&self, client: &str) -> usize {
        self.by_client.get(client).map_or(0, BTreeSet::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_indexes_stay_consistent() {
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let (k1, k2) = (Bytes::from_static(b"k1"), Bytes::from_static(b"k2"));
        let mut r = Registrations::default();
        assert!(r.register(&a, &k1, 2));
        assert!(r.register(&a, &k1, 2));
        assert!(r.register(&a, &k2, 2));
        assert!(!r.register(&a, &Bytes::from_static(b"k3"), 2));
        assert!(r.register(&b, &k1, 2));
        assert_eq!(
            r.observers(b"k1").cloned().collect::<Vec<_>>(),
            vec![a.clone(), b.clone()]
        );
        assert!(r.unregister(&b, b"k1"));
        assert!(!r.unregister(&b, b"k1"));
        assert_eq!(r.drop_client("a"), 2);
        assert_eq!(r.observers(b"k1").count(), 0);
        assert_eq!(r, Registrations::default());
        assert!(!r.register(&a, &k1, 0));
        assert_eq!(r, Registrations::default());
    }
}
