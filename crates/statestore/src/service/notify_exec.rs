//! The executor's side of persistent notifications: reserve before a write executes, commit or abort
//! after, log both records in order (with a crash point between them), abort stale reservations,
//! and answer the queue owner ([`Internal`]) and the admin RPC ([`AdminRequest`]).

use std::sync::Arc;

use bytes::Bytes;
use mqstate_broker::{
    Broker, Message, Principal, PublishProperties, QoS, ServiceInbox, ServiceRequest,
};
use mqstate_protocol::{Command, SetCondition};
use mqstate_store::notify::{lock_key, Event, QueueDelta, QueueUndo, RemoveError, Topic};
use mqstate_store::{Delta, Execution, RequestContext, RequestRecord};
use mqstate_wal::Commit;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Notify};

use super::completer::{Outcome, ReplyTo};
use super::undo::Undo;
use super::Executor;
use crate::envelope::ReplyTopic;
use crate::metrics;
use crate::notify::admin::{def_json, error_json, AdminRequest};
use crate::notify::owner::{self, OwnerPort};
use crate::notify::{DeliveryStats, Internal, LockState, NotifyConfig, ADMIN_TOPIC};

/// Crash point: the slot is reserved and the write executed, in memory; its commit record is not
/// logged yet.
pub const NOTIFY_AFTER_RESERVE: &str = "notify-after-reserve";
/// Client id of the service's own writes (lock keys) in request contexts.
const OWNER_CLIENT_ID: &str = "$mqstate-notify";
/// Requests from the owner waiting for the executor.
const INTERNAL_QUEUE: usize = 256;

/// What the executor holds for notifications.
pub(super) struct NotifySide {
    config: NotifyConfig,
    inboxes: Option<(mpsc::Receiver<Internal>, ServiceInbox)>,
    wake_owner: Arc<Notify>,
    queued: watch::Sender<u64>,
    stats: Arc<DeliveryStats>,
}

/// Claims the admin topic and starts the owner; `None` when notifications are off or the topic
/// cannot be claimed (logged).
pub(super) fn start(broker: &Broker, config: Option<NotifyConfig>) -> Option<NotifySide> {
    let config = config?;
    let admin = match broker.claim_topic(ADMIN_TOPIC) {
        Ok(inbox) => inbox,
        Err(e) => {
            tracing::error!("persistent notifications disabled: cannot claim {ADMIN_TOPIC}: {e}");
            return None;
        }
    };
    let (requests, internal) = mpsc::channel(INTERNAL_QUEUE);
    let wake_owner = Arc::new(Notify::new());
    let (queued, queued_rx) = watch::channel(0u64);
    let stats = Arc::new(DeliveryStats::default());
    tokio::spawn(owner::run(
        config.clone(),
        OwnerPort {
            requests,
            wake: Arc::clone(&wake_owner),
            queued: queued_rx,
            stats: Arc::clone(&stats),
            clock: broker.clock().clone(),
            acquisitions: std::sync::atomic::AtomicU64::new(0),
        },
    ));
    Some(NotifySide {
        config,
        inboxes: Some((internal, admin)),
        wake_owner,
        queued,
        stats,
    })
}

/// The queue side of one write.
pub(super) enum PendingQueue {
    /// The reservation failed: the write is refused and changes nothing.
    Full(String),
    /// The write happened: its commit record (the key change and its notifications) to log.
    Committed(Box<Committed>),
}

pub(super) struct Committed {
    /// Releases the reservation, which is in memory only: the commit record carries it.
    reserve_undo: QueueUndo,
    commit: (QueueDelta, QueueUndo),
}

/// The event of a write command.
pub(super) fn event_of(command: &Command) -> Option<Event> {
    match command {
        Command::Set { .. } => Some(Event::Set),
        Command::Del { .. } | Command::VDel { .. } => Some(Event::Delete),
        _ => None,
    }
}

/// The reply to a write refused because `topic`'s queue is full.
pub(super) fn queue_full_reply(topic: &str) -> Bytes {
    Bytes::from(format!("-ERR notification queue full: {topic}\r\n"))
}

fn age_ms(topic: &Topic, now_ms: u64) -> u64 {
    topic
        .entries()
        .front()
        .map_or(0, |e| now_ms.saturating_sub(e.version.wall_ms))
}

