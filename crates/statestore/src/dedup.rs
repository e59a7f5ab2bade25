//! The duplicate-request cache (spec §1, "Retried requests").
//!
//! After a reconnect, clients re-send requests that were not acknowledged, with the same correlation data.
//! Executing them again would turn a retried `SET … NX` from `+OK` into `:-1`; so each (client id,
//! correlation data) is remembered until the request's own expiry, and a retry gets the first reply.
//! A retry that arrives while the original is still on its way to the disk waits for it.
//!
//! Time is passed in (`now`), so the cache is deterministic under test.
//!
//! An entry keeps only what the retry's reply needs ([`CachedReply`]), under the request's
//! fixed-width [`RequestId`] (a hash of the client id and correlation data, as in the log record):
//! the reply message and the request's correlation data are slices of packets, and a hundred
//! thousand entries pinning them cost hundreds of megabytes (decision 0015).
//!
//! A write's log record carries its request's identity and first reply ([`RequestRecord`]), and a
//! snapshot the identities of the logged requests the cache holds when it is sealed
//! ([`DedupCache::for_each_logged_request`]); so a restarted node (or one that learned the writes from a
//! replica's log) rebuilds the cache from them ([`RecoveredRequests`], [`DedupCache::restore`]) and
//! answers a retry of a write executed before the crash with its first reply, as the running node
//! would have. Reads and refused writes leave no record: after a restart their retry executes
//! again, which changes nothing.

use std::collections::{hash_map, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use mqstate_protocol::Hlc;
use mqstate_store::{Change, RequestId, RequestRecord};

/// Default bound on remembered requests; the oldest are forgotten first.
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// [`DedupCache::sweep`] gives memory back once the table is this many times larger than needed.
const SHRINK_FACTOR: usize = 4;

/// The first reply to a request, as a retry gets it again (addressed to the retry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedReply {
    pub payload: Bytes,
    /// Its `__ts`.
    pub version: Option<Hlc>,
}

/// What the cache knows of a request.
#[derive(Debug)]
pub enum Seen<W> {
    /// First time: execute it (the waiter is handed back). The caller must later call
    /// [`DedupCache::complete`].
    New(W),
    /// Executed already: re-send this reply and finish the waiter; do not execute.
    Done(CachedReply, W),
    /// Still executing: the caller's waiter has been parked and is returned by `complete`.
    Pending,
}

enum Entry<W> {
    InFlight(Vec<W>),
    /// The reply, and whether the request's change is durable in the log with its identity.
    Done(CachedReply, bool),
}

/// `W` is whatever a retry needs to be finished later (e.g. its deferred PUBACK).
pub struct DedupCache<W> {
    entries: HashMap<RequestId, (Entry<W>, Instant)>,
    /// Keys by insertion; deadlines are not monotonic across clients, so expiry is checked lazily.
    /// With each key its insertion number, ascending: a cursor for
    /// [`DedupCache::for_each_logged_request`] that later insertions and evictions do not move.
    order: VecDeque<(RequestId, Instant, u64)>,
    inserted: u64,
    max_entries: usize,
}

impl<W> DedupCache<W> {
    pub fn new(max_entries: usize) -> Self {
        DedupCache {
            entries: HashMap::new(),
            order: VecDeque::new(),
            inserted: 0,
            max_entries: max_entries.max(1),
        }
    }

    /// Looks a request up; a first sighting is recorded as in flight until `expiry` from `now`.
    pub fn check(&mut self, key: RequestId, expiry: Duration, now: Instant, waiter: W) -> Seen<W> {
        self.evict(now, 1);
        // One lookup (each hashes the key) for both the answer and the insertion.
        let deadline = now + expiry;
        match self.entries.entry(key) {
            hash_map::Entry::Occupied(mut held) => match held.get_mut() {
                (Entry::Done(reply, _), deadline) if *deadline > now => {
                    return Seen::Done(reply.clone(), waiter)
                }
                (Entry::InFlight(waiters), _) => {
                    waiters.push(waiter);
                    return Seen::Pending;
                }
                expired => {
                    *expired = (Entry::InFlight(Vec::new()), deadline);
                }
            },
            hash_map::Entry::Vacant(free) => {
                free.insert((Entry::InFlight(Vec::new()), deadline));
            }
        }
        self.push_order(key, deadline);
        debug_assert!(self.entries.len() <= self.max_entries);
        debug_assert!(
            self.order.len() >= self.entries.len(),
            "every entry is in the order"
        );
        Seen::New(waiter)
    }

