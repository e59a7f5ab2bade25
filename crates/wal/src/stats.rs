//! Counters of the writer, readable at any time (for metrics) without locking.
//!
//! The binary exports these counters at scrape time. The distributions they cannot carry go to the
//! `metrics` facade from here, once per batch and per fsync (a no-op without an installed recorder):
//! `mqstate_wal_batch_records` and `mqstate_wal_fsync_duration_seconds`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Live counters, shared between the writer and whoever reports metrics.
#[derive(Debug, Default)]
pub struct WalStats {
    /// The `log` label of the histograms.
    name: &'static str,
    batches: AtomicU64,
    records: AtomicU64,
    bytes_written: AtomicU64,
    largest_batch_records: AtomicU64,
    fsyncs: AtomicU64,
    fsync_micros_total: AtomicU64,
    fsync_micros_max: AtomicU64,
    write_errors: AtomicU64,
}

/// A copy of [`WalStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalStatsSnapshot {
    pub batches: u64,
    pub records: u64,
    pub bytes_written: u64,
    pub largest_batch_records: u64,
    pub fsyncs: u64,
    pub fsync_micros_total: u64,
    pub fsync_micros_max: u64,
    pub write_errors: u64,
}

impl WalStats {
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            name,
            ..Self::default()
        }
    }

    /// The log's name (its `log` metrics label).
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn record_batch(&self, records: usize, bytes: usize) {
        let records = records as u64;
        self.batches.fetch_add(1, Relaxed);
        self.records.fetch_add(records, Relaxed);
        self.bytes_written.fetch_add(bytes as u64, Relaxed);
        self.largest_batch_records.fetch_max(records, Relaxed);
        metrics::histogram!("mqstate_wal_batch_records", "log" => self.name).record(records as f64);
    }

    pub(crate) fn record_fsync(&self, took: Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.fsyncs.fetch_add(1, Relaxed);
        self.fsync_micros_total.fetch_add(micros, Relaxed);
        self.fsync_micros_max.fetch_max(micros, Relaxed);
        metrics::histogram!("mqstate_wal_fsync_duration_seconds", "log" => self.name)
            .record(took.as_secs_f64());
    }

    pub(crate) fn record_write_error(&self) {
        self.write_errors.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> WalStatsSnapshot {
        WalStatsSnapshot {
            batches: self.batches.load(Relaxed),
            records: self.records.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            largest_batch_records: self.largest_batch_records.load(Relaxed),
            fsyncs: self.fsyncs.load(Relaxed),
            fsync_micros_total: self.fsync_micros_total.load(Relaxed),
            fsync_micros_max: self.fsync_micros_max.load(Relaxed),
            write_errors: self.write_errors.load(Relaxed),
        }
    }
}
