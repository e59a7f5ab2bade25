//! The state-store commands the simulations issue (SET, SET NX, GET, DEL, VDEL on small integer
//! values, SET with a fencing token, SET with an expiry), the clients' mix of them, their RESP
//! form, what an answer says, one key's sequential model with versions, fencing tokens and expiry
//! (within the spread of the nodes' clocks), and the checks of one
//! key's history: linearizable, versions never backwards in real time, accepted fencing tokens
//! never backwards in version order, the newest acknowledged write not lost; a run's [`History`]
//! and a sweep's [`Figures`]. Shared by the data plane's simulation
//! (`crates/replication/tests/turmoil_sim.rs`), the front end's
//! (`crates/statestore/tests/turmoil_sim.rs`; decision 0067) and the cluster's
//! (`crates/node/tests/turmoil_sim.rs`), which keep only what differs: the nodes, how a request
//! travels, the faults.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use mqstate_protocol::{ErrorKind, Hlc};
use rand::Rng;

use crate::{Model, Timed, UNKNOWN};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Cmd {
    Set {
        value: u64,
        nx: bool,
    },
    Get,
    Del,
    Vdel {
        value: u64,
    },
    /// A SET with a fencing token (`__ft`): refused if the key holds a newer token; stores the
    /// newer of the two. Only on keys no DEL or unfenced SET touches (a lock holder's).
    FencedSet {
        value: u64,
        token: Hlc,
    },
    /// A SET with an expiry (`PX px_ms`): from the head's clock reading as it ran plus `px_ms`,
    /// every head that reads the key on its own clock finds it gone. Only on keys whose operations
    /// record their simulated times ([`Op::ms`]). Last, so the other variants hash as before.
    SetPx {
        value: u64,
        nx: bool,
        px_ms: u64,
    },
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
    /// A fenced SET refused: the key's fencing token is newer than the request's.
    Fenced,
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
    /// The simulated milliseconds of the invocation and of the return ([`UNKNOWN`] when no outcome
    /// came back): recorded for the operations on expiring keys, whose model needs them.
    pub ms: Option<(u64, u64)>,
}

/// A client's next command: 30 % SET, 15 % SET NX, 35 % GET, 10 % DEL, 10 % VDEL of a value it
/// wrote (its latest most often). A value is the client's id and `seq`, so every SET writes one
/// no other does; `written` gathers them.
pub fn draw(rng: &mut impl Rng, client: u64, seq: u64, written: &mut Vec<u64>) -> Cmd {
    let value = client << 32 | seq;
    let cmd = match rng.gen_range(0..100) {
        0..=29 => Cmd::Set { value, nx: false },
        30..=44 => Cmd::Set { value, nx: true },
        45..=79 => Cmd::Get,
        80..=89 => Cmd::Del,
        _ => Cmd::Vdel {
            value: match written.last() {
                Some(&v) if rng.gen_bool(0.7) => v,
                _ => client << 32 | rng.gen_range(1..=seq),
            },
        },
    };
    if let Cmd::Set { value, .. } = cmd {
        written.push(value);
    }
    cmd
}

fn bulk(text: &str) -> String {
    format!("${}\r\n{text}\r\n", text.len())
}

/// The fencing token `cmd` sends (as the `__ft` property), if any.
pub fn fencing_token(cmd: &Cmd) -> Option<&Hlc> {
    match cmd {
        Cmd::FencedSet { token, .. } => Some(token),
        _ => None,
    }
}

