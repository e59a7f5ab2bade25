//! Faults, chosen and timed from the run's seed, injected into the running server.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::Net;
use crate::history::{now_us, FaultRecord};
use crate::server::Server;
use crate::workload::{Shared, LEASE_MS};

/// How long an armed failpoint may take to be reached before the process is killed instead.
const FAILPOINT_WAIT: Duration = Duration::from_secs(6);
/// The same for `chain-mid-copy`, armed on a node as it restarts: its recovery, its first lease
/// renewal, the view that puts it back at the tail and the heads' first copy chunk come first.
const COPY_WAIT: Duration = Duration::from_secs(15);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9`, then restart.
    Kill9,
    /// `SIGSTOP`, longer than a lock lease, then `SIGCONT`.
    Pause,
    /// Every write fails with ENOSPC for a while (the wal's `enospc` failpoint).
    DiskFull,
    /// Abort at a wal failpoint (`after-write-before-fsync`, `mid-snapshot`, `before-rename`),
    /// between a notified write's reservation and its commit (`notify-after-reserve`), or, on a
    /// cluster, at a chain failpoint of a write (`chain-head-after-prepare`,
    /// `chain-tail-before-commit`), restart.
    Crash(&'static str),
    /// Cluster only: a node killed, kept down until the control plane has taken it out of its
    /// chains, then restarted armed at `chain-mid-copy`: it aborts at the first recovery-copy
    /// chunk it receives on re-entering at the tail, and is restarted again.
    CrashMidCopy,
    /// Unsynced log writes discarded, then abort (the wal's `power-loss` failpoint), restart.
    PowerLoss,
    /// Clients' clocks (`__ts`) jump ahead or behind for a while.
    ClockSkew,
    /// Cluster only: a node killed and restarted with its wall clock 0.5–5 s ahead or behind
    /// (the server's hidden `--test-clock-offset-ms`), for the rest of the run.
    ClockOffset,
    /// Cluster only: links between nodes cut (one node isolated from the others, or one link
    /// between two nodes) for longer than a lease, then healed. Clients still reach every node.
    Partition,
    /// Cluster only: 5–40 % of the packets between one node and the others (or one pair of
    /// nodes) dropped at random, both ways, for 2–8 s (nftables in the node's namespace).
    Loss,
    /// Cluster only: one node's outgoing link limited to 64–1024 kbit/s with up to 50–500 ms of
    /// queueing (a `tbf` qdisc in its namespace; no `sch_netem` here), for 2–8 s.
    SlowLink,
}

impl Fault {
    /// The name in the report's `faults` object.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill9 => "kill9",
            Fault::Pause => "pause",
            Fault::DiskFull => "disk_full",
            Fault::Crash("after-write-before-fsync") => "crash_after_write_before_fsync",
            Fault::Crash("mid-snapshot") => "crash_mid_snapshot",
            Fault::Crash("before-rename") => "crash_before_rename",
            Fault::Crash(NOTIFY_AFTER_RESERVE) => "crash_notify_after_reserve",
            Fault::Crash(CHAIN_HEAD_AFTER_PREPARE) => "crash_chain_after_prepare",
            Fault::Crash(CHAIN_TAIL_BEFORE_COMMIT) => "crash_chain_before_commit",
            // Every point is named above; `WEIGHTED` draws no other.
            Fault::Crash(point) => point,
            Fault::CrashMidCopy => "crash_chain_mid_copy",
            Fault::PowerLoss => "power_loss",
            Fault::ClockSkew => "clock_skew",
            Fault::Partition => "partition",
            Fault::ClockOffset => "clock_offset",
            Fault::Loss => "loss",
            Fault::SlowLink => "slow_link",
        }
    }
}

/// The state store's crash point between a notified write's reservation and its commit record
/// (docs/notifications.md); reached only by writes a notification topic matches (single node).
const NOTIFY_AFTER_RESERVE: &str = "notify-after-reserve";
/// The chain protocol's crash points (`crates/replication/src/failpoint.rs`): the head has sent
/// phase 1 of a write on, no other replica has it yet; the tail holds phase 1 and is about to
/// send phase 2 back; a replica re-entering at the tail received a recovery-copy chunk.
const CHAIN_HEAD_AFTER_PREPARE: &str = "chain-head-after-prepare";
const CHAIN_TAIL_BEFORE_COMMIT: &str = "chain-tail-before-commit";
const CHAIN_MID_COPY: &str = "chain-mid-copy";

const WEIGHTED: [(Fault, u32); 16] = [
    (Fault::Kill9, 3),
    (Fault::Pause, 2),
    (Fault::DiskFull, 2),
    (Fault::Crash("after-write-before-fsync"), 2),
    (Fault::Crash("mid-snapshot"), 1),
    (Fault::Crash("before-rename"), 1),
    (Fault::Crash(NOTIFY_AFTER_RESERVE), 2),
    (Fault::PowerLoss, 3),
    (Fault::ClockSkew, 1),
    (Fault::Partition, 4),
    (Fault::ClockOffset, 1),
    (Fault::Loss, 3),
    (Fault::SlowLink, 2),
    (Fault::Crash(CHAIN_HEAD_AFTER_PREPARE), 2),
    (Fault::Crash(CHAIN_TAIL_BEFORE_COMMIT), 2),
    (Fault::CrashMidCopy, 2),
];

impl Fault {
    /// Whether the fault acts on the links between nodes (the cluster's namespaces, `Net`).
    fn needs_net(self) -> bool {
        matches!(self, Fault::Partition | Fault::Loss | Fault::SlowLink)
    }

    /// Whether only a cluster can reach it (or has the setting it changes).
    fn cluster_only(self) -> bool {
        matches!(
            self,
            Fault::ClockOffset
                | Fault::CrashMidCopy
                | Fault::Crash(CHAIN_HEAD_AFTER_PREPARE | CHAIN_TAIL_BEFORE_COMMIT)
        )
    }

    /// Whether only a single node can reach it: no notification topic on a cluster run.
    fn single_only(self) -> bool {
        self == Fault::Crash(NOTIFY_AFTER_RESERVE)
    }
}

/// The fault kinds by report name, for `--faults`.
pub fn kinds() -> impl Iterator<Item = Fault> {
    WEIGHTED.iter().map(|(f, _)| *f)
}

/// The control plane's lease and clock factor at their defaults (`mqstate serve`): a node that
/// is paused or cut off longer than this loses its chains.
const NODE_LEASE_MS: u64 = 3000 + 1000;

/// One to three faults at times in the middle of the run (offsets from its start), drawn from
/// `allowed` (every kind when empty) among those a `cluster` (clock offsets, chain failpoints) or
/// a single node (the notification queue's failpoint) and `partitions` (the cluster's
/// namespaces) allow.
pub fn schedule(
    seed: u64,
    duration: Duration,
    allowed: &[Fault],
    cluster: bool,
    partitions: bool,
) -> Vec<(Duration, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xFA17);
    let count = rng.gen_range(1..=3);
    let weighted: Vec<(Fault, u32)> = WEIGHTED
        .iter()
        .filter(|(f, _)| allowed.is_empty() || allowed.contains(f))
        .filter(|(f, _)| partitions || !f.needs_net())
        .filter(|(f, _)| {
            if cluster {
                !f.single_only()
            } else {
                !f.cluster_only()
            }
        })
        .copied()
        .collect();
    if weighted.is_empty() {
        return Vec::new();
    }
    let total: u32 = weighted.iter().map(|(_, w)| w).sum();
    let mut faults: Vec<(Duration, Fault)> = (0..count)
        .map(|_| {
            let at = duration.mul_f64(rng.gen_range(0.15..0.7));
            let mut pick = rng.gen_range(0..total);
            let fault = weighted
                .iter()
                .find(|(_, w)| {
                    let hit = pick < *w;
                    pick = pick.saturating_sub(*w);
                    hit
                })
                .map_or(Fault::Kill9, |(f, _)| *f);
            (at, fault)
        })
        .collect();
    faults.sort_by_key(|(at, _)| *at);
    faults
}

/// Injects `fault` now into one of `servers` (chosen from `rng`; links between them for a
/// partition, through `net`); blocks until it is over (every server runs again).
pub fn inject(
    fault: Fault,
    servers: &mut [Server],
    net: Option<&mut Net>,
    shared: &Shared,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let started_us = now_us();
    let mut missed = None;
    let target = rng.gen_range(0..servers.len());
    let n = servers.len();
    let cluster = n > 1;
    let server = &mut servers[target];
    let detail = match fault {
        Fault::Kill9 => {
            server.kill9();
            shared.end_incarnation();
            std::thread::sleep(Duration::from_millis(rng.gen_range(50..500)));
            server.restart().context("restart after kill -9")?;
            "killed and restarted".to_owned()
        }
        Fault::Pause => {
            let range = if cluster {
                NODE_LEASE_MS - 500..NODE_LEASE_MS + 3000
            } else {
                LEASE_MS + 100..3 * LEASE_MS
            };
            let pause = Duration::from_millis(rng.gen_range(range));
            server.signal("STOP");
            std::thread::sleep(pause);
            server.signal("CONT");
            format!("stopped for {} ms", pause.as_millis())
        }
        Fault::DiskFull => {
            let full = Duration::from_millis(rng.gen_range(300..2000));
            server.arm("disk-full")?;
            std::thread::sleep(full);
            server.disarm("disk-full");
            format!("full for {} ms", full.as_millis())
        }
        Fault::Crash(_) | Fault::PowerLoss => {
            let point = if let Fault::Crash(point) = fault {
                point
            } else {
                "power-loss"
            };
            let (reached, detail) = crash_at(server, shared, point, false)?;
            if !reached {
                missed = Some(fault.name());
            }
            detail
        }
        Fault::CrashMidCopy => {
            // Long enough for the control plane to mark it down (lease + clock factor since its
            // last grant, by the leader's clock; an election first if it led), so that it
            // re-enters its chains at the tail and is copied; a quicker return keeps its place.
            let down =
                Duration::from_millis(rng.gen_range(NODE_LEASE_MS + 2000..NODE_LEASE_MS + 4000));
            server.kill9();
            shared.end_incarnation();
            std::thread::sleep(down);
            let (reached, detail) = crash_at(server, shared, CHAIN_MID_COPY, true)?;
            if !reached {
                missed = Some(fault.name());
            }
            format!(
                "killed, down for {} ms, restarted: {detail}",
                down.as_millis()
            )
        }
        Fault::ClockSkew => {
            let magnitude: i64 = rng.gen_range(5_000..30_000);
            let skew = if rng.gen_bool(0.5) {
                magnitude
            } else {
                -magnitude
            };
            let window = Duration::from_millis(rng.gen_range(500..3000));
            shared.skew_ms.store(skew, Ordering::Relaxed);
            std::thread::sleep(window);
            shared.skew_ms.store(0, Ordering::Relaxed);
            format!("client clocks {skew:+} ms for {} ms", window.as_millis())
        }
        Fault::ClockOffset => {
            let magnitude: i64 = rng.gen_range(500..5_000);
            let offset = if rng.gen_bool(0.5) {
                magnitude
            } else {
                -magnitude
            };
            server.kill9();
            shared.end_incarnation();
            server.clock_offset_ms = offset;
            shared.record_clock_offset(offset);
            server.restart().context("restart with a clock offset")?;
            format!("killed and restarted with its clock {offset:+} ms")
        }
        Fault::Partition => {
            let net = net.context("a partition needs the nodes' network namespaces")?;
            let window =
                Duration::from_millis(rng.gen_range(NODE_LEASE_MS - 1000..NODE_LEASE_MS + 4000));
            let detail = if rng.gen_bool(0.5) {
                for other in (0..n).filter(|&o| o != target) {
                    net.cut(target, other)?;
                }
                format!("node {} cut off from the others", target + 1)
            } else {
                let other = (target + rng.gen_range(1..n)) % n;
                net.cut(target, other)?;
                format!("link between nodes {} and {} cut", target + 1, other + 1)
            };
            std::thread::sleep(window);
            net.heal()?;
            format!("{detail} for {} ms", window.as_millis())
        }
        Fault::Loss => {
            let net = net.context("packet loss needs the nodes' network namespaces")?;
            let percent = rng.gen_range(5..=40);
            let window = Duration::from_millis(rng.gen_range(2000..8000));
            let (others, what) = if rng.gen_bool(0.5) {
                let others: Vec<usize> = (0..n).filter(|&o| o != target).collect();
                (others, format!("node {} and the others", target + 1))
            } else {
                let other = (target + rng.gen_range(1..n)) % n;
                (
                    vec![other],
                    format!("nodes {} and {}", target + 1, other + 1),
                )
            };
            let lost = net.lose(target, &others, percent);
            if lost.is_ok() {
                std::thread::sleep(window);
            }
            net.unshape();
            lost?;
            format!(
                "{percent} % of the packets between {what} dropped for {} ms",
                window.as_millis()
            )
        }
        Fault::SlowLink => {
            let net = net.context("a slow link needs the nodes' network namespaces")?;
            let rate_kbit = rng.gen_range(64..=1024);
            let latency_ms = rng.gen_range(50..=500);
            let window = Duration::from_millis(rng.gen_range(2000..8000));
            let slowed = net.slow(target, rate_kbit, latency_ms);
            if slowed.is_ok() {
                std::thread::sleep(window);
            }
            net.unshape();
            slowed?;
            format!(
                "link limited to {rate_kbit} kbit/s, queueing up to {latency_ms} ms, for {} ms",
                window.as_millis()
            )
        }
    };
    let detail = if cluster && !matches!(fault, Fault::Partition | Fault::Loss) {
        format!("node {}: {detail}", target + 1)
    } else {
        detail
    };
    shared.record_fault(FaultRecord {
        // Counted as what happened: a failpoint not reached is a kill -9.
        kind: if missed.is_some() {
            Fault::Kill9.name()
        } else {
            fault.name()
        }
        .to_owned(),
        started_us,
        ended_us: now_us(),
        detail,
        missed: missed.map(str::to_owned),
    });
    Ok(())
}

/// Arms `point` and waits for the process to abort there; kills it if the point is not reached.
/// With `starting`, the server is down and is started once armed (a point reached on the way
/// back, such as `chain-mid-copy`).
fn crash_at(
    server: &mut Server,
    shared: &Shared,
    point: &str,
    starting: bool,
) -> anyhow::Result<(bool, String)> {
    server.arm(point)?;
    let armed = Instant::now();
    let limit = if starting {
        // It may abort before it accepts connections: `wait_exit`, not `wait_ready`.
        server.spawn_only().context("start, armed")?;
        COPY_WAIT
    } else {
        FAILPOINT_WAIT
    };
    let reached = server.wait_exit(limit);
    if !reached {
        server.kill9();
    }
    shared.end_incarnation();
    server.disarm(point);
    server
        .restart()
        .with_context(|| format!("restart after the {point} failpoint"))?;
    let detail = if reached {
        format!(
            "aborted at {point} {} ms after arming; restarted",
            armed.elapsed().as_millis()
        )
    } else {
        format!("{point} not reached in {limit:?}: killed instead; restarted")
    };
    Ok((reached, detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_drawn_only_where_it_can_act() {
        let run = Duration::from_secs(10);
        let mut drawn = Vec::new();
        for seed in 0..500 {
            for (_, fault) in schedule(seed, run, &[], false, false) {
                assert!(!fault.needs_net() && !fault.cluster_only(), "{fault:?}");
                drawn.push(fault);
            }
            for (_, fault) in schedule(seed, run, &[], true, true) {
                assert!(!fault.single_only(), "{fault:?} on a cluster");
                drawn.push(fault);
            }
            for (_, fault) in schedule(seed, run, &[], true, false) {
                assert!(!fault.needs_net(), "{fault:?} without namespaces");
            }
        }
        for fault in kinds() {
            assert!(drawn.contains(&fault), "{} never drawn", fault.name());
        }
    }

    #[test]
    fn every_kind_has_its_own_report_name() {
        let names: Vec<&str> = kinds().map(Fault::name).collect();
        for (i, name) in names.iter().enumerate() {
            // A failpoint's own name (`Fault::Crash`'s fallback) is not a report name.
            assert!(!name.contains('-'), "{name}");
            assert!(!names[..i].contains(name), "{name} twice");
        }
        // The server arms every crash point these faults create a marker for.
        for fault in kinds() {
            if let Fault::Crash(point) = fault {
                assert!(crate::server::CRASH_POINTS.contains(&point), "{point}");
            }
        }
        assert!(crate::server::CRASH_POINTS.contains(&CHAIN_MID_COPY));
    }
}
