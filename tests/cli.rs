//! The state-store CLI against a real `mqstate serve`: exit codes, JSON output, binary values, scan,
//! watch, and lock renewals with fencing.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Output, Stdio};

use common::Server;

fn mqstate(server: &Server, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mqstate"));
    // Connection flags right after the subcommand: anything after `lock … --` belongs to the command.
    let (subcommand, rest) = args.split_first().expect("a subcommand");
    cmd.arg(subcommand)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &server.port().to_string(),
            "--timeout",
            "10",
        ])
        .args(rest)
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .env_remove("AIO_MQTT_USE_TLS")
        .env_remove("AIO_MQTT_CLIENT_ID");
    cmd
}

fn run(server: &Server, args: &[&str]) -> Output {
    mqstate(server, args).output().expect("run mqstate")
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exit code")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(output)))
}

#[test]
fn set_get_and_exit_codes() {
    let server = Server::start();
    let set = run(&server, &["set", "greeting", "hello"]);
    assert_eq!(code(&set), 0, "{set:?}");
    assert_eq!(stdout(&set), "OK\n");

    let get = run(&server, &["get", "greeting"]);
    assert_eq!(code(&get), 0);
    assert_eq!(stdout(&get), "hello\n");

    let doc = json(&run(&server, &["get", "greeting", "--json"]));
    assert_eq!(doc["found"], true);
    assert_eq!(doc["value"], "hello");
    let version = doc["version"].as_str().expect("version");
    assert_eq!(version.split(':').count(), 3, "{version}");

    let miss = run(&server, &["get", "absent"]);
    assert_eq!(code(&miss), 1);
    assert_eq!(stdout(&miss), "");
    assert_eq!(
        json(&run(&server, &["get", "absent", "--json"]))["found"],
        false
    );

    let nx = run(&server, &["set", "greeting", "other", "--nx"]);
    assert_eq!(code(&nx), 1);
    assert_eq!(
        json(&run(
            &server,
            &["set", "greeting", "other", "--nx", "--json"]
        ))["applied"],
        false
    );
    assert_eq!(
        code(&run(&server, &["set", "greeting", "hello", "--nex"])),
        0
    );
    assert_eq!(code(&run(&server, &["set", "greeting", "bye", "--nex"])), 1);
    assert_eq!(stdout(&run(&server, &["get", "greeting"])), "hello\n");
}

