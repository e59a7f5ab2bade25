//! Keys newly observed on a cluster node whose watch is on its way to the other nodes. Until the
//! nodes that may execute a key's writes know that this node observes it, its changes pass this
//! node by; so whoever finds the key observed here already (a KEYNOTIFY, a restored session's
//! registrations) waits for that watch before telling its client the registration is in force.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::watch;

use crate::router::Router;

/// The watches on their way, per key.
#[derive(Clone, Default)]
pub(super) struct Watching(Arc<Mutex<HashMap<Bytes, watch::Receiver<bool>>>>);

impl Watching {
    /// `key` became observed here: its watch is on its way until [`Announcing::send`] is done.
    pub(super) fn begin(&self, key: Bytes) -> Announcing {
        let (known, rx) = watch::channel(false);
        self.lock().insert(key.clone(), rx);
        Announcing {
            key,
            known,
            watching: self.clone(),
        }
    }

    /// The watch of `key` still on its way, if any ([`in_force`] waits for it).
    pub(super) fn on_its_way(&self, key: &[u8]) -> Option<watch::Receiver<bool>> {
        self.lock().get(key).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Bytes, watch::Receiver<bool>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A watch to send: the other nodes are told `key` is observed here.
pub(super) struct Announcing {
    key: Bytes,
    known: watch::Sender<bool>,
    watching: Watching,
}

impl Announcing {
    /// Tells the nodes that may execute the key's writes; returns once they know, and so does
    /// every [`in_force`] waiting on this watch.
    pub(super) async fn send(self, router: &Router) {
        router.0.watch(self.key.clone(), true).await;
        let _ = self.known.send(true);
        let mut watching = self.watching.lock();
        // A later watch of the key (unobserved and observed again meanwhile) stays.
        if watching
            .get(&self.key)
            .is_some_and(|rx| rx.same_channel(&self.known.subscribe()))
        {
            watching.remove(&self.key);
        }
    }
}

/// Returns once the watch `on_its_way` was sent (or abandoned: its sender dropped, as when the
/// service stops).
pub(super) async fn in_force(mut on_its_way: watch::Receiver<bool>) {
    let _ = on_its_way.wait_for(|known| *known).await;
}
