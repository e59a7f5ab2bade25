//! The only module that knows `rmqtt-codec`: it turns bytes into [`Inbound`] packets in our own
//! types, and encodes outbound packets. PUBLISH is encoded by hand: it is the hot path, and encoding
//! it directly from a shared [`Message`] avoids building (and allocating) a codec packet per delivery,
//! and gives the exact size to check against the client's Maximum Packet Size.

use std::num::{NonZeroU16, NonZeroU32};

use bytes::{BufMut, Bytes, BytesMut};
use bytestring::ByteString;
use rmqtt_codec::error::DecodeError;
use rmqtt_codec::{types::QoS as CQoS, v3, v5};
use tokio_util::codec::{Decoder, Encoder};

use crate::message::{Message, PublishProperties, QoS};
use crate::will::Will;

/// MQTT reason codes the broker sends.
pub(crate) mod reason {
    pub const SUCCESS: u8 = 0x00;
    pub const DISCONNECT_WITH_WILL: u8 = 0x04;
    pub const NO_SUBSCRIPTION_EXISTED: u8 = 0x11;
    pub const UNSPECIFIED: u8 = 0x80;
    pub const MALFORMED: u8 = 0x81;
    pub const PROTOCOL_ERROR: u8 = 0x82;
    pub const UNSUPPORTED_PROTOCOL_VERSION: u8 = 0x84;
    pub const CLIENT_ID_NOT_VALID: u8 = 0x85;
    pub const NOT_AUTHORIZED: u8 = 0x87;
    pub const SERVER_UNAVAILABLE: u8 = 0x88;
    pub const SERVER_BUSY: u8 = 0x89;
    pub const SERVER_SHUTTING_DOWN: u8 = 0x8B;
    pub const KEEP_ALIVE_TIMEOUT: u8 = 0x8D;
    pub const SESSION_TAKEN_OVER: u8 = 0x8E;
    pub const TOPIC_FILTER_INVALID: u8 = 0x8F;
    pub const TOPIC_NAME_INVALID: u8 = 0x90;
    pub const PACKET_ID_NOT_FOUND: u8 = 0x92;
    pub const RECEIVE_MAXIMUM_EXCEEDED: u8 = 0x93;
    pub const TOPIC_ALIAS_INVALID: u8 = 0x94;
    pub const PACKET_TOO_LARGE: u8 = 0x95;
    pub const QUOTA_EXCEEDED: u8 = 0x97;
    pub const PAYLOAD_FORMAT_INVALID: u8 = 0x99;
    pub const USE_ANOTHER_SERVER: u8 = 0x9C;
    pub const SHARED_SUBSCRIPTIONS_NOT_SUPPORTED: u8 = 0x9E;
}

/// Largest remaining length the MQTT variable byte integer can express.
const MAX_REMAINING_LENGTH: usize = 268_435_455;

/// A protocol violation by the client: the DISCONNECT reason code (v5) and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (reason code {code:#04x})")]
pub(crate) struct Violation {
    pub code: u8,
    pub reason: &'static str,
}

impl Violation {
    pub(crate) const fn new(code: u8, reason: &'static str) -> Self {
        Self { code, reason }
    }
}

impl From<DecodeError> for Violation {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::MaxSizeExceeded { .. } => Violation::new(
                reason::PACKET_TOO_LARGE,
                "packet larger than the Maximum Packet Size",
            ),
            DecodeError::InvalidProtocol
            | DecodeError::ConnectReservedFlagSet
            | DecodeError::InvalidConnectFlags
            | DecodeError::PacketIdRequired => {
                Violation::new(reason::PROTOCOL_ERROR, "protocol error")
            }
            DecodeError::InvalidTopicFilter => Violation::new(
                reason::PROTOCOL_ERROR,
                "SUBSCRIBE/UNSUBSCRIBE without topic filters",
            ),
            DecodeError::InvalidTopicName => {
                Violation::new(reason::TOPIC_NAME_INVALID, "invalid topic name")
            }
            DecodeError::InvalidClientId => Violation::new(
                reason::CLIENT_ID_NOT_VALID,
                "empty client id without clean start",
            ),
            _ => Violation::new(reason::MALFORMED, "malformed packet"),
        }
    }
}

/// Protocol family of a connection (3.1 and 3.1.1 share the v3 codec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    V3,
    V5,
}

/// What the first bytes of a connection say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Not enough bytes yet.
    Incomplete,
    Mqtt(Version),
    /// A CONNECT with a protocol level we do not speak.
    UnsupportedLevel(u8),
    /// Not an MQTT CONNECT at all: close without a reply.
    NotMqtt,
}

/// Looks at the start of the first packet to choose the codec (and to answer unknown protocol
/// levels with the right CONNACK, which the codec crate cannot tell apart from garbage).
pub(crate) fn probe(buf: &[u8]) -> Probe {
    let Some(&first) = buf.first() else {
        return Probe::Incomplete;
    };
    if first != 0x10 {
        return Probe::NotMqtt;
    }
    // Remaining length: up to 4 bytes.
    let mut i = 1;
    loop {
        let Some(&b) = buf.get(i) else {
            return Probe::Incomplete;
        };
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        if i > 4 {
            return Probe::NotMqtt;
        }
    }
    let Some(name_len) = buf.get(i..i + 2) else {
        return Probe::Incomplete;
    };
    let name_len = usize::from(u16::from_be_bytes([name_len[0], name_len[1]]));
    let name_start = i + 2;
    let Some(name) = buf.get(name_start..name_start + name_len) else {
        return if name_len > 6 {
            Probe::NotMqtt
        } else {
            Probe::Incomplete
        };
    };
    if name != b"MQTT" && name != b"MQIsdp" {
        return Probe::NotMqtt;
    }
    match buf.get(name_start + name_len) {
        None => Probe::Incomplete,
        Some(3 | 4) => Probe::Mqtt(Version::V3),
        Some(5) => Probe::Mqtt(Version::V5),
        Some(&level) => Probe::UnsupportedLevel(level),
    }
}

