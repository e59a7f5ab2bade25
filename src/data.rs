//! `mqstate data inspect|verify|repair DIR`: the operator's tools for a data directory. They work
//! offline (stop the server first; `repair` takes the directory lock and refuses while a server
//! holds it) and read it exactly the way recovery does (`mqstate_wal::tools`), adding what only this
//! layer knows: that a data directory holds two or three logs (the state store's, the broker's
//! session log in `sessions/`, and on a cluster node the chain log in `chains/`), how to decode their records and snapshots, and how to talk to a person at a
//! terminal.

mod chain_view;
mod session_view;

use std::fmt;
use std::io::{self, BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use mqstate_sessions as sessions;
use mqstate_store::notify::QueueDelta;
use mqstate_store::{Change, Delta, Limits, StateMachine, StoreConfig, StoreError};
use mqstate_wal::tools::{self, RecordReport, RepairReport, Report, SegmentReport};
use mqstate_wal::{read_snapshot, DataDir, Metadata, SegmentEnd, WalError};
use serde_json::{json, Value};

use crate::serve::SERVICE_NODE_ID;

/// Bytes of a key or value `inspect` shows before truncating (`--max-bytes` overrides it).
pub const DEFAULT_SHOW_BYTES: usize = 64;
/// Exit status when the directory is damaged (`verify`) or was left damaged (`repair`).
const EXIT_DAMAGED: u8 = 1;
/// Exit status when the tool could not do its job (bad path, not a data directory, I/O error,
/// repair not confirmed).
const EXIT_ERROR: u8 = 2;
/// Exit status of `verify` when the only finding is a damaged last record after the durable end:
/// start-up cuts it off, but that it was never acknowledged cannot be proven.
const EXIT_UNPROVEN: u8 = 3;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print segments, records (decoded deltas), snapshot and metadata.
    Inspect {
        dir: PathBuf,
        /// Print one JSON document instead of text.
        #[arg(long)]
        json: bool,
        /// Show at most this many bytes of each key and value (escaped).
        #[arg(long, default_value_t = DEFAULT_SHOW_BYTES, value_name = "N")]
        max_bytes: usize,
    },
    /// Check the directory as the server's start-up would: exit 0 clean, 1 damaged (naming file and
    /// offset), 2 not checked (not a data directory, I/O), 3 a torn last record after the durable
    /// end that start-up would cut (unproven whether it was acknowledged).
    Verify { dir: PathBuf },
    /// Repair what can be repaired: rebuild damaged metadata, rewrite a damaged segment header,
    /// cut the log at its first damage; report exactly what is removed.
    Repair {
        dir: PathBuf,
        /// Do not ask for confirmation (required when stdin is not a terminal).
        #[arg(long)]
        yes: bool,
    },
}

