//! Counters and token buckets behind the limits on hostile or runaway clients: open connections
//! (total and per source address, handshakes included) and rates. Plain data and a mutex: no I/O, and
//! time comes in as an argument. Decision 0011.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Refused sockets answered with a CONNACK at once; beyond, refused sockets are closed unanswered.
pub(crate) const MAX_REFUSALS_IN_PROGRESS: usize = 64;

/// How fast a [`TokenBucket`] fills: `burst` tokens at most, one more every `refill`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub burst: u32,
    pub refill: Duration,
}

impl Rate {
    /// `n` a second with a burst of one second's worth; `None` (no limit) for 0.
    pub fn per_second(n: u32) -> Option<Rate> {
        (n > 0).then(|| Rate {
            burst: n,
            refill: Duration::from_secs(1) / n,
        })
    }
}

/// A token bucket; the [`Rate`] is passed in so that many buckets share one.
#[derive(Debug, Clone, Copy)]
pub struct TokenBucket {
    tokens: u32,
    /// When the bucket last gained (or started counting towards) a token.
    since: Instant,
}

impl TokenBucket {
    pub fn full(rate: Rate, now: Instant) -> Self {
        TokenBucket {
            tokens: rate.burst,
            since: now,
        }
    }

    /// Tokens available at `now`.
    pub fn available(&mut self, rate: Rate, now: Instant) -> u32 {
        self.refill(rate, now);
        self.tokens
    }

    /// Takes a token if there is one.
    pub fn try_take(&mut self, rate: Rate, now: Instant) -> bool {
        self.refill(rate, now);
        if self.tokens == 0 {
            return false;
        }
        if self.tokens >= rate.burst {
            // The refill clock starts with the first token taken from a full bucket.
            self.since = now;
        }
        self.tokens -= 1;
        true
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        if rate.refill.is_zero() {
            self.tokens = rate.burst;
            return;
        }
        let elapsed = now.saturating_duration_since(self.since);
        let earned = elapsed.as_nanos() / rate.refill.as_nanos();
        if earned == 0 {
            return;
        }
        let earned = u32::try_from(earned).unwrap_or(u32::MAX);
        self.tokens = self.tokens.saturating_add(earned).min(rate.burst);
        self.since = if self.tokens >= rate.burst {
            now
        } else {
            self.since + rate.refill * earned
        };
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// `max_connections` sockets are open.
    Total,
    /// `max_connections_per_address` sockets are open from this address.
    PerAddress,
}

impl Refused {
    /// The reason string of the refusing CONNACK (and the log line).
    pub(crate) fn why(self) -> &'static str {
        match self {
            Refused::Total => "the server's connection limit is reached",
            Refused::PerAddress => "too many connections from this address",
        }
    }
}

#[derive(Default)]
struct Open {
    total: usize,
    /// Only tracked when there is a per-address limit.
    per_address: HashMap<IpAddr, usize>,
}

/// Open sockets, counted from accept (so handshakes in progress count) until the connection task
/// ends; a [`ConnectionPermit`] is one of them.
pub(crate) struct Connections {
    max_total: usize,
    max_per_address: usize,
    open: Mutex<Open>,
    /// Refused sockets currently being answered with a CONNACK (see [`Connections::begin_refusal`]).
    refusing: AtomicUsize,
    max_refusing: usize,
    /// Whether refusals since the last admitted socket were logged already (one warning per run).
    warned: AtomicBool,
}

