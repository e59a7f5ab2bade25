//! One request, from the envelope to its outcome: the envelope's checks, the duplicate cache, the
//! rate limit, key access, execution on the state machine and the append of its change.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_broker::{service::Acker, Identity, Message, Principal, ServiceRequest};
use mqstate_protocol::{parse_request, Command, ErrorKind, Reply};
use mqstate_store::{Delta, Execution, KeyNotification, RequestContext, RequestRecord};

use super::completer::{Outcome, ReplyTo, Timing, NOT_DURABLE, NOT_DURABLE_REPLY};
use super::undo::Undo;
use super::{
    notify_exec, reply_topic, Durability, Executor, FORBIDDEN_RESPONSE_TOPIC_REASON,
    PUBACK_NOT_AUTHORIZED, PUBACK_TOPIC_NAME_INVALID,
};
use crate::dedup::Seen;
use crate::envelope::{Rejection, ReplyTopic, Request};
use crate::metrics;

/// A request that passed [`Executor::admit`].
pub(super) struct Admitted {
    pub(super) label: &'static str,
    pub(super) command: Command,
    pub(super) ts: Option<mqstate_protocol::Hlc>,
    pub(super) fencing_token: Option<mqstate_protocol::Hlc>,
}

impl Executor {
    pub(super) async fn handle(&mut self, mut service_request: ServiceRequest) {
        let acker = service_request.take_ack();
        let who = Principal {
            client_id: &service_request.client_id,
            identity: &service_request.identity,
        };
        let request = match Request::from_message(
            service_request.client_id.clone(),
            &service_request.message,
            |topic| reply_topic(&self.broker, who, topic),
        ) {
            Ok(request) => request,
            Err(rejection) => {
                return self
                    .reject(&service_request.client_id, rejection, acker)
                    .await
            }
        };
        let seen = {
            let mut dedup = self.dedup.lock().unwrap_or_else(|p| p.into_inner());
            dedup.check(request.id, request.expiry, self.clock.now(), acker)
        };
        let acker = match seen {
            Seen::New(acker) => acker,
            Seen::Pending => {
                metrics::request_counted(metrics::UNPARSED, "duplicate");
                return;
            }
            Seen::Done(reply, acker) => {
                metrics::request_counted(metrics::UNPARSED, "duplicate");
                let reply = ReplyTo::new(
                    &self.replies,
                    &request,
                    reply.payload,
                    reply.version,
                    request.expiry,
                );
                // The first reply, already released: the keyspace has no say in it.
                self.send_stateless_reply(reply, acker).await;
                return;
            }
        };
        if let Some(router) = self.config.router.clone() {
            return self
                .route(router, request, &service_request.identity, acker)
                .await;
        }
        let started = self.clock.now();
        let (command, executed) = self.execute(&request, &service_request.identity).await;
        let expiry_left = request
            .expiry
            .saturating_sub(self.clock.now().saturating_duration_since(started));
        if let Some(notify_exec::PendingQueue::Full(topic)) = &self.pending_queue {
            let payload = notify_exec::queue_full_reply(topic);
            self.pending_queue = None;
            let reply = ReplyTo::new(&self.replies, &request, payload, None, expiry_left);
            return self
                .send(Outcome::Reply {
                    commit: None,
                    notifications: Vec::new(),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: Some(Timing {
                        command,
                        result: "error",
                        received: started,
                    }),
                })
                .await;
        }
        let Some((mut execution, persist)) = executed else {
            let reply = ReplyTo::new(
                &self.replies,
                &request,
                Bytes::from_static(NOT_DURABLE_REPLY),
                None,
                expiry_left,
            );
            self.send(Outcome::Reply {
                commit: None,
                notifications: Vec::new(),
                reply: Some(reply),
                acker: Some(acker),
                timing: Some(Timing {
                    command,
                    result: NOT_DURABLE,
                    received: started,
                }),
            })
            .await;
            return;
        };
        let undo = execution.undo.take();
        let payload = execution.reply.encode();
        // Logged with its change: a retry after a restart gets this reply until the request's own
        // expiry (wall time, so that it means the same to the next process).
        let identity = || RequestRecord {
            id: request.id,
            expires_at_ms: self
                .clock
                .now_ms()
                .saturating_add(u64::try_from(request.expiry.as_millis()).unwrap_or(u64::MAX)),
            reply: payload.clone(),
            reply_ts: execution.ts.clone(),
        };
        let commit = match (self.pending_queue.take(), execution.delta.as_ref(), undo) {
            (Some(pending), _, undo) => {
                let identity = identity();
                self.log_notified(pending, undo, &identity).await
            }
            (None, Some(delta), Some(undo)) if persist || matches!(delta, Delta::Delete { .. }) => {
                let identity = identity();
                let logged = self
                    .log_requested(delta.encode(), delta.version(), &identity)
                    .await;
                match &logged {
                    Ok(_) => self.log.push_undo(Undo::Key(undo)),
                    Err(_) => self.machine.apply_delta(&undo),
                }
                logged
            }
            _ => Ok(None),
        };
        let reply_to = |payload: Bytes, version| {
            ReplyTo::new(&self.replies, &request, payload, version, expiry_left)
        };
        let timing = |result| {
            Some(Timing {
                command,
                result,
                received: started,
            })
        };
        // A change was logged, hence with the request's identity.
        let logged = matches!(commit, Ok(Some(_))) && execution.delta.is_some();
        let outcome = match commit {
            Ok(commit) => {
                let mut reply = reply_to(payload, execution.ts.clone());
                reply.logged = logged;
                Outcome::Reply {
                    commit,
                    notifications: self.notifications(&execution.notifications),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: timing(match execution.reply {
                        Reply::Error(_) => "error",
                        _ => "ok",
                    }),
                }
            }
            Err(message) => {
                tracing::error!(client_id = %request.client_id, "state store write refused: {message}");
                let reply = reply_to(Bytes::from_static(NOT_DURABLE_REPLY), None);
                Outcome::Reply {
                    commit: None,
                    notifications: Vec::new(),
                    reply: Some(reply),
                    acker: Some(acker),
                    timing: timing(NOT_DURABLE),
                }
            }
        };
        self.send(outcome).await;
    }

