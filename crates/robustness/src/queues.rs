//! Persistent notification queues under faults (docs/notifications.md, issue 18: "deliver at least
//! once with nothing lost"). On a single node the driver creates one topic over the register keys
//! whose endpoint is its own HTTP server (`endpoint`), waits after the final recovery until the
//! queue has drained, and checks what the endpoint received against the history:
//!
//! - `queue-lost`: every acknowledged SET of a register key was delivered with its version and
//!   value, every acknowledged DEL/VDEL that deleted one with a version between what was seen
//!   before it and after it;
//! - `queue-seq-gap`: the `seq`s delivered are 1, 2, … up to the last one the topic handed out;
//! - `queue-phantom`: each record is a write of the history (acknowledged or of unknown outcome)
//!   or an expiry of a key written with PX, and one `seq` never stands for two changes, nor one
//!   change for two `seq`s;
//! - `queue-order`: per key, `seq` order is version order;
//! - `queue-drain`, `queue-format`: the queue drained within its bound after the run; every push
//!   was a batch as documented.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use mqstate_protocol::topic::NOTIFY_ADMIN_TOPIC;
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};

use crate::checks::Violation;
use crate::client::{Client, Options};
use crate::endpoint::{Delivered, Endpoint, Received};
use crate::history::{Cmd, History, Op, Outcome, Version};
use crate::workload::Shared;

