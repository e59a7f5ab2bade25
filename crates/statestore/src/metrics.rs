//! The service's metrics, through the `metrics` facade: the binary decides whether and how they are
//! exported. Without an installed recorder each call is a no-op.
//!
//! * `mqstate_statestore_requests_total{command, result}` — every request once: `result` is `ok`,
//!   `error` (an `-ERR` reply), `not_durable` (the write could not be logged), `duplicate` (a retry
//!   answered from the cache), `bad_request` (envelope refused), `forbidden` (reserved response topic;
//!   the client is disconnected) or `dropped` (no response topic). `command` is the command word, or
//!   `unparsed` when the request was not parsed (envelope refused, duplicate, RESP or syntax error).
//! * `mqstate_statestore_request_duration_seconds{command}` — from receipt to the reply being
//!   published, durability wait included.
//! * `mqstate_statestore_keys`, `mqstate_statestore_bytes` — size of the keyspace.
//! * `mqstate_snapshot_duration_seconds{phase}` (`encode`: executor time over all of a snapshot's
//!   chunks; `write`: in the background, from the file's creation to its rename — the chunks are
//!   written as they are encoded, so it spans the encoding) and `mqstate_snapshots_total{result}`.

use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Histogram};
use mqstate_protocol::Command;

/// The `command` label of a request whose command was not (or could not be) parsed.
pub const UNPARSED: &str = "unparsed";

/// The `command` label: the command word, or [`UNPARSED`] for a request that does not parse.
pub fn command_label(command: Option<&Command>) -> &'static str {
    match command {
        Some(Command::Set { .. }) => "set",
        Some(Command::Get { .. }) => "get",
        Some(Command::Del { .. }) => "del",
        Some(Command::VDel { .. }) => "vdel",
        Some(Command::KeyNotify { .. }) => "keynotify",
        Some(Command::KeyNotifyStop { .. }) => "keynotify_stop",
        Some(Command::Scan { .. }) => "scan",
        None => UNPARSED,
    }
}

/// A request that got a reply from execution (or a `not_durable` one), with its latency, counted by
/// the one task that completes requests: the handles of each
/// `(command, result)` are looked up once, not at every request (each lookup builds the metric's key
/// with its labels, hashes it and searches the recorder's registry under a lock). Handles belong to
/// the recorder installed when they were made: make this after the recorder (as `serve` does).
#[derive(Default)]
pub struct Completed {
    /// A few dozen at most (commands × results); the labels are compared as pointers first.
    handles: Vec<(&'static str, &'static str, Counter, Histogram)>,
}

impl Completed {
    pub fn record(&mut self, command: &'static str, result: &'static str, took: Duration) {
        let found = self
            .handles
            .iter()
            .position(|(c, r, _, _)| *c == command && *r == result);
        let i = found.unwrap_or_else(|| {
            self.handles.push((
                command,
                result,
                counter!("mqstate_statestore_requests_total", "command" => command, "result" => result),
                histogram!("mqstate_statestore_request_duration_seconds", "command" => command),
            ));
            self.handles.len() - 1
        });
        let (_, _, counter, histogram) = &self.handles[i];
        counter.increment(1);
        histogram.record(took.as_secs_f64());
    }
}

/// A request answered or dropped without being executed.
pub fn request_counted(command: &'static str, result: &'static str) {
    counter!("mqstate_statestore_requests_total", "command" => command, "result" => result)
        .increment(1);
}

pub fn keyspace_size(keys: usize, bytes: u64) {
    gauge!("mqstate_statestore_keys").set(keys as f64);
    gauge!("mqstate_statestore_bytes").set(bytes as f64);
}

pub fn snapshot_phase(phase: &'static str, took: Duration) {
    histogram!("mqstate_snapshot_duration_seconds", "phase" => phase).record(took.as_secs_f64());
}

pub fn snapshot_finished(ok: bool) {
    let result = if ok { "ok" } else { "error" };
    counter!("mqstate_snapshots_total", "result" => result).increment(1);
}

/// Notifications an endpoint acknowledged (and that were removed from the queue).
pub fn notifications_delivered(topic: &str, n: u64) {
    counter!("mqstate_notify_delivered_total", "topic" => topic.to_owned()).increment(n);
}

/// A push that failed; `retried` records will be pushed again.
pub fn notification_push_failed(topic: &str, retried: u64) {
    counter!("mqstate_notify_failed_pushes_total", "topic" => topic.to_owned()).increment(1);
    counter!("mqstate_notify_retried_total", "topic" => topic.to_owned()).increment(retried);
}

/// A removal refused because the remover no longer held the queue's lock.
pub fn notification_removal_fenced(topic: &str) {
    counter!("mqstate_notify_fenced_removals_total", "topic" => topic.to_owned()).increment(1);
}

/// A commit that could not enter a queue after its write succeeded (an expiry into a full queue).
pub fn notification_dropped(topic: &str) {
    counter!("mqstate_notify_dropped_total", "topic" => topic.to_owned()).increment(1);
}

/// Queue depth, reservations, bytes and the oldest entry's age of one topic.
pub fn notification_queue(
    topic: &str,
    entries: usize,
    reserved: usize,
    bytes: u64,
    oldest_age_ms: u64,
) {
    let topic = topic.to_owned();
    gauge!("mqstate_notify_queue_entries", "topic" => topic.clone()).set(entries as f64);
    gauge!("mqstate_notify_queue_reserved", "topic" => topic.clone()).set(reserved as f64);
    gauge!("mqstate_notify_queue_bytes", "topic" => topic.clone()).set(bytes as f64);
    gauge!("mqstate_notify_oldest_entry_age_ms", "topic" => topic).set(oldest_age_ms as f64);
}
