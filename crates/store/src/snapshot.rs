//! Snapshot of a state machine: the whole keyspace plus the HLC high-water mark, in key order, so equal
//! states encode to equal bytes. KEYNOTIFY registrations are session state and are not included.
//!
//! ```text
//! 'S' | format version Int32 (4) | high-water HLC | topics | count Int32 | count × entry | requests
//! entry = key Buffer | value Buffer | version HLC | fencing token Nullable<HLC> | expires at Nullable<Int64>
//! topics = Array<name Buffer | endpoint Buffer | keys Buffer | events UInt8 | max queue Int32
//!                | next seq Int64 | next reservation id Int64
//!                | Array<reservation id Int64 | deadline Int64>
//!                | Array<seq Int64 | key Buffer | event UInt8 | version HLC | value Nullable<Buffer>>>
//! requests = Array<request id 16 bytes | expires at Int64 | reply | reply __ts Nullable<HLC>>
//! ```
//! (`request id` and `reply` as in [`crate::request`].) Versions 1 (no topics, no requests), 2 (no
//! requests) and 3 (requests with their client id and correlation data spelled out) are still read. The topics are encoded
//! whole when the snapshot starts, so they are exact as of its last index; only the keys are fuzzy.
//! The requests ([`RequestRecord`]s of the service's duplicate cache, not state of the machine) come
//! last because a streamed snapshot's writer knows them only at its end ([`encode_requests`]).
//! The result is the `state` Buffer of the snapshot file; its framing and checksum belong to the WAL.
//!
//! [`SnapshotEncoder`] encodes in chunks so a large keyspace never stops the caller for long: the state
//! machine may change between chunks. Such a *fuzzy* snapshot is exact once the deltas applied after
//! it was started are replayed on it: each delta assigns a key's whole entry (or removes it), so
//! replaying one the snapshot already reflects changes nothing, and the last delta of each key wins
//! (decision 0014). The count and the high-water mark are written last, into the header.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

use crate::codec::{Reader, Writer};
use crate::error::StoreError;
use crate::keyspace::{AscendingBuilder, Entry, NewEntry};
use crate::machine::{StateMachine, StoreConfig};
use crate::notify::record::text;
use crate::notify::{event_from_byte, Notifications, QueueEntry, TopicDef};
use crate::request::RequestRecord;

/// First byte of a key-value snapshot.
pub const SNAPSHOT_MARKER: u8 = b'S';
/// Current snapshot format version.
pub const SNAPSHOT_VERSION: i32 = 4;
/// The format before topics.
const SNAPSHOT_VERSION_KEYS_ONLY: i32 = 1;
/// The format before requests.
const SNAPSHOT_VERSION_TOPICS: i32 = 2;
/// The format whose requests spell out their client id and correlation data.
const SNAPSHOT_VERSION_LEGACY_REQUESTS: i32 = 3;

const CONTEXT: &str = "key-value snapshot";

/// The fewest bytes an encoded entry takes (one-byte key, empty value and node id, no token or
/// expiry): bounds what a snapshot's count may reserve before its entries are read.
const MIN_ENTRY_BYTES: usize = 4 + 1 + 4 + (8 + 4 + 4) + 1 + 1;

/// The fewest bytes an encoded request takes (a one-byte reply, no reply `__ts`).
const MIN_REQUEST_BYTES: usize = 16 + 8 + 1 + 1;

/// Whether [`SnapshotEncoder::step`] reached the end of the keyspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Keys after the cursor remain.
    Continue,
    /// Every key has been encoded; call [`SnapshotEncoder::finish`].
    Done,
}

/// A snapshot being encoded chunk by chunk, in key order, from a cursor.
///
/// The bytes encoded so far are either kept until [`SnapshotEncoder::finish`] (the whole state in
/// one buffer) or taken after each step with [`SnapshotEncoder::take_encoded`] and written out, so
/// that the encoded state is never whole in memory; then [`SnapshotEncoder::finish_streamed`] says
/// which bytes already taken are to be overwritten (the count and the high-water mark).
pub struct SnapshotEncoder {
    w: Writer,
    /// Bytes of the state already handed out by [`SnapshotEncoder::take_encoded`]; `w` holds the
    /// ones after them.
    taken: usize,
    /// Where (in the state) the high-water HLC's wall time and counter are patched in at the end.
    high_water_at: usize,
    count_at: usize,
    count: usize,
    /// The last key encoded: the next chunk starts after it.
    cursor: Option<Box<[u8]>>,
}

/// Bytes of a streamed state to overwrite once the state is complete: `bytes` at `offset` (from the
/// start of the state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatePatch {
    pub offset: u64,
    pub bytes: Vec<u8>,
}