/// The topic of a run and the keys it watches: every register key (`reg/*`), all three events.
pub const TOPIC: &str = "robustness";
pub const KEYS_PREFIX: &str = "reg/";
const ADMIN_CLIENT: &str = "queue-admin";
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the queue may take to drain after the final recovery (pushes retried after failures
/// back off up to the server's `notify_retry_max_ms`, which the driver sets to 1 s).
pub const DRAIN_BOUND: Duration = Duration::from_secs(60);

/// The server settings a run with a queue uses: retries and walks fast enough to drain in bounds.
pub const SERVER_ARGS: [&str; 6] = [
    "--notify-retry-min-ms",
    "100",
    "--notify-retry-max-ms",
    "1000",
    "--notify-walk-interval-ms",
    "1000",
];

/// One admin request to the first node, on a fresh connection; the JSON reply.
async fn admin(shared: &Shared, request: &Value) -> Result<Value, String> {
    let addr = shared.addrs[0];
    let deadline = Instant::now() + CALL_TIMEOUT;
    let options = Options {
        client_id: ADMIN_CLIENT,
        clean_start: true,
        session_expiry_secs: 0,
    };
    let (mut client, _) = Client::connect(addr, options, deadline).await?;
    let reply = client
        .call(
            NOTIFY_ADMIN_TOPIC,
            request.to_string(),
            Vec::new(),
            deadline,
        )
        .await;
    client.disconnect().await;
    let (payload, _) = reply?;
    let reply: Value = serde_json::from_slice(&payload)
        .map_err(|e| format!("the admin reply is not JSON: {e}"))?;
    match reply["error"].as_str() {
        Some(error) => Err(format!("{}: {error}", request["op"])),
        None => Ok(reply),
    }
}

/// Creates the run's topic pushing to `url` (retried for a few seconds: the server just started).
pub async fn create_topic(shared: &Shared, url: &str) -> Result<(), String> {
    let request = json!({
        "op": "create", "name": TOPIC, "endpoint": url, "keys": format!("{KEYS_PREFIX}*"),
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match admin(shared, &request).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(format!("topic create: {e}")),
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The queue's figures once it holds nothing (no entry, no reservation), polled within
/// `DRAIN_BOUND`; the last figures seen in the error otherwise.
pub async fn drain(shared: &Shared) -> Result<Value, String> {
    let deadline = Instant::now() + DRAIN_BOUND;
    let request = json!({"op": "stats", "name": TOPIC});
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        match admin(shared, &request).await {
            Ok(stats) if stats["entries"] == 0 && stats["reserved"] == 0 => return Ok(stats),
            Ok(stats) => last = stats.to_string(),
            Err(e) => last = e,
        }
        sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "the queue of topic {TOPIC} did not drain within {DRAIN_BOUND:?}; last: {last}"
    ))
}

/// The queue side of one run: the endpoint, started with the topic, and what it received.
pub struct QueueRun {
    endpoint: Endpoint,
}

/// What the queue delivered, and its final figures once drained.
pub struct QueueOutcome {
    pub received: Received,
    pub drained: Result<Value, String>,
}

impl QueueRun {
    /// Starts the endpoint and creates the topic on the (running) server.
    pub fn start(
        runtime: &tokio::runtime::Runtime,
        shared: &Shared,
        seed: u64,
    ) -> anyhow::Result<QueueRun> {
        runtime.block_on(async {
            let endpoint = Endpoint::start(seed).await?;
            create_topic(shared, &endpoint.url())
                .await
                .map_err(anyhow::Error::msg)?;
            Ok(QueueRun { endpoint })
        })
    }

    /// Waits for the queue to drain (when the server runs), then stops the endpoint.
    pub fn finish(
        self,
        runtime: &tokio::runtime::Runtime,
        shared: &Shared,
        running: bool,
    ) -> QueueOutcome {
        let drained = if running {
            runtime.block_on(drain(shared))
        } else {
            Err("the server was not running after the final recovery".to_owned())
        };
        QueueOutcome {
            received: self.endpoint.stop(),
            drained,
        }
    }
}

impl QueueOutcome {
    /// Distinct records (by `seq`) the endpoint received.
    pub fn records(&self) -> usize {
        let mut seqs: Vec<u64> = self.received.records.iter().map(|r| r.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        seqs.len()
    }

    pub fn violations(&self, history: &History) -> Vec<Violation> {
        let mut violations = Vec::new();
        if let Err(e) = &self.drained {
            violations.push(violation("queue-drain", "", e.clone(), Vec::new()));
        }
        violations.extend(check(history, &self.received, self.drained.as_ref().ok()));
        violations
    }

    /// Every record received, for a failing run's directory.
    pub fn save(&self, path: &std::path::Path) -> anyhow::Result<()> {
        std::fs::write(path, serde_json::to_string(&self.received.records)?)?;
        Ok(())
    }
}

fn violation(check: &'static str, key: &str, detail: String, ops: Vec<usize>) -> Violation {
    Violation {
        check,
        key: key.to_owned(),
        detail,
        ops,
    }
}

/// The checks of the module documentation. `drained` is the queue's final figures (`None` when
/// it did not drain: then nothing can be called lost).
pub fn check(history: &History, received: &Received, drained: Option<&Value>) -> Vec<Violation> {
    let mut violations = Vec::new();
    for e in &received.malformed {
        violations.push(violation(
            "queue-format",
            "",
            format!("a push the endpoint could not read: {e}"),
            Vec::new(),
        ));
    }
    let by_seq = distinct_by_seq(&received.records, &mut violations);
    seq_without_gaps(&by_seq, drained, &mut violations);
    let mut by_key: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in history
        .ops
        .iter()
        .filter(|op| op.key.starts_with(KEYS_PREFIX))
    {
        by_key.entry(op.key.as_str()).or_default().push(op);
    }
    no_phantoms(history, &by_seq, &by_key, &mut violations);
    seq_order_is_version_order(&by_seq, &mut violations);
    if drained.is_some() {
        nothing_lost(history, &by_seq, &by_key, &mut violations);
    }
    violations
}

/// The records by `seq` (redeliveries folded); a `seq` delivered with different content is a
/// violation (a consumer that drops repeated `seq`s would lose one of the two changes).
fn distinct_by_seq<'a>(
    records: &'a [Delivered],
    violations: &mut Vec<Violation>,
) -> BTreeMap<u64, &'a Delivered> {
    let mut by_seq: BTreeMap<u64, &Delivered> = BTreeMap::new();
    for record in records {
        if record.topic != TOPIC {
            violations.push(violation(
                "queue-phantom",
                &record.key,
                format!(
                    "a record of topic {:?}, which was never created",
                    record.topic
                ),
                Vec::new(),
            ));
            continue;
        }
        match by_seq.get(&record.seq) {
            None => {
                by_seq.insert(record.seq, record);
            }
            Some(first) if same_change(first, record) => {}
            Some(first) => violations.push(violation(
                "queue-phantom",
                &record.key,
                format!(
                    "seq {} delivered for two changes: {} {} {} {:?}, then {} {} {} {:?}",
                    record.seq,
                    first.key,
                    first.event,
                    first.version,
                    first.value,
                    record.key,
                    record.event,
                    record.version,
                    record.value
                ),
                Vec::new(),
            )),
        }
    }
    by_seq
}

fn same_change(a: &Delivered, b: &Delivered) -> bool {
    (&a.key, &a.event, &a.version, &a.value) == (&b.key, &b.event, &b.version, &b.value)
}

fn seq_without_gaps(
    by_seq: &BTreeMap<u64, &Delivered>,
    drained: Option<&Value>,
    violations: &mut Vec<Violation>,
) {
    let highest_delivered = by_seq.keys().next_back().copied().unwrap_or(0);
    // Once drained, everything the topic numbered was delivered: up to `next_seq - 1`.
    let handed_out = drained
        .and_then(|stats| stats["next_seq"].as_u64())
        .map_or(0, |next| next.saturating_sub(1));
    let highest = highest_delivered.max(handed_out);
    let missing: Vec<u64> = (1..=highest).filter(|s| !by_seq.contains_key(s)).collect();
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().take(20).map(u64::to_string).collect();
        violations.push(violation(
            "queue-seq-gap",
            "",
            format!(
                "{} seq(s) of 1..={highest} never delivered (highest delivered {highest_delivered}, \
                 the topic handed out {handed_out}): {}{}",
                missing.len(),
                shown.join(", "),
                if missing.len() > shown.len() { ", …" } else { "" }
            ),
            Vec::new(),
        ));
    }
}

