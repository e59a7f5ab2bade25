//! Time behind a port: the one place the server reads the system clock.
//!
//! A [`Clock`] answers two questions: the wall time (milliseconds since the Unix epoch; what is
//! written to logs, compared with HLC timestamps and survives a restart) and the monotonic time
//! (what deadlines, timers and rate limits count with). Components are handed an
//! `Arc<dyn Clock>` and never call `SystemTime::now` or `Instant::now` themselves, so a test or a
//! simulation can run a node on a clock it controls (decision 0029).
//!
//! The monotonic time of every clock here is tokio's (`tokio::time::Instant::now`): it is the time
//! base of the timers the server sleeps on, and a test that pauses tokio's clock
//! (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) moves it. Outside a runtime,
//! or without paused time, it is the system's monotonic clock.

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Wall and monotonic time. Implementations are cheap to call (once per message on hot paths).
pub trait Clock: Send + Sync + fmt::Debug {
    /// Wall-clock time: milliseconds since the Unix epoch (0 for a clock set before it).
    fn now_ms(&self) -> u64;

    /// Monotonic time on tokio's clock (see the crate docs): never goes backwards.
    fn now(&self) -> Instant;

    /// [`Clock::now`] as a tokio instant, for `sleep_until` and friends.
    fn tokio_now(&self) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.now())
    }
}

/// A shared clock, as components hold it.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock: what production runs on.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// The operating system's wall clock and tokio's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// Another clock with its wall time shifted by an offset that can change while it runs: a node
/// whose clock is skewed (the robustness suite's per-node offset), or stepped by NTP. The
/// monotonic time is the base clock's: skew changes what time it is, not how fast time passes.
#[derive(Debug)]
pub struct OffsetClock {
    base: SharedClock,
    offset_ms: AtomicI64,
}

impl OffsetClock {
    pub fn new(base: SharedClock, offset_ms: i64) -> Self {
        OffsetClock {
            base,
            offset_ms: AtomicI64::new(offset_ms),
        }
    }

    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }

    /// Sets the offset (a step of the wall clock: it may go backwards).
    pub fn set_offset_ms(&self, offset_ms: i64) {
        self.offset_ms.store(offset_ms, Ordering::Relaxed);
    }
}

impl Clock for OffsetClock {
    fn now_ms(&self) -> u64 {
        shift(self.base.now_ms(), self.offset_ms())
    }

    fn now(&self) -> Instant {
        self.base.now()
    }
}

/// A clock for tests and simulation: its wall time starts where the test says and then advances
/// with the monotonic time, which is tokio's — so under paused time nothing moves unless the test
/// advances it (`tokio::time::advance`), and both move together. [`ManualClock::set_ms`] steps the
/// wall time alone (a clock jump).
#[derive(Debug)]
pub struct ManualClock {
    origin: Instant,
    origin_ms: AtomicU64,
}

impl ManualClock {
    /// A clock whose wall time is `now_ms` now.
    pub fn starting_at(now_ms: u64) -> Self {
        ManualClock {
            origin: SystemClock.now(),
            origin_ms: AtomicU64::new(now_ms),
        }
    }

    /// Sets the wall time to `now_ms` (it keeps advancing from there).
    pub fn set_ms(&self, now_ms: u64) {
        let elapsed = elapsed_ms(self.origin, SystemClock.now());
        self.origin_ms
            .store(now_ms.saturating_sub(elapsed), Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        let elapsed = elapsed_ms(self.origin, self.now());
        self.origin_ms
            .load(Ordering::Relaxed)
            .saturating_add(elapsed)
    }

    fn now(&self) -> Instant {
        SystemClock.now()
    }
}

fn elapsed_ms(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_millis()).unwrap_or(u64::MAX)
}

fn shift(ms: u64, offset_ms: i64) -> u64 {
    if offset_ms >= 0 {
        ms.saturating_add(offset_ms.unsigned_abs())
    } else {
        ms.saturating_sub(offset_ms.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn manual_wall_time_follows_paused_time() {
        let clock = ManualClock::starting_at(1_000_000);
        let t0 = clock.now();
        assert_eq!(clock.now_ms(), 1_000_000);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(clock.now_ms(), 1_001_500);
        assert_eq!(clock.now() - t0, Duration::from_millis(1500));
        clock.set_ms(5_000);
        assert_eq!(clock.now_ms(), 5_000);
        assert_eq!(
            clock.now() - t0,
            Duration::from_millis(1500),
            "a wall step leaves monotonic time alone"
        );
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(clock.now_ms(), 5_010);
    }

    #[tokio::test(start_paused = true)]
    async fn offset_shifts_wall_time_both_ways() {
        let base: SharedClock = Arc::new(ManualClock::starting_at(10_000));
        let skewed = OffsetClock::new(base.clone(), -3_000);
        assert_eq!(skewed.now_ms(), 7_000);
        skewed.set_offset_ms(250);
        assert_eq!(skewed.now_ms(), 10_250);
        assert_eq!(skewed.now(), base.now());
        skewed.set_offset_ms(-20_000);
        assert_eq!(skewed.now_ms(), 0, "a clock set before the epoch reads 0");
    }

    #[test]
    fn system_clock_is_after_2020_and_monotonic() {
        let clock = SystemClock;
        assert!(clock.now_ms() > 1_577_836_800_000);
        let a = clock.now();
        assert!(clock.now() >= a);
    }
}