/// The end of a streamed snapshot ([`SnapshotEncoder::finish_streamed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedEnd {
    /// The last bytes of the keys, after everything taken before; the state is complete once
    /// [`encode_requests`] follows them.
    pub rest: Vec<u8>,
    /// Fields of bytes already taken that are only known now.
    pub patches: Vec<StatePatch>,
}

impl SnapshotEncoder {
    /// Writes the header, with the count and the high-water mark still to come.
    pub fn new(machine: &StateMachine) -> Result<SnapshotEncoder, StoreError> {
        let mut w = Writer::default();
        w.u8(SNAPSHOT_MARKER);
        w.i32(SNAPSHOT_VERSION);
        let high_water_at = w.buf.len();
        w.hlc(&machine.clock.high_water())?;
        encode_topics(&mut w, machine)?;
        let count_at = w.buf.len();
        w.i32(0);
        Ok(SnapshotEncoder {
            w,
            taken: 0,
            high_water_at,
            count_at,
            count: 0,
            cursor: None,
        })
    }

    /// Encodes the keys after the cursor, stopping after `max_keys` keys or once the chunk reached
    /// `max_bytes` (at least one key per call).
    pub fn step(
        &mut self,
        machine: &StateMachine,
        max_keys: usize,
        max_bytes: usize,
    ) -> Result<Progress, StoreError> {
        let chunk_start = self.w.buf.len();
        let after = self.cursor.take();
        let mut encoded = 0usize;
        let (progress, last) = {
            let mut keys = machine.keyspace.iter_after(after.as_deref());
            let mut last = None;
            let progress = loop {
                let chunk_full = encoded >= max_keys || self.w.buf.len() - chunk_start >= max_bytes;
                if encoded > 0 && chunk_full {
                    break Progress::Continue;
                }
                let Some(entry) = keys.next() else {
                    break Progress::Done;
                };
                encode_entry(&mut self.w, &entry)?;
                encoded += 1;
                last = Some(entry.key());
            };
            (progress, last.map(Box::from))
        };
        self.count += encoded;
        self.cursor = last.or(after);
        Ok(progress)
    }

    /// The bytes encoded since the last call (the first call: from the start of the state), to be
    /// written out in order.
    pub fn take_encoded(&mut self) -> Vec<u8> {
        let chunk = std::mem::take(&mut self.w.buf);
        self.taken += chunk.len();
        chunk
    }

    /// Bytes of the state encoded so far, taken or not.
    pub fn encoded_len(&self) -> usize {
        self.taken + self.w.buf.len()
    }

    /// Encodes what is left, then fills in the count and the clock's high-water mark as of now
    /// (the clock only grows, so it is at least every encoded version), and ends with `requests`.
    /// For an encoder whose bytes were never taken: the whole state.
    pub fn finish(
        self,
        machine: &StateMachine,
        requests: &[RequestRecord],
    ) -> Result<Vec<u8>, StoreError> {
        debug_assert_eq!(
            self.taken, 0,
            "a streamed snapshot ends with finish_streamed"
        );
        let end = self.finish_streamed(machine)?;
        debug_assert!(end.patches.is_empty());
        let mut state = end.rest;
        state.extend(encode_requests(requests)?);
        Ok(state)
    }

    /// [`SnapshotEncoder::finish`] of a state whose bytes were taken as they were encoded: the
    /// bytes left, and the count and high-water mark as patches to what was taken before.
    pub fn finish_streamed(mut self, machine: &StateMachine) -> Result<StreamedEnd, StoreError> {
        while self.step(machine, usize::MAX, usize::MAX)? == Progress::Continue {}
        let count = i32::try_from(self.count).map_err(|_| StoreError::BufferTooLarge {
            what: "snapshot key count",
            len: self.count,
            max: i32::MAX as usize,
        })?;
        let high_water = machine.clock.high_water();
        let mut patches = Vec::new();
        if self.taken == 0 {
            self.w.patch_i32(self.count_at, count);
            self.w.patch_hlc_time(self.high_water_at, &high_water);
        } else {
            // The header went out with the first chunk, which holds at least the header.
            debug_assert!(self.count_at + 4 <= self.taken);
            let mut header = Writer::default();
            header.i64(i64::try_from(high_water.wall_ms).unwrap_or(i64::MAX));
            header.i32(i32::try_from(high_water.counter).unwrap_or(i32::MAX));
            patches.push(StatePatch {
                offset: self.high_water_at as u64,
                bytes: header.buf,
            });
            patches.push(StatePatch {
                offset: self.count_at as u64,
                bytes: count.to_be_bytes().to_vec(),
            });
        }
        Ok(StreamedEnd {
            rest: self.w.buf,
            patches,
        })
    }
}

