//! `mqstate bench`: a load generator for any AIO state store, or plain MQTT pub/sub.
//!
//! * `--mode statestore` (default): each connection is one raw MQTT 5 client keeping `--inflight` QoS 1
//!   requests outstanding, matched to replies by correlation data ([`statestore`]).
//! * `--mode pubsub`: publishers and subscribers measuring delivered messages/s and end-to-end latency
//!   from a timestamp in the payload ([`pubsub`]); `--publishers 1 --subscribers 100` is fan-out.
//! * `--mode idle`: opens `--connections` MQTT connections that stay idle, and with `--server-pid`
//!   reports the broker's memory per idle connection ([`idle`]).
//! * `--responder`: answers every request with `+OK` without storing anything — the cost of MQTT
//!   request/response alone, as a baseline and as a stand-in store for tests ([`responder`]).
//!
//! Connections are our own thin MQTT 5 client ([`mqstate_cli::wire`]) over TCP with TCP_NODELAY, TLS with `--tls`
//! ([`mqstate_cli::dial`]), each owned by one task: the load generator shares the server's cores and must add neither
//! Nagle delays nor its own CPU to what it measures.
//!
//! Latencies go into one HDR histogram ([`stats`]); a sampler keeps per-second throughput for the plot
//! and the live progress line ([`progress`]); the end of a run prints a table and optionally writes
//! `--json` and `--plot` ([`plot`]).

mod heads;
mod idle;
mod plot;
mod progress;
mod pubsub;
mod responder;
mod statestore;
mod stats;
mod timeline;
mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mqstate_cli::connection::ConnectionArgs;
use mqstate_cli::error::{CliError, EXIT_FAILED, EXIT_OK};
use stats::{Recorder, Report};
use workload::{Distribution, Mix};

/// Default `--responder-topic`: the invoke topic, shared by the responder's connections.
pub const RESPONDER_FILTER: &str =
    "$share/mqstate-responder/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
/// Default run length when neither `--duration` nor `--requests` is given.
pub const DEFAULT_DURATION_S: f64 = 10.0;
/// Smallest pubsub payload: the send timestamp (8 bytes) must fit.
pub const MIN_PAYLOAD_BYTES: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Statestore,
    Pubsub,
    Idle,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// What to drive.
    #[arg(long, value_enum, default_value = "statestore")]
    pub mode: Mode,
    /// Instead of generating load, answer every state-store request with +OK (a baseline store).
    #[arg(long)]
    pub responder: bool,
    /// Topic filter the responder serves. The default shared subscription spreads requests over the
    /// connections; with a plain filter every connection answers every request.
    #[arg(long, value_name = "FILTER", default_value = RESPONDER_FILTER)]
    pub responder_topic: String,
    /// Connections (state-store mode, idle mode and responder). Idle mode goes past 65,535: on
    /// loopback it spreads its connections over source addresses 127.0.0.2, 127.0.0.3, ... so that
    /// each has enough ephemeral ports.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub connections: u32,
    /// Threads of the load generator. One, like redis-benchmark, leaves the most CPU to a server on the
    /// same machine and needs no hand-offs between threads; more when one core cannot drive the server.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Requests in flight per connection (pubsub: outgoing QoS 1 window per publisher).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub inflight: u16,
    /// Run for this many seconds after the warm-up (default 10 unless --requests is given).
    #[arg(long, value_name = "SECONDS", conflicts_with = "requests")]
    pub duration: Option<f64>,
    /// Send exactly this many requests (pubsub: messages per run, over all publishers), warm-up included.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Seconds at the start whose replies are not measured.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0)]
    pub warmup: f64,
    /// Operation weights: set, get, del, vdel, setnx, keynotify (notifications fan out to registrants).
    #[arg(long, default_value = "set=50,get=50")]
    pub mix: Mix,
    /// Size of the keyspace.
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// How keys are chosen.
    #[arg(long, value_enum, default_value = "uniform")]
    pub distribution: Distribution,
    /// Bytes per value.
    #[arg(long, value_name = "BYTES", default_value_t = 64)]
    pub value_size: usize,
    /// Pubsub: publishing connections.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub publishers: u16,
    /// Pubsub: subscribing connections (each receives every message).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub subscribers: u16,
    /// Pubsub: QoS of publishes and subscriptions.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub qos: u8,
    /// Pubsub: payload bytes (at least 8, the timestamp).
    #[arg(long, value_name = "BYTES", default_value_t = 64)]
    pub payload: usize,
    /// Idle mode: pid of the broker, whose resident memory is read before and after.
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Draw throughput over time and the latency distribution to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Write the run second by second to this file (state-store mode): replies ok, errors, timeouts,
    /// p50 and p99 of each second; JSON if the name ends in `.json` (with the unavailability
    /// figures), CSV otherwise.
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// Servers of a cluster, `HOST:PORT,...` (instead of --host/--port): connections are spread over
    /// them. State-store mode: a connection that dies reconnects to the next one, as an SDK client
    /// would; the requests it had outstanding count as errors. Pub/sub mode: subscribers and
    /// publishers take the servers in turn (publishers one further along).
    #[arg(long, value_name = "HOST:PORT,...", value_delimiter = ',')]
    pub servers: Vec<String>,
    /// State-store mode on a cluster: each connection sends only keys whose partition the node it
    /// is connected to heads (learnt from each server's `cluster status` before the run), so no
    /// request is forwarded between nodes — the chain alone, without the forwarding hop.
    #[arg(long)]
    pub keys_at_head: bool,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