    /// The checks every request passes before it executes, here or at its partition's head: the
    /// rate limit, the syntax, `__ts`/`__ft`, key access. `Err` is the error to answer.
    pub(super) fn admit(
        &mut self,
        request: &Request,
        identity: &Identity,
    ) -> Result<Admitted, (&'static str, ErrorKind)> {
        if !self.rates.allow(&request.client_id, self.clock.now()) {
            return Err((metrics::UNPARSED, ErrorKind::QuotaExceeded));
        }
        let parsed = parse_request(&request.payload, &self.config.request_limits)
            .map_err(|e| e.kind())
            .and_then(Command::parse);
        let label = metrics::command_label(parsed.as_ref().ok());
        let (ts, ft) = match (&request.timestamp, &request.fencing_token) {
            (Ok(ts), Ok(ft)) => (ts.clone(), ft.clone()),
            (Err(kind), _) | (_, Err(kind)) => return Err((label, *kind)),
        };
        let command = match parsed {
            Ok(command) => command,
            Err(kind) => return Err((label, kind)),
        };
        let who = Principal {
            client_id: &request.client_id,
            identity,
        };
        let keys = &self.config.key_access.0;
        let allowed = match &command {
            Command::Get { key } | Command::KeyNotify { key } | Command::KeyNotifyStop { key } => {
                keys.may_read(who, key)
            }
            Command::Set { key, .. } | Command::Del { key } | Command::VDel { key, .. } => {
                keys.may_write(who, key)
            }
            // Filtered below instead: a SCAN returns what the client may read.
            Command::Scan { .. } => true,
        };
        if !allowed {
            tracing::debug!(client_id = %request.client_id, user = ?identity.user, "state store request not authorized");
            return Err((label, ErrorKind::NotAuthorized));
        }
        Ok(Admitted {
            label,
            command,
            ts,
            fencing_token: ft,
        })
    }