/// The last bytes of a snapshot's state: the requests whose changes it may hold.
pub fn encode_requests(requests: &[RequestRecord]) -> Result<Vec<u8>, StoreError> {
    let mut encoder = RequestsEncoder::default();
    for request in requests {
        encoder.push(request)?;
    }
    encoder.finish()
}

/// [`encode_requests`] one request at a time, so they need not be gathered first.
pub struct RequestsEncoder {
    w: Writer,
    count: usize,
    /// Bytes were handed out by [`RequestsEncoder::take_encoded`].
    taken: bool,
}

impl Default for RequestsEncoder {
    fn default() -> Self {
        let mut w = Writer::default();
        w.i32(0);
        RequestsEncoder {
            w,
            count: 0,
            taken: false,
        }
    }
}

impl RequestsEncoder {
    /// Adds a request; one that cannot be encoded (a field over 2 GiB) leaves the list as it was.
    pub fn push(&mut self, request: &RequestRecord) -> Result<(), StoreError> {
        let len = self.w.buf.len();
        match request.encode_fields(&mut self.w) {
            Ok(()) => {
                self.count += 1;
                Ok(())
            }
            Err(e) => {
                self.w.buf.truncate(len);
                Err(e)
            }
        }
    }

    pub fn finish(mut self) -> Result<Vec<u8>, StoreError> {
        debug_assert!(!self.taken, "a streamed list ends with finish_streamed");
        let count = self.count()?;
        self.w.patch_i32(0, count);
        Ok(self.w.buf)
    }

    /// The bytes encoded since the last call, to be written out in order.
    pub fn take_encoded(&mut self) -> Vec<u8> {
        self.taken = true;
        std::mem::take(&mut self.w.buf)
    }

    /// [`RequestsEncoder::finish`] of a list whose bytes were taken as they were encoded, starting
    /// at `offset` in the state: the bytes left, and the count as a patch.
    pub fn finish_streamed(self, offset: u64) -> Result<(Vec<u8>, StatePatch), StoreError> {
        let count = self.count()?;
        let patch = StatePatch {
            offset,
            bytes: count.to_be_bytes().to_vec(),
        };
        Ok((self.w.buf, patch))
    }

    fn count(&self) -> Result<i32, StoreError> {
        i32::try_from(self.count).map_err(|_| StoreError::BufferTooLarge {
            what: "snapshot request list",
            len: self.count,
            max: i32::MAX as usize,
        })
    }
}

fn encode_entry(w: &mut Writer, entry: &Entry<'_>) -> Result<(), StoreError> {
    w.buffer("key", entry.key())?;
    w.buffer("value", entry.value())?;
    w.hlc(&entry.version())?;
    w.nullable_hlc(entry.fencing_token().as_ref())?;
    w.nullable_u64(entry.expires_at_ms());
    Ok(())
}

fn encode_topics(w: &mut Writer, machine: &StateMachine) -> Result<(), StoreError> {
    let topics: Vec<_> = machine.notify.iter().collect();
    w.count("snapshot topic list", topics.len())?;
    for topic in topics {
        let (def, next_seq, next_reservation_id, reservations, entries) =
            Notifications::topic_parts(topic);
        w.buffer("topic name", def.name.as_bytes())?;
        w.buffer("endpoint", def.endpoint.as_bytes())?;
        w.buffer("key pattern", &def.keys)?;
        w.u8(def.events);
        w.i32(i32::try_from(def.max_queue).unwrap_or(i32::MAX));
        w.u63(next_seq);
        w.u63(next_reservation_id);
        w.count("snapshot reservation list", reservations.len())?;
        for (&id, &deadline) in reservations {
            w.u63(id);
            w.u63(deadline);
        }
        w.count("snapshot queue entry list", entries.len())?;
        for entry in entries {
            w.u63(entry.seq);
            w.buffer("key", &entry.key)?;
            w.u8(entry.event.bit());
            w.hlc(&entry.version)?;
            w.bool(entry.value.is_some());
            if let Some(value) = &entry.value {
                w.buffer("value", value)?;
            }
        }
    }
    Ok(())
}

