//! The binary encoding of [`SessionChange`] lists: one journal record, or a whole snapshot image.
//! Documented in `docs/storage-format.md` ("Session log"). Big-endian like every other file.
//!
//! ```text
//! record   = version u8 (= 1), count u32, change*
//! change   = marker u8 (ASCII), fields
//! str/bin  = length u32, bytes (str: UTF-8)
//! option   = 0 | 1 value
//! ```

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use bytestring::ByteString;

use super::{SessionChange, StoredMessage};
use crate::message::{Message, PublishProperties, QoS};
use crate::peers::PublishId;
use crate::session::SubscriptionOptions;
use crate::will::Will;

/// Version byte at the start of every encoded change list.
pub const FORMAT_VERSION: u8 = 1;

const CREATED: u8 = b'C';
const ATTACHED: u8 = b'N';
const DETACHED: u8 = b'O';
const SUBSCRIBED: u8 = b'S';
const UNSUBSCRIBED: u8 = b'U';
const APPENDED: u8 = b'A';
const SENT: u8 = b'P';
const RELEASED: u8 = b'L';
const REMOVED: u8 = b'R';
const DELETED: u8 = b'D';
const QOS2_RECEIVED: u8 = b'Q';
const QOS2_RELEASED: u8 = b'q';
const WILL_SCHEDULED: u8 = b'W';
const WILL_CANCELLED: u8 = b'w';
const WILL_SET: u8 = b'V';
const RETAINED_SET: u8 = b'T';
const RETAINED_CLEARED: u8 = b't';
const RETAINED_CLEARED_AT: u8 = b'x';
const TOOK: u8 = b'K';

// Property presence bits of an encoded message.
const PROP_UTF8: u8 = 1;
const PROP_EXPIRY: u8 = 2;
const PROP_CONTENT_TYPE: u8 = 4;
const PROP_RESPONSE_TOPIC: u8 = 8;
const PROP_CORRELATION: u8 = 16;

/// Bytes that do not decode as a change list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session log data does not decode: {what} at byte {offset}")]
pub struct DecodeError {
    pub what: &'static str,
    pub offset: usize,
}

/// Encodes `changes` (a record or a snapshot image).
pub fn encode_changes(changes: &[SessionChange]) -> Bytes {
    let mut out = BytesMut::with_capacity(64);
    out.put_u8(FORMAT_VERSION);
    out.put_u32(len32(changes.len()));
    for change in changes {
        encode_change(change, &mut out);
    }
    out.freeze()
}

/// Decodes what [`encode_changes`] wrote; never panics on bad input.
pub fn decode_changes(data: &[u8]) -> Result<Vec<SessionChange>, DecodeError> {
    let mut r = Reader { data, pos: 0 };
    let version = r.u8("version")?;
    if version != FORMAT_VERSION {
        return Err(r.error("unsupported version"));
    }
    let count = r.u32("change count")?;
    // Each change takes at least 5 bytes: do not trust the count for the allocation.
    let mut changes = Vec::with_capacity((count as usize).min(data.len() / 5));
    for _ in 0..count {
        changes.push(decode_change(&mut r)?);
    }
    if r.pos != data.len() {
        return Err(r.error("trailing bytes"));
    }
    Ok(changes)
}

/// Lengths are `u32` on disk; nothing the broker holds comes near 4 GiB (packets are capped far lower).
fn len32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

fn put_bin(out: &mut BytesMut, b: &[u8]) {
    out.put_u32(len32(b.len()));
    out.put_slice(b);
}

