//! The completer: takes the executor's outcomes in order, settles each one's commit and only then
//! releases the notifications, the reply and the PUBACK; an outcome computed on state that is being
//! rolled back gets the not-durable reply instead ([`Rollbacks`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use mqstate_broker::{service::Acker, Broker, Message};
use mqstate_protocol::Hlc;
use mqstate_store::RequestId;
use mqstate_wal::{Commit, Settler};
use tokio::sync::mpsc;

use super::snapshot_schedule::{self, PendingSnapshot};
use super::PUBACK_UNSPECIFIED_ERROR;
use crate::dedup::{CachedReply, DedupCache};
use crate::envelope::{ReplyBuilder, Request};
use crate::metrics;

/// `result` label of a write that could not be made durable.
pub(super) const NOT_DURABLE: &str = "not_durable";

/// One unit of work for the completer, in execution order.
// `Reply` is the per-request variant and `Snapshot` the rare one: boxing `Reply` to shrink the enum would
// cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Outcome {
    /// Publish `notifications` then `reply`, then ack — once `commit` (if any) is durable and no
    /// commit queued before it in its epoch failed; otherwise the not-durable reply, without the
    /// notifications ([`Rollbacks`]).
    Reply {
        commit: Option<Commit>,
        notifications: Vec<(Arc<str>, Message)>,
        reply: Option<ReplyTo>,
        acker: Option<Acker>,
        /// For the request metrics; `None` for expiries and cached replies.
        timing: Option<Timing>,
    },
    /// Call `done` once `commit` (if any) is durable (`true`) or failed (`false`); `false` too when
    /// the outcome was computed on state being rolled back ([`Rollbacks`]).
    Internal {
        commit: Option<Commit>,
        done: Box<dyn FnOnce(bool) + Send>,
    },
    /// Everything before this is durable once it is reached: complete the snapshot's file.
    Snapshot(PendingSnapshot),
}

/// An outcome on its way to the completer, with the rollback epoch it was computed in.
pub(super) struct Queued {
    /// How many rollbacks the executor had made when it computed the outcome; `None` for outcomes
    /// that do not depend on the keyspace (a cached reply, a rejected envelope).
    pub(super) epoch: Option<u64>,
    pub(super) outcome: Outcome,
}

/// The completer's view of failed commits: which outcomes were computed on state that is being
/// rolled back.
///
/// A commit that fails in epoch `e` means every change the executor made after it in epoch `e` is
/// undone (the writer refuses every record queued behind a failed one, and the executor rolls back
/// all undurable writes, then counts epoch `e + 1`). An outcome of epoch `e` queued behind the
/// failed commit may have read those changes — a GET of the refused SET's value, a VDEL that found
/// the key another refused VDEL had deleted — so it is not released: it becomes the not-durable
/// error, like the failed write itself (decision 0012).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rollbacks {
    /// The newest epoch in which a commit failed.
    failed_in: Option<u64>,
}

impl Rollbacks {
    /// A commit computed in `epoch` failed.
    pub fn commit_failed(&mut self, epoch: Option<u64>) {
        debug_assert!(
            epoch.is_some(),
            "only outcomes computed on the state commit"
        );
        self.failed_in = self.failed_in.max(epoch);
    }

    /// Whether an outcome computed in `epoch`, reached after every earlier one, may have seen a
    /// change that is rolled back. Epochs only grow along the queue, so an outcome of an epoch in
    /// which a commit already failed was computed after that commit, before the rollback.
    pub fn is_stale(&self, epoch: Option<u64>) -> bool {
        matches!((epoch, self.failed_in), (Some(e), Some(f)) if e <= f)
    }
}

/// What the completer needs to count a request once its outcome is known.
pub(super) struct Timing {
    pub(super) command: &'static str,
    /// `ok`, `error` or `not_durable`; a failed commit turns it into `not_durable`.
    pub(super) result: &'static str,
    pub(super) received: Instant,
}

pub(super) struct ReplyTo {
    /// The request in the duplicate-request cache (`None`: never looked up there, e.g. a refused
    /// envelope or an admin request).
    pub(super) request: Option<RequestId>,
    pub(super) message: Message,
    /// The `__ts` of `message`, for the duplicate-request cache.
    pub(super) version: Option<Hlc>,
    /// The request's change was logged with its identity ([`mqstate_store::RequestRecord`]): once
    /// durable, a snapshot keeps the identity for the duplicate cache of a restarted node.
    pub(super) logged: bool,
}

impl ReplyTo {
    /// The reply to `request` with `payload` and `__ts` `version`.
    pub(super) fn new(
        replies: &ReplyBuilder,
        request: &Request,
        payload: Bytes,
        version: Option<Hlc>,
        expiry: Duration,
    ) -> ReplyTo {
        ReplyTo {
            request: Some(request.id),
            message: replies.reply(request, payload, version.as_ref(), expiry),
            version,
            logged: false,
        }
    }
}

