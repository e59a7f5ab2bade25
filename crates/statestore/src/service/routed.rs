//! Key commands of a cluster node: checked here, executed at their partition's head through the
//! [`Router`], answered through the completer (so the duplicate cache completes and the reply
//! goes out like any other). The executor does not wait: each routed request waits in its own task,
//! after the same client's previous request for the same key ([`super::key_order`]).
//!
//! KEYNOTIFY and KEYNOTIFY STOP register here (the observer's session is here); when a key becomes
//! observed here, the reply waits until the router told the other nodes, so a write executed at
//! any head after the reply is notified — as does the reply to a registration of a key whose
//! watch another registration sent and is still on its way ([`super::watching`]) — and until the
//! client's set of keys is kept with its session (decision 0054). SCAN is checked here by this node's own state machine
//! (which holds no keys: only the pattern's checks apply) and assembled over every partition.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use mqstate_broker::{service::Acker, Identity, Principal};
use mqstate_protocol::{Command, Hlc, Reply};
use mqstate_store::RequestContext;

use super::completer::{Outcome, Queued, ReplyTo, Timing};
use super::request::Admitted;
use super::Executor;
use crate::envelope::Request;
use crate::router::{RoutedRequest, Router, ScanRequest};

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
            Command::Get { ref key }
            | Command::Set { ref key, .. }
            | Command::Del { ref key }
            | Command::VDel { ref key, .. } => key.clone(),
            Command::KeyNotify { ref key } | Command::KeyNotifyStop { ref key } => {
                let key = key.clone();
                let was_observed = self.machine.is_observed(&key);
                let before = self.machine.registered_keys(&request.client_id);
                let context = RequestContext {
                    client_id: request.client_id.clone(),
                    ts,
                    fencing_token,
                    now_ms: self.clock.now_ms(),
                };
                let execution = self.machine.execute(command, &context);
                let payload = execution.reply.encode();
                let observed = self.machine.is_observed(&key);
                let after = self.machine.registered_keys(&request.client_id);
                // The client's whole set, kept with its session (if persistent) before the reply.
                let keep = (after != before).then_some(after);
                if was_observed && !observed {
                    let (router, key) = (router.clone(), key.clone());
                    tokio::spawn(async move { router.0.watch(key, false).await });
                }
                // Newly observed here: this request tells the other nodes. Observed already by
                // a registration whose watch is still on its way: that watch is awaited too.
                let announcing =
                    (observed && !was_observed).then(|| self.watching.begin(key.clone()));
                let on_its_way = if observed && announcing.is_none() {
                    self.watching.on_its_way(&key)
                } else {
                    None
                };
                if announcing.is_some() || on_its_way.is_some() || keep.is_some() {
                    // Answered once the nodes that may execute its writes know of it, and the
                    // registration is kept with the client's session.
                    let client_id = request.client_id.clone();
                    return self.reply_later(request, label, started, acker, async move {
                        if let Some(announcing) = announcing {
                            announcing.send(&router).await;
                        }
                        if let Some(on_its_way) = on_its_way {
                            super::watching::in_force(on_its_way).await;
                        }
                        if let Some(keys) = keep {
                            if let Err(e) = router.0.keep_observed(&client_id, keys).await {
                                // In force on this node; lost if the node dies before a later
                                // registration of the client is kept.
                                tracing::warn!(%client_id, "KEYNOTIFY registrations not kept with the session: {e}");
                            }
                        }
                        (payload, None)
                    });
                }
                let mut queued = reply_now(self, label, payload);
                if let Outcome::Reply {
                    timing: Some(t), ..
                } = &mut queued.outcome
                {
                    t.result = result_of(&execution.reply);
                }
                return self.queue_routed(queued, acker).await;
            }
            Command::Scan {
                pattern,
                continuation,
            } => {
                // The checks of the pattern (length, syntax), by the store's own SCAN on this
                // node's machine, which holds no keys.
                let context = RequestContext {
                    client_id: request.client_id.clone(),
                    ts,
                    fencing_token,
                    now_ms: self.clock.now_ms(),
                };
                let check = Command::Scan {
                    pattern: pattern.clone(),
                    continuation: continuation.clone(),
                };
                let checked = self.machine.execute(check, &context);
                if let Reply::Error(_) = checked.reply {
                    let queued = reply_now(self, label, checked.reply.encode());
                    return self.queue_routed(queued, acker).await;
                }
                let scan = ScanRequest {
                    pattern,
                    continuation,
                    expiry: request.expiry,
                };
                let keys = Arc::clone(&self.config.key_access.0);
                let identity = identity.clone();
                let client_id = request.client_id.clone();
                return self.reply_later(request, label, started, acker, async move {
                    let reply = match router.0.scan(scan).await {
                        Ok((mut found, continuation)) => {
                            let who = Principal {
                                client_id: &client_id,
                                identity: &identity,
                            };
                            found.retain(|key| keys.may_read(who, key));
                            Reply::Keys {
                                keys: found,
                                continuation,
                            }
                            .encode()
                        }
                        Err(reason) => Bytes::from(format!(
                            "-ERR the cluster could not serve the request in time ({reason}); retry\r\n"
                        )),
                    };
                    (reply, None)
                });
            }
        };
        let mut turn = self.key_order.turn(&request.client_id, &key);
        let routed = RoutedRequest {
            client_id: request.client_id.clone(),
            id: request.id,
            correlation: request.correlation_data.clone(),
            key,
            payload: request.payload.clone(),
            command,
            ts,
            fencing_token,
            expiry: request.expiry,
        };
        self.reply_later(request, label, started, acker, async move {
            // After the client's previous request for the key (a pipelined SET then GET).
            turn.wait().await;
            let reply = router.0.execute(routed).await;
            drop(turn);
            (reply.payload, reply.ts)
        });
    }

    /// Answers `request` with what `reply` resolves to, from a task of its own, through the
    /// completer.
    fn reply_later(
        &mut self,
        request: crate::envelope::Request,
        label: &'static str,
        started: std::time::Instant,
        acker: Acker,
        reply: impl Future<Output = (Bytes, Option<Hlc>)> + Send + 'static,
    ) {
        let tx = self.tx.clone();
        let replies = self.replies.clone();
        let clock = self.clock.clone();
        tokio::spawn(async move {
            let (payload, ts) = reply.await;
            let expiry_left = request
                .expiry
                .saturating_sub(clock.now().saturating_duration_since(started));
            let result = if payload.starts_with(b"-") {
                "error"
            } else {
                "ok"
            };
            let reply = ReplyTo::new(&replies, &request, payload, ts, expiry_left);
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

fn result_of(reply: &Reply) -> &'static str {
    match reply {
        Reply::Error(_) => "error",
        _ => "ok",
    }
}
