//! Hybrid logical clocks (spec §4): the [`Hlc`] timestamp value and the server's [`HybridClock`].
//!
//! Text form `%015d:%05d:%s` (`001696374425000:00001:StateStore`); order is wall clock, then counter,
//! then node id. The clock never hands out the same `(wall, counter)` twice, so every version it issues
//! is strictly greater than everything it has issued or observed, whatever the node ids.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::ProtocolError;

/// Largest counter: clients parse it as a signed 32-bit integer.
pub const MAX_COUNTER: u32 = i32::MAX as u32;

/// Largest wall clock: clients parse it as a signed 64-bit integer.
pub const MAX_WALL_MS: u64 = i64::MAX as u64;

/// Default for how far ahead of the server clock a request `__ts` or `__ft` may be (spec §4).
pub const DEFAULT_MAX_CLOCK_DRIFT_MS: u64 = 60_000;

/// A hybrid logical clock timestamp. Field order is the comparison order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hlc {
    /// Milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// Logical counter within one `wall_ms`.
    pub counter: u32,
    /// The issuing node; never contains `:`.
    pub node_id: Arc<str>,
}

impl Hlc {
    /// A timestamp; `node_id` must be a valid node id (see [`validate_node_id`]).
    pub fn new(wall_ms: u64, counter: u32, node_id: Arc<str>) -> Hlc {
        debug_assert!(
            validate_node_id(&node_id).is_ok(),
            "HLC node id {node_id:?} contains ':'"
        );
        Hlc {
            wall_ms,
            counter,
            node_id,
        }
    }

    /// Parses the text form, splitting into exactly three parts. Numbers are plain decimal digits
    /// (leading zeros allowed, as the form pads them) within [`MAX_WALL_MS`] / [`MAX_COUNTER`].
    pub fn parse(text: &str) -> Result<Hlc, ProtocolError> {
        let malformed = || ProtocolError::MalformedHlc {
            text: text.to_owned(),
        };
        let mut parts = text.split(':');
        let (Some(wall), Some(counter), Some(node_id), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed());
        };
        let wall_ms = parse_digits(wall)
            .filter(|&w| w <= MAX_WALL_MS)
            .ok_or_else(malformed)?;
        let counter = parse_digits(counter)
            .and_then(|c| u32::try_from(c).ok())
            .filter(|&c| c <= MAX_COUNTER)
            .ok_or_else(malformed)?;
        Ok(Hlc::new(wall_ms, counter, Arc::from(node_id)))
    }
}

fn parse_digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A node id is valid when it does not contain `:` (the text form's separator).
pub fn validate_node_id(node_id: &str) -> Result<(), ProtocolError> {
    if node_id.contains(':') {
        return Err(ProtocolError::InvalidNodeId {
            node_id: node_id.to_owned(),
        });
    }
    Ok(())
}

impl fmt::Display for Hlc {
    /// `{:015}:{:05}:{node}`, formatted by hand into one buffer: every reply's `__ts` and every
    /// notification's `version` is one, and `write!` pads one `write_char` at a time.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 19 digits of a u64 at most + ':' + 10 of a u32 + ':'.
        let mut buf = [0u8; 32];
        let mut len = put_padded(&mut buf, 0, self.wall_ms, 15);
        buf[len] = b':';
        len = put_padded(&mut buf, len + 1, u64::from(self.counter), 5);
        buf[len] = b':';
        let time = std::str::from_utf8(&buf[..=len]).map_err(|_| fmt::Error)?;
        f.write_str(time)?;
        f.write_str(&self.node_id)
    }
}

/// Writes `value` in decimal at `buf[at..]`, zero-padded to `width` digits (more if it needs
/// them); returns the end.
fn put_padded(buf: &mut [u8; 32], at: usize, mut value: u64, width: usize) -> usize {
    let mut digits = [b'0'; 20];
    let mut n = 0;
    while value > 0 || n == 0 {
        digits[digits.len() - 1 - n] = b'0' + (value % 10) as u8;
        value /= 10;
        n += 1;
    }
    let n = n.max(width);
    buf[at..at + n].copy_from_slice(&digits[digits.len() - n..]);
    at + n
}

impl FromStr for Hlc {
    type Err = ProtocolError;

    fn from_str(text: &str) -> Result<Hlc, ProtocolError> {
        Hlc::parse(text)
    }
}

/// The server's clock (Kulkarni et al., "Logical Physical Clocks"), driven by the caller's wall time.
///
/// It holds the high-water mark `(wall_ms, counter)` of everything issued or observed. At counter
/// overflow the logical wall clock advances by 1 ms and the counter restarts at 0, so the counter
/// always fits an `i32` and timestamps stay strictly increasing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridClock {
    node_id: Arc<str>,
    wall_ms: u64,
    counter: u32,
    max_drift_ms: u64,
}