/// The async runtime a bench command runs on: `--threads` workers, the current thread alone for one.
pub fn runtime(args: &BenchArgs) -> tokio::runtime::Builder {
    if args.threads == 1 {
        return tokio::runtime::Builder::new_current_thread();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(usize::from(args.threads));
    builder
}

pub async fn run(args: BenchArgs) -> ExitCode {
    if args.mode == Mode::Idle && !args.responder {
        return match run_idle(&args).await {
            Ok(()) => ExitCode::from(EXIT_OK),
            Err(e) => e.report(),
        };
    }
    let result = if args.responder {
        responder::run(&args).await.map(|()| None)
    } else {
        measure(&args).await.map(Some)
    };
    match result {
        Ok(None) => ExitCode::from(EXIT_OK),
        Ok(Some(report)) => {
            print!("{}", report.table());
            // Errors in the run are reported, but a run that completed is a success for the tool.
            ExitCode::from(if report.ops > 0 { EXIT_OK } else { EXIT_FAILED })
        }
        Err(e) => e.report(),
    }
}

async fn run_idle(args: &BenchArgs) -> Result<(), CliError> {
    let hold = seconds("--duration", args.duration.unwrap_or(DEFAULT_DURATION_S))?;
    let report = idle::run(args, hold).await?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn write_json(path: &std::path::Path, report: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| CliError::usage("--json", e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|source| CliError::Input {
        what: format!("--json {} (writing)", path.display()),
        source,
    })
}

/// State shared by every task of a measured run.
pub struct Shared {
    pub recorder: Recorder,
    pub timeline: timeline::Timeline,
    pub started: Instant,
    /// Replies to requests sent before this instant are not measured.
    pub measure_from: Instant,
    budget: Option<u64>,
    issued: AtomicU64,
    stopped: AtomicBool,
    /// Nanoseconds from `started` to the latest measured completion.
    last_completion_ns: AtomicU64,
}

impl Shared {
    fn new(warmup: Duration, budget: Option<u64>) -> Shared {
        let started = Instant::now();
        Shared {
            recorder: Recorder::new(),
            timeline: timeline::Timeline::new(started),
            started,
            measure_from: started + warmup,
            budget,
            issued: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            last_completion_ns: AtomicU64::new(0),
        }
    }

    /// Claims the right to send one more request; false once the run is over.
    pub fn take_ticket(&self) -> bool {
        if self.stopped.load(Ordering::Relaxed) {
            return false;
        }
        match self.budget {
            Some(budget) => {
                let n = self.issued.fetch_add(1, Ordering::Relaxed);
                if n + 1 >= budget {
                    self.stop();
                }
                n < budget
            }
            None => {
                self.issued.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    }

    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    /// Whether the run is over (budget spent, duration elapsed or Ctrl-C). Connection tasks look at
    /// every turn and every tick rather than wait on it: waiting would cost every turn a lock.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    pub fn measuring(&self, sent: Instant) -> bool {
        sent >= self.measure_from
    }

    pub fn completed_at(&self, at: Instant) {
        let ns = u64::try_from(at.saturating_duration_since(self.started).as_nanos())
            .unwrap_or(u64::MAX);
        self.last_completion_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// From the end of the warm-up to the last measured completion.
    fn measured_time(&self) -> Duration {
        let last =
            self.started + Duration::from_nanos(self.last_completion_ns.load(Ordering::Relaxed));
        last.saturating_duration_since(self.measure_from)
    }
}

fn seconds(flag: &str, value: f64) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        CliError::usage(
            flag,
            format!("{value} is not a non-negative number of seconds"),
        )
    })
}

async fn measure(args: &BenchArgs) -> Result<Report, CliError> {
    let warmup = seconds("--warmup", args.warmup)?;
    let duration = match (args.duration, args.requests) {
        (Some(d), _) => Some(seconds("--duration", d)?),
        (None, Some(_)) => None,
        (None, None) => Some(seconds("--duration", DEFAULT_DURATION_S)?),
    };
    if args.mode == Mode::Pubsub && args.payload < MIN_PAYLOAD_BYTES {
        return Err(CliError::usage(
            "--payload",
            format!(
                "at least {MIN_PAYLOAD_BYTES} bytes: the send timestamp travels in the payload"
            ),
        ));
    }
    let (mode, prepared) = match args.mode {
        Mode::Statestore => ("statestore", statestore::prepare(args).await?),
        Mode::Pubsub => ("pubsub", pubsub::prepare(args).await?),
        Mode::Idle => return Err(CliError::usage("--mode", "idle runs are not measured runs")),
    };
    let shared = Arc::new(Shared::new(warmup, args.requests));
    let sampler = progress::Sampler::start(Arc::clone(&shared));
    let run = prepared.start(Arc::clone(&shared));
    let stopper = {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            match duration {
                Some(d) => tokio::select! {
                    () = tokio::time::sleep(warmup + d) => {}
                    _ = tokio::signal::ctrl_c() => {}
                },
                None => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            shared.stop();
        })
    };
    let run_result = run.await;
    stopper.abort();
    let timeline = sampler.finish().await;
    run_result?;
    let report = shared
        .recorder
        .report(mode, shared.measured_time(), timeline);
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &report, &shared.recorder.percentile_curve())?;
    }
    let unavailability = shared.timeline.unavailability();
    if let Some(path) = &args.timeline {
        let rows = shared.timeline.rows();
        let text = if path.extension().is_some_and(|e| e == "json") {
            timeline::json(&rows, &unavailability)
        } else {
            timeline::csv(&rows)
        };
        std::fs::write(path, text).map_err(|source| CliError::Input {
            what: format!("--timeline {} (writing)", path.display()),
            source,
        })?;
    }
    if let Some(line) = timeline::describe(&unavailability) {
        if !args.servers.is_empty() || args.timeline.is_some() {
            println!("{line}");
        }
    }
    Ok(report)
}