/// Whether `op` may have changed its key: acknowledged, or of unknown outcome.
fn may_have_written(history: &History, op: &Op) -> bool {
    !op.effect_known(history.cluster)
        || matches!(op.outcome, Outcome::Written(_) | Outcome::Deleted(1))
}

fn no_phantoms(
    history: &History,
    by_seq: &BTreeMap<u64, &Delivered>,
    by_key: &BTreeMap<&str, Vec<&Op>>,
    violations: &mut Vec<Violation>,
) {
    let mut change_seqs: HashMap<(&str, &str), u64> = HashMap::new();
    for (&seq, record) in by_seq {
        if let Some(first) = change_seqs.insert((&record.key, &record.version), seq) {
            violations.push(violation(
                "queue-phantom",
                &record.key,
                format!(
                    "version {} of {} delivered as seq {first} and again as seq {seq}",
                    record.version, record.key
                ),
                Vec::new(),
            ));
        }
        let version = Version::parse(&record.version);
        let ops = by_key
            .get(record.key.as_str())
            .map_or(&[][..], Vec::as_slice);
        let explained = version.is_some()
            && ops.iter().any(|op| {
                may_have_written(history, op)
                    && match (&op.cmd, record.event.as_str()) {
                        (Cmd::Set { value, .. }, "set") => {
                            record.value.as_ref() == Some(value)
                                && match &op.outcome {
                                    Outcome::Written(v) => Some(v) == version.as_ref(),
                                    _ => true,
                                }
                        }
                        (Cmd::Del { .. } | Cmd::VDel { .. }, "delete") => true,
                        (Cmd::Set { px_ms: Some(_), .. }, "expire") => true,
                        _ => false,
                    }
            });
        if !explained {
            violations.push(violation(
                "queue-phantom",
                &record.key,
                format!(
                    "seq {seq}: {} {} at {} ({:?}) is no write of the history nor an expiry",
                    record.event, record.key, record.version, record.value
                ),
                Vec::new(),
            ));
        }
    }
}

