//! Peak memory (VmHWM) while the state store writes a snapshot of N keys with 100-byte values
//! (keys `bench:0000000000`, as `scripts/bench.sh restart` loads them), on the binary's allocator.
//!
//! * `streamed` — the service's way (issue 12): the executor's chunks ([`SNAPSHOT_CHUNK_KEYS`] keys or
//!   [`SNAPSHOT_CHUNK_BYTES`]) go through [`snapshot_stream`] to the file as they are encoded.
//! * `whole` — the way before it: the whole state encoded into one buffer, then written.
//!
//! Prints the raw bytes of keys and values, VmHWM once the keys are loaded (before the snapshot) and
//! after the snapshot is in place, and their ratios to the raw bytes. One mode per process, so each
//! peak is its own:
//!
//! `cargo run --release -p mqstate-statestore --example snapshot_rss -- streamed 1000000`

use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::Hlc;
use mqstate_statestore::service::snapshot_stream;
use mqstate_statestore::service::{SNAPSHOT_CHUNK_BYTES, SNAPSHOT_CHUNK_KEYS};
use mqstate_store::{Delta, Limits, Progress, SnapshotEncoder, StateMachine, StoreConfig};
use mqstate_wal::{FsyncPolicy, Snapshot, Wal, WalOptions, WalWriter};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const VALUE_BYTES: usize = 100;
const KEY_BYTES: usize = 16;

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: snapshot_rss streamed|whole N";
    let mode = args.get(1).ok_or(usage)?.clone();
    let n: u64 = args.get(2).ok_or(usage)?.parse()?;
    if mode != "streamed" && mode != "whole" {
        return Err(usage.into());
    }
    let node: Arc<str> = Arc::from("mqstate");
    let mut machine = StateMachine::new(StoreConfig {
        node_id: node.clone(),
        limits: Limits::default(),
    })?;
    let value = Bytes::from(vec![b'v'; VALUE_BYTES]);
    for i in 0..n {
        machine.apply_delta(&Delta::Put {
            key: Bytes::from(format!("bench:{i:010}")),
            value: value.clone(),
            version: Hlc::new(1_800_000_000_000 + i, 0, node.clone()),
            fencing_token: None,
            expires_at_ms: None,
        });
    }
    let raw_kb = n * (KEY_BYTES + VALUE_BYTES) as u64 / 1024;
    let before = status_kb("VmHWM");

    let tmp = tempfile::tempdir()?;
    let options = WalOptions {
        fsync: FsyncPolicy::Never,
        ..WalOptions::default()
    };
    let (wal, _) = Wal::open(tmp.path(), options)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let wal = Arc::new(WalWriter::spawn(wal)?);
        wal.append(0, Bytes::from_static(b"record")).await?.await?;
        if mode == "streamed" {
            streamed(&machine, &wal).await?;
        } else {
            let state = machine.snapshot_encode()?;
            wal.install_snapshot(Snapshot {
                last_index: 0,
                last_term: 0,
                state: Bytes::from(state),
            })
            .await?;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    let after = status_kb("VmHWM");
    let snapshot_kb = std::fs::metadata(tmp.path().join("mqstate.snapshot"))?.len() / 1024;
    let ratio = |kb: u64| kb as f64 / raw_kb as f64;
    println!(
        "{mode}: {n} keys, raw keys + values {raw_kb} kB, snapshot file {snapshot_kb} kB; \
         VmHWM before the snapshot {before} kB ({:.2}x), after it {after} kB ({:.2}x)",
        ratio(before),
        ratio(after)
    );
    Ok(())
}

/// The executor's loop without requests in between: a chunk per turn, waiting while the file is
/// behind, then the seal (what the completer does once the records are durable).
async fn streamed(
    machine: &StateMachine,
    wal: &Arc<WalWriter>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut encoder = SnapshotEncoder::new(machine)?;
    let stream = snapshot_stream::start(wal, 0);
    loop {
        stream.room().await;
        let step = encoder.step(machine, SNAPSHOT_CHUNK_KEYS, SNAPSHOT_CHUNK_BYTES)?;
        stream
            .push(encoder.take_encoded())
            .map_err(|_| "the snapshot file failed")?;
        if step == Progress::Done {
            break;
        }
    }
    let end = encoder.finish_streamed(machine)?;
    stream
        .push_waiting(end.rest)
        .await
        .map_err(|_| "the snapshot file failed")?;
    stream.end().commit(Box::new(|_, _| None), end.patches);
    // The seal completes the file in the background; the purge marks it done.
    while wal.reader().last_purged().is_none() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(())
}
