//! Chain messages to a peer, batched per hop: one sender task per peer takes everything queued for
//! it and sends it as one frame ([`DataRequest::Chains`]), with at most [`CALLS_IN_FLIGHT`] calls
//! under way per peer. Under load the messages of many writes (phase 1 to the successor, phase 2
//! to the predecessor, of every partition) travel together while earlier calls are under way;
//! when idle, a message leaves at once. Calls may overtake each other: the protocol tolerates
//! reordering (every step is keyed by key and version).
//!
//! Delivery is best effort, as the protocol expects: a batch the peer did not take is dropped with
//! whatever queued behind it meanwhile (the replicas resend what still matters on their ticks), so a
//! dead or stopped peer never makes the queue grow.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use mqstate_chain::Message;
use mqstate_cluster::transport::Request;
use mqstate_cluster::ClusterNode;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::wire::{encode, DataRequest};

/// How long one batch may take to hand over.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Calls under way per peer: a message need not wait for a whole round trip of the previous
/// batch (the peer's process may be slow to be scheduled), and frames stay batched under load.
const CALLS_IN_FLIGHT: usize = 4;
/// Messages per frame at most (a frame stays far below the transport's limit: a message holds
/// one row per item, a copy chunk `copy_batch` rows).
const MAX_MESSAGES: usize = 256;

/// The per-peer senders of one node's driver.
pub struct Peers {
    node: Arc<ClusterNode>,
    /// Ordered, as every map whose order can reach the network (deterministic under simulation).
    queues: BTreeMap<u64, mpsc::UnboundedSender<(u32, Message)>>,
}

impl Peers {
    pub fn new(node: Arc<ClusterNode>) -> Peers {
        Peers {
            node,
            queues: BTreeMap::new(),
        }
    }

    /// Queues `message` for the replica of `partition` on node `to`.
    pub fn send(&mut self, to: u64, partition: u32, message: Message) {
        let node = &self.node;
        let queue = self.queues.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(Arc::clone(node), to, rx));
            tx
        });
        if queue.send((partition, message)).is_err() {
            // The sender task is gone only when its runtime is shutting down.
            tracing::debug!(
                partition,
                to,
                "chain message dropped: no sender to node {to}"
            );
        }
    }
}

/// One peer's sender: until every [`Peers`] handle is dropped.
async fn run(node: Arc<ClusterNode>, to: u64, mut rx: mpsc::UnboundedReceiver<(u32, Message)>) {
    let mut calls = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            Some(done) = calls.join_next(), if !calls.is_empty() => {
                if let Ok(Err((count, e))) = done {
                    // What queued while this call failed would most likely fail too, and the
                    // protocol resends what still matters: drop it rather than let a dead peer's
                    // queue grow.
                    let mut dropped = 0;
                    while rx.try_recv().is_ok() {
                        dropped += 1;
                    }
                    tracing::debug!(to, count, dropped, "chain messages not delivered: {e}");
                }
            }
            first = rx.recv(), if calls.len() < CALLS_IN_FLIGHT => {
                let Some(first) = first else { break };
                let mut batch = vec![first];
                while batch.len() < MAX_MESSAGES {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let count = batch.len();
                let Some(addr) = node.addr_of(to) else {
                    tracing::debug!(to, count, "chain messages to an unknown node dropped");
                    continue;
                };
                let frame = encode(&DataRequest::Chains(batch));
                let transport = node.transport();
                calls.spawn(async move {
                    transport
                        .call(&addr, Request::Data(frame), SEND_TIMEOUT)
                        .await
                        .map(drop)
                        .map_err(|e| (count, e))
                });
            }
        }
    }
}
