//! `mqstate-robustness`: runs the real server under injected faults with many concurrent clients,
//! records every operation, and checks the history (docs/robustness.md). Run it through
//! `scripts/robustness.sh`, which builds the server it tests.

mod checks;
mod client;
mod cluster;
mod endpoint;
mod faults;
mod history;
mod linearizability;
mod model;
mod queues;
mod recheck;
mod server;
mod timeline;
mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use checks::{Findings, Violation};
use history::{now_us, FaultRecord};
use server::Server;
use workload::Shared;

#[derive(Parser, Debug)]
#[command(about = "Fault-injected robustness runs against mqstate serve, with history checks")]
#[command(args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Server processes per run: 1 (a single node) or 3 (a cluster founded by three nodes).
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    #[arg(long, default_value_t = 5)]
    runs: u32,
    /// Seconds of client traffic per run (faults fall inside it).
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Seed of the first run (run i uses seed + i); random if not given.
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, default_value = "target/robustness/report.json")]
    report: PathBuf,
    /// The `mqstate` binary under test (required for runs).
    #[arg(long)]
    server: Option<PathBuf>,
    /// Seconds the linearizability search may spend on one key.
    #[arg(long, default_value_t = 20)]
    check_budget: u64,
    /// The server's `--fsync` policy. Anything but `always` acknowledges writes before they are
    /// durable: a negative control, under which the power-loss fault must find lost writes.
    #[arg(long, default_value = "always")]
    fsync: String,
    /// Only these fault kinds (report names, comma-separated), e.g. `pause,power_loss`: kill9,
    /// pause, disk_full, crash_after_write_before_fsync, crash_mid_snapshot, crash_before_rename,
    /// power_loss, clock_skew; single node only crash_notify_after_reserve; cluster only
    /// partition, loss, slow_link (in network namespaces), clock_offset,
    /// crash_chain_after_prepare, crash_chain_before_commit, crash_chain_mid_copy.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Keep the data directory, server log and history of passing runs too.
    #[arg(long)]
    keep: bool,
    /// On a cluster, leave the KEYNOTIFY observers out (they run by default: notifications
    /// across nodes, decisions 0046 and 0059).
    #[arg(long, conflicts_with = "cluster_observers")]
    no_cluster_observers: bool,
    /// On a cluster, run the KEYNOTIFY observers (the default; kept for older command lines).
    #[arg(long, hide = true)]
    cluster_observers: bool,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Reruns every check on a saved history (a failing run's `history.json`): exit 1 when a
    /// check fails. For iterating on the checker without rerunning servers.
    Check {
        #[arg(long)]
        history: PathBuf,
        /// Seconds the linearizability search may spend on one key.
        #[arg(long, default_value_t = 20)]
        check_budget: u64,
        /// Check only the operations on this key, and print them in invocation order.
        #[arg(long)]
        key: Option<String>,
        /// Also draw the timeline of the checked history to this HTML file.
        #[arg(long)]
        timeline: Option<PathBuf>,
    },
}

#[derive(Serialize)]
struct Report {
    nodes: u32,
    /// Whether partitions between nodes could be injected (a cluster in network namespaces).
    partitions: bool,
    runs: u32,
    duration_seconds: u64,
    first_seed: u64,
    operations: usize,
    /// Operations whose outcome is unknown (timeouts, lost connections).
    unknown_operations: usize,
    notifications: usize,
    /// Records the persistent notification queue delivered (distinct `seq`s; single node).
    queue_records: usize,
    violations: usize,
    acked_lost: usize,
    /// The faults that happened, by kind: a failpoint not reached in time counts as `kill9`.
    faults: BTreeMap<String, u64>,
    /// Failpoint faults drawn whose point was not reached in time (the node was killed instead).
    failpoints_missed: BTreeMap<String, u64>,
    failing_seeds: Vec<u64>,
    /// Keys whose linearizability search ran out of budget (not failures; listed per run).
    incomplete_checks: usize,
    /// The largest `max_version_ahead_ms` of any run.
    max_version_ahead_ms: i64,
    run_details: Vec<RunSummary>,
}