/// Failures of the data tools. Damage found by `verify` is a result, not one of these.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: no such directory; pass the directory given to `mqstate serve --data-dir`", .0.display())]
    NoDirectory(PathBuf),
    #[error("{}: a file, not a directory; pass the directory given to `mqstate serve --data-dir`", .0.display())]
    NotADirectory(PathBuf),
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error(
        "repair drops data and stdin is not a terminal to ask on; run again with --yes to confirm"
    )]
    NotConfirmed,
    #[error("repair cancelled; nothing was changed")]
    Declined,
    #[error("cannot read the confirmation from stdin: {0}")]
    Prompt(#[source] io::Error),
    #[error("cannot write the output: {0}")]
    Output(#[from] io::Error),
    #[error("cannot encode the JSON output: {0}")]
    Json(#[from] serde_json::Error),
}

pub fn run(cmd: Command) -> ExitCode {
    let (name, result) = match cmd {
        Command::Inspect {
            dir,
            json,
            max_bytes,
        } => ("inspect", inspect(&dir, json, max_bytes)),
        Command::Verify { dir } => ("verify", verify(&dir)),
        Command::Repair { dir, yes } => ("repair", repair(&dir, yes)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mqstate data {name}: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

fn existing_dir(dir: &Path) -> Result<(), DataError> {
    if dir.is_dir() {
        Ok(())
    } else if dir.exists() {
        Err(DataError::NotADirectory(dir.to_path_buf()))
    } else {
        Err(DataError::NoDirectory(dir.to_path_buf()))
    }
}

/// The two logs of a data directory, each in the `mqstate-wal` layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Log {
    /// The state store's log, at the top of the data directory.
    Store,
    /// The broker's session log, `<data-dir>/sessions/` (absent before the first start with it).
    Sessions,
    /// A cluster node's chain log, `<data-dir>/chains/` (decision 0035; only on cluster nodes).
    Chains,
}

impl Log {
    fn name(self) -> &'static str {
        match self {
            Log::Store => "state-store log",
            Log::Sessions => "session log",
            Log::Chains => "chain log",
        }
    }

    fn dir(self, data_dir: &Path) -> PathBuf {
        match self {
            Log::Store => data_dir.to_path_buf(),
            Log::Sessions => sessions::dir(data_dir),
            Log::Chains => data_dir.join(mqstate_replication::log::CHAINS_DIR),
        }
    }

    /// The logs at `dir`, each with its directory: a data directory's store log and the other
    /// logs present in it, or, when `dir` is itself a data directory's session or chain log
    /// (`<data-dir>/chains`), that log alone. Read as a store log, a chain log's records and
    /// snapshot would all look damaged, and `repair` would cut them.
    fn at(dir: &Path) -> Vec<(Log, PathBuf)> {
        let inner = [Log::Sessions, Log::Chains];
        let parent = match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        let holds_logs = inner.iter().any(|log| log.dir(dir).is_dir());
        if !holds_logs && parent.join(mqstate_wal::layout::METADATA_FILE).is_file() {
            let named = |log: &Log| log.dir(parent).file_name() == dir.file_name();
            if let Some(log) = inner.into_iter().find(named) {
                return vec![(log, dir.to_path_buf())];
            }
        }
        let mut logs = vec![(Log::Store, Log::Store.dir(dir))];
        logs.extend(
            inner
                .into_iter()
                .map(|log| (log, log.dir(dir)))
                .filter(|(_, log_dir)| log_dir.is_dir()),
        );
        logs
    }

    fn describe(self, data: &[u8], max_bytes: usize, as_json: bool) -> String {
        match self {
            Log::Store => {
                // Decoded once: the request (if any) and the change it made are shown together.
                let change = Change::decode(data);
                let request = RequestShown::of(&change, max_bytes);
                let view = DeltaView::of(change, max_bytes);
                match (as_json, request) {
                    (true, None) => view.to_json().to_string(),
                    (true, Some(request)) => {
                        let mut json = view.to_json();
                        if let Value::Object(fields) = &mut json {
                            fields.insert("request".to_owned(), request.to_json());
                        }
                        json.to_string()
                    }
                    (false, None) => view.to_string(),
                    (false, Some(request)) => format!("{view} {request}"),
                }
            }
            Log::Sessions => session_view::describe(data, max_bytes, as_json),
            Log::Chains => chain_view::describe(data, max_bytes, as_json),
        }
    }

    /// Why a record's data does not decode as this log's records; `None` if it does.
    fn decode_error(self, data: &[u8]) -> Option<String> {
        match self {
            Log::Store => Change::decode(data).err().map(|e| e.to_string()),
            Log::Sessions => session_view::decode_error(data),
            Log::Chains => chain_view::decode_error(data),
        }
    }

    fn what_a_record_is(self) -> &'static str {
        match self {
            Log::Store => "a state change",
            Log::Sessions => "a session change list",
            Log::Chains => "a replica's batch of one partition",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// inspect
// ---------------------------------------------------------------------------------------------

/// Text: the state-store log, then the session log and the chain log under headings. JSON: the
/// state-store log's fields at the top level, the session log's under `"sessions"` and the chain
/// log's under `"chains"` (null if there is none).
fn inspect(dir: &Path, as_json: bool, max_bytes: usize) -> Result<ExitCode, DataError> {
    existing_dir(dir)?;
    let mut out = io::BufWriter::new(io::stdout().lock());
    let mut sessions_json = Value::Null;
    let mut chains_json = Value::Null;
    let mut store_json = Value::Null;
    let logs = Log::at(dir);
    let only_store = logs.len() == 1 && logs[0].0 == Log::Store;
    for (log, log_dir) in logs {
        let report = tools::inspect(&log_dir, &|data: &[u8]| {
            log.describe(data, max_bytes, as_json)
        })?;
        if only_store
            && report.metadata.is_none()
            && report.snapshot.is_none()
            && report.segments.is_empty()
        {
            // Nothing to show, and exit 0 would read as "an empty data directory".
            return Err(WalError::NotADataDirectory { path: log_dir }.into());
        }
        let snapshot = SnapshotFacts::read(log, &log_dir);
        if as_json {
            let doc = report_json(&report, &snapshot);
            match log {
                Log::Store => store_json = doc,
                Log::Sessions => sessions_json = doc,
                Log::Chains => chains_json = doc,
            }
        } else {
            if log != Log::Store {
                writeln!(out, "\n{}: {}", log.name(), log_dir.display())?;
            }
            write_report(&mut out, &report, &snapshot)?;
        }
    }
    if as_json {
        let doc = match (store_json, sessions_json, chains_json) {
            // One data directory's session or chain log, named by itself: that log's document.
            (Value::Null, Value::Null, doc) | (Value::Null, doc, Value::Null) => doc,
            (mut store, sessions, chains) => {
                if let Value::Object(fields) = &mut store {
                    fields.insert("sessions".to_owned(), sessions);
                    fields.insert("chains".to_owned(), chains);
                }
                store
            }
        };
        serde_json::to_writer_pretty(&mut out, &doc)?;
        writeln!(out)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// The identity of the request that made a change (a `J` record, or an `I` of the previous
/// release), ready to show: the request id a retry of it is recognised by (a hash of the client id
/// and correlation data, decision 0034), until when, and the first reply a retry gets.
struct RequestShown {
    id: String,
    expires_at_ms: u64,
    reply: Shown,
}

impl RequestShown {
    /// `None` for a change that carries no request (expiries, older records, undecodable data).
    fn of(change: &Result<Change, StoreError>, max_bytes: usize) -> Option<RequestShown> {
        match change {
            Ok(Change::Requested { request, .. }) => {
                Some(RequestShown::of_record(request, max_bytes))
            }
            _ => None,
        }
    }

    fn of_record(request: &mqstate_store::RequestRecord, max_bytes: usize) -> RequestShown {
        RequestShown {
            id: request.id.to_string(),
            expires_at_ms: request.expires_at_ms,
            reply: Shown::new(request.reply.trim_ascii_end(), max_bytes),
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "expires_at_ms": self.expires_at_ms,
            "reply": self.reply.text,
        })
    }
}

impl fmt::Display for RequestShown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "by request {} (a retry until {} ms gets {})",
            self.id, self.expires_at_ms, self.reply
        )
    }
}

/// One record's data as the state store reads it, ready to show.
enum DeltaView {
    Put {
        key: Shown,
        value: Shown,
        version: String,
        fencing_token: Option<String>,
        expires_at_ms: Option<u64>,
    },
    Delete {
        key: Shown,
        version: String,
    },
    /// A change to notification topics and queues (summarized).
    Queue(String),
    Undecodable(String),
}

impl DeltaView {
    fn of(change: Result<Change, StoreError>, max_bytes: usize) -> DeltaView {
        // A request's change is shown as the change (its request is shown beside it, `RequestShown`).
        let change = match change {
            Ok(Change::Requested { change, .. }) => Ok(*change),
            other => other,
        };
        let delta = match change {
            Ok(Change::Queue(queue)) => return DeltaView::Queue(queue_summary(&queue)),
            Ok(Change::Key(delta)) => Ok(delta),
            Ok(Change::Requested { .. }) => {
                return DeltaView::Undecodable("a request record inside a request record".into())
            }
            Err(e) => Err(e),
        };
        match delta {
            Ok(Delta::Put {
                key,
                value,
                version,
                fencing_token,
                expires_at_ms,
            }) => DeltaView::Put {
                key: Shown::new(&key, max_bytes),
                value: Shown::new(&value, max_bytes),
                version: version.to_string(),
                fencing_token: fencing_token.map(|t| t.to_string()),
                expires_at_ms,
            },
            Ok(Delta::Delete { key, version }) => DeltaView::Delete {
                key: Shown::new(&key, max_bytes),
                version: version.to_string(),
            },
            Err(e) => DeltaView::Undecodable(e.to_string()),
        }
    }

    fn to_json(&self) -> Value {
        match self {
            DeltaView::Put {
                key,
                value,
                version,
                fencing_token,
                expires_at_ms,
            } => json!({
                "op": "put",
                "key": key.text, "key_len": key.len,
                "value": value.text, "value_len": value.len,
                "version": version,
                "fencing_token": fencing_token,
                "expires_at_ms": expires_at_ms,
            }),
            DeltaView::Delete { key, version } => json!({
                "op": "delete",
                "key": key.text, "key_len": key.len,
                "version": version,
            }),
            DeltaView::Queue(summary) => json!({ "op": "queue", "change": summary }),
            DeltaView::Undecodable(error) => json!({ "op": "undecodable", "error": error }),
        }
    }
}

impl fmt::Display for DeltaView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeltaView::Put {
                key,
                value,
                version,
                fencing_token,
                expires_at_ms,
            } => {
                write!(f, "put key {key} value {value} version {version}")?;
                if let Some(token) = fencing_token {
                    write!(f, " fencing-token {token}")?;
                }
                if let Some(ms) = expires_at_ms {
                    write!(f, " expires-at-ms {ms}")?;
                }
                Ok(())
            }
            DeltaView::Delete { key, version } => write!(f, "delete key {key} version {version}"),
            DeltaView::Queue(summary) => write!(f, "queue {summary}"),
            DeltaView::Undecodable(error) => write!(f, "UNDECODABLE: {error}"),
        }
    }
}