impl Executor {
    pub(super) fn notify_inboxes(
        &mut self,
    ) -> (Option<mpsc::Receiver<Internal>>, Option<ServiceInbox>) {
        match self.notify.as_mut().and_then(|n| n.inboxes.take()) {
            Some((internal, admin)) => (Some(internal), Some(admin)),
            None => (None, None),
        }
    }

    pub(super) fn stale_reservation_deadline(&self) -> Option<tokio::time::Instant> {
        let ms = self.machine.topics().next_reservation_deadline()?;
        let wait = std::time::Duration::from_millis(ms.saturating_sub(self.clock.now_ms()));
        Some(self.clock.tokio_now() + wait)
    }

    /// Reserves a slot in each matching queue before the write executes.
    pub(super) fn reserve(
        &mut self,
        key: Option<&Bytes>,
        event: Option<Event>,
        now_ms: u64,
    ) -> Result<Option<(QueueDelta, QueueUndo)>, String> {
        let (Some(notify), Some(key), Some(event)) = (&self.notify, key, event) else {
            return Ok(None);
        };
        let timeout_ms =
            u64::try_from(notify.config.reservation_timeout.as_millis()).unwrap_or(u64::MAX);
        self.machine
            .reserve(key, event, now_ms.saturating_add(timeout_ms))
    }

    /// Commits the reservation if the write changed the key; otherwise releases it (nothing is
    /// logged for it) and there is nothing to log.
    pub(super) fn settle(
        &mut self,
        reserve: (QueueDelta, QueueUndo),
        event: Option<Event>,
        execution: &Execution,
    ) -> Option<PendingQueue> {
        match (&execution.delta, event) {
            (Some(change), Some(event)) => {
                let commit = self.machine.commit_reserved(change, event, &reserve.0);
                Some(PendingQueue::Committed(Box::new(Committed {
                    reserve_undo: reserve.1,
                    commit,
                })))
            }
            _ => {
                self.machine.undo_queue(reserve.1);
                None
            }
        }
    }

    /// Logs the commit record, with the identity of the request that made it: one record for
    /// the reservation, the key change and its notifications (decision 0038). Until it is logged
    /// the reservation holds the slot in memory only; what is not logged is undone in memory.
    pub(super) async fn log_notified(
        &mut self,
        pending: PendingQueue,
        key_undo: Option<Delta>,
        request: &RequestRecord,
    ) -> Result<Option<Commit>, String> {
        let PendingQueue::Committed(committed) = pending else {
            return Ok(None);
        };
        let Committed {
            reserve_undo,
            commit: (record, commit_undo),
        } = *committed;
        if self.config.failpoints.is_armed() {
            // Reserved and written in memory, nothing logged yet.
            self.config.failpoints.hit(NOTIFY_AFTER_RESERVE);
        }
        let reserved = match reserve_undo {
            QueueUndo::Unreserve(reserved) => reserved,
            other => {
                debug_assert!(false, "a reservation's undo is an Unreserve, not {other:?}");
                Vec::new()
            }
        };
        let undo = Undo::Notified {
            key: key_undo,
            commit: commit_undo,
            reserved,
        };
        let QueueDelta::Commit { change, .. } = &record else {
            debug_assert!(false, "a notified write logs a commit, not {record:?}");
            self.apply_undo(undo);
            return Err("a notified write's record is not a commit".to_owned());
        };
        match self
            .log_requested(record.encode(), change.version(), request)
            .await
        {
            Ok(commit) => {
                self.log.push_undo(undo);
                self.notify_queued();
                Ok(commit)
            }
            Err(e) => {
                tracing::error!("notification commit not logged: {e}");
                self.apply_undo(undo);
                Err(e)
            }
        }
    }

    pub(super) fn count_dropped(&self, topics: &[String]) {
        for topic in topics {
            tracing::warn!(%topic, "expiry not queued: the notification queue is full");
            metrics::notification_dropped(topic);
        }
    }

    /// Wakes the pushers: entries were queued.
    pub(super) fn notify_queued(&self) {
        if let Some(notify) = &self.notify {
            notify.queued.send_modify(|n| *n += 1);
        }
    }

