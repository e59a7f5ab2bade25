//! openraft's state machine: the applied [`ControlState`], shared with the node that reads it, and
//! its snapshots (kept in `<dir>/raft.snapshot`, replaced atomically, so the log they cover can be
//! purged).

use mqstate_wal::layout::write_file_atomically;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use openraft::storage::{RaftStateMachine, Snapshot, SnapshotMeta};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::control::{ControlState, Outcome};
use crate::types::{storage_error, Entry, LogId, StorageError, StoredMembership, TypeConfig};
use crate::NodeId;

const SNAPSHOT_FILE: &str = "raft.snapshot";

type Meta = SnapshotMeta<NodeId, openraft::BasicNode>;

/// What the log has made of the control state so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    pub state: ControlState,
}

/// The applied state, readable by the node while Raft applies.
#[derive(Debug, Clone, Default)]
pub struct SharedState(Arc<RwLock<Applied>>);

impl SharedState {
    pub fn read(&self) -> RwLockReadGuard<'_, Applied> {
        // Writers replace whole values; a panic mid-apply leaves a consistent (if older) state.
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Applied> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: Meta,
    data: Vec<u8>,
}

/// The state machine store.
#[derive(Debug, Clone)]
pub struct StateMachineStore {
    state: SharedState,
    dir: PathBuf,
    /// Shared with the snapshot builders openraft gets (clones of this store).
    current: Arc<Mutex<Current>>,
    /// The last log id the snapshot on disk covers: what the log may be purged up to
    /// ([`StateMachineStore::snapshot_covers`]).
    covered: Arc<watch::Sender<Option<LogId>>>,
}

#[derive(Debug, Default)]
struct Current {
    snapshot: Option<StoredSnapshot>,
    built: u64,
}

impl StateMachineStore {
    /// Opens the store in `dir`, starting from the snapshot there if any.
    #[allow(clippy::result_large_err)] // openraft's own error type, as its traits return
    pub fn open(dir: &Path) -> Result<StateMachineStore, StorageError> {
        std::fs::create_dir_all(dir).map_err(storage_error::read_snapshot)?;
        let path = dir.join(SNAPSHOT_FILE);
        let (current, applied) = match std::fs::read(&path) {
            Ok(bytes) => {
                let stored: StoredSnapshot = postcard::from_bytes(&bytes).map_err(|e| {
                    storage_error::read_snapshot(format!(
                        "the control-plane snapshot {} does not decode: {e}",
                        path.display()
                    ))
                })?;
                let applied: Applied = postcard::from_bytes(&stored.data).map_err(|e| {
                    storage_error::read_snapshot(format!(
                        "the control-plane snapshot {} holds no state: {e}",
                        path.display()
                    ))
                })?;
                (Some(stored), applied)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, Applied::default()),
            Err(e) => return Err(storage_error::read_snapshot(e)),
        };
        let covered = current.as_ref().and_then(|s| s.meta.last_log_id);
        Ok(StateMachineStore {
            covered: Arc::new(watch::Sender::new(covered)),
            state: SharedState(Arc::new(RwLock::new(applied))),
            dir: dir.to_owned(),
            current: Arc::new(Mutex::new(Current {
                snapshot: current,
                built: 0,
            })),
        })
    }

