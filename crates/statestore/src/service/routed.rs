//! Key commands of a cluster node: checked here, executed at their partition's head through the
//! [`Router`], answered through the completer (so the duplicate cache completes and the reply
//! goes out like any other). The executor does not wait: each routed request waits in its own task.

use bytes::Bytes;
use mqstate_broker::{service::Acker, Identity};
use mqstate_protocol::{Command, Reply};

use super::completer::{Outcome, Queued, ReplyTo, Timing};
use super::request::Admitted;
use super::Executor;
use crate::envelope::Request;
use crate::router::{RoutedRequest, Router};

impl Executor {
    pub(super) async fn route(
        &mut self,
        router: Router,
        request: Request,
        identity: &Identity,
        acker: Acker,
    ) {
        let started = self.clock.now();
        let reply_now = |executor: &Self, label: &'static str, payload: Bytes| Queued {
            epoch: None,
            outcome: Outcome::Reply {
                commit: None,
                notifications: Vec::new(),
                reply: Some(ReplyTo::new(
                    &executor.replies,
                    &request,
                    payload,
                    None,
                    request.expiry,
                )),
                acker: None,
                timing: Some(Timing {
                    command: label,
                    result: "error",
                    received: started,
                }),
            },
        };
        let Admitted {
            label,
            command,
            ts,
            fencing_token,
        } = match self.admit(&request, identity) {
            Ok(admitted) => admitted,
            Err((label, kind)) => {
                let queued = reply_now(self, label, Reply::Error(kind).encode());
                return self.queue_routed(queued, acker).await;
            }
        };
        let key = match command {
            Command::Get { key }
            | Command::Set { key, .. }
            | Command::Del { key }
            | Command::VDel { key, .. } => key,
            // Not replicated yet (issue 15): a clear error rather than this node's own answer.
            Command::Scan { .. } | Command::KeyNotify { .. } | Command::KeyNotifyStop { .. } => {
                let text = format!(
                    "-ERR {} is not available on a cluster node yet\r\n",
                    label.to_ascii_uppercase()
                );
                let queued = reply_now(self, label, Bytes::from(text));
                return self.queue_routed(queued, acker).await;
            }
        };
        let routed = RoutedRequest {
            client_id: request.client_id.clone(),
            correlation: request.correlation_data.clone(),
            key,
            payload: request.payload.clone(),
            ts,
            fencing_token,
            expiry: request.expiry,
        };
        let tx = self.tx.clone();
        let replies = self.replies.clone();
        let clock = self.clock.clone();
        tokio::spawn(async move {
            let reply = router.0.execute(routed).await;
            let expiry_left = request
                .expiry
                .saturating_sub(clock.now().saturating_duration_since(started));
            let result = if reply.payload.starts_with(b"-") {
                "error"
            } else {
                "ok"
            };
            let reply = ReplyTo::new(&replies, &request, reply.payload, reply.ts, expiry_left);
            let queued = Queued {
                epoch: None,
                outcome: Outcome::Reply {
                    commit: None,
                    notifications: Vec::new(),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: Some(Timing {
                        command: label,
                        result,
                        received: started,
                    }),
                },
            };
            if tx.send(queued).await.is_err() {
                tracing::error!("state store completer stopped; routed reply dropped");
            }
        });
    }

    async fn queue_routed(&mut self, mut queued: Queued, acker: Acker) {
        if let Outcome::Reply { acker: slot, .. } = &mut queued.outcome {
            *slot = Some(acker);
        }
        if self.tx.send(queued).await.is_err() {
            tracing::error!("state store completer stopped; outcome dropped");
        }
    }
}
