//! SCAN on a cluster node: every partition's head scans its rows after the cursor (a part), the
//! node that received the request merges the parts into one page with the single node's reply
//! format and cursor rule (the continuation is the last key examined, so keys deleted behind it
//! cannot come back). Pure; the fan-out is in the crate root.

use std::collections::BTreeMap;
use std::ops::Bound;

use mqstate_chain::{Key, Row};
use mqstate_protocol::Glob;

use crate::rows;
use crate::wire::{PartScan, ScanPage};

/// One partition's part of `page`, from the head's rows at `now_ms`: the live keys matching the
/// pattern after the cursor, at most `page_keys` of them and `visit_max` rows examined. A locked
/// row counts with the value being written (the write is on its way through the chain).
pub fn part(rows: &BTreeMap<Key, Row>, glob: &Glob, page: &ScanPage, now_ms: u64) -> PartScan {
    let start = match &page.after {
        Some(after) => Bound::Excluded(after.clone()),
        None => Bound::Unbounded,
    };
    let mut keys = Vec::new();
    let mut visited = 0u32;
    let mut range = rows.range((start, Bound::Unbounded)).peekable();
    while let Some((key, row)) = range.next() {
        visited += 1;
        let live = row
            .value
            .as_deref()
            .and_then(|value| rows::delta_of(value).ok())
            .is_some_and(|delta| rows::is_live(&delta, now_ms));
        if live && glob.matches(key) {
            keys.push(key.clone());
        }
        let full = keys.len() >= page.page_keys as usize || visited >= page.visit_max;
        if full {
            let stopped_at = range.peek().is_some().then(|| key.clone());
            return PartScan { keys, stopped_at };
        }
    }
    PartScan {
        keys,
        stopped_at: None,
    }
}

/// The page the client gets from every partition's part: keys in order, at most `page_keys`, and
/// the continuation (`None`: this was the last page). Nothing after the earliest point where a
/// part stopped is answered, so the next page (after the continuation) misses no key.
pub fn merge(parts: Vec<PartScan>, page_keys: usize) -> (Vec<Key>, Option<Key>) {
    let bound = parts.iter().filter_map(|p| p.stopped_at.clone()).min();
    let mut keys: Vec<Key> = parts
        .into_iter()
        .flat_map(|p| p.keys)
        .filter(|key| bound.as_ref().is_none_or(|bound| key <= bound))
        .collect();
    keys.sort();
    keys.dedup();
    if keys.len() > page_keys {
        keys.truncate(page_keys);
        let last = keys.last().cloned();
        return (keys, last);
    }
    (keys, bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mqstate_chain::Version;
    use mqstate_protocol::Hlc;
    use mqstate_store::{Change, Delta};
    use std::sync::Arc;

    fn row(key: &str, expires_at_ms: Option<u64>, deleted: bool) -> (Key, Row) {
        let version = Hlc::new(1, 0, Arc::from("n"));
        let delta = if deleted {
            Delta::Delete {
                key: Bytes::copy_from_slice(key.as_bytes()),
                version,
            }
        } else {
            Delta::Put {
                key: Bytes::copy_from_slice(key.as_bytes()),
                value: Bytes::from_static(b"v"),
                version,
                fencing_token: None,
                expires_at_ms,
            }
        };
        let row = Row {
            value: Some(Change::Key(delta).encode().unwrap()),
            version: Version {
                wall_ms: 1,
                counter: 0,
                node: 1,
            },
            view: 1,
            locked: false,
        };
        (key.as_bytes().to_vec(), row)
    }

    fn page(after: Option<&str>, page_keys: u32, visit_max: u32) -> ScanPage {
        ScanPage {
            pattern: b"*".to_vec(),
            after: after.map(|a| a.as_bytes().to_vec()),
            page_keys,
            visit_max,
        }
    }

    fn text(keys: &[Key]) -> Vec<String> {
        keys.iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect()
    }

    #[test]
    fn a_part_skips_dead_rows_and_says_where_it_stopped() {
        let rows: BTreeMap<Key, Row> = [
            row("a", None, false),
            row("b", Some(10), false),
            row("c", None, true),
            row("d", None, false),
            row("e", None, false),
        ]
        .into_iter()
        .collect();
        let glob = Glob::new(b"*").unwrap();
        let all = part(&rows, &glob, &page(None, 10, 100), 20);
        assert_eq!(text(&all.keys), ["a", "d", "e"]);
        assert_eq!(all.stopped_at, None);
        let two = part(&rows, &glob, &page(None, 2, 100), 20);
        assert_eq!(text(&two.keys), ["a", "d"]);
        assert_eq!(two.stopped_at.as_deref(), Some(b"d".as_slice()));
        let visits = part(&rows, &glob, &page(Some("a"), 10, 2), 20);
        assert_eq!(text(&visits.keys), Vec::<String>::new());
        assert_eq!(visits.stopped_at.as_deref(), Some(b"c".as_slice()));
        // Before its deadline, b is live.
        assert_eq!(
            text(&part(&rows, &glob, &page(None, 10, 100), 5).keys),
            ["a", "b", "d", "e"]
        );
    }

    #[test]
    fn merged_pages_miss_nothing_and_repeat_nothing() {
        // Three partitions' keys; walk pages of 2 through them with small visit limits.
        let partitions: Vec<BTreeMap<Key, Row>> = [
            vec!["a", "d", "g", "j"],
            vec!["b", "e", "h"],
            vec!["c", "f", "i", "k", "l"],
        ]
        .iter()
        .map(|keys| keys.iter().map(|k| row(k, None, false)).collect())
        .collect();
        let glob = Glob::new(b"*").unwrap();
        let mut seen = Vec::new();
        let mut after: Option<Key> = None;
        for _ in 0..20 {
            let p = ScanPage {
                after: after.clone(),
                ..page(None, 2, 3)
            };
            let parts = partitions
                .iter()
                .map(|rows| part(rows, &glob, &p, 0))
                .collect();
            let (keys, next) = merge(parts, 2);
            assert!(keys.len() <= 2);
            seen.extend(keys);
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(
            text(&seen),
            ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"]
        );
    }
}
