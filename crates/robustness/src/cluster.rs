//! A 3-node cluster under test: three `mqstate serve` processes founding one cluster, each in its
//! own network namespace joined to the driver by a bridge (`Net`) when the machine allows it, so
//! that the links between nodes can be cut; on loopback with distinct ports otherwise (no
//! partitions then).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use crate::server::{free_addr, Launch, Server};

mod shaping;

/// The MQTT and cluster ports of a node inside its own namespace (each has its own address).
const MQTT_PORT: u16 = 1883;
const CLUSTER_PORT: u16 = 7001;

/// Network namespaces `<prefix>n1..n3`, each with one veth whose other end is on the bridge
/// `<prefix>br` in the driver's namespace, on a private /24 (10.218.X.0, the bridge .254, node i .i).
/// Faults change routes inside the namespaces only: a cut link is a blackhole route on each side.
pub struct Net {
    prefix: String,
    subnet: u8,
    nodes: usize,
    /// The links currently cut (node indexes, smaller first).
    cut: Vec<(usize, usize)>,
}

impl Net {
    /// Sets the namespaces up; `Ok(None)` when this machine does not allow it (not root, no
    /// `ip`), so the caller runs on loopback instead.
    pub fn create(nodes: usize) -> anyhow::Result<Option<Net>> {
        let pid = std::process::id();
        let prefix = format!("mqr{pid}");
        let probe = format!("{prefix}probe");
        if !quiet(&["ip", "netns", "add", &probe]) {
            return Ok(None);
        }
        quiet(&["ip", "netns", "del", &probe]);
        // Drivers running at once (scripts/robustness-soak.sh --parallel) each take a subnet no
        // other holds: chosen and claimed (the bridge's address) under one lock per machine.
        let lock_path = std::env::temp_dir().join("mqstate-robustness-net.lock");
        let lock = std::fs::File::create(&lock_path)
            .with_context(|| format!("creating {}", lock_path.display()))?;
        lock.lock()
            .with_context(|| format!("locking {}", lock_path.display()))?;
        remove_stale();
        let subnet = free_subnet(pid)?;
        let net = Net {
            prefix,
            subnet,
            nodes,
            cut: Vec::new(),
        };
        net.teardown();
        let made = net
            .setup()
            .context("setting up the nodes' network namespaces");
        drop(lock);
        made?;
        Ok(Some(net))
    }

    fn ns(&self, i: usize) -> String {
        format!("{}n{}", self.prefix, i + 1)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }

    pub fn ip(&self, i: usize) -> Ipv4Addr {
        let host = u8::try_from(i + 1).unwrap_or(u8::MAX);
        Ipv4Addr::new(10, 218, self.subnet, host)
    }