fn seq_order_is_version_order(by_seq: &BTreeMap<u64, &Delivered>, violations: &mut Vec<Violation>) {
    let mut last: HashMap<&str, (u64, Version)> = HashMap::new();
    for (&seq, record) in by_seq {
        let Some(version) = Version::parse(&record.version) else {
            continue; // reported as a phantom
        };
        if let Some((before, previous)) = last.get(record.key.as_str()) {
            if *previous >= version {
                violations.push(violation(
                    "queue-order",
                    &record.key,
                    format!(
                        "seq {before} carries version {previous} of {}, the later seq {seq} the \
                         older or equal {version}",
                        record.key
                    ),
                    Vec::new(),
                ));
            }
        }
        last.insert(&record.key, (seq, version));
    }
}

fn nothing_lost(
    history: &History,
    by_seq: &BTreeMap<u64, &Delivered>,
    by_key: &BTreeMap<&str, Vec<&Op>>,
    violations: &mut Vec<Violation>,
) {
    let mut delivered: HashMap<&str, Vec<(&Delivered, Version)>> = HashMap::new();
    for record in by_seq.values() {
        if let Some(version) = Version::parse(&record.version) {
            delivered
                .entry(record.key.as_str())
                .or_default()
                .push((record, version));
        }
    }
    for (key, ops) in by_key {
        let records = delivered.get(key).map_or(&[][..], Vec::as_slice);
        for op in ops.iter().filter(|op| op.effect_known(history.cluster)) {
            match (&op.cmd, &op.outcome) {
                (Cmd::Set { value, .. }, Outcome::Written(version)) => {
                    let found = records.iter().any(|(r, v)| {
                        r.event == "set" && v == version && r.value.as_ref() == Some(value)
                    });
                    if !found {
                        violations.push(violation(
                            "queue-lost",
                            key,
                            format!(
                                "{} #{} by {} ({value} at {version}) acknowledged, never delivered",
                                op.cmd.name(),
                                op.id,
                                op.client
                            ),
                            vec![op.id],
                        ));
                    }
                }
                (Cmd::Del { .. } | Cmd::VDel { .. }, Outcome::Deleted(1)) => {
                    let (after, before) = delete_window(ops, op);
                    let found = records.iter().any(|(r, v)| {
                        r.event == "delete"
                            && after.is_none_or(|a| v > a)
                            && before.is_none_or(|b| v < b)
                    });
                    if !found {
                        violations.push(violation(
                            "queue-lost",
                            key,
                            format!(
                                "{} #{} by {} deleted the key (acknowledged), no delete after {} \
                                 and before {} delivered",
                                op.cmd.name(),
                                op.id,
                                op.client,
                                after.map_or_else(|| "the start".to_owned(), ToString::to_string),
                                before.map_or_else(|| "the end".to_owned(), ToString::to_string),
                            ),
                            vec![op.id],
                        ));
                    }
                }
                _ => {}
            }
        }
    }
}