impl HybridClock {
    /// A clock that has issued nothing yet.
    pub fn new(node_id: Arc<str>, max_drift_ms: u64) -> Result<HybridClock, ProtocolError> {
        validate_node_id(&node_id)?;
        Ok(HybridClock {
            node_id,
            wall_ms: 0,
            counter: 0,
            max_drift_ms,
        })
    }

    /// This clock's node id.
    pub fn node_id(&self) -> &Arc<str> {
        &self.node_id
    }

    /// The high-water mark, stamped with this node's id. Restoring it with [`HybridClock::observe`]
    /// on a fresh clock guarantees every later timestamp is greater than every earlier one.
    pub fn high_water(&self) -> Hlc {
        Hlc::new(self.wall_ms, self.counter, self.node_id.clone())
    }

    /// A new timestamp for a local event: greater than all issued or observed, at least `now_ms`.
    pub fn now(&mut self, now_ms: u64) -> Hlc {
        let before = (self.wall_ms, self.counter);
        if now_ms > self.wall_ms {
            self.wall_ms = now_ms;
            self.counter = 0;
        } else if self.counter < MAX_COUNTER {
            self.counter += 1;
        } else {
            self.wall_ms = self.wall_ms.saturating_add(1);
            self.counter = 0;
        }
        debug_assert!((self.wall_ms, self.counter) > before, "HLC did not advance");
        self.high_water()
    }

    /// A new timestamp for receiving `remote` (max rule): greater than `remote` and all issued.
    pub fn update(&mut self, remote: &Hlc, now_ms: u64) -> Hlc {
        self.observe(remote);
        let issued = self.now(now_ms);
        debug_assert!((issued.wall_ms, issued.counter) > (remote.wall_ms, remote.counter));
        issued
    }

    /// Raises the high-water mark to `seen` without issuing anything (replay, restart). Never moves
    /// backwards, whatever the wall clock does.
    pub fn observe(&mut self, seen: &Hlc) {
        if (seen.wall_ms, seen.counter) > (self.wall_ms, self.counter) {
            self.wall_ms = seen.wall_ms;
            self.counter = seen.counter;
        }
        if self.counter > MAX_COUNTER {
            self.wall_ms = self.wall_ms.saturating_add(1);
            self.counter = 0;
        }
    }

