//! The rules KEYNOTIFY notifications keep, checked over what observers received: per observer and
//! key, versions arrive in order (a repeat of a version already received, as QoS 1 into a
//! persistent session may bring after a reconnect, is not a step back, but it must carry the same
//! change); every notification carries its version (`__ts`); a SET's notification carries the
//! value the SET that got its version wrote; and within one registration (one connection of the
//! observer) no acknowledged SET sent after the registration is missing below the newest version
//! received. Shared by the robustness tool's checker (`crates/robustness/src/checks.rs`, real
//! processes) and the cluster simulation (`crates/node/tests/turmoil_sim.rs`), which convert their
//! own histories into these borrowed views: the values' type is theirs (`V`), instants are places
//! on any one clock that orders a write's invocation against a registration's confirmation.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;

use mqstate_protocol::Hlc;

/// What a notification says happened to the key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Change<V> {
    Set(V),
    Delete,
}

/// One notification an observer received.
#[derive(Debug, Clone)]
pub struct Note<'a, V> {
    pub observer: &'a str,
    /// The observer's connection number: registrations end with a connection (spec §6).
    pub epoch: u32,
    pub key: &'a str,
    pub change: &'a Change<V>,
    /// Its `__ts`; `None` if it came without one (a violation).
    pub version: Option<&'a Hlc>,
}

/// An observer's registration of a key on one connection, confirmed (`+OK`) at `at`.
#[derive(Debug, Clone)]
pub struct Registered<'a> {
    pub observer: &'a str,
    pub epoch: u32,
    pub key: &'a str,
    pub at: u64,
}

/// An acknowledged SET (it returned `+OK` with `version`): operation `id` of the history, invoked
/// at `invoked` (on the registrations' clock), writing `value`.
#[derive(Debug, Clone)]
pub struct Write<'a, V> {
    pub id: usize,
    pub key: &'a str,
    pub invoked: u64,
    pub version: &'a Hlc,
    pub value: &'a V,
}

/// A broken rule: `check` is `notification-order` (order, missing `__ts`, a version received twice
/// with different changes, a wrong value) or `notification-gap`; `ops` are the writes it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub check: &'static str,
    pub key: String,
    pub detail: String,
    pub ops: Vec<usize>,
}

