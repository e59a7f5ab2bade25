//! The state-store commands the simulations issue (SET, SET NX, GET, DEL, VDEL on small integer
//! values), their RESP form, what an answer says, one key's sequential model with versions, and the
//! checks of one key's history: linearizable, versions never backwards in real time, the newest
//! acknowledged write not lost. Shared by the data plane's simulation
//! (`crates/replication/tests/turmoil_sim.rs`) and the front end's
//! (`crates/statestore/tests/turmoil_sim.rs`; decision 0067).

use mqstate_protocol::Hlc;

use crate::{Model, Timed, UNKNOWN};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Cmd {
    Set { value: u64, nx: bool },
    Get,
    Del,
    Vdel { value: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Outcome {
    Written(Hlc),
    NotApplied,
    Hit(u64, Hlc),
    Miss,
    /// DEL / VDEL: 1 deleted, 0 missing, -1 (VDEL) value differs.
    Deleted(i64),
    /// No answer, or an answer that does not say whether it ran.
    Unknown,
}

/// One operation of a history: who issued it, what it was, when (places in the run's one order
/// of events), and what came back.
#[derive(Debug, Clone)]
pub struct Op {
    pub client: u64,
    pub cmd: Cmd,
    pub invoked: u64,
    /// [`UNKNOWN`] when no outcome came back.
    pub returned: u64,
    pub outcome: Outcome,
}

fn bulk(text: &str) -> String {
    format!("${}\r\n{text}\r\n", text.len())
}

/// The RESP request of `cmd` on `key`.
pub fn resp(cmd: &Cmd, key: &str) -> Vec<u8> {
    let args: Vec<String> = match cmd {
        Cmd::Set { value, nx: false } => vec!["SET".into(), key.into(), value.to_string()],
        Cmd::Set { value, nx: true } => {
            vec!["SET".into(), key.into(), value.to_string(), "NX".into()]
        }
        Cmd::Get => vec!["GET".into(), key.into()],
        Cmd::Del => vec!["DEL".into(), key.into()],
        Cmd::Vdel { value } => vec!["VDEL".into(), key.into(), value.to_string()],
    };
    let mut out = format!("*{}\r\n", args.len());
    for a in &args {
        out.push_str(&bulk(a));
    }
    out.into_bytes()
}

/// The outcome an answer (its payload and `__ts`) says; `Err` for an `-ERR` (its text) or a reply
/// that makes no sense.
pub fn outcome(cmd: &Cmd, payload: &[u8], ts: Option<&str>) -> Result<Outcome, String> {
    let text = String::from_utf8_lossy(payload).into_owned();
    let version = || {
        ts.and_then(|ts| Hlc::parse(ts).ok())
            .ok_or_else(|| format!("{text:?} without a version"))
    };
    if let Some(error) = text.strip_prefix("-ERR ") {
        return Err(error.trim_end().to_owned());
    }
    match (cmd, text.as_str()) {
        (Cmd::Set { .. }, "+OK\r\n") => Ok(Outcome::Written(version()?)),
        (Cmd::Set { nx: true, .. }, ":-1\r\n") => Ok(Outcome::NotApplied),
        (Cmd::Get, "$-1\r\n") => Ok(Outcome::Miss),
        (Cmd::Get, hit) if hit.starts_with('$') => {
            let value = hit
                .split("\r\n")
                .nth(1)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("GET answered {hit:?}"))?;
            Ok(Outcome::Hit(value, version()?))
        }
        (Cmd::Del, ":1\r\n") | (Cmd::Vdel { .. }, ":1\r\n") => Ok(Outcome::Deleted(1)),
        (Cmd::Del, ":0\r\n") | (Cmd::Vdel { .. }, ":0\r\n") => Ok(Outcome::Deleted(0)),
        (Cmd::Vdel { .. }, ":-1\r\n") => Ok(Outcome::Deleted(-1)),
        _ => Err(format!("unexpected reply {text:?} to {cmd:?}")),
    }
}

/// One key's sequential specification: the state store's semantics of the commands used here.
pub struct KeyModel;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyState {
    /// The value, and its version unless written by a request whose answer never came.
    entry: Option<(u64, Option<Hlc>)>,
    /// The highest version the key is known to have had: every later write's is above it.
    floor: Option<Hlc>,
}

impl KeyState {
    /// A key that does not exist and never did.
    pub fn absent() -> KeyState {
        KeyState {
            entry: None,
            floor: None,
        }
    }
}

impl Model for KeyModel {
    type State = KeyState;
    type Op = (Cmd, Outcome);

    fn step(&self, state: &KeyState, (cmd, outcome): &(Cmd, Outcome)) -> Option<KeyState> {
        let above_floor = |v: &Hlc| state.floor.as_ref().is_none_or(|f| v > f);
        let written = |value: u64, version: Option<&Hlc>| KeyState {
            entry: Some((value, version.cloned())),
            floor: version.cloned().or_else(|| state.floor.clone()),
        };
        let deleted = || KeyState {
            entry: None,
            floor: state.floor.clone(),
        };
        let present = state.entry.is_some();
        let holds = |v: u64| state.entry.as_ref().is_some_and(|(value, _)| *value == v);
        match (cmd, outcome) {
            (Cmd::Set { value, nx }, Outcome::Written(v)) => {
                (above_floor(v) && !(*nx && present)).then(|| written(*value, Some(v)))
            }
            (Cmd::Set { nx: true, .. }, Outcome::NotApplied) => present.then(|| state.clone()),
            // Placed means it ran: NX only takes effect on an absent key.
            (Cmd::Set { value, nx }, Outcome::Unknown) => Some(if *nx && present {
                state.clone()
            } else {
                written(*value, None)
            }),
            (Cmd::Get, Outcome::Miss) => (!present).then(|| state.clone()),
            (Cmd::Get, Outcome::Hit(value, v)) => match &state.entry {
                Some((held, Some(version))) if held == value && version == v => Some(state.clone()),
                // The value of a write whose answer never came: its version shows here.
                Some((held, None)) if held == value && above_floor(v) => {
                    Some(written(*value, Some(v)))
                }
                _ => None,
            },
            (Cmd::Get, Outcome::Unknown) => Some(state.clone()),
            (Cmd::Del, Outcome::Deleted(1)) => present.then(deleted),
            (Cmd::Del, Outcome::Deleted(0)) => (!present).then(deleted),
            (Cmd::Del, Outcome::Unknown) => Some(deleted()),
            (Cmd::Vdel { value }, Outcome::Deleted(1)) => holds(*value).then(deleted),
            (Cmd::Vdel { .. }, Outcome::Deleted(0)) => (!present).then(deleted),
            (Cmd::Vdel { value }, Outcome::Deleted(-1)) => {
                (present && !holds(*value)).then(|| state.clone())
            }
            (Cmd::Vdel { value }, Outcome::Unknown) => Some(if holds(*value) {
                deleted()
            } else {
                state.clone()
            }),
            _ => None,
        }
    }
}

/// The version an outcome shows, if any.
pub fn version_of(op: &Op) -> Option<&Hlc> {
    match &op.outcome {
        Outcome::Written(v) | Outcome::Hit(_, v) => Some(v),
        _ => None,
    }
}

/// The checks of one key's operations, each finding a line: linearizable against [`KeyModel`]
/// (searching at most `max_states` states), versions never backwards in real time, and the newest
/// acknowledged SET shown by the last read of `final_client` unless a delete may have come after it.
pub fn check_key(key: &str, ops: &[&Op], final_client: u64, max_states: usize) -> Vec<String> {
    let mut findings = Vec::new();
    let timed: Vec<Timed<(Cmd, Outcome)>> = ops
        .iter()
        .map(|op| Timed {
            op: (op.cmd.clone(), op.outcome.clone()),
            invoked: op.invoked,
            returned: op.returned,
        })
        .collect();
    if let Err(e) = crate::check(&KeyModel, &timed, KeyState::absent(), max_states) {
        findings.push(format!("{key}: {e}"));
    }
    // Versions in real time: what returned before an operation began bounds what it sees.
    let mut backwards_found = Vec::new();
    for a in ops.iter().filter(|op| op.returned != UNKNOWN) {
        let Some(va) = version_of(a) else { continue };
        for b in ops.iter().filter(|b| b.invoked > a.returned) {
            let Some(vb) = version_of(b) else { continue };
            let backwards = vb < va || (vb == va && matches!(b.outcome, Outcome::Written(_)));
            if backwards {
                backwards_found.push(format!(
                    "{key}: {:?} by c{} got version {vb} after {:?} by c{} had returned {va}",
                    b.cmd, b.client, a.cmd, a.client
                ));
            }
        }
    }
    let more = backwards_found.len().saturating_sub(3);
    findings.extend(backwards_found.into_iter().take(3));
    if more > 0 {
        findings.push(format!(
            "{key}: and {more} more versions that went backwards"
        ));
    }
    // Acknowledged writes survive: the last read shows the newest acknowledged SET unless a delete
    // may have come after it.
    let newest = ops
        .iter()
        .filter(|op| matches!(op.outcome, Outcome::Written(_)))
        .max_by_key(|op| version_of(op).cloned());
    let last_read = ops.iter().rev().find(|op| {
        op.client == final_client && matches!(op.outcome, Outcome::Hit(..) | Outcome::Miss)
    });
    if let (Some(newest), Some(last)) = (newest, last_read) {
        let acked = version_of(newest).cloned();
        let deleted_after = ops.iter().any(|op| {
            matches!(op.cmd, Cmd::Del | Cmd::Vdel { .. })
                && matches!(op.outcome, Outcome::Deleted(1) | Outcome::Unknown)
                && op.returned > newest.invoked
        });
        let lost = match &last.outcome {
            Outcome::Hit(_, v) => Some(v) < acked.as_ref(),
            Outcome::Miss => !deleted_after,
            _ => false,
        };
        if lost {
            findings.push(format!(
                "{key}: the acknowledged {:?} by c{} (version {}) is lost: the last read got {:?}",
                newest.cmd,
                newest.client,
                acked.map(|v| v.to_string()).unwrap_or_default(),
                last.outcome
            ));
        }
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    const FINAL: u64 = 99;

    fn op(client: u64, cmd: Cmd, outcome: Outcome, invoked: u64, returned: u64) -> Op {
        Op {
            client,
            cmd,
            invoked,
            returned,
            outcome,
        }
    }

    fn hlc(wall_ms: u64) -> Hlc {
        Hlc {
            wall_ms,
            counter: 0,
            node_id: "mqstate".into(),
        }
    }

    /// The checks refuse what they must: a stale read, a version that goes back, a lost write; and
    /// accept a write whose answer never came showing up later.
    #[test]
    fn the_checks_catch_stale_reads_versions_going_back_and_lost_writes() {
        let set = |value| Cmd::Set { value, nx: false };
        let check = |ops: Vec<Op>| check_key("k", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000);
        let fine = vec![
            op(1, set(1), Outcome::Written(hlc(10)), 1, 2),
            op(2, set(2), Outcome::Unknown, 3, UNKNOWN),
            op(1, Cmd::Get, Outcome::Hit(1, hlc(10)), 4, 5),
            op(1, Cmd::Get, Outcome::Hit(2, hlc(12)), 6, 7),
            op(
                3,
                Cmd::Set { value: 3, nx: true },
                Outcome::NotApplied,
                8,
                9,
            ),
            op(FINAL, Cmd::Get, Outcome::Hit(2, hlc(12)), 10, 11),
        ];
        assert_eq!(check(fine), Vec::<String>::new());

        let stale = vec![
            op(1, set(1), Outcome::Written(hlc(10)), 1, 2),
            op(1, set(2), Outcome::Written(hlc(11)), 3, 4),
            op(2, Cmd::Get, Outcome::Hit(1, hlc(10)), 5, 6),
        ];
        let findings = check(stale);
        assert!(
            findings.iter().any(|f| f.contains("not linearizable")),
            "{findings:?}"
        );
        assert!(
            findings.iter().any(|f| f.contains("after Set")),
            "{findings:?}"
        );

        let back = vec![
            op(1, set(1), Outcome::Written(hlc(10)), 1, 2),
            op(1, set(2), Outcome::Written(hlc(9)), 3, 4),
        ];
        assert!(!check(back).is_empty(), "a later SET with a lower version");

        let lost = vec![
            op(1, set(1), Outcome::Written(hlc(10)), 1, 2),
            op(2, Cmd::Del, Outcome::Deleted(1), 0, 1),
            op(FINAL, Cmd::Get, Outcome::Miss, 3, 4),
        ];
        let findings = check(lost);
        assert!(
            findings.iter().any(|f| f.contains("is lost")),
            "{findings:?}"
        );
    }

    #[test]
    fn answers_read_as_outcomes() {
        let set = Cmd::Set { value: 7, nx: true };
        let ts = "000000000000010:00000:mqstate";
        assert_eq!(
            outcome(&set, b"+OK\r\n", Some(ts)),
            Ok(Outcome::Written(hlc(10)))
        );
        assert_eq!(outcome(&set, b":-1\r\n", None), Ok(Outcome::NotApplied));
        assert_eq!(
            outcome(&Cmd::Get, b"$1\r\n7\r\n", Some(ts)),
            Ok(Outcome::Hit(7, hlc(10)))
        );
        assert!(
            outcome(&set, b"+OK\r\n", None).is_err(),
            "a SET without a version"
        );
        assert_eq!(
            outcome(&Cmd::Del, b"-ERR the quota has been exceeded\r\n", None),
            Err("the quota has been exceeded".to_owned())
        );
        assert_eq!(
            resp(&set, "k"),
            b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n7\r\n$2\r\nNX\r\n".to_vec()
        );
    }
}
