//! Reading a journal back: [`Restored`] applies changes in log order (snapshot image first, then
//! the records after it) and ends up with what the broker had. Every change is an assignment, so a
//! change applied twice (once in the image, once from the log) does no harm.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytestring::ByteString;

use super::{SessionChange, StoredMessage};
use crate::message::Message;
use crate::peers::PublishId;
use crate::session::SubscriptionOptions;
use crate::will::Will;

/// Durable sessions and retained messages as the journal describes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    pub sessions: BTreeMap<Arc<str>, StoredSession>,
    /// Retained message and when it was received (wall-clock ms), by topic.
    pub retained: BTreeMap<ByteString, (Arc<Message>, u64)>,
    /// When each topic's retained message was last cleared (wall-clock ms), where the journal
    /// remembers it (a cluster node's, decision 0063); a later retained message replaces it.
    pub retained_clears: BTreeMap<ByteString, u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredSession {
    pub expiry_secs: u32,
    /// When the connection ended (wall-clock ms); `None` if it was connected when the log ended.
    pub detached_at_ms: Option<u64>,
    pub subscriptions: BTreeMap<ByteString, SubscriptionOptions>,
    /// QoS 1/2 messages by sequence number (queue order).
    pub messages: BTreeMap<u64, StoredEntry>,
    /// Delayed will and when it is due (wall-clock ms).
    pub will: Option<(Will, u64)>,
    /// The will of the client connected when the journal ended (`WillSet`): published after its
    /// delay from when the session is put back.
    pub connected_will: Option<Will>,
    /// Packet ids of inbound QoS 2 publishes received and not yet released by PUBREL.
    pub inbound_qos2: BTreeSet<u16>,
    /// The forwarded QoS 2 publishes the session took in lately, oldest first (decision 0066).
    pub taken: Vec<TakenId>,
}

/// A forwarded QoS 2 publish a session took in, remembered so that a redelivery skips it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakenId {
    pub id: PublishId,
    /// When the session took it in (wall-clock ms).
    pub at_ms: u64,
    /// How long after `at_ms` it may still be given again (the origin's settle bound).
    pub keep_ms: u64,
}

impl TakenId {
    /// Whether it can still come again at `now_ms`.
    pub fn kept_at(&self, now_ms: u64) -> bool {
        self.at_ms.saturating_add(self.keep_ms) >= now_ms
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEntry {
    pub message: StoredMessage,
    /// Packet id it was sent with, if it is in flight.
    pub packet_id: Option<u16>,
    /// PUBREC seen: PUBREL is what goes again.
    pub released: bool,
}

impl StoredSession {
    /// The will to publish if the session ends now: its pending delayed will, or, if its client
    /// was connected (the node that held it died), that connection's will.
    pub fn will_at_end(&self) -> Option<&Will> {
        match (&self.will, self.detached_at_ms) {
            (Some((will, _)), _) => Some(will),
            (None, None) => self.connected_will.as_ref(),
            (None, Some(_)) => None,
        }
    }
}

impl Restored {
    /// Applies one change. Changes about sessions or messages that do not exist are ignored: they
    /// are older than the snapshot image (which already has their effect) or raced a session's end.
    pub fn apply(&mut self, change: SessionChange) {
        match change {
            SessionChange::Created {
                client_id,
                expiry_secs,
            } => {
                self.sessions.insert(
                    client_id,
                    StoredSession {
                        expiry_secs,
                        ..StoredSession::default()
                    },
                );
            }
            SessionChange::Attached {
                client_id,
                expiry_secs,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.expiry_secs = expiry_secs;
                    s.detached_at_ms = None;
                    s.will = None;
                    s.connected_will = None;
                }
            }
            SessionChange::Detached {
                client_id,
                expiry_secs,
                at_ms,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.expiry_secs = expiry_secs;
                    s.detached_at_ms = Some(at_ms);
                    s.connected_will = None;
                }
            }
            SessionChange::Subscribed {
                client_id,
                filter,
                options,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.subscriptions.insert(filter, options);
                }
            }
            SessionChange::Unsubscribed { client_id, filter } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.subscriptions.remove(&filter);
                }
            }
            SessionChange::Appended {
                client_id,
                seq,
                message,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.messages.insert(
                        seq,
                        StoredEntry {
                            message,
                            packet_id: None,
                            released: false,
                        },
                    );
                }
            }
            SessionChange::Sent {
                client_id,
                seq,
                packet_id,
            } => {
                if let Some(e) = self.entry(&client_id, seq) {
                    e.packet_id = Some(packet_id);
                }
            }
            SessionChange::Released { client_id, seq } => {
                if let Some(e) = self.entry(&client_id, seq) {
                    e.released = true;
                }
            }
            SessionChange::Removed { client_id, seq } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.messages.remove(&seq);
                }
            }
            SessionChange::Deleted { client_id } => {
                self.sessions.remove(&client_id);
            }
            SessionChange::Qos2Received {
                client_id,
                packet_id,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.inbound_qos2.insert(packet_id);
                }
            }
            SessionChange::Qos2Released {
                client_id,
                packet_id,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.inbound_qos2.remove(&packet_id);
                }
            }
            SessionChange::WillScheduled {
                client_id,
                will,
                at_ms,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.will = Some((will, at_ms));
                }
            }
            SessionChange::WillCancelled { client_id } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.will = None;
                }
            }
            SessionChange::Took {
                client_id,
                id,
                at_ms,
                keep_ms,
            } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    // What can no longer come again goes: a row holds only the last settle bound.
                    s.taken.retain(|t| t.kept_at(at_ms) && t.id != id);
                    s.taken.push(TakenId { id, at_ms, keep_ms });
                }
            }
            SessionChange::WillSet { client_id, will } => {
                if let Some(s) = self.sessions.get_mut(&client_id) {
                    s.connected_will = Some(will);
                }
            }
            SessionChange::RetainedSet {
                message,
                received_at_ms,
            } => {
                self.retained_clears.remove(&message.topic);
                self.retained
                    .insert(message.topic.clone(), (message, received_at_ms));
            }
            SessionChange::RetainedCleared { topic, at_ms } => {
                self.retained.remove(&topic);
                match at_ms {
                    Some(at_ms) => {
                        let at = self.retained_clears.entry(topic).or_insert(at_ms);
                        *at = (*at).max(at_ms);
                    }
                    None => {
                        self.retained_clears.remove(&topic);
                    }
                }
            }
        }
    }

    fn entry(&mut self, client_id: &str, seq: u64) -> Option<&mut StoredEntry> {
        self.sessions.get_mut(client_id)?.messages.get_mut(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_is_forgotten_once_it_can_no_longer_come_again() {
        let client_id: Arc<str> = "c".into();
        let mut restored = Restored::default();
        restored.apply(SessionChange::Created {
            client_id: client_id.clone(),
            expiry_secs: 60,
        });
        let took = |seq, at_ms| SessionChange::Took {
            client_id: client_id.clone(),
            id: PublishId {
                node: 1,
                incarnation: 1,
                seq,
            },
            at_ms,
            keep_ms: 1_000,
        };
        restored.apply(took(1, 10_000));
        restored.apply(took(2, 10_500));
        // Replayed twice (image, then the log): kept once.
        restored.apply(took(2, 10_500));
        restored.apply(took(3, 11_200));
        let seqs: Vec<u64> = restored.sessions["c"]
            .taken
            .iter()
            .map(|t| t.id.seq)
            .collect();
        assert_eq!(seqs, [2, 3], "1 was taken more than 1 s before 3");
    }
}
