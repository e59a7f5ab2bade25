//! The changes of observed keys as this replica persisted them (decision 0061): every replica of a
//! chain persists every write, so whichever of them survives a head holds the changes that head
//! committed, whether or not it handed them to the observing nodes. A node whose observers got a
//! change whose predecessor they never got asks the key's replicas for the changes in between
//! ([`Trail::between`]). Pure (no I/O, no clock of its own); memory only, bounded.
//!
//! Each entry is linked to the entry before it for its key (`prev`): the row this replica held for
//! the key before. Replicas persist a key's rows in the chain's order, so the links follow the
//! chain's versions, except across what this replica did not see — a write while the key was not
//! observed (the key's entries are dropped: the next has no link), a re-entry at the tail
//! ([`Trail::clear`]: the partition's entries go), a restart (only what the chain log replays
//! after its snapshot is noted again, [`Trail::note_replayed`]), the bounds. A walk
//! back over the links that reaches the version asked for therefore has every change in between;
//! one that breaks off answers nothing.

use std::collections::{HashMap, VecDeque};

use mqstate_chain::Record;

use mqstate_protocol::Hlc;

use crate::rows;
use crate::wire::{Committed, Reach};

/// Entries older than this go (the observing node asks within its hold, a few seconds).
pub const KEEP_MS: u64 = 60_000;
/// Entries per key, at most (the oldest go first).
pub const KEEP_PER_KEY: usize = 8_192;
/// Bytes of keys and values kept, at most: beyond it a key's new entries are not kept (and its
/// older ones dropped, so that no link skips a change).
pub const KEEP_BYTES: usize = 64 << 20;
/// Sweeps of old entries happen at most this often.
const SWEEP_EVERY_MS: u64 = 1_000;

#[derive(Default)]
pub struct Trail {
    keys: HashMap<Vec<u8>, Kept>,
    bytes: usize,
    next_sweep_ms: u64,
}

struct Kept {
    partition: u32,
    /// Oldest first; each `change.prev` is the version of the entry before it (as persisted here).
    entries: VecDeque<(u64, Committed)>,
}

fn size(change: &Committed) -> usize {
    change.key.len() + change.version.len() + change.value.as_ref().map_or(0, Vec::len)
}

impl Trail {
    /// Notes the rows `records` persist to this replica of `partition`; `observed` says whether a
    /// key's changes may be wanted by some node.
    pub fn note(
        &mut self,
        partition: u32,
        records: &[Record],
        now_ms: u64,
        observed: impl Fn(&[u8]) -> bool,
    ) {
        self.note_rows(partition, records, |key, value| {
            if !observed(key) {
                return None;
            }
            let delta = rows::delta_of(value).ok()?;
            Some((rows::committed(&delta), now_ms))
        });
        self.sweep(now_ms, observed);
    }

    /// Notes the rows a restarted replica's chain log replays (what it persisted after the log's
    /// snapshot, in order), so that the changes it persisted before the restart can still be
    /// fetched: with replication factor 3, a change was lost to the observers whenever the head
    /// died and the other replicas restarted after persisting it (robustness seed 400550). Any
    /// key's (this process knows nobody's interest yet); only the changes younger than
    /// [`KEEP_MS`] by their version, aged from it. The first change of a key after the snapshot
    /// has no link.
    pub fn note_replayed(&mut self, partition: u32, records: &[Record], now_ms: u64) {
        self.note_rows(partition, records, |_, value| {
            let delta = rows::delta_of(value).ok()?;
            let at_ms = delta.version().wall_ms.min(now_ms);
            (at_ms.saturating_add(KEEP_MS) > now_ms).then(|| (rows::committed(&delta), at_ms))
        });
    }

    /// Each row of `records` whose change `kept` returns (with the time it is aged from) is
    /// linked after its key's last; any other row breaks its key's trail (the next change noted
    /// has no link). A replica's re-entry clears its partition.
    fn note_rows(
        &mut self,
        partition: u32,
        records: &[Record],
        kept: impl Fn(&[u8], &[u8]) -> Option<(Committed, u64)>,
    ) {
        for record in records {
            match record {
                Record::Row { key, row } => {
                    match row.value.as_deref().and_then(|value| kept(key, value)) {
                        Some((change, at_ms)) => self.push(partition, change, at_ms),
                        None => self.forget(key),
                    }
                }
                Record::Clear { .. } => self.clear(partition),
                Record::CaughtUp { .. } | Record::Readable | Record::Note { .. } => {}
            }
        }
    }

    fn push(&mut self, partition: u32, mut change: Committed, now_ms: u64) {
        let kept = self.keys.entry(change.key.clone()).or_insert_with(|| Kept {
            partition,
            entries: VecDeque::new(),
        });
        let last = kept.entries.back().map(|(_, c)| c.version.clone());
        // Phase 2 persists the row again, unlocked: the same change.
        if last.as_deref() == Some(change.version.as_str()) {
            return;
        }
        if self.bytes + size(&change) > KEEP_BYTES {
            let key = change.key;
            return self.forget(&key);
        }
        change.prev = last;
        self.bytes += size(&change);
        kept.partition = partition;
        kept.entries.push_back((now_ms, change));
        while kept.entries.len() > KEEP_PER_KEY {
            if let Some((_, old)) = kept.entries.pop_front() {
                self.bytes -= size(&old);
            }
        }
    }