/// The RESP request of `cmd` on `key`.
pub fn resp(cmd: &Cmd, key: &str) -> Vec<u8> {
    let args: Vec<String> = match cmd {
        Cmd::Set { value, nx: false } | Cmd::FencedSet { value, .. } => {
            vec!["SET".into(), key.into(), value.to_string()]
        }
        Cmd::Set { value, nx: true } => {
            vec!["SET".into(), key.into(), value.to_string(), "NX".into()]
        }
        Cmd::SetPx { value, nx, px_ms } => {
            let mut args = vec!["SET".into(), key.into(), value.to_string()];
            if *nx {
                args.push("NX".into());
            }
            args.extend(["PX".into(), px_ms.to_string()]);
            args
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
        let error = error.trim_end();
        if matches!(cmd, Cmd::FencedSet { .. })
            && error == ErrorKind::FencingTokenLowerVersion.as_str()
        {
            return Ok(Outcome::Fenced);
        }
        return Err(error.to_owned());
    }
    match (cmd, text.as_str()) {
        (Cmd::Set { .. } | Cmd::FencedSet { .. } | Cmd::SetPx { .. }, "+OK\r\n") => {
            Ok(Outcome::Written(version()?))
        }
        (Cmd::Set { nx: true, .. } | Cmd::SetPx { nx: true, .. }, ":-1\r\n") => {
            Ok(Outcome::NotApplied)
        }
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
///
/// Expiry ([`Cmd::SetPx`]): the head that runs the SET at simulated time `t` stores the deadline
/// `t + s1 + px` on its own clock (`s1` its offset from simulated time); a later command that runs
/// at `t'` on a head `s2` off finds the key gone iff `t' + s2 ≥ t + s1 + px` (the head's clock as
/// it runs the command: `head::step`'s `now_ms`; its expiry timer deletes the row on the same
/// clock). Neither `t` within the SET's interval nor which node was the head is known, so with
/// `clock_spread_ms` the largest difference of two nodes' offsets, a command that ended before
/// `invoked + px − spread` must find the key, one that began at or after `returned + px + spread`
/// must not, and one in between may do either. A command that found the key gone in that band
/// leaves it in the model: a head whose clock is behind may still find it there (until the
/// expiry's delete lands, which the history does not show). So "gone, then back" is caught only
/// outside the band.
pub struct KeyModel {
    pub clock_spread_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyState {
    /// The value, and its version unless written by a request whose answer never came.
    entry: Option<(u64, Option<Hlc>)>,
    /// Of an entry written with an expiry: the simulated ms before which no head finds it gone,
    /// and from which every head does ([`UNKNOWN`]: never certain).
    expiry: Option<(u64, u64)>,
    /// The highest version the key is known to have had: every later write's is above it.
    floor: Option<Hlc>,
    /// The fencing token the key holds (it goes with the key).
    token: Option<Hlc>,
}

impl KeyState {
    /// A key that does not exist and never did.
    pub fn absent() -> KeyState {
        KeyState {
            entry: None,
            expiry: None,
            floor: None,
            token: None,
        }
    }
}

/// An operation as the model sees it: the command, its outcome and its simulated ms ([`Op::ms`]).
pub type ModelOp = (Cmd, Outcome, Option<(u64, u64)>);

/// Whether a command running somewhere within `ms` can have found the key there, and gone.
fn found(state: &KeyState, ms: &Option<(u64, u64)>) -> (bool, bool) {
    let (from, to) = ms.unwrap_or((0, UNKNOWN));
    let present = state.entry.is_some();
    let maybe_there = present && state.expiry.is_none_or(|(_, latest)| from < latest);
    let maybe_gone = !present || state.expiry.is_some_and(|(earliest, _)| to >= earliest);
    (maybe_there, maybe_gone)
}

impl Model for KeyModel {
    type State = KeyState;
    type Op = ModelOp;

    fn step(&self, state: &KeyState, (cmd, outcome, ms): &ModelOp) -> Option<KeyState> {
        let above_floor = |v: &Hlc| state.floor.as_ref().is_none_or(|f| v > f);
        let written = |value: u64, version: Option<&Hlc>, expiry: Option<(u64, u64)>| KeyState {
            entry: Some((value, version.cloned())),
            expiry,
            floor: version.cloned().or_else(|| state.floor.clone()),
            token: state.token.clone(),
        };
        let deleted = || KeyState {
            entry: None,
            expiry: None,
            floor: state.floor.clone(),
            token: None,
        };
        // A fenced SET passes unless the key holds a newer token, and leaves the newer of the two.
        let fenced = |value: u64, token: &Hlc, version: Option<&Hlc>| {
            let passes = state.token.as_ref().is_none_or(|held| token >= held);
            passes.then(|| KeyState {
                token: state.token.clone().max(Some(token.clone())),
                ..written(value, version, None)
            })
        };
        let (there, gone) = found(state, ms);
        let (from, to) = ms.unwrap_or((0, UNKNOWN));
        let spread = self.clock_spread_ms;
        let expiry = |px: u64| {
            (
                from.saturating_add(px).saturating_sub(spread),
                to.saturating_add(px).saturating_add(spread),
            )
        };
        let holds = |v: u64| there && state.entry.as_ref().is_some_and(|(value, _)| *value == v);
        match (cmd, outcome) {
            (Cmd::Set { value, nx }, Outcome::Written(v)) => {
                (above_floor(v) && (!*nx || gone)).then(|| written(*value, Some(v), None))
            }
            (Cmd::SetPx { value, nx, px_ms }, Outcome::Written(v)) => (above_floor(v)
                && (!*nx || gone))
                .then(|| written(*value, Some(v), Some(expiry(*px_ms)))),
            (Cmd::Set { nx: true, .. } | Cmd::SetPx { nx: true, .. }, Outcome::NotApplied) => {
                there.then(|| state.clone())
            }
            // Placed means it ran: NX only takes effect on a key it found gone. (Where it may have
            // found it there too, that did nothing: the same as leaving it unplaced.)
            (Cmd::Set { value, nx }, Outcome::Unknown) => Some(if *nx && !gone {
                state.clone()
            } else {
                written(*value, None, None)
            }),
            (Cmd::SetPx { value, nx, px_ms }, Outcome::Unknown) => Some(if *nx && !gone {
                state.clone()
            } else {
                written(*value, None, Some(expiry(*px_ms)))
            }),
            (Cmd::Get, Outcome::Miss) => gone.then(|| state.clone()),
            (Cmd::Get, Outcome::Hit(value, v)) if there => match &state.entry {
                Some((held, Some(version))) if held == value && version == v => Some(state.clone()),
                // The value of a write whose answer never came: its version shows here.
                Some((held, None)) if held == value && above_floor(v) => {
                    Some(written(*value, Some(v), state.expiry))
                }
                _ => None,
            },
            (Cmd::Get, Outcome::Unknown) => Some(state.clone()),
            (Cmd::Del, Outcome::Deleted(1)) => there.then(deleted),
            // Gone: nothing to delete, and an expired entry stays for slower clocks.
            (Cmd::Del | Cmd::Vdel { .. }, Outcome::Deleted(0)) => gone.then(|| state.clone()),
            (Cmd::Del, Outcome::Unknown) => Some(if there { deleted() } else { state.clone() }),
            (Cmd::Vdel { value }, Outcome::Deleted(1)) => holds(*value).then(deleted),
            (Cmd::Vdel { value }, Outcome::Deleted(-1)) => {
                (there && !holds(*value)).then(|| state.clone())
            }
            (Cmd::Vdel { value }, Outcome::Unknown) => Some(if holds(*value) {
                deleted()
            } else {
                state.clone()
            }),
            (Cmd::FencedSet { value, token }, Outcome::Written(v)) => {
                fenced(*value, token, Some(v)).filter(|_| above_floor(v))
            }
            (Cmd::FencedSet { value, token }, Outcome::Fenced) => {
                fenced(*value, token, None).is_none().then(|| state.clone())
            }
            // Placed means it ran: refused, or written.
            (Cmd::FencedSet { value, token }, Outcome::Unknown) => {
                Some(fenced(*value, token, None).unwrap_or_else(|| state.clone()))
            }
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
/// acknowledged SET shown by the last read of `final_client` unless a delete may have come after it
/// or it expires. `clock_spread_ms` is the largest difference between two nodes' clocks
/// ([`KeyModel`]).
pub fn check_key(
    key: &str,
    ops: &[&Op],
    final_client: u64,
    max_states: usize,
    clock_spread_ms: u64,
) -> Vec<String> {
    let mut findings = Vec::new();
    let timed: Vec<Timed<ModelOp>> = ops
        .iter()
        .map(|op| Timed {
            op: (op.cmd.clone(), op.outcome.clone(), op.ms),
            invoked: op.invoked,
            returned: op.returned,
        })
        .collect();
    let model = KeyModel { clock_spread_ms };
    if let Err(e) = crate::check(&model, &timed, KeyState::absent(), max_states) {
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
    // Fenced writes accepted, in the order of their versions, carry tokens that never go down.
    let mut accepted: Vec<(&Hlc, &Hlc, &Op)> = ops
        .iter()
        .filter_map(|op| match (&op.cmd, &op.outcome) {
            (Cmd::FencedSet { token, .. }, Outcome::Written(v)) => Some((v, token, *op)),
            _ => None,
        })
        .collect();
    accepted.sort_by(|a, b| a.0.cmp(b.0));
    let mut highest: Option<(&Hlc, &Op)> = None;
    for (version, token, op) in accepted {
        if let Some((max, by)) = highest.filter(|(max, _)| token < *max) {
            findings.push(format!(
                "{key}: {:?} by c{} was accepted at version {version} after {:?} by c{} had been accepted with the newer token {max}",
                op.cmd, op.client, by.cmd, by.client
            ));
        }
        if highest.is_none_or(|(max, _)| token > max) {
            highest = Some((token, op));
        }
    }
    // Acknowledged writes survive: the last read shows the newest acknowledged SET unless a delete
    // or an expiring SET may have come after it, or it expires itself.
    let newest = ops
        .iter()
        .filter(|op| matches!(op.outcome, Outcome::Written(_)))
        .max_by_key(|op| version_of(op).cloned());
    let last_read = ops.iter().rev().find(|op| {
        op.client == final_client && matches!(op.outcome, Outcome::Hit(..) | Outcome::Miss)
    });
    if let (Some(newest), Some(last)) = (newest, last_read) {
        let acked = version_of(newest).cloned();
        // A delete, or a SET with an expiry (gone by now), that may have come after it.
        let deleted_after = ops.iter().any(|op| {
            let deletes = match op.cmd {
                Cmd::Del | Cmd::Vdel { .. } => {
                    matches!(op.outcome, Outcome::Deleted(1) | Outcome::Unknown)
                }
                Cmd::SetPx { .. } => matches!(op.outcome, Outcome::Written(_) | Outcome::Unknown),
                _ => false,
            };
            deletes && op.returned > newest.invoked
        });
        let expires = matches!(newest.cmd, Cmd::SetPx { .. });
        let lost = match &last.outcome {
            Outcome::Hit(_, v) => Some(v) < acked.as_ref(),
            Outcome::Miss => !deleted_after && !expires,
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

/// An operation of a simulation's history: [`Op`] on a key, with what else the simulation records
/// (its `Debug` form is the line [`History::dump`] writes).
pub trait Keyed: Debug {
    /// The key and the operation on it.
    fn keyed(&self) -> (&'static str, &Op);

    fn key(&self) -> &'static str {
        self.keyed().0
    }

    fn kv(&self) -> &Op {
        self.keyed().1
    }

    /// Adds the operation to a run's trace, a hash of every operation in order.
    fn trace(&self, hasher: &mut DefaultHasher) {
        let op = self.kv();
        (
            self.key(),
            op.client,
            &op.cmd,
            op.invoked,
            op.returned,
            &op.outcome,
        )
            .hash(hasher);
    }
}

/// An operation of a cluster's history: [`Op`] on a key, with the node it was (last) sent to,
/// which is part of its trace.
#[derive(Debug, Clone)]
pub struct NodeOp {
    pub node: u64,
    pub key: &'static str,
    pub kv: Op,
}

impl Keyed for NodeOp {
    fn keyed(&self) -> (&'static str, &Op) {
        (self.key, &self.kv)
    }

    fn trace(&self, hasher: &mut DefaultHasher) {
        (
            self.kv.client,
            self.node,
            self.key,
            &self.kv.cmd,
            self.kv.invoked,
            self.kv.returned,
            &self.kv.outcome,
        )
            .hash(hasher);
    }
}

/// A run's operations, in the order they were recorded, and the one clock their `invoked` and
/// `returned` are places of.
#[derive(Debug)]
pub struct History<O> {
    clock: u64,
    pub ops: Vec<O>,
    /// Errors taken as "unknown" (`-ERR` texts, refusals), with their counts.
    pub errors: BTreeMap<String, u64>,
    /// The largest difference between two nodes' clocks, for the model of expiring keys.
    pub clock_spread_ms: u64,
}

impl<O> Default for History<O> {
    fn default() -> Self {
        History {
            clock: 0,
            ops: Vec::new(),
            errors: BTreeMap::new(),
            clock_spread_ms: 0,
        }
    }
}

impl<O> History<O> {
    /// The next event's place.
    pub fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The `returned` of an operation that came back with `outcome`: the next place, or
    /// [`UNKNOWN`].
    pub fn returned(&mut self, outcome: &Outcome) -> u64 {
        match outcome {
            Outcome::Unknown => UNKNOWN,
            _ => self.tick(),
        }
    }

    /// Counts an error taken as "unknown".
    pub fn count_error(&mut self, error: String) {
        *self.errors.entry(error).or_default() += 1;
    }
}

impl<O: Keyed> History<O> {
    /// With the environment variable `var` set to a path, writes the history as text to
    /// `<path>.<seed>`, an operation a line, to compare two runs of a seed.
    pub fn dump(&self, var: &str, seed: u64) {
        if let Ok(path) = std::env::var(var) {
            let text: String = self.ops.iter().map(|op| format!("{op:?}\n")).collect();
            // Only a tool for comparing runs: a failed write shows as a missing file.
            let _ = std::fs::write(format!("{path}.{seed}"), text);
        }
    }

    /// What is wrong with a run that ended with `run`: its failure, then [`check_key`]'s findings
    /// on each key, or else a key of `keys` that `final_client` did not read.
    pub fn findings(
        &self,
        run: Result<(), String>,
        keys: &[&str],
        final_client: u64,
        max_states: usize,
    ) -> Vec<String> {
        let mut findings = Vec::new();
        if let Err(e) = run {
            findings.push(format!("the run failed: {e}"));
        }
        let by_key: BTreeMap<&str, Vec<&Op>> =
            self.ops.iter().fold(BTreeMap::new(), |mut m, op| {
                m.entry(op.key()).or_insert_with(Vec::new).push(op.kv());
                m
            });
        for (key, ops) in &by_key {
            findings.extend(check_key(
                key,
                ops,
                final_client,
                max_states,
                self.clock_spread_ms,
            ));
        }
        let reads: BTreeSet<&str> = self
            .ops
            .iter()
            .filter(|op| op.kv().client == final_client && op.kv().returned != UNKNOWN)
            .map(|op| op.key())
            .collect();
        if findings.is_empty() && reads.len() != keys.len() {
            findings.push(format!("only {reads:?} were read after the faults"));
        }
        findings
    }
}

/// What a sweep of seeds ran, for its summary.
#[derive(Debug, Default)]
pub struct Figures {
    pub seeds: u64,
    pub simulated: Duration,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    pub ops: u64,
    pub acked: u64,
    pub unknown: u64,
    pub errors: BTreeMap<String, u64>,
    /// A hash of every operation of every seed, in order: equal for two runs of one seed when
    /// the run is reproduced exactly.
    pub trace: u64,
}

impl Figures {
    /// Adds a seed that ran `simulated` and recorded `history`.
    pub fn add<O: Keyed>(&mut self, simulated: Duration, history: &History<O>) {
        self.seeds += 1;
        self.simulated += simulated;
        let mut trace = DefaultHasher::new();
        self.trace.hash(&mut trace);
        for op in &history.ops {
            op.trace(&mut trace);
        }
        self.trace = trace.finish();
        self.ops += history.ops.len() as u64;
        self.unknown += history
            .ops
            .iter()
            .filter(|op| op.kv().outcome == Outcome::Unknown)
            .count() as u64;
        self.acked += history
            .ops
            .iter()
            .filter(|op| matches!(op.kv().outcome, Outcome::Written(_) | Outcome::Deleted(1)))
            .count() as u64;
        for (error, n) in &history.errors {
            *self.errors.entry(error.clone()).or_default() += n;
        }
    }

    /// The sweep's summary line: `errors` names what [`History::errors`] counts, `violating` is
    /// the number of seeds that failed, `real` how long the sweep took.
    pub fn summary(&self, sim: &str, errors: &str, violating: usize, real: Duration) -> String {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect();
        format!(
            "{sim} turmoil sweep: {} seeds, {:.0} s simulated, faults: {}, {} operations ({} acknowledged writes, {} unknown, {} of them {errors}), {violating} violating seeds, trace {:016x}; {:.1} s of real time",
            self.seeds,
            self.simulated.as_secs_f64(),
            faults.join(", "),
            self.ops,
            self.acked,
            self.unknown,
            self.errors.values().sum::<u64>(),
            self.trace,
            real.as_secs_f64(),
        )
    }
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
            ms: None,
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
        let check =
            |ops: Vec<Op>| check_key("k", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000, 0);
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

    /// A fenced SET with an older token than the key holds must be refused: accepted, it is
    /// reported (no linearization, and the tokens went down); refused, the history is fine, and a
    /// refusal with no newer token held is not.
    #[test]
    fn an_older_fencing_token_must_be_refused() {
        let fenced = |value, token| Cmd::FencedSet {
            value,
            token: hlc(token),
        };
        let check =
            |ops: Vec<Op>| check_key("f", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000, 0);
        let history = |late: Outcome| {
            vec![
                op(1, fenced(1, 5), Outcome::Written(hlc(10)), 1, 2),
                op(2, fenced(2, 8), Outcome::Written(hlc(11)), 3, 4),
                op(1, fenced(3, 5), late, 5, 6),
            ]
        };
        assert_eq!(check(history(Outcome::Fenced)), Vec::<String>::new());
        let findings = check(history(Outcome::Written(hlc(12))));
        assert!(
            findings.iter().any(|f| f.contains("not linearizable")),
            "{findings:?}"
        );
        assert!(
            findings.iter().any(|f| f.contains("newer token")),
            "{findings:?}"
        );
        let refused_alone = vec![op(1, fenced(1, 5), Outcome::Fenced, 1, 2)];
        assert!(!check(refused_alone).is_empty());
    }

    /// An expiring key: a read that ended before the earliest expiry (the SET's invocation plus
    /// its PX, less the clocks' spread) must find it, one that began at or after the latest (the
    /// SET's return plus PX plus the spread) must not; in between, either. A SET NX without an
    /// answer in the band may have written or not.
    #[test]
    fn an_expiring_key_is_there_before_its_earliest_expiry_and_gone_after_its_latest() {
        let set = |nx| Cmd::SetPx {
            value: 1,
            nx,
            px_ms: 1_000,
        };
        let timed = |mut op: Op, from: u64, to: u64| {
            op.ms = Some((from, to));
            op
        };
        // The SET ran within 100..120 ms: with a spread of 50 ms, the key expires within
        // 1,050..1,170 ms as any head sees it.
        let written = timed(
            op(1, set(false), Outcome::Written(hlc(100)), 1, 2),
            100,
            120,
        );
        let read = |outcome, from, to| timed(op(2, Cmd::Get, outcome, 3, 4), from, to);
        let check = |later: Op| {
            let ops = [written.clone(), later];
            check_key("t", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000, 50)
        };
        let hit = || Outcome::Hit(1, hlc(100));
        assert_eq!(check(read(hit(), 1_000, 1_049)), Vec::<String>::new());
        assert!(
            !check(read(Outcome::Miss, 1_000, 1_049)).is_empty(),
            "gone too early"
        );
        assert_eq!(
            check(read(Outcome::Miss, 1_000, 1_050)),
            Vec::<String>::new()
        );
        assert_eq!(check(read(hit(), 1_169, 1_200)), Vec::<String>::new());
        assert!(
            !check(read(hit(), 1_170, 1_200)).is_empty(),
            "there too late"
        );
        assert_eq!(
            check(read(Outcome::Miss, 1_170, 1_200)),
            Vec::<String>::new()
        );
        // A second expiry overrides the first, and the last read missing it is no lost write.
        let final_miss = timed(op(FINAL, Cmd::Get, Outcome::Miss, 5, 6), 1_300, 1_310);
        let ops = [written.clone(), final_miss];
        let findings = check_key("t", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000, 50);
        assert_eq!(findings, Vec::<String>::new());

        // A SET NX of 9 without an answer, in the band: a later read may find 9 (it wrote) or
        // still 1 (it found 1 there).
        let unknown_nx = Cmd::SetPx {
            value: 9,
            nx: true,
            px_ms: 1_000,
        };
        let unknown_nx = timed(
            op(3, unknown_nx, Outcome::Unknown, 3, UNKNOWN),
            1_100,
            UNKNOWN,
        );
        for seen in [Outcome::Hit(1, hlc(100)), Outcome::Hit(9, hlc(101))] {
            let later = timed(op(2, Cmd::Get, seen.clone(), 5, 6), 1_120, 1_130);
            let ops = [written.clone(), unknown_nx.clone(), later];
            let findings = check_key("t", &ops.iter().collect::<Vec<_>>(), FINAL, 100_000, 50);
            assert_eq!(findings, Vec::<String>::new(), "{seen:?}");
        }
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
        let fenced = Cmd::FencedSet {
            value: 7,
            token: hlc(3),
        };
        let refusal = format!("-ERR {}\r\n", ErrorKind::FencingTokenLowerVersion.as_str());
        assert_eq!(
            outcome(&fenced, refusal.as_bytes(), None),
            Ok(Outcome::Fenced)
        );
        assert_eq!(fencing_token(&fenced), Some(&hlc(3)));
        assert_eq!(
            resp(&set, "k"),
            b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n7\r\n$2\r\nNX\r\n".to_vec()
        );
    }
}
