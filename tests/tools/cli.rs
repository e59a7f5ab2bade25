//! The state-store CLI against a real `mqstate serve`: exit codes, JSON output, binary values, scan,
//! watch, and lock renewals with fencing.

use crate::common;

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

    // Into a pipe the value is written as it is: no escaping, no newline added.
    let get = run(&server, &["get", "greeting"]);
    assert_eq!(code(&get), 0);
    assert_eq!(stdout(&get), "hello");
    assert_eq!(
        stdout(&run(&server, &["get", "greeting", "--escape"])),
        "hello\n"
    );

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
    assert_eq!(stdout(&run(&server, &["get", "greeting"])), "hello");
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

    // What `mqstate get k > f` writes is what `mqstate set k @f` read.
    let piped = run(&server, &["get", "bin"]);
    assert_eq!(piped.stdout, bytes);
    let escaped = stdout(&run(&server, &["get", "bin", "--escape"]));
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

/// `mqstate watch KEY --count 2`, started and registered (its first stderr line read).
fn watch_two_changes(
    server: &Server,
    key: &str,
) -> (std::process::Child, BufReader<std::process::ChildStderr>) {
    let mut watcher = mqstate(server, &["watch", key, "--count", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(watcher.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.contains("watching 1 key"), "{line}");
    (watcher, stderr)
}

#[test]
fn watch_prints_each_change() {
    let server = Server::start();
    let (watcher, _stderr) = watch_two_changes(&server, "watched");

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

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `mqstate passwd` a one-user password file (alice / `wonderland`).
fn alice_password_file(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("passwd");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["passwd", "-c", "--password-stdin"])
        .arg(&path)
        .arg("alice")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"wonderland\n")
        .unwrap();
    assert!(child.wait().unwrap().success());
    path
}

#[test]
fn connection_failures_say_the_cause_and_the_fix_without_waiting() {
    let free = common::free_addr().port().to_string();
    // A --timeout far beyond the test's patience: the answer must not come from waiting it out.
    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["get", "k", "--host", "127.0.0.1", "--port", &free])
        .args(["--timeout", "3600"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 2);
    let text = stderr(&out);
    assert!(text.contains("connection refused"), "{text}");
    assert!(text.contains("--host/--port"), "{text}");
    assert!(!text.contains("within"), "{text}");
}

#[test]
fn a_wrong_password_is_reported_once_and_never_retried() {
    let dir = tempfile::tempdir().unwrap();
    let passwd = alice_password_file(dir.path());
    // Two failed logins from this address are allowed, the third locks it out: two CLI calls with a
    // wrong password must leave the correct one able to log in (no retries behind the user's back).
    let server = Server::start_with(&[
        "--password-file",
        passwd.to_str().unwrap(),
        "--auth-failure-limit",
        "3",
        "--auth-failure-refill",
        "3600",
    ]);
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "mirror\n").unwrap();
    let right = dir.path().join("right");
    std::fs::write(&right, "wonderland\n").unwrap();
    for _ in 0..2 {
        let out = run(
            &server,
            &[
                "get",
                "k",
                "--username",
                "alice",
                "--password-file",
                wrong.to_str().unwrap(),
            ],
        );
        assert_eq!(code(&out), 2, "{out:?}");
        let text = stderr(&out);
        assert!(text.contains("wrong user name or password"), "{text}");
        assert!(text.contains("--password-file"), "{text}");
    }
    let out = run(
        &server,
        &[
            "set",
            "k",
            "v",
            "--username",
            "alice",
            "--password-file",
            right.to_str().unwrap(),
        ],
    );
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

#[test]
fn a_value_beyond_the_brokers_packet_limit_is_refused_up_front_with_the_limit() {
    let server = Server::start_with(&["--max-packet-size", "4096"]);
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'x'; 8192]).unwrap();
    let out = run(&server, &["set", "big", &format!("@{}", big.display())]);
    assert_eq!(code(&out), 2, "{out:?}");
    let text = stderr(&out);
    assert!(text.contains("maximum packet size of 4096"), "{text}");
    // The connection was never dropped for it: a small value still goes through.
    assert_eq!(code(&run(&server, &["set", "small", "x"])), 0);
}

#[test]
fn a_cli_call_leaves_no_session_behind() {
    let server = Server::start();
    assert_eq!(
        code(&run(&server, &["set", "k", "v", "--client-id", "cli-once"])),
        0
    );
    // Resuming that client id finds nothing: the CLI's session ended with its connection.
    assert!(
        !session_present(server.addr, "cli-once"),
        "the CLI left its session on the server"
    );
}

#[test]
fn lock_forwards_sigterm_waits_for_the_command_then_releases() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("terminated");
    let script = format!(
        "trap 'echo done > {}; exit 5' TERM; echo started; while :; do sleep 0.05; done",
        marker.display()
    );
    let mut holder = mqstate(
        &server,
        &["lock", "L", "--ttl", "60000", "--", "sh", "-c", &script],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut out = BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "started\n");
    // While the command runs, the lock is held.
    assert_eq!(
        code(&run(
            &server,
            &["lock", "L", "--ttl", "60000", "--", "true"]
        )),
        1
    );
    let status = Command::new("kill")
        .args(["-TERM", &holder.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let finished = holder.wait_with_output().unwrap();
    // The command saw the signal, finished its own way, and its status is passed through.
    assert_eq!(code(&finished), 5, "{}", stderr(&finished));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "done\n");
    // Released, not left to expire (the TTL is a minute).
    assert_eq!(
        code(&run(
            &server,
            &["lock", "L", "--ttl", "60000", "--", "true"]
        )),
        0
    );
}