#[derive(Serialize)]
struct RunSummary {
    seed: u64,
    operations: usize,
    unknown_operations: usize,
    notifications: usize,
    queue_records: usize,
    faults: Vec<FaultRecord>,
    violations: Vec<Violation>,
    acked_lost: usize,
    incomplete_checks: Vec<String>,
    /// How far the newest version ran ahead of the wall clock at its reply (restarts resume the
    /// HLC at its persisted ceiling, up to 10 s ahead, decision 0012; client clock skew adds to it).
    max_version_ahead_ms: i64,
    check_millis: u128,
    /// The failing run's timeline (HTML with an SVG).
    timeline: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let result = match &args.command {
        Some(Command::Check {
            history,
            check_budget,
            key,
            timeline,
        }) => recheck::run(history, *check_budget, key.as_deref(), timeline.as_deref()),
        None => run_all(&args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("robustness: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run_all(args: &Args) -> anyhow::Result<i32> {
    if args.nodes != 1 && args.nodes != 3 {
        bail!(
            "--nodes {}: a single node (1) or a 3-node cluster (3) can be tested",
            args.nodes
        );
    }
    if args.runs == 0 || args.duration < 2 {
        bail!("--runs must be at least 1 and --duration at least 2 seconds");
    }
    let mut allowed = Vec::new();
    for name in &args.faults {
        match faults::kinds().find(|f| f.name() == name) {
            Some(fault) => allowed.push(fault),
            None => bail!(
                "--faults: unknown fault {name:?}; known: {}",
                faults::kinds()
                    .map(|f| f.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    if args.server.is_none() {
        bail!("--server: the mqstate binary to test is required for runs");
    }
    let first_seed = args.seed.unwrap_or_else(|| now_us() ^ 0x5EED);
    let work_dir = args
        .report
        .parent()
        .map_or_else(|| PathBuf::from("runs"), |p| p.join("runs"));
    std::fs::create_dir_all(&work_dir).context("creating the work directory")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // The cluster's nodes each in a network namespace (so links can be cut), made once for all runs.
    let mut net = if args.nodes > 1 {
        let net = cluster::Net::create(args.nodes as usize)?;
        if net.is_none() {
            eprintln!(
                "robustness: no network namespaces here (root and `ip` needed): the nodes run on \
                 loopback and no partitions are injected"
            );
        }
        net
    } else {
        None
    };
    let mut report = Report {
        nodes: args.nodes,
        partitions: net.is_some(),
        runs: 0,
        duration_seconds: args.duration,
        first_seed,
        operations: 0,
        unknown_operations: 0,
        notifications: 0,
        queue_records: 0,
        violations: 0,
        acked_lost: 0,
        faults: BTreeMap::new(),
        failpoints_missed: BTreeMap::new(),
        failing_seeds: Vec::new(),
        incomplete_checks: 0,
        max_version_ahead_ms: 0,
        run_details: Vec::new(),
    };
    for i in 0..args.runs {
        let seed = first_seed.wrapping_add(u64::from(i));
        let run_dir = work_dir.join(seed.to_string());
        let summary = run_one(args, &runtime, seed, &run_dir, &allowed, net.as_mut())?;
        eprintln!(
            "robustness: run {}/{} seed {seed}: {} ops ({} unknown), {} notifications, faults [{}], {} violation(s), {} incomplete, checked in {} ms",
            i + 1,
            args.runs,
            summary.operations,
            summary.unknown_operations,
            summary.notifications,
            summary
                .faults
                .iter()
                .map(|f| match &f.missed {
                    Some(missed) => format!("{} ({missed} not reached)", f.kind),
                    None => f.kind.clone(),
                })
                .collect::<Vec<_>>()
                .join(", "),
            summary.violations.len(),
            summary.incomplete_checks.len(),
            summary.check_millis
        );
        for v in &summary.violations {
            eprintln!("robustness:   {} {}: {}", v.check, v.key, v.detail);
        }
        report.runs += 1;
        report.operations += summary.operations;
        report.unknown_operations += summary.unknown_operations;
        report.notifications += summary.notifications;
        report.queue_records += summary.queue_records;
        report.violations += summary.violations.len();
        report.acked_lost += summary.acked_lost;
        report.incomplete_checks += summary.incomplete_checks.len();
        report.max_version_ahead_ms = report
            .max_version_ahead_ms
            .max(summary.max_version_ahead_ms);
        for fault in &summary.faults {
            *report.faults.entry(fault.kind.clone()).or_default() += 1;
            if let Some(missed) = &fault.missed {
                *report.failpoints_missed.entry(missed.clone()).or_default() += 1;
            }
        }
        if !summary.violations.is_empty() {
            report.failing_seeds.push(seed);
        }
        report.run_details.push(summary);
        // Written after every run, so a long run that is stopped still leaves its figures.
        write_report(&args.report, &report)?;
    }
    println!(
        "robustness: {} runs, {} operations, {} violations, {} acknowledged writes lost, faults {:?}, failpoints not reached {:?}",
        report.runs,
        report.operations,
        report.violations,
        report.acked_lost,
        report.faults,
        report.failpoints_missed
    );
    if !report.failing_seeds.is_empty() {
        println!("robustness: failing seeds {:?}", report.failing_seeds);
    }
    println!("{}", args.report.display());
    Ok(if report.violations > 0 { 1 } else { 0 })
}

fn write_report(path: &Path, report: &Report) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
}

fn run_one(
    args: &Args,
    runtime: &tokio::runtime::Runtime,
    seed: u64,
    run_dir: &Path,
    allowed: &[faults::Fault],
    net: Option<&mut cluster::Net>,
) -> anyhow::Result<RunSummary> {
    let _ = std::fs::remove_dir_all(run_dir);
    let mut net = net;
    if let Some(net) = net.as_deref_mut() {
        net.heal()?;
    }
    std::fs::create_dir_all(run_dir)?;
    let server = args
        .server
        .as_deref()
        .context("--server is required for runs")?;
    let servers = if args.nodes == 1 {
        vec![Server::start(
            server,
            run_dir,
            &args.fsync,
            &queues::SERVER_ARGS,
        )?]
    } else {
        let net = net.as_deref();
        cluster::start(server, run_dir, &args.fsync, args.nodes as usize, net)?
    };
    let shared = Shared::new(servers.iter().map(|s| s.addr).collect());
    // A persistent notification topic over the register keys, pushed to our endpoint.
    let queue = if args.nodes == 1 {
        Some(queues::QueueRun::start(runtime, &shared, seed)?)
    } else {
        None
    };
    let duration = Duration::from_secs(args.duration);
    let schedule = faults::schedule(seed, duration, allowed, args.nodes > 1, net.is_some());
    let started = Instant::now();

    let (writers, observers) = runtime.block_on(async {
        workload::spawn_clients(
            &shared,
            seed,
            args.nodes == 1 || args.cluster_observers || !args.no_cluster_observers,
        )
    });
    let (mut servers, mut errors) = std::thread::scope(|scope| {
        let shared = &shared;
        let injector = scope
            .spawn(move || inject_all(servers, net, shared, schedule, started, duration, seed));
        std::thread::sleep(duration);
        shared.stop_writers.store(true, Ordering::SeqCst);
        injector.join()
    })
    .map_err(|_| anyhow::anyhow!("the fault injector panicked"))?;
    runtime.block_on(async {
        for task in writers {
            let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
        }
        // Let the last notifications arrive.
        tokio::time::sleep(Duration::from_secs(1)).await;
        shared.stop_observers.store(true, Ordering::SeqCst);
        for task in observers {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    });

    // The final crash and recovery (of every node at once): everything acknowledged must be
    // there afterwards.
    if servers.iter().all(|s| s.pid().is_some()) {
        let crashed = now_us();
        for server in &mut servers {
            server.kill9();
        }
        shared.end_incarnation();
        shared.record_fault(FaultRecord {
            kind: "kill9".into(),
            started_us: crashed,
            ended_us: now_us(),
            detail: "final kill -9 (of every node) before the reads after recovery".into(),
            missed: None,
        });
        match restart_all(&mut servers) {
            Ok(()) => {
                if let Err(e) = runtime.block_on(workload::final_reads(&shared)) {
                    errors.push(format!("reads after recovery failed: {e}"));
                }
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    let running = servers.iter().all(|s| s.pid().is_some());
    let queue = queue.map(|q| q.finish(runtime, &shared, running));
    for server in &mut servers {
        server.stop();
    }
    shared.end_incarnation();
    let server_logs = servers
        .iter()
        .map(|s| s.log_path().display().to_string())
        .collect::<Vec<_>>()
        .join(", ");

    let history = std::mem::take(&mut *shared.history.lock().unwrap_or_else(|p| p.into_inner()));
    let checking = Instant::now();
    let mut findings: Findings =
        checks::run_checks(&history, Duration::from_secs(args.check_budget));
    for error in errors {
        findings.violations.push(Violation {
            check: "availability",
            key: String::new(),
            detail: format!("{error} (server logs: {server_logs})"),
            ops: Vec::new(),
        });
    }
    if let Some(queue) = &queue {
        findings.violations.extend(queue.violations(&history));
    }
    let check_millis = checking.elapsed().as_millis();
    let failing = !findings.violations.is_empty();
    let timeline = if failing {
        let path = run_dir.join("timeline.html");
        std::fs::write(&path, timeline::render(seed, &history, &findings))?;
        std::fs::write(
            run_dir.join("history.json"),
            serde_json::to_string(&history)?,
        )?;
        if let Some(queue) = &queue {
            queue.save(&run_dir.join("deliveries.json"))?;
        }
        Some(path)
    } else {
        if args.keep {
            std::fs::write(
                run_dir.join("history.json"),
                serde_json::to_string(&history)?,
            )?;
        } else {
            let _ = std::fs::remove_dir_all(run_dir);
        }
        None
    };
    let max_version_ahead_ms = history
        .ops
        .iter()
        .filter_map(|op| {
            let returned_ms = i64::try_from(op.returned_us? / 1000).ok()?;
            let version_ms = i64::try_from(op.version()?.0.wall_ms).ok()?;
            Some(version_ms - returned_ms)
        })
        .max()
        .unwrap_or(0);
    Ok(RunSummary {
        seed,
        max_version_ahead_ms,
        operations: history.ops.len(),
        unknown_operations: history
            .ops
            .iter()
            .filter(|op| !op.outcome.is_known())
            .count(),
        notifications: history.notifications.len(),
        queue_records: queue.as_ref().map_or(0, queues::QueueOutcome::records),
        faults: history.faults,
        violations: findings.violations,
        acked_lost: findings.acked_lost,
        incomplete_checks: findings.incomplete,
        check_millis,
        timeline,
    })
}

/// Restarts every stopped server: all spawned first, then each waited for (a cluster node may
/// wait for the others before it listens).
fn restart_all(servers: &mut [Server]) -> anyhow::Result<()> {
    for server in servers.iter_mut().filter(|s| s.pid().is_none()) {
        server.spawn_only()?;
    }
    for server in servers.iter_mut() {
        server.wait_ready()?;
    }
    Ok(())
}

/// The fault injector's thread: the scheduled faults, each at its time. Returns the servers and
/// any failure to bring one back (itself a finding).
fn inject_all(
    mut servers: Vec<Server>,
    mut net: Option<&mut cluster::Net>,
    shared: &Shared,
    schedule: Vec<(Duration, faults::Fault)>,
    started: Instant,
    duration: Duration,
    seed: u64,
) -> (Vec<Server>, Vec<String>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x1A7E);
    let mut errors = Vec::new();
    for (at, fault) in schedule {
        let due = started + at;
        if let Err(e) = watch(&mut servers, shared, due, &mut errors) {
            errors.push(e);
            return (servers, errors);
        }
        if let Err(e) = faults::inject(fault, &mut servers, net.as_deref_mut(), shared, &mut rng) {
            errors.push(format!("{}: {e:#}", fault.name()));
            return (servers, errors);
        }
    }
    let end = started + duration;
    if let Err(e) = watch(&mut servers, shared, end, &mut errors) {
        errors.push(e);
    }
    (servers, errors)
}

/// Until `until`: checks every 50 ms that no server has died on its own; if one has, that is a
/// finding, and it is restarted so the run goes on.
fn watch(
    servers: &mut [Server],
    shared: &Shared,
    until: Instant,
    errors: &mut Vec<String>,
) -> Result<(), String> {
    while Instant::now() < until && !shared.stop_writers.load(Ordering::SeqCst) {
        for (i, server) in servers.iter_mut().enumerate() {
            if let Some(status) = server.exited() {
                shared.end_incarnation();
                errors.push(format!("server {} exited on its own ({status})", i + 1));
                server
                    .restart()
                    .map_err(|e| format!("restart after an unexpected exit: {e:#}"))?;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
