//! `etcd-bench`: puts against an etcd cluster the way etcd's own benchmark tool does
//! (`benchmark put --clients C --conns N --val-size V --key-space-size K`): C clients, each
//! sending one put at a time (the next when the previous is answered), spread round-robin over N
//! gRPC connections, each connection balanced over every endpoint; random keys of 8 bytes out of
//! the key space, values of V bytes. Prints rate and latency percentiles after the warm-up, and
//! writes the same JSON fields as `mqstate bench --json` (`ops_per_sec`, `p50_us`, `p99_us`, …).
//! Debian does not ship etcd's benchmark tool, hence this one (decision 0042).

use std::time::{Duration, Instant};

use clap::Parser;
use etcd_client::{Client, KvClient};
use hdrhistogram::Histogram;
use rand::Rng;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "etcd put benchmark (etcd's `benchmark put`, for mqstate's side-by-side)")]
struct Args {
    /// Comma-separated client URLs of the members.
    #[arg(long)]
    endpoints: String,
    /// Concurrent clients, each with one put in flight.
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// gRPC connections the clients share.
    #[arg(long, default_value_t = 50)]
    conns: usize,
    /// Bytes per value.
    #[arg(long, default_value_t = 64)]
    val_size: usize,
    /// Keys are chosen uniformly from this many.
    #[arg(long, default_value_t = 10_000)]
    key_space_size: u64,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds at the start whose puts are not measured.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Report {
    mode: &'static str,
    ops: u64,
    elapsed_s: f64,
    ops_per_sec: f64,
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    p999_us: u64,
    max_us: u64,
    mean_us: f64,
    errors: u64,
}

/// One client's measured puts and errors.
struct Tally {
    latencies: Histogram<u64>,
    errors: u64,
}

async fn client(
    mut kv: KvClient,
    args: std::sync::Arc<Args>,
    start_measuring: Instant,
    end: Instant,
) -> Tally {
    let mut tally = Tally {
        latencies: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
        errors: 0,
    };
    let value = vec![b'v'; args.val_size];
    loop {
        let key = rand::rng().random_range(0..args.key_space_size);
        // etcd's tool encodes the key as 8 bytes (binary.PutVarint into a key-size buffer).
        let key = key.to_be_bytes().to_vec();
        let sent = Instant::now();
        if sent >= end {
            return tally;
        }
        let outcome = kv.put(key, value.clone(), None).await;
        let done = Instant::now();
        if done < start_measuring {
            continue;
        }
        match outcome {
            Ok(_) => {
                let us = done.duration_since(sent).as_micros() as u64;
                let _ = tally.latencies.record(us.max(1));
            }
            Err(e) => {
                if tally.errors == 0 {
                    eprintln!("put failed: {e}");
                }
                tally.errors += 1;
            }
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = std::sync::Arc::new(Args::parse());
    if args.clients == 0 || args.conns == 0 || args.key_space_size == 0 {
        return Err("--clients, --conns and --key-space-size must be positive".into());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let endpoints: Vec<String> = args.endpoints.split(',').map(str::to_owned).collect();
        let mut conns = Vec::with_capacity(args.conns);
        for _ in 0..args.conns {
            conns.push(Client::connect(&endpoints, None).await?.kv_client());
        }
        let start = Instant::now();
        let start_measuring = start + Duration::from_secs_f64(args.warmup);
        let end = start_measuring + Duration::from_secs_f64(args.duration);
        let tasks: Vec<_> = (0..args.clients)
            .map(|i| {
                let kv = conns[i % conns.len()].clone();
                tokio::spawn(client(kv, args.clone(), start_measuring, end))
            })
            .collect();
        let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let mut errors = 0;
        for task in tasks {
            let tally = task.await?;
            all.add(&tally.latencies)?;
            errors += tally.errors;
        }
        let elapsed = Instant::now().duration_since(start_measuring).as_secs_f64();
        let report = Report {
            mode: "etcd-put",
            ops: all.len(),
            elapsed_s: elapsed,
            ops_per_sec: all.len() as f64 / elapsed,
            p50_us: all.value_at_quantile(0.5),
            p90_us: all.value_at_quantile(0.9),
            p99_us: all.value_at_quantile(0.99),
            p999_us: all.value_at_quantile(0.999),
            max_us: all.max(),
            mean_us: all.mean(),
            errors,
        };
        println!(
            "etcd put: {} clients over {} connections, {}-byte values\nops {}\nops/s {:.0}\np50 {} µs  p90 {} µs  p99 {} µs  p99.9 {} µs  max {} µs\nerrors {}",
            args.clients, args.conns, args.val_size, report.ops, report.ops_per_sec,
            report.p50_us, report.p90_us, report.p99_us, report.p999_us, report.max_us, errors
        );
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
        }
        Ok(())
    })
}
