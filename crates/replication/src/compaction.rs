//! Compaction of the chain log: once `snapshot_threshold_bytes` were logged since the last
//! snapshot, the driver hands the [`Compactor`] every replica's image ([`mqstate_chain::Replica::image`],
//! and what the log restored for replicas not created yet) between two turns, when each image is
//! exactly what the records appended so far fold to. The snapshot covers those records: it is
//! written (by `mqstate-wal`'s snapshot machinery, as the state store's) only once they are all
//! fsynced — a snapshot never holds a row the log did not make durable — and the segments it covers
//! are then purged. At start the log reads the snapshot and folds the records after it
//! ([`crate::log::ChainLog::open`]).
//!
//! The image is cloned in the driver and encoded on a blocking thread, whole in memory (rows are
//! the store's records; a streamed encoding like the state store's is future work).
//!
//! An image keeps each key's last row only, so the snapshot also holds the requests this node
//! remembers ([`crate::recent`]) that have not expired: the rows that recorded the others it folds
//! away, and a retry of their requests after a restart must still get its first reply, not run
//! again (issue #15, decision 0050).
//!
//! The state's format: `MARKER`, the version ([`VERSION`]), then postcard of the images and the
//! requests. The first release's state is postcard of the images alone, a map, which begins with
//! its length as a varint; the marker is not a valid one, so no such state begins with it (it
//! still loads, with no requests), and that release's decoder refuses a later state instead of
//! reading it as something else (a leading zero byte, say, it would read as no images at all).

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use mqstate_chain::Restored;
use mqstate_protocol::Hlc;
use mqstate_store::{RequestId, RequestRecord};
use mqstate_wal::snapshot::Snapshot;
use mqstate_wal::{Lsn, WalWriter};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

/// Longest a closing log waits for a snapshot under way.
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The beginning of a versioned state: ten bytes with the continuation bit set are no varint
/// postcard reads (see the module's comment).
const MARKER: [u8; 10] = [0xff; 10];

/// The state's version: 2, images and remembered requests (1, images alone, had no marker).
pub const VERSION: u8 = 2;

/// What a snapshot holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contents {
    /// Each partition's image.
    pub images: BTreeMap<u32, Restored>,
    /// The requests each partition remembers ([`crate::recent::Recent::live`]).
    pub requests: BTreeMap<u32, Vec<RequestRecord>>,
}

/// The state as it is written (version 2).
#[derive(Serialize, Deserialize)]
struct State {
    images: BTreeMap<u32, Restored>,
    requests: BTreeMap<u32, Vec<Remembered>>,
}

/// A remembered request as the state holds it.
#[derive(Serialize, Deserialize)]
struct Remembered {
    id: [u8; 16],
    expires_at_ms: u64,
    reply: Vec<u8>,
    reply_ts: Option<String>,
}

/// The snapshot's state (see the module's comment).
pub fn encode(contents: Contents) -> Vec<u8> {
    let requests = contents
        .requests
        .into_iter()
        .map(|(partition, requests)| {
            let requests = requests
                .into_iter()
                .map(|r| Remembered {
                    id: r.id.0,
                    expires_at_ms: r.expires_at_ms,
                    reply: r.reply.to_vec(),
                    reply_ts: r.reply_ts.as_ref().map(Hlc::to_string),
                })
                .collect();
            (partition, requests)
        })
        .collect();
    let state = State {
        images: contents.images,
        requests,
    };
    // Encoding into a Vec fails only for types postcard cannot express; ours are plain data.
    let mut header = MARKER.to_vec();
    header.push(VERSION);
    postcard::to_extend(&state, header).unwrap_or_default()
}

