//! MQTT topic names of the state store (spec §1, §6).

/// The state store's service id: every topic that contains it belongs to the state store.
pub const SERVICE_ID: &str = "FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

/// The system topic requests are published to.
pub const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";

/// Prefix of every notification topic; clients may not use it (or the invoke topic) as a response topic.
pub const NOTIFY_TOPIC_PREFIX: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

/// The topic of the persistent-notification admin RPC (JSON requests, MQTT 5 request/response): the
/// server claims it, `mqstate topic …` publishes to it.
pub const NOTIFY_ADMIN_TOPIC: &str = "mqstate/admin/v1/notify";

/// `{prefix}/{HEX(client_id)}/command/notify/{HEX(key)}` with upper-case base16 (RFC 4648).
///
/// The topic is twice as long as client id and key together; the caller must check it against the
/// MQTT topic limit (65,535 bytes) before publishing, which bounds observable keys to about 32 KB.
pub fn notify_topic(client_id: &[u8], key: &[u8]) -> String {
    let mut topic =
        String::with_capacity(NOTIFY_TOPIC_PREFIX.len() + 17 + 2 * (client_id.len() + key.len()));
    topic.push_str(NOTIFY_TOPIC_PREFIX);
    topic.push('/');
    push_hex_upper(&mut topic, client_id);
    topic.push_str("/command/notify/");
    push_hex_upper(&mut topic, key);
    topic
}

