//! openraft logs a warning and an error for every failed call to a peer, every backoff interval
//! (half a second) for as long as the peer is down: a node that died fills its peers' logs. This
//! filter lets the first of a run of identical openraft warnings and errors through, and then the
//! same one again at most once per [`EVERY`]. "Identical" is the same call site with the same
//! fields, leaving out the ones that change on every retry (`interval`, `request_id`): a different
//! peer or a different error passes at once. Everything below warning (leader changes, membership)
//! and everything not from openraft passes untouched; our own code says when a peer goes down or
//! comes back (the control plane's lease, the mesh's "node does not answer").

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Filter};

/// How often the same openraft warning may be logged again.
pub const EVERY: Duration = Duration::from_secs(60);
/// Distinct warnings remembered; beyond it the memory starts over (a few extra lines at worst).
const REMEMBERED: usize = 1024;
/// Fields that differ on every retry of the same failure.
const VARYING: [&str; 2] = ["interval", "request_id"];

#[derive(Default)]
pub struct RepeatedLogs {
    last: Mutex<HashMap<String, Instant>>,
}

impl RepeatedLogs {
    /// Whether a warning with this `key` is logged `now`.
    fn admit(&self, key: String, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = last.get(&key) {
            if now.saturating_duration_since(*at) < EVERY {
                return false;
            }
        }
        if last.len() >= REMEMBERED {
            last.clear();
        }
        last.insert(key, now);
        true
    }
}

/// The fields of an event as text, without the [`VARYING`] ones.
struct Key<'a>(&'a mut String);

impl Visit for Key<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if !VARYING.contains(&field.name()) {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: Subscriber> Filter<S> for RepeatedLogs {
    fn enabled(&self, _: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        true
    }

    fn event_enabled(&self, event: &Event<'_>, _: &Context<'_, S>) -> bool {
        let meta = event.metadata();
        // Levels order by verbosity: anything more verbose than WARN passes.
        if !meta.target().starts_with("openraft") || *meta.level() > Level::WARN {
            return true;
        }
        let mut key = format!(
            "{}:{}:{}",
            meta.target(),
            meta.file().unwrap_or(""),
            meta.line().unwrap_or(0)
        );
        event.record(&mut Key(&mut key));
        self.admit(key, Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    use super::*;

    /// The fields of every event that reaches it.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<String>>>);

    impl<S: Subscriber> Layer<S> for Lines {
        fn on_event(&self, event: &Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            let mut text = String::new();
            event.record(&mut Key(&mut text));
            self.0.lock().unwrap().push(text);
        }
    }

    #[test]
    fn a_repeated_openraft_warning_is_logged_once_and_others_pass() {
        let lines = Lines::default();
        let layer = lines.clone().with_filter(RepeatedLogs::default());
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..5 {
                // As openraft's retry loop: the same failure, with a field that changes.
                tracing::error!(target: "openraft::replication", interval = 499.9 - f64::from(i), err = "cannot reach 127.0.0.1:7003", "RPCError");
                tracing::info!(target: "openraft::core", "vote changed {i}");
                tracing::warn!(target: "mqstate::mesh", "our own warning");
            }
            tracing::error!(target: "openraft::replication", err = "cannot reach 127.0.0.1:7002", "RPCError");
        });
        let text = lines.0.lock().unwrap().join("\n");
        assert_eq!(text.matches("7003").count(), 1, "{text}");
        assert_eq!(text.matches("7002").count(), 1, "another peer: {text}");
        assert_eq!(text.matches("vote changed").count(), 5, "{text}");
        assert_eq!(text.matches("our own warning").count(), 5, "{text}");
    }

    #[test]
    fn the_same_warning_passes_again_after_a_while() {
        let filter = RepeatedLogs::default();
        let start = Instant::now();
        assert!(filter.admit("k".into(), start));
        assert!(!filter.admit("k".into(), start + EVERY / 2));
        assert!(filter.admit("k".into(), start + EVERY));
        assert!(filter.admit("other".into(), start + EVERY));
    }
}