fn decode_topics(r: &mut Reader<'_>, notify: &mut Notifications) -> Result<(), StoreError> {
    let topics = r.len("topic count")?;
    for _ in 0..topics {
        let def = TopicDef {
            name: text(r, "topic name")?,
            endpoint: text(r, "endpoint")?,
            keys: r.bytes("key pattern")?,
            events: r.u8("events")?,
            max_queue: u32::try_from(r.i32("max queue")?)
                .map_err(|_| r.invalid("max queue", "must not be negative"))?,
        };
        if def.validate().is_err() {
            return Err(r.invalid("topic", "not a valid topic definition"));
        }
        let next_seq = r.u63("next seq")?;
        let next_reservation_id = r.u63("next reservation id")?;
        let mut reservations = BTreeMap::new();
        for _ in 0..r.len("reservation count")? {
            reservations.insert(r.u63("reservation id")?, r.u63("deadline")?);
        }
        let n = r.len("entry count")?;
        let mut entries = VecDeque::with_capacity(n.min(r.remaining() / 16));
        for _ in 0..n {
            let seq = r.u63("seq")?;
            let key = Bytes::copy_from_slice(r.key()?);
            let event = event_from_byte(r.u8("event")?)
                .ok_or_else(|| r.invalid("event", "expected 1, 2 or 4"))?;
            let version = r.hlc("version")?;
            let value = if r.bool("value present")? {
                Some(r.bytes("value")?)
            } else {
                None
            };
            entries.push_back(QueueEntry {
                seq,
                key,
                event,
                version,
                value,
            });
        }
        notify
            .restore_topic(def, next_seq, next_reservation_id, reservations, entries)
            .map_err(|reason| r.invalid("topic queue", reason))?;
    }
    Ok(())
}

impl StateMachine {
    /// Encodes the keyspace and the clock's high-water mark in one go (no requests).
    pub fn snapshot_encode(&self) -> Result<Vec<u8>, StoreError> {
        SnapshotEncoder::new(self)?.finish(self, &[])
    }

    /// Rebuilds a state machine from [`snapshot_encode`](Self::snapshot_encode) output. Arbitrary
    /// bytes yield an error, never a panic; keys must be strictly ascending (no duplicates).
    pub fn snapshot_decode(data: &[u8], config: StoreConfig) -> Result<StateMachine, StoreError> {
        Self::snapshot_decode_with_requests(data, config).map(|(machine, _)| machine)
    }

    /// [`StateMachine::snapshot_decode`], with the requests the snapshot holds (oldest first).
    pub fn snapshot_decode_with_requests(
        data: &[u8],
        config: StoreConfig,
    ) -> Result<(StateMachine, Vec<RequestRecord>), StoreError> {
        let mut r = Reader::new(CONTEXT, data);
        if r.u8("marker")? != SNAPSHOT_MARKER {
            return Err(StoreError::Invalid {
                context: CONTEXT,
                what: "marker",
                offset: 0,
                reason: "expected 'S'",
            });
        }
        let version = r.i32("format version")?;
        if !(SNAPSHOT_VERSION_KEYS_ONLY..=SNAPSHOT_VERSION).contains(&version) {
            return Err(r.invalid("format version", "this build reads format versions 1 to 4"));
        }
        let high_water = r.hlc("high-water mark")?;
        let mut notify = Notifications::default();
        if version >= SNAPSHOT_VERSION_TOPICS {
            decode_topics(&mut r, &mut notify)?;
        }
        let count = r.len("key count")?;
        let mut keys = AscendingBuilder::with_capacity(count.min(r.remaining() / MIN_ENTRY_BYTES));
        let mut machine = StateMachine::new(config)?;
        machine.clock.observe(&high_water);
        for _ in 0..count {
            let key = r.key()?;
            if keys.last_key().is_some_and(|prev| prev >= key) {
                return Err(r.invalid("key", "keys must be strictly ascending"));
            }
            let value = r.buffer("value")?;
            let version = r.hlc("version")?;
            let fencing_token = r.nullable_hlc("fencing token")?;
            let expires_at_ms = r.nullable_u63("expiry")?;
            machine.clock.observe(&version);
            keys.push(
                key,
                NewEntry {
                    value,
                    version: &version,
                    fencing_token: fencing_token.as_ref(),
                    expires_at_ms,
                },
            );
        }
        let mut requests = Vec::new();
        if version >= SNAPSHOT_VERSION_LEGACY_REQUESTS {
            let n = r.len("request count")?;
            requests.reserve(n.min(r.remaining() / MIN_REQUEST_BYTES));
            for _ in 0..n {
                requests.push(if version == SNAPSHOT_VERSION_LEGACY_REQUESTS {
                    RequestRecord::decode_legacy_fields(&mut r)?
                } else {
                    RequestRecord::decode_fields(&mut r)?
                });
            }
        }
        r.finish()?;
        machine.keyspace = keys.finish();
        machine.notify = notify;
        Ok((machine, requests))
    }
}

#[cfg(test)]
mod tests;