/// The CONNACK for an unsupported protocol level, in the format that level's clients read
/// (v3 return code 0x01 below 5, v5 reason 0x84 above).
pub(crate) fn unsupported_level_connack(level: u8) -> &'static [u8] {
    if level < 5 {
        &[0x20, 0x02, 0x00, 0x01]
    } else {
        &[0x20, 0x03, 0x00, reason::UNSUPPORTED_PROTOCOL_VERSION, 0x00]
    }
}

/// A decoded CONNECT.
#[derive(Debug, Clone)]
pub(crate) struct ConnectInfo {
    pub clean_start: bool,
    pub keep_alive: u16,
    pub client_id: ByteString,
    /// v3: `None` (derived from clean session by the caller).
    pub session_expiry_secs: Option<u32>,
    pub receive_maximum: u16,
    /// `u32::MAX` when the client set none.
    pub max_packet_size: u32,
    pub will: Option<Will>,
    pub username: Option<ByteString>,
    pub password: Option<Bytes>,
    /// v5 enhanced authentication: Authentication Method and Data.
    pub auth_method: Option<ByteString>,
    pub auth_data: Option<Bytes>,
}

/// A decoded PUBLISH, before topic-alias resolution.
#[derive(Debug, Clone)]
pub(crate) struct InPublish {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    pub topic: ByteString,
    pub packet_id: Option<u16>,
    pub topic_alias: Option<u16>,
    pub payload: Bytes,
    pub properties: PublishProperties,
}

/// Subscription options as requested in SUBSCRIBE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SubRequest {
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0 send retained, 1 only if new, 2 never.
    pub retain_handling: u8,
}

/// A client-to-server packet in our types.
#[derive(Debug)]
pub(crate) enum Inbound {
    Connect(Box<ConnectInfo>),
    Publish(InPublish),
    PubAck {
        packet_id: u16,
    },
    PubRec {
        packet_id: u16,
        reason: u8,
    },
    PubRel {
        packet_id: u16,
    },
    PubComp {
        packet_id: u16,
    },
    Subscribe {
        packet_id: u16,
        subscription_id: Option<u32>,
        filters: Vec<(ByteString, SubRequest)>,
    },
    Unsubscribe {
        packet_id: u16,
        filters: Vec<ByteString>,
    },
    PingReq,
    Disconnect {
        reason: u8,
        session_expiry_secs: Option<u32>,
    },
    /// AUTH after CONNECT (re-authentication or a continuation we never asked for).
    Auth,
    /// A packet only a server may send: a protocol error.
    Unexpected(&'static str),
}

/// The four acknowledgements of the QoS flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckKind {
    /// PUBACK
    Acknowledge,
    /// PUBREC
    Received,
    /// PUBREL
    Release,
    /// PUBCOMP
    Complete,
}

/// Everything a successful CONNACK carries (refusals carry only their reason code and string:
/// [`Codec::refuse_connack`]).
#[derive(Debug, Clone)]
pub(crate) struct ConnAck {
    pub session_present: bool,
    pub session_expiry_secs: Option<u32>,
    pub receive_maximum: u16,
    pub max_packet_size: u32,
    pub assigned_client_id: Option<ByteString>,
    pub topic_alias_maximum: u16,
    pub server_keep_alive: Option<u16>,
    pub shared_subscriptions: bool,
    /// Echo of the CONNECT's Authentication Method when enhanced authentication succeeded.
    pub auth_method: Option<ByteString>,
}

/// One outbound PUBLISH, borrowed from the session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutPublish<'a> {
    pub message: &'a Message,
    pub qos: QoS,
    pub retain: bool,
    pub dup: bool,
    pub packet_id: Option<u16>,
    pub subscription_ids: &'a [u32],
    /// Remaining Message Expiry Interval, already decremented.
    pub expiry_secs: Option<u32>,
}

/// Packet codec of one connection.
pub(crate) struct Codec {
    inner: rmqtt_codec::MqttCodec,
    version: Version,
    /// The client's Maximum Packet Size (from its CONNECT; `u32::MAX` until then). Reason strings
    /// that would make a CONNACK or DISCONNECT larger are left out (MQTT-3.2.2-19, -3.14.2-3).
    peer_max_packet: u32,
}

fn to_qos(q: CQoS) -> QoS {
    match q {
        CQoS::AtMostOnce => QoS::AtMostOnce,
        CQoS::AtLeastOnce => QoS::AtLeastOnce,
        CQoS::ExactlyOnce => QoS::ExactlyOnce,
    }
}

impl Codec {
    /// `max_packet_size` is the largest whole packet accepted from the client.
    pub(crate) fn new(version: Version, max_packet_size: u32) -> Self {
        // The codec limits the remaining length; allow for the shortest fixed header so that a
        // packet of exactly the advertised size is accepted.
        let max_remaining = max_packet_size.saturating_sub(2).max(1);
        let inner = match version {
            Version::V3 => rmqtt_codec::MqttCodec::V3(v3::Codec::new(max_remaining)),
            Version::V5 => rmqtt_codec::MqttCodec::V5(v5::Codec::new(max_remaining, 0)),
        };
        Self {
            inner,
            version,
            peer_max_packet: u32::MAX,
        }
    }

    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// Decodes the next complete packet from `src`, if there is one.
    pub(crate) fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Inbound>, Violation> {
        use rmqtt_codec::MqttPacket;
        if let Some((first, body)) = whole_frame(src) {
            precheck(self.version, first, body)?;
        }
        match self.inner.decode(src)? {
            None => Ok(None),
            Some((MqttPacket::V3(p), _)) => Ok(Some(from_v3(p))),
            Some((MqttPacket::V5(p), _)) => {
                let inbound = from_v5(p)?;
                if let Inbound::Connect(c) = &inbound {
                    self.peer_max_packet = c.max_packet_size;
                }
                Ok(Some(inbound))
            }
            Some((MqttPacket::Version(_), _)) => Err(Violation::new(
                reason::PROTOCOL_ERROR,
                "unexpected version probe",
            )),
        }
    }

