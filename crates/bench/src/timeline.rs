//! The run second by second (`--timeline FILE`): per second of wall time since the start, the replies
//! that were answers (`ok`), errors (`-ERR`, a bad `__stat`, requests lost with their connection),
//! requests that timed out, and the latency percentiles of that second's replies.
//!
//! And the **unavailability window** of a fail-over: the longest time between two successful
//! replies — over the whole run, and on any one connection (whose window includes its reconnect to
//! another server). A node killed under load shows as that gap: from the last reply before the kill
//! to the first reply after it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use super::stats::MAX_LATENCY_US;

/// Significant digits of the per-second histograms: two are enough for a p99 per second and keep a
/// second's histogram small.
const PRECISION: u8 = 2;

/// One second of the run.
#[derive(Debug)]
struct Second {
    ok: u64,
    errors: u64,
    timeouts: u64,
    latency_us: Histogram<u64>,
}

impl Second {
    fn new() -> Second {
        Second {
            ok: 0,
            errors: 0,
            timeouts: 0,
            latency_us: Histogram::new_with_bounds(1, MAX_LATENCY_US, PRECISION)
                .unwrap_or_else(|e| unreachable!("constant histogram bounds are valid: {e}")),
        }
    }
}

/// A row of the written timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SecondRow {
    /// Seconds since the start of the run (the row covers `[second, second + 1)`).
    pub second: u64,
    pub ok: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub p50_us: u64,
    pub p99_us: u64,
}

/// The longest stretch without a successful reply.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gap {
    /// Seconds since the start of the run of the last successful reply before the gap.
    pub from_s: f64,
    /// Length of the gap, seconds.
    pub length_s: f64,
}

/// The unavailability figures of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Unavailability {
    /// Longest gap between two successful replies of the whole run.
    pub overall: Option<Gap>,
    /// Longest gap between two successful replies on one client (reconnect included).
    pub one_client: Option<Gap>,
}

/// Shared by every connection of a run.
#[derive(Debug)]
pub struct Timeline {
    started: Instant,
    seconds: Mutex<Vec<Second>>,
    /// Nanoseconds from `started` to the latest successful reply (0: none yet).
    last_ok_ns: AtomicU64,
    longest: Mutex<Unavailability>,
}

impl Timeline {
    pub fn new(started: Instant) -> Timeline {
        Timeline {
            started,
            seconds: Mutex::new(Vec::new()),
            last_ok_ns: AtomicU64::new(0),
            longest: Mutex::new(Unavailability::default()),
        }
    }

