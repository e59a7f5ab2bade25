//! Which cluster a node belongs to (decision 0075): an id every node-to-node request carries, so
//! that a node of another cluster that reaches this one — it took a dead member's address (a
//! reused IP, a parallel test cluster's port), or an operator pointed it at the wrong peers — is
//! refused instead of being taken for a member (openraft would make it a follower and truncate
//! its log, or stop on "follower log reversion is not allowed").
//!
//! * Founders derive the id from the founding membership (FNV-1a 64 of the sorted `(id, address)`
//!   pairs), each on its own and all alike, just before they initialize Raft.
//! * A node that has none yet (a joiner, a founder that found the cluster formed) adopts the id of
//!   the first Raft request that reaches it.
//! * Either way it is written to `<cluster dir>/cluster-id` before the node acts on it, and read
//!   back at every start.
//! * A node whose cluster directory predates the id (an earlier release) has none and adopts none
//!   from its own cluster either, since nobody there stamps: it stays unprotected, as before.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use mqstate_wal::layout::write_file_atomically;

use crate::NodeId;

/// The file, in a node's cluster directory.
pub const FILE: &str = "cluster-id";

/// A cluster's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClusterId(pub u64);

impl std::fmt::Display for ClusterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl ClusterId {
    /// The id of a cluster founded by `founders` (every founder computes the same).
    pub fn of_founders(founders: &BTreeMap<NodeId, String>) -> ClusterId {
        let mut text = String::new();
        for (id, addr) in founders {
            text.push_str(&format!("{id}={addr};"));
        }
        ClusterId(crate::partition::key_hash(text.as_bytes()))
    }

