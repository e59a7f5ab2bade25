//! What replicas send each other, and what a replica gives its driver to do.

use serde::{Deserialize, Serialize};

use crate::types::{Key, NodeId, Record, RequestId, Version};

/// A batch from one replica to another under one view. Everything a replica has for one peer after
/// handling one input travels in one message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The sender's view; a receiver acting under another view drops the whole message (the sender
    /// resends what still matters under the new view).
    pub view: u64,
    pub from: NodeId,
    pub items: Vec<Item>,
}

/// One step of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Item {
    /// Phase 1, predecessor → successor: hold this row (locked, or committed at the tail) durably.
    Prepare {
        key: Key,
        value: Option<Vec<u8>>,
        version: Version,
    },
    /// Phase 2, successor → predecessor: every replica from here to the tail has `version` durably
    /// and committed; commit and unlock.
    Commit { key: Key, version: Version },
    /// Recovery, head → a replica catching up: committed rows in key order after the previous
    /// chunk (`seq` numbers the chunks of one copy). Applied by version, so a resent or stale
    /// chunk changes nothing.
    Copy { seq: u64, rows: Vec<CopiedRow> },
    /// The catching-up replica holds chunk `seq` durably.
    CopyAck { seq: u64 },
    /// Head → catching-up replica: every row the copy skipped (locked at the head) has since been
    /// committed through the chain, so you hold every committed row.
    CopyDone,
    /// The catching-up replica recorded that it caught up.
    CopyDoneAck,
    /// Successor → predecessor: this replica holds `version` of `key`, above the one the
    /// predecessor prepared, or one it may have lost. Phase 1 is pipelined (a replica forwards
    /// before its own fsync), so a predecessor that lost power before its fsync can be behind its
    /// successor; it takes a later row and rolls it forward (decision 0043).
    Ahead {
        key: Key,
        value: Option<Vec<u8>>,
        version: Version,
    },
    /// Predecessor → successor, from a replica restarted from its log until it is answered: send
    /// me every row you hold (`Ahead` each), then `Synced`.
    Resync,
    /// Successor → predecessor: every row this replica holds was sent before this.
    Synced,
}

/// A committed row in a recovery copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopiedRow {
    pub key: Key,
    pub value: Option<Vec<u8>>,
    pub version: Version,
}

/// What the driver must do, in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Append these records to the replica's log as batch `index` (batches are numbered 1, 2, …
    /// per replica incarnation, appended in order) and call [`crate::Replica::durable`] with
    /// `index` once they are fsynced. Only a `Prepare` goes out before its row's batch is durable
    /// (phase 1 is pipelined); a commit, an answer or an acknowledgement waits for it.
    Persist { index: u64, records: Vec<Record> },
    /// Send to a peer (any transport; loss, duplication and reordering are tolerated).
    Send { to: NodeId, message: Message },
    /// Answer a client request.
    Reply { request: RequestId, answer: Answer },
    /// This replica holds every committed row of the partition: tell the control plane
    /// (`CaughtUp`), so that its next view has this replica in the read view.
    CaughtUp { view: u64 },
}

/// The answer to a client request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The write is committed: every replica of the write view it completed in fsynced it.
    Written { version: Version },
    /// A read: the committed value (`None`: no such key) and its version (`None`: never written).
    Value {
        value: Option<Vec<u8>>,
        version: Option<Version>,
    },
    /// This replica is not the head: send the request to `head` (if known).
    NotHead { head: Option<NodeId> },
    /// Not executed: no view is held (lease or reconfiguration), or the head is still catching up.
    /// Retry.
    Unavailable,
    /// Not executed: the write's version is not above the row's; stamp it above `current` and retry.
    StaleVersion { current: Version },
    /// Not executed: the write's condition does not hold; `current` is the row's version.
    ConditionFailed { current: Option<Version> },
}

/// A write as the head's driver submits it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub key: Key,
    /// `None` deletes.
    pub value: Option<Vec<u8>>,
    /// Must be above the row's version.
    pub version: Version,
    pub expect: Expect,
}

/// The condition a write is executed under, checked against the committed row at the moment the
/// write starts at the head (after every earlier write to the key completed), so a driver can build
/// compare-and-set commands (NX, NEX, VDEL, fencing) on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Any,
    /// No value (never written, or deleted).
    Absent,
    /// The row is at exactly this version.
    Version(Version),
}