/// The key a notification topic ([`notify_topic`]) names, if `topic` is one.
pub fn notified_key(topic: &str) -> Option<Vec<u8>> {
    let rest = topic.strip_prefix(NOTIFY_TOPIC_PREFIX)?.strip_prefix('/')?;
    let (_, key) = rest.split_once("/command/notify/")?;
    if key.len() % 2 != 0 {
        return None;
    }
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    };
    key.as_bytes()
        .chunks(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

/// Whether `client_id` may not use `topic` as a request's Response Topic (the client is disconnected).
///
/// Spec §1 forbids the invoke topic and the notification namespace. On top of that, a response topic
/// naming the state store (the SDKs use `clients/{client id}/services/statestore/v1/{SERVICE_ID}/…`)
/// must be under the client's own `clients/{client id}/`: otherwise a client could have the state store
/// publish replies into another client's RPC flow.
pub fn is_forbidden_response_topic(topic: &str, client_id: &str) -> bool {
    topic == INVOKE_TOPIC
        || topic.starts_with(NOTIFY_TOPIC_PREFIX)
        || (names_service(topic) && !is_under_own_clients_topic(topic, client_id))
}

/// `topic.contains(SERVICE_ID)`. Every request's response topic is asked this three times (its
/// envelope, its reply's authorization, the broker's rules): `str::contains` sets up a Two-Way
/// searcher at each call, hundreds of instructions for a topic of a hundred bytes, where the id's
/// first byte is rare enough in topics that comparing at each occurrence of it costs a few dozen.
fn names_service(topic: &str) -> bool {
    let (bytes, id) = (topic.as_bytes(), SERVICE_ID.as_bytes());
    let Some(last_start) = bytes.len().checked_sub(id.len()) else {
        return false;
    };
    bytes[..=last_start]
        .iter()
        .enumerate()
        .any(|(i, &b)| b == id[0] && bytes[i..].starts_with(id))
}

fn is_under_own_clients_topic(topic: &str, client_id: &str) -> bool {
    topic
        .strip_prefix("clients/")
        .and_then(|rest| rest.strip_prefix(client_id))
        .is_some_and(|rest| rest.starts_with('/'))
}

/// Whether clients are forbidden to publish on `topic`: every topic naming the state store except the
/// invoke topic. Only the state store publishes notifications and replies there, so a client cannot
/// spoof either.
pub fn is_reserved_for_service(topic: &str) -> bool {
    topic != INVOKE_TOPIC && names_service(topic)
}

/// Whether subscribing `client_id` to `filter` targets another client's notification topics: the
/// filter names the notification namespace and its client level is not the client's own hex id (a
/// wildcard there would reach everyone's). Broader filters (`#`, `clients/#`) are not refused:
/// notifications are delivered into the observer's session directly, never routed by topic, so they
/// cannot leak through a subscription.
pub fn is_foreign_notification_filter(filter: &str, client_id: &[u8]) -> bool {
    let Some(rest) = filter.strip_prefix(NOTIFY_TOPIC_PREFIX) else {
        return false;
    };
    let Some(rest) = rest.strip_prefix('/') else {
        // The prefix itself, or the prefix glued to more text: not a topic of ours unless it is
        // exactly the namespace root.
        return rest.is_empty();
    };
    let level = rest.split('/').next().unwrap_or_default();
    let mut own = String::with_capacity(2 * client_id.len());
    push_hex_upper(&mut own, client_id);
    level != own
}

fn push_hex_upper(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    for &byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_notification_topic_names_its_key() {
        let topic = notify_topic(b"client", b"k\x00\xff");
        assert_eq!(notified_key(&topic), Some(b"k\x00\xff".to_vec()));
        assert_eq!(notified_key(&notify_topic(b"c", b"")), Some(Vec::new()));
        assert_eq!(notified_key("t/command/notify/41"), None);
        assert_eq!(
            notified_key(&format!("{NOTIFY_TOPIC_PREFIX}/63/command/notify/4")),
            None
        );
        assert_eq!(
            notified_key(&format!("{NOTIFY_TOPIC_PREFIX}/63/command/notify/4g")),
            None
        );
    }

    proptest! {
        #[test]
        fn names_service_is_contains(
            before in "[A-F0-9/-]{0,60}",
            cut in 0..=SERVICE_ID.len(),
            after in "[A-F0-9/-]{0,20}",
            whole in any::<bool>(),
        ) {
            // The id whole or cut short, among characters it is made of.
            let id = if whole { SERVICE_ID } else { &SERVICE_ID[..cut] };
            let topic = format!("{before}{id}{after}");
            prop_assert_eq!(names_service(&topic), topic.contains(SERVICE_ID));
        }
    }

    #[test]
    fn golden_notify_topic() {
        assert_eq!(
            notify_topic(b"client-id1", b"SOMEKEY"),
            "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/636C69656E742D696431/command/notify/534F4D454B4559"
        );
        assert_eq!(
            notify_topic(b"c", &[0x00, 0xab, 0xff]),
            "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/63/command/notify/00ABFF"
        );
    }

    #[test]
    fn forbidden_response_topics() {
        let forbidden = |t: &str| is_forbidden_response_topic(t, "me");
        assert!(forbidden(INVOKE_TOPIC));
        assert!(forbidden(NOTIFY_TOPIC_PREFIX));
        assert!(forbidden(&notify_topic(b"a", b"b")));
        assert!(forbidden(&notify_topic(b"me", b"b")));
        assert!(forbidden(
            "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8xyz"
        ));
        assert!(!forbidden("clients/me/response"));
        assert!(!forbidden(
            "clients/statestore/v1/fa9ae35f-2f64-47cd-9bff-08e2b32a0fe8/x"
        ));
        // The SDKs' response topic: only the client's own.
        let sdk = |id: &str| {
            format!("clients/{id}/services/statestore/v1/{SERVICE_ID}/command/invoke/response")
        };
        assert!(!forbidden(&sdk("me")));
        assert!(forbidden(&sdk("other")));
        assert!(forbidden(&sdk("mek")), "a longer id is another client");
        assert!(forbidden(
            "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/x"
        ));
    }

    #[test]
    fn reserved_topics_are_the_service_namespace_except_invoke() {
        assert!(!is_reserved_for_service(INVOKE_TOPIC));
        assert!(is_reserved_for_service(&notify_topic(b"a", b"k")));
        assert!(is_reserved_for_service(&format!(
            "clients/x/services/statestore/v1/{SERVICE_ID}/command/invoke/response"
        )));
        assert!(is_reserved_for_service(&format!("{INVOKE_TOPIC}/x")));
        assert!(!is_reserved_for_service("clients/x/response"));
        assert!(!is_reserved_for_service(
            "statestore/v1/other/command/invoke"
        ));
    }

    #[test]
    fn notification_filters_must_name_the_own_client() {
        let own = format!("{NOTIFY_TOPIC_PREFIX}/6D65/command/notify/+");
        assert!(!is_foreign_notification_filter(&own, b"me"));
        assert!(!is_foreign_notification_filter(
            &format!("{NOTIFY_TOPIC_PREFIX}/6D65/#"),
            b"me"
        ));
        for foreign in [
            format!("{NOTIFY_TOPIC_PREFIX}/6F74686572/command/notify/+"),
            format!("{NOTIFY_TOPIC_PREFIX}/+/command/notify/+"),
            format!("{NOTIFY_TOPIC_PREFIX}/#"),
            NOTIFY_TOPIC_PREFIX.to_owned(),
            format!("{NOTIFY_TOPIC_PREFIX}/6d65/#"),
        ] {
            assert!(is_foreign_notification_filter(&foreign, b"me"), "{foreign}");
        }
        assert!(!is_foreign_notification_filter("#", b"me"));
        assert!(!is_foreign_notification_filter("clients/#", b"me"));
    }
}