    fn encode_packet(&mut self, packet: rmqtt_codec::MqttPacket, dst: &mut BytesMut) {
        if let Err(e) = self.inner.encode(packet, dst) {
            // Only our own oversized reason strings could fail here; nothing from the network.
            tracing::warn!(error = %e, "failed to encode a control packet; dropped");
        }
    }

    /// The CONNACK that accepts the connection.
    pub(crate) fn connack(&mut self, ack: ConnAck, dst: &mut BytesMut) {
        use rmqtt_codec::MqttPacket;
        debug_assert!(ack.receive_maximum > 0 && ack.max_packet_size > 0);
        let packet = match self.version {
            Version::V3 => MqttPacket::V3(v3::Packet::ConnectAck(v3::ConnectAck {
                session_present: ack.session_present,
                return_code: v3::ConnectAckReason::ConnectionAccepted,
            })),
            Version::V5 => MqttPacket::V5(v5::Packet::ConnectAck(Box::new(v5::ConnectAck {
                session_present: ack.session_present,
                reason_code: v5::ConnectAckReason::Success,
                session_expiry_interval_secs: ack.session_expiry_secs,
                // 0 is a protocol error for both: leave them out (no limit) rather than send it.
                receive_max: NonZeroU16::new(ack.receive_maximum).unwrap_or(NonZeroU16::MAX),
                max_packet_size: NonZeroU32::new(ack.max_packet_size).map(NonZeroU32::get),
                assigned_client_id: ack.assigned_client_id,
                topic_alias_max: ack.topic_alias_maximum,
                shared_subscription_available: ack.shared_subscriptions,
                server_keepalive_sec: ack.server_keep_alive,
                auth_method: ack.auth_method,
                ..v5::ConnectAck::default()
            }))),
        };
        self.encode_packet(packet, dst);
    }

    /// The CONNACK that refuses the connection with `reason_code` (the connection closes after
    /// it). In MQTT 5 it carries nothing but the reason code and, if it fits the client's Maximum
    /// Packet Size, the reason string: no Session Present (MQTT-3.2.2-6) and none of the
    /// capabilities of a session that will not exist.
    pub(crate) fn refuse_connack(
        &mut self,
        reason_code: u8,
        reason_string: Option<&str>,
        dst: &mut BytesMut,
    ) {
        use rmqtt_codec::MqttPacket;
        debug_assert!(reason_code >= reason::UNSPECIFIED);
        let version = self.version;
        let packet = |reason_string: Option<&str>| match version {
            Version::V3 => MqttPacket::V3(v3::Packet::ConnectAck(v3::ConnectAck {
                session_present: false,
                return_code: v3_connack_code(reason_code),
            })),
            Version::V5 => MqttPacket::V5(v5::Packet::ConnectAck(Box::new(v5::ConnectAck {
                session_present: false,
                reason_code: v5::ConnectAckReason::try_from(reason_code)
                    .unwrap_or(v5::ConnectAckReason::UnspecifiedError),
                reason_string: reason_string.map(ByteString::from),
                ..v5::ConnectAck::default()
            }))),
        };
        let with_reason = packet(reason_string);
        let without_reason = packet(None);
        self.encode_within_peer_limit(with_reason, without_reason, dst);
    }

    /// Encodes `packet`, or `fallback` (the same without its reason string) if `packet` would be
    /// larger than the client's Maximum Packet Size.
    fn encode_within_peer_limit(
        &mut self,
        packet: rmqtt_codec::MqttPacket,
        fallback: rmqtt_codec::MqttPacket,
        dst: &mut BytesMut,
    ) {
        let before = dst.len();
        self.encode_packet(packet, dst);
        if dst.len() - before > self.peer_max_packet as usize {
            dst.truncate(before);
            self.encode_packet(fallback, dst);
        }
    }

    pub(crate) fn ack(
        &mut self,
        kind: AckKind,
        packet_id: u16,
        reason_code: u8,
        dst: &mut BytesMut,
    ) {
        use rmqtt_codec::MqttPacket;
        let Some(packet_id) = NonZeroU16::new(packet_id) else {
            debug_assert!(false, "packet id 0 never reaches an ack");
            return;
        };
        let packet = match self.version {
            Version::V3 => MqttPacket::V3(match kind {
                AckKind::Acknowledge => v3::Packet::PublishAck { packet_id },
                AckKind::Received => v3::Packet::PublishReceived { packet_id },
                AckKind::Release => v3::Packet::PublishRelease { packet_id },
                AckKind::Complete => v3::Packet::PublishComplete { packet_id },
            }),
            Version::V5 => MqttPacket::V5(match kind {
                AckKind::Acknowledge | AckKind::Received => {
                    let ack = v5::PublishAck {
                        packet_id,
                        reason_code: v5::PublishAckReason::try_from(reason_code)
                            .unwrap_or(v5::PublishAckReason::UnspecifiedError),
                        properties: Vec::new(),
                        reason_string: None,
                    };
                    if kind == AckKind::Acknowledge {
                        v5::Packet::PublishAck(ack)
                    } else {
                        v5::Packet::PublishReceived(ack)
                    }
                }
                AckKind::Release | AckKind::Complete => {
                    let ack = v5::PublishAck2 {
                        packet_id,
                        reason_code: v5::PublishAck2Reason::try_from(reason_code)
                            .unwrap_or(v5::PublishAck2Reason::PacketIdNotFound),
                        properties: Vec::new(),
                        reason_string: None,
                    };
                    if kind == AckKind::Release {
                        v5::Packet::PublishRelease(ack)
                    } else {
                        v5::Packet::PublishComplete(ack)
                    }
                }
            }),
        };
        self.encode_packet(packet, dst);
    }

