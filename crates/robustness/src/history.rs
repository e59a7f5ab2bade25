//! What a run records: every operation's invocation and result, every notification, every fault.
//!
//! Times are microseconds of the wall clock (the server's expiry deadlines are wall-clock
//! milliseconds on the same machine, and the model needs both on one scale).

use std::time::{SystemTime, UNIX_EPOCH};

use mqstate_protocol::Hlc;
use serde::{Deserialize, Serialize};

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A version or fencing token as the wire carries it, ordered as an HLC.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Version(pub Hlc);

impl Version {
    pub fn parse(text: &str) -> Option<Version> {
        Hlc::parse(text).ok().map(Version)
    }
}

impl TryFrom<String> for Version {
    type Error = String;

    fn try_from(text: String) -> Result<Version, String> {
        Version::parse(&text).ok_or_else(|| format!("{text:?} is not a version (HLC)"))
    }
}

impl From<Version> for String {
    fn from(v: Version) -> String {
        v.0.to_string()
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Condition {
    Always,
    /// `NX`
    NotExists,
    /// `NEX`
    NotExistsOrEqual,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cmd {
    Set {
        value: String,
        condition: Condition,
        px_ms: Option<u64>,
        fencing_token: Option<Version>,
    },
    Get,
    Del {
        fencing_token: Option<Version>,
    },
    VDel {
        value: String,
        fencing_token: Option<Version>,
    },
}

impl Cmd {
    pub fn name(&self) -> &'static str {
        match self {
            Cmd::Set {
                condition: Condition::Always,
                ..
            } => "SET",
            Cmd::Set {
                condition: Condition::NotExists,
                ..
            } => "SET NX",
            Cmd::Set {
                condition: Condition::NotExistsOrEqual,
                ..
            } => "SET NEX",
            Cmd::Get => "GET",
            Cmd::Del { .. } => "DEL",
            Cmd::VDel { .. } => "VDEL",
        }
    }
}

/// The result of an operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// `+OK` with the new version.
    Written(Version),
    /// `:-1` of a SET whose condition was false.
    NotApplied,
    Hit {
        value: String,
        version: Version,
    },
    Miss,
    /// DEL / VDEL integer replies.
    Deleted(i64),
    /// `-ERR <text>`.
    Error(String),
    /// Timeout or connection loss: may or may not have happened.
    Unknown,
    /// A reply the protocol does not allow (reported; what it did is unknown).
    Unexpected(String),
}

impl Outcome {
    /// Whether the operation's effect is known (it has a return time).
    pub fn is_known(&self) -> bool {
        !matches!(self, Outcome::Unknown | Outcome::Unexpected(_))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Op {
    pub id: usize,
    pub client: String,
    pub key: String,
    pub cmd: Cmd,
    pub invoked_us: u64,
    /// `None` for an [`Outcome::Unknown`].
    pub returned_us: Option<u64>,
    pub outcome: Outcome,
    /// Which server process (0, 1, …) the request went to.
    pub incarnation: u32,
}

impl Op {
    pub fn version(&self) -> Option<&Version> {
        match &self.outcome {
            Outcome::Written(v) | Outcome::Hit { version: v, .. } => Some(v),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    Set(String),
    Delete,
}

/// One notification an observer received.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Notified {
    pub observer: String,
    /// The observer's connection number; registrations end with a connection (spec §6).
    pub epoch: u32,
    pub key: String,
    pub change: Change,
    pub version: Option<Version>,
    pub received_us: u64,
}

/// An observer's registration of one key on one connection, confirmed by `+OK` at `registered_us`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Registration {
    pub observer: String,
    pub epoch: u32,
    pub key: String,
    pub registered_us: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultRecord {
    /// What happened: a crash at a failpoint that was not reached in time is a `kill9`.
    pub kind: String,
    pub started_us: u64,
    pub ended_us: u64,
    pub detail: String,
    /// The failpoint fault that was drawn when its point was not reached in time and the node
    /// was killed instead (`kind` is then `kill9`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Incarnation {
    pub started_us: u64,
    /// When the process was gone (killed, crashed, stopped); `None` while it runs.
    pub ended_us: Option<u64>,
}

/// Everything one run recorded.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct History {
    /// A cluster run: a request may be forwarded to another node's head and completed there (or
    /// repaired forward under a new view) after the node it was sent to died, so an unknown
    /// operation may take effect at any time until the end of the run.
    pub cluster: bool,
    pub ops: Vec<Op>,
    pub notifications: Vec<Notified>,
    pub registrations: Vec<Registration>,
    pub faults: Vec<FaultRecord>,
    pub incarnations: Vec<Incarnation>,
    /// Reconnections of a persistent session that the server answered with Session Present = 0.
    pub sessions_lost: Vec<String>,
    /// Every clock offset a node was restarted with (the `clock_offset` fault), in ms.
    pub clock_offsets_ms: Vec<i64>,
}

impl History {
    /// The widest gap there can have been between two nodes' clocks (every node starts at 0).
    pub fn clock_spread_ms(&self) -> u64 {
        let high = self
            .clock_offsets_ms
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(0);
        let low = self
            .clock_offsets_ms
            .iter()
            .copied()
            .min()
            .unwrap_or(0)
            .min(0);
        high.abs_diff(low)
    }

    /// The latest instant an operation sent to `incarnation` can have taken effect.
    pub fn effect_deadline_us(&self, incarnation: u32) -> u64 {
        if self.cluster {
            return u64::MAX;
        }
        self.incarnations
            .get(incarnation as usize)
            .and_then(|i| i.ended_us)
            .unwrap_or(u64::MAX)
    }
}

/// The start of a cluster node's error when it gave up on a request it may have handed to its
/// partition's head (`crates/replication`): the write may still complete, so the checks treat the
/// operation as unknown rather than refused.
pub const CLUSTER_GAVE_UP: &str = "the cluster could not serve the request in time";

impl Op {
    /// Whether the effect of the operation is known: unknown ones, and the errors of a cluster
    /// node that gave up waiting, may or may not have happened.
    pub fn effect_known(&self, cluster: bool) -> bool {
        match &self.outcome {
            Outcome::Error(text) if cluster => !text.starts_with(CLUSTER_GAVE_UP),
            outcome => outcome.is_known(),
        }
    }
}