    /// Executes a request; returns its metrics label and the execution (with the delta that would
    /// undo its change) and whether its change is to be logged.
    /// `None` when the command is a write and the log refuses writes.
    async fn execute(
        &mut self,
        request: &Request,
        identity: &Identity,
    ) -> (&'static str, Option<(Execution, bool)>) {
        let Admitted {
            label,
            command,
            ts,
            fencing_token: ft,
        } = match self.admit(request, identity) {
            Ok(admitted) => admitted,
            Err((label, kind)) => return (label, Some((Execution::error(kind), false))),
        };
        let now_ms = self.clock.now_ms();
        let who = Principal {
            client_id: &request.client_id,
            identity,
        };
        let keys = Arc::clone(&self.config.key_access.0);
        let is_scan = matches!(command, Command::Scan { .. });
        if written_key_of(&command).is_some() && !self.log_accepts_writes().await {
            return (label, None);
        }
        let context = RequestContext {
            client_id: request.client_id.clone(),
            ts,
            fencing_token: ft,
            now_ms,
        };
        let persist = self.config.durability == Durability::All || request.persist;
        let event = notify_exec::event_of(&command);
        let reserved = match self.reserve(written_key_of(&command), event, now_ms) {
            Ok(reserved) => reserved,
            Err(topic) => {
                self.pending_queue = Some(notify_exec::PendingQueue::Full(topic));
                return (
                    label,
                    Some((Execution::error(ErrorKind::QuotaExceeded), false)),
                );
            }
        };
        let mut execution = self.machine.execute(command, &context);
        if let Some(reserved) = reserved {
            self.pending_queue = self.settle(reserved, event, &execution);
        }
        if let (true, Reply::Keys { keys: found, .. }) = (is_scan, &mut execution.reply) {
            found.retain(|key| keys.may_read(who, key));
        }
        if execution.delta.is_some() {
            self.report_keyspace_size();
        }
        (label, Some((execution, persist)))
    }

    pub(super) fn notifications(
        &self,
        notifications: &[KeyNotification],
    ) -> Vec<(Arc<str>, Message)> {
        notifications
            .iter()
            .map(|n| {
                (
                    n.client_id.clone(),
                    self.replies
                        .notification(&n.client_id, &n.key, n.payload.encode(), &n.version),
                )
            })
            .collect()
    }

    async fn reject(&mut self, client_id: &Arc<str>, rejection: Rejection, acker: Acker) {
        match rejection {
            Rejection::NoResponseTopic => {
                metrics::request_counted(metrics::UNPARSED, "dropped");
                tracing::debug!(%client_id, "state store request without a response topic dropped");
                acker.ack(0x00);
            }
            Rejection::ForbiddenResponseTopic(topic) => {
                metrics::request_counted(metrics::UNPARSED, "forbidden");
                tracing::info!(%client_id, %topic, "disconnecting client: state store response topic is reserved");
                self.broker.disconnect(
                    client_id,
                    FORBIDDEN_RESPONSE_TOPIC_REASON,
                    Some(&format!(
                        "response topic {topic} is reserved for the state store"
                    )),
                );
            }
            Rejection::ResponseTopicRefused {
                response_topic,
                why,
            } => {
                let (result, code, reason) = match why {
                    ReplyTopic::NotAuthorized => (
                        "response_topic_not_authorized",
                        PUBACK_NOT_AUTHORIZED,
                        "the client may not publish on it itself",
                    ),
                    _ => (
                        "response_topic_invalid",
                        PUBACK_TOPIC_NAME_INVALID,
                        "it is not a valid topic name",
                    ),
                };
                metrics::request_counted(metrics::UNPARSED, result);
                tracing::info!(%client_id, topic = %response_topic, "state store request refused: the reply cannot go to its Response Topic: {reason}");
                acker.ack(code);
            }
            Rejection::UnsupportedVersion {
                response_topic,
                correlation_data,
                requested,
            } => {
                metrics::request_counted(metrics::UNPARSED, "unsupported_version");
                tracing::debug!(%client_id, %requested, "state store request with an unsupported __protVer");
                let reply = ReplyTo {
                    request: None,
                    message: self.replies.unsupported_version(
                        response_topic,
                        correlation_data,
                        requested,
                    ),
                    version: None,
                    logged: false,
                };
                self.send_stateless_reply(reply, acker).await;
            }
            Rejection::BadRequest {
                response_topic,
                correlation_data,
                message,
            } => {
                metrics::request_counted(metrics::UNPARSED, "bad_request");
                let reply =
                    self.replies
                        .bad_request(response_topic, correlation_data.clone(), message);
                // Not cached: without correlation data there is nothing to match a retry by.
                let reply = ReplyTo {
                    request: None,
                    message: reply,
                    version: None,
                    logged: false,
                };
                self.send_stateless_reply(reply, acker).await;
            }
        }
    }
}

/// The key a command writes, if it writes one.
fn written_key_of(command: &Command) -> Option<&Bytes> {
    match command {
        Command::Set { key, .. } | Command::Del { key } | Command::VDel { key, .. } => Some(key),
        _ => None,
    }
}
