//! A client's key commands on the router path run in the order they arrived, per key: each
//! routed request waits in a task of its own, so without this a pipelined `SET k` then `GET k`
//! could reach the head in either order and the GET miss the SET — which the single node's
//! executor, running requests one after another, never does (decision 0064).
//!
//! Each (client, key) keeps the completion of its latest request; the next request of the same
//! client for the same key waits for it before it executes. Requests of other clients or other
//! keys do not wait. An entry is forgotten once its request completed and no other followed it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

type Entries = HashMap<(Arc<str>, Bytes), (u64, oneshot::Receiver<()>)>;

/// The latest request of each (client, key) on the router path.
#[derive(Default)]
pub(super) struct KeyOrder {
    entries: Arc<Mutex<Entries>>,
    next: u64,
}

impl KeyOrder {
    /// The turn of a request of `client_id` for `key`, taken in arrival order: it starts once the
    /// client's previous request for the key completed.
    pub(super) fn turn(&mut self, client_id: &Arc<str>, key: &Bytes) -> Turn {
        self.next += 1;
        let seq = self.next;
        let (done, completed) = oneshot::channel();
        let slot = (Arc::clone(client_id), key.clone());
        let previous = self
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(slot.clone(), (seq, completed))
            .map(|(_, previous)| previous);
        Turn {
            previous,
            done: Some(done),
            entries: Arc::clone(&self.entries),
            slot,
            seq,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// One request's place in its (client, key) order; dropping it completes the request.
pub(super) struct Turn {
    previous: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
    entries: Arc<Mutex<Entries>>,
    slot: (Arc<str>, Bytes),
    seq: u64,
}

impl Turn {
    /// Waits until the previous request of the same client for the same key completed (or was
    /// dropped: a request given up on does not hold the next one).
    pub(super) async fn wait(&mut self) {
        if let Some(previous) = self.previous.take() {
            let _ = previous.await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        // Still the latest of its (client, key): nobody waits for it.
        if entries
            .get(&self.slot)
            .is_some_and(|(seq, _)| *seq == self.seq)
        {
            entries.remove(&self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> Bytes {
        Bytes::copy_from_slice(k.as_bytes())
    }

    #[tokio::test]
    async fn a_request_waits_for_the_previous_one_of_its_client_and_key_only() {
        let mut order = KeyOrder::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let first = order.turn(&a, &key("k"));
        let mut second = order.turn(&a, &key("k"));
        let mut other_key = order.turn(&a, &key("j"));
        let mut other_client = order.turn(&b, &key("k"));
        // Not behind anything.
        other_key.wait().await;
        other_client.wait().await;
        let waiting = tokio::spawn(async move {
            second.wait().await;
            second
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the second waits for the first");
        drop(first);
        let second = waiting.await.unwrap();
        drop((second, other_key, other_client));
        assert_eq!(order.len(), 0, "completed requests are forgotten");
    }

    #[tokio::test]
    async fn an_entry_is_forgotten_once_no_later_request_follows() {
        let mut order = KeyOrder::default();
        let a: Arc<str> = Arc::from("a");
        let first = order.turn(&a, &key("k"));
        let mut second = order.turn(&a, &key("k"));
        let third = order.turn(&a, &key("k"));
        drop(first);
        second.wait().await;
        drop(second);
        assert_eq!(order.len(), 1, "the third is still the latest");
        drop(third);
        assert_eq!(order.len(), 0);
    }
}