fn encode_change(change: &SessionChange, out: &mut BytesMut) {
    match change {
        SessionChange::Created {
            client_id,
            expiry_secs,
        } => {
            out.put_u8(CREATED);
            put_bin(out, client_id.as_bytes());
            out.put_u32(*expiry_secs);
        }
        SessionChange::Attached {
            client_id,
            expiry_secs,
        } => {
            out.put_u8(ATTACHED);
            put_bin(out, client_id.as_bytes());
            out.put_u32(*expiry_secs);
        }
        SessionChange::Detached {
            client_id,
            expiry_secs,
            at_ms,
        } => {
            out.put_u8(DETACHED);
            put_bin(out, client_id.as_bytes());
            out.put_u32(*expiry_secs);
            out.put_u64(*at_ms);
        }
        SessionChange::Subscribed {
            client_id,
            filter,
            options,
        } => {
            out.put_u8(SUBSCRIBED);
            put_bin(out, client_id.as_bytes());
            put_bin(out, filter.as_bytes());
            out.put_u8(options.qos as u8);
            out.put_u8(u8::from(options.no_local) | u8::from(options.retain_as_published) << 1);
            out.put_u8(options.retain_handling);
            put_opt_u32(out, options.subscription_id);
        }
        SessionChange::Unsubscribed { client_id, filter } => {
            out.put_u8(UNSUBSCRIBED);
            put_bin(out, client_id.as_bytes());
            put_bin(out, filter.as_bytes());
        }
        SessionChange::Appended {
            client_id,
            seq,
            message,
        } => {
            out.put_u8(APPENDED);
            put_bin(out, client_id.as_bytes());
            out.put_u64(*seq);
            encode_message(&message.message, out);
            out.put_u8(message.qos as u8);
            out.put_u8(u8::from(message.retain));
            out.put_u32(len32(message.subscription_ids.len()));
            for id in &message.subscription_ids {
                out.put_u32(*id);
            }
            out.put_u64(message.received_at_ms);
        }
        SessionChange::Sent {
            client_id,
            seq,
            packet_id,
        } => {
            out.put_u8(SENT);
            put_bin(out, client_id.as_bytes());
            out.put_u64(*seq);
            out.put_u16(*packet_id);
        }
        SessionChange::Released { client_id, seq } => {
            out.put_u8(RELEASED);
            put_bin(out, client_id.as_bytes());
            out.put_u64(*seq);
        }
        SessionChange::Removed { client_id, seq } => {
            out.put_u8(REMOVED);
            put_bin(out, client_id.as_bytes());
            out.put_u64(*seq);
        }
        SessionChange::Deleted { client_id } => {
            out.put_u8(DELETED);
            put_bin(out, client_id.as_bytes());
        }
        SessionChange::Qos2Received {
            client_id,
            packet_id,
        } => {
            out.put_u8(QOS2_RECEIVED);
            put_bin(out, client_id.as_bytes());
            out.put_u16(*packet_id);
        }
        SessionChange::Qos2Released {
            client_id,
            packet_id,
        } => {
            out.put_u8(QOS2_RELEASED);
            put_bin(out, client_id.as_bytes());
            out.put_u16(*packet_id);
        }
        SessionChange::WillScheduled {
            client_id,
            will,
            at_ms,
        } => {
            out.put_u8(WILL_SCHEDULED);
            put_bin(out, client_id.as_bytes());
            encode_message(&will.message, out);
            out.put_u32(will.delay_secs);
            out.put_u64(*at_ms);
        }
        SessionChange::WillCancelled { client_id } => {
            out.put_u8(WILL_CANCELLED);
            put_bin(out, client_id.as_bytes());
        }
        SessionChange::Took {
            client_id,
            id,
            at_ms,
            keep_ms,
        } => {
            out.put_u8(TOOK);
            put_bin(out, client_id.as_bytes());
            out.put_u64(id.node);
            out.put_u64(id.incarnation);
            out.put_u64(id.seq);
            out.put_u64(*at_ms);
            out.put_u64(*keep_ms);
        }
        SessionChange::WillSet { client_id, will } => {
            out.put_u8(WILL_SET);
            put_bin(out, client_id.as_bytes());
            encode_message(&will.message, out);
            out.put_u32(will.delay_secs);
        }
        SessionChange::RetainedSet {
            message,
            received_at_ms,
        } => {
            out.put_u8(RETAINED_SET);
            encode_message(message, out);
            out.put_u64(*received_at_ms);
        }
        SessionChange::RetainedCleared { topic, at_ms: None } => {
            out.put_u8(RETAINED_CLEARED);
            put_bin(out, topic.as_bytes());
        }
        SessionChange::RetainedCleared {
            topic,
            at_ms: Some(at_ms),
        } => {
            out.put_u8(RETAINED_CLEARED_AT);
            put_bin(out, topic.as_bytes());
            out.put_u64(*at_ms);
        }
    }
}

