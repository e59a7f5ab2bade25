//! One ordered stream to another node: its outbox and the task that sends it, one batch at a time.

use std::sync::Arc;
use std::time::Duration;

use mqstate_cluster::transport::{Request, Response};
use mqstate_cluster::NodeId;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::wire::{self, Batch, Item, Reply, WireMessage};
use crate::{Shared, CALL_TIMEOUT};

/// Items sent in one batch at most.
const MAX_BATCH_ITEMS: usize = 512;
/// An idle stream sends an empty batch this often: the receiver learns the sender is there
/// (and asks for a resync after its own restart), the sender learns the receiver answers.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// After a failed call, the next try waits this long.
const RETRY: Duration = Duration::from_millis(300);

pub(crate) struct Outbox {
    pub addr: String,
    items: Vec<Item>,
    /// Resolved once the batch carrying the items queued with them is answered.
    waiters: Vec<oneshot::Sender<()>>,
    /// The next batch starts with every local route and the retained messages.
    resync: bool,
    /// The control plane counts the member up (its lease is current).
    member_up: bool,
    /// The last call got no answer: nothing is queued for it until one does.
    unreachable: bool,
    /// When the node last stopped being live (counted down or not answering).
    pub last_down: Option<Instant>,
    wake: Arc<Notify>,
    pub task: JoinHandle<()>,
}

impl Outbox {
    pub(crate) fn start(shared: Arc<Shared>, id: NodeId, addr: String, up: bool) -> Outbox {
        let wake = Arc::new(Notify::new());
        let task = tokio::spawn(send(shared, id, Arc::clone(&wake)));
        Outbox {
            addr,
            items: Vec::new(),
            waiters: Vec::new(),
            resync: true,
            member_up: up,
            unreachable: false,
            last_down: None,
            wake,
            task,
        }
    }

    /// Whether things are queued for this node (and waited for).
    pub(crate) fn is_live(&self) -> bool {
        self.member_up && !self.unreachable
    }

    pub(crate) fn set_member_up(&mut self, up: bool) {
        let was_live = self.is_live();
        if self.member_up && !up {
            tracing::info!(addr = %self.addr, "mesh: the control plane counts a node down; skipping it");
            self.skip();
        }
        self.member_up = up;
        self.note_liveness(was_live);
    }

    /// Remembers when the node stopped being live (`was_live`: it was before the change).
    fn note_liveness(&mut self, was_live: bool) {
        if was_live && !self.is_live() {
            self.last_down = Some(Instant::now());
        }
    }

    /// Queues `item` (if any); with `wait`, returns what resolves once it is answered.
    pub(crate) fn push(&mut self, item: Option<Item>, wait: bool) -> Option<oneshot::Receiver<()>> {
        debug_assert!(self.is_live());
        self.items.extend(item);
        self.wake.notify_one();
        wait.then(|| {
            let (tx, rx) = oneshot::channel();
            self.waiters.push(tx);
            rx
        })
    }

    /// The node is not followed for now: what was queued is dropped, nobody waits for it, and it
    /// gets a resync when it answers again.
    fn skip(&mut self) {
        self.items.clear();
        self.waiters.clear();
        self.resync = true;
    }

    pub(crate) fn want_resync(&mut self) {
        self.resync = true;
        self.wake.notify_one();
    }
}

/// The sender task of the stream to node `id`.
async fn send(shared: Arc<Shared>, id: NodeId, wake: Arc<Notify>) {
    let transport = shared.node.transport();
    let mut seq: u64 = 0;
    let mut idle_since = tokio::time::Instant::now();
    loop {
        let taken = {
            let mut state = shared.lock();
            let Some(outbox) = state.outboxes.get_mut(&id) else {
                return;
            };
            let due =
                outbox.resync || !outbox.items.is_empty() || idle_since.elapsed() >= HEARTBEAT;
            (due && outbox.member_up).then(|| {
                let n = outbox.items.len().min(MAX_BATCH_ITEMS);
                let items: Vec<Item> = outbox.items.drain(..n).collect();
                let waiters = if outbox.items.is_empty() {
                    std::mem::take(&mut outbox.waiters)
                } else {
                    Vec::new()
                };
                let resync = std::mem::take(&mut outbox.resync);
                (outbox.addr.clone(), items, waiters, resync)
            })
        };
        let Some((addr, mut items, waiters, resync)) = taken else {
            let _ = tokio::time::timeout(HEARTBEAT, wake.notified()).await;
            continue;
        };
        if resync {
            let routes = shared.lock().tables.local_routes();
            let retained = shared
                .broker
                .retained_messages()
                .iter()
                .map(|(message, age)| WireMessage::from_message(message, *age))
                .collect();
            items.insert(0, Item::Resync { routes, retained });
        }
        seq += 1;
        let batch = Batch {
            from: shared.me,
            incarnation: shared.incarnation,
            seq,
            items,
        };
        let request = Request::Mesh(batch.encode());
        let reply = match transport.call(&addr, request, CALL_TIMEOUT).await {
            Ok(Response::Mesh(bytes)) => wire::decode::<Reply>(&bytes).map_err(|e| e.to_string()),
            Ok(Response::Failed(why)) => Err(why),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        };
        idle_since = tokio::time::Instant::now();
        let failed = {
            let mut state = shared.lock();
            let Some(outbox) = state.outboxes.get_mut(&id) else {
                return;
            };
            let was_live = outbox.is_live();
            let failed = match reply {
                Ok(Reply::Accepted) => {
                    if outbox.unreachable {
                        tracing::info!(node = id, "mesh: node answers again");
                        outbox.unreachable = false;
                    }
                    for waiter in waiters {
                        let _ = waiter.send(());
                    }
                    false
                }
                Ok(Reply::Resync) => {
                    // Sent again, behind a resync (the routes of the batch are in it; a resync
                    // carries none of the other items, so they go again as they were). A
                    // receiver refuses a batch starting with a resync only if it cannot read it:
                    // then wait before the next try.
                    let mut items = batch.items;
                    let refused_resync = matches!(items.first(), Some(Item::Resync { .. }));
                    if refused_resync {
                        items.remove(0);
                        tracing::warn!(
                            node = id,
                            "mesh: node cannot read our batches (another version?)"
                        );
                    }
                    items.append(&mut outbox.items);
                    outbox.items = items;
                    let mut waiters = waiters;
                    waiters.append(&mut outbox.waiters);
                    outbox.waiters = waiters;
                    outbox.resync = true;
                    refused_resync
                }
                Err(why) => {
                    if !outbox.unreachable {
                        tracing::warn!(node = id, %addr, %why, "mesh: node does not answer; skipping it until it does");
                    }
                    outbox.unreachable = true;
                    outbox.skip();
                    // Dropped: whoever waits for this node goes on without it.
                    drop(waiters);
                    true
                }
            };
            outbox.note_liveness(was_live);
            failed
        };
        if failed {
            tokio::time::sleep(RETRY).await;
        }
    }
}
