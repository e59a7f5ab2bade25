//! The requests each partition executed lately, as this replica's own rows recorded them: a retry
//! that reaches a head after later writes replaced the row its first execution made still gets
//! its first reply, not a second execution (decision 0050).
//!
//! A row's value carries the identity, deadline and first reply of the request that made it
//! ([`mqstate_store::RequestRecord`]); the row itself only remembers the last one. Every replica
//! notes each row it persists here, so whichever replica becomes head knows what the chain ran
//! before it, however many writes followed. Entries live until the request's own deadline (after
//! it a retry is a new request), at most [`KEEP_AT_MOST_MS`].
//!
//! A restarted replica gets them back from its chain log: the requests of every row the replay
//! folds, and those the log's last snapshot held ([`Recent::live`] when it was taken; the snapshot
//! keeps each key's last row only).
//!
//! A write that ran and changed nothing (a SET NX that found the key, a DEL of no key) makes no
//! row: its head notes it here itself ([`Recent::remember`]), so a late copy of the request
//! (a front end still trying a head its client had given up on, and resent to) gets the first
//! reply, not a second run that may then apply (cluster simulation seed 61). Only that head knows
//! it (and the members a re-entered replica asks): a fail-over between the two copies forgets it.
//!
//! Invariant: an entry stands for a row this replica holds durably or is making durable, or for a
//! reply it gave as head on a committed row, never for a row it voided. A re-entry at the tail
//! ([`Record::Clear`]) voids the partition's rows, so it forgets the partition's entries too: a
//! write that was never committed must not answer a retry.
//! A hit is only a reply once the key's row is committed at the head (the caller reads the key
//! first, which flushes an interrupted write through the chain).
//!
//! A replica that re-entered therefore starts with nothing, though the chain ran requests it may
//! be asked about once it is head (robustness seed 70169: a head that had re-entered ran a retry a
//! second time). Until it has the entries of the other members of its chain ([`Recent::export`],
//! merged by [`Recent::import`]), the partition is *unsynced*: it must not execute as head, which
//! [`Recent::first_reply`] answers [`Unsynced`]. Once the longest a request is remembered has
//! passed since the re-entry, nothing it could have missed matters, and it is synced by itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use bytes::Bytes;
use mqstate_chain::{Record, Restored, Row};
use mqstate_protocol::Hlc;
use mqstate_store::{RequestId, RequestRecord};
use serde::{Deserialize, Serialize};

/// Entries are kept no longer than this, whatever the request's own expiry says: the cluster's
/// front ends retry for at most 30 s, and a client's own re-send of a request comes well within
/// this (a longer message expiry only stretches how long a row's own record answers).
pub const KEEP_AT_MOST_MS: u64 = 120_000;

/// Entries are kept this much longer than their request's expiry: the head that ran a request and
/// the head that sees its retry judge the time by different clocks, and a request may still start
/// a little past its deadline ([`crate::head::DEADLINE_SLACK_MS`]).
pub const CLOCK_MARGIN_MS: u64 = 10_000;

/// Sweeps of expired entries happen at most this often per partition.
const SWEEP_EVERY_MS: u64 = 1_000;

/// A replica that re-entered its chain and does not know yet which requests the chain ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsynced;

#[derive(Default)]
pub struct Recent {
    partitions: Mutex<HashMap<u32, Table>>,
}

/// One remembered request as another replica sends it ([`Recent::export`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exported {
    pub id: [u8; 16],
    pub until_ms: u64,
    pub expires_at_ms: u64,
    pub reply: Vec<u8>,
    pub reply_ts: Option<String>,
}

#[derive(Default)]
struct Table {
    /// Request → (kept until, first reply).
    requests: HashMap<RequestId, (u64, RequestRecord)>,
    next_sweep_ms: u64,
    /// Since this replica re-entered at the tail (Unix ms), until the other members' entries are
    /// merged in.
    unsynced_since: Option<u64>,
    /// The view of that re-entry ([`Record::Clear`]): entries exported before a later re-entry
    /// do not sync it.
    cleared_view: u64,
}

