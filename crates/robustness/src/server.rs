//! The server under test: a real `mqstate serve` process on a loopback port with its own data
//! directory, killed, paused, crashed at failpoints and restarted on the same port and data.

use std::fs::{self, File};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The servers' log filter (`MQSTATE_LOG`), `warn` unless this is set: more to analyse a finding
/// with, e.g. `warn,mqstate_sessions=info`.
const SERVER_LOG_ENV: &str = "MQSTATE_ROBUSTNESS_SERVER_LOG";

/// How long a start (recovery included) may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The failpoints every process is started with, each armed by creating its marker file
/// (`crates/wal/src/failpoint.rs`; one spec per point, joined with `,`).
pub const CRASH_POINTS: [&str; 8] = [
    "after-write-before-fsync",
    "mid-snapshot",
    "before-rename",
    "power-loss",
    // The state store's: a notified write reserved and executed, its commit not logged yet.
    "notify-after-reserve",
    // The chain protocol's (`crates/replication/src/failpoint.rs`), reached on a cluster node only.
    "chain-head-after-prepare",
    "chain-tail-before-commit",
    "chain-mid-copy",
];

pub struct Server {
    binary: PathBuf,
    pub addr: SocketAddr,
    data_dir: PathBuf,
    markers: PathBuf,
    log: PathBuf,
    fsync: String,
    /// More `serve` arguments (a cluster node's `--node-id`, `--peers`, …).
    extra_args: Vec<String>,
    /// The network namespace the process runs in (a cluster node under `cluster::Net`).
    netns: Option<String>,
    /// Added to the process's wall clock from its next start (`--test-clock-offset-ms`).
    pub clock_offset_ms: i64,
    child: Option<Child>,
}

/// Where and how a cluster node runs (`Server::start_node`).
pub struct Launch {
    pub addr: SocketAddr,
    pub extra_args: Vec<String>,
    pub netns: Option<String>,
}

impl Server {
    /// Starts a server on a free loopback port with `extra_args`; its data and marker files live
    /// under `run_dir`.
    pub fn start(
        binary: &Path,
        run_dir: &Path,
        fsync: &str,
        extra_args: &[&str],
    ) -> anyhow::Result<Server> {
        let launch = Launch {
            addr: free_addr()?,
            extra_args: extra_args.iter().map(|a| (*a).to_owned()).collect(),
            netns: None,
        };
        Server::start_node(binary, run_dir, fsync, launch)
    }

    /// Starts a server as `launch` says; its data, log and marker files live under `dir`.
    pub fn start_node(
        binary: &Path,
        dir: &Path,
        fsync: &str,
        launch: Launch,
    ) -> anyhow::Result<Server> {
        let mut server = Server::prepare(binary, dir, fsync, launch)?;
        server.spawn()?;
        Ok(server)
    }

    /// A server not started yet (`restart` starts it): the nodes of a cluster are spawned
    /// together and waited for together, since none answers before the others are up.
    pub fn prepare(
        binary: &Path,
        dir: &Path,
        fsync: &str,
        launch: Launch,
    ) -> anyhow::Result<Server> {
        let markers = dir.join("markers");
        fs::create_dir_all(&markers).context("creating the marker directory")?;
        Ok(Server {
            binary: binary.to_path_buf(),
            addr: launch.addr,
            data_dir: dir.join("data"),
            markers,
            log: dir.join("server.log"),
            fsync: fsync.to_owned(),
            extra_args: launch.extra_args,
            netns: launch.netns,
            clock_offset_ms: 0,
            child: None,
        })
    }

    fn failpoint_spec(&self) -> String {
        let mut specs = vec![format!("enospc:{}", self.marker("disk-full").display())];
        for point in CRASH_POINTS {
            specs.push(format!("{point}@{}", self.marker(point).display()));
        }
        specs.join(",")
    }

    pub fn marker(&self, name: &str) -> PathBuf {
        self.markers.join(name)
    }

    pub fn arm(&self, name: &str) -> anyhow::Result<()> {
        File::create(self.marker(name)).context("creating a failpoint marker")?;
        Ok(())
    }

    pub fn disarm(&self, name: &str) {
        let _ = fs::remove_file(self.marker(name));
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        self.spawn_only()?;
        self.wait_ready()
    }

    /// Starts the process without waiting for it to accept connections.
    pub fn spawn_only(&mut self) -> anyhow::Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .context("opening the server log")?;
        // `ip netns exec` execs the server in place: the child's pid is the server's.
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        let child = command
            .arg("serve")
            .arg("--listen")
            .arg(self.addr.to_string())
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args([
                "--fsync",
                &self.fsync,
                "--snapshot-threshold-bytes",
                "262144",
            ])
            .args(&self.extra_args)
            .args(
                (self.clock_offset_ms != 0)
                    .then(|| format!("--test-clock-offset-ms={}", self.clock_offset_ms)),
            )
            .env("MQSTATE_FAILPOINT", self.failpoint_spec())
            .env(
                "MQSTATE_LOG",
                std::env::var(SERVER_LOG_ENV).unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    pub fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "mqstate serve exited during start-up ({status}); see {}",
                    self.log.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "mqstate serve did not accept connections on {} in time",
                    self.addr
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How the process ended, if it exited without being told to.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status.to_string())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `limit` for the process to exit on its own (an armed failpoint); `true` if it did.
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_)) = child.try_wait() {
                    self.child = None;
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`).
    pub fn signal(&self, name: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .arg(format!("-{name}"))
                .arg(pid.to_string())
                .status();
        }
    }

    /// SIGTERM and wait for a graceful exit (bounded: SIGKILL after 20 s).
    pub fn stop(&mut self) {
        self.signal("CONT");
        self.signal("TERM");
        if !self.wait_exit(Duration::from_secs(20)) {
            self.kill9();
        }
    }

    pub fn restart(&mut self) -> anyhow::Result<()> {
        debug_assert!(self.child.is_none());
        self.spawn()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.signal("CONT");
        self.kill9();
    }
}

pub fn free_addr() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(listener.local_addr()?)
}
