//! MQTT topic names of the state store (spec §1, §6).

/// The system topic requests are published to.
pub const INVOKE_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";

/// Prefix of every notification topic; clients may not use it (or the invoke topic) as a response topic.
pub const NOTIFY_TOPIC_PREFIX: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

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

/// Whether a request's Response Topic is forbidden (the broker disconnects the client, spec §1).
pub fn is_forbidden_response_topic(topic: &str) -> bool {
    topic == INVOKE_TOPIC || topic.starts_with(NOTIFY_TOPIC_PREFIX)
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
        assert!(is_forbidden_response_topic(INVOKE_TOPIC));
        assert!(is_forbidden_response_topic(NOTIFY_TOPIC_PREFIX));
        assert!(is_forbidden_response_topic(&notify_topic(b"a", b"b")));
        assert!(is_forbidden_response_topic(
            "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8xyz"
        ));
        assert!(!is_forbidden_response_topic("clients/me/response"));
        assert!(!is_forbidden_response_topic(
            "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/x"
        ));
        assert!(!is_forbidden_response_topic(
            "clients/statestore/v1/fa9ae35f-2f64-47cd-9bff-08e2b32a0fe8/x"
        ));
    }
}