    /// The key's entries go: the next one noted has no link.
    fn forget(&mut self, key: &[u8]) {
        if let Some(kept) = self.keys.remove(key) {
            self.bytes -= kept.entries.iter().map(|(_, c)| size(c)).sum::<usize>();
        }
    }

    /// This replica re-entered its chain: what it held of `partition` is void.
    pub fn clear(&mut self, partition: u32) {
        let bytes = &mut self.bytes;
        self.keys.retain(|_, kept| {
            let keep = kept.partition != partition;
            if !keep {
                *bytes -= kept.entries.iter().map(|(_, c)| size(c)).sum::<usize>();
            }
            keep
        });
    }

    /// Drops the entries older than [`KEEP_MS`], except the newest of a key still observed: the
    /// link of its next change (a session that moved catches up from it, decision 0065).
    fn sweep(&mut self, now_ms: u64, observed: impl Fn(&[u8]) -> bool) {
        if now_ms < self.next_sweep_ms {
            return;
        }
        self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
        let bytes = &mut self.bytes;
        self.keys.retain(|key, kept| {
            let keep_last = usize::from(observed(key));
            while kept.entries.len() > keep_last
                && kept
                    .entries
                    .front()
                    .is_some_and(|(at, _)| at.saturating_add(KEEP_MS) <= now_ms)
            {
                if let Some((_, old)) = kept.entries.pop_front() {
                    *bytes -= size(&old);
                }
            }
            !kept.entries.is_empty()
        });
    }

    /// The changes of `key` after version `after` up to version `until`, in order, if this replica
    /// holds every one of them; `None` if its links break off before `after`. An empty `after`
    /// asks for every change up to `until` since the first this replica noted (an observer that
    /// started observing the key before it had a row: decision 0065).
    pub fn between(&self, key: &[u8], after: &str, until: &str) -> Option<Vec<Committed>> {
        let kept = self.keys.get(key)?;
        let mut found = Vec::new();
        let mut target = until.to_owned();
        while target != after {
            let (_, change) = kept
                .entries
                .iter()
                .rev()
                .find(|(_, c)| c.version == target)?;
            found.push(change.clone());
            match &change.prev {
                Some(prev) => target = prev.clone(),
                None if after.is_empty() => break,
                None => return None,
            }
        }
        found.reverse();
        Some(found)
    }

    /// The changes of `key` from `until` back towards `after` (exclusive) as far as this
    /// replica's links go ([`Reach`]).
    pub fn reach(&self, key: &[u8], after: &str, until: &str) -> Reach {
        let mut reach = Reach::default();
        let Some(kept) = self.keys.get(key) else {
            return reach;
        };
        let after_hlc = Hlc::parse(after).ok();
        let mut target = until.to_owned();
        loop {
            if target == after {
                reach.whole = true;
                break;
            }
            let Some((_, change)) = kept.entries.iter().rev().find(|(_, c)| c.version == target)
            else {
                break;
            };
            let at_or_before = Hlc::parse(&change.version)
                .ok()
                .zip(after_hlc.as_ref())
                .is_some_and(|(version, after)| version <= *after);
            if at_or_before {
                break;
            }
            reach.changes.push(change.clone());
            match &change.prev {
                Some(prev) => target = prev.clone(),
                None => {
                    reach.unlinked = true;
                    break;
                }
            }
        }
        reach.changes.reverse();
        reach
    }

