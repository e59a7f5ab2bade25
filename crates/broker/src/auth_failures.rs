//! Failed authentications per source address: a token bucket per IP. Each failure takes a token; an
//! address with no token left is refused without asking the authenticator (so password guessing gets
//! slow and cannot keep the CPU busy with hash verifications); tokens come back one per refill interval.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::limits::{Rate, TokenBucket};

/// What [`AuthFailures::check`] says about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allowed,
    /// Out of tokens; `first` is true for the first refusal since the address ran out (log it loudly).
    Limited {
        first: bool,
    },
}

pub(crate) struct AuthFailures {
    /// `None`: no limit.
    rate: Option<Rate>,
    max_tracked: usize,
    /// Per address: its bucket and whether its running out was already logged.
    buckets: Mutex<HashMap<IpAddr, (TokenBucket, bool)>>,
}

impl AuthFailures {
    /// `burst` failures are allowed at once (0 disables the limit); one more each `refill`. At most
    /// `max_tracked` addresses are remembered.
    pub(crate) fn new(burst: u32, refill: Duration, max_tracked: usize) -> Self {
        AuthFailures {
            rate: (burst > 0).then_some(Rate { burst, refill }),
            max_tracked: max_tracked.max(1),
            buckets: Mutex::default(),
        }
    }

    pub(crate) fn check(&self, ip: IpAddr, now: Instant) -> Verdict {
        let Some(rate) = self.rate else {
            return Verdict::Allowed;
        };
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let Some((bucket, warned)) = buckets.get_mut(&ip) else {
            return Verdict::Allowed;
        };
        if bucket.available(rate, now) > 0 {
            *warned = false;
            Verdict::Allowed
        } else {
            let first = !*warned;
            *warned = true;
            Verdict::Limited { first }
        }
    }

    pub(crate) fn record_failure(&self, ip: IpAddr, now: Instant) {
        let Some(rate) = self.rate else {
            return;
        };
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if !buckets.contains_key(&ip) && buckets.len() >= self.max_tracked {
            // Forget addresses that have earned all their tokens back; if none has, forget one at
            // random rather than grow without bound.
            buckets.retain(|_, (b, _)| b.available(rate, now) < rate.burst);
            if buckets.len() >= self.max_tracked {
                if let Some(victim) = buckets.keys().next().copied() {
                    buckets.remove(&victim);
                }
            }
        }
        let (bucket, _) = buckets
            .entry(ip)
            .or_insert((TokenBucket::full(rate, now), false));
        bucket.try_take(rate, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn burst_then_refused_then_refilled() {
        let t0 = Instant::now();
        let f = AuthFailures::new(3, Duration::from_secs(10), 100);
        for _ in 0..3 {
            assert_eq!(f.check(A, t0), Verdict::Allowed);
            f.record_failure(A, t0);
        }
        assert_eq!(f.check(A, t0), Verdict::Limited { first: true });
        assert_eq!(f.check(A, t0), Verdict::Limited { first: false });
        assert_eq!(
            f.check(B, t0),
            Verdict::Allowed,
            "other addresses unaffected"
        );
        assert_eq!(
            f.check(A, t0 + Duration::from_secs(9)),
            Verdict::Limited { first: false }
        );
        assert_eq!(f.check(A, t0 + Duration::from_secs(10)), Verdict::Allowed);
        f.record_failure(A, t0 + Duration::from_secs(10));
        assert_eq!(
            f.check(A, t0 + Duration::from_secs(11)),
            Verdict::Limited { first: true }
        );
        // Long quiet: full burst again, never more.
        let later = t0 + Duration::from_secs(1000);
        for _ in 0..3 {
            assert_eq!(f.check(A, later), Verdict::Allowed);
            f.record_failure(A, later);
        }
        assert!(matches!(f.check(A, later), Verdict::Limited { .. }));
    }

    #[test]
    fn zero_burst_disables_and_tracking_is_bounded() {
        let t0 = Instant::now();
        let off = AuthFailures::new(0, Duration::from_secs(1), 10);
        for _ in 0..100 {
            off.record_failure(A, t0);
        }
        assert_eq!(off.check(A, t0), Verdict::Allowed);

        let f = AuthFailures::new(1, Duration::from_secs(60), 2);
        for i in 0..50u8 {
            f.record_failure(IpAddr::V4(std::net::Ipv4Addr::new(192, 168, 0, i)), t0);
        }
        assert!(f.buckets.lock().unwrap().len() <= 2);
    }
}