/// One line about a queue delta (values are not shown).
fn queue_summary(delta: &QueueDelta) -> String {
    match delta {
        QueueDelta::CreateTopic(def) => {
            format!("create-topic {} endpoint {}", def.name, def.endpoint)
        }
        QueueDelta::DeleteTopic(name) => format!("delete-topic {name}"),
        QueueDelta::Reserve(list) => format!("reserve {list:?}"),
        QueueDelta::Abort(list) => format!("abort {list:?}"),
        QueueDelta::Commit {
            change,
            event,
            commits,
        } => format!(
            "commit {} key {} version {} into {:?}",
            event.as_str(),
            Shown::new(change.key(), 64),
            change.version(),
            commits
        ),
        QueueDelta::Remove { topic, up_to_seq } => format!("remove {topic} up to seq {up_to_seq}"),
    }
}

/// Bytes escaped for a terminal (ASCII escapes, quotes escaped) and cut to a length.
struct Shown {
    text: String,
    len: usize,
}

impl Shown {
    fn new(bytes: &[u8], max_bytes: usize) -> Shown {
        let shown = &bytes[..bytes.len().min(max_bytes)];
        let mut text: String = shown
            .iter()
            .flat_map(|b| std::ascii::escape_default(*b))
            .map(char::from)
            .collect();
        if bytes.len() > shown.len() {
            text.push_str(&format!("...(+{} bytes)", bytes.len() - shown.len()));
        }
        Shown {
            text,
            len: bytes.len(),
        }
    }
}

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.text)
    }
}

