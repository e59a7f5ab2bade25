//! Application messages as the broker routes them, independent of the codec crate.

use bytes::Bytes;
use bytestring::ByteString;

/// MQTT quality of service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QoS {
    AtMostOnce = 0,
    AtLeastOnce = 1,
    ExactlyOnce = 2,
}

/// The PUBLISH properties that travel with a message from publisher to subscriber unchanged
/// (topic alias and subscription identifiers are per-hop and live elsewhere).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PublishProperties {
    /// Payload Format Indicator = 1 (UTF-8).
    pub payload_is_utf8: bool,
    /// Message Expiry Interval in seconds, as received (the broker decrements it on delivery).
    pub message_expiry_interval: Option<u32>,
    pub content_type: Option<ByteString>,
    pub response_topic: Option<ByteString>,
    pub correlation_data: Option<Bytes>,
    pub user_properties: Vec<(ByteString, ByteString)>,
}

impl PublishProperties {
    /// The first user property named `name`, if any.
    pub fn user_property(&self, name: &str) -> Option<&ByteString> {
        self.user_properties
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }
}

/// One application message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Message {
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    pub properties: PublishProperties,
}