    /// Rejects `remote` when it is more than the allowed drift ahead of this server's clock — the
    /// later of `now_ms` and the logical wall clock, so a wall clock that stepped back does not turn
    /// correct clients away.
    pub fn check_drift(&self, remote: &Hlc, now_ms: u64) -> Result<(), ProtocolError> {
        let server_ms = now_ms.max(self.wall_ms);
        let ahead_ms = remote.wall_ms.saturating_sub(server_ms);
        if ahead_ms > self.max_drift_ms {
            return Err(ProtocolError::ClockDrift {
                ahead_ms,
                max_drift_ms: self.max_drift_ms,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hlc(wall_ms: u64, counter: u32, node: &str) -> Hlc {
        Hlc::new(wall_ms, counter, Arc::from(node))
    }

    fn clock() -> HybridClock {
        HybridClock::new(Arc::from("StateStore"), DEFAULT_MAX_CLOCK_DRIFT_MS).unwrap()
    }

    #[test]
    fn golden_text() {
        let t = hlc(1_696_374_425_000, 1, "StateStore");
        assert_eq!(t.to_string(), "001696374425000:00001:StateStore");
        assert_eq!(Hlc::parse("001696374425000:00001:StateStore").unwrap(), t);
        assert_eq!(hlc(5, 123_456, "").to_string(), "000000000000005:123456:");
        assert_eq!(Hlc::parse("5:7:n").unwrap(), hlc(5, 7, "n"));
    }

    #[test]
    fn malformed_texts() {
        for bad in [
            "",
            "1:2",
            "1:2:n:x",
            ":2:n",
            "1::n",
            "-1:2:n",
            "1:-2:n",
            "+1:2:n",
            "1:2147483648:n",
            "9223372036854775808:0:n",
            "99999999999999999999:0:n",
            " 1:2:n",
            "1:2 :n",
        ] {
            let err = Hlc::parse(bad).unwrap_err();
            assert!(matches!(err, ProtocolError::MalformedHlc { .. }), "{bad:?}");
            assert_eq!(err.kind(), crate::ErrorKind::MalformedTimestamp);
        }
        assert!(Hlc::parse("9223372036854775807:2147483647:n").is_ok());
    }

    #[test]
    fn order_is_wall_counter_node() {
        assert!(hlc(1, 9, "z") < hlc(2, 0, "a"));
        assert!(hlc(1, 1, "z") < hlc(1, 2, "a"));
        assert!(hlc(1, 1, "a") < hlc(1, 1, "b"));
    }

    #[test]
    fn node_id_with_colon_is_rejected() {
        assert!(HybridClock::new(Arc::from("a:b"), 1).is_err());
    }

    #[test]
    fn counter_resets_when_wall_advances() {
        let mut c = clock();
        assert_eq!(c.now(100), hlc(100, 0, "StateStore"));
        assert_eq!(c.now(100), hlc(100, 1, "StateStore"));
        assert_eq!(c.now(100), hlc(100, 2, "StateStore"));
        assert_eq!(c.now(101), hlc(101, 0, "StateStore"));
    }

    #[test]
    fn wall_clock_stepping_back_never_goes_back() {
        let mut c = clock();
        let a = c.now(1_000);
        let b = c.now(10);
        assert!(b > a);
        assert_eq!(b, hlc(1_000, 1, "StateStore"));
    }

    #[test]
    fn counter_overflow_advances_logical_wall() {
        let mut c = clock();
        c.observe(&hlc(100, MAX_COUNTER, "other"));
        assert_eq!(c.now(50), hlc(101, 0, "StateStore"));
        let mut c = clock();
        c.observe(&hlc(100, u32::MAX, "other"));
        let next = c.now(50);
        assert!(next.wall_ms > 100 && next.counter <= MAX_COUNTER);
    }

    #[test]
    fn update_is_greater_than_remote_and_local() {
        let mut c = clock();
        c.now(100);
        let remote = hlc(500, 7, "zzz");
        let t = c.update(&remote, 200);
        assert_eq!(t, hlc(500, 8, "StateStore"));
        let t2 = c.update(&hlc(10, 0, "a"), 200);
        assert_eq!(t2, hlc(500, 9, "StateStore"));
        assert_eq!(c.update(&hlc(10, 0, "a"), 900), hlc(900, 0, "StateStore"));
    }

    #[test]
    fn observe_does_not_issue_and_high_water_restores() {
        let mut c = clock();
        c.observe(&hlc(300, 4, "x"));
        assert_eq!(c.high_water(), hlc(300, 4, "StateStore"));
        c.observe(&hlc(200, 9, "x"));
        assert_eq!(c.high_water(), hlc(300, 4, "StateStore"));
        let mut restored = clock();
        restored.observe(&c.high_water());
        assert_eq!(restored.now(0), hlc(300, 5, "StateStore"));
    }

    #[test]
    fn drift_limit() {
        let mut c = clock();
        assert!(c.check_drift(&hlc(160_000, 0, "x"), 100_000).is_ok());
        assert_eq!(
            c.check_drift(&hlc(160_001, 0, "x"), 100_000),
            Err(ProtocolError::ClockDrift {
                ahead_ms: 60_001,
                max_drift_ms: 60_000
            })
        );
        assert!(c.check_drift(&hlc(0, 0, "x"), 100_000).is_ok());
        // Measured against the logical clock when the wall clock stepped back.
        c.now(200_000);
        assert!(c.check_drift(&hlc(260_000, 0, "x"), 100_000).is_ok());
    }

    fn any_hlc() -> impl Strategy<Value = Hlc> {
        (0..=MAX_WALL_MS, 0..=MAX_COUNTER, "[a-zA-Z0-9_-]{0,12}")
            .prop_map(|(w, c, n)| Hlc::new(w, c, Arc::from(n.as_str())))
    }

    proptest! {
        #[test]
        fn text_is_the_padded_form(
            w in prop_oneof![0..1_000u64, 0..=u64::MAX], c in prop_oneof![0..100u32, 0..=u32::MAX],
            n in "[a-z0-9]{0,8}",
        ) {
            let t = Hlc::new(w, c, Arc::from(n.as_str()));
            prop_assert_eq!(t.to_string(), format!("{w:015}:{c:05}:{n}"));
        }

        #[test]
        fn text_round_trip(t in any_hlc()) {
            prop_assert_eq!(Hlc::parse(&t.to_string()).unwrap(), t);
        }

        #[test]
        fn text_order_matches_value_order_for_padded_fields(
            a in (0..999_999_999_999_999u64, 0..99_999u32), b in (0..999_999_999_999_999u64, 0..99_999u32)
        ) {
            let (x, y) = (hlc(a.0, a.1, "n"), hlc(b.0, b.1, "n"));
            prop_assert_eq!(x.cmp(&y), x.to_string().cmp(&y.to_string()));
        }

        #[test]
        fn clock_is_strictly_monotonic(events in prop::collection::vec(
            (0..1_000u64, prop::option::of((0..2_000u64, 0..=MAX_COUNTER))), 1..64)
        ) {
            let mut c = clock();
            let mut last = c.high_water();
            for (now_ms, remote) in events {
                let t = match remote {
                    Some((w, n)) => {
                        let remote = hlc(w, n, "remote");
                        let t = c.update(&remote, now_ms);
                        prop_assert!((t.wall_ms, t.counter) > (remote.wall_ms, remote.counter));
                        t
                    }
                    None => c.now(now_ms),
                };
                prop_assert!(t > last);
                prop_assert!(t.wall_ms >= now_ms);
                prop_assert!(t.counter <= MAX_COUNTER);
                last = t;
            }
        }
    }
}