    fn since_start(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.started)
    }

    fn with_second(&self, at: Instant, f: impl FnOnce(&mut Second)) {
        let second = usize::try_from(self.since_start(at).as_secs()).unwrap_or(usize::MAX);
        let mut seconds = self
            .seconds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seconds.len() <= second {
            // A run is bounded by its duration; a clock jump cannot ask for more than its seconds.
            seconds.resize_with(second.min(1 << 20) + 1, Second::new);
        }
        if let Some(slot) = seconds.get_mut(second) {
            f(slot);
        }
    }

    /// A reply arrived at `at` after `latency`.
    pub fn reply(&self, at: Instant, latency: Duration, is_error: bool) {
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        self.with_second(at, |s| {
            if is_error {
                s.errors += 1;
            } else {
                s.ok += 1;
            }
            s.latency_us.saturating_record(us.min(MAX_LATENCY_US));
        });
        if !is_error {
            let now_ns = nanos(self.since_start(at));
            let before = self.last_ok_ns.fetch_max(now_ns, Ordering::Relaxed);
            if before > 0 && now_ns > before {
                self.offer(
                    |u| &mut u.overall,
                    Gap {
                        from_s: before as f64 / 1e9,
                        length_s: (now_ns - before) as f64 / 1e9,
                    },
                );
            }
        }
    }

    /// `n` requests that will get no reply: their connection died, or they timed out.
    pub fn lost(&self, at: Instant, n: u64, timed_out: bool) {
        if n == 0 {
            return;
        }
        self.with_second(at, |s| {
            if timed_out {
                s.timeouts += n;
            } else {
                s.errors += n;
            }
        });
    }

    /// A client went from a successful reply at `from` to the next at `to`.
    pub fn client_gap(&self, from: Instant, to: Instant) {
        self.offer(
            |u| &mut u.one_client,
            Gap {
                from_s: self.since_start(from).as_secs_f64(),
                length_s: to.saturating_duration_since(from).as_secs_f64(),
            },
        );
    }

    fn offer(&self, slot: impl FnOnce(&mut Unavailability) -> &mut Option<Gap>, gap: Gap) {
        let mut longest = self
            .longest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = slot(&mut longest);
        if slot.is_none_or(|g| gap.length_s > g.length_s) {
            *slot = Some(gap);
        }
    }

    pub fn unavailability(&self) -> Unavailability {
        self.longest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn rows(&self) -> Vec<SecondRow> {
        let seconds = self
            .seconds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seconds
            .iter()
            .enumerate()
            .map(|(i, s)| SecondRow {
                second: i as u64,
                ok: s.ok,
                errors: s.errors,
                timeouts: s.timeouts,
                p50_us: if s.latency_us.is_empty() {
                    0
                } else {
                    s.latency_us.value_at_quantile(0.50)
                },
                p99_us: if s.latency_us.is_empty() {
                    0
                } else {
                    s.latency_us.value_at_quantile(0.99)
                },
            })
            .collect()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The timeline as CSV (a header, then one line per second).
pub fn csv(rows: &[SecondRow]) -> String {
    let mut out = String::from("second,ok,errors,timeouts,p50_us,p99_us\n");
    for r in rows {
        out.push_str(&format!(
            "{},{},{},{},{},{}\n",
            r.second, r.ok, r.errors, r.timeouts, r.p50_us, r.p99_us
        ));
    }
    out
}

/// The timeline as JSON: the rows and the unavailability figures.
pub fn json(rows: &[SecondRow], unavailability: &Unavailability) -> String {
    #[derive(Serialize)]
    struct File<'a> {
        seconds: &'a [SecondRow],
        unavailability: &'a Unavailability,
    }
    serde_json::to_string_pretty(&File {
        seconds: rows,
        unavailability,
    })
    .unwrap_or_else(|e| unreachable!("plain numbers always serialize: {e}"))
        + "\n"
}

/// One line for the report: the longest gaps, if there was more than one reply.
pub fn describe(u: &Unavailability) -> Option<String> {
    let overall = u.overall?;
    let mut line = format!(
        "longest gap between ok replies {:.3} s (from {:.1} s)",
        overall.length_s, overall.from_s
    );
    if let Some(client) = u.one_client {
        line.push_str(&format!(
            "; on one client, reconnect included, {:.3} s (from {:.1} s)",
            client.length_s, client.from_s
        ));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_land_in_their_second_and_gaps_are_measured_between_ok_replies() {
        let start = Instant::now();
        let t = Timeline::new(start);
        let at = |ms: u64| start + Duration::from_millis(ms);
        t.reply(at(100), Duration::from_millis(2), false);
        t.reply(at(900), Duration::from_millis(4), false);
        // An error does not end the gap: the store was still not answering.
        t.reply(at(1_500), Duration::from_millis(600), true);
        t.lost(at(2_100), 3, true);
        t.lost(at(2_200), 2, false);
        t.reply(at(3_400), Duration::from_millis(1), false);
        let rows = t.rows();
        assert_eq!(rows.len(), 4);
        assert_eq!((rows[0].ok, rows[0].errors), (2, 0));
        assert!(
            (3_900..=4_100).contains(&rows[0].p99_us),
            "{}",
            rows[0].p99_us
        );
        assert_eq!((rows[1].ok, rows[1].errors), (0, 1));
        assert_eq!((rows[2].errors, rows[2].timeouts), (2, 3));
        assert_eq!(rows[3].ok, 1);
        let gap = t.unavailability().overall.unwrap();
        assert!((gap.length_s - 2.5).abs() < 1e-6, "{gap:?}");
        assert!((gap.from_s - 0.9).abs() < 1e-6, "{gap:?}");
        let text = csv(&rows);
        assert!(text.starts_with("second,ok,errors,timeouts,p50_us,p99_us\n0,2,0,0,"));
        assert_eq!(text.lines().count(), 5);
    }

    #[test]
    fn the_longest_client_gap_wins() {
        let start = Instant::now();
        let t = Timeline::new(start);
        t.client_gap(start, start + Duration::from_millis(700));
        t.client_gap(
            start + Duration::from_secs(1),
            start + Duration::from_millis(3_000),
        );
        t.client_gap(start, start + Duration::from_millis(10));
        let u = t.unavailability();
        let client = u.one_client.unwrap();
        assert!((client.length_s - 2.0).abs() < 1e-6);
        assert!(
            describe(&u).is_none(),
            "no overall gap without two ok replies"
        );
        let json: serde_json::Value = serde_json::from_str(&json(&t.rows(), &u)).unwrap();
        assert!(json["unavailability"]["one_client"]["length_s"]
            .as_f64()
            .is_some());
    }
}
