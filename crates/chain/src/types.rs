//! The values the protocol is made of: rows, versions, views, and the records a replica persists.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A node's id, as the control plane numbers nodes.
pub type NodeId = u64;

/// The driver's name for one client request; answers carry it back.
pub type RequestId = u64;

/// A row's key (a state-store key's bytes).
pub type Key = Vec<u8>;

/// A row's version. Its shape is the store's hybrid logical clock (wall time, counter, node), and it
/// is compared in that order; the protocol only ever compares versions, it never makes one up — the
/// head's driver stamps each write, and a stamp not above the row's current version is refused
/// ([`crate::Answer::StaleVersion`]) so that a key's version never goes backwards, fail-overs included.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Version {
    pub wall_ms: u64,
    pub counter: u32,
    pub node: u64,
}

/// One row as a replica holds it (RTable's per-row metadata, seed 002 figure 6).
///
/// `value: None` is a tombstone: the key is deleted (or, while `locked`, being inserted or deleted),
/// kept with its version so that versions never go backwards and a recovery copy can tell "deleted"
/// from "never heard of".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    pub value: Option<Vec<u8>>,
    pub version: Version,
    /// The view under which this replica last wrote the row.
    pub view: u64,
    /// Phase 1 reached this replica but phase 2 has not: the value is durable here but not known to
    /// be committed. The tail never persists a set lock bit.
    pub locked: bool,
}

/// A partition's published view, as the control plane gives it (`mqstate-cluster`'s `Partition`):
/// the replica acts under it only while it holds a lease for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// Grows with every change; messages of any other view are rejected.
    pub id: u64,
    /// The write view, head first. Newcomers are at the end.
    pub chain: Vec<NodeId>,
    /// The replicas that hold every committed row: the chain without those still catching up, in
    /// chain order.
    pub read_view: Vec<NodeId>,
}

impl View {
    pub fn head(&self) -> Option<NodeId> {
        self.chain.first().copied()
    }

    pub fn position(&self, node: NodeId) -> Option<usize> {
        self.chain.iter().position(|&n| n == node)
    }

    pub fn readable(&self, node: NodeId) -> bool {
        self.read_view.contains(&node)
    }

    /// The chain as replicas use it: the read view's members first, then those catching up, each
    /// in chain order. The head must hold every committed row, so it is never a replica still
    /// catching up, whatever order the control plane keeps (its chain keeps survivors in place,
    /// so a replica catching up in the middle would otherwise become head when the head before it
    /// fails). Moving a catching-up replica is safe: it starts its copy over in every new view.
    pub fn readable_first(mut self) -> View {
        let (mut chain, rest): (Vec<NodeId>, Vec<NodeId>) =
            self.chain.iter().partition(|n| self.read_view.contains(n));
        chain.extend(rest);
        self.chain = chain;
        self
    }
}

/// What a replica asks its driver to append to its log, in order. Replaying a log's durable records
/// into [`Restored`] gives back what the replica needs after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// The row's new state (replaces the previous one).
    Row { key: Key, row: Row },
    /// This replica re-enters the chain of `view` at its tail: every row before this record is void
    /// (it may be stale, or a write that was never committed); a recovery copy from the head follows.
    Clear { view: u64 },
    /// The recovery copy under `view` is complete: this replica holds every committed row.
    CaughtUp { view: u64 },
    /// This replica is in the read view again; a later re-entry starts over with [`Record::Clear`].
    Readable,
}

/// A replica's durable state, folded from its log's records at restart (or read from a snapshot
/// of the log: [`crate::Replica::image`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restored {
    pub rows: BTreeMap<Key, Row>,
    /// The view whose recovery copy began ([`Record::Clear`]), while not readable since. A
    /// restart under the same view keeps the rows copied so far (the head's copy goes on from where
    /// it was); any other view starts over.
    pub joining_since: Option<u64>,
    /// The view whose recovery copy completed, while still joining.
    pub caught_up_view: Option<u64>,
}

impl Restored {
    /// Folds one durable record, in log order.
    pub fn apply(&mut self, record: Record) {
        match record {
            Record::Row { key, row } => {
                self.rows.insert(key, row);
            }
            Record::Clear { view } => {
                self.rows.clear();
                self.joining_since = Some(view);
                self.caught_up_view = None;
            }
            Record::CaughtUp { view } => self.caught_up_view = Some(view),
            Record::Readable => {
                self.joining_since = None;
                self.caught_up_view = None;
            }
        }
    }
}