    /// The version of the change persisted here before `version` of `key`, if this replica
    /// holds both.
    pub fn prev_of(&self, key: &[u8], version: &str) -> Option<String> {
        let kept = self.keys.get(key)?;
        let (_, change) = kept
            .entries
            .iter()
            .rev()
            .find(|(_, c)| c.version == version)?;
        change.prev.clone()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys.values().map(|k| k.entries.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use mqstate_chain::{Row, Version};
    use mqstate_protocol::Hlc;
    use mqstate_store::{Change, Delta};

    use super::*;

    fn hlc(n: u64) -> Hlc {
        Hlc::new(1_700_000_000_000 + n, 0, Arc::from("mqstate"))
    }

    fn row(key: &str, n: u64, locked: bool) -> Record {
        let delta = Delta::Put {
            key: Bytes::copy_from_slice(key.as_bytes()),
            value: Bytes::from(format!("v{n}")),
            version: hlc(n),
            fencing_token: None,
            expires_at_ms: None,
        };
        Record::Row {
            key: key.as_bytes().to_vec(),
            row: Row {
                value: Some(Change::Key(delta).encode().unwrap()),
                version: Version {
                    wall_ms: n,
                    counter: 0,
                    node: 1,
                },
                view: 1,
                locked,
            },
        }
    }

    fn v(n: u64) -> String {
        hlc(n).to_string()
    }

    fn versions(changes: &[Committed]) -> Vec<String> {
        changes.iter().map(|c| c.version.clone()).collect()
    }

    #[test]
    fn the_changes_between_two_versions_come_back_in_order_once_each() {
        let mut trail = Trail::default();
        let records: Vec<Record> = (1..=4)
            .flat_map(|n| [row("k", n, true), row("k", n, false)])
            .collect();
        trail.note(0, &records, 0, |_| true);
        assert_eq!(
            trail.len(),
            4,
            "phase 2's second persist is the same change"
        );
        let between = trail.between(b"k", &v(1), &v(3)).unwrap();
        assert_eq!(versions(&between), [v(2), v(3)]);
        assert_eq!(between[0].prev, Some(v(1)));
        assert_eq!(trail.between(b"k", &v(3), &v(3)), Some(Vec::new()));
        assert_eq!(trail.prev_of(b"k", &v(4)), Some(v(3)));
        // Before the first entry here: the walk breaks off.
        assert_eq!(trail.between(b"k", &v(0), &v(3)), None);
        assert_eq!(trail.between(b"other", &v(0), &v(3)), None);
    }

    #[test]
    fn an_empty_start_asks_for_everything_since_the_first_change_noted() {
        let mut trail = Trail::default();
        trail.note(0, &[row("k", 1, false), row("k", 2, false)], 0, |_| true);
        let all = trail.between(b"k", "", &v(2)).unwrap();
        assert_eq!(versions(&all), [v(1), v(2)]);
        // Once the first change went (too old), the links break off before it: nothing.
        trail.note(0, &[row("k", 3, false)], KEEP_MS + 1, |_| true);
        assert_eq!(trail.between(b"k", "", &v(3)), None);
    }

    #[test]
    fn a_reach_goes_back_as_far_as_the_links_go() {
        let mut trail = Trail::default();
        // Change 1 was written while nobody observed the key: 2 is the first noted, unlinked.
        trail.note(0, &[row("k", 1, false)], 0, |_| false);
        trail.note(0, &[row("k", 2, false), row("k", 3, false)], 0, |_| true);
        let reach = trail.reach(b"k", &v(1), &v(3));
        assert_eq!(versions(&reach.changes), [v(2), v(3)]);
        assert!(!reach.whole && reach.unlinked);
        let reach = trail.reach(b"k", &v(2), &v(3));
        assert_eq!(versions(&reach.changes), [v(3)]);
        assert!(reach.whole);
        assert_eq!(trail.reach(b"k", &v(1), &v(9)), Reach::default());
        // An idle observed key keeps its newest change past the age bound: its next one links.
        trail.note(0, &[], KEEP_MS * 2, |_| true);
        trail.note(0, &[row("k", 4, false)], KEEP_MS * 2, |_| true);
        assert_eq!(
            versions(&trail.between(b"k", &v(3), &v(4)).unwrap()),
            [v(4)]
        );
        // Another key's old entries all go once nobody observes it.
        trail.note(1, &[row("j", 1, false)], KEEP_MS * 2, |_| true);
        trail.note(1, &[], KEEP_MS * 4, |key| key == b"k");
        assert_eq!(trail.len(), 1);
    }

    #[test]
    fn a_change_missed_here_breaks_the_links() {
        let mut trail = Trail::default();
        trail.note(0, &[row("k", 1, false)], 0, |_| true);
        // Written while nobody observed the key: not kept, and the links start over.
        trail.note(0, &[row("k", 2, false)], 0, |_| false);
        trail.note(0, &[row("k", 3, false)], 0, |_| true);
        assert_eq!(trail.between(b"k", &v(1), &v(3)), None);
        assert_eq!(trail.prev_of(b"k", &v(3)), None);

        // A re-entry at the tail voids the partition's entries, not the others'.
        trail.note(1, &[row("j", 1, false)], 0, |_| true);
        trail.note(0, &[Record::Clear { view: 2 }], 0, |_| true);
        assert_eq!(trail.len(), 1);
        trail.note(0, &[row("k", 4, false)], 0, |_| true);
        assert_eq!(trail.prev_of(b"k", &v(4)), None);
    }

    #[test]
    fn old_entries_go() {
        let mut trail = Trail::default();
        trail.note(0, &[row("k", 1, false)], 0, |_| true);
        trail.note(0, &[row("k", 2, false)], KEEP_MS / 2, |_| true);
        trail.note(0, &[row("k", 3, false)], KEEP_MS + 1, |_| true);
        assert_eq!(trail.len(), 2);
        // 1 is gone: what came after it is still all here, what came before it no more.
        assert_eq!(
            versions(&trail.between(b"k", &v(1), &v(3)).unwrap()),
            [v(2), v(3)]
        );
        assert_eq!(trail.between(b"k", &v(0), &v(3)), None);
        assert_eq!(
            trail.bytes,
            trail
                .keys
                .values()
                .flat_map(|k| &k.entries)
                .map(|(_, c)| size(c))
                .sum::<usize>()
        );
    }
}