/// The findings of `notes` (in the order they were received, per observer), given the
/// observers' `registrations` and the acknowledged `writes` of the keys.
pub fn check<V: PartialEq + Debug>(
    notes: &[Note<'_, V>],
    registrations: &[Registered<'_>],
    writes: &[Write<'_, V>],
) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut per_observer_key: BTreeMap<(&str, &str), Vec<&Note<'_, V>>> = BTreeMap::new();
    for n in notes {
        per_observer_key
            .entry((n.observer, n.key))
            .or_default()
            .push(n);
    }
    for ((observer, key), received_in_order) in &per_observer_key {
        let writes_of_key: Vec<&Write<'_, V>> = writes.iter().filter(|w| w.key == *key).collect();
        let written: HashMap<&Hlc, &Write<'_, V>> =
            writes_of_key.iter().map(|w| (w.version, *w)).collect();
        let mut previous: Option<&Hlc> = None;
        let mut received: BTreeMap<&Hlc, &Change<V>> = BTreeMap::new();
        for n in received_in_order {
            let Some(version) = n.version else {
                findings.push(order(
                    key,
                    format!("{observer} got a notification without __ts"),
                ));
                continue;
            };
            // QoS 1 into a persistent session is at least once: after a reconnect or a restart
            // the unacknowledged ones come again. A repeat is not a step back.
            if let Some(first) = received.get(version) {
                if *first != n.change {
                    findings.push(order(
                        key,
                        format!("{observer} got version {version} twice with different changes"),
                    ));
                }
                continue;
            }
            received.insert(version, n.change);
            if let (Change::Set(value), Some(w)) = (n.change, written.get(version)) {
                if w.value != value {
                    findings.push(order(key, format!(
                        "{observer} was told version {version} is {value:?}; the SET #{} that got it wrote {:?}",
                        w.id, w.value
                    )));
                }
            }
            if let Some(pv) = previous {
                if version < pv {
                    findings.push(order(
                        key,
                        format!(
                            "{observer} got version {version} after version {pv}: out of order"
                        ),
                    ));
                }
            }
            previous = Some(version);
        }
        // Gaps, per connection (registrations end with it).
        let mut epochs: BTreeMap<u32, Vec<&Hlc>> = BTreeMap::new();
        for n in received_in_order {
            if let Some(v) = n.version {
                epochs.entry(n.epoch).or_default().push(v);
            }
        }
        for (epoch, versions) in epochs {
            let Some(registered) = registrations
                .iter()
                .find(|r| r.observer == *observer && r.key == *key && r.epoch == epoch)
            else {
                continue;
            };
            let Some(last) = versions.iter().max() else {
                continue;
            };
            for w in &writes_of_key {
                if w.invoked > registered.at
                    && w.version < *last
                    && !received.contains_key(w.version)
                {
                    findings.push(Finding {
                        check: "notification-gap",
                        key: (*key).to_owned(),
                        detail: format!(
                            "{observer} (connection {epoch}, registered before SET #{} was sent) saw version {last} but never {}, which that SET got",
                            w.id, w.version
                        ),
                        ops: vec![w.id],
                    });
                }
            }
        }
    }
    findings
}

fn order(key: &str, detail: String) -> Finding {
    Finding {
        check: "notification-order",
        key: key.to_owned(),
        detail,
        ops: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(n: u64) -> Hlc {
        Hlc {
            wall_ms: n,
            counter: 0,
            node_id: "n".into(),
        }
    }

    /// Checks notifications of key `k` to observer `o` — (epoch, value, version) — against three
    /// acknowledged SETs `a`, `b`, `c` at versions 1, 2, 3, invoked after the registration of
    /// epoch 1 (and before that of epoch 2).
    fn checks(received: &[(u32, &str, u64)]) -> Vec<&'static str> {
        let versions = [v(1), v(2), v(3)];
        let values = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let writes: Vec<Write<'_, String>> = (0..3)
            .map(|i| Write {
                id: i,
                key: "k",
                invoked: 100 * (i as u64 + 1),
                version: &versions[i],
                value: &values[i],
            })
            .collect();
        let registrations = [
            Registered {
                observer: "o",
                epoch: 1,
                key: "k",
                at: 50,
            },
            Registered {
                observer: "o",
                epoch: 2,
                key: "k",
                at: 1_000,
            },
        ];
        let changes: Vec<(u32, Change<String>, Hlc)> = received
            .iter()
            .map(|(epoch, value, version)| (*epoch, Change::Set((*value).to_owned()), v(*version)))
            .collect();
        let notes: Vec<Note<'_, String>> = changes
            .iter()
            .map(|(epoch, change, version)| Note {
                observer: "o",
                epoch: *epoch,
                key: "k",
                change,
                version: Some(version),
            })
            .collect();
        check(&notes, &registrations, &writes)
            .iter()
            .map(|f| f.check)
            .collect()
    }

    #[test]
    fn repeated_notifications_after_a_reconnect_are_not_out_of_order() {
        let again = [
            (1, "a", 1),
            (1, "b", 2),
            (2, "a", 1),
            (2, "b", 2),
            (2, "c", 3),
        ];
        assert_eq!(checks(&again), Vec::<&str>::new());
    }

    #[test]
    fn a_missing_reordered_or_wrong_notification_is_reported() {
        assert_eq!(checks(&[(1, "a", 1), (1, "c", 3)]), ["notification-gap"]);
        assert_eq!(
            checks(&[(1, "a", 1), (1, "c", 3), (1, "b", 2)]),
            ["notification-order"]
        );
        assert_eq!(
            checks(&[(1, "a", 1), (1, "x", 2), (1, "c", 3)]),
            ["notification-order"]
        );
        assert_eq!(
            checks(&[(1, "a", 1), (1, "b", 2), (1, "c", 3), (1, "x", 3)]),
            ["notification-order"]
        );
        // Registered after every SET was sent: the missing one is not owed on that connection.
        assert_eq!(checks(&[(2, "a", 1), (2, "c", 3)]), Vec::<&str>::new());
    }
}
