//! What brokers send each other inside `Request::Mesh` / `Response::Mesh` (postcard, like the
//! control plane's and the chains' messages).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use bytestring::ByteString;
use mqstate_broker::{GroupKey, Message, PublishId, PublishProperties, QoS};
use mqstate_cluster::NodeId;
use serde::{Deserialize, Serialize};

/// One batch from one node to another: the items of its ordered stream since the last batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub from: NodeId,
    /// The sender's run: a restarted sender starts a new one (and resyncs).
    pub incarnation: u64,
    /// Consecutive within an incarnation; a receiver that missed one asks for a resync.
    pub seq: u64,
    pub items: Vec<Item>,
}

/// A route: a filter this node's sessions hold, in a shared group or not.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Route {
    pub filter: String,
    pub group: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Item {
    /// Every route the sender holds, replacing what the receiver knew of it, and its retained
    /// messages (the receiver adopts those on topics it holds none for).
    Resync {
        routes: Vec<Route>,
        retained: Vec<WireMessage>,
    },
    Added(Route),
    Removed(Route),
    Publish(WirePublish),
    /// A client id connected on the sender: the receiver's connection with it is taken over.
    Claim(String),
    /// A publish held while a node that had a subscriber of it died, sent again once that
    /// node's sessions were adopted: the receiver gives it only to sessions it put back within
    /// the last `put_back_within_ms` (the others had it already), and to one member of each of
    /// `publish.groups` (a group a failed node was to serve; decisions 0057, 0062).
    Redeliver {
        publish: WirePublish,
        put_back_within_ms: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePublish {
    pub message: WireMessage,
    /// The publishing client, for No Local.
    pub origin: Option<String>,
    /// Shared groups (filter, name) the receiver serves for this message.
    pub groups: Vec<(String, String)>,
    /// The publish's number (decision 0066). Not in the item: it travels in the batch's
    /// [`Numbers`] trailer, which a node of the previous release ignores.
    #[serde(skip)]
    pub id: Option<PublishId>,
}

/// What follows a [`Batch`] in its message when any of its publishes is numbered: the number
/// of each `Publish` and `Redeliver` item, in item order. Postcard reads a value from the front
/// of its bytes and leaves the rest, so a node of the previous release reads the batch and
/// ignores this (its publishes then go unnumbered: as before 0066).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Numbers(Vec<Option<(u64, u64, u64)>>);

impl Batch {
    fn publishes_mut(&mut self) -> impl Iterator<Item = &mut WirePublish> {
        self.items.iter_mut().filter_map(|item| match item {
            Item::Publish(publish) | Item::Redeliver { publish, .. } => Some(publish),
            _ => None,
        })
    }

    /// The batch, then its [`Numbers`] if it has any.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = encode(self);
        let numbers: Vec<Option<(u64, u64, u64)>> = self
            .items
            .iter()
            .filter_map(|item| match item {
                Item::Publish(publish) | Item::Redeliver { publish, .. } => Some(publish.id),
                _ => None,
            })
            .map(|id| id.map(|id| (id.node, id.incarnation, id.seq)))
            .collect();
        if numbers.iter().any(Option::is_some) {
            out.extend(encode(&Numbers(numbers)));
        }
        out
    }

    /// What [`Batch::encode`] wrote (or a batch of the previous release, without numbers).
    pub fn decode(bytes: &[u8]) -> Result<Batch, postcard::Error> {
        let (mut batch, rest): (Batch, &[u8]) = postcard::take_from_bytes(bytes)?;
        if rest.is_empty() {
            return Ok(batch);
        }
        let Numbers(numbers) = decode(rest)?;
        let mut numbers = numbers.into_iter();
        for publish in batch.publishes_mut() {
            publish.id = numbers
                .next()
                .flatten()
                .map(|(node, incarnation, seq)| PublishId {
                    node,
                    incarnation,
                    seq,
                });
        }
        if numbers.next().is_some() {
            return Err(postcard::Error::DeserializeBadEncoding);
        }
        Ok(batch)
    }
}

/// A message with how long ago its origin received it (expiry counts from then).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireMessage {
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: u8,
    pub retain: bool,
    pub age_ms: u64,
    pub payload_is_utf8: bool,
    pub message_expiry_interval: Option<u32>,
    pub content_type: Option<String>,
    pub response_topic: Option<String>,
    pub correlation_data: Option<Vec<u8>>,
    pub user_properties: Vec<(String, String)>,
}

/// The answer to a [`Batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Applied; every publish in it is in the receiver's session queues (durable where they are).
    Accepted,
    /// Not applied: the receiver does not follow the sender's stream (it restarted, or a batch
    /// was lost); send again starting with a [`Item::Resync`].
    Resync,
}

