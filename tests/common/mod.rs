//! Shared harness for the integration tests: runs the real `mqstate serve` binary on a free loopback port
//! with its own data directory, and stops it (gracefully or with SIGKILL) on demand.
#![allow(dead_code)] // each test binary uses a different subset

pub mod cluster;
pub mod mqtt;
pub mod proxy;
pub mod sdk;
pub mod state;
pub mod topic;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to start accepting connections (recovery included).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Set to `1`, every [`Server`] runs as a one-member cluster (`--node-id 1 --peers 1=…`): the
/// state store's keys on chains of one instead of the single node's executor (issue 15, decision
/// 0064). `MQSTATE_TEST_CHAIN_OF_ONE=1 cargo test --test statestore` runs the single-node
/// scenarios through the chain path.
pub const CHAIN_OF_ONE_ENV: &str = "MQSTATE_TEST_CHAIN_OF_ONE";

/// Whether this test run asked for chains of one ([`CHAIN_OF_ONE_ENV`]).
pub fn chain_of_one() -> bool {
    std::env::var(CHAIN_OF_ONE_ENV).is_ok_and(|v| v == "1")
}

pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
    /// The cluster address of a one-member cluster ([`chain_of_one`]); kept across restarts.
    cluster_addr: Option<SocketAddr>,
    data_dir: PathBuf,
    extra_args: Vec<String>,
    env: Vec<(String, String)>,
    _temp: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts a server on a fresh data directory.
    pub fn start() -> Server {
        Server::start_with(&[])
    }

    /// Starts a server on a fresh data directory with extra `serve` flags.
    pub fn start_with(extra_args: &[&str]) -> Server {
        let temp = tempfile::tempdir().expect("temp dir");
        let data_dir = temp.path().join("data");
        let mut server = Server {
            child: None,
            addr: free_addr(),
            cluster_addr: chain_of_one().then(free_addr),
            data_dir,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            _temp: Some(temp),
        };
        server.spawn();
        server
    }

    /// Starts a one-member cluster on a fresh data directory, whatever [`CHAIN_OF_ONE_ENV`] says,
    /// once its chains serve.
    pub fn start_chain_of_one() -> Server {
        let temp = tempfile::tempdir().expect("temp dir");
        let data_dir = temp.path().join("data");
        let mut server = Server {
            child: None,
            addr: free_addr(),
            cluster_addr: Some(free_addr()),
            data_dir,
            extra_args: Vec::new(),
            env: Vec::new(),
            _temp: Some(temp),
        };
        server.spawn();
        server
    }

    /// Starts a server on `data_dir` (which the caller owns) with extra `serve` flags and
    /// environment variables.
    pub fn start_in(data_dir: &Path, extra_args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut server = Server {
            child: None,
            addr: free_addr(),
            cluster_addr: chain_of_one().then(free_addr),
            data_dir: data_dir.to_path_buf(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            _temp: None,
        };
        server.spawn();
        server
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Process id of the running server.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mqstate"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(self.addr.to_string())
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(&self.extra_args)
            .args(self.cluster_args())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env(
                "MQSTATE_LOG",
                std::env::var("MQSTATE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawn mqstate serve");
        self.child = Some(child);
        self.wait_ready();
    }

    fn cluster_args(&self) -> Vec<String> {
        // A test that configures a cluster itself keeps its own.
        if self.extra_args.iter().any(|a| a == "--node-id") {
            return Vec::new();
        }
        match self.cluster_addr {
            Some(addr) => vec![
                "--node-id".into(),
                "1".into(),
                "--cluster-listen".into(),
                addr.to_string(),
                "--peers".into(),
                format!("1={addr}"),
            ],
            None => Vec::new(),
        }
    }

    fn wait_ready(&mut self) {
        self.wait_listening();
        if !self.cluster_args().is_empty() {
            self.wait_formed();
        }
    }

    /// A one-member cluster answers a GET through its chain once it formed and its views act.
    fn wait_formed(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let status = Command::new(env!("CARGO_BIN_EXE_mqstate"))
                .args(["get", "--port", &self.port().to_string(), "--timeout", "2"])
                .arg("__chain_of_one_formed")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("run mqstate get");
            // 0: found, 1: not found — either way the chain answered.
            if matches!(status.code(), Some(0 | 1)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the one-member cluster on {} did not form in time",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("mqstate serve exited during start-up: {status}");
                }
            }
            assert!(
                Instant::now() < deadline,
                "mqstate serve did not accept connections on {} in time",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no chance to flush anything that was not already durable.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the server to exit on its own (a crash point, say).
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("server is running");
        child.wait().expect("wait for mqstate serve")
    }

    /// SIGTERM and wait for a graceful exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("server is running");
        // kill(1) sends SIGTERM without a libc binding (std only offers SIGKILL).
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        child.wait().expect("wait for mqstate serve")
    }

    /// Sends a signal by name (`HUP`, `TERM`, ...) to the running server.
    pub fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("server is running");
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Starts the server again on the same address and data directory.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill the server first");
        self.spawn();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Waits for a server process started outside [`Server`] to exit; kills it and fails if it is
/// still running after [`state::WAIT`].
pub fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + state::WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}: the server kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback address that was free a moment ago, for a server process to bind.
///
/// Not the kernel's `bind(0)`: that hands out ports from the ephemeral range, where any client
/// socket of any test may take the same port between our check and the server's bind (seen as a
/// server that could not start, or a client refused by the wrong server). These come from below
/// the ephemeral range (32768 up on Linux), each port once per test process (a counter), starting
/// at an offset from the process id so concurrent test binaries rarely meet.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 12_000;
    const SPAN: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let start = (std::process::id() % 97) * (SPAN / 97);
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..SPAN {
        let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN;
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port as u16)) {
            return listener.local_addr().expect("local addr");
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + SPAN)
}

/// A plain HTTP/1.1 GET (one request, then close): the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .expect("connect to HTTP endpoint");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send HTTP request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read HTTP response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of HTTP headers in {response:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {head:?}"));
    (status, body.to_owned())
}

/// Runs `mqstate serve ARGS` with its standard error captured (so not a terminal) and reads it until a
/// line contains `until` or the server exits (bounded by [`START_TIMEOUT`]); then kills it. Returns
/// what it wrote and its exit status if it exited by itself.
pub fn serve_stderr(
    args: &[&str],
    env: &[(&str, &str)],
    until: &str,
) -> (String, Option<std::process::ExitStatus>) {
    use std::io::{BufRead, BufReader};
    let temp = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("serve")
        .arg("--data-dir")
        .arg(temp.path().join("data"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mqstate serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let until = until.to_owned();
    std::thread::spawn(move || {
        let mut text = String::new();
        let mut found = false;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            found = line.contains(&until);
            text.push_str(&line);
            text.push('\n');
            if found {
                break;
            }
        }
        let _ = tx.send((text, found));
    });
    let (text, found) = rx
        .recv_timeout(START_TIMEOUT)
        .unwrap_or_else(|_| (String::new(), true));
    // Standard error closed without the line: the server is exiting, so wait for its status.
    let status = if found {
        child.try_wait().ok().flatten()
    } else {
        child.wait().ok()
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    (text, status)
}
