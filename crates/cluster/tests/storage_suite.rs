//! openraft's own storage test suite, run on our log store and state machine.

use mqstate_cluster::log_store::LogStore;
use mqstate_cluster::state_machine::StateMachineStore;
use mqstate_cluster::types::{StorageError, TypeConfig};
use openraft::testing::{StoreBuilder, Suite};

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // Not `purging_within` a state machine's snapshot, as a node's log is: the suite purges
        // logs no snapshot covers.
        let log = LogStore::open(dir.path()).expect("a fresh Raft log opens");
        let sm = StateMachineStore::open(dir.path())?;
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite_passes() {
    if let Err(e) = Suite::test_all(Builder) {
        panic!("openraft's storage suite failed: {e}");
    }
}
