//! Start-up cost of a log: `open_bench write DIR N` writes N records of 140 bytes (a 16-byte key and
//! a 100-byte value, as `scripts/bench.sh restart` loads), `open_bench open DIR` opens the log and
//! reads every record back as recovery does, printing the time taken and the peak RSS (VmHWM).
//!
//! `cargo run --release -p mqstate-wal --example open_bench -- write /tmp/wal-bench 1000000`

use std::time::Instant;

use mqstate_wal::{FsyncPolicy, Wal, WalOptions};

fn options() -> WalOptions {
    WalOptions {
        fsync: FsyncPolicy::Never,
        ..WalOptions::default()
    }
}

fn vm_hwm() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM"))
        .unwrap_or("VmHWM: ?")
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: open_bench write DIR N | open_bench open DIR";
    let (mode, dir) = match (args.get(1), args.get(2)) {
        (Some(mode), Some(dir)) => (mode.as_str(), dir.as_str()),
        _ => return Err(usage.into()),
    };
    match mode {
        "write" => {
            let n: u64 = args.get(3).ok_or(usage)?.parse()?;
            let (mut wal, _) = Wal::open(dir, options())?;
            let mut record = vec![b'v'; 140];
            let mut written = 0;
            while written < n {
                let batch: Vec<Vec<u8>> = (written..n.min(written + 1024))
                    .map(|i| {
                        record[..8].copy_from_slice(&i.to_be_bytes());
                        record.clone()
                    })
                    .collect();
                wal.write_batch(batch.iter().map(|r| (0, &r[..])))?;
                wal.rotate_if_needed()?;
                written += batch.len() as u64;
            }
            wal.sync()?;
        }
        "open" => {
            let started = Instant::now();
            let (wal, recovered) = Wal::open(dir, options())?;
            let opened = started.elapsed();
            let (mut count, mut bytes) = (0u64, 0usize);
            for entry in recovered.records {
                count += 1;
                bytes += entry?.data.len();
            }
            drop(wal);
            println!(
                "opened in {} ms, {count} records ({bytes} bytes) read in {} ms in total, VmHWM {}",
                opened.as_millis(),
                started.elapsed().as_millis(),
                vm_hwm()
            );
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}
