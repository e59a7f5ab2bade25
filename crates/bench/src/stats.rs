//! What a run measures: a latency histogram (HDR, microseconds), counts by reply kind and by error,
//! the completions per second over time, and the final report (table and JSON).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use mqstate_protocol::Reply;
use serde::Serialize;

/// Highest latency the histogram resolves: anything slower is recorded as this.
pub const MAX_LATENCY_US: u64 = 60_000_000;
/// Significant decimal digits of the histogram.
pub const HISTOGRAM_PRECISION: u8 = 3;

/// How one reply (or its absence) is counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub label: String,
    pub is_error: bool,
}

/// Names a state-store reply: `+OK`, `$value` (GET hit), `$-1`, `:<n>`, `*keys`, `-ERR <text>`,
/// `__stat <code>`, or `malformed`.
pub fn classify(stat: Option<&str>, payload: &Bytes) -> Outcome {
    let ok = |label: String| Outcome {
        label,
        is_error: false,
    };
    let error = |label: String| Outcome {
        label,
        is_error: true,
    };
    if stat != Some(mqstate_cli::rpc::STATUS_OK) {
        return error(format!("__stat {}", stat.unwrap_or("missing")));
    }
    match Reply::parse(payload) {
        Ok(Reply::Ok) => ok("+OK".into()),
        Ok(Reply::Integer(n)) => ok(format!(":{n}")),
        Ok(Reply::Bulk(_)) => ok("$value".into()),
        Ok(Reply::Nil) => ok("$-1".into()),
        Ok(Reply::Keys { .. }) => ok("*keys".into()),
        Ok(Reply::Error(kind)) => error(format!("-ERR {}", kind.as_str())),
        Err(_) => match payload.strip_prefix(b"-ERR ") {
            Some(text) => error(format!("-ERR {}", String::from_utf8_lossy(text).trim_end())),
            None => error("malformed".into()),
        },
    }
}

