//! Once a second: record the completions of that second (the throughput timeline) and, when stderr
//! is a terminal, redraw the live progress line.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;

use super::Shared;

/// Timeline resolution.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

pub struct Sampler {
    task: JoinHandle<Vec<u64>>,
    stop: Arc<tokio::sync::Notify>,
}

impl Sampler {
    pub fn start(shared: Arc<Shared>) -> Sampler {
        let stop = Arc::new(tokio::sync::Notify::new());
        let stop_rx = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let bar = std::io::stderr().is_terminal().then(|| {
                let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
                bar.set_style(
                    ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                bar
            });
            let mut timeline = Vec::new();
            let mut previous = 0u64;
            let mut ticks = tokio::time::interval_at(
                tokio::time::Instant::now() + SAMPLE_INTERVAL,
                SAMPLE_INTERVAL,
            );
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    () = stop_rx.notified() => break,
                }
                let completed = shared.recorder.completed();
                timeline.push(completed - previous);
                previous = completed;
                if let Some(bar) = &bar {
                    bar.set_message(format!(
                        "{} ops/s  p99 {} µs  total {completed}",
                        timeline.last().copied().unwrap_or(0),
                        shared.recorder.p99_us()
                    ));
                    bar.tick();
                }
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            timeline
        });
        Sampler { task, stop }
    }

    /// Stops sampling and returns the per-second completions.
    pub async fn finish(self) -> Vec<u64> {
        self.stop.notify_one();
        self.task.await.unwrap_or_default()
    }
}