    pub(crate) fn suback(&mut self, packet_id: u16, codes: Vec<u8>, dst: &mut BytesMut) {
        use rmqtt_codec::MqttPacket;
        let Some(packet_id) = NonZeroU16::new(packet_id) else {
            return;
        };
        let packet = match self.version {
            Version::V3 => MqttPacket::V3(v3::Packet::SubscribeAck {
                packet_id,
                status: codes
                    .into_iter()
                    .map(|c| match CQoS::try_from(c) {
                        Ok(q) => v3::SubscribeReturnCode::Success(q),
                        Err(_) => v3::SubscribeReturnCode::Failure,
                    })
                    .collect(),
            }),
            Version::V5 => MqttPacket::V5(v5::Packet::SubscribeAck(v5::SubscribeAck {
                packet_id,
                properties: Vec::new(),
                reason_string: None,
                status: codes
                    .into_iter()
                    .map(|c| {
                        v5::SubscribeAckReason::try_from(c)
                            .unwrap_or(v5::SubscribeAckReason::UnspecifiedError)
                    })
                    .collect(),
            })),
        };
        self.encode_packet(packet, dst);
    }

    pub(crate) fn unsuback(&mut self, packet_id: u16, codes: Vec<u8>, dst: &mut BytesMut) {
        use rmqtt_codec::MqttPacket;
        let Some(packet_id) = NonZeroU16::new(packet_id) else {
            return;
        };
        let packet = match self.version {
            Version::V3 => MqttPacket::V3(v3::Packet::UnsubscribeAck { packet_id }),
            Version::V5 => MqttPacket::V5(v5::Packet::UnsubscribeAck(v5::UnsubscribeAck {
                packet_id,
                properties: Vec::new(),
                reason_string: None,
                status: codes
                    .into_iter()
                    .map(|c| {
                        v5::UnsubscribeAckReason::try_from(c)
                            .unwrap_or(v5::UnsubscribeAckReason::UnspecifiedError)
                    })
                    .collect(),
            })),
        };
        self.encode_packet(packet, dst);
    }

    pub(crate) fn pingresp(&mut self, dst: &mut BytesMut) {
        dst.put_slice(&[0xD0, 0x00]);
    }

    /// DISCONNECT (v5 only: a v3 server just closes the connection). A code the server may not
    /// send (0x04 is the client's, others belong to CONNACK or acks only) goes out as 0x80
    /// Unspecified error; the reason string is left out if it would exceed the client's Maximum
    /// Packet Size (MQTT-3.14.2-3).
    pub(crate) fn disconnect(
        &mut self,
        reason_code: u8,
        reason_string: Option<&str>,
        dst: &mut BytesMut,
    ) {
        use rmqtt_codec::MqttPacket;
        if self.version == Version::V3 {
            return;
        }
        let code = match v5::DisconnectReasonCode::try_from(reason_code) {
            Ok(v5::DisconnectReasonCode::DisconnectWithWillMessage) | Err(_) => {
                v5::DisconnectReasonCode::UnspecifiedError
            }
            Ok(code) => code,
        };
        let packet = |reason_string: Option<&str>| {
            MqttPacket::V5(v5::Packet::Disconnect(v5::Disconnect {
                reason_code: code,
                reason_string: reason_string.map(ByteString::from),
                ..v5::Disconnect::default()
            }))
        };
        let with_reason = packet(reason_string);
        let without_reason = packet(None);
        self.encode_within_peer_limit(with_reason, without_reason, dst);
    }

    /// Encodes a PUBLISH unless it would exceed `max_packet_size`; returns whether it was written.
    pub(crate) fn publish(
        &self,
        p: &OutPublish<'_>,
        max_packet_size: u32,
        dst: &mut BytesMut,
    ) -> bool {
        encode_publish(self.version, p, max_packet_size, dst)
    }
}

/// The first byte and the body of the packet at the start of `src`, once all of it is there.
fn whole_frame(src: &[u8]) -> Option<(u8, &[u8])> {
    let (&first, rest) = src.split_first()?;
    let (remaining, len_bytes) = read_var_int(rest)?;
    rest.get(len_bytes..len_bytes.checked_add(remaining)?)
        .map(|body| (first, body))
}