impl WireMessage {
    pub fn from_message(message: &Message, age: Duration) -> WireMessage {
        let p = &message.properties;
        WireMessage {
            topic: message.topic.to_string(),
            payload: message.payload.to_vec(),
            qos: message.qos as u8,
            retain: message.retain,
            age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
            payload_is_utf8: p.payload_is_utf8,
            message_expiry_interval: p.message_expiry_interval,
            content_type: p.content_type.as_ref().map(ToString::to_string),
            response_topic: p.response_topic.as_ref().map(ToString::to_string),
            correlation_data: p.correlation_data.as_ref().map(|c| c.to_vec()),
            user_properties: p
                .user_properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// The message and its age; `None` for a QoS the broker does not know.
    pub fn into_message(self) -> Option<(Message, Duration)> {
        let qos = match self.qos {
            0 => QoS::AtMostOnce,
            1 => QoS::AtLeastOnce,
            2 => QoS::ExactlyOnce,
            _ => return None,
        };
        let message = Message {
            topic: ByteString::from(self.topic),
            payload: Bytes::from(self.payload),
            qos,
            retain: self.retain,
            properties: PublishProperties {
                payload_is_utf8: self.payload_is_utf8,
                message_expiry_interval: self.message_expiry_interval,
                content_type: self.content_type.map(ByteString::from),
                response_topic: self.response_topic.map(ByteString::from),
                correlation_data: self.correlation_data.map(Bytes::from),
                user_properties: self
                    .user_properties
                    .into_iter()
                    .map(|(k, v)| (ByteString::from(k), ByteString::from(v)))
                    .collect(),
            },
        };
        Some((message, Duration::from_millis(self.age_ms)))
    }
}

impl Route {
    pub fn new(filter: &str, group: Option<&str>) -> Route {
        Route {
            filter: filter.to_owned(),
            group: group.map(str::to_owned),
        }
    }

    pub fn group_key(&self) -> Option<GroupKey> {
        self.group.as_ref().map(|group| GroupKey {
            filter: Arc::from(self.filter.as_str()),
            group: Arc::from(group.as_str()),
        })
    }
}

/// How these messages are encoded and decoded: as every message inside the cluster transport.
pub use mqstate_cluster::transport::{decode_body as decode, encode_body as encode};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_message_survives_the_trip() {
        let message = Message {
            topic: "a/b".into(),
            payload: Bytes::from_static(b"x"),
            qos: QoS::ExactlyOnce,
            retain: true,
            properties: PublishProperties {
                payload_is_utf8: true,
                message_expiry_interval: Some(9),
                content_type: Some("t".into()),
                response_topic: Some("r".into()),
                correlation_data: Some(Bytes::from_static(b"c")),
                user_properties: vec![("k".into(), "v".into())],
            },
        };
        let batch = Batch {
            from: 1,
            incarnation: 2,
            seq: 3,
            items: vec![Item::Publish(WirePublish {
                message: WireMessage::from_message(&message, Duration::from_millis(1500)),
                origin: Some("c".into()),
                groups: vec![("f".into(), "g".into())],
                id: None,
            })],
        };
        let back = Batch::decode(&batch.encode()).unwrap();
        assert_eq!(back, batch);
        let Item::Publish(p) = &back.items[0] else {
            panic!("{back:?}")
        };
        let (m, age) = p.message.clone().into_message().unwrap();
        assert_eq!((m, age), (message, Duration::from_millis(1500)));
    }

    #[test]
    fn numbers_travel_after_the_batch_where_the_previous_release_ignores_them() {
        let publish = |id: Option<PublishId>| WirePublish {
            message: WireMessage::from_message(
                &Message {
                    topic: "t".into(),
                    payload: Bytes::from_static(b"x"),
                    qos: QoS::ExactlyOnce,
                    retain: false,
                    properties: PublishProperties::default(),
                },
                Duration::ZERO,
            ),
            origin: None,
            groups: Vec::new(),
            id,
        };
        let id = PublishId {
            node: 2,
            incarnation: 1 << 50,
            seq: 9,
        };
        let batch = Batch {
            from: 2,
            incarnation: 1 << 50,
            seq: 4,
            items: vec![
                Item::Claim("c".into()),
                Item::Publish(publish(None)),
                Item::Redeliver {
                    publish: publish(Some(id)),
                    put_back_within_ms: 5,
                },
                Item::Publish(publish(Some(PublishId { seq: 10, ..id }))),
            ],
        };
        let bytes = batch.encode();
        assert_eq!(Batch::decode(&bytes).unwrap(), batch);
        // A node of the previous release decodes the batch as before, without the numbers.
        let old: Batch = decode(&bytes).unwrap();
        assert_eq!(old.items.len(), 4);
        let Item::Redeliver { publish: p, .. } = &old.items[2] else {
            panic!("{old:?}")
        };
        assert_eq!(p.id, None);
        // Unnumbered batches are exactly what the previous release sent.
        let mut plain = batch.clone();
        plain.publishes_mut().for_each(|p| p.id = None);
        assert_eq!(plain.encode(), encode(&plain));
    }

    proptest! {
        /// Whatever a peer (or anyone reaching the cluster port) sends decodes or fails; never panics.
        #[test]
        fn garbage_decodes_or_fails(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Batch::decode(&bytes);
            let _ = decode::<Reply>(&bytes);
        }
    }
}