#[test]
fn binary_values_round_trip_through_files_stdin_and_raw_output() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("value.bin");
    let bytes: Vec<u8> = (0..=255u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let arg = format!("@{}", path.display());
    assert_eq!(code(&run(&server, &["set", "bin", &arg])), 0);

    let raw = run(&server, &["get", "bin", "--raw"]);
    assert_eq!(code(&raw), 0);
    assert_eq!(raw.stdout, bytes);

    let escaped = stdout(&run(&server, &["get", "bin"]));
    assert!(escaped.starts_with("\\x00\\x01"), "{escaped}");
    assert!(escaped.ends_with("\\xfe\\xff\n"), "{escaped}");
    assert_eq!(
        json(&run(&server, &["get", "bin", "--json"]))["value_hex"]
            .as_str()
            .unwrap()
            .len(),
        512
    );

    let mut child = mqstate(&server, &["set", "from-stdin", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"line1\nline2\0")
        .unwrap();
    assert_eq!(code(&child.wait_with_output().unwrap()), 0);
    assert_eq!(
        run(&server, &["get", "from-stdin", "--raw"]).stdout,
        b"line1\nline2\0"
    );

    let empty = run(&server, &["set", "empty", ""]);
    assert_eq!(code(&empty), 0);
    let got = run(&server, &["get", "empty", "--raw"]);
    assert_eq!(code(&got), 0, "an empty value exists");
    assert!(got.stdout.is_empty());
}

#[test]
fn del_and_vdel_report_what_happened() {
    let server = Server::start();
    assert_eq!(code(&run(&server, &["set", "k", "v1"])), 0);
    let differs = run(&server, &["vdel", "k", "other", "--json"]);
    assert_eq!(code(&differs), 1);
    assert_eq!(json(&differs)["reason"], "value differs");
    assert_eq!(code(&run(&server, &["vdel", "k", "v1"])), 0);
    let gone = run(&server, &["vdel", "k", "v1", "--json"]);
    assert_eq!(code(&gone), 1);
    assert_eq!(json(&gone)["reason"], "not found");

    assert_eq!(code(&run(&server, &["set", "k", "v2"])), 0);
    let del = run(&server, &["del", "k"]);
    assert_eq!((code(&del), stdout(&del).as_str()), (0, "deleted\n"));
    assert_eq!(code(&run(&server, &["del", "k"])), 1);
}

#[test]
fn scan_lists_matching_keys() {
    let server = Server::start();
    for key in ["app/a", "app/b", "app/sub/c", "other"] {
        assert_eq!(code(&run(&server, &["set", key, "x"])), 0);
    }
    let scan = run(&server, &["scan", "app/*"]);
    assert_eq!(code(&scan), 0, "{scan:?}");
    let mut keys: Vec<String> = stdout(&scan).lines().map(str::to_owned).collect();
    keys.sort();
    assert_eq!(keys, ["app/a", "app/b", "app/sub/c"]);
    let doc = json(&run(&server, &["scan", "app/?", "--json"]));
    let mut listed: Vec<&str> = doc["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    listed.sort_unstable();
    assert_eq!(listed, ["app/a", "app/b"]);
}

#[test]
fn watch_prints_each_change() {
    let server = Server::start();
    let mut watcher = mqstate(&server, &["watch", "watched", "--count", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(watcher.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.contains("watching 1 key"), "{line}");

    assert_eq!(code(&run(&server, &["set", "watched", "v\t1"])), 0);
    assert_eq!(code(&run(&server, &["del", "watched"])), 0);
    let output = watcher.wait_with_output().unwrap();
    assert_eq!(code(&output), 0);
    let lines: Vec<String> = stdout(&output).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].starts_with("SET\twatched\tv\\t1\t"),
        "{}",
        lines[0]
    );
    assert!(lines[1].starts_with("DELETE\twatched\t"), "{}", lines[1]);
}

#[test]
fn lock_renews_while_the_command_runs_and_passes_a_usable_fencing_token() {
    let server = Server::start();
    let bin = env!("CARGO_BIN_EXE_mqstate");
    let port = server.port().to_string();
    // Inside the lock: the token fences a write, the lock outlives its TTL thanks to renewals (a second
    // `lock` still finds it held after 2.5 TTLs), and the exit status of the command is passed through.
    let script = format!(
        r#"set -e
{bin} set protected v1 --fence "$MQSTATE_FENCING_TOKEN" --port {port}
sleep 2.5
if {bin} lock L --ttl 1000 --port {port} -- true; then exit 10; fi
exit 7"#
    );
    let locked = run(
        &server,
        &["lock", "L", "--ttl", "1000", "--", "sh", "-c", &script],
    );
    assert_eq!(
        code(&locked),
        7,
        "{}",
        String::from_utf8_lossy(&locked.stderr)
    );
    assert!(String::from_utf8_lossy(&locked.stderr).contains("fencing token"));

    // The key is now fenced: a write without a token is refused (exit 1: condition not met).
    let unfenced = run(&server, &["set", "protected", "v2"]);
    assert_eq!(code(&unfenced), 1, "{unfenced:?}");
    assert!(String::from_utf8_lossy(&unfenced.stderr).contains("fencing token"));

    // Released on exit: the lock can be taken again at once.
    assert_eq!(
        code(&run(&server, &["lock", "L", "--ttl", "1000", "--", "true"])),
        0
    );
}

#[test]
fn unreachable_broker_and_bad_usage_exit_2() {
    let server = Server::start();
    let free = common::free_addr().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["get", "k", "--port", &free, "--timeout", "1"])
        .env_remove("AIO_BROKER_HOSTNAME")
        .output()
        .unwrap();
    assert_eq!(code(&out), 2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--host/--port"));

    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["get", "k", "--port", &free, "--timeout", "1", "--json"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 2);
    assert_eq!(json(&out)["exit"], 2);

    assert_eq!(code(&run(&server, &["set", "only-a-key"])), 2);
    assert_eq!(
        code(&run(&server, &["set", "k", "v", "--fence", "not-an-hlc"])),
        2
    );
}