/// A variable byte integer at the start of `buf` and the number of bytes it took; `None` when
/// incomplete or longer than four bytes (the codec crate reports that as malformed).
fn read_var_int(buf: &[u8]) -> Option<(usize, usize)> {
    let mut value = 0usize;
    for (i, &byte) in buf.iter().enumerate().take(4) {
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// Checks the codec crate does not make: the rules about flags and property values whose breach
/// it accepts silently, or reports only as a generic malformed packet.
fn precheck(version: Version, first: u8, body: &[u8]) -> Result<(), Violation> {
    match first >> 4 {
        1 => check_connect_flags(body),
        3 => {
            let qos = (first >> 1) & 0b11;
            if qos == 0 && first & 0b1000 != 0 {
                return Err(Violation::new(
                    reason::MALFORMED,
                    "DUP flag set on a QoS 0 PUBLISH",
                ));
            }
            if version == Version::V5 && publish_topic_alias(body, qos) == Some(0) {
                return Err(Violation::new(
                    reason::TOPIC_ALIAS_INVALID,
                    "topic alias 0 (aliases start at 1)",
                ));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Without the Will Flag, Will QoS and Will Retain must be 0 (MQTT 5 §3.1.2.6 and 3.1.2.7; the
/// same in 3.1.1): otherwise the CONNECT is malformed.
fn check_connect_flags(body: &[u8]) -> Result<(), Violation> {
    const WILL: u8 = 0b0000_0100;
    const WILL_QOS_AND_RETAIN: u8 = 0b0011_1000;
    let Some(name_len) = body.get(..2) else {
        return Ok(());
    };
    let name_len = usize::from(u16::from_be_bytes([name_len[0], name_len[1]]));
    // Name, then the protocol level, then the flags.
    let Some(&flags) = body.get(2 + name_len + 1) else {
        return Ok(());
    };
    if flags & WILL == 0 && flags & WILL_QOS_AND_RETAIN != 0 {
        return Err(Violation::new(
            reason::MALFORMED,
            "CONNECT sets Will QoS or Will Retain without the Will Flag",
        ));
    }
    Ok(())
}

/// The Topic Alias property of a v5 PUBLISH body, if it has one; `None` also when the properties
/// cannot be read (the codec crate then reports the packet as malformed).
fn publish_topic_alias(body: &[u8], qos: u8) -> Option<u16> {
    const TOPIC_ALIAS: u8 = 0x23;
    let topic_len = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let at = 2 + topic_len + if qos == 0 { 0 } else { 2 };
    let (props_len, len_bytes) = read_var_int(body.get(at..)?)?;
    let start = at + len_bytes;
    let mut props = body.get(start..start.checked_add(props_len)?)?;
    while let Some((&id, rest)) = props.split_first() {
        let skip = match id {
            0x01 => 1,
            0x02 => 4,
            TOPIC_ALIAS => {
                return Some(u16::from_be_bytes([*rest.first()?, *rest.get(1)?]));
            }
            0x03 | 0x08 | 0x09 => {
                2 + usize::from(u16::from_be_bytes([*rest.first()?, *rest.get(1)?]))
            }
            0x0B => read_var_int(rest)?.1,
            0x26 => {
                let key = 2 + usize::from(u16::from_be_bytes([*rest.first()?, *rest.get(1)?]));
                let value = rest.get(key..key + 2)?;
                key + 2 + usize::from(u16::from_be_bytes([value[0], value[1]]))
            }
            _ => return None,
        };
        props = rest.get(skip..)?;
    }
    None
}

fn v3_connack_code(reason_code: u8) -> v3::ConnectAckReason {
    match reason_code {
        reason::UNSUPPORTED_PROTOCOL_VERSION => v3::ConnectAckReason::UnacceptableProtocolVersion,
        reason::CLIENT_ID_NOT_VALID => v3::ConnectAckReason::IdentifierRejected,
        0x86 => v3::ConnectAckReason::BadUserNameOrPassword,
        0x87 => v3::ConnectAckReason::NotAuthorized,
        _ => v3::ConnectAckReason::ServiceUnavailable,
    }
}

fn from_v3(p: v3::Packet) -> Inbound {
    match p {
        v3::Packet::Connect(c) => Inbound::Connect(Box::new(ConnectInfo {
            clean_start: c.clean_session,
            keep_alive: c.keep_alive,
            client_id: c.client_id,
            session_expiry_secs: None,
            receive_maximum: u16::MAX,
            max_packet_size: u32::MAX,
            will: c.last_will.map(|w| Will {
                message: Message {
                    topic: w.topic,
                    payload: w.message,
                    qos: to_qos(w.qos),
                    retain: w.retain,
                    properties: PublishProperties::default(),
                },
                delay_secs: 0,
            }),
            username: c.username,
            password: c.password,
            auth_method: None,
            auth_data: None,
        })),
        v3::Packet::Publish(p) => Inbound::Publish(InPublish {
            dup: p.dup,
            qos: to_qos(p.qos),
            retain: p.retain,
            topic: p.topic,
            packet_id: p.packet_id.map(NonZeroU16::get),
            topic_alias: None,
            payload: p.payload,
            properties: PublishProperties::default(),
        }),
        v3::Packet::PublishAck { packet_id } => Inbound::PubAck {
            packet_id: packet_id.get(),
        },
        v3::Packet::PublishReceived { packet_id } => Inbound::PubRec {
            packet_id: packet_id.get(),
            reason: reason::SUCCESS,
        },
        v3::Packet::PublishRelease { packet_id } => Inbound::PubRel {
            packet_id: packet_id.get(),
        },
        v3::Packet::PublishComplete { packet_id } => Inbound::PubComp {
            packet_id: packet_id.get(),
        },
        v3::Packet::Subscribe {
            packet_id,
            topic_filters,
        } => Inbound::Subscribe {
            packet_id: packet_id.get(),
            subscription_id: None,
            filters: topic_filters
                .into_iter()
                .map(|(f, q)| {
                    let req = SubRequest {
                        qos: to_qos(q),
                        no_local: false,
                        retain_as_published: false,
                        retain_handling: 0,
                    };
                    (f, req)
                })
                .collect(),
        },
        v3::Packet::Unsubscribe {
            packet_id,
            topic_filters,
        } => Inbound::Unsubscribe {
            packet_id: packet_id.get(),
            filters: topic_filters,
        },
        v3::Packet::PingRequest => Inbound::PingReq,
        v3::Packet::Disconnect => Inbound::Disconnect {
            reason: reason::SUCCESS,
            session_expiry_secs: None,
        },
        v3::Packet::ConnectAck(_)
        | v3::Packet::SubscribeAck { .. }
        | v3::Packet::UnsubscribeAck { .. }
        | v3::Packet::PingResponse => {
            Inbound::Unexpected("server-to-client packet sent by a client")
        }
    }
}

fn from_v5_props(p: v5::PublishProperties) -> PublishProperties {
    PublishProperties {
        payload_is_utf8: p.is_utf8_payload,
        message_expiry_interval: p.message_expiry_interval.map(NonZeroU32::get),
        content_type: p.content_type,
        response_topic: p.response_topic,
        correlation_data: p.correlation_data,
        user_properties: p.user_properties,
    }
}

fn from_v5(p: v5::Packet) -> Result<Inbound, Violation> {
    Ok(match p {
        v5::Packet::Connect(c) => {
            let c = *c;
            let will = c.last_will.map(|w| Will {
                message: Message {
                    topic: w.topic,
                    payload: w.message,
                    qos: to_qos(w.qos),
                    retain: w.retain,
                    properties: PublishProperties {
                        payload_is_utf8: w.is_utf8_payload.unwrap_or(false),
                        message_expiry_interval: w.message_expiry_interval.map(NonZeroU32::get),
                        content_type: w.content_type,
                        response_topic: w.response_topic,
                        correlation_data: w.correlation_data,
                        user_properties: w.user_properties,
                    },
                },
                delay_secs: w.will_delay_interval_sec.unwrap_or(0),
            });
            Inbound::Connect(Box::new(ConnectInfo {
                clean_start: c.clean_start,
                keep_alive: c.keep_alive,
                client_id: c.client_id,
                session_expiry_secs: Some(c.session_expiry_interval_secs),
                receive_maximum: c.receive_max.map_or(u16::MAX, NonZeroU16::get),
                max_packet_size: c.max_packet_size.map_or(u32::MAX, NonZeroU32::get),
                will,
                username: c.username,
                password: c.password,
                auth_method: c.auth_method,
                auth_data: c.auth_data,
            }))
        }
        v5::Packet::Publish(p) => {
            let p = *p;
            let mut props = p.properties.unwrap_or_default();
            if !props.subscription_ids.is_empty() {
                return Err(Violation::new(
                    reason::PROTOCOL_ERROR,
                    "PUBLISH from a client carries subscription ids",
                ));
            }
            let topic_alias = props.topic_alias.take().map(NonZeroU16::get);
            Inbound::Publish(InPublish {
                dup: p.dup,
                qos: to_qos(p.qos),
                retain: p.retain,
                topic: p.topic,
                packet_id: p.packet_id.map(NonZeroU16::get),
                topic_alias,
                payload: p.payload,
                properties: from_v5_props(props),
            })
        }
        v5::Packet::PublishAck(a) => Inbound::PubAck {
            packet_id: a.packet_id.get(),
        },
        v5::Packet::PublishReceived(a) => Inbound::PubRec {
            packet_id: a.packet_id.get(),
            reason: u8::from(a.reason_code),
        },
        v5::Packet::PublishRelease(a) => Inbound::PubRel {
            packet_id: a.packet_id.get(),
        },
        v5::Packet::PublishComplete(a) => Inbound::PubComp {
            packet_id: a.packet_id.get(),
        },
        v5::Packet::Subscribe(s) => Inbound::Subscribe {
            packet_id: s.packet_id.get(),
            subscription_id: s.id.map(NonZeroU32::get),
            filters: s
                .topic_filters
                .into_iter()
                .map(|(f, o)| {
                    let req = SubRequest {
                        qos: to_qos(o.qos),
                        no_local: o.no_local,
                        retain_as_published: o.retain_as_published,
                        retain_handling: u8::from(o.retain_handling),
                    };
                    (f, req)
                })
                .collect(),
        },
        v5::Packet::Unsubscribe(u) => Inbound::Unsubscribe {
            packet_id: u.packet_id.get(),
            filters: u.topic_filters,
        },
        v5::Packet::PingRequest => Inbound::PingReq,
        v5::Packet::Disconnect(d) => Inbound::Disconnect {
            reason: u8::from(d.reason_code),
            session_expiry_secs: d.session_expiry_interval_secs,
        },
        v5::Packet::Auth(_) => Inbound::Auth,
        v5::Packet::ConnectAck(_)
        | v5::Packet::SubscribeAck(_)
        | v5::Packet::UnsubscribeAck(_)
        | v5::Packet::PingResponse => {
            Inbound::Unexpected("server-to-client packet sent by a client")
        }
    })
}

fn var_int_len(v: usize) -> usize {
    match v {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

fn put_var_int(dst: &mut BytesMut, mut v: usize) {
    debug_assert!(v <= MAX_REMAINING_LENGTH);
    loop {
        let mut byte = (v % 128) as u8;
        v /= 128;
        if v > 0 {
            byte |= 0x80;
        }
        dst.put_u8(byte);
        if v == 0 {
            break;
        }
    }
}

fn put_str(dst: &mut BytesMut, s: &[u8]) {
    // Strings we forward were decoded from 16-bit length prefixes, so they fit.
    debug_assert!(s.len() <= usize::from(u16::MAX));
    dst.put_u16(s.len() as u16);
    dst.put_slice(s);
}

fn v5_publish_properties_len(p: &OutPublish<'_>) -> usize {
    let props = &p.message.properties;
    let mut len = 0;
    if props.payload_is_utf8 {
        len += 2;
    }
    if p.expiry_secs.is_some() {
        len += 5;
    }
    len += props.content_type.as_ref().map_or(0, |s| 3 + s.len());
    len += props.response_topic.as_ref().map_or(0, |s| 3 + s.len());
    len += props.correlation_data.as_ref().map_or(0, |s| 3 + s.len());
    len += p
        .subscription_ids
        .iter()
        .map(|id| 1 + var_int_len(*id as usize))
        .sum::<usize>();
    len += props
        .user_properties
        .iter()
        .map(|(k, v)| 5 + k.len() + v.len())
        .sum::<usize>();
    len
}

/// Hand-written PUBLISH encoder (v3.1.1 and v5). Writes nothing and returns `false` if the packet
/// would exceed `max_packet_size` (the spec says such a message is dropped for that client).
pub(crate) fn encode_publish(
    version: Version,
    p: &OutPublish<'_>,
    max_packet_size: u32,
    dst: &mut BytesMut,
) -> bool {
    let msg = p.message;
    let props_len = match version {
        Version::V3 => None,
        Version::V5 => Some(v5_publish_properties_len(p)),
    };
    let remaining = 2
        + msg.topic.len()
        + if p.qos == QoS::AtMostOnce { 0 } else { 2 }
        + props_len.map_or(0, |l| var_int_len(l) + l)
        + msg.payload.len();
    let total = 1 + var_int_len(remaining) + remaining;
    if remaining > MAX_REMAINING_LENGTH || total > max_packet_size as usize {
        return false;
    }
    dst.reserve(total);
    let before = dst.len();
    let first = 0x30 | (u8::from(p.dup) << 3) | ((p.qos as u8) << 1) | u8::from(p.retain);
    dst.put_u8(first);
    put_var_int(dst, remaining);
    put_str(dst, msg.topic.as_bytes());
    if p.qos != QoS::AtMostOnce {
        debug_assert!(
            p.packet_id.is_some_and(|id| id != 0),
            "QoS > 0 needs a packet id"
        );
        dst.put_u16(p.packet_id.unwrap_or(0));
    }
    if let Some(props_len) = props_len {
        let props = &msg.properties;
        put_var_int(dst, props_len);
        if props.payload_is_utf8 {
            dst.put_slice(&[0x01, 0x01]);
        }
        if let Some(expiry) = p.expiry_secs {
            dst.put_u8(0x02);
            dst.put_u32(expiry);
        }
        if let Some(s) = &props.content_type {
            dst.put_u8(0x03);
            put_str(dst, s.as_bytes());
        }
        if let Some(s) = &props.response_topic {
            dst.put_u8(0x08);
            put_str(dst, s.as_bytes());
        }
        if let Some(s) = &props.correlation_data {
            dst.put_u8(0x09);
            put_str(dst, s);
        }
        for id in p.subscription_ids {
            dst.put_u8(0x0B);
            put_var_int(dst, *id as usize);
        }
        for (k, v) in &props.user_properties {
            dst.put_u8(0x26);
            put_str(dst, k.as_bytes());
            put_str(dst, v.as_bytes());
        }
    }
    dst.put_slice(&msg.payload);
    debug_assert_eq!(
        dst.len() - before,
        total,
        "PUBLISH size computed and written agree"
    );
    true
}

/// Fuzzing entry point: runs version probing, decoding and our conversion over arbitrary bytes.
pub(crate) fn decode_all(data: &[u8], max_packet_size: u32) -> Vec<Result<Inbound, Violation>> {
    let version = match probe(data) {
        Probe::Mqtt(v) => v,
        _ => return Vec::new(),
    };
    let mut codec = Codec::new(version, max_packet_size);
    let mut buf = BytesMut::from(data);
    let mut out = Vec::new();
    loop {
        match codec.decode(&mut buf) {
            Ok(Some(p)) => out.push(Ok(p)),
            Ok(None) => break,
            Err(v) => {
                out.push(Err(v));
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message(props: PublishProperties) -> Message {
        Message {
            topic: "a/b".into(),
            payload: Bytes::from_static(b"hi"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: props,
        }
    }

    #[test]
    fn publish_golden_bytes_v3_and_v5() {
        let msg = message(PublishProperties::default());
        let p = OutPublish {
            message: &msg,
            qos: QoS::AtLeastOnce,
            retain: true,
            dup: true,
            packet_id: Some(7),
            subscription_ids: &[],
            expiry_secs: None,
        };
        let mut v3 = BytesMut::new();
        assert!(encode_publish(Version::V3, &p, u32::MAX, &mut v3));
        assert_eq!(&v3[..], b"\x3b\x09\x00\x03a/b\x00\x07hi");
        let mut v5 = BytesMut::new();
        let p5 = OutPublish {
            subscription_ids: &[5],
            expiry_secs: Some(9),
            ..p
        };
        assert!(encode_publish(Version::V5, &p5, u32::MAX, &mut v5));
        assert_eq!(
            &v5[..],
            b"\x3b\x11\x00\x03a/b\x00\x07\x07\x02\x00\x00\x00\x09\x0b\x05hi"
        );
    }

    #[test]
    fn publish_over_max_size_writes_nothing() {
        let msg = message(PublishProperties::default());
        let p = OutPublish {
            message: &msg,
            qos: QoS::AtMostOnce,
            retain: false,
            dup: false,
            packet_id: None,
            subscription_ids: &[],
            expiry_secs: None,
        };
        let mut buf = BytesMut::new();
        // 2 fixed + 5 topic + 1 props + 2 payload = 10 bytes.
        assert!(!encode_publish(Version::V5, &p, 9, &mut buf));
        assert!(buf.is_empty());
        assert!(encode_publish(Version::V5, &p, 10, &mut buf));
        assert_eq!(buf.len(), 10);
    }

    #[test]
    fn probe_recognises_levels() {
        assert_eq!(probe(b"\x10\x10\x00\x04MQTT\x05"), Probe::Mqtt(Version::V5));
        assert_eq!(probe(b"\x10\x10\x00\x04MQTT\x04"), Probe::Mqtt(Version::V3));
        assert_eq!(
            probe(b"\x10\x10\x00\x06MQIsdp\x03"),
            Probe::Mqtt(Version::V3)
        );
        assert_eq!(
            probe(b"\x10\x10\x00\x04MQTT\x06"),
            Probe::UnsupportedLevel(6)
        );
        assert_eq!(probe(b"\x10\x10\x00\x04MQ"), Probe::Incomplete);
        assert_eq!(probe(b"\x30\x10"), Probe::NotMqtt);
        assert_eq!(probe(b"\x10\x10\x00\x04XXXX\x05"), Probe::NotMqtt);
    }

    fn arb_props() -> impl Strategy<Value = PublishProperties> {
        (
            any::<bool>(),
            proptest::option::of("[a-z/]{0,12}"),
            proptest::option::of("[a-z/]{1,12}"),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..16)),
            proptest::collection::vec(("[a-z]{0,6}", "[a-z]{0,6}"), 0..3),
        )
            .prop_map(|(utf8, ct, rt, cd, up)| PublishProperties {
                payload_is_utf8: utf8,
                message_expiry_interval: None,
                content_type: ct.map(ByteString::from),
                response_topic: rt.map(ByteString::from),
                correlation_data: cd.map(Bytes::from),
                user_properties: up.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
            })
    }

    proptest! {
        /// What we encode, the codec crate decodes back to the same message.
        #[test]
        fn publish_round_trips_through_the_codec(
            topic in "[a-z]{1,8}(/[a-z]{1,8}){0,3}",
            payload in proptest::collection::vec(any::<u8>(), 0..300),
            qos in 0u8..3,
            retain: bool,
            dup: bool,
            props in arb_props(),
            expiry in proptest::option::of(1u32..100_000),
            sub_ids in proptest::collection::vec(1u32..300_000, 0..3),
        ) {
            let qos = match qos { 0 => QoS::AtMostOnce, 1 => QoS::AtLeastOnce, _ => QoS::ExactlyOnce };
            let msg = Message { topic: topic.clone().into(), payload: payload.clone().into(), qos, retain, properties: props.clone() };
            let packet_id = (qos != QoS::AtMostOnce).then_some(42);
            let dup = dup && qos != QoS::AtMostOnce;
            let p = OutPublish { message: &msg, qos, retain, dup, packet_id, subscription_ids: &sub_ids, expiry_secs: expiry };
            let mut buf = BytesMut::new();
            prop_assert!(encode_publish(Version::V5, &p, u32::MAX, &mut buf));
            let mut codec = v5::Codec::new(0, 0);
            let (decoded, _) = codec.decode(&mut buf).unwrap().unwrap();
            let v5::Packet::Publish(d) = decoded else { panic!("not a publish") };
            prop_assert_eq!(&d.topic[..], &topic[..]);
            prop_assert_eq!(&d.payload[..], &payload[..]);
            prop_assert_eq!(d.packet_id.map(|p| p.get()), packet_id);
            prop_assert_eq!((d.retain, d.dup, to_qos(d.qos)), (retain, dup, qos));
            let dp = d.properties.unwrap();
            prop_assert_eq!(dp.subscription_ids.iter().map(|i| i.get()).collect::<Vec<_>>(), sub_ids);
            prop_assert_eq!(dp.message_expiry_interval.map(|e| e.get()), expiry);
            let mut back = from_v5_props(dp);
            back.message_expiry_interval = None;
            prop_assert_eq!(back, props);
            prop_assert!(buf.is_empty());
        }

        /// The raw-frame check finds the Topic Alias wherever the other properties put it, and
        /// refuses exactly alias 0.
        #[test]
        fn precheck_reads_the_topic_alias_of_any_publish(
            topic in "[a-z/]{0,12}",
            alias in proptest::option::of(0u16..5),
            qos in 0u8..3,
            props in arb_props(),
            expiry in proptest::option::of(1u32..100_000),
            payload in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let publish = rmqtt_codec::types::Publish {
                dup: false,
                retain: false,
                qos: CQoS::try_from(qos).unwrap(),
                topic: topic.into(),
                packet_id: (qos > 0).then(|| NonZeroU16::new(9).unwrap()),
                payload: payload.into(),
                properties: Some(v5::PublishProperties {
                    topic_alias: alias.and_then(NonZeroU16::new),
                    message_expiry_interval: expiry.and_then(NonZeroU32::new),
                    content_type: props.content_type,
                    response_topic: props.response_topic,
                    correlation_data: props.correlation_data,
                    user_properties: props.user_properties,
                    is_utf8_payload: props.payload_is_utf8,
                    ..Default::default()
                }),
            };
            let mut buf = BytesMut::new();
            v5::Codec::new(0, 0).encode(v5::Packet::Publish(Box::new(publish)), &mut buf).unwrap();
            if alias == Some(0) {
                // The codec crate will not write alias 0: put it in by hand, in place of the
                // property list, to check that it is refused.
                let (first, body) = whole_frame(&buf).unwrap();
                let at = 2 + body[1] as usize + if qos == 0 { 0 } else { 2 };
                let mut patched = body[..at].to_vec();
                patched.extend_from_slice(&[3, 0x23, 0, 0]);
                let v = precheck(Version::V5, first, &patched).unwrap_err();
                prop_assert_eq!(v.code, reason::TOPIC_ALIAS_INVALID);
            } else {
                let (first, body) = whole_frame(&buf).unwrap();
                prop_assert_eq!(publish_topic_alias(body, qos), alias);
                prop_assert!(precheck(Version::V5, first, body).is_ok());
            }
        }

        /// Arbitrary bytes never panic the decode path.
        #[test]
        fn decoding_garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut framed = b"\x10\x0d\x00\x04MQTT\x05\x02\x00\x00\x00\x00\x00".to_vec();
            framed.extend_from_slice(&data);
            let _ = decode_all(&framed, 1024);
            let _ = decode_all(&data, 1024);
        }
    }
}