impl Recent {
    /// Notes the requests whose rows `records` write to this replica of `partition`.
    pub fn note(&self, partition: u32, records: &[Record], now_ms: u64) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for record in records {
            match record {
                Record::Row { row, .. } => insert(&mut partitions, partition, row, now_ms),
                Record::Clear { view } => {
                    // The sessions' space holds no store records: nothing to sync there.
                    let unsynced_since =
                        (partition & crate::space::SESSIONS == 0).then_some(now_ms);
                    partitions.insert(
                        partition,
                        Table {
                            unsynced_since,
                            cleared_view: *view,
                            ..Table::default()
                        },
                    );
                }
                Record::CaughtUp { .. } | Record::Readable => {}
            }
        }
        if let Some(table) = partitions.get_mut(&partition) {
            table.sweep(now_ms);
        }
    }

    /// Notes `requests` of `partition` that no row this replica persists now records: one this
    /// replica, as head, answered without writing a row; those of the rows its log replayed at
    /// start ([`crate::log::ChainLog::take_replayed_requests`]), so a retry of a request whose row
    /// was replaced before a restart still gets its first reply (cluster simulation seed 56).
    pub fn remember(
        &self,
        partition: u32,
        requests: impl IntoIterator<Item = RequestRecord>,
        now_ms: u64,
    ) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for request in requests {
            insert_request(&mut partitions, partition, request, now_ms);
        }
    }

    /// Notes the requests of the rows this replica of `partition` held at start.
    pub fn note_restored(&self, partition: u32, restored: &Restored, now_ms: u64) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for row in restored.rows.values() {
            insert(&mut partitions, partition, row, now_ms);
        }
    }

    /// The first reply of request `id` if this replica saw a row of `partition` made by it and
    /// the request has not expired (give or take [`CLOCK_MARGIN_MS`]); [`Unsynced`] while this
    /// replica cannot know (it re-entered and has not got the other members' entries yet), so
    /// must not execute requests as head. One look, on the head's path of every request.
    pub fn first_reply(
        &self,
        partition: u32,
        id: &RequestId,
        now_ms: u64,
    ) -> Result<Option<RequestRecord>, Unsynced> {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let Some(table) = partitions.get_mut(&partition) else {
            return Ok(None);
        };
        if table.is_unsynced(now_ms) {
            return Err(Unsynced);
        }
        Ok(table
            .requests
            .get(id)
            .filter(|(until, _)| *until > now_ms)
            .map(|(_, record)| record.clone()))
    }

    /// Every partition's live entries, for the chain log's snapshot ([`crate::compaction`]): what
    /// this replica knows, synced or not (a restart forgets that it was unsynced either way).
    pub fn live(&self, now_ms: u64) -> BTreeMap<u32, Vec<RequestRecord>> {
        let partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        partitions
            .iter()
            .map(|(&partition, table)| {
                let requests = table.live(now_ms).map(|(_, r)| r.clone()).collect();
                (partition, requests)
            })
            .filter(|(_, requests): &(u32, Vec<RequestRecord>)| !requests.is_empty())
            .collect()
    }

    /// The partitions waiting for their entries, each with the view it re-entered under.
    pub fn unsynced(&self) -> Vec<(u32, u64)> {
        let partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let mut unsynced: Vec<(u32, u64)> = partitions
            .iter()
            .filter(|(_, t)| t.unsynced_since.is_some())
            .map(|(&p, t)| (p, t.cleared_view))
            .collect();
        // In partition order, not the map's: the syncs go out in it (deterministic under simulation).
        unsynced.sort_unstable();
        unsynced
    }

    /// This replica's live entries of `partition`, for a member that re-entered; `None` while it
    /// is unsynced itself (it cannot vouch for what it may have missed).
    pub fn export(&self, partition: u32, now_ms: u64) -> Option<Vec<Exported>> {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let Some(table) = partitions.get_mut(&partition) else {
            return Some(Vec::new());
        };
        if table.is_unsynced(now_ms) {
            return None;
        }
        let entries = table
            .live(now_ms)
            .map(|(until, record)| Exported {
                id: record.id.0,
                until_ms: until,
                expires_at_ms: record.expires_at_ms,
                reply: record.reply.to_vec(),
                reply_ts: record.reply_ts.as_ref().map(Hlc::to_string),
            })
            .collect();
        Some(entries)
    }

    /// Merges the entries of `partition` other members exported ([`Recent::export`]) and ends
    /// its unsynced state, unless this replica re-entered under a view after `view` (the view of
    /// the re-entry they answer, or of the head's recovery copy that sent them): entries exported
    /// before a re-entry miss what the chain ran between the two. Whether they were merged. An
    /// entry whose `__ts` does not parse is left out, with a log line.
    pub fn import(&self, partition: u32, view: u64, entries: Vec<Exported>) -> bool {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let table = partitions.entry(partition).or_default();
        if table.cleared_view > view {
            return false;
        }
        for entry in entries {
            let reply_ts = match entry.reply_ts.as_deref().map(Hlc::parse).transpose() {
                Ok(ts) => ts,
                Err(e) => {
                    tracing::warn!(partition, "a remembered request's __ts does not parse: {e}");
                    continue;
                }
            };
            let id = RequestId(entry.id);
            table.requests.entry(id).or_insert((
                entry.until_ms,
                RequestRecord {
                    id,
                    expires_at_ms: entry.expires_at_ms,
                    reply: Bytes::from(entry.reply),
                    reply_ts,
                },
            ));
        }
        table.unsynced_since = None;
        true
    }

    /// How many requests are remembered (all partitions).
    pub fn len(&self) -> usize {
        let partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        partitions.values().map(|t| t.requests.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn insert(partitions: &mut HashMap<u32, Table>, partition: u32, row: &Row, now_ms: u64) {
    if let Some(request) = row.value.as_deref().and_then(request_of) {
        insert_request(partitions, partition, request, now_ms);
    }
}

fn insert_request(
    partitions: &mut HashMap<u32, Table>,
    partition: u32,
    request: RequestRecord,
    now_ms: u64,
) {
    if !is_live(&request, now_ms) {
        return;
    }
    let until = request
        .expires_at_ms
        .min(now_ms.saturating_add(KEEP_AT_MOST_MS))
        .saturating_add(CLOCK_MARGIN_MS);
    partitions
        .entry(partition)
        .or_default()
        .requests
        .insert(request.id, (until, request));
}

impl Table {
    /// Whether the entries of other members are still missing; once the longest a request is
    /// remembered has passed since the re-entry, nothing missed matters any more.
    fn is_unsynced(&mut self, now_ms: u64) -> bool {
        match self.unsynced_since {
            Some(since) if now_ms < since.saturating_add(KEEP_AT_MOST_MS + CLOCK_MARGIN_MS) => true,
            Some(_) => {
                self.unsynced_since = None;
                false
            }
            None => false,
        }
    }

    /// The entries not expired at `now_ms`, each with when it expires, in request order, not the
    /// map's: the same entries make the same message or snapshot (deterministic under simulation).
    fn live(&self, now_ms: u64) -> impl Iterator<Item = (u64, &RequestRecord)> {
        let mut live: Vec<(u64, &RequestRecord)> = self
            .requests
            .values()
            .filter(|(until, _)| *until > now_ms)
            .map(|(until, record)| (*until, record))
            .collect();
        live.sort_unstable_by_key(|(_, record)| record.id.0);
        live.into_iter()
    }

    fn sweep(&mut self, now_ms: u64) {
        if now_ms < self.next_sweep_ms {
            return;
        }
        self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
        self.requests.retain(|_, (until, _)| *until > now_ms);
    }
}

/// Whether a retry of `request` may still come at `now_ms` (give or take the clocks' margin), so
/// that it is worth remembering.
pub(crate) fn is_live(request: &RequestRecord, now_ms: u64) -> bool {
    request.expires_at_ms.saturating_add(CLOCK_MARGIN_MS) > now_ms
}

/// The request record a row's value carries, if it is a store record made by a request (the
/// rows of sessions and of expiry deletes carry none), read from the record's header: every
/// replica notes every row it persists, on the write path. A value that does not decode is not
/// this module's to report: the head reports it when it reads the row.
pub(crate) fn request_of(value: &[u8]) -> Option<RequestRecord> {
    RequestRecord::of_record(value).ok().flatten()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use mqstate_chain::Version;
    use mqstate_protocol::Hlc;
    use mqstate_store::{Change, Delta};

    use super::*;

    /// A row of `k` made by request (`client`, `correlation`) that expires at `expires_at_ms`.
    pub(crate) fn row_of(client: &str, correlation: &[u8], expires_at_ms: u64) -> Record {
        let version = Hlc::new(1_000, 0, Arc::from("n"));
        let change = Change::Requested {
            request: RequestRecord {
                id: RequestId::of(client, correlation),
                expires_at_ms,
                reply: Bytes::from_static(b"+OK\r\n"),
                reply_ts: Some(version.clone()),
            },
            change: Box::new(Change::Key(Delta::Put {
                key: Bytes::from_static(b"k"),
                value: Bytes::from_static(b"v"),
                version,
                fencing_token: None,
                expires_at_ms: None,
            })),
        };
        Record::Row {
            key: b"k".to_vec(),
            row: Row {
                value: Some(change.encode().expect("a test row encodes")),
                version: Version {
                    wall_ms: 1_000,
                    counter: 0,
                    node: 1,
                },
                view: 1,
                locked: true,
            },
        }
    }

    fn unsynced(recent: &Recent, partition: u32, now_ms: u64) -> bool {
        let any = RequestId::of("any", b"");
        recent.first_reply(partition, &any, now_ms) == Err(Unsynced)
    }

    /// A synced replica's first reply.
    fn first(
        recent: &Recent,
        partition: u32,
        id: &RequestId,
        now_ms: u64,
    ) -> Option<RequestRecord> {
        recent.first_reply(partition, id, now_ms).expect("synced")
    }

    #[test]
    fn a_request_whose_row_was_replaced_still_has_its_first_reply() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        recent.note(3, &[row_of("c", b"2", 10_000)], 1_100);
        let reply = first(&recent, 3, &RequestId::of("c", b"1"), 1_200);
        assert_eq!(reply.map(|r| r.reply), Some(Bytes::from_static(b"+OK\r\n")));
        assert!(first(&recent, 4, &RequestId::of("c", b"1"), 1_200).is_none());
    }

    #[test]
    fn a_request_answered_without_a_row_has_its_first_reply() {
        let recent = Recent::default();
        let id = RequestId::of("c", b"nx");
        let record = RequestRecord {
            id,
            expires_at_ms: 10_000,
            reply: Bytes::from_static(b":-1\r\n"),
            reply_ts: None,
        };
        recent.remember(3, [record], 1_000);
        let reply = first(&recent, 3, &id, 5_000);
        assert_eq!(reply.map(|r| r.reply), Some(Bytes::from_static(b":-1\r\n")));
        // Forgotten like a row's once the request expired (give or take the clocks' margin).
        assert!(first(&recent, 3, &id, 10_000 + CLOCK_MARGIN_MS).is_none());
    }

    /// What the chain log's snapshot keeps: every partition's live entries, those of no-ops too,
    /// in request order.
    #[test]
    fn the_live_entries_of_every_partition() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"2", 10_000)], 1_000);
        recent.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        recent.note(4, &[row_of("c", b"old", 2_000)], 1_000);
        let unwritten = RequestRecord {
            id: RequestId::of("c", b"nx"),
            expires_at_ms: 10_000,
            reply: Bytes::from_static(b":-1\r\n"),
            reply_ts: None,
        };
        recent.remember(5, [unwritten.clone()], 1_000);
        let live = recent.live(2_000 + CLOCK_MARGIN_MS);
        let mut three = vec![RequestId::of("c", b"1"), RequestId::of("c", b"2")];
        three.sort_unstable_by_key(|id| id.0);
        assert_eq!(live[&3].iter().map(|r| r.id).collect::<Vec<_>>(), three);
        assert!(!live.contains_key(&4), "expired");
        assert_eq!(live[&5], [unwritten]);
    }

    #[test]
    fn an_expired_request_is_a_new_one() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 2_000)], 1_000);
        let id = RequestId::of("c", b"1");
        assert!(first(&recent, 3, &id, 2_000 + CLOCK_MARGIN_MS - 1).is_some());
        assert!(first(&recent, 3, &id, 2_000 + CLOCK_MARGIN_MS).is_none());
        recent.note(3, &[], 5_000 + CLOCK_MARGIN_MS);
        assert!(recent.is_empty(), "swept once expired");
    }

    #[test]
    fn a_re_entry_waits_for_the_other_members_entries() {
        let head = Recent::default();
        head.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        let rejoined = Recent::default();
        rejoined.note(3, &[row_of("c", b"0", 10_000)], 900);
        rejoined.note(3, &[Record::Clear { view: 4 }], 1_100);
        assert!(unsynced(&rejoined, 3, 1_200));
        assert_eq!(rejoined.unsynced(), vec![(3, 4)]);
        assert!(
            rejoined.export(3, 1_200).is_none(),
            "cannot vouch for others"
        );
        let entries = head.export(3, 1_200).expect("the head is synced");
        assert!(rejoined.import(3, 4, entries));
        assert!(!unsynced(&rejoined, 3, 1_200));
        let reply = first(&rejoined, 3, &RequestId::of("c", b"1"), 1_300);
        assert_eq!(
            reply.map(|r| r.reply_ts),
            Some(Some(Hlc::new(1_000, 0, Arc::from("n"))))
        );
        // Long after a re-entry with nobody to ask, nothing missed matters any more.
        let alone = Recent::default();
        alone.note(3, &[Record::Clear { view: 4 }], 1_000);
        assert!(unsynced(&alone, 3, 1_000 + KEEP_AT_MOST_MS));
        assert!(!unsynced(
            &alone,
            3,
            1_000 + KEEP_AT_MOST_MS + CLOCK_MARGIN_MS
        ));
        // The sessions' space has nothing to sync.
        alone.note(
            3 | crate::space::SESSIONS,
            &[Record::Clear { view: 4 }],
            1_000,
        );
        assert!(!unsynced(&alone, 3 | crate::space::SESSIONS, 1_000));
    }

    #[test]
    fn a_re_entry_at_the_tail_forgets_the_voided_rows_requests() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        recent.note(7, &[row_of("c", b"9", 10_000)], 1_000);
        recent.note(3, &[Record::Clear { view: 4 }], 1_100);
        assert!(unsynced(&recent, 3, 1_200));
        // Synced from members that never had the voided row.
        assert!(recent.import(3, 4, Vec::new()));
        assert!(first(&recent, 3, &RequestId::of("c", b"1"), 1_200).is_none());
        assert!(first(&recent, 7, &RequestId::of("c", b"9"), 1_200).is_some());
    }

    /// Entries exported for an earlier re-entry (a sync that was under way, a recovery copy of an
    /// earlier view) do not sync a replica that re-entered again since: the chain may have run
    /// requests between the two that they do not have.
    #[test]
    fn entries_from_before_a_later_re_entry_do_not_sync_it() {
        let head = Recent::default();
        head.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        let entries = head.export(3, 1_000).expect("the head is synced");
        let rejoined = Recent::default();
        rejoined.note(3, &[Record::Clear { view: 4 }], 900);
        rejoined.note(3, &[Record::Clear { view: 6 }], 1_100);
        assert!(!rejoined.import(3, 5, entries.clone()));
        assert!(unsynced(&rejoined, 3, 1_200));
        assert!(rejoined.import(3, 6, entries));
        assert!(!unsynced(&rejoined, 3, 1_200));
    }

    #[test]
    fn a_long_expiry_is_kept_at_most_the_bound() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", u64::MAX / 2)], 1_000);
        let id = RequestId::of("c", b"1");
        let end = 1_000 + KEEP_AT_MOST_MS + CLOCK_MARGIN_MS;
        assert!(first(&recent, 3, &id, end - 1).is_some());
        assert!(first(&recent, 3, &id, end).is_none());
    }
}
