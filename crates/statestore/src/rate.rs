//! State-store requests per second per client: a token bucket per client id. A client over its rate
//! gets `-ERR the quota has been exceeded` (the AIO error text for configured limits) instead of its
//! request being executed, so one client cannot take the executor from the others. Decision 0011.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use mqstate_broker::limits::{Rate, TokenBucket};

/// Buckets beyond this many are pruned of the full ones (clients idle for a second or more).
const PRUNE_ABOVE: usize = 65_536;

pub(crate) struct RequestRates {
    /// `None`: no limit.
    rate: Option<Rate>,
    /// Per client: its bucket and whether its running out was logged already.
    buckets: HashMap<Arc<str>, (TokenBucket, bool)>,
}

impl RequestRates {
    /// `per_second` requests a second per client, with a burst of one second's worth; 0 disables.
    pub(crate) fn new(per_second: u32) -> Self {
        RequestRates {
            rate: Rate::per_second(per_second),
            buckets: HashMap::new(),
        }
    }

    /// Whether `client_id` may have one more request executed now.
    pub(crate) fn allow(&mut self, client_id: &Arc<str>, now: Instant) -> bool {
        let Some(rate) = self.rate else {
            return true;
        };
        if self.buckets.len() >= PRUNE_ABOVE && !self.buckets.contains_key(client_id) {
            self.buckets
                .retain(|_, (b, _)| b.available(rate, now) < rate.burst);
        }
        let (bucket, warned) = self
            .buckets
            .entry(client_id.clone())
            .or_insert_with(|| (TokenBucket::full(rate, now), false));
        if bucket.try_take(rate, now) {
            *warned = false;
            return true;
        }
        if !*warned {
            *warned = true;
            tracing::warn!(%client_id, per_second = rate.burst, "state store requests over the per-client rate limit; answering -ERR the quota has been exceeded");
        }
        false
    }

    /// The client's connection ended: its bucket is not needed any more.
    pub(crate) fn forget(&mut self, client_id: &str) {
        self.buckets.remove(client_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn each_client_has_its_own_rate() {
        let t0 = Instant::now();
        let mut r = RequestRates::new(2);
        let a: Arc<str> = "a".into();
        let b: Arc<str> = "b".into();
        assert!(r.allow(&a, t0));
        assert!(r.allow(&a, t0));
        assert!(!r.allow(&a, t0));
        assert!(r.allow(&b, t0), "another client is not affected");
        assert!(r.allow(&a, t0 + Duration::from_millis(500)));
        r.forget("a");
        assert!(!r.buckets.contains_key("a"));
    }

    #[test]
    fn zero_is_unlimited() {
        let t0 = Instant::now();
        let mut r = RequestRates::new(0);
        let a: Arc<str> = "a".into();
        for _ in 0..10_000 {
            assert!(r.allow(&a, t0));
        }
        assert!(r.buckets.is_empty());
    }
}
