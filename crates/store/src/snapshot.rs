//! Snapshot of a state machine: the whole keyspace plus the HLC high-water mark, in key order, so equal
//! states encode to equal bytes. KEYNOTIFY registrations are session state and are not included.
//!
//! ```text
//! 'S' | format version Int32 (1) | high-water HLC | count Int32 | count × entry
//! entry = key Buffer | value Buffer | version HLC | fencing token Nullable<HLC> | expires at Nullable<Int64>
//! ```
//! The result is the `state` Buffer of the snapshot file; its framing and checksum belong to the WAL.

use crate::codec::{Reader, Writer};
use crate::error::StoreError;
use crate::keyspace::{Entry, Keyspace};
use crate::machine::{StateMachine, StoreConfig};

/// First byte of a key-value snapshot.
pub const SNAPSHOT_MARKER: u8 = b'S';
/// Current snapshot format version.
pub const SNAPSHOT_VERSION: i32 = 1;

const CONTEXT: &str = "key-value snapshot";

impl StateMachine {
    /// Encodes the keyspace and the clock's high-water mark.
    pub fn snapshot_encode(&self) -> Result<Vec<u8>, StoreError> {
        let mut w = Writer::default();
        w.u8(SNAPSHOT_MARKER);
        w.i32(SNAPSHOT_VERSION);
        w.hlc(&self.clock.high_water())?;
        let count = i32::try_from(self.keyspace.len()).map_err(|_| StoreError::BufferTooLarge {
            what: "snapshot key count",
            len: self.keyspace.len(),
            max: i32::MAX as usize,
        })?;
        w.i32(count);
        for (key, entry) in self.keyspace.iter() {
            w.buffer("key", key)?;
            w.buffer("value", &entry.value)?;
            w.hlc(&entry.version)?;
            w.nullable_hlc(entry.fencing_token.as_ref())?;
            w.nullable_u64(entry.expires_at_ms);
        }
        Ok(w.buf)
    }

    /// Rebuilds a state machine from [`snapshot_encode`](Self::snapshot_encode) output. Arbitrary
    /// bytes yield an error, never a panic; keys must be strictly ascending (no duplicates).
    pub fn snapshot_decode(data: &[u8], config: StoreConfig) -> Result<StateMachine, StoreError> {
        let mut r = Reader::new(CONTEXT, data);
        if r.u8("marker")? != SNAPSHOT_MARKER {
            return Err(StoreError::Invalid {
                context: CONTEXT,
                what: "marker",
                offset: 0,
                reason: "expected 'S'",
            });
        }
        if r.i32("format version")? != SNAPSHOT_VERSION {
            return Err(r.invalid("format version", "this build reads format version 1 only"));
        }
        let high_water = r.hlc("high-water mark")?;
        let count = r.len("key count")?;
        let mut keyspace = Keyspace::default();
        let mut previous: Option<bytes::Bytes> = None;
        for _ in 0..count {
            let key = r.key()?;
            if previous.as_ref().is_some_and(|prev| *prev >= key) {
                return Err(r.invalid("key", "keys must be strictly ascending"));
            }
            previous = Some(key.clone());
            let entry = Entry {
                value: r.bytes("value")?,
                version: r.hlc("version")?,
                fencing_token: r.nullable_hlc("fencing token")?,
                expires_at_ms: r.nullable_u63("expiry")?,
            };
            keyspace.insert(key, entry);
        }
        r.finish()?;
        let mut machine = StateMachine::new(config)?;
        machine.clock.observe(&high_water);
        for (_, entry) in keyspace.iter() {
            machine.clock.observe(&entry.version);
        }
        machine.keyspace = keyspace;
        Ok(machine)
    }
}