fn put_opt_u32(out: &mut BytesMut, v: Option<u32>) {
    match v {
        Some(v) => {
            out.put_u8(1);
            out.put_u32(v);
        }
        None => out.put_u8(0),
    }
}

fn encode_message(m: &Message, out: &mut BytesMut) {
    put_bin(out, m.topic.as_bytes());
    put_bin(out, &m.payload);
    out.put_u8(m.qos as u8);
    out.put_u8(u8::from(m.retain));
    let p = &m.properties;
    let mut bits = 0;
    for (present, bit) in [
        (p.payload_is_utf8, PROP_UTF8),
        (p.message_expiry_interval.is_some(), PROP_EXPIRY),
        (p.content_type.is_some(), PROP_CONTENT_TYPE),
        (p.response_topic.is_some(), PROP_RESPONSE_TOPIC),
        (p.correlation_data.is_some(), PROP_CORRELATION),
    ] {
        if present {
            bits |= bit;
        }
    }
    out.put_u8(bits);
    if let Some(v) = p.message_expiry_interval {
        out.put_u32(v);
    }
    if let Some(v) = &p.content_type {
        put_bin(out, v.as_bytes());
    }
    if let Some(v) = &p.response_topic {
        put_bin(out, v.as_bytes());
    }
    if let Some(v) = &p.correlation_data {
        put_bin(out, v);
    }
    out.put_u32(len32(p.user_properties.len()));
    for (k, v) in &p.user_properties {
        put_bin(out, k.as_bytes());
        put_bin(out, v.as_bytes());
    }
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn error(&self, what: &'static str) -> DecodeError {
        DecodeError {
            what,
            offset: self.pos,
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.data.len())
            .ok_or_else(|| self.error(what))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }

    fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.error(what)),
        }
    }

    fn bin(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = self.u32(what)?;
        self.take(len as usize, what)
    }

    fn bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        Ok(Bytes::copy_from_slice(self.bin(what)?))
    }

    fn string(&mut self, what: &'static str) -> Result<ByteString, DecodeError> {
        let start = self.pos;
        let b = self.bin(what)?;
        ByteString::try_from(b).map_err(|_| DecodeError {
            what,
            offset: start,
        })
    }

    fn client_id(&mut self) -> Result<Arc<str>, DecodeError> {
        Ok(Arc::from(&*self.string("client id")?))
    }

    fn qos(&mut self, what: &'static str) -> Result<QoS, DecodeError> {
        match self.u8(what)? {
            0 => Ok(QoS::AtMostOnce),
            1 => Ok(QoS::AtLeastOnce),
            2 => Ok(QoS::ExactlyOnce),
            _ => Err(self.error(what)),
        }
    }

    fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>, DecodeError> {
        Ok(if self.bool(what)? {
            Some(self.u32(what)?)
        } else {
            None
        })
    }

    /// A count of items each at least `min_size` bytes long, checked against what is left.
    fn count(&mut self, min_size: usize, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_size) > self.data.len() - self.pos {
            return Err(self.error(what));
        }
        Ok(n)
    }
}

fn decode_message(r: &mut Reader<'_>) -> Result<Message, DecodeError> {
    let topic = r.string("topic")?;
    let payload = r.bytes("payload")?;
    let qos = r.qos("message QoS")?;
    let retain = r.bool("retain flag")?;
    let bits = r.u8("property bits")?;
    if bits
        & !(PROP_UTF8 | PROP_EXPIRY | PROP_CONTENT_TYPE | PROP_RESPONSE_TOPIC | PROP_CORRELATION)
        != 0
    {
        return Err(r.error("property bits"));
    }
    let mut properties = PublishProperties {
        payload_is_utf8: bits & PROP_UTF8 != 0,
        ..PublishProperties::default()
    };
    if bits & PROP_EXPIRY != 0 {
        properties.message_expiry_interval = Some(r.u32("message expiry interval")?);
    }
    if bits & PROP_CONTENT_TYPE != 0 {
        properties.content_type = Some(r.string("content type")?);
    }
    if bits & PROP_RESPONSE_TOPIC != 0 {
        properties.response_topic = Some(r.string("response topic")?);
    }
    if bits & PROP_CORRELATION != 0 {
        properties.correlation_data = Some(r.bytes("correlation data")?);
    }
    let n = r.count(8, "user property count")?;
    for _ in 0..n {
        let k = r.string("user property name")?;
        let v = r.string("user property value")?;
        properties.user_properties.push((k, v));
    }
    Ok(Message {
        topic,
        payload,
        qos,
        retain,
        properties,
    })
}