    /// Records the reply of an executed request and returns the retries that waited for it.
    /// `logged`: the request's change is durable in the log, recorded with its identity.
    pub fn complete(&mut self, key: RequestId, reply: CachedReply, logged: bool) -> Vec<W> {
        match self.entries.get_mut(&key) {
            Some((entry @ Entry::InFlight(_), _)) => {
                match std::mem::replace(entry, Entry::Done(reply, logged)) {
                    Entry::InFlight(waiters) => waiters,
                    Entry::Done(..) => Vec::new(),
                }
            }
            _ => Vec::new(),
        }
    }

    /// Calls `f` with up to `max` completed requests whose changes are in the log, oldest first,
    /// from after the cursor `after` (`None`: from the first), their deadlines as Unix ms (`now` is
    /// `now_ms`): what a snapshot keeps of the cache, a batch at a time. Returns the cursor of the
    /// next batch, `None` once every request was visited.
    pub fn for_each_logged_request(
        &self,
        after: Option<u64>,
        max: usize,
        now: Instant,
        now_ms: u64,
        mut f: impl FnMut(RequestRecord),
    ) -> Option<u64> {
        let start = after.map_or(0, |after| {
            self.order.partition_point(|(_, _, n)| *n <= after)
        });
        for (visited, (key, deadline, n)) in self.order.iter().skip(start).enumerate() {
            if visited == max {
                return Some(n - 1);
            }
            let Some((Entry::Done(reply, true), d)) = self.entries.get(key) else {
                continue;
            };
            if d != deadline || *d <= now {
                continue;
            }
            let left = u64::try_from(d.duration_since(now).as_millis()).unwrap_or(u64::MAX);
            f(RequestRecord {
                id: *key,
                expires_at_ms: now_ms.saturating_add(left),
                reply: reply.payload.clone(),
                reply_ts: reply.version.clone(),
            });
        }
        None
    }

    fn push_order(&mut self, key: RequestId, deadline: Instant) {
        self.inserted += 1;
        self.order.push_back((key, deadline, self.inserted));
    }

