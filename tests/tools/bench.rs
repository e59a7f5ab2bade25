//! `mqstate bench` end to end: against mosquitto with `bench --responder` answering (the baseline
//! path, skipped when mosquitto is not installed) and against a real `mqstate serve`. No speed
//! thresholds: the runs must complete, count every request, and report ordered percentiles.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A mosquitto broker on a free loopback port, stopped on drop.
struct Mosquitto {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Mosquitto {
    /// `None` (with a message) when mosquitto is not installed.
    fn start() -> Option<Mosquitto> {
        let binary = [
            "/usr/sbin/mosquitto",
            "/usr/bin/mosquitto",
            "/usr/local/sbin/mosquitto",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .or_else(|| {
            Command::new("mosquitto")
                .arg("-h")
                .output()
                .ok()
                .map(|_| "mosquitto")
        });
        let Some(binary) = binary else {
            eprintln!("SKIPPED: mosquitto is not installed (apt-get install -y mosquitto)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_addr().port();
        let config = dir.path().join("mosquitto.conf");
        std::fs::write(
            &config,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .unwrap();
        let child = Command::new(binary)
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mosquitto");
        let deadline = Instant::now() + common::START_TIMEOUT;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "mosquitto did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Mosquitto {
            child,
            port,
            _dir: dir,
        })
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `bench --responder` on the broker, returned once it reports that it is subscribed.
struct Responder(Child);

impl Responder {
    fn start(port: u16) -> Responder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
            .args([
                "bench",
                "--responder",
                "--connections",
                "2",
                "--port",
                &port.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the responder");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("responder ready"), "{line}");
        Responder(child)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `bench --port PORT --json FILE ARGS` and returns its table and its `--json` report.
fn run_bench(port: u16, args: &[&str]) -> (String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("bench")
        .args(["--port", &port.to_string(), "--json"])
        .arg(&report)
        .args(args)
        .output()
        .expect("run bench");
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    (table, report)
}

/// Runs a measured `bench` and returns its `--json` report.
fn bench(port: u16, args: &[&str]) -> Value {
    let (table, report) = run_bench(port, args);
    assert!(table.contains("ops/s") && table.contains("p99"), "{table}");
    report
}

fn assert_sane(report: &Value, ops: u64) {
    assert_eq!(report["ops"], ops, "{report:#}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report:#}");
    let at = |f: &str| {
        report[f]
            .as_u64()
            .unwrap_or_else(|| panic!("{f} missing: {report:#}"))
    };
    assert!(at("p50_us") >= 1);
    assert!(
        at("p50_us") <= at("p99_us")
            && at("p99_us") <= at("p999_us")
            && at("p999_us") <= at("max_us")
    );
    assert!(report["ops_per_sec"].as_f64().unwrap() > 0.0);
}

#[test]
fn statestore_load_against_the_responder_counts_every_reply() {
    let Some(broker) = Mosquitto::start() else {
        return;
    };
    let _responder = Responder::start(broker.port);
    let report = bench(
        broker.port,
        &[
            "--requests",
            "2000",
            "--connections",
            "2",
            "--inflight",
            "8",
            "--mix",
            "set=50,get=50",
        ],
    );
    assert_sane(&report, 2000);
    assert_eq!(report["replies"]["+OK"], 2000);
    assert_eq!(report["mode"], "statestore");
}

#[test]
fn pubsub_fan_out_delivers_every_message_to_every_subscriber() {
    let Some(broker) = Mosquitto::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("fanout.svg");
    let report = bench(
        broker.port,
        &[
            "--mode",
            "pubsub",
            "--publishers",
            "1",
            "--subscribers",
            "100",
            "--qos",
            "1",
            "--payload",
            "64",
            "--requests",
            "20",
            "--plot",
            svg.to_str().unwrap(),
        ],
    );
    assert_sane(&report, 2000);
    assert_eq!(report["replies"]["delivered"], 2000);
    let drawing = std::fs::read_to_string(&svg).unwrap();
    assert!(drawing.starts_with("<svg") && drawing.contains("throughput"));
}

#[test]
fn statestore_load_against_mqstate_serve() {
    let server = common::Server::start();
    let report = bench(
        server.port(),
        &[
            "--requests",
            "1500",
            "--connections",
            "3",
            "--inflight",
            "4",
            "--keys",
            "50",
            "--distribution",
            "zipf",
            "--mix",
            "set=40,get=30,del=10,vdel=10,setnx=10",
        ],
    );
    assert_sane(&report, 1500);
    let replies: u64 = report["replies"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(replies, 1500, "{report:#}");
    assert!(
        report["replies"]["+OK"].as_u64().unwrap() > 0,
        "some SETs apply: {report:#}"
    );
}

#[test]
fn idle_mode_holds_every_connection_and_reports_server_memory() {
    let server = common::Server::start();
    let pid = server.pid().to_string();
    let (table, report) = run_bench(
        server.port(),
        &[
            "--mode",
            "idle",
            "--connections",
            "200",
            "--duration",
            "0",
            "--server-pid",
            &pid,
        ],
    );
    assert!(table.contains("per connection"), "{table}");
    assert_eq!(report["connections"], 200, "{report:#}");
    assert!(report["server_rss_before_kib"].as_u64().unwrap() > 0);
    assert!(report["server_rss_after_kib"].as_u64().unwrap() > 0);
    assert!(report["bytes_per_connection"].is_number(), "{report:#}");
}
