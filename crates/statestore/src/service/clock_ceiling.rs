//! The clock ceiling in the log's metadata file (decision 0012): every timestamp that leaves the
//! service has a wall time below it, so a restart that resumes the clock at the ceiling never hands
//! out an older one, whatever was deleted or the wall clock did.

use std::time::Instant;

use mqstate_broker::SharedClock;
use mqstate_wal::durable::RETRY_INTERVAL;
use mqstate_wal::{Metadata, WalWriter};

/// How far ahead of the clock the ceiling is set: the metadata file is rewritten about once per
/// this much clock advance (decision 0012).
pub const CLOCK_CEILING_LEASE_MS: u64 = 10_000;

/// The clock ceiling to persist when the clock's wall time reached `high_water_ms` at `now_ms`.
pub fn next_clock_ceiling(high_water_ms: u64, now_ms: u64) -> u64 {
    high_water_ms
        .max(now_ms)
        .saturating_add(CLOCK_CEILING_LEASE_MS)
}

/// The metadata on disk, whose `hlc_high_water_ms` is the ceiling, and the last failure to raise it.
pub(super) struct ClockCeiling {
    metadata: Metadata,
    /// When raising the ceiling last failed (disk full); it is retried at most once per
    /// [`RETRY_INTERVAL`].
    failed_at: Option<Instant>,
    /// The node's clock: the wall time the ceiling leads, the instant of a failure.
    clock: SharedClock,
}

impl ClockCeiling {
    /// `metadata` as on disk, its ceiling already above the clock.
    pub(super) fn new(metadata: Metadata, clock: SharedClock) -> ClockCeiling {
        ClockCeiling {
            metadata,
            failed_at: None,
            clock,
        }
    }

    /// Keeps the ceiling above `high_water_ms`, the clock's wall time: called before any outcome
    /// (which may carry a timestamp) leaves the executor.
    pub(super) async fn raise(&mut self, wal: &WalWriter, high_water_ms: u64) {
        if high_water_ms < self.metadata.hlc_high_water_ms {
            return;
        }
        if self
            .failed_at
            .is_some_and(|at| self.clock.now().saturating_duration_since(at) < RETRY_INTERVAL)
        {
            return;
        }
        let raised = Metadata {
            hlc_high_water_ms: next_clock_ceiling(high_water_ms, self.clock.now_ms()),
            ..self.metadata.clone()
        };
        match wal.write_metadata(raised.clone()).await {
            Ok(()) => {
                self.metadata = raised;
                self.failed_at = None;
            }
            Err(e) => {
                // Replies go on (reads must survive a full disk); only a crash before the disk
                // recovers, followed by a wall clock stepping back, could then reissue a timestamp.
                tracing::error!("cannot raise the HLC ceiling in the metadata file: {e}");
                self.failed_at = Some(self.clock.now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_leads_the_later_of_clock_and_wall_time() {
        assert_eq!(
            next_clock_ceiling(5_000, 1_000),
            5_000 + CLOCK_CEILING_LEASE_MS
        );
        assert_eq!(
            next_clock_ceiling(1_000, 5_000),
            5_000 + CLOCK_CEILING_LEASE_MS
        );
        assert_eq!(next_clock_ceiling(u64::MAX - 1, 0), u64::MAX);
    }
}
