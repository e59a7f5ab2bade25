//! Broker limits and tunables. Every limit the broker enforces is a field here.

use std::time::Duration;

/// Configuration of a [`crate::Broker`]. Plain data: the binary fills it from its own settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Largest packet (fixed header included) accepted from a client; advertised as Maximum Packet
    /// Size. Larger packets get DISCONNECT 0x95. Default 1 MiB.
    pub max_packet_size: u32,
    /// Receive Maximum advertised to clients: QoS 1/2 publishes a client may have unacknowledged
    /// towards the broker. Exceeding it gets DISCONNECT 0x93. Default 1024.
    pub receive_maximum: u16,
    /// Topic Alias Maximum advertised to clients (client -> server aliases). 0 disables. Default 64.
    pub topic_alias_maximum: u16,
    /// Messages queued per session (connected or not) before the overflow policy applies. Default 1000.
    pub max_queued_messages: usize,
    /// Topic and payload bytes queued per session before the overflow policy applies (a larger
    /// single message still enters an empty queue). Default 64 MiB.
    pub max_queued_bytes: usize,
    /// Cap on QoS 1/2 messages in flight towards one client, on top of the client's own Receive
    /// Maximum. Default 256.
    pub max_inflight: u16,
    /// Longest Session Expiry Interval granted, in seconds; longer requests are clamped and the
    /// clamped value is returned in CONNACK. MQTT 3.1.1 persistent sessions get this value.
    /// Default 7 days.
    pub session_expiry_max_secs: u32,
    /// If set, the longest keep-alive a client may use, in seconds (Mosquitto's `max_keepalive`): an
    /// MQTT 5 client asking for more, or for none (0), is told this value in CONNACK's Server Keep
    /// Alive, which every MQTT 5 CONNACK then carries; an MQTT 3.1.1 client, which cannot be told,
    /// is refused (CONNACK 0x02 Identifier rejected, as Mosquitto does). Default none.
    pub server_keep_alive_secs: Option<u16>,
    /// Keep-alive tolerance as a multiple of the keep-alive, in tenths (15 = 1.5x, as the spec asks).
    pub keep_alive_tolerance_tenths: u32,
    /// Time allowed between TCP accept and a complete CONNECT. Default 10 s.
    pub connect_timeout: Duration,
    /// How long a new connection waits for the old one to hand its session over on takeover before
    /// taking it by force. Default 5 s.
    pub takeover_timeout: Duration,
    /// Time allowed to write DISCONNECT and close on shutdown or protocol error. Default 2 s.
    pub close_timeout: Duration,
    /// Longest client identifier accepted, in bytes. Default 256.
    pub max_client_id_len: usize,
    /// Capacity of a claimed topic's service inbox; a full inbox back-pressures the publisher.
    /// Default 1024.
    pub service_inbox_capacity: usize,
    /// Largest number of bytes encoded into the write buffer before it is flushed; bounds the
    /// per-connection write buffer. Default 64 KiB.
    pub write_batch_bytes: usize,
    /// Whether `$share/group/filter` subscriptions are accepted (else SUBACK 0x9E). Default true.
    pub shared_subscriptions: bool,
    /// Failed authentications allowed from one source address before its CONNECTs are refused
    /// (0x87) without being checked; 0 disables the limit. Default 30: enough that a site behind one
    /// NAT address survives a few mistyped passwords and a misconfigured client (docs/security.md,
    /// "Failed logins").
    pub auth_failure_burst: u32,
    /// A rate-limited address gets one more attempt per this interval. Default 2 s (≈ 1,800 guesses
    /// an hour at most, each against an argon2id hash).
    pub auth_failure_refill: Duration,
    /// Source addresses whose failures are remembered at once; bounds the limiter's memory.
    /// Default 65,536.
    pub auth_failure_tracked_max: usize,
    /// Open sockets at most, handshakes in progress included; more are refused right after accept
    /// (CONNACK 0x97 when a refusal slot is free, else just closed). 0 disables. Default 100,000.
    pub max_connections: usize,
    /// Open sockets at most from one source address; refused like `max_connections`. 0 disables
    /// (the default: many devices may share one NAT address).
    pub max_connections_per_address: usize,
    /// Subscriptions one session may hold; filters beyond get SUBACK 0x97. 0 disables. Default 1000.
    pub max_subscriptions_per_session: usize,
    /// Longest topic name or filter, in bytes: PUBLISH (and will) topics beyond get DISCONNECT
    /// (CONNACK) 0x90, filters SUBACK 0x8F. Default 65,535 (the MQTT maximum).
    pub max_topic_length: usize,
    /// Most `/`-separated levels in a topic name or filter; answered like `max_topic_length`.
    /// Default 128.
    pub max_topic_levels: usize,
    /// A client whose socket does not take a write batch (at most `write_batch_bytes`) within this
    /// time is disconnected: the socket is closed (no DISCONNECT: the stream may end mid-packet and
    /// the client is not reading) and its session follows normal expiry. Default 30 s.
    pub slow_consumer_timeout: Duration,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            max_packet_size: 1024 * 1024,
            receive_maximum: 1024,
            topic_alias_maximum: 64,
            max_queued_messages: 1000,
            max_queued_bytes: 64 * 1024 * 1024,
            max_inflight: 256,
            session_expiry_max_secs: 7 * 24 * 3600,
            server_keep_alive_secs: None,
            keep_alive_tolerance_tenths: 15,
            connect_timeout: Duration::from_secs(10),
            takeover_timeout: Duration::from_secs(5),
            close_timeout: Duration::from_secs(2),
            max_client_id_len: 256,
            service_inbox_capacity: 1024,
            write_batch_bytes: 64 * 1024,
            shared_subscriptions: true,
            auth_failure_burst: 30,
            auth_failure_refill: Duration::from_secs(2),
            auth_failure_tracked_max: 65_536,
            max_connections: 100_000,
            max_connections_per_address: 0,
            max_subscriptions_per_session: 1000,
            max_topic_length: 65_535,
            max_topic_levels: 128,
            slow_consumer_timeout: Duration::from_secs(30),
        }
    }
}

impl BrokerConfig {
    /// The keep-alive deadline for a negotiated keep-alive, or `None` when keep-alive is off (0).
    pub(crate) fn keep_alive_deadline(&self, keep_alive_secs: u16) -> Option<Duration> {
        if keep_alive_secs == 0 {
            return None;
        }
        let millis = u64::from(keep_alive_secs) * 100 * u64::from(self.keep_alive_tolerance_tenths);
        Some(Duration::from_millis(millis))
    }

    /// Whether a topic name or filter is within `max_topic_length` and `max_topic_levels`.
    pub(crate) fn topic_within_limits(&self, topic: &str) -> bool {
        topic.len() <= self.max_topic_length
            && topic.bytes().filter(|b| *b == b'/').count() < self.max_topic_levels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_is_one_and_a_half_times() {
        let cfg = BrokerConfig::default();
        assert_eq!(cfg.keep_alive_deadline(10), Some(Duration::from_secs(15)));
        assert_eq!(cfg.keep_alive_deadline(0), None);
    }

    #[test]
    fn topic_limits_count_bytes_and_levels() {
        let cfg = BrokerConfig {
            max_topic_length: 8,
            max_topic_levels: 3,
            ..BrokerConfig::default()
        };
        assert!(cfg.topic_within_limits("a/b/c"));
        assert!(!cfg.topic_within_limits("a/b/c/d"));
        assert!(cfg.topic_within_limits("abcdefgh"));
        assert!(!cfg.topic_within_limits("abcdefghi"));
    }
}
