//! `mqstate data inspect|verify|repair` against data written by a real server: what inspect shows,
//! that verify and the server's start-up agree on damage (file and offset), that repair keeps what
//! came before the damage, and that a torn tail is cut by the server on its own — for the state
//! store's log and for the session log in `<data-dir>/sessions/`.

use crate::common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

use common::mqtt::Client;
use common::state::{bulk, StateClient, NIL, OK, WAIT};
use common::Server;

/// Bytes before a record's data: marker, term, checksum, length (storage-format.md).
const RECORD_HEADER_BYTES: u64 = 4 + 8 + 4 + 4;

// ---------------------------------------------------------------------------------------------
// Writing and reading keys
// ---------------------------------------------------------------------------------------------

async fn set_keys(addr: SocketAddr, keys: &[(String, String)]) {
    let mut client = StateClient::connect(addr, "writer").await;
    for (key, value) in keys {
        let reply = client
            .request(&[b"SET", key.as_bytes(), value.as_bytes()])
            .await;
        assert_eq!(reply.as_ref(), OK, "SET {key}");
    }
}

/// GETs every key; `None` where the server says nil.
async fn get_keys(addr: SocketAddr, keys: &[(String, String)]) -> Vec<Option<String>> {
    let mut client = StateClient::connect(addr, "reader").await;
    let mut found = Vec::new();
    for (key, value) in keys {
        let reply = client.request(&[b"GET", key.as_bytes()]).await;
        if reply.as_ref() == NIL {
            found.push(None);
        } else {
            assert_eq!(reply.as_ref(), &bulk(value.as_bytes())[..], "GET {key}");
            found.push(Some(value.clone()));
        }
    }
    found
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn numbered(count: usize) -> Vec<(String, String)> {
    (0..count)
        .map(|i| (format!("key{i:02}"), format!("value{i:02}")))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The binary, offline and as a server we watch
// ---------------------------------------------------------------------------------------------

fn data_tool(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("data")
        .args(args)
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `mqstate serve` on `dir` with its log in `log`, outside the harness so a failed start or the log
/// text can be examined.
fn spawn_serve(dir: &Path, log: &Path) -> (Child, SocketAddr) {
    let addr = common::free_addr();
    let child = Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg("serve")
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--data-dir")
        .arg(dir)
        .env("MQSTATE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(log).unwrap())
        .spawn()
        .unwrap();
    (child, addr)
}

fn wait_listening(child: &mut Child, addr: SocketAddr, log: &Path) {
    let deadline = Instant::now() + WAIT;
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "server exited during start-up ({status}): {}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "server did not start listening");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One record as `inspect --json` lists it.
#[derive(Debug, Clone)]
struct Listed {
    path: PathBuf,
    lsn: u64,
    offset: u64,
    len: u64,
    key: String,
}

fn inspect_json(dir: &Path) -> Vec<Listed> {
    let out = data_tool(&["inspect", "--json"], dir);
    assert!(out.status.success(), "inspect: {}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut records = Vec::new();
    for segment in doc["segments"].as_array().unwrap() {
        let path = PathBuf::from(segment["path"].as_str().unwrap());
        for r in segment["records"].as_array().unwrap() {
            assert_eq!(r["delta"]["op"], "put", "only SETs were sent: {r}");
            records.push(Listed {
                path: path.clone(),
                lsn: r["lsn"].as_u64().unwrap(),
                offset: r["offset"].as_u64().unwrap(),
                len: r["len"].as_u64().unwrap(),
                key: r["delta"]["key"].as_str().unwrap().to_owned(),
            });
        }
    }
    records
}

fn flip_byte(path: &Path, at: u64) {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    file.seek(SeekFrom::Start(at)).unwrap();
    file.read_exact(&mut byte).unwrap();
    file.seek(SeekFrom::Start(at)).unwrap();
    file.write_all(&[byte[0] ^ 0xFF]).unwrap();
    file.sync_all().unwrap();
}

/// `verify` on a directory damaged at `at_offset` of `file_name`: exit 1 and a complaint naming
/// both. Returns the output for what a test checks besides.
fn verify_finds_damage(dir: &Path, file_name: &str, at_offset: &str) -> Output {
    let out = data_tool(&["verify"], dir);
    let complaint = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "verify on damage: {complaint}");
    assert!(complaint.contains(file_name), "names the file: {complaint}");
    assert!(
        complaint.contains(at_offset),
        "names the offset: {complaint}"
    );
    out
}

/// The server refuses to start on the damage, with an error naming the file and the offset.
fn start_is_refused(dir: &Path, what: &str, file_name: &str, at_offset: &str) {
    let log = dir.with_file_name("refused.log");
    let (mut child, _) = spawn_serve(dir, &log);
    let status = common::wait_exit(&mut child, &format!("start on {what}"));
    assert!(!status.success(), "the server must refuse {what}");
    let refusal = fs::read_to_string(&log).unwrap();
    assert!(
        refusal.contains(file_name),
        "start-up error names the file: {refusal}"
    );
    assert!(
        refusal.contains(at_offset),
        "start-up error names the offset: {refusal}"
    );
}

/// `repair --yes` succeeds; returns what it said.
fn repair(dir: &Path) -> String {
    let out = data_tool(&["repair", "--yes"], dir);
    let said = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "repair: {said} {}",
        text(&out.stderr)
    );
    said
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn inspect_verify_corruption_and_repair_agree_with_the_server() {
    let keys = numbered(20);
    let mut server = Server::start();
    runtime().block_on(set_keys(server.addr, &keys));
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();

    let out = data_tool(&["inspect"], &dir);
    assert!(out.status.success(), "inspect: {}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(
        shown.contains("put key \"key07\" value \"value07\" version "),
        "inspect shows the decoded SET: {shown}"
    );
    assert!(shown.contains("metadata: "), "{shown}");
    assert!(shown.contains("snapshot: "), "{shown}");

    let records = inspect_json(&dir);
    let listed: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    let sent: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(listed, sent, "one record per acknowledged SET, in order");

    let out = data_tool(&["verify"], &dir);
    assert_eq!(out.status.code(), Some(0), "verify: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("clean"));

    // Damage the middle record: intact records follow it, so this is corruption, not a torn tail.
    let victim = records[10].clone();
    flip_byte(&victim.path, victim.offset + RECORD_HEADER_BYTES + 1);
    let file_name = victim.path.display().to_string();
    let at_offset = format!("byte offset {}", victim.offset);

    let complaint = text(&verify_finds_damage(&dir, &file_name, &at_offset).stderr);
    assert!(complaint.contains("repair"), "suggests repair: {complaint}");

    start_is_refused(&dir, "a corrupt log", &file_name, &at_offset);

    let out = data_tool(&["repair"], &dir);
    assert_eq!(out.status.code(), Some(2), "repair without --yes on a pipe");
    assert!(text(&out.stderr).contains("--yes"), "{}", text(&out.stderr));
    assert_eq!(
        data_tool(&["verify"], &dir).status.code(),
        Some(1),
        "an unconfirmed repair changes nothing"
    );

    let said = repair(&dir);
    assert!(
        said.contains(&format!("cut {file_name} at {at_offset}")),
        "repair says what it cut: {said}"
    );
    assert_eq!(data_tool(&["verify"], &dir).status.code(), Some(0));

    server.restart();
    let found = runtime().block_on(get_keys(server.addr, &keys));
    for (record, value) in records.iter().zip(&found) {
        assert_eq!(
            value.is_some(),
            record.lsn < victim.lsn,
            "after repair, {} (lsn {}) is present exactly when it came before the damage",
            record.key,
            record.lsn
        );
    }
}

/// Bytes a record of `len` data bytes occupies, padding included (storage-format.md).
fn record_bytes(len: u64) -> u64 {
    RECORD_HEADER_BYTES + len.div_ceil(4) * 4
}

#[test]
fn torn_tail_is_cut_at_start_and_earlier_records_survive() {
    let keys = numbered(5);
    let mut server = Server::start();
    runtime().block_on(set_keys(server.addr, &keys));
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();

    // Half of a record written where the next one goes and never fsynced: what a crash during
    // an append leaves. It lies after every acknowledged record.
    let records = inspect_json(&dir);
    let last = records.last().unwrap().clone();
    assert_eq!(last.key, "key04");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&last.path)
        .unwrap();
    let mut record = vec![0u8; record_bytes(last.len) as usize];
    file.seek(SeekFrom::Start(last.offset)).unwrap();
    file.read_exact(&mut record).unwrap();
    let end = last.offset + record_bytes(last.len);
    file.seek(SeekFrom::Start(end)).unwrap();
    file.write_all(&record[..record.len() / 2]).unwrap();
    file.sync_all().unwrap();
    drop(file);

    let out = data_tool(&["verify"], &dir);
    let said = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "a torn tail is neither damage nor clean: {said} {}",
        text(&out.stderr)
    );
    assert!(
        said.contains("torn")
            && said.contains("cannot be proven")
            && !said.contains(&format!("state-store log {}: clean", dir.display())),
        "{said}"
    );

    let log = dir.with_file_name("torn.log");
    let (mut child, addr) = spawn_serve(&dir, &log);
    wait_listening(&mut child, addr, &log);
    let found = runtime().block_on(get_keys(addr, &keys));
    let _ = child.kill();
    let _ = child.wait();
    let expected: Vec<Option<String>> = keys.iter().map(|(_, v)| Some(v.clone())).collect();
    assert_eq!(found, expected, "every acknowledged record survives");
    let logged = fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("torn record") && logged.contains(&last.path.display().to_string()),
        "the server logs the cut: {logged}"
    );
    assert_eq!(
        data_tool(&["verify"], &dir).status.code(),
        Some(0),
        "clean after the server cut the tail"
    );
}

/// Issue 11 item 12: an acknowledged DEL whose bytes changed was dropped at start-up as a "torn
/// tail", bringing the deleted key back, and verify called the directory clean.
#[test]
fn a_changed_acknowledged_last_record_is_damage_not_a_torn_tail() {
    let mut server = Server::start();
    runtime().block_on(async {
        let mut client = StateClient::connect(server.addr, "writer").await;
        assert_eq!(
            client.request(&[b"SET", b"door", b"OPEN"]).await.as_ref(),
            OK
        );
        let deleted = client.request(&[b"DEL", b"door"]).await;
        assert_eq!(deleted.as_ref(), b":1\r\n", "DEL acknowledged");
    });
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();

    let out = data_tool(&["inspect", "--json"], &dir);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let segment = doc["segments"].as_array().unwrap().last().unwrap().clone();
    let del = segment["records"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(del["delta"]["op"], "delete", "{del}");
    let path = PathBuf::from(segment["path"].as_str().unwrap());
    let offset = del["offset"].as_u64().unwrap();
    flip_byte(&path, offset + RECORD_HEADER_BYTES + 1);

    let file_name = path.display().to_string();
    let at_offset = format!("byte offset {offset}");
    let complaint = text(&verify_finds_damage(&dir, &file_name, &at_offset).stderr);
    assert!(complaint.contains("acknowledged"), "{complaint}");
    start_is_refused(
        &dir,
        "a changed acknowledged record",
        &file_name,
        &at_offset,
    );

    let said = repair(&dir);
    assert!(
        said.contains("LOST: 1 acknowledged records"),
        "repair says what is lost: {said}"
    );
    assert_eq!(data_tool(&["verify"], &dir).status.code(), Some(0));
}

/// Issue 11 items 12 and 13: the newest segment cut short, dropping 16 acknowledged records, was
/// "clean" for verify and "dropped 0 intact records" for repair.
#[test]
fn a_truncated_newest_segment_is_refused_and_repair_names_the_loss() {
    let keys = numbered(20);
    let mut server = Server::start();
    runtime().block_on(set_keys(server.addr, &keys));
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();
    let records = inspect_json(&dir);
    let cut_in = records[4].clone();
    let file = OpenOptions::new().write(true).open(&cut_in.path).unwrap();
    file.set_len(cut_in.offset + RECORD_HEADER_BYTES + 3)
        .unwrap();
    file.sync_all().unwrap();
    drop(file);

    let file_name = cut_in.path.display().to_string();
    let at_offset = format!("byte offset {}", cut_in.offset);
    let complaint = text(&verify_finds_damage(&dir, &file_name, &at_offset).stderr);
    assert!(
        complaint.contains(&format!("LSN {}", cut_in.lsn)),
        "{complaint}"
    );
    start_is_refused(&dir, "a truncated log", &file_name, "mqstate data repair");

    let said = repair(&dir);
    assert!(said.contains("LOST: 16 acknowledged records"), "{said}");
    assert_eq!(data_tool(&["verify"], &dir).status.code(), Some(0));
    server.restart();
    let found = runtime().block_on(get_keys(server.addr, &keys));
    let present: Vec<bool> = found.iter().map(Option::is_some).collect();
    let expected: Vec<bool> = (0..20).map(|i| i < 4).collect();
    assert_eq!(
        present, expected,
        "the four records before the cut are kept"
    );
}

/// Issue 11 item 13: one damaged byte in a segment's header made repair delete every record of
/// the segment.
#[test]
fn repair_rewrites_a_damaged_segment_header_and_keeps_every_record() {
    let keys = numbered(5);
    let mut server = Server::start();
    runtime().block_on(set_keys(server.addr, &keys));
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();
    let path = inspect_json(&dir)[0].path.clone();
    flip_byte(&path, 1);
    verify_finds_damage(&dir, &path.display().to_string(), "byte offset 0");

    let said = repair(&dir);
    assert!(
        said.contains(&format!("rewrote the damaged header of {}", path.display()))
            && said.contains("dropped 0 intact records and 0 bytes"),
        "{said}"
    );
    assert!(!said.contains("LOST"), "{said}");
    server.restart();
    let found = runtime().block_on(get_keys(server.addr, &keys));
    assert!(
        found.iter().all(Option::is_some),
        "every record kept: {found:?}"
    );
}

/// Issue 11 item 13: a damaged metadata file has a repair path.
#[test]
fn repair_rebuilds_a_damaged_metadata_file() {
    let keys = numbered(3);
    let mut server = Server::start();
    runtime().block_on(set_keys(server.addr, &keys));
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();
    let metadata = dir.join("mqstate.metadata");
    flip_byte(&metadata, 9);
    verify_finds_damage(&dir, &metadata.display().to_string(), "byte offset");
    start_is_refused(
        &dir,
        "damaged metadata",
        &metadata.display().to_string(),
        "byte offset",
    );

    let said = repair(&dir);
    assert!(
        said.contains("metadata: ") && said.contains("rebuilt"),
        "{said}"
    );
    assert!(dir.join("mqstate.metadata.damaged").exists());
    assert_eq!(data_tool(&["verify"], &dir).status.code(), Some(0));
    server.restart();
    let found = runtime().block_on(get_keys(server.addr, &keys));
    assert!(found.iter().all(Option::is_some), "{found:?}");
    runtime().block_on(set_keys(server.addr, &numbered(4)));
}

/// Issue 11 item 12: `data verify /etc` said clean (and `inspect` showed it as empty).
#[test]
fn verify_of_a_directory_that_is_not_a_data_directory_is_not_clean() {
    let other = tempfile::tempdir().unwrap();
    fs::write(other.path().join("hosts"), b"127.0.0.1 localhost").unwrap();
    let mut dirs = vec![other.path().to_path_buf()];
    if Path::new("/etc").is_dir() {
        dirs.push(PathBuf::from("/etc"));
    }
    for dir in dirs {
        let out = data_tool(&["verify"], &dir);
        let complaint = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {complaint}", dir.display());
        assert!(complaint.contains("not a data directory"), "{complaint}");
        assert!(
            !text(&out.stdout).contains("clean"),
            "{}",
            text(&out.stdout)
        );
        // Nor does inspect show it as an empty data directory.
        let out = data_tool(&["inspect"], &dir);
        let complaint = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {complaint}", dir.display());
        assert!(complaint.contains("not a data directory"), "{complaint}");
    }
    // A file given for the directory: named as a file, not as missing.
    let file = other.path().join("hosts");
    for tool in ["inspect", "verify"] {
        let out = data_tool(&[tool], &file);
        let complaint = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{tool}: {complaint}");
        assert!(complaint.contains("not a directory"), "{tool}: {complaint}");
    }
}

/// The session log's records as `inspect --json` lists them: segment, offset and change ops.
fn inspect_session_json(dir: &Path) -> Vec<(PathBuf, u64, Vec<String>)> {
    let out = data_tool(&["inspect", "--json"], dir);
    assert!(out.status.success(), "inspect: {}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut records = Vec::new();
    for segment in doc["sessions"]["segments"]
        .as_array()
        .expect("a session log")
    {
        let path = PathBuf::from(segment["path"].as_str().unwrap());
        for r in segment["records"].as_array().unwrap() {
            let ops = r["delta"]
                .as_array()
                .unwrap_or_else(|| panic!("a decoded change list: {r}"))
                .iter()
                .map(|c| c["op"].as_str().unwrap().to_owned())
                .collect();
            records.push((path.clone(), r["offset"].as_u64().unwrap(), ops));
        }
    }
    records
}

#[test]
fn session_log_is_inspected_verified_and_repaired_by_name() {
    const TOPIC: &str = "tools/sessions";
    let mut server = Server::start();
    runtime().block_on(async {
        let mut subscriber = Client::connect(server.addr, "tools-sub", true).await;
        subscriber.subscribe(TOPIC).await;
        subscriber.client.disconnect().await.unwrap();
        let mut publisher = Client::connect(server.addr, "tools-pub", false).await;
        for payload in ["m1", "m2", "m3"] {
            publisher
                .publish(TOPIC, Bytes::from_static(payload.as_bytes()))
                .await;
        }
    });
    assert!(server.stop().success(), "graceful stop");
    let dir = server.data_dir().to_path_buf();

    let out = data_tool(&["inspect"], &dir);
    let shown = text(&out.stdout);
    assert!(out.status.success(), "inspect: {}", text(&out.stderr));
    assert!(shown.contains("session log: "), "{shown}");
    assert!(
        shown.contains(&format!(
            "subscribed \"tools-sub\" filter \"{TOPIC}\" qos 1"
        )),
        "{shown}"
    );
    assert!(
        shown.contains(&format!(
            "appended \"tools-sub\" seq 1 topic \"{TOPIC}\" payload \"m2\""
        )),
        "inspect decodes the queued messages: {shown}"
    );

    let out = data_tool(&["verify"], &dir);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "verify: {}", text(&out.stderr));
    assert!(
        said.contains("state-store log") && said.contains("session log"),
        "{said}"
    );

    // Named by itself, the session log is read as one (read as a state-store log, every record
    // would look damaged, and repair would cut them).
    let sessions = dir.join("sessions");
    let out = data_tool(&["inspect"], &sessions);
    let alone = text(&out.stdout);
    assert!(out.status.success(), "inspect: {}", text(&out.stderr));
    assert!(alone.starts_with("\nsession log: "), "{alone}");
    assert!(alone.contains("appended \"tools-sub\" seq 1"), "{alone}");
    let out = data_tool(&["verify"], &sessions);
    assert_eq!(out.status.code(), Some(0), "verify: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("session log {}: clean", sessions.display())
    );
    let out = data_tool(&["repair", "--yes"], &sessions);
    assert!(out.status.success(), "repair: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("clean; nothing to repair"),
        "{}",
        text(&out.stdout)
    );

    // Damage the record of m2: m3's follows it intact, so this is corruption, not a torn tail.
    let records = inspect_session_json(&dir);
    let appended: Vec<_> = records
        .iter()
        .filter(|(_, _, ops)| ops == &["appended"])
        .collect();
    assert_eq!(
        appended.len(),
        3,
        "one record per queued message: {records:?}"
    );
    let (path, offset, _) = appended[1].clone();
    flip_byte(&path, offset + RECORD_HEADER_BYTES + 1);
    let file_name = path.display().to_string();
    let at_offset = format!("byte offset {offset}");

    let out = verify_finds_damage(&dir, &file_name, &at_offset);
    let complaint = text(&out.stderr);
    assert!(
        complaint.contains("session log"),
        "names the log: {complaint}"
    );
    assert!(
        text(&out.stdout).contains("state-store log"),
        "the state-store log is still reported clean: {}",
        text(&out.stdout)
    );

    start_is_refused(&dir, "a corrupt session log", &file_name, &at_offset);

    let said = repair(&dir);
    assert!(
        said.contains("session log") && said.contains(&format!("cut {file_name} at {at_offset}")),
        "repair says which log and what it cut: {said}"
    );
    assert_eq!(data_tool(&["verify"], &dir).status.code(), Some(0));

    server.restart();
    runtime().block_on(async {
        let mut subscriber = Client::connect(server.addr, "tools-sub", true).await;
        assert_eq!(
            subscriber.next_message().await,
            "m1",
            "kept: before the damage"
        );
        let mut publisher = Client::connect(server.addr, "tools-pub", false).await;
        publisher.publish(TOPIC, Bytes::from_static(b"m4")).await;
        assert_eq!(
            subscriber.next_message().await,
            "m4",
            "m2 and m3 came after the damage and were dropped by the repair"
        );
    });
}

#[test]
fn a_data_directory_in_use_refuses_a_second_server_and_repair() {
    let server = Server::start();
    let dir = server.data_dir().to_path_buf();

    let log = dir.with_file_name("second.log");
    let (mut second, _) = spawn_serve(&dir, &log);
    let status = common::wait_exit(&mut second, "a second server on the same data directory");
    assert!(!status.success(), "a second server must refuse to start");
    let refusal = fs::read_to_string(&log).unwrap();
    assert!(
        refusal.contains("in use by another process")
            && refusal.contains(&dir.display().to_string()),
        "the refusal names the directory and why: {refusal}"
    );

    let out = data_tool(&["repair", "--yes"], &dir);
    let complaint = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "repair while the server runs: {complaint}"
    );
    assert!(
        complaint.contains("in use by another process"),
        "{complaint}"
    );

    // The first server is untouched and keeps serving.
    runtime().block_on(set_keys(server.addr, &numbered(1)));
}

/// A data directory that is a file, or that this user may not write: the server refuses to start,
/// naming the path and the cause once.
#[test]
fn a_data_directory_that_is_a_file_is_refused_naming_it() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("data");
    fs::write(&dir, b"not a directory").unwrap();
    let log = temp.path().join("serve.log");
    let (mut server, _) = spawn_serve(&dir, &log);
    let status = common::wait_exit(&mut server, "a server on a file as its data directory");
    assert!(!status.success());
    let refusal = fs::read_to_string(&log).unwrap();
    assert!(
        refusal.contains(&dir.display().to_string()) && refusal.contains("not a directory"),
        "the refusal names the path and why: {refusal}"
    );
    assert_eq!(
        refusal.matches("not a directory").count(),
        1,
        "the cause once: {refusal}"
    );
    assert_eq!(
        fs::read(&dir).unwrap(),
        b"not a directory",
        "the file is untouched"
    );
}
