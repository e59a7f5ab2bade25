//! The RPC envelope (spec §1): what a request must carry, and the properties of every reply.
//!
//! Envelope problems are not state-store errors: a forbidden response topic disconnects the client, a
//! request without a response topic cannot be answered at all, a response topic the client may not
//! publish on itself is refused with PUBACK 0x87 (nothing is published there), QoS 0 or missing
//! correlation data get the AIO RPC convention's `__stat` 400 instead of a RESP payload, and an
//! unsupported `__protVer` gets `__stat` 505. Only a well-formed envelope reaches command execution.
//! `docs/statestore.md` lists the checks in order.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use bytestring::ByteString;
use mqstate_broker::{Message, PublishProperties, QoS};
use mqstate_protocol::{topic, ErrorKind, Hlc};
use mqstate_store::RequestId;

/// Protocol version the server speaks and announces in `__protVer`.
pub const PROTOCOL_VERSION: &str = "1.0";
/// Major protocol versions the server accepts in a request's `__protVer` (announced in
/// `__supProtMajVer`, space-separated, on a 505 reply).
pub const SUPPORTED_MAJOR_VERSIONS: &[u16] = &[1];
/// Content type of requests and replies.
pub const CONTENT_TYPE: &str = "application/octet-stream";
/// How long a reply stays valid when the request carried no Message Expiry Interval.
pub const DEFAULT_REQUEST_EXPIRY: Duration = Duration::from_secs(10);

/// User property names of the AIO RPC convention.
pub mod prop {
    pub const STATUS: &str = "__stat";
    pub const STATUS_MESSAGE: &str = "__stMsg";
    pub const PROTOCOL_VERSION: &str = "__protVer";
    pub const SOURCE_ID: &str = "__srcId";
    pub const TIMESTAMP: &str = "__ts";
    pub const FENCING_TOKEN: &str = "__ft";
    pub const SUPPORTED_MAJOR_VERSIONS: &str = "__supProtMajVer";
    pub const REQUEST_PROTOCOL_VERSION: &str = "__requestProtVer";
    pub const PERSISTENCE: &str = "aio-persistence";
}

/// A request whose envelope is well formed.
#[derive(Debug, Clone)]
pub struct Request {
    /// The identity the duplicate-request cache and the log know the request by.
    pub id: RequestId,
    pub client_id: Arc<str>,
    pub response_topic: ByteString,
    pub correlation_data: Bytes,
    pub payload: Bytes,
    /// `__ts`: absent, or parsed (a malformed one is answered `-ERR malformed timestamp`).
    pub timestamp: Result<Option<Hlc>, ErrorKind>,
    /// `__ft`: absent, or parsed.
    pub fencing_token: Result<Option<Hlc>, ErrorKind>,
    /// `aio-persistence: true` (spec §8).
    pub persist: bool,
    /// How long the client waits for the reply (its Message Expiry Interval).
    pub expiry: Duration,
}

/// Whether the reply to a request may be published on its Response Topic (the service asks the
/// broker: see [`crate::service`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyTopic {
    Allowed,
    /// Not a topic name a PUBLISH may carry (wildcards, NUL, beyond the topic limits).
    Invalid,
    /// The requester may not publish there itself: replying there would make the state store a
    /// confused deputy.
    NotAuthorized,
}

/// Why a publish on the invoke topic is not a request we execute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The response topic is the invoke topic, a notification topic or another client's state-store
    /// response topic: disconnect the client.
    ForbiddenResponseTopic(ByteString),
    /// The response topic is invalid or the requester may not publish there: refuse the publish
    /// (PUBACK 0x90 / 0x87), publish nothing.
    ResponseTopicRefused {
        response_topic: ByteString,
        why: ReplyTopic,
    },
    /// Nowhere to answer: drop and count.
    NoResponseTopic,
    /// Answer with `__stat` 400 and this `__stMsg`.
    BadRequest {
        response_topic: ByteString,
        correlation_data: Option<Bytes>,
        message: &'static str,
    },
    /// `__protVer` names a major version we do not speak (or does not parse): answer with
    /// `__stat` 505 and the supported major versions, as the AIO RPC executors do.
    UnsupportedVersion {
        response_topic: ByteString,
        correlation_data: Bytes,
        requested: ByteString,
    },
}