    /// Fills the cache with the requests recovered from a snapshot and the log (oldest first) at a
    /// start: a retry of one of them gets its first reply until its own expiry.
    pub fn restore(&mut self, recovered: RecoveredRequests, now: Instant) {
        let now_ms = recovered.now_ms;
        // Grown once, not doubled (and rehashed) on the way: a start may bring the whole bound.
        let room = recovered.len().min(self.max_entries);
        self.entries.reserve(room);
        self.order.reserve(room);
        for request in recovered.requests {
            let left = Duration::from_millis(request.expires_at_ms.saturating_sub(now_ms));
            let deadline = now + left;
            self.evict(now, 1);
            let key = request.id;
            // In both the snapshot and a record replayed after it: the same request.
            if self.entries.contains_key(&key) {
                continue;
            }
            let reply = CachedReply {
                payload: request.reply,
                version: request.reply_ts,
            };
            self.push_order(key, deadline);
            self.entries
                .insert(key, (Entry::Done(reply, true), deadline));
            debug_assert!(self.entries.len() <= self.max_entries);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Forgets expired requests and, once few are left, gives back the memory a busy period grew:
    /// the table never shrinks by itself, and full it takes tens of megabytes.
    pub fn sweep(&mut self, now: Instant) {
        self.evict(now, 0);
        if self.entries.capacity() > SHRINK_FACTOR * self.entries.len().max(1) {
            self.entries.shrink_to_fit();
        }
        if self.order.capacity() > SHRINK_FACTOR * self.order.len().max(1) {
            self.order.shrink_to_fit();
        }
    }

    /// Forgets expired requests, and the oldest ones while fewer than `room` more would fit.
    fn evict(&mut self, now: Instant, room: usize) {
        while let Some((key, deadline, _)) = self.order.front() {
            let over_capacity = self.entries.len() + room > self.max_entries;
            if *deadline > now && !over_capacity {
                break;
            }
            let in_flight = matches!(self.entries.get(key), Some((Entry::InFlight(_), _)));
            // An in-flight entry is never dropped by time (its reply is still coming); only a full
            // cache forgets it, and then a retry would execute again — the bound wins over memory.
            if in_flight && !over_capacity {
                break;
            }
            if let Some((key, deadline, _)) = self.order.pop_front() {
                if self.entries.get(&key).is_some_and(|(_, d)| *d == deadline) {
                    self.entries.remove(&key);
                }
            }
        }
    }
}

/// The requests of a snapshot and of the records replayed after it, as a start finds them, for
/// [`DedupCache::restore`]: those already expired are dropped, and at most as many as the cache
/// holds are kept (the newest).
#[derive(Debug)]
pub struct RecoveredRequests {
    max_entries: usize,
    /// The wall clock at the start, in Unix ms.
    now_ms: u64,
    requests: VecDeque<RequestRecord>,
}

impl RecoveredRequests {
    pub fn new(max_entries: usize, now_ms: u64) -> RecoveredRequests {
        RecoveredRequests {
            max_entries: max_entries.max(1),
            now_ms,
            requests: VecDeque::new(),
        }
    }

    /// A request found in the snapshot or the log, in log order.
    pub fn add(&mut self, request: RequestRecord) {
        if request.expires_at_ms <= self.now_ms {
            return;
        }
        if self.requests.len() == self.max_entries {
            self.requests.pop_front();
        }
        self.requests.push_back(request);
    }

    /// Takes the request of a replayed record, if it has one, and returns the change to apply.
    pub fn replayed(&mut self, change: Change) -> Change {
        match change {
            Change::Requested { request, change } => {
                self.add(request);
                *change
            }
            change => change,
        }
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn id(client_id: &str, correlation: &[u8]) -> RequestId {
        RequestId::of(client_id, correlation)
    }

    fn reply(tag: &'static str) -> CachedReply {
        CachedReply {
            payload: Bytes::from_static(tag.as_bytes()),
            version: None,
        }
    }

    #[test]
    fn retry_after_completion_gets_the_first_reply() {
        let mut cache = DedupCache::<u32>::new(10);
        let (c, corr, t0) = (
            Arc::<str>::from("c"),
            Bytes::from_static(b"x"),
            Instant::now(),
        );
        assert!(matches!(
            cache.check(id(&c, &corr), Duration::from_secs(5), t0, 1),
            Seen::New(_)
        ));
        assert!(cache
            .complete(id(&c, &corr), reply("+OK"), false)
            .is_empty());
        match cache.check(
            id(&c, &corr),
            Duration::from_secs(5),
            t0 + Duration::from_secs(1),
            2,
        ) {
            Seen::Done(m, 2) => assert_eq!(&m.payload[..], b"+OK"),
            other => panic!("expected cached reply, got {other:?}"),
        }
        // Another client with the same correlation data is a different request.
        assert!(matches!(
            cache.check(id("d", &corr), Duration::from_secs(5), t0, 3),
            Seen::New(_)
        ));
    }

    #[test]
    fn retry_while_in_flight_waits_for_the_original() {
        let mut cache = DedupCache::<u32>::new(10);
        let (c, corr, t0) = (
            Arc::<str>::from("c"),
            Bytes::from_static(b"x"),
            Instant::now(),
        );
        assert!(matches!(
            cache.check(id(&c, &corr), Duration::from_secs(5), t0, 1),
            Seen::New(_)
        ));
        assert!(matches!(
            cache.check(id(&c, &corr), Duration::from_secs(5), t0, 2),
            Seen::Pending
        ));
        assert_eq!(cache.complete(id(&c, &corr), reply("+OK"), false), vec![2]);
    }

    #[test]
    fn entries_expire_with_the_request_and_the_bound_holds() {
        let mut cache = DedupCache::<u32>::new(2);
        let (c, t0) = (Arc::<str>::from("c"), Instant::now());
        let corr = |i: u8| Bytes::copy_from_slice(&[i]);
        for i in 0..2 {
            assert!(matches!(
                cache.check(id(&c, &corr(i)), Duration::from_secs(1), t0, 0),
                Seen::New(_)
            ));
            cache.complete(id(&c, &corr(i)), reply("+OK"), false);
        }
        // Past the expiry the same request executes again.
        assert!(matches!(
            cache.check(
                id(&c, &corr(0)),
                Duration::from_secs(1),
                t0 + Duration::from_secs(2),
                0
            ),
            Seen::New(_)
        ));
        assert!(cache.len() <= 2);
        for i in 10..50 {
            cache.check(
                id(&c, &corr(i)),
                Duration::from_secs(100),
                t0 + Duration::from_secs(3),
                0,
            );
            assert!(
                cache.len() <= 2,
                "cache grew past its bound: {}",
                cache.len()
            );
        }
    }

    #[test]
    fn a_sweep_forgets_expired_requests_and_gives_the_table_back() {
        let mut cache = DedupCache::<u32>::new(1000);
        let (c, t0) = (Arc::<str>::from("c"), Instant::now());
        for i in 0..1000u32 {
            let corr = i.to_be_bytes();
            cache.check(id(&c, &corr), Duration::from_secs(1), t0, 0);
            cache.complete(id(&c, &corr), reply("+OK"), false);
        }
        let grown = cache.entries.capacity();
        cache.sweep(t0 + Duration::from_millis(500));
        assert_eq!(cache.len(), 1000, "nothing expired yet");
        cache.sweep(t0 + Duration::from_secs(2));
        assert!(cache.is_empty());
        assert!(cache.entries.capacity() < grown / SHRINK_FACTOR);
        assert!(cache.order.capacity() < 1000 / SHRINK_FACTOR);
    }

    #[test]
    fn logged_requests_survive_a_restart_and_expire_as_before() {
        let mut cache = DedupCache::<u32>::new(10);
        let (c, t0, ms0) = (Arc::<str>::from("c"), Instant::now(), 1_000_000);
        let expiry = Duration::from_secs(10);
        for (corr, logged) in [(&b"w"[..], true), (b"r", false)] {
            cache.check(id(&c, corr), expiry, t0, 0);
            cache.complete(id(&c, corr), reply(":1"), logged);
        }
        cache.check(id(&c, b"in flight"), expiry, t0, 0);
        let mut requests = Vec::new();
        let end = cache.for_each_logged_request(None, 10, t0 + Duration::from_secs(4), ms0, |r| {
            requests.push(r)
        });
        assert_eq!(end, None);
        assert_eq!(requests.len(), 1, "only the completed write: {requests:?}");
        assert_eq!(
            (requests[0].id, requests[0].expires_at_ms),
            (id(&c, b"w"), ms0 + 6_000)
        );

        // A start 2 s later: the snapshot's request, plus the same one replayed, plus one expired.
        let mut recovered = RecoveredRequests::new(10, ms0 + 2_000);
        recovered.add(requests[0].clone());
        recovered.add(requests[0].clone());
        recovered.add(expired_request());
        assert_eq!(recovered.len(), 2);
        let t1 = Instant::now();
        let mut restarted = DedupCache::<u32>::new(10);
        restarted.restore(recovered, t1);
        assert_eq!(restarted.len(), 1);
        match restarted.check(id(&c, b"w"), expiry, t1 + Duration::from_secs(3), 7) {
            Seen::Done(m, 7) => assert_eq!(&m.payload[..], b":1"),
            other => panic!("expected the first reply, got {other:?}"),
        }
        // Its expiry is the original one (4 s left at the restart), not a new one.
        assert!(matches!(
            restarted.check(id(&c, b"w"), expiry, t1 + Duration::from_secs(5), 8),
            Seen::New(8)
        ));
    }

    #[test]
    fn logged_requests_come_in_batches_that_evictions_do_not_shift() {
        let mut cache = DedupCache::<u32>::new(100);
        let (c, t0) = (Arc::<str>::from("c"), Instant::now());
        let add = |cache: &mut DedupCache<u32>, i: u8, secs| {
            cache.check(id(&c, &[i]), Duration::from_secs(secs), t0, 0);
            cache.complete(id(&c, &[i]), reply(":1"), true);
        };
        for i in 0..5 {
            add(&mut cache, i, if i < 2 { 1 } else { 100 });
        }
        let mut seen = Vec::new();
        let mut batch = |cache: &DedupCache<u32>, after| {
            cache.for_each_logged_request(after, 2, t0, 0, |r| seen.push(r.id))
        };
        let cursor = batch(&cache, None);
        assert!(cursor.is_some());
        // The first two expire and are evicted, a sixth comes: the cursor still points after them.
        cache.sweep(t0 + Duration::from_secs(2));
        add(&mut cache, 5, 100);
        let mut cursor = cursor;
        while let Some(after) = cursor {
            cursor = batch(&cache, Some(after));
        }
        let expected: Vec<_> = (0..6).map(|i| id(&c, &[i])).collect();
        assert_eq!(seen, expected);
    }

    #[test]
    fn recovered_requests_keep_the_newest_within_the_bound() {
        let mut recovered = RecoveredRequests::new(2, 0);
        for i in 1..=3u8 {
            let mut request = expired_request();
            request.id = id("c", &[i]);
            request.expires_at_ms = 10;
            recovered.add(request);
        }
        let kept: Vec<RequestId> = recovered.requests.iter().map(|r| r.id).collect();
        assert_eq!(kept, vec![id("c", &[2]), id("c", &[3])]);
    }

    /// A request whose expiry passed long ago.
    fn expired_request() -> RequestRecord {
        RequestRecord {
            id: id("c", b"old"),
            expires_at_ms: 5,
            reply: Bytes::from_static(b"+OK\r\n"),
            reply_ts: None,
        }
    }
}