/// What the snapshot's state says, beyond the file framing `tools::inspect` already checks.
enum SnapshotFacts {
    /// No snapshot file, or one the WAL tools already report as damaged.
    Unavailable,
    /// What it holds, e.g. `[("keys", 12)]`.
    Counts(Vec<(&'static str, usize)>),
    Undecodable(String),
}

impl SnapshotFacts {
    fn read(log: Log, log_dir: &Path) -> SnapshotFacts {
        let Ok(Some(snapshot)) = read_snapshot(&DataDir::new(log_dir)) else {
            return SnapshotFacts::Unavailable;
        };
        let counts = match log {
            Log::Store => {
                let config = StoreConfig {
                    node_id: SERVICE_NODE_ID.into(),
                    limits: Limits::default(),
                };
                StateMachine::snapshot_decode(&snapshot.state, config)
                    .map(|machine| vec![("keys", machine.keyspace().len())])
                    .map_err(|e| e.to_string())
            }
            Log::Sessions => session_view::snapshot_counts(&snapshot.state),
            // The chain log is not compacted yet: a snapshot there is not ours to read.
            Log::Chains => Ok(Vec::new()),
        };
        match counts {
            Ok(counts) => SnapshotFacts::Counts(counts),
            Err(e) => SnapshotFacts::Undecodable(format!(
                "the snapshot state does not decode ({e}); the server will refuse to start"
            )),
        }
    }
}

fn end_text(end: &Option<SegmentEnd>) -> String {
    match end {
        None => "unreadable header".to_owned(),
        Some(SegmentEnd::EndMarker { offset }) => format!("end marker at byte offset {offset}"),
        Some(SegmentEnd::Damaged {
            offset,
            damage,
            intact_after,
        }) => match intact_after {
            Some(after) => format!(
                "DAMAGED at byte offset {offset} ({damage}); intact records follow at {after}"
            ),
            None => format!("damaged at byte offset {offset} ({damage}); nothing intact after it"),
        },
    }
}

fn metadata_text(metadata: &Option<Metadata>) -> String {
    match metadata {
        None => "none".to_owned(),
        Some(m) => format!(
            "term {}, voted for {}, node id {:?}, HLC high-water {} ms, durable end {}, last purged {}",
            m.term,
            m.voted_for
                .map_or_else(|| "nobody".to_owned(), |v| v.to_string()),
            m.node_id,
            m.hlc_high_water_ms,
            m.durable_end,
            m.last_purged.map_or_else(
                || "none".to_owned(),
                |p| format!("lsn {} term {}", p.index, p.term)
            )
        ),
    }
}

fn write_report(out: &mut impl Write, report: &Report, snapshot: &SnapshotFacts) -> io::Result<()> {
    writeln!(out, "metadata: {}", metadata_text(&report.metadata))?;
    match (&report.snapshot, snapshot) {
        (None, _) => writeln!(out, "snapshot: none")?,
        (Some(s), facts) => {
            write!(
                out,
                "snapshot: last index {}, last term {}, {} bytes of state",
                s.last_index, s.last_term, s.state_bytes
            )?;
            match facts {
                SnapshotFacts::Counts(counts) => {
                    for (what, n) in counts {
                        write!(out, ", {n} {what}")?;
                    }
                    writeln!(out)?;
                }
                SnapshotFacts::Undecodable(e) => writeln!(out, "; {e}")?,
                SnapshotFacts::Unavailable => writeln!(out)?,
            }
        }
    }
    writeln!(out, "segments: {}", report.segments.len())?;
    for segment in &report.segments {
        write_segment(out, segment)?;
    }
    if let Some(torn) = &report.torn_tail {
        writeln!(
            out,
            "torn tail (the server cuts it off at start-up): {torn}"
        )?;
    }
    for problem in &report.problems {
        writeln!(out, "PROBLEM: {problem}")?;
    }
    Ok(())
}

fn write_segment(out: &mut impl Write, segment: &SegmentReport) -> io::Result<()> {
    writeln!(
        out,
        "{}: first lsn {}, {} bytes, {} records, {}",
        segment.path.display(),
        segment.first_lsn,
        segment.size_bytes,
        segment.records.len(),
        end_text(&segment.end)
    )?;
    for RecordReport {
        lsn,
        term,
        offset,
        len,
        summary,
    } in &segment.records
    {
        writeln!(
            out,
            "  lsn {lsn} term {term} offset {offset} len {len}: {summary}"
        )?;
    }
    Ok(())
}

fn report_json(report: &Report, snapshot: &SnapshotFacts) -> Value {
    let segments: Vec<Value> = report
        .segments
        .iter()
        .map(|segment| {
            let records: Vec<Value> = segment
                .records
                .iter()
                .map(|r| {
                    // The describe closure produced JSON text; anything else is shown as text.
                    let delta = serde_json::from_str::<Value>(&r.summary)
                        .unwrap_or_else(|_| Value::String(r.summary.clone()));
                    json!({
                        "lsn": r.lsn, "term": r.term, "offset": r.offset, "len": r.len,
                        "delta": delta,
                    })
                })
                .collect();
            json!({
                "path": segment.path.display().to_string(),
                "first_lsn": segment.first_lsn,
                "size_bytes": segment.size_bytes,
                "end": end_text(&segment.end),
                "records": records,
            })
        })
        .collect();
    let snapshot_json = report.snapshot.map(|s| {
        let mut doc = json!({
            "last_index": s.last_index, "last_term": s.last_term, "state_bytes": s.state_bytes,
        });
        match snapshot {
            SnapshotFacts::Counts(counts) => {
                for (what, n) in counts {
                    doc[what.replace(' ', "_")] = json!(n);
                }
            }
            SnapshotFacts::Undecodable(e) => doc["error"] = json!(e),
            SnapshotFacts::Unavailable => {}
        }
        doc
    });
    let metadata_json = report.metadata.as_ref().map(|m| {
        json!({
            "term": m.term, "voted_for": m.voted_for, "node_id": m.node_id,
            "hlc_high_water_ms": m.hlc_high_water_ms,
            "durable_end": m.durable_end,
            "last_purged": m.last_purged.map(|p| json!({"index": p.index, "term": p.term})),
        })
    });
    json!({
        "metadata": metadata_json,
        "snapshot": snapshot_json,
        "segments": segments,
        "torn_tail": report.torn_tail,
        "problems": report.problems,
    })
}

// ---------------------------------------------------------------------------------------------
// verify
// ---------------------------------------------------------------------------------------------

/// Whether the WAL's error is a finding about the files (rather than a failure to look at them).
fn is_damage(e: &WalError) -> bool {
    matches!(
        e,
        WalError::Corrupt { .. }
            | WalError::Gap { .. }
            | WalError::LostDurable { .. }
            | WalError::MetadataMissing { .. }
            | WalError::PurgedPastSnapshot { .. }
    )
}

/// Damage in one log, as the server's start-up would see it: the first finding only.
fn find_damage(log: Log, log_dir: &Path) -> Result<Option<String>, DataError> {
    let report = match tools::verify(log_dir) {
        Ok(report) => report,
        Err(e) if is_damage(&e) => return Ok(Some(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    debug_assert!(report.problems.is_empty(), "verify passed with problems");
    // Framing is intact; the server also decodes every record and the snapshot state.
    if let SnapshotFacts::Undecodable(e) = SnapshotFacts::read(log, log_dir) {
        return Ok(Some(format!(
            "{}: {e}; restore it from a backup",
            DataDir::new(log_dir).snapshot_path().display()
        )));
    }
    let decoded = tools::inspect(log_dir, &|data: &[u8]| {
        log.decode_error(data).unwrap_or_default()
    })?;
    for segment in &decoded.segments {
        if let Some(bad) = segment.records.iter().find(|r| !r.summary.is_empty()) {
            return Ok(Some(format!(
                "{}: record lsn {} at byte offset {} has a valid checksum but does not decode as {} \
                 ({}); this is a bug in the writer: keep a copy of the directory, report it, \
                 then run `mqstate data repair` to cut the log before it",
                segment.path.display(),
                bad.lsn,
                bad.offset,
                log.what_a_record_is(),
                bad.summary
            )));
        }
    }
    Ok(None)
}

/// Checks every log of the directory; exit 1 if any is damaged, 3 if the worst is a torn tail.
fn verify(dir: &Path) -> Result<ExitCode, DataError> {
    existing_dir(dir)?;
    let mut damaged = false;
    let mut unproven = false;
    for (log, log_dir) in Log::at(dir) {
        match find_damage(log, &log_dir)? {
            Some(damage) => {
                damaged = true;
                eprintln!(
                    "mqstate data verify: {} {}: DAMAGED: {damage}",
                    log.name(),
                    log_dir.display()
                );
            }
            None => match tools::inspect(&log_dir, &|_| String::new())?.torn_tail {
                Some(torn) => {
                    unproven = true;
                    println!(
                        "{} {}: NOT PROVEN CLEAN: torn last record: {torn}",
                        log.name(),
                        log_dir.display()
                    );
                }
                None => println!("{} {}: clean", log.name(), log_dir.display()),
            },
        }
    }
    let code = if damaged {
        EXIT_DAMAGED
    } else if unproven {
        EXIT_UNPROVEN
    } else {
        0
    };
    Ok(ExitCode::from(code))
}

// ---------------------------------------------------------------------------------------------
// repair
// ---------------------------------------------------------------------------------------------

/// Repairs every damaged log of the directory, after one confirmation for all of them.
fn repair(dir: &Path, yes: bool) -> Result<ExitCode, DataError> {
    existing_dir(dir)?;
    let mut damaged = Vec::new();
    // Held until the end: a server must not open the logs while they are judged and cut.
    let mut _locks = Vec::new();
    for (log, log_dir) in Log::at(dir) {
        _locks.push(DataDir::new(&log_dir).lock()?);
        let damage = match find_damage(log, &log_dir)? {
            Some(damage) => damage,
            // The server would cut a torn tail by itself; repairing it here is harmless.
            None => match tools::inspect(&log_dir, &|_| String::new())?.torn_tail {
                Some(torn) => torn,
                None => {
                    println!(
                        "{} {}: clean; nothing to repair",
                        log.name(),
                        log_dir.display()
                    );
                    continue;
                }
            },
        };
        eprintln!("found in the {}: {damage}", log.name());
        damaged.push((log, log_dir));
    }
    if damaged.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "repair rebuilds a damaged metadata file, rewrites a damaged segment header when the \
         records after it are intact, keeps every record before the first damage of each log and \
         deletes everything after it (later segments included)"
    );
    if !yes {
        confirm()?;
    }
    let mut left_damaged = false;
    for (log, log_dir) in damaged {
        println!("{} {}:", log.name(), log_dir.display());
        let report = match tools::repair(&log_dir, rebuilt_clock_ceiling(log, &log_dir)) {
            Ok(report) => report,
            Err(e) if is_damage(&e) => {
                eprintln!(
                    "mqstate data repair: {}: repair only cuts the log and cannot fix this: {e}; \
                     restore the named file from a backup",
                    log.name()
                );
                left_damaged = true;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        print_repair(&report)?;
        match find_damage(log, &log_dir)? {
            None => println!(
                "{} {}: repaired; `mqstate serve` can start on it",
                log.name(),
                log_dir.display()
            ),
            Some(left) => {
                eprintln!(
                    "mqstate data repair: {}: damage remains that repair cannot fix: {left}; \
                     restore the named file from a backup",
                    log.name()
                );
                left_damaged = true;
            }
        }
    }
    Ok(ExitCode::from(if left_damaged { EXIT_DAMAGED } else { 0 }))
}

fn confirm() -> Result<(), DataError> {
    let stdin = io::stdin();
    if !stdin.is_terminal() {
        return Err(DataError::NotConfirmed);
    }
    eprint!("drop it? type 'yes' to continue: ");
    io::stderr().flush()?;
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(DataError::Prompt)?;
    if answer.trim().eq_ignore_ascii_case("yes") {
        Ok(())
    } else {
        Err(DataError::Declined)
    }
}

fn print_repair(report: &RepairReport) -> io::Result<()> {
    let mut out = io::stdout().lock();
    if let Some(rebuilt) = &report.metadata_rebuilt {
        writeln!(out, "metadata: {rebuilt}")?;
    }
    for path in &report.headers_rewritten {
        writeln!(
            out,
            "rewrote the damaged header of {} (every record after it is intact and kept)",
            path.display()
        )?;
    }
    if let Some((path, offset)) = &report.cut {
        writeln!(out, "cut {} at byte offset {offset}", path.display())?;
    }
    for path in &report.deleted {
        writeln!(out, "deleted {}", path.display())?;
    }
    writeln!(
        out,
        "dropped {} intact records and {} bytes in total",
        report.dropped_records, report.dropped_bytes
    )?;
    if let Some(lost) = &report.lost_durable {
        writeln!(
            out,
            "LOST: {} acknowledged records (LSN {} to {}) are not in the log any more; only a \
             backup or a replica has them. The durable end in the metadata file is now {}",
            lost.end - lost.start,
            lost.start,
            lost.end - 1,
            lost.start
        )?;
    }
    Ok(())
}

/// The HLC high-water mark a rebuilt metadata file gets: above every timestamp the log and
/// snapshot hold and above the wall clock, as the server sets it at start (sessions: unused, 0).
fn rebuilt_clock_ceiling(log: Log, log_dir: &Path) -> u64 {
    if log == Log::Sessions {
        return 0;
    }
    let config = StoreConfig {
        node_id: SERVICE_NODE_ID.into(),
        limits: Limits::default(),
    };
    let snapshot = read_snapshot(&DataDir::new(log_dir)).ok().flatten();
    let machine = snapshot
        .and_then(|s| StateMachine::snapshot_decode(&s.state, config.clone()).ok())
        .or_else(|| StateMachine::new(config).ok());
    let high_water = machine.map_or(0, |machine| {
        let machine = std::cell::RefCell::new(machine);
        let _ = tools::inspect(log_dir, &|data: &[u8]| {
            if let Ok(delta) = Delta::decode(data) {
                machine.borrow_mut().apply_delta(&delta);
            }
            String::new()
        });
        let wall_ms = machine.borrow().clock().high_water().wall_ms;
        wall_ms
    });
    // An offline tool: the system clock, as the server that opens the directory next will read.
    let now_ms = mqstate_clock::Clock::now_ms(&mqstate_clock::SystemClock);
    mqstate_statestore::service::next_clock_ceiling(high_water, now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mqstate_protocol::Hlc;

    fn version(wall_ms: u64) -> Hlc {
        Hlc::new(wall_ms, 3, "mqstate".into())
    }

    #[test]
    fn shown_escapes_quotes_and_control_bytes_and_counts_what_it_cuts() {
        let shown = Shown::new(b"a\"b\n\xff", 64);
        assert_eq!(shown.to_string(), r#""a\"b\n\xff""#);
        assert_eq!(shown.len, 5);
        let cut = Shown::new(b"abcdef", 4);
        assert_eq!(cut.to_string(), "\"abcd...(+2 bytes)\"");
        assert_eq!(cut.len, 6);
    }

    #[test]
    fn put_and_delete_read_as_one_line_each() {
        let put = Delta::Put {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
            version: version(1),
            fencing_token: Some(version(2)),
            expires_at_ms: Some(99),
        };
        let shown =
            DeltaView::of(Change::decode(&put.encode().unwrap()), DEFAULT_SHOW_BYTES).to_string();
        assert_eq!(
            shown,
            "put key \"k\" value \"v\" version 000000000000001:00003:mqstate \
             fencing-token 000000000000002:00003:mqstate expires-at-ms 99"
        );
        let delete = Delta::Delete {
            key: Bytes::from_static(b"k"),
            version: version(5),
        };
        let view = DeltaView::of(
            Change::decode(&delete.encode().unwrap()),
            DEFAULT_SHOW_BYTES,
        );
        assert_eq!(
            view.to_json(),
            json!({"op": "delete", "key": "k", "key_len": 1, "version": "000000000000005:00003:mqstate"})
        );
    }

    #[test]
    fn a_request_record_shows_its_change_and_who_made_it() {
        let change = Change::Requested {
            request: mqstate_store::RequestRecord {
                id: mqstate_store::RequestId::of("app-1", &[0x0a, 0xff]),
                expires_at_ms: 1_234,
                reply: Bytes::from_static(b"+OK\r\n"),
                reply_ts: Some(version(7)),
            },
            change: Box::new(Change::Key(Delta::Delete {
                key: Bytes::from_static(b"k"),
                version: version(7),
            })),
        };
        let data = change.encode().unwrap();
        assert_eq!(
            Log::Store.describe(&data, DEFAULT_SHOW_BYTES, false),
            "delete key \"k\" version 000000000000007:00003:mqstate \
             by request d79a8e08eeaea999152ea2ad682d450b (a retry until 1234 ms gets \"+OK\")"
        );
        let json: Value =
            serde_json::from_str(&Log::Store.describe(&data, DEFAULT_SHOW_BYTES, true)).unwrap();
        assert_eq!(json["op"], "delete");
        assert_eq!(
            json["request"],
            json!({"id": "d79a8e08eeaea999152ea2ad682d450b", "expires_at_ms": 1234, "reply": "+OK"})
        );
        // A change without a request (an expiry) shows no request.
        let plain = Change::Key(Delta::Delete {
            key: Bytes::from_static(b"k"),
            version: version(7),
        });
        let json: Value = serde_json::from_str(&Log::Store.describe(
            &plain.encode().unwrap(),
            DEFAULT_SHOW_BYTES,
            true,
        ))
        .unwrap();
        assert!(json.get("request").is_none(), "{json}");
    }

    #[test]
    fn bytes_that_are_not_a_delta_are_flagged_not_fatal() {
        let view = DeltaView::of(Change::decode(b"?garbage"), DEFAULT_SHOW_BYTES);
        assert!(view.to_string().starts_with("UNDECODABLE: "), "{view}");
        assert_eq!(view.to_json()["op"], "undecodable");
    }
}