fn decode_change(r: &mut Reader<'_>) -> Result<SessionChange, DecodeError> {
    let marker_at = r.pos;
    let change = match r.u8("marker")? {
        CREATED => SessionChange::Created {
            client_id: r.client_id()?,
            expiry_secs: r.u32("expiry")?,
        },
        ATTACHED => SessionChange::Attached {
            client_id: r.client_id()?,
            expiry_secs: r.u32("expiry")?,
        },
        DETACHED => SessionChange::Detached {
            client_id: r.client_id()?,
            expiry_secs: r.u32("expiry")?,
            at_ms: r.u64("detached at")?,
        },
        SUBSCRIBED => {
            let client_id = r.client_id()?;
            let filter = r.string("filter")?;
            let qos = r.qos("subscription QoS")?;
            let flags = r.u8("subscription flags")?;
            if flags > 3 {
                return Err(r.error("subscription flags"));
            }
            let retain_handling = r.u8("retain handling")?;
            if retain_handling > 2 {
                return Err(r.error("retain handling"));
            }
            let subscription_id = r.opt_u32("subscription id")?;
            SessionChange::Subscribed {
                client_id,
                filter,
                options: SubscriptionOptions {
                    qos,
                    no_local: flags & 1 != 0,
                    retain_as_published: flags & 2 != 0,
                    retain_handling,
                    subscription_id,
                },
            }
        }
        UNSUBSCRIBED => SessionChange::Unsubscribed {
            client_id: r.client_id()?,
            filter: r.string("filter")?,
        },
        APPENDED => {
            let client_id = r.client_id()?;
            let seq = r.u64("seq")?;
            let message = Arc::new(decode_message(r)?);
            let qos = r.qos("delivery QoS")?;
            let retain = r.bool("delivery retain flag")?;
            let n = r.count(4, "subscription id count")?;
            let mut subscription_ids = Vec::with_capacity(n);
            for _ in 0..n {
                subscription_ids.push(r.u32("subscription id")?);
            }
            let received_at_ms = r.u64("received at")?;
            SessionChange::Appended {
                client_id,
                seq,
                message: StoredMessage {
                    message,
                    qos,
                    retain,
                    subscription_ids,
                    received_at_ms,
                },
            }
        }
        SENT => SessionChange::Sent {
            client_id: r.client_id()?,
            seq: r.u64("seq")?,
            packet_id: r.u16("packet id")?,
        },
        RELEASED => SessionChange::Released {
            client_id: r.client_id()?,
            seq: r.u64("seq")?,
        },
        REMOVED => SessionChange::Removed {
            client_id: r.client_id()?,
            seq: r.u64("seq")?,
        },
        DELETED => SessionChange::Deleted {
            client_id: r.client_id()?,
        },
        QOS2_RECEIVED => SessionChange::Qos2Received {
            client_id: r.client_id()?,
            packet_id: r.u16("packet id")?,
        },
        QOS2_RELEASED => SessionChange::Qos2Released {
            client_id: r.client_id()?,
            packet_id: r.u16("packet id")?,
        },
        WILL_SCHEDULED => {
            let client_id = r.client_id()?;
            let message = decode_message(r)?;
            let delay_secs = r.u32("will delay")?;
            SessionChange::WillScheduled {
                client_id,
                will: Will {
                    message,
                    delay_secs,
                },
                at_ms: r.u64("will due at")?,
            }
        }
        WILL_CANCELLED => SessionChange::WillCancelled {
            client_id: r.client_id()?,
        },
        TOOK => SessionChange::Took {
            client_id: r.client_id()?,
            id: PublishId {
                node: r.u64("publish node")?,
                incarnation: r.u64("publish incarnation")?,
                seq: r.u64("publish seq")?,
            },
            at_ms: r.u64("taken at")?,
            keep_ms: r.u64("kept for")?,
        },
        WILL_SET => {
            let client_id = r.client_id()?;
            let message = decode_message(r)?;
            SessionChange::WillSet {
                client_id,
                will: Will {
                    message,
                    delay_secs: r.u32("will delay")?,
                },
            }
        }
        RETAINED_SET => SessionChange::RetainedSet {
            message: Arc::new(decode_message(r)?),
            received_at_ms: r.u64("received at")?,
        },
        RETAINED_CLEARED => SessionChange::RetainedCleared {
            topic: r.string("topic")?,
            at_ms: None,
        },
        RETAINED_CLEARED_AT => SessionChange::RetainedCleared {
            topic: r.string("topic")?,
            at_ms: Some(r.u64("cleared at")?),
        },
        _ => {
            return Err(DecodeError {
                what: "unknown marker",
                offset: marker_at,
            })
        }
    };
    Ok(change)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn text() -> impl Strategy<Value = String> {
        "[a-z/#+é]{0,12}"
    }

    fn qos() -> impl Strategy<Value = QoS> {
        prop_oneof![
            Just(QoS::AtMostOnce),
            Just(QoS::AtLeastOnce),
            Just(QoS::ExactlyOnce)
        ]
    }

    fn message() -> impl Strategy<Value = Message> {
        (
            (text(), proptest::collection::vec(any::<u8>(), 0..16), qos()),
            (any::<bool>(), any::<bool>(), any::<Option<u32>>()),
            (
                proptest::option::of(text()),
                proptest::option::of(text()),
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
                proptest::collection::vec((text(), text()), 0..3),
            ),
        )
            .prop_map(
                |((topic, payload, qos), (retain, utf8, expiry), (ct, rt, cd, up))| Message {
                    topic: topic.into(),
                    payload: payload.into(),
                    qos,
                    retain,
                    properties: PublishProperties {
                        payload_is_utf8: utf8,
                        message_expiry_interval: expiry,
                        content_type: ct.map(Into::into),
                        response_topic: rt.map(Into::into),
                        correlation_data: cd.map(Into::into),
                        user_properties: up
                            .into_iter()
                            .map(|(k, v)| (k.into(), v.into()))
                            .collect(),
                    },
                },
            )
    }

    fn options() -> impl Strategy<Value = SubscriptionOptions> {
        (
            qos(),
            any::<bool>(),
            any::<bool>(),
            0u8..3,
            any::<Option<u32>>(),
        )
            .prop_map(
                |(qos, no_local, retain_as_published, retain_handling, subscription_id)| {
                    SubscriptionOptions {
                        qos,
                        no_local,
                        retain_as_published,
                        retain_handling,
                        subscription_id,
                    }
                },
            )
    }

    fn change() -> impl Strategy<Value = SessionChange> {
        let id = || text().prop_map(|s| Arc::<str>::from(s.as_str()));
        prop_oneof![
            (id(), any::<u32>()).prop_map(|(client_id, expiry_secs)| SessionChange::Created {
                client_id,
                expiry_secs
            }),
            (id(), any::<u32>()).prop_map(|(client_id, expiry_secs)| SessionChange::Attached {
                client_id,
                expiry_secs
            }),
            (id(), any::<u32>(), any::<u64>()).prop_map(|(client_id, expiry_secs, at_ms)| {
                SessionChange::Detached {
                    client_id,
                    expiry_secs,
                    at_ms,
                }
            }),
            (id(), text(), options()).prop_map(|(client_id, f, options)| {
                SessionChange::Subscribed {
                    client_id,
                    filter: f.into(),
                    options,
                }
            }),
            (id(), text()).prop_map(|(client_id, f)| SessionChange::Unsubscribed {
                client_id,
                filter: f.into()
            }),
            (
                id(),
                any::<u64>(),
                message(),
                qos(),
                any::<bool>(),
                proptest::collection::vec(any::<u32>(), 0..3),
                any::<u64>()
            )
                .prop_map(|(client_id, seq, m, qos, retain, ids, at)| {
                    SessionChange::Appended {
                        client_id,
                        seq,
                        message: StoredMessage {
                            message: Arc::new(m),
                            qos,
                            retain,
                            subscription_ids: ids,
                            received_at_ms: at,
                        },
                    }
                }),
            (id(), any::<u64>(), any::<u16>()).prop_map(|(client_id, seq, packet_id)| {
                SessionChange::Sent {
                    client_id,
                    seq,
                    packet_id,
                }
            }),
            (id(), any::<u64>())
                .prop_map(|(client_id, seq)| SessionChange::Released { client_id, seq }),
            (id(), any::<u64>())
                .prop_map(|(client_id, seq)| SessionChange::Removed { client_id, seq }),
            id().prop_map(|client_id| SessionChange::Deleted { client_id }),
            (id(), any::<u16>()).prop_map(|(client_id, packet_id)| {
                SessionChange::Qos2Received {
                    client_id,
                    packet_id,
                }
            }),
            (id(), any::<[u64; 5]>()).prop_map(
                |(client_id, [node, incarnation, seq, at_ms, keep_ms])| {
                    SessionChange::Took {
                        client_id,
                        id: PublishId {
                            node,
                            incarnation,
                            seq,
                        },
                        at_ms,
                        keep_ms,
                    }
                }
            ),
            (id(), any::<u16>()).prop_map(|(client_id, packet_id)| {
                SessionChange::Qos2Released {
                    client_id,
                    packet_id,
                }
            }),
            (id(), message(), any::<u32>(), any::<u64>()).prop_map(
                |(client_id, message, delay_secs, at_ms)| SessionChange::WillScheduled {
                    client_id,
                    will: Will {
                        message,
                        delay_secs
                    },
                    at_ms,
                }
            ),
            id().prop_map(|client_id| SessionChange::WillCancelled { client_id }),
            (id(), message(), any::<u32>()).prop_map(|(client_id, message, delay_secs)| {
                SessionChange::WillSet {
                    client_id,
                    will: Will {
                        message,
                        delay_secs,
                    },
                }
            }),
            (message(), any::<u64>()).prop_map(|(m, at)| SessionChange::RetainedSet {
                message: Arc::new(m),
                received_at_ms: at
            }),
            (text(), proptest::option::of(any::<u64>())).prop_map(|(t, at_ms)| {
                SessionChange::RetainedCleared {
                    topic: t.into(),
                    at_ms,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_change_round_trips(changes in proptest::collection::vec(change(), 0..6)) {
            let bytes = encode_changes(&changes);
            prop_assert_eq!(decode_changes(&bytes).unwrap(), changes);
        }

        #[test]
        fn truncated_or_arbitrary_bytes_never_panic(
            changes in proptest::collection::vec(change(), 1..4),
            cut in any::<prop::sample::Index>(),
            junk in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let bytes = encode_changes(&changes);
            let cut = cut.index(bytes.len());
            prop_assert!(decode_changes(&bytes[..cut]).is_err());
            let _ = decode_changes(&junk);
        }
    }

    /// A message with every optional property, so its golden bytes pin each field of `encode_message`.
    fn golden_message() -> Message {
        Message {
            topic: "t".into(),
            payload: Bytes::from_static(b"p"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: PublishProperties {
                payload_is_utf8: true,
                message_expiry_interval: Some(9),
                content_type: Some("c".into()),
                response_topic: Some("r".into()),
                correlation_data: Some(Bytes::from_static(b"d")),
                user_properties: vec![("k".into(), "v".into())],
            },
        }
    }

    /// Golden bytes of every record kind (docs/storage-format.md, "Session log"): a change to any
    /// layout fails here and must bump `FORMAT_VERSION` and the document together.
    #[test]
    fn every_record_kind_has_a_stable_layout() {
        // topic "t", payload "p", QoS 1, retain, all five property bits, expiry 9, content type
        // "c", response topic "r", correlation "d", one user property k=v.
        const MESSAGE: &str =
            "0000000174000000017001011f000000090000000163000000017200000001640000000100000001\
                               6b0000000176";
        let id = || Arc::<str>::from("c");
        let message = golden_message;
        let cases: Vec<(SessionChange, String)> = vec![
            (
                SessionChange::Created { client_id: id(), expiry_secs: 0x0102_0304 },
                "43 0000000163 01020304".into(),
            ),
            (
                SessionChange::Attached { client_id: id(), expiry_secs: 5 },
                "4e 0000000163 00000005".into(),
            ),
            (
                SessionChange::Detached { client_id: id(), expiry_secs: 5, at_ms: 6 },
                "4f 0000000163 00000005 0000000000000006".into(),
            ),
            (
                SessionChange::Subscribed {
                    client_id: id(),
                    filter: "a/+".into(),
                    options: SubscriptionOptions {
                        qos: QoS::ExactlyOnce,
                        no_local: true,
                        retain_as_published: true,
                        retain_handling: 2,
                        subscription_id: Some(7),
                    },
                },
                "53 0000000163 00000003612f2b 02 03 02 01 00000007".into(),
            ),
            (
                SessionChange::Subscribed {
                    client_id: id(),
                    filter: "f".into(),
                    options: SubscriptionOptions {
                        qos: QoS::AtMostOnce,
                        no_local: false,
                        retain_as_published: false,
                        retain_handling: 0,
                        subscription_id: None,
                    },
                },
                "53 0000000163 0000000166 00 00 00 00".into(),
            ),
            (
                SessionChange::Unsubscribed { client_id: id(), filter: "f".into() },
                "55 0000000163 0000000166".into(),
            ),
            (
                SessionChange::Appended {
                    client_id: id(),
                    seq: 8,
                    message: StoredMessage {
                        message: Arc::new(message()),
                        qos: QoS::AtLeastOnce,
                        retain: false,
                        subscription_ids: vec![3],
                        received_at_ms: 4,
                    },
                },
                format!("41 0000000163 0000000000000008 {MESSAGE} 01 00 00000001 00000003 0000000000000004"),
            ),
            (
                SessionChange::Sent { client_id: id(), seq: 8, packet_id: 0x0a0b },
                "50 0000000163 0000000000000008 0a0b".into(),
            ),
            (
                SessionChange::Released { client_id: id(), seq: 8 },
                "4c 0000000163 0000000000000008".into(),
            ),
            (
                SessionChange::Removed { client_id: id(), seq: 7 },
                "52 0000000163 0000000000000007".into(),
            ),
            (SessionChange::Deleted { client_id: id() }, "44 0000000163".into()),
            (
                SessionChange::Qos2Received { client_id: id(), packet_id: 0x1234 },
                "51 0000000163 1234".into(),
            ),
            (
                SessionChange::Qos2Released { client_id: id(), packet_id: 0x1234 },
                "71 0000000163 1234".into(),
            ),
            (
                SessionChange::WillScheduled {
                    client_id: id(),
                    will: Will { message: message(), delay_secs: 10 },
                    at_ms: 11,
                },
                format!("57 0000000163 {MESSAGE} 0000000a 000000000000000b"),
            ),
            (SessionChange::WillCancelled { client_id: id() }, "77 0000000163".into()),
            (
                SessionChange::WillSet {
                    client_id: id(),
                    will: Will { message: message(), delay_secs: 10 },
                },
                format!("56 0000000163 {MESSAGE} 0000000a"),
            ),
            (
                SessionChange::RetainedSet { message: Arc::new(message()), received_at_ms: 12 },
                format!("54 {MESSAGE} 000000000000000c"),
            ),
            (
                SessionChange::RetainedCleared { topic: "t".into(), at_ms: None },
                "74 0000000174".into(),
            ),
            (
                SessionChange::RetainedCleared { topic: "t".into(), at_ms: Some(13) },
                "78 0000000174 000000000000000d".into(),
            ),
        ];
        let kinds: std::collections::BTreeSet<u8> = cases
            .iter()
            .map(|(change, _)| encode_changes(std::slice::from_ref(change))[5])
            .collect();
        assert_eq!(kinds.len(), 18, "one golden case per record kind");
        for (change, hex) in cases {
            let expected: String = format!("01 00000001 {hex}").split_whitespace().collect();
            let bytes = encode_changes(std::slice::from_ref(&change));
            let actual: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(actual, expected, "{change:?}");
            assert_eq!(decode_changes(&bytes).unwrap(), vec![change]);
        }
    }

    #[test]
    fn another_format_version_is_refused() {
        assert_eq!(
            decode_changes(&[2, 0, 0, 0, 0]),
            Err(DecodeError {
                what: "unsupported version",
                offset: 1
            })
        );
    }
}
