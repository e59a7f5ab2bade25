//! State-store requests forwarded to their partition's head, batched per peer: one sender task
//! per peer takes every request queued for it and sends them as one frame
//! ([`DataRequest::ExecuteMany`]), with at most [`CALLS_IN_FLIGHT`] calls under way per peer. The
//! head executes the batch's requests together (their reads and chain writes meet in the same
//! driver turns) and answers them in one frame. Under load a forwarded request then costs a share
//! of a frame each way, not a frame, a connection's syscalls and a wake-up of its own; when idle,
//! a request leaves at once.
//!
//! A call that fails (the head died, a connection broke) fails every request of its batch at once,
//! like the call per request before it: the caller retries at once against the head it then
//! learns, so a head's `kill -9` is seen when its connections break, not at a timeout.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use mqstate_cluster::transport::{Request, Response};
use mqstate_cluster::ClusterNode;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::wire::{decode, encode, DataRequest, DataResponse, Executed, Routed};
use crate::STEP_TIMEOUT;

/// Calls under way per peer: a request need not wait for a whole batch at the head (one chain
/// write), and batches form while the earlier calls are under way.
const CALLS_IN_FLIGHT: usize = 8;
/// Requests per frame at most.
const MAX_REQUESTS: usize = 128;

/// What a forwarded request comes back as: the reply, or why it was not executed (retry).
pub type Outcome = Result<Executed, String>;

struct Job {
    routed: Routed,
    answer: oneshot::Sender<Outcome>,
}

/// The per-peer senders of forwarded requests.
pub struct Forwarder {
    node: Arc<ClusterNode>,
    /// Ordered, as every map whose order can reach the network (deterministic under simulation).
    queues: Mutex<BTreeMap<u64, mpsc::UnboundedSender<Job>>>,
}

impl Forwarder {
    pub fn new(node: Arc<ClusterNode>) -> Forwarder {
        Forwarder {
            node,
            queues: Mutex::new(BTreeMap::new()),
        }
    }

    /// Executes `routed` at node `head` (its partition's head, as this node knows it).
    pub async fn execute(&self, head: u64, routed: Routed) -> Outcome {
        let (answer, rx) = oneshot::channel();
        let job = Job { routed, answer };
        let sent = {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            let queue = queues.entry(head).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(run(Arc::clone(&self.node), head, rx));
                tx
            });
            queue.send(job).is_ok()
        };
        if !sent {
            return Err(format!("no sender to node {head} (shutting down)"));
        }
        rx.await
            .unwrap_or_else(|_| Err(format!("the request to node {head} was dropped")))
    }
}

/// One peer's sender: until the [`Forwarder`] is dropped.
async fn run(node: Arc<ClusterNode>, to: u64, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut calls = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
            first = rx.recv(), if calls.len() < CALLS_IN_FLIGHT => {
                let Some(first) = first else { break };
                let mut batch = vec![first];
                while batch.len() < MAX_REQUESTS {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let Some(addr) = node.addr_of(to) else {
                    fail(batch, &format!("node {to} has no address"));
                    continue;
                };
                let (requests, answers): (Vec<Routed>, Vec<_>) =
                    batch.into_iter().map(|job| (job.routed, job.answer)).unzip();
                let frame = encode(&DataRequest::ExecuteMany(requests));
                let transport = node.transport();
                calls.spawn(async move {
                    let outcome = transport
                        .call(&addr, Request::Data(frame), STEP_TIMEOUT * 2)
                        .await;
                    deliver(to, outcome, answers);
                });
            }
        }
    }
}

/// Hands each request of a batch its outcome.
fn deliver(
    to: u64,
    outcome: Result<Response, mqstate_cluster::transport::TransportError>,
    answers: Vec<oneshot::Sender<Outcome>>,
) {
    let reason = match outcome {
        Ok(Response::Data(bytes)) => match decode::<DataResponse>(&bytes) {
            Ok(DataResponse::ExecutedMany(outcomes)) if outcomes.len() == answers.len() => {
                for (answer, outcome) in answers.into_iter().zip(outcomes) {
                    let _ = answer.send(outcome.map_err(|reason| format!("node {to}: {reason}")));
                }
                return;
            }
            Ok(DataResponse::Retry(reason)) => format!("node {to}: {reason}"),
            Ok(other) => format!("node {to} answered {other:?}"),
            Err(e) => format!("node {to} answered a frame that does not decode: {e}"),
        },
        Ok(other) => format!("node {to} answered {other:?}"),
        Err(e) => e.to_string(),
    };
    for answer in answers {
        let _ = answer.send(Err(reason.clone()));
    }
}

fn fail(batch: Vec<Job>, reason: &str) {
    for job in batch {
        let _ = job.answer.send(Err(reason.to_owned()));
    }
}