    fn parse(text: &str) -> Option<ClusterId> {
        let hex = text.trim();
        (hex.len() == 16)
            .then(|| u64::from_str_radix(hex, 16).ok())
            .flatten()
            .map(ClusterId)
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this node belongs to cluster {ours}, the request to cluster {theirs} (a node of another cluster, or one started on another cluster's data, is calling)")]
    OtherCluster { ours: ClusterId, theirs: ClusterId },
    #[error("this node belongs to cluster {ours}; the request names no cluster (its sender runs an earlier release, or is no member yet)")]
    Unnamed { ours: ClusterId },
}

/// A node's cluster id: known (read back, derived or adopted) or not yet, and where it is kept.
pub struct Identity {
    file: PathBuf,
    id: OnceLock<ClusterId>,
    /// Serializes the first write of the file.
    writing: Mutex<()>,
}

impl Identity {
    /// Reads the id kept in `dir`, if any. A file that is there but does not hold an id is an
    /// error: the node must not start as if it belonged to no cluster.
    pub fn open(dir: &Path) -> Result<Identity, String> {
        let file = dir.join(FILE);
        let id = OnceLock::new();
        match fs::read_to_string(&file) {
            Ok(text) => {
                let parsed = ClusterId::parse(&text).ok_or_else(|| {
                    format!(
                        "{} does not hold a cluster id (16 hex digits): {:?}",
                        file.display(),
                        text.chars().take(40).collect::<String>()
                    )
                })?;
                let _ = id.set(parsed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("reading {}: {e}", file.display())),
        }
        Ok(Identity {
            file,
            id,
            writing: Mutex::new(()),
        })
    }

    pub fn get(&self) -> Option<ClusterId> {
        self.id.get().copied()
    }

    /// Makes `id` this node's, durably, unless it has one: returns the id it has after.
    pub fn settle(&self, id: ClusterId) -> Result<ClusterId, String> {
        let _writing = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(known) = self.get() {
            return Ok(known);
        }
        self.file
            .parent()
            .map_or(Ok(()), fs::create_dir_all)
            .and_then(|()| write_file_atomically(&self.file, format!("{id}\n").as_bytes(), 0o644))
            .map_err(|e| format!("writing {}: {e}", self.file.display()))?;
        let _ = self.id.set(id);
        Ok(id)
    }

    /// Whether a request stamped `stamp` may be served here. `adopting`: a Raft request, whose
    /// id a node that has none takes as its own.
    pub fn admit(&self, stamp: Option<ClusterId>, adopting: bool) -> Result<(), Refusal> {
        match (self.get(), stamp) {
            (Some(ours), Some(theirs)) if ours != theirs => {
                Err(Refusal::OtherCluster { ours, theirs })
            }
            (Some(ours), None) => Err(Refusal::Unnamed { ours }),
            (Some(_), Some(_)) | (None, None) => Ok(()),
            (None, Some(theirs)) => {
                if adopting {
                    match self.settle(theirs) {
                        Ok(id) => {
                            tracing::info!(cluster = %id, "this node belongs to cluster {id} (learnt from its first Raft request)")
                        }
                        // Not kept: adopted again by the next request (and served meanwhile, as
                        // before there were ids).
                        Err(e) => tracing::warn!("the cluster id could not be kept: {e}"),
                    }
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn founders(pairs: &[(NodeId, &str)]) -> BTreeMap<NodeId, String> {
        pairs.iter().map(|&(id, a)| (id, a.to_owned())).collect()
    }

    #[test]
    fn founders_agree_and_other_memberships_differ() {
        let a = founders(&[(1, "a:7001"), (2, "b:7001"), (3, "c:7001")]);
        let b = founders(&[(3, "c:7001"), (1, "a:7001"), (2, "b:7001")]);
        assert_eq!(ClusterId::of_founders(&a), ClusterId::of_founders(&b));
        let moved = founders(&[(1, "a:7001"), (2, "b:7001"), (3, "c:7002")]);
        assert_ne!(ClusterId::of_founders(&a), ClusterId::of_founders(&moved));
        let renumbered = founders(&[(1, "a:7001"), (2, "b:7001"), (4, "c:7001")]);
        assert_ne!(
            ClusterId::of_founders(&a),
            ClusterId::of_founders(&renumbered)
        );
    }

    #[test]
    fn an_id_is_kept_across_opens_and_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity::open(dir.path()).unwrap();
        assert_eq!(identity.get(), None);
        assert_eq!(identity.settle(ClusterId(7)), Ok(ClusterId(7)));
        assert_eq!(identity.settle(ClusterId(8)), Ok(ClusterId(7)));
        let again = Identity::open(dir.path()).unwrap();
        assert_eq!(again.get(), Some(ClusterId(7)));
        assert_eq!(
            fs::read_to_string(dir.path().join(FILE)).unwrap(),
            "0000000000000007\n"
        );
    }

    #[test]
    fn a_file_without_an_id_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "xyz", "00000000000000070", "not hex at all!!"] {
            fs::write(dir.path().join(FILE), bad).unwrap();
            let err = Identity::open(dir.path()).err().expect("refused");
            assert!(err.contains("does not hold a cluster id"), "{err}");
        }
    }

    #[test]
    fn requests_of_another_cluster_or_of_none_are_refused_once_the_id_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity::open(dir.path()).unwrap();
        // No id yet: everything passes; a non-Raft request teaches nothing.
        assert_eq!(identity.admit(None, true), Ok(()));
        assert_eq!(identity.admit(Some(ClusterId(5)), false), Ok(()));
        assert_eq!(identity.get(), None);
        // The first Raft request's id is adopted, and kept.
        assert_eq!(identity.admit(Some(ClusterId(5)), true), Ok(()));
        assert_eq!(
            Identity::open(dir.path()).unwrap().get(),
            Some(ClusterId(5))
        );
        assert_eq!(identity.admit(Some(ClusterId(5)), true), Ok(()));
        assert_eq!(
            identity.admit(Some(ClusterId(6)), true),
            Err(Refusal::OtherCluster {
                ours: ClusterId(5),
                theirs: ClusterId(6)
            })
        );
        assert_eq!(
            identity.admit(None, false),
            Err(Refusal::Unnamed { ours: ClusterId(5) })
        );
    }
}