#[test]
fn lock_reports_signals_like_a_shell_and_releases_when_the_command_cannot_start() {
    let server = Server::start();
    let killed = run(
        &server,
        &[
            "lock",
            "L",
            "--ttl",
            "60000",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ],
    );
    assert_eq!(code(&killed), 128 + 9, "{}", stderr(&killed));

    let missing = run(
        &server,
        &["lock", "L", "--ttl", "60000", "--", "/nonexistent/command"],
    );
    assert_eq!(code(&missing), 127, "{}", stderr(&missing));
    assert!(stderr(&missing).contains("/nonexistent/command"));
    // Released at once, not after the minute's TTL.
    assert_eq!(
        code(&run(
            &server,
            &["lock", "L", "--ttl", "60000", "--", "true"]
        )),
        0
    );
}

#[test]
fn watch_reconnects_when_the_broker_restarts() {
    let mut server = Server::start();
    let (watcher, mut err) = watch_two_changes(&server, "w");
    let mut line = String::new();
    assert_eq!(code(&run(&server, &["set", "w", "before"])), 0);

    server.stop();
    server.restart();
    // Wait for the watcher to say it registered again, then change the key.
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "watch ended");
        if line.contains("reconnected") {
            break;
        }
    }
    assert_eq!(code(&run(&server, &["set", "w", "after"])), 0);
    let output = watcher.wait_with_output().unwrap();
    assert_eq!(code(&output), 0);
    let lines: Vec<String> = stdout(&output).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("SET\tw\tbefore\t"), "{}", lines[0]);
    assert!(lines[1].starts_with("SET\tw\tafter\t"), "{}", lines[1]);
}

/// Connects as `client_id` with Clean Start 0 (MQTT 5) and returns the CONNACK's Session Present flag.
fn session_present(addr: std::net::SocketAddr, client_id: &str) -> bool {
    use std::io::Read;
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0x00, 0, 60, 0];
    body.extend_from_slice(&u16::try_from(client_id.len()).unwrap().to_be_bytes());
    body.extend_from_slice(client_id.as_bytes());
    let mut packet = vec![0x10, u8::try_from(body.len()).unwrap()];
    packet.extend(body);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    stream.write_all(&packet).unwrap();
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).unwrap();
    assert_eq!((head[0], head[3]), (0x20, 0), "CONNACK success expected");
    head[2] & 1 == 1
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let mut server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    // More than a pipe holds, so the writer meets the closed end whatever the timing.
    std::fs::write(&big, vec![b'v'; 200_000]).unwrap();
    assert_eq!(
        code(&run(&server, &["set", "k", &format!("@{}", big.display())])),
        0
    );
    let into_closed_pipe = |mut cmd: Command| {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(stderr(&out), "", "{cmd:?} complained about the closed pipe");
        assert!(!out.status.success(), "{cmd:?}: {:?}", out.status);
    };
    into_closed_pipe(mqstate(&server, &["get", "k"]));
    // The data tools read a stopped server's directory.
    server.stop();
    let mut inspect = Command::new(env!("CARGO_BIN_EXE_mqstate"));
    inspect.args(["data", "inspect"]).arg(server.data_dir());
    into_closed_pipe(inspect);
}

#[test]
fn passwd_without_a_terminal_reads_standard_input_or_says_how() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("passwd");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["passwd", "-c"])
        .arg(&file)
        .arg("alice")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"wonderland\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(std::fs::read_to_string(&file)
        .unwrap()
        .starts_with("alice:$argon2id$"));

    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["passwd"])
        .arg(&file)
        .arg("bob")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_ne!(code(&out), 0);
    let text = stderr(&out);
    assert!(text.contains("standard input"), "{text}");
    assert!(text.contains("terminal"), "{text}");
}

#[test]
fn completions_and_man_pages_come_from_the_command_line_definition() {
    let shell = |name: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
            .args(["completions", name])
            .output()
            .unwrap();
        assert_eq!(code(&out), 0, "{out:?}");
        stdout(&out)
    };
    let bash = shell("bash");
    assert!(bash.contains("_mqstate()"), "{bash}");
    assert!(
        bash.contains("--password-file"),
        "connection flags complete too"
    );
    assert!(shell("zsh").starts_with("#compdef mqstate"));
    let fish = shell("fish");
    assert!(fish.contains("complete -c mqstate"), "{fish}");
    assert!(fish.contains("watch"), "{fish}");

    let man = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("man")
        .output()
        .unwrap();
    assert_eq!(code(&man), 0);
    let page = stdout(&man);
    assert!(
        page.starts_with(".ie") || page.contains(".TH mqstate"),
        "{page}"
    );
    assert!(page.contains("serve"), "{page}");

    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args(["man", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    for page in [
        "mqstate.1",
        "mqstate-get.1",
        "mqstate-lock.1",
        "mqstate-data-verify.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        assert!(text.contains(".TH"), "{page}: {text}");
    }
}