impl Connections {
    /// 0 disables a limit. At most `max_refusing` refused sockets are answered at once.
    pub(crate) fn new(max_total: usize, max_per_address: usize, max_refusing: usize) -> Self {
        Connections {
            max_total,
            max_per_address,
            open: Mutex::default(),
            refusing: AtomicUsize::new(0),
            max_refusing,
            warned: AtomicBool::new(false),
        }
    }

    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnectionPermit, Refused> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if self.max_total > 0 && open.total >= self.max_total {
            return Err(Refused::Total);
        }
        if self.max_per_address > 0 {
            let n = open.per_address.entry(ip).or_insert(0);
            if *n >= self.max_per_address {
                return Err(Refused::PerAddress);
            }
            *n += 1;
        }
        open.total += 1;
        if self.warned.load(Ordering::Relaxed) {
            self.warned.store(false, Ordering::Relaxed);
        }
        Ok(ConnectionPermit {
            connections: Arc::clone(self),
            ip,
        })
    }

    /// True for the first refusal since a socket was last admitted: log that one loudly.
    pub(crate) fn first_refusal(&self) -> bool {
        !self.warned.swap(true, Ordering::Relaxed)
    }

    /// Open sockets (admitted, not yet closed).
    pub(crate) fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// A slot for answering one refused socket with a refusing CONNACK, or `None` when enough are
    /// being answered already (the socket is then just closed): a flood of refused sockets must
    /// cost no more than a small fixed number of tasks.
    pub(crate) fn begin_refusal(self: &Arc<Self>) -> Option<RefusalSlot> {
        let taken = self
            .refusing
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_refusing).then_some(n + 1)
            });
        taken.ok().map(|_| RefusalSlot(Arc::clone(self)))
    }

    fn release(&self, ip: IpAddr) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.total = open.total.saturating_sub(1);
        if self.max_per_address > 0 {
            if let Some(n) = open.per_address.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    open.per_address.remove(&ip);
                }
            }
        }
    }
}

/// One admitted socket; dropping it (when the connection task ends) frees its place.
pub(crate) struct ConnectionPermit {
    connections: Arc<Connections>,
    ip: IpAddr,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.connections.release(self.ip);
    }
}

/// One refused socket being answered; dropping it frees the slot.
pub(crate) struct RefusalSlot(Arc<Connections>);

impl Drop for RefusalSlot {
    fn drop(&mut self) {
        self.0.refusing.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn per_second_rate_refills_continuously() {
        let rate = Rate::per_second(4).unwrap();
        assert!(Rate::per_second(0).is_none());
        let t0 = Instant::now();
        let mut b = TokenBucket::full(rate, t0);
        for _ in 0..4 {
            assert!(b.try_take(rate, t0));
        }
        assert!(!b.try_take(rate, t0));
        assert!(!b.try_take(rate, t0 + Duration::from_millis(249)));
        assert!(b.try_take(rate, t0 + Duration::from_millis(250)));
        // A long pause gives the burst back, never more.
        assert_eq!(b.available(rate, t0 + Duration::from_secs(100)), 4);
    }

    #[test]
    fn connections_are_counted_until_the_permit_drops() {
        let c = Arc::new(Connections::new(3, 2, 1));
        let a1 = c.admit(A).unwrap();
        let _a2 = c.admit(A).unwrap();
        assert_eq!(c.admit(A).err(), Some(Refused::PerAddress));
        let _b1 = c.admit(B).unwrap();
        assert_eq!(c.admit(B).err(), Some(Refused::Total));
        drop(a1);
        assert_eq!(c.open(), 2);
        let _a3 = c.admit(A).unwrap();
        assert_eq!(c.open(), 3);
    }

    #[test]
    fn addresses_are_forgotten_when_their_last_socket_closes() {
        let c = Arc::new(Connections::new(0, 1, 1));
        for i in 0..100u8 {
            drop(
                c.admit(IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 0, i)))
                    .unwrap(),
            );
        }
        assert!(c.open.lock().unwrap().per_address.is_empty());
        assert_eq!(c.open(), 0);
    }

    #[test]
    fn refusal_slots_are_bounded() {
        let c = Arc::new(Connections::new(1, 0, 2));
        let s1 = c.begin_refusal().unwrap();
        let _s2 = c.begin_refusal().unwrap();
        assert!(c.begin_refusal().is_none());
        drop(s1);
        assert!(c.begin_refusal().is_some());
    }
}
