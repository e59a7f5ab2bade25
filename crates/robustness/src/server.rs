//! The server under test: a real `mqstate serve` process on a loopback port with its own data
//! directory, killed, paused, crashed at failpoints and restarted on the same port and data.

use std::fs::{self, File};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long a start (recovery included) may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The failpoints every process is started with, each armed by creating its marker file
/// (`crates/wal/src/failpoint.rs`).
pub const CRASH_POINTS: [&str; 4] = [
    "after-write-before-fsync",
    "mid-snapshot",
    "before-rename",
    "power-loss",
];

pub struct Server {
    binary: PathBuf,
    pub addr: SocketAddr,
    data_dir: PathBuf,
    markers: PathBuf,
    log: PathBuf,
    fsync: String,
    child: Option<Child>,
}

impl Server {
    /// Starts a server on a free loopback port; its data and marker files live under `run_dir`.
    pub fn start(binary: &Path, run_dir: &Path, fsync: &str) -> anyhow::Result<Server> {
        let markers = run_dir.join("markers");
        fs::create_dir_all(&markers).context("creating the marker directory")?;
        let mut server = Server {
            binary: binary.to_path_buf(),
            addr: free_addr()?,
            data_dir: run_dir.join("data"),
            markers,
            log: run_dir.join("server.log"),
            fsync: fsync.to_owned(),
            child: None,
        };
        server.spawn()?;
        Ok(server)
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
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .context("opening the server log")?;
        let child = Command::new(&self.binary)
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
            .env("MQSTATE_FAILPOINT", self.failpoint_spec())
            .env("MQSTATE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
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

fn free_addr() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(listener.local_addr()?)
}