/// The versions a delete's own version lies between: the newest any operation saw or wrote before
/// the delete was sent, and the oldest any saw or wrote after it returned.
fn delete_window<'a>(ops: &[&'a Op], delete: &Op) -> (Option<&'a Version>, Option<&'a Version>) {
    let (Some(returned), invoked) = (delete.returned_us, delete.invoked_us) else {
        return (None, None);
    };
    let after = ops
        .iter()
        .filter(|op| op.returned_us.is_some_and(|r| r < invoked))
        .filter_map(|op| op.version())
        .max();
    let before = ops
        .iter()
        .filter(|op| op.invoked_us > returned)
        .filter_map(|op| op.version())
        .min();
    (after, before)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Condition;

    fn set(id: usize, value: &str, outcome: Outcome, t: u64) -> Op {
        Op {
            id,
            client: "w0".into(),
            key: "reg/0".into(),
            cmd: Cmd::Set {
                value: value.into(),
                condition: Condition::Always,
                px_ms: None,
                fencing_token: None,
            },
            invoked_us: t,
            returned_us: outcome.is_known().then_some(t + 10),
            outcome,
            incarnation: 0,
        }
    }

    fn version(ms: u64) -> String {
        format!("{ms:015}:00000:mqstate")
    }

    fn record(seq: u64, event: &str, ms: u64, value: Option<&str>) -> Delivered {
        Delivered {
            topic: TOPIC.into(),
            seq,
            key: "reg/0".into(),
            event: event.into(),
            version: version(ms),
            value: value.map(str::to_owned),
            received_us: 0,
            refused: false,
        }
    }

    fn written(ms: u64) -> Outcome {
        Outcome::Written(Version::parse(&version(ms)).expect("version"))
    }

    fn checks_of(ops: Vec<Op>, records: Vec<Delivered>, next_seq: u64) -> Vec<&'static str> {
        let history = History {
            ops,
            ..History::default()
        };
        let received = Received {
            records,
            ..Received::default()
        };
        let stats = json!({"entries": 0, "reserved": 0, "next_seq": next_seq});
        check(&history, &received, Some(&stats))
            .into_iter()
            .map(|v| v.check)
            .collect()
    }

    #[test]
    fn a_complete_delivery_passes_with_redeliveries() {
        let ops = vec![
            set(0, "a", written(100), 0),
            set(1, "b", Outcome::Unknown, 100),
            set(2, "c", Outcome::Error("refused".into()), 200),
        ];
        let records = vec![
            record(1, "set", 100, Some("a")),
            record(1, "set", 100, Some("a")),
            record(2, "set", 150, Some("b")),
        ];
        assert_eq!(checks_of(ops, records, 3), Vec::<&str>::new());
    }

    #[test]
    fn lost_gaps_phantoms_and_order_are_found() {
        // The acknowledged SET never delivered.
        let lost = checks_of(vec![set(0, "a", written(100), 0)], vec![], 1);
        assert_eq!(lost, ["queue-lost"]);
        // seq 2 handed out, never delivered.
        let gap = checks_of(
            vec![set(0, "a", written(100), 0)],
            vec![record(1, "set", 100, Some("a"))],
            3,
        );
        assert_eq!(gap, ["queue-seq-gap"]);
        // A refused SET's value delivered.
        let phantom = checks_of(
            vec![set(0, "c", Outcome::Error("refused".into()), 0)],
            vec![record(1, "set", 100, Some("c"))],
            2,
        );
        assert_eq!(phantom, ["queue-phantom"]);
        // The same seq for two changes.
        let twice = checks_of(
            vec![
                set(0, "a", Outcome::Unknown, 0),
                set(1, "b", Outcome::Unknown, 50),
            ],
            vec![
                record(1, "set", 100, Some("a")),
                record(1, "set", 120, Some("b")),
            ],
            2,
        );
        assert_eq!(twice, ["queue-phantom"]);
        // Versions going back along seq.
        let order = checks_of(
            vec![set(0, "a", written(200), 0), set(1, "b", written(100), 0)],
            vec![
                record(1, "set", 200, Some("a")),
                record(2, "set", 100, Some("b")),
            ],
            3,
        );
        assert_eq!(order, ["queue-order"]);
    }

    #[test]
    fn an_acknowledged_delete_needs_a_delete_in_its_window() {
        let del = Op {
            id: 1,
            client: "w1".into(),
            key: "reg/0".into(),
            cmd: Cmd::Del {
                fencing_token: None,
            },
            invoked_us: 1000,
            returned_us: Some(1010),
            outcome: Outcome::Deleted(1),
            incarnation: 0,
        };
        let ops = || vec![set(0, "a", written(100), 0), del.clone()];
        let found = checks_of(
            ops(),
            vec![
                record(1, "set", 100, Some("a")),
                record(2, "delete", 300, None),
            ],
            3,
        );
        assert_eq!(found, Vec::<&str>::new());
        // The only delete is older than the SET the DEL came after.
        let missing = checks_of(
            ops(),
            vec![
                record(1, "delete", 50, None),
                record(2, "set", 100, Some("a")),
            ],
            3,
        );
        assert_eq!(missing, ["queue-lost"]);
    }
}