/// Reply to a write that could not be logged (disk full, I/O error). Not one of the spec's texts: the
/// spec has none for this, and clients surface any `-ERR` text to the application.
pub const NOT_DURABLE_REPLY: &[u8] =
    b"-ERR the write could not be made durable on the server's disk; retry later\r\n";

/// The reply a write gets instead of `reply` when its log record did not become durable: same
/// envelope, the error payload, and no `__ts` (no version was stored).
fn not_durable(mut reply: Message) -> Message {
    reply.payload = Bytes::from_static(NOT_DURABLE_REPLY);
    reply
        .properties
        .user_properties
        .retain(|(name, _)| name != crate::envelope::prop::TIMESTAMP);
    reply
}

/// Awaits a commit. On failure the settler reports it to the executor, which rolls back; returns
/// the epoch the failed write was computed in.
async fn settle(commit: Option<Commit>, settler: &Settler) -> Result<(), Option<u64>> {
    let Some(commit) = commit else {
        return Ok(());
    };
    let durable_before = settler.durable().get();
    match settler.settle(commit).await {
        Ok(lsn) => {
            debug_assert!(lsn >= durable_before, "commits complete in LSN order");
            Ok(())
        }
        Err(failed) => {
            tracing::error!("state store write not durable: {}", failed.error);
            Err(Some(failed.epoch))
        }
    }
}

pub(super) async fn complete(
    broker: Broker,
    mut rx: mpsc::Receiver<Queued>,
    dedup: Arc<Mutex<DedupCache<Acker>>>,
    settler: Settler,
) {
    let mut rollbacks = Rollbacks::default();
    let mut completed = metrics::Completed::default();
    while let Some(Queued { epoch, outcome }) = rx.recv().await {
        match outcome {
            Outcome::Snapshot(pending) => snapshot_schedule::write_when_durable(
                pending,
                settler.durable().get(),
                &dedup,
                broker.clock(),
            ),
            Outcome::Internal { commit, done } => {
                let settled = settle(commit, &settler).await;
                if let Err(failed_in) = settled {
                    rollbacks.commit_failed(failed_in);
                }
                done(settled.is_ok() && !rollbacks.is_stale(epoch));
            }
            Outcome::Reply {
                commit,
                notifications,
                reply,
                acker,
                timing,
            } => {
                let settled = settle(commit, &settler).await;
                if let Err(failed_in) = settled {
                    rollbacks.commit_failed(failed_in);
                }
                // A failed write, or anything computed on its rolled-back state: the error reply.
                let released = settled.is_ok() && !rollbacks.is_stale(epoch);
                let (reply, reason) = if released {
                    for (client_id, message) in notifications {
                        broker.deliver_to(&client_id, message);
                    }
                    let sent = reply.map(|r| (r.request, r.message, r.version, r.logged));
                    (sent, 0x00)
                } else {
                    // Not logged after all: a retry after a restart executes again.
                    match reply.map(|r| {
                        let message = not_durable(r.message);
                        (r.request, message, None, false)
                    }) {
                        Some(failed) => (Some(failed), 0x00),
                        None => (None, PUBACK_UNSPECIFIED_ERROR),
                    }
                };
                if let Some((request, message, version, logged)) = reply {
                    let waiting = match request {
                        Some(request) => {
                            let cached = CachedReply {
                                payload: message.payload.clone(),
                                version,
                            };
                            dedup
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .complete(request, cached, logged)
                        }
                        None => Vec::new(),
                    };
                    broker.publish(message);
                    for retry in waiting {
                        retry.ack(reason);
                    }
                }
                if let Some(acker) = acker {
                    acker.ack(reason);
                }
                if let Some(timing) = timing {
                    let result = if released { timing.result } else { NOT_DURABLE };
                    completed.record(timing.command, result, timing.received.elapsed());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rollbacks;

    #[test]
    fn outcomes_of_an_epoch_with_a_failed_commit_are_stale() {
        let mut rollbacks = Rollbacks::default();
        assert!(!rollbacks.is_stale(Some(0)), "nothing failed yet");
        rollbacks.commit_failed(Some(0));
        assert!(rollbacks.is_stale(Some(0)), "computed before the rollback");
        assert!(!rollbacks.is_stale(Some(1)), "computed after the rollback");
        assert!(!rollbacks.is_stale(None), "independent of the state");
        // Later failures of the same epoch (every commit behind the first fails) change nothing.
        rollbacks.commit_failed(Some(0));
        assert!(!rollbacks.is_stale(Some(1)));
        rollbacks.commit_failed(Some(1));
        assert!(rollbacks.is_stale(Some(1)));
        assert!(!rollbacks.is_stale(Some(2)));
    }
}
