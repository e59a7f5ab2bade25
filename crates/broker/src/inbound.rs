//! Per-connection checks on inbound PUBLISH that need connection state: client -> server topic
//! aliases.

use std::collections::HashMap;

use bytestring::ByteString;

use crate::codec::{reason, Violation};

/// Topic aliases a client set on this connection (at most the Topic Alias Maximum we advertised).
/// The map is boxed and made on first use: most connections never set an alias, and an empty
/// `HashMap` inline would cost every one of them 48 bytes.
pub(crate) struct TopicAliases {
    max: u16,
    #[allow(clippy::box_collection)]
    by_alias: Option<Box<HashMap<u16, ByteString>>>,
}

impl TopicAliases {
    pub(crate) fn new(max: u16) -> Self {
        Self {
            max,
            by_alias: None,
        }
    }

    /// The topic a PUBLISH is for, registering or looking up its alias.
    pub(crate) fn resolve(
        &mut self,
        topic: ByteString,
        alias: Option<u16>,
    ) -> Result<ByteString, Violation> {
        match alias {
            None if topic.is_empty() => Err(Violation::new(
                reason::PROTOCOL_ERROR,
                "PUBLISH with an empty topic and no topic alias",
            )),
            None => Ok(topic),
            Some(a) if a == 0 || a > self.max => Err(Violation::new(
                reason::TOPIC_ALIAS_INVALID,
                "topic alias 0 or above the Topic Alias Maximum",
            )),
            Some(a) if topic.is_empty() => self
                .by_alias
                .as_ref()
                .and_then(|m| m.get(&a))
                .cloned()
                .ok_or(Violation::new(
                    reason::PROTOCOL_ERROR,
                    "PUBLISH uses a topic alias that was never set",
                )),
            Some(a) => {
                let by_alias = self.by_alias.get_or_insert_with(Box::default);
                debug_assert!(by_alias.len() <= usize::from(self.max));
                by_alias.insert(a, topic.clone());
                Ok(topic)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_set_use_and_reject() {
        let mut a = TopicAliases::new(2);
        assert_eq!(a.resolve("x/y".into(), Some(1)).unwrap(), "x/y");
        assert_eq!(a.resolve("".into(), Some(1)).unwrap(), "x/y");
        assert_eq!(
            a.resolve("".into(), Some(2)).unwrap_err().code,
            reason::PROTOCOL_ERROR
        );
        assert_eq!(
            a.resolve("z".into(), Some(3)).unwrap_err().code,
            reason::TOPIC_ALIAS_INVALID
        );
        assert_eq!(
            a.resolve("z".into(), Some(0)).unwrap_err().code,
            reason::TOPIC_ALIAS_INVALID
        );
        assert_eq!(
            a.resolve("".into(), None).unwrap_err().code,
            reason::PROTOCOL_ERROR
        );
        assert_eq!(
            TopicAliases::new(0)
                .resolve("t".into(), Some(1))
                .unwrap_err()
                .code,
            reason::TOPIC_ALIAS_INVALID
        );
    }
}
