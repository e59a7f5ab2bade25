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
//! Invariant: an entry stands for a row this replica holds durably or is making durable, never for
//! one it voided. A re-entry at the tail ([`Record::Clear`]) voids the partition's rows, so it
//! forgets the partition's entries too: a write that was never committed must not answer a retry.
//! A hit is only a reply once the key's row is committed at the head (the caller reads the key
//! first, which flushes an interrupted write through the chain).

use std::collections::HashMap;
use std::sync::Mutex;

use mqstate_chain::{Record, Restored, Row};
use mqstate_store::{Change, RequestId, RequestRecord};

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

#[derive(Default)]
pub struct Recent {
    partitions: Mutex<HashMap<u32, Table>>,
}

#[derive(Default)]
struct Table {
    /// Request → (kept until, first reply).
    requests: HashMap<RequestId, (u64, RequestRecord)>,
    next_sweep_ms: u64,
}

impl Recent {
    /// Notes the requests whose rows `records` write to this replica of `partition`.
    pub fn note(&self, partition: u32, records: &[Record], now_ms: u64) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for record in records {
            match record {
                Record::Row { row, .. } => insert(&mut partitions, partition, row, now_ms),
                Record::Clear { .. } => {
                    partitions.remove(&partition);
                }
                Record::CaughtUp { .. } | Record::Readable => {}
            }
        }
        if let Some(table) = partitions.get_mut(&partition) {
            table.sweep(now_ms);
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
    /// the request has not expired (give or take [`CLOCK_MARGIN_MS`]).
    pub fn first_reply(
        &self,
        partition: u32,
        id: &RequestId,
        now_ms: u64,
    ) -> Option<RequestRecord> {
        let partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let (until, record) = partitions.get(&partition)?.requests.get(id)?;
        (*until > now_ms).then(|| record.clone())
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
    let Some(request) = row.value.as_deref().and_then(request_of) else {
        return;
    };
    if request.expires_at_ms.saturating_add(CLOCK_MARGIN_MS) <= now_ms {
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
    fn sweep(&mut self, now_ms: u64) {
        if now_ms < self.next_sweep_ms {
            return;
        }
        self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
        self.requests.retain(|_, (until, _)| *until > now_ms);
    }
}

/// The request record a row's value carries, if it is a store record made by a request (the
/// rows of sessions and of expiry deletes carry none). A value that does not decode is not this
/// module's to report: the head reports it when it reads the row.
fn request_of(value: &[u8]) -> Option<RequestRecord> {
    match Change::decode(value).ok()? {
        Change::Requested { request, .. } => Some(request),
        Change::Key(_) | Change::Queue(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use mqstate_chain::Version;
    use mqstate_protocol::Hlc;
    use mqstate_store::Delta;

    use super::*;

    fn row_of(client: &str, correlation: &[u8], expires_at_ms: u64) -> Record {
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

    #[test]
    fn a_request_whose_row_was_replaced_still_has_its_first_reply() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        recent.note(3, &[row_of("c", b"2", 10_000)], 1_100);
        let first = recent.first_reply(3, &RequestId::of("c", b"1"), 1_200);
        assert_eq!(first.map(|r| r.reply), Some(Bytes::from_static(b"+OK\r\n")));
        assert!(recent
            .first_reply(4, &RequestId::of("c", b"1"), 1_200)
            .is_none());
    }

    #[test]
    fn an_expired_request_is_a_new_one() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 2_000)], 1_000);
        let id = RequestId::of("c", b"1");
        assert!(recent
            .first_reply(3, &id, 2_000 + CLOCK_MARGIN_MS - 1)
            .is_some());
        assert!(recent
            .first_reply(3, &id, 2_000 + CLOCK_MARGIN_MS)
            .is_none());
        recent.note(3, &[], 5_000 + CLOCK_MARGIN_MS);
        assert!(recent.is_empty(), "swept once expired");
    }

    #[test]
    fn a_re_entry_at_the_tail_forgets_the_voided_rows_requests() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", 10_000)], 1_000);
        recent.note(7, &[row_of("c", b"9", 10_000)], 1_000);
        recent.note(3, &[Record::Clear { view: 4 }], 1_100);
        assert!(recent
            .first_reply(3, &RequestId::of("c", b"1"), 1_200)
            .is_none());
        assert!(recent
            .first_reply(7, &RequestId::of("c", b"9"), 1_200)
            .is_some());
    }

    #[test]
    fn a_long_expiry_is_kept_at_most_the_bound() {
        let recent = Recent::default();
        recent.note(3, &[row_of("c", b"1", u64::MAX / 2)], 1_000);
        let id = RequestId::of("c", b"1");
        let end = 1_000 + KEEP_AT_MOST_MS + CLOCK_MARGIN_MS;
        assert!(recent.first_reply(3, &id, end - 1).is_some());
        assert!(recent.first_reply(3, &id, end).is_none());
    }
}