/// Connections opened before the clock starts, ready to be driven.
pub enum Prepared {
    Statestore(statestore::Prepared),
    Pubsub(pubsub::Prepared),
}

impl Prepared {
    async fn start(self, shared: Arc<Shared>) -> Result<(), CliError> {
        match self {
            Prepared::Statestore(p) => p.run(shared).await,
            Prepared::Pubsub(p) => p.run(shared).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_hands_out_exactly_n_tickets_then_stops() {
        let shared = Shared::new(Duration::ZERO, Some(3));
        assert!(shared.take_ticket());
        assert!(shared.take_ticket());
        assert!(shared.take_ticket());
        assert!(!shared.take_ticket());
        assert!(shared.stopped.load(Ordering::Relaxed));
    }

    #[test]
    fn warmup_requests_are_not_measured() {
        let shared = Shared::new(Duration::from_secs(3600), None);
        assert!(!shared.measuring(Instant::now()));
        assert!(shared.measuring(shared.measure_from));
    }

    #[test]
    fn responder_default_shares_the_invoke_topic() {
        assert_eq!(
            RESPONDER_FILTER.strip_prefix("$share/mqstate-responder/"),
            Some(mqstate_protocol::topic::INVOKE_TOPIC)
        );
    }

    #[test]
    fn negative_seconds_are_a_usage_error() {
        assert!(seconds("--warmup", -1.0).is_err());
        assert_eq!(
            seconds("--warmup", 1.5).unwrap(),
            Duration::from_millis(1500)
        );
    }
}