/// What a snapshot's state holds; an error names what does not decode.
pub fn decode(state: &[u8]) -> Result<Contents, String> {
    let Some([version, body @ ..]) = state.strip_prefix(&MARKER[..]) else {
        // The first release's: the images alone.
        let images = postcard::from_bytes(state).map_err(|e| format!("version 1: {e}"))?;
        return Ok(Contents {
            images,
            requests: BTreeMap::new(),
        });
    };
    if *version != VERSION {
        return Err(format!(
            "version {version} is not one this release reads (1 or {VERSION})"
        ));
    }
    let (state, rest) =
        postcard::take_from_bytes::<State>(body).map_err(|e| format!("version {VERSION}: {e}"))?;
    if !rest.is_empty() {
        return Err(format!(
            "version {VERSION}: {} bytes after the end",
            rest.len()
        ));
    }
    let mut requests = BTreeMap::new();
    for (partition, remembered) in state.requests {
        let records = remembered
            .into_iter()
            .map(|r| {
                let reply_ts = r.reply_ts.as_deref().map(Hlc::parse).transpose();
                let reply_ts = reply_ts.map_err(|e| {
                    format!("version {VERSION}: a remembered request's __ts of partition {partition}: {e}")
                })?;
                Ok(RequestRecord {
                    id: RequestId(r.id),
                    expires_at_ms: r.expires_at_ms,
                    reply: Bytes::from(r.reply),
                    reply_ts,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        requests.insert(partition, records);
    }
    Ok(Contents {
        images: state.images,
        requests,
    })
}

/// Takes the snapshots of one node's chain log, one at a time.
pub struct Compactor {
    threshold: u64,
    running: Option<JoinHandle<()>>,
}

impl Compactor {
    /// Snapshots once `threshold` bytes were logged since the last one.
    pub fn new(threshold: u64) -> Compactor {
        Compactor {
            threshold: threshold.max(1),
            running: None,
        }
    }

    /// Whether a snapshot should begin, `logged` bytes after the last one began.
    pub fn due(&self, logged: u64) -> bool {
        logged >= self.threshold && self.running.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Begins a snapshot of `contents`, whose images must be what every record of `wal` up to
    /// `upto` folds to.
    pub fn start(&mut self, wal: Arc<WalWriter>, upto: Lsn, contents: Contents) {
        self.running = Some(tokio::spawn(snapshot(wal, upto, contents)));
    }

    /// Waits for a snapshot under way, so the log can close: it completes, or is abandoned after
    /// [`STOP_WAIT`] (its records never became durable: a failing disk). An abandoned snapshot
    /// leaves at most its temporary file; the previous snapshot and the log stay valid.
    pub async fn stop(&mut self) {
        if let Some(mut task) = self.running.take() {
            if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
                tracing::warn!(
                    "the chain log's snapshot did not complete in {STOP_WAIT:?}; abandoned"
                );
                task.abort();
                let _ = task.await;
            }
        }
    }
}

async fn snapshot(wal: Arc<WalWriter>, upto: Lsn, contents: Contents) {
    // Every record the images hold must be durable before a snapshot stands for them.
    let mut durable = wal.reader().durable();
    while *durable.borrow_and_update() <= upto {
        if durable.changed().await.is_err() {
            return;
        }
    }
    let rows: usize = contents.images.values().map(|image| image.rows.len()).sum();
    let requests: usize = contents.requests.values().map(Vec::len).sum();
    let Ok(state) = tokio::task::spawn_blocking(move || encode(contents)).await else {
        return;
    };
    let bytes = state.len();
    let snapshot = Snapshot {
        last_index: upto,
        last_term: 0,
        state: Bytes::from(state),
    };
    match wal.install_snapshot(snapshot).await {
        Ok(()) => tracing::debug!(
            upto,
            rows,
            requests,
            bytes,
            "chain log snapshot written, log purged"
        ),
        Err(e) => tracing::warn!(
            upto,
            "the chain log's snapshot failed (the log is kept): {e}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::ChainLog;
    use mqstate_chain::{Record, Row, Version};
    use mqstate_wal::WalOptions;

    fn row(v: u64) -> Row {
        Row {
            value: Some(vec![v as u8; 40]),
            version: Version {
                wall_ms: v,
                counter: 0,
                node: 1,
            },
            view: 1,
            locked: v.is_multiple_of(3),
        }
    }

    /// What the records of `batches` fold to.
    fn fold(batches: &[(u32, Vec<Record>)]) -> BTreeMap<u32, Restored> {
        let mut images: BTreeMap<u32, Restored> = BTreeMap::new();
        for (partition, records) in batches {
            for record in records {
                images.entry(*partition).or_default().apply(record.clone());
            }
        }
        images
    }

    fn segments(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir.join("chains").join("log"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn a_reopened_log_is_its_snapshot_and_the_tail_and_the_covered_segments_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let options = || WalOptions {
            segment_soft_limit_bytes: 1024,
            preallocate_segments: false,
            ..WalOptions::default()
        };
        let mut batches = Vec::new();
        let write = |n: u64| -> (u32, Vec<Record>) {
            let partition = (n % 4) as u32;
            let mut records = vec![Record::Row {
                key: format!("k{}", n % 50).into_bytes(),
                row: row(n),
            }];
            if n == 120 {
                records.insert(0, Record::Clear { view: 7 });
            }
            if n == 160 {
                records.push(Record::CaughtUp { view: 7 });
            }
            if n == 170 {
                // After the snapshot: voids partition 2's rows, and its requests with them.
                records.insert(0, Record::Clear { view: 8 });
            }
            (partition, records)
        };
        // Partition 1's request is live when the log opens again, partition 3's expired.
        let now_ms = 2_000 + crate::recent::CLOCK_MARGIN_MS;
        let requests = BTreeMap::from([
            (1, vec![request(1, now_ms)]),
            (2, vec![request(2, now_ms)]),
            (3, vec![request(3, 2_000)]),
        ]);
        {
            let (log, restored) = ChainLog::open(dir.path(), options(), 1_000).unwrap();
            let mut log = log.snapshot_every(2048);
            assert!(restored.is_empty());
            for n in 1..=200 {
                let (partition, records) = write(n);
                batches.push((partition, records.clone()));
                let commit = log.append(partition, records).await.unwrap();
                if n != 150 {
                    // One at a time, so that segments fill and rotate.
                    commit.await.unwrap();
                } else {
                    let segments_before = segments(dir.path());
                    assert!(log.snapshot_due());
                    log.snapshot(Contents {
                        images: fold(&batches),
                        requests: requests.clone(),
                    });
                    assert!(
                        !log.snapshot_due(),
                        "one at a time, and the count starts over"
                    );
                    // Written only once its records are durable: wait for them, then for it.
                    commit.await.unwrap();
                    log.wait_for_snapshot().await;
                    assert!(
                        segments(dir.path()) < segments_before,
                        "segments covered by the snapshot are purged: {} before, {} after",
                        segments_before,
                        segments(dir.path())
                    );
                }
            }
            log.shutdown().await;
        }
        assert!(dir.path().join("chains").join("mqstate.snapshot").exists());
        let (mut log, restored) = ChainLog::open(dir.path(), options(), now_ms).unwrap();
        assert_eq!(restored, fold(&batches));
        assert_eq!(restored[&0].joining_since, Some(7));
        assert_eq!(restored[&0].caught_up_view, Some(7));
        let remembered: Vec<(u32, Vec<RequestId>)> = log
            .take_replayed_requests()
            .into_iter()
            .map(|(partition, requests)| (partition, requests.iter().map(|r| r.id).collect()))
            .filter(|(_, ids): &(u32, Vec<RequestId>)| !ids.is_empty())
            .collect();
        assert_eq!(
            remembered,
            [(1, vec![RequestId([1; 16])])],
            "the snapshot's live requests, less those a later re-entry voided"
        );
        log.shutdown().await;
    }

    /// A remembered request `n` that expires at `expires_at_ms`.
    fn request(n: u8, expires_at_ms: u64) -> RequestRecord {
        RequestRecord {
            id: RequestId([n; 16]),
            expires_at_ms,
            reply: Bytes::from_static(b"+OK\r\n"),
            reply_ts: Some(Hlc::new(1_000, u32::from(n), Arc::from("n"))),
        }
    }

    fn contents() -> Contents {
        let mut image = Restored::default();
        image.apply(Record::Row {
            key: b"k".to_vec(),
            row: row(4),
        });
        Contents {
            images: BTreeMap::from([(3, image), (5, Restored::default())]),
            requests: BTreeMap::from([(3, vec![request(1, 9), request(2, 10)])]),
        }
    }

    #[test]
    fn contents_round_trip_and_garbage_is_an_error_not_a_panic() {
        assert_eq!(decode(&encode(contents())).unwrap(), contents());
        assert!(decode(&[]).is_err());
        assert!(decode(&[0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
        let state = encode(contents());
        let error = decode(&state[..state.len() - 1]).unwrap_err();
        assert!(error.contains("version 2"), "{error}");
        let error = decode(&[state.clone(), vec![0]].concat()).unwrap_err();
        assert!(error.contains("after the end"), "{error}");
        let mut future = state.clone();
        future[MARKER.len()] = 3;
        let error = decode(&future).unwrap_err();
        assert!(error.contains("version 3"), "{error}");
    }

    #[test]
    fn a_damaged_reply_ts_is_an_error() {
        let state = State {
            images: BTreeMap::new(),
            requests: BTreeMap::from([(
                3,
                vec![Remembered {
                    id: [1; 16],
                    expires_at_ms: 9,
                    reply: b"+OK\r\n".to_vec(),
                    reply_ts: Some("not an hlc".into()),
                }],
            )]),
        };
        let bytes = postcard::to_extend(&state, [&MARKER[..], &[VERSION]].concat()).unwrap();
        let error = decode(&bytes).unwrap_err();
        assert!(error.contains("__ts of partition 3"), "{error}");
    }

    /// The first release's state, the images alone (no marker), still loads: no requests. Its
    /// decoder refuses a version-2 state rather than read it as something else.
    #[test]
    fn a_version_1_state_loads_with_no_requests_and_its_decoder_refuses_version_2() {
        for images in [contents().images, BTreeMap::new()] {
            let state = postcard::to_allocvec(&images).unwrap();
            let expected = Contents {
                images,
                requests: BTreeMap::new(),
            };
            assert_eq!(decode(&state).unwrap(), expected);
        }
        for contents in [contents(), Contents::default()] {
            let version_1 = postcard::from_bytes::<BTreeMap<u32, Restored>>(&encode(contents));
            assert!(version_1.is_err(), "{version_1:?}");
        }
    }

    fn any_request() -> impl Strategy<Value = RequestRecord> {
        (
            any::<[u8; 16]>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..16),
            proptest::option::of((0..=MAX_WALL_MS, 0..=MAX_COUNTER, "[a-z0-9]{0,6}")),
        )
            .prop_map(|(id, expires_at_ms, reply, ts)| RequestRecord {
                id: RequestId(id),
                expires_at_ms,
                reply: Bytes::from(reply),
                reply_ts: ts.map(|(w, c, n)| Hlc::new(w, c, Arc::from(n.as_str()))),
            })
    }

    fn any_contents() -> impl Strategy<Value = Contents> {
        let image = proptest::collection::btree_map(
            proptest::collection::vec(any::<u8>(), 0..4),
            (any::<u64>(), any::<bool>()),
            0..4,
        )
        .prop_map(|rows| {
            let mut image = Restored::default();
            for (key, (v, locked)) in rows {
                image.apply(Record::Row {
                    key,
                    row: Row { locked, ..row(v) },
                });
            }
            image
        });
        (
            proptest::collection::btree_map(any::<u32>(), image, 0..4),
            proptest::collection::btree_map(
                any::<u32>(),
                proptest::collection::vec(any_request(), 0..4),
                0..4,
            ),
        )
            .prop_map(|(images, requests)| Contents { images, requests })
    }

    use mqstate_protocol::hlc::{MAX_COUNTER, MAX_WALL_MS};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            // Behind the current version's marker, so that the new fields' decoding sees them.
            let _ = decode(&[&MARKER[..], &[VERSION], &bytes].concat());
        }

        #[test]
        fn contents_round_trip(contents in any_contents()) {
            prop_assert_eq!(decode(&encode(contents.clone())).unwrap(), contents);
        }
    }
}