    /// Sets every topic's gauges (queue depth, reserved, bytes, oldest entry age): called once a
    /// second, so the metrics endpoint shows queues nobody asked `topic stats` about.
    pub(super) fn report_queues(&self) {
        if self.notify.is_none() {
            return;
        }
        let now_ms = self.clock.now_ms();
        for topic in self.machine.topics().iter() {
            metrics::notification_queue(
                &topic.def.name,
                topic.entries().len(),
                topic.reserved(),
                topic.bytes(),
                age_ms(topic, now_ms),
            );
        }
    }

    pub(super) async fn abort_stale_reservations(&mut self) {
        let Some((abort, undo)) = self.machine.abort_stale_reservations(self.clock.now_ms()) else {
            return;
        };
        tracing::warn!(?abort, "stale notification reservations aborted");
        match self.log_queue(&abort).await {
            Ok(commit) => {
                self.log.push_undo(Undo::Queue(undo));
                self.send(Outcome::Internal {
                    commit,
                    done: Box::new(|_| {}),
                })
                .await;
            }
            Err(e) => {
                self.machine.undo_queue(undo);
                tracing::error!("stale reservations not aborted: {e}");
            }
        }
    }

    /// Logs a queue change made by `apply` (which returns it with its undo) and answers `done`
    /// once it is durable.
    async fn log_and_then(
        &mut self,
        change: (QueueDelta, QueueUndo),
        done: impl FnOnce(bool) + Send + 'static,
    ) {
        let (delta, undo) = change;
        match self.log_queue(&delta).await {
            Ok(commit) => {
                self.log.push_undo(Undo::Queue(undo));
                self.send(Outcome::Internal {
                    commit,
                    done: Box::new(done),
                })
                .await;
            }
            Err(e) => {
                self.machine.undo_queue(undo);
                tracing::error!("notification queue change not logged: {e}");
                done(false);
            }
        }
    }

    /// A SET of a lock key by the service itself; returns the execution and its commit.
    async fn write_lock(
        &mut self,
        key: Bytes,
        holder: Bytes,
        condition: SetCondition,
        expiry_ms: u64,
    ) -> Option<(Execution, Option<Commit>)> {
        if !self.log_accepts_writes().await {
            return None;
        }
        let context = RequestContext {
            client_id: Arc::from(OWNER_CLIENT_ID),
            ts: Some(self.machine.clock().high_water()),
            fencing_token: None,
            now_ms: self.clock.now_ms(),
        };
        let mut execution = self.machine.execute(
            Command::Set {
                key,
                value: holder,
                condition,
                expiry_ms: Some(expiry_ms),
            },
            &context,
        );
        let commit = match (&execution.delta, execution.undo.take()) {
            (Some(delta), Some(undo)) => match self.log(delta).await {
                Ok(commit) => {
                    self.log.push_undo(Undo::Key(undo));
                    commit
                }
                Err(e) => {
                    self.machine.apply_delta(&undo);
                    tracing::error!("notification lock not logged: {e}");
                    return None;
                }
            },
            _ => None,
        };
        Some((execution, commit))
    }