    fn setup(&self) -> anyhow::Result<()> {
        let br = self.bridge();
        let gateway = format!("10.218.{}.254/24", self.subnet);
        run(&["ip", "link", "add", &br, "type", "bridge"])?;
        run(&["ip", "addr", "add", &gateway, "dev", &br])?;
        run(&["ip", "link", "set", &br, "up"])?;
        for i in 0..self.nodes {
            let ns = self.ns(i);
            let outside = format!("{}v{}", self.prefix, i + 1);
            let inside = format!("{}p{}", self.prefix, i + 1);
            let addr = format!("{}/24", self.ip(i));
            run(&["ip", "netns", "add", &ns])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            run(&[
                "ip", "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ])?;
            run(&["ip", "link", "set", &inside, "netns", &ns])?;
            run(&["ip", "-n", &ns, "link", "set", &inside, "name", "eth0"])?;
            run(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            run(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            run(&["ip", "link", "set", &outside, "master", &br])?;
            run(&["ip", "link", "set", &outside, "up"])?;
        }
        Ok(())
    }

    /// Removes what `setup` made (the veths go with their namespaces); errors ignored.
    fn teardown(&self) {
        for i in 0..self.nodes {
            quiet(&["ip", "netns", "del", &self.ns(i)]);
        }
        quiet(&["ip", "link", "del", &self.bridge()]);
    }

    fn route(&self, verb: &str, from: usize, to: usize) -> anyhow::Result<()> {
        let target = format!("{}/32", self.ip(to));
        run(&[
            "ip",
            "-n",
            &self.ns(from),
            "route",
            verb,
            "blackhole",
            &target,
        ])
    }

    /// Cuts the link between nodes `a` and `b` both ways (packets silently dropped, as on a
    /// partitioned network: no reset, connections hang). Clients still reach both.
    pub fn cut(&mut self, a: usize, b: usize) -> anyhow::Result<()> {
        let link = (a.min(b), a.max(b));
        if a == b || self.cut.contains(&link) {
            return Ok(());
        }
        self.route("add", a, b)?;
        self.route("add", b, a)?;
        self.cut.push(link);
        Ok(())
    }

    /// Restores every cut link and removes every loss rule and rate limit (`shaping`).
    pub fn heal(&mut self) -> anyhow::Result<()> {
        self.unshape();
        for (a, b) in std::mem::take(&mut self.cut) {
            self.route("del", a, b)?;
            self.route("del", b, a)?;
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Removes the namespaces and bridges of drivers that ended without cleaning up (killed): those
/// named `mqr<pid>…` whose process is gone.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    let listing = String::from_utf8_lossy(&out.stdout);
    for name in listing.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix("mqr") else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('n') else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new(&format!("/proc/{pid}")).exists() {
            quiet(&["ip", "netns", "del", name]);
            quiet(&["ip", "link", "del", &format!("mqr{pid}br")]);
        }
    }
}

fn quiet(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The cluster settings every node runs with, beyond its addresses (the defaults otherwise: lease
/// 3 s, clock factor 1 s, election timeout 1 s).
const CLUSTER_ARGS: [&str; 2] = ["--replication-factor", "3"];

/// Starts nodes 1..=n founding one cluster: in `net`'s namespaces when given, else on loopback.
/// Returns them in node order once each accepts MQTT connections.
pub fn start(
    binary: &Path,
    run_dir: &Path,
    fsync: &str,
    n: usize,
    net: Option<&Net>,
) -> anyhow::Result<Vec<Server>> {
    let mut addrs = Vec::with_capacity(n);
    for i in 0..n {
        addrs.push(match net {
            Some(net) => (
                SocketAddr::new(IpAddr::V4(net.ip(i)), MQTT_PORT),
                SocketAddr::new(IpAddr::V4(net.ip(i)), CLUSTER_PORT),
            ),
            None => (free_addr()?, free_addr()?),
        });
    }
    let peers = addrs
        .iter()
        .enumerate()
        .map(|(i, (_, cluster))| format!("{}={cluster}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut servers = Vec::with_capacity(n);
    for (i, (mqtt, cluster)) in addrs.iter().enumerate() {
        let mut extra_args: Vec<String> = vec![
            "--node-id".into(),
            (i + 1).to_string(),
            "--cluster-listen".into(),
            cluster.to_string(),
            "--peers".into(),
            peers.clone(),
        ];
        if net.is_some() {
            // Private addresses of our own namespaces, reached only from this machine.
            extra_args
                .extend(["--cluster-plaintext", "--allow-anonymous", "true"].map(str::to_owned));
        }
        extra_args.extend(CLUSTER_ARGS.iter().map(|s| (*s).to_owned()));
        let launch = Launch {
            addr: *mqtt,
            extra_args,
            netns: net.map(|net| net.ns(i)),
        };
        let dir = run_dir.join(format!("n{}", i + 1));
        let mut server = Server::prepare(binary, &dir, fsync, launch)?;
        server.spawn_only()?;
        servers.push(server);
    }
    for server in &mut servers {
        server.wait_ready()?;
    }
    Ok(servers)
}

/// The first 10.218.X.0/24 from `pid % 250` on that no interface of this namespace has an address in
/// (another driver's bridge).
fn free_subnet(pid: u32) -> anyhow::Result<u8> {
    let out = Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .context("running ip addr show")?;
    let listed = String::from_utf8_lossy(&out.stdout);
    let taken: Vec<u8> = listed
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("10.218."))
        .filter_map(|rest| rest.split('.').next()?.parse().ok())
        .collect();
    (0..250u32)
        .map(|i| u8::try_from((pid + i) % 250).unwrap_or(0))
        .find(|subnet| !taken.contains(subnet))
        .context("every subnet 10.218.0-249.0/24 is taken by another driver")
}
