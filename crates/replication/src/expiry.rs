//! Expiry on chains: keys with PX expire at their partition's head, and the delete goes through
//! the chain like a DEL (with its notification). The head keeps the deadlines of the rows it wrote
//! or found when it took the partition over ([`Deadlines`]); when one passes it re-reads the row
//! and, if it is still that expired value, writes the store's own expiry delete ([`delete_of`])
//! with the version it read as the condition. A deadline that is stale (the key was written again,
//! deleted, or this node is no longer the head) costs one read and is dropped.

use std::collections::BTreeSet;
use std::sync::Mutex;

use mqstate_protocol::Hlc;
use mqstate_store::{Change, Delta, StateMachine, StoreConfig};

/// Deadlines of the rows this node is head for: (deadline ms, partition, key), earliest first.
#[derive(Default)]
pub struct Deadlines(Mutex<BTreeSet<(u64, u32, Vec<u8>)>>);

impl Deadlines {
    pub fn schedule(&self, partition: u32, key: Vec<u8>, deadline_ms: u64) {
        self.lock().insert((deadline_ms, partition, key));
    }

    /// Takes the entries due at `now_ms`, at most `max`.
    pub fn take_due(&self, now_ms: u64, max: usize) -> Vec<(u32, Vec<u8>)> {
        let mut due = self.lock();
        let mut taken = Vec::new();
        while taken.len() < max {
            match due.first() {
                Some((deadline, _, _)) if *deadline <= now_ms => {}
                _ => break,
            }
            if let Some((_, partition, key)) = due.pop_first() {
                taken.push((partition, key));
            }
        }
        taken
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(u64, u32, Vec<u8>)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The expiry delete of the row `row` (a store record) at `now_ms`, as the store makes it (a
/// fresh version above the row's and `floor`): `None` if the row holds no value expired by then.
/// The new row (the encoded delete) and the delete.
pub fn delete_of(
    store: &StoreConfig,
    row: &[u8],
    now_ms: u64,
    floor: Option<&Hlc>,
) -> Option<(Vec<u8>, Delta)> {
    let change = Change::decode(row).ok()?;
    let mut machine = StateMachine::new(store.clone()).ok()?;
    if let Some(floor) = floor {
        machine.observe_clock(floor);
    }
    machine.apply_change(&change);
    let expiration = machine.expire_due(now_ms).into_iter().next()?;
    let value = Change::Key(expiration.delta.clone()).encode().ok()?;
    Some((value, expiration.delta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mqstate_store::Limits;
    use std::sync::Arc;

    #[test]
    fn deadlines_come_due_in_order() {
        let d = Deadlines::default();
        d.schedule(1, b"b".to_vec(), 20);
        d.schedule(0, b"a".to_vec(), 10);
        d.schedule(2, b"c".to_vec(), 30);
        assert_eq!(d.take_due(5, 10), vec![]);
        assert_eq!(d.take_due(25, 1), vec![(0, b"a".to_vec())]);
        assert_eq!(d.take_due(25, 10), vec![(1, b"b".to_vec())]);
        assert_eq!(d.len(), 1);
    }

    #[test]
    fn only_an_expired_value_is_deleted_above_its_version() {
        let store = StoreConfig {
            node_id: "mqstate".into(),
            limits: Limits::default(),
        };
        let version = Hlc::new(1_000, 3, Arc::from("mqstate"));
        let row = Change::Key(Delta::Put {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
            version: version.clone(),
            fencing_token: None,
            expires_at_ms: Some(2_000),
        })
        .encode()
        .unwrap();
        assert!(delete_of(&store, &row, 1_999, None).is_none());
        let (value, delta) = delete_of(&store, &row, 2_000, None).unwrap();
        assert!(
            matches!(&delta, Delta::Delete { key, version: v } if key.as_ref() == b"k" && *v > version)
        );
        assert_eq!(Change::decode(&value).unwrap(), Change::Key(delta.clone()));
        // Above a floor handed out before.
        let floor = Hlc::new(5_000, 0, Arc::from("mqstate"));
        let (_, later) = delete_of(&store, &row, 2_000, Some(&floor)).unwrap();
        assert!(*later.version() > floor);
        // A deleted row has nothing to expire.
        assert!(delete_of(&store, &value, 9_000, None).is_none());
    }
}