impl Request {
    /// Checks the envelope of a publish on the invoke topic. `reply_topic` judges the Response
    /// Topic once the built-in rules allowed it; nothing is published on a topic it refuses, not
    /// even a `__stat` 400.
    pub fn from_message(
        client_id: Arc<str>,
        message: &Message,
        reply_topic: impl FnOnce(&str) -> ReplyTopic,
    ) -> Result<Request, Rejection> {
        let props = &message.properties;
        let Some(response_topic) = props.response_topic.clone() else {
            return Err(Rejection::NoResponseTopic);
        };
        if topic::is_forbidden_response_topic(&response_topic, &client_id) {
            return Err(Rejection::ForbiddenResponseTopic(response_topic));
        }
        match reply_topic(&response_topic) {
            ReplyTopic::Allowed => {}
            why => {
                return Err(Rejection::ResponseTopicRefused {
                    response_topic,
                    why,
                })
            }
        }
        if message.qos == QoS::AtMostOnce {
            return Err(Rejection::BadRequest {
                response_topic,
                correlation_data: props.correlation_data.clone(),
                message: "state store requests must be published with QoS 1",
            });
        }
        let Some(correlation_data) = props.correlation_data.clone() else {
            return Err(Rejection::BadRequest {
                response_topic,
                correlation_data: None,
                message: "state store requests must carry Correlation Data",
            });
        };
        if let Some(requested) = props.user_property(prop::PROTOCOL_VERSION) {
            if !is_supported_version(requested) {
                return Err(Rejection::UnsupportedVersion {
                    response_topic,
                    correlation_data,
                    requested: requested.clone(),
                });
            }
        }
        Ok(Request {
            id: RequestId::of(&client_id, &correlation_data),
            client_id,
            response_topic,
            correlation_data,
            payload: message.payload.clone(),
            timestamp: parse_hlc_property(props, prop::TIMESTAMP),
            fencing_token: parse_hlc_property(props, prop::FENCING_TOKEN),
            persist: props
                .user_property(prop::PERSISTENCE)
                .is_some_and(|v| v.eq_ignore_ascii_case("true")),
            expiry: props
                .message_expiry_interval
                .map(|secs| Duration::from_secs(u64::from(secs)))
                .unwrap_or(DEFAULT_REQUEST_EXPIRY),
        })
    }
}

/// Whether `__protVer` text `major.minor` (both 16-bit decimal numbers, as the SDKs parse it)
/// names a major version we speak. An absent `__protVer` means 1.0 (the SDKs' default).
pub fn is_supported_version(text: &str) -> bool {
    text.split_once('.')
        .and_then(|(major, minor)| Some((major.parse::<u16>().ok()?, minor.parse::<u16>().ok()?)))
        .is_some_and(|(major, _)| SUPPORTED_MAJOR_VERSIONS.contains(&major))
}

fn parse_hlc_property(props: &PublishProperties, name: &str) -> Result<Option<Hlc>, ErrorKind> {
    match props.user_property(name) {
        None => Ok(None),
        Some(text) => Hlc::parse(text)
            .map(Some)
            .map_err(|_| ErrorKind::MalformedTimestamp),
    }
}

/// Builds replies: one place knows which properties every reply carries.
#[derive(Debug, Clone)]
pub struct ReplyBuilder {
    server_id: ByteString,
}

impl ReplyBuilder {
    pub fn new(server_id: &str) -> ReplyBuilder {
        ReplyBuilder {
            server_id: ByteString::from(server_id),
        }
    }