    pub(super) async fn handle_internal(&mut self, request: Internal) {
        let now_ms = self.clock.now_ms();
        match request {
            Internal::Topics { reply } => {
                let topics = self
                    .machine
                    .topics()
                    .iter()
                    .map(|t| t.def.clone())
                    .collect();
                let _ = reply.send(topics);
            }
            Internal::List { topic, max, reply } => {
                let entries = self.machine.topics().get(&topic).map(|t| t.list(0, max));
                self.send(Outcome::Internal {
                    commit: None,
                    // Listed behind a write whose commit failed, the entries may include ones that
                    // are rolled back: none are pushed this time, the owner lists again.
                    done: Box::new(move |current| {
                        let _ = reply.send(entries.map(|e| if current { e } else { Vec::new() }));
                    }),
                })
                .await;
            }
            Internal::Remove {
                topic,
                up_to_seq,
                holder,
                token,
                reply,
            } => {
                match self
                    .machine
                    .remove_acknowledged(&topic, up_to_seq, &holder, &token, now_ms)
                {
                    Ok(change) => {
                        self.log_and_then(change, move |durable| {
                            let _ = reply.send(if durable {
                                Ok(())
                            } else {
                                Err(RemoveError::Fenced)
                            });
                        })
                        .await
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Internal::Lock {
                topic,
                current,
                fresh,
                reply,
            } => self.lock(topic, current, fresh, reply, now_ms).await,
        }
    }

    /// Renews the caller's lock, takes a free one or this node's previous incarnation's (a restart
    /// after a crash), and leaves one another node holds.
    async fn lock(
        &mut self,
        topic: String,
        current: Option<Bytes>,
        fresh: Bytes,
        reply: tokio::sync::oneshot::Sender<LockState>,
        now_ms: u64,
    ) {
        let Some(notify) = &self.notify else { return };
        let expiry_ms = u64::try_from(notify.config.lock_expiry.as_millis()).unwrap_or(u64::MAX);
        let own_prefix = format!("{}/", notify.config.node_id);
        let key = lock_key(&topic);
        let held = self
            .machine
            .keyspace()
            .get_live(&key, now_ms)
            .map(|e| (Bytes::copy_from_slice(e.value()), e.expires_at_ms()));
        let (holder, condition) = match held {
            None => (fresh, SetCondition::NotExistsOrEqual),
            Some((value, _)) if current.as_ref() == Some(&value) => {
                (value, SetCondition::NotExistsOrEqual)
            }
            Some((value, _)) if value.starts_with(own_prefix.as_bytes()) => {
                (fresh, SetCondition::Always)
            }
            Some((value, expires_at_ms)) => {
                let _ = reply.send(LockState {
                    holder: Some(value),
                    token: None,
                    expires_at_ms,
                });
                return;
            }
        };
        let Some((execution, commit)) = self
            .write_lock(key, holder.clone(), condition, expiry_ms)
            .await
        else {
            let _ = reply.send(LockState {
                holder: None,
                token: None,
                expires_at_ms: None,
            });
            return;
        };
        let token = execution.delta.as_ref().map(|d| d.version().clone());
        let state = LockState {
            holder: Some(holder),
            token,
            expires_at_ms: Some(now_ms.saturating_add(expiry_ms)),
        };
        self.send(Outcome::Internal {
            commit,
            done: Box::new(move |durable| {
                let _ = reply.send(if durable {
                    state
                } else {
                    LockState {
                        holder: None,
                        token: None,
                        expires_at_ms: None,
                    }
                });
            }),
        })
        .await;
    }

    pub(super) async fn handle_admin(&mut self, mut request: ServiceRequest) {
        let acker = request.take_ack();
        let properties = &request.message.properties;
        let Some(response_topic) = properties.response_topic.clone() else {
            tracing::debug!(client_id = %request.client_id, "notification admin request without a response topic dropped");
            return acker.ack(0x00);
        };
        if mqstate_protocol::topic::is_reserved_for_service(&response_topic) {
            // Replies there would pass for the state store's own messages.
            tracing::info!(client_id = %request.client_id, %response_topic, "notification admin request refused: the response topic is reserved for the state store");
            return acker.ack(super::FORBIDDEN_RESPONSE_TOPIC_REASON);
        }
        // The same rule as for state-store replies: an admin reply goes only where the requester
        // could publish itself, so the admin topic cannot be used to publish in our name.
        let who = Principal {
            client_id: &request.client_id,
            identity: &request.identity,
        };
        match super::reply_topic(&self.broker, who, &response_topic) {
            ReplyTopic::Allowed => {}
            ReplyTopic::Invalid => return acker.ack(super::PUBACK_TOPIC_NAME_INVALID),
            ReplyTopic::NotAuthorized => {
                tracing::info!(client_id = %request.client_id, %response_topic, "notification admin request refused: the reply cannot go to its Response Topic");
                return acker.ack(super::PUBACK_NOT_AUTHORIZED);
            }
        }
        let correlation = properties.correlation_data.clone().unwrap_or_default();
        let reply_to = move |value: Value| ReplyTo {
            request: None,
            message: Message {
                topic: response_topic,
                payload: Bytes::from(value.to_string()),
                qos: QoS::AtLeastOnce,
                retain: false,
                properties: PublishProperties {
                    payload_is_utf8: true,
                    content_type: Some("application/json".into()),
                    correlation_data: Some(correlation),
                    ..PublishProperties::default()
                },
            },
            version: None,
            logged: false,
        };
        let parsed = AdminRequest::parse(&request.message.payload);
        let (commit, value) = match parsed {
            Err(e) => (None, error_json(&e)),
            // The keys of a cluster node live on chains, which neither reserve nor commit
            // notifications yet (issue 15): a topic created here would never see a change.
            Ok(_) if self.config.router.is_some() => (
                None,
                error_json("notification topics are not available on a cluster node yet"),
            ),
            Ok(request) => self.admin(request).await,
        };
        self.send(Outcome::Reply {
            commit,
            notifications: Vec::new(),
            reply: Some(reply_to(value)),
            acker: Some(acker),
            timing: None,
        })
        .await;
    }

    async fn admin(&mut self, request: AdminRequest) -> (Option<Commit>, Value) {
        let not_found = |name: &str| error_json(&format!("no topic named {name:?}"));
        match request {
            AdminRequest::List => {
                let topics: Vec<Value> = self
                    .machine
                    .topics()
                    .iter()
                    .map(|t| def_json(&t.def))
                    .collect();
                (None, json!({ "topics": topics }))
            }
            AdminRequest::Get(name) => match self.machine.topics().get(&name) {
                Some(topic) => (None, def_json(&topic.def)),
                None => (None, not_found(&name)),
            },
            AdminRequest::Stats(name) => match self.topic_stats(&name) {
                Some(stats) => (None, stats),
                None => (None, not_found(&name)),
            },
            AdminRequest::Create(def) => {
                if !self.log_accepts_writes().await {
                    return (None, error_json("the log refuses writes; retry later"));
                }
                let json = def_json(&def);
                let (delta, undo) = self.machine.define_topic(def);
                match self.log_queue(&delta).await {
                    Ok(commit) => {
                        self.log.push_undo(Undo::Queue(undo));
                        if let Some(notify) = &self.notify {
                            // A new topic gets its owner at once, not at the next walk.
                            notify.wake_owner.notify_one();
                        }
                        (commit, json)
                    }
                    Err(e) => {
                        self.machine.undo_queue(undo);
                        (None, error_json(&format!("topic not created: {e}")))
                    }
                }
            }
            AdminRequest::Remove(name) => {
                if !self.log_accepts_writes().await {
                    return (None, error_json("the log refuses writes; retry later"));
                }
                let Some((delta, undo)) = self.machine.delete_topic(&name) else {
                    return (None, not_found(&name));
                };
                match self.log_queue(&delta).await {
                    Ok(commit) => {
                        self.log.push_undo(Undo::Queue(undo));
                        if let Some(notify) = &self.notify {
                            notify.wake_owner.notify_one();
                        }
                        // The gauges of a deleted queue would otherwise keep its last depth.
                        metrics::notification_queue(&name, 0, 0, 0, 0);
                        (commit, json!({ "deleted": name }))
                    }
                    Err(e) => {
                        self.machine.undo_queue(undo);
                        (None, error_json(&format!("topic not deleted: {e}")))
                    }
                }
            }
        }
    }

    fn topic_stats(&self, name: &str) -> Option<Value> {
        let topic = self.machine.topics().get(name)?;
        let now_ms = self.clock.now_ms();
        let lock = self.machine.keyspace().get_live(&lock_key(name), now_ms);
        let delivery = self
            .notify
            .as_ref()
            .map(|n| n.stats.get(name))
            .unwrap_or_default();
        let oldest_age_ms = age_ms(topic, now_ms);
        metrics::notification_queue(
            name,
            topic.entries().len(),
            topic.reserved(),
            topic.bytes(),
            oldest_age_ms,
        );
        let owner = lock.map(|l| String::from_utf8_lossy(l.value()).into_owned());
        Some(json!({
            "name": name,
            "entries": topic.entries().len(),
            "reserved": topic.reserved(),
            "bytes": topic.bytes(),
            "max_queue": topic.def.max_queue,
            "oldest_age_ms": oldest_age_ms,
            "next_seq": topic.next_seq(),
            "owner": owner.as_deref().and_then(|o| o.split_once('/')).map(|(node, _)| node),
            "lock": {
                "name": String::from_utf8_lossy(&lock_key(name)),
                "holder": owner,
                "cookie": owner.as_deref().and_then(|o| o.split_once('/')).map(|(_, cookie)| cookie),
                "token": lock.map(|l| l.version().to_string()),
            },
            "lock_expires": lock.and_then(|l| l.expires_at_ms()),
            "delivered": delivery.delivered,
            "retried": delivery.retried,
            "failed_pushes": delivery.failed_pushes,
            "fenced_removals": delivery.fenced,
            "last_error": delivery.last_error,
        }))
    }
}