    fn current(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn shared(&self) -> SharedState {
        self.state.clone()
    }

    /// Watches the last log id the snapshot on disk covers, for the log store to purge no further
    /// ([`crate::log_store::LogStore::purging_within`]).
    pub fn snapshot_covers(&self) -> watch::Receiver<Option<LogId>> {
        self.covered.subscribe()
    }

    /// Writes `snapshot` over the old one atomically (`write_file_atomically`).
    /// Called with the `current` lock held: one temp file, one writer.
    #[allow(clippy::result_large_err)] // openraft's own error type, as its traits return
    fn persist(&self, snapshot: &StoredSnapshot) -> Result<(), StorageError> {
        let bytes = postcard::to_allocvec(snapshot).map_err(storage_error::write_snapshot)?;
        let path = self.dir.join(SNAPSHOT_FILE);
        write_file_atomically(&path, &bytes, 0o644).map_err(|e| {
            storage_error::write_snapshot(format!("cannot write {}: {e}", path.display()))
        })?;
        let last = snapshot.meta.last_log_id;
        self.covered.send_if_modified(|covered| {
            let newer = last > *covered;
            if newer {
                *covered = last;
            }
            newer
        });
        Ok(())
    }

    fn to_snapshot(stored: &StoredSnapshot) -> Snapshot<TypeConfig> {
        Snapshot {
            meta: stored.meta.clone(),
            snapshot: Box::new(Cursor::new(stored.data.clone())),
        }
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // openraft runs this in a task of its own, beside an install: the state is read and the
        // file written under the lock an install holds, so neither the file nor `current` ever
        // goes back to a state older than one installed (the log it covers may be purged by then).
        let mut current = self.current();
        let (data, last_log_id, last_membership) = {
            let applied = self.state.read();
            let data = postcard::to_allocvec(&*applied).map_err(storage_error::write_snapshot)?;
            (data, applied.last_applied, applied.membership.clone())
        };
        current.built += 1;
        let snapshot_id = match last_log_id {
            Some(id) => format!("{}-{}-{}", id.leader_id.term, id.index, current.built),
            None => format!("none-{}", current.built),
        };
        let stored = StoredSnapshot {
            meta: Meta {
                last_log_id,
                last_membership,
                snapshot_id,
            },
            data,
        };
        self.persist(&stored)?;
        let snapshot = Self::to_snapshot(&stored);
        current.snapshot = Some(stored);
        Ok(snapshot)
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.state.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut applied = self.state.write();
        let mut outcomes = Vec::new();
        for entry in entries {
            applied.last_applied = Some(entry.log_id);
            let outcome = match entry.payload {
                EntryPayload::Blank => Outcome::Done,
                EntryPayload::Normal(command) => applied.state.apply(&command),
                EntryPayload::Membership(membership) => {
                    let members = membership
                        .nodes()
                        .map(|(id, node)| (*id, node.addr.clone()))
                        .collect();
                    applied.state.set_members(&members);
                    applied.membership = StoredMembership::new(Some(entry.log_id), membership);
                    Outcome::Done
                }
            };
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let applied: Applied = postcard::from_bytes(&data).map_err(|e| {
            storage_error::read_snapshot(format!("a received snapshot does not decode: {e}"))
        })?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        // Under the lock a build holds from reading the state to writing the file (see
        // `build_snapshot`).
        let mut current = self.current();
        self.persist(&stored)?;
        *self.state.write() = Applied {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            ..applied
        };
        current.snapshot = Some(stored);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        Ok(self.current().snapshot.as_ref().map(Self::to_snapshot))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, RaftSnapshotBuilder};

    use super::*;

    fn log_id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(1, 0), index)
    }

    /// A snapshot received from the leader, as openraft hands it to `install_snapshot`.
    fn received(index: u64) -> (Meta, Box<Cursor<Vec<u8>>>) {
        let applied = Applied {
            last_applied: Some(log_id(index)),
            ..Applied::default()
        };
        let meta = Meta {
            last_log_id: Some(log_id(index)),
            last_membership: StoredMembership::default(),
            snapshot_id: format!("leader-{index}"),
        };
        let data = postcard::to_allocvec(&applied).unwrap();
        (meta, Box::new(Cursor::new(data)))
    }

    /// openraft builds snapshots in a task of their own, beside the state machine worker that
    /// installs one received from the leader (after which openraft purges the log it covers). A
    /// build that read the state before the install must not replace the installed snapshot with
    /// its older one, in memory or on disk: a restart would then start from a snapshot older than
    /// the purged log, below entries this node acknowledged.
    #[test]
    fn a_build_racing_an_install_never_replaces_the_installed_snapshot_with_an_older_one() {
        const INSTALLS: u64 = 200;
        let dir = tempfile::tempdir().unwrap();
        let mut machine = StateMachineStore::open(dir.path()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let builder = {
            let mut builder = machine.clone();
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    rt.block_on(builder.build_snapshot()).unwrap();
                }
            })
        };
        for index in 1..=INSTALLS {
            let (meta, data) = received(index);
            rt.block_on(machine.install_snapshot(&meta, data)).unwrap();
            let current = rt
                .block_on(machine.get_current_snapshot())
                .unwrap()
                .unwrap();
            assert!(
                current.meta.last_log_id >= Some(log_id(index)),
                "snapshot {:?} after installing {index}",
                current.meta.last_log_id
            );
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        builder.join().unwrap();
        let reopened = StateMachineStore::open(dir.path()).unwrap();
        assert_eq!(
            reopened.state.read().last_applied,
            Some(log_id(INSTALLS)),
            "the snapshot on disk is the newest"
        );
    }
}