    /// A state-store reply (errors included: `__stat` is 200 on every one, spec §1). `version` is the
    /// `__ts` to attach, absent on GET misses. `expiry` is what remains of the request's expiry.
    pub fn reply(
        &self,
        request: &Request,
        payload: Bytes,
        version: Option<&Hlc>,
        expiry: Duration,
    ) -> Message {
        let mut user_properties = self.common_properties("200");
        if let Some(version) = version {
            user_properties.push((
                ByteString::from_static(prop::TIMESTAMP),
                ByteString::from(version.to_string()),
            ));
        }
        self.message(
            request.response_topic.clone(),
            Some(request.correlation_data.clone()),
            payload,
            user_properties,
            expiry,
        )
    }

    /// The AIO RPC `__stat` 400 reply to a request whose envelope is unusable.
    pub fn bad_request(
        &self,
        response_topic: ByteString,
        correlation_data: Option<Bytes>,
        message: &str,
    ) -> Message {
        let mut user_properties = self.common_properties("400");
        user_properties.push((
            ByteString::from_static(prop::STATUS_MESSAGE),
            ByteString::from(message),
        ));
        self.message(
            response_topic,
            correlation_data,
            Bytes::new(),
            user_properties,
            DEFAULT_REQUEST_EXPIRY,
        )
    }

    /// The AIO RPC `__stat` 505 reply to a request whose `__protVer` we do not speak: it names the
    /// major versions we do (`__supProtMajVer`) and echoes the requested one (`__requestProtVer`).
    pub fn unsupported_version(
        &self,
        response_topic: ByteString,
        correlation_data: Bytes,
        requested: ByteString,
    ) -> Message {
        let supported = SUPPORTED_MAJOR_VERSIONS
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        let message = format!(
            "the state store only supports major protocol versions {supported}, but the request's __protVer is {requested:?}"
        );
        let mut user_properties = self.common_properties("505");
        user_properties.extend([
            (
                ByteString::from_static(prop::STATUS_MESSAGE),
                ByteString::from(message),
            ),
            (
                ByteString::from_static(prop::SUPPORTED_MAJOR_VERSIONS),
                ByteString::from(supported),
            ),
            (
                ByteString::from_static(prop::REQUEST_PROTOCOL_VERSION),
                requested,
            ),
        ]);
        self.message(
            response_topic,
            Some(correlation_data),
            Bytes::new(),
            user_properties,
            DEFAULT_REQUEST_EXPIRY,
        )
    }

    /// With room for the two properties a reply adds at most (replies are built once per
    /// request: the names are static, not copied).
    fn common_properties(&self, status: &'static str) -> Vec<(ByteString, ByteString)> {
        let mut properties = Vec::with_capacity(5);
        properties.extend([
            (
                ByteString::from_static(prop::STATUS),
                ByteString::from_static(status),
            ),
            (
                ByteString::from_static(prop::PROTOCOL_VERSION),
                ByteString::from_static(PROTOCOL_VERSION),
            ),
            (
                ByteString::from_static(prop::SOURCE_ID),
                self.server_id.clone(),
            ),
        ]);
        properties
    }

    fn message(
        &self,
        topic: ByteString,
        correlation_data: Option<Bytes>,
        payload: Bytes,
        user_properties: Vec<(ByteString, ByteString)>,
        expiry: Duration,
    ) -> Message {
        Message {
            topic,
            payload,
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: PublishProperties {
                payload_is_utf8: false,
                // Never 0: an expiry of 0 seconds is "no expiry" on the wire.
                message_expiry_interval: Some(
                    u32::try_from(expiry.as_secs().max(1)).unwrap_or(u32::MAX),
                ),
                content_type: Some(ByteString::from_static(CONTENT_TYPE)),
                response_topic: None,
                correlation_data,
                user_properties,
            },
        }
    }