#[derive(Debug)]
struct Inner {
    latency_us: Histogram<u64>,
    replies: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

/// Shared by every connection of a run. One lock per reply is far below the cost of the MQTT round trip.
#[derive(Debug)]
pub struct Recorder {
    inner: Mutex<Inner>,
    /// Measured completions so far (read by the sampler for the progress line and the timeline).
    completed: AtomicU64,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    pub fn new() -> Recorder {
        let latency_us = Histogram::new_with_bounds(1, MAX_LATENCY_US, HISTOGRAM_PRECISION)
            .unwrap_or_else(|e| unreachable!("constant histogram bounds are valid: {e}"));
        Recorder {
            inner: Mutex::new(Inner {
                latency_us,
                replies: BTreeMap::new(),
                errors: BTreeMap::new(),
            }),
            completed: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves only counters behind: still worth reporting.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one measured reply.
    pub fn record(&self, latency: Duration, outcome: &Outcome) {
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut inner = self.lock();
        inner.latency_us.saturating_record(us.min(MAX_LATENCY_US));
        let map = if outcome.is_error {
            &mut inner.errors
        } else {
            &mut inner.replies
        };
        bump(map, &outcome.label, 1);
        drop(inner);
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an event without a latency (notifications, lost replies, connection errors).
    pub fn count(&self, label: &str, is_error: bool, n: u64) {
        let mut inner = self.lock();
        let map = if is_error {
            &mut inner.errors
        } else {
            &mut inner.replies
        };
        bump(map, label, n);
    }

    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    pub fn p99_us(&self) -> u64 {
        self.lock().latency_us.value_at_quantile(0.99)
    }

    /// (percentile, latency µs) points of the latency distribution, for the plot.
    pub fn percentile_curve(&self) -> Vec<(f64, u64)> {
        let inner = self.lock();
        inner
            .latency_us
            .iter_quantiles(1)
            .map(|v| (v.quantile_iterated_to() * 100.0, v.value_iterated_to()))
            .collect()
    }

    /// The summary of the run, measured over `elapsed`.
    pub fn report(&self, mode: &str, elapsed: Duration, timeline: Vec<u64>) -> Report {
        let inner = self.lock();
        let h = &inner.latency_us;
        let ops = h.len();
        let secs = elapsed.as_secs_f64();
        Report {
            mode: mode.to_owned(),
            ops,
            elapsed_s: secs,
            ops_per_sec: if secs > 0.0 { ops as f64 / secs } else { 0.0 },
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
            mean_us: h.mean(),
            replies: inner.replies.clone(),
            errors: inner.errors.clone(),
            ops_per_sec_timeline: timeline,
        }
    }
}

/// Adds `n` to the count of `label`, allocating its key only the first time (once per reply kind,
/// not once per reply).
fn bump(map: &mut BTreeMap<String, u64>, label: &str, n: u64) {
    match map.get_mut(label) {
        Some(count) => *count += n,
        None => {
            map.insert(label.to_owned(), n);
        }
    }
}

/// The result of a run, as written by `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: String,
    /// Measured operations (replies, or delivered messages in pubsub mode) after the warm-up.
    pub ops: u64,
    pub elapsed_s: f64,
    pub ops_per_sec: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
    /// Counts by reply kind (`+OK`, `$value`, `$-1`, `:1`, …; `delivered`, `notification`).
    pub replies: BTreeMap<String, u64>,
    /// Counts by error (`-ERR <text>`, `__stat <code>`, `timeout`, `connection`, …).
    pub errors: BTreeMap<String, u64>,
    /// Completions in each second of the run (warm-up included), for the throughput plot.
    pub ops_per_sec_timeline: Vec<u64>,
}

impl Report {
    /// The human-readable summary printed at the end of a run.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let row = |out: &mut String, name: &str, value: String| {
            out.push_str(&format!("{name:<12} {value}\n"));
        };
        row(&mut out, "mode", self.mode.clone());
        row(&mut out, "ops", self.ops.to_string());
        row(&mut out, "elapsed", format!("{:.2} s", self.elapsed_s));
        row(&mut out, "ops/s", format!("{:.1}", self.ops_per_sec));
        row(
            &mut out,
            "latency µs",
            format!(
                "p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  mean {:.0}",
                self.p50_us, self.p90_us, self.p99_us, self.p999_us, self.max_us, self.mean_us
            ),
        );
        for (label, n) in &self.replies {
            row(&mut out, "reply", format!("{label:<24} {n}"));
        }
        for (label, n) in &self.errors {
            row(&mut out, "error", format!("{label:<24} {n}"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &'static [u8]) -> Bytes {
        Bytes::from_static(s)
    }

    #[test]
    fn classify_names_every_reply_kind() {
        let ok = Some("200");
        assert_eq!(classify(ok, &b(b"+OK\r\n")).label, "+OK");
        assert_eq!(classify(ok, &b(b":-1\r\n")).label, ":-1");
        assert_eq!(classify(ok, &b(b"$2\r\nhi\r\n")).label, "$value");
        assert_eq!(classify(ok, &b(b"$-1\r\n")).label, "$-1");
        let quota = classify(ok, &b(b"-ERR the quota has been exceeded\r\n"));
        assert!(quota.is_error);
        assert_eq!(quota.label, "-ERR the quota has been exceeded");
        assert_eq!(
            classify(ok, &b(b"-ERR brand new\r\n")).label,
            "-ERR brand new"
        );
        assert!(classify(ok, &b(b"junk")).is_error);
        assert_eq!(classify(Some("400"), &b(b"")).label, "__stat 400");
        assert_eq!(classify(None, &b(b"+OK\r\n")).label, "__stat missing");
    }

    #[test]
    fn report_orders_percentiles_and_counts_kinds() {
        let recorder = Recorder::new();
        let ok = Outcome {
            label: "+OK".into(),
            is_error: false,
        };
        for us in 1..=1000u64 {
            recorder.record(Duration::from_micros(us), &ok);
        }
        recorder.count("timeout", true, 3);
        let report = recorder.report("statestore", Duration::from_secs(2), vec![400, 600]);
        assert_eq!(report.ops, 1000);
        assert_eq!(recorder.completed(), 1000);
        assert!((report.ops_per_sec - 500.0).abs() < 1e-9);
        assert!(report.p50_us <= report.p99_us && report.p99_us <= report.p999_us);
        assert!(report.p999_us <= report.max_us);
        assert!((499..=501).contains(&report.p50_us), "{}", report.p50_us);
        assert_eq!(report.replies["+OK"], 1000);
        assert_eq!(report.errors["timeout"], 3);
        let json = serde_json::to_value(&report).unwrap();
        for field in [
            "ops_per_sec",
            "p50_us",
            "p99_us",
            "p999_us",
            "max_us",
            "replies",
            "errors",
        ] {
            assert!(json.get(field).is_some(), "{field}");
        }
        assert!(report.table().contains("p99.9"));
    }

    #[test]
    fn latencies_beyond_the_bound_are_clamped_not_lost() {
        let recorder = Recorder::new();
        let ok = Outcome {
            label: "+OK".into(),
            is_error: false,
        };
        recorder.record(Duration::from_secs(3600), &ok);
        let report = recorder.report("x", Duration::from_secs(1), vec![]);
        assert_eq!(report.ops, 1);
        assert!(report.max_us >= MAX_LATENCY_US);
    }
}