    /// A key notification for one observer (spec §6).
    pub fn notification(
        &self,
        client_id: &str,
        key: &[u8],
        payload: Bytes,
        version: &Hlc,
    ) -> Message {
        Message {
            topic: ByteString::from(topic::notify_topic(client_id.as_bytes(), key)),
            payload,
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: PublishProperties {
                content_type: Some(ByteString::from_static(CONTENT_TYPE)),
                user_properties: vec![(
                    ByteString::from_static(prop::TIMESTAMP),
                    ByteString::from(version.to_string()),
                )],
                ..PublishProperties::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(_: &str) -> ReplyTopic {
        ReplyTopic::Allowed
    }

    fn request_message(qos: QoS, response: Option<&str>, correlation: Option<&[u8]>) -> Message {
        Message {
            topic: topic::INVOKE_TOPIC.into(),
            payload: Bytes::from_static(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"),
            qos,
            retain: false,
            properties: PublishProperties {
                response_topic: response.map(ByteString::from),
                correlation_data: correlation.map(Bytes::copy_from_slice),
                message_expiry_interval: Some(7),
                user_properties: vec![
                    ("__ts".into(), "001696374425000:00001:client".into()),
                    ("__ft".into(), "garbage".into()),
                    ("aio-persistence".into(), "true".into()),
                ],
                ..PublishProperties::default()
            },
        }
    }

    #[test]
    fn well_formed_request_is_parsed_with_its_properties() {
        let msg = request_message(
            QoS::AtLeastOnce,
            Some("client/resp"),
            Some(b"0123456789abcdef"),
        );
        let req = Request::from_message("c1".into(), &msg, allowed).unwrap();
        assert_eq!(&*req.response_topic, "client/resp");
        assert_eq!(&req.correlation_data[..], b"0123456789abcdef");
        assert_eq!(
            req.timestamp.unwrap().unwrap().to_string(),
            "001696374425000:00001:client"
        );
        assert_eq!(req.fencing_token, Err(ErrorKind::MalformedTimestamp));
        assert!(req.persist);
        assert_eq!(req.expiry, Duration::from_secs(7));
    }

    #[test]
    fn envelope_rejections_follow_the_spec() {
        let no_topic = request_message(QoS::AtLeastOnce, None, Some(b"c"));
        assert_eq!(
            Request::from_message("c".into(), &no_topic, allowed).unwrap_err(),
            Rejection::NoResponseTopic
        );

        for forbidden in [
            topic::INVOKE_TOPIC.to_owned(),
            format!("{}/x/command/notify/y", topic::NOTIFY_TOPIC_PREFIX),
        ] {
            let msg = request_message(QoS::AtLeastOnce, Some(&forbidden), Some(b"c"));
            assert!(matches!(
                Request::from_message("c".into(), &msg, allowed),
                Err(Rejection::ForbiddenResponseTopic(t)) if *t == *forbidden
            ));
        }

        let qos0 = request_message(QoS::AtMostOnce, Some("r"), Some(b"c"));
        assert!(matches!(
            Request::from_message("c".into(), &qos0, allowed),
            Err(Rejection::BadRequest { .. })
        ));
        let no_corr = request_message(QoS::AtLeastOnce, Some("r"), None);
        assert!(matches!(
            Request::from_message("c".into(), &no_corr, allowed),
            Err(Rejection::BadRequest {
                correlation_data: None,
                ..
            })
        ));
    }

    #[test]
    fn a_refused_response_topic_is_refused_before_anything_is_answered_there() {
        // Even a QoS 0 request without correlation data (which would get a __stat 400 there).
        let msg = request_message(QoS::AtMostOnce, Some("sensors/secret/door"), None);
        for why in [ReplyTopic::NotAuthorized, ReplyTopic::Invalid] {
            let mut asked = None;
            let refused = Request::from_message("c".into(), &msg, |t| {
                asked = Some(t.to_owned());
                why
            });
            assert_eq!(
                refused.unwrap_err(),
                Rejection::ResponseTopicRefused {
                    response_topic: "sensors/secret/door".into(),
                    why
                }
            );
            assert_eq!(asked.as_deref(), Some("sensors/secret/door"));
        }
    }

    #[test]
    fn protocol_versions_are_checked_by_major() {
        for ok in ["1.0", "1.7", "1.65535"] {
            assert!(is_supported_version(ok), "{ok}");
        }
        for bad in [
            "99.0", "2.0", "0.9", "1", "1.x", "", "one.zero", "70000.0", " 1.0",
        ] {
            assert!(!is_supported_version(bad), "{bad}");
        }
        let mut msg = request_message(QoS::AtLeastOnce, Some("r"), Some(b"corr"));
        msg.properties
            .user_properties
            .push(("__protVer".into(), "99.0".into()));
        assert_eq!(
            Request::from_message("c".into(), &msg, allowed).unwrap_err(),
            Rejection::UnsupportedVersion {
                response_topic: "r".into(),
                correlation_data: Bytes::from_static(b"corr"),
                requested: "99.0".into(),
            }
        );
        let reply = ReplyBuilder::new("s").unsupported_version(
            "r".into(),
            Bytes::from_static(b"corr"),
            "99.0".into(),
        );
        let p = &reply.properties;
        assert_eq!(p.user_property("__stat").map(|v| &**v), Some("505"));
        assert_eq!(p.user_property("__supProtMajVer").map(|v| &**v), Some("1"));
        assert_eq!(
            p.user_property("__requestProtVer").map(|v| &**v),
            Some("99.0")
        );
        assert!(p.user_property("__stMsg").is_some());
        assert_eq!(p.correlation_data.as_deref(), Some(&b"corr"[..]));
    }

    #[test]
    fn replies_carry_stat_200_version_and_echoed_correlation() {
        let msg = request_message(QoS::AtLeastOnce, Some("client/resp"), Some(b"corr"));
        let req = Request::from_message("c1".into(), &msg, allowed).unwrap();
        let builder = ReplyBuilder::new("mqstate");
        let version = Hlc::parse("000000000000005:00000:mqstate").unwrap();
        let reply = builder.reply(
            &req,
            Bytes::from_static(b"+OK\r\n"),
            Some(&version),
            Duration::from_millis(300),
        );
        assert_eq!(&*reply.topic, "client/resp");
        assert_eq!(reply.qos, QoS::AtLeastOnce);
        let p = &reply.properties;
        assert_eq!(p.correlation_data.as_deref(), Some(&b"corr"[..]));
        assert_eq!(p.user_property("__stat").map(|v| &**v), Some("200"));
        assert_eq!(p.user_property("__protVer").map(|v| &**v), Some("1.0"));
        assert_eq!(p.user_property("__srcId").map(|v| &**v), Some("mqstate"));
        assert_eq!(
            p.user_property("__ts").map(|v| &**v),
            Some("000000000000005:00000:mqstate")
        );
        assert_eq!(p.content_type.as_deref(), Some(CONTENT_TYPE));
        assert_eq!(
            p.message_expiry_interval,
            Some(1),
            "sub-second remainder rounds up to 1 s, never 0"
        );

        let miss = builder.reply(
            &req,
            Bytes::from_static(b"$-1\r\n"),
            None,
            Duration::from_secs(5),
        );
        assert_eq!(
            miss.properties.user_property("__ts"),
            None,
            "GET miss has no __ts"
        );
    }

    #[test]
    fn bad_request_reply_is_stat_400_with_message() {
        let reply = ReplyBuilder::new("s").bad_request("r".into(), None, "why");
        assert_eq!(
            reply.properties.user_property("__stat").map(|v| &**v),
            Some("400")
        );
        assert_eq!(
            reply.properties.user_property("__stMsg").map(|v| &**v),
            Some("why")
        );
        assert!(reply.payload.is_empty());
    }

    #[test]
    fn notification_topic_is_upper_hex_and_carries_ts() {
        let v = Hlc::parse("000000000000005:00001:s").unwrap();
        let n = ReplyBuilder::new("s").notification("client-id1", b"SOMEKEY", Bytes::new(), &v);
        assert!(n
            .topic
            .ends_with("/636C69656E742D696431/command/notify/534F4D454B4559"));
        assert_eq!(
            n.properties.user_property("__ts").map(|v| &**v),
            Some("000000000000005:00001:s")
        );
        assert!(!n.retain);
    }
}
