//! Binary conventions of `storage-format.md`: big-endian integers, `Buffer` = `Int32` length + bytes,
//! `Nullable<T>` = `Bool` byte + `T`. Decoding never trusts a length beyond the bytes present.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_protocol::hlc::{validate_node_id, MAX_COUNTER, MAX_WALL_MS};
use mqstate_protocol::Hlc;

use crate::error::StoreError;

/// Largest `Buffer` the format can describe.
pub const MAX_BUFFER_BYTES: usize = i32::MAX as usize;

#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// A writer whose buffer holds `capacity` bytes before it grows: records are encoded on the
    /// write path, where growing from empty costs a reallocation per doubling.
    pub(crate) fn with_capacity(capacity: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// Starts a `Buffer` whose bytes the caller writes next; [`end_buffer`](Self::end_buffer) with
    /// the returned position writes its length.
    pub(crate) fn begin_buffer(&mut self) -> usize {
        self.i32(0);
        self.buf.len()
    }

    /// Ends the `Buffer` begun at `start`.
    pub(crate) fn end_buffer(
        &mut self,
        what: &'static str,
        start: usize,
    ) -> Result<(), StoreError> {
        let len = self.buf.len() - start;
        let len32 = i32::try_from(len).map_err(|_| StoreError::BufferTooLarge {
            what,
            len,
            max: MAX_BUFFER_BYTES,
        })?;
        self.buf[start - 4..start].copy_from_slice(&len32.to_be_bytes());
        Ok(())
    }

    pub(crate) fn u8(&mut self, value: u8) {
        self.buf.push(value);
    }

    pub(crate) fn bool(&mut self, value: bool) {
        self.buf.push(u8::from(value));
    }

    pub(crate) fn i32(&mut self, value: i32) {
        self.buf.extend_from_slice(&value.to_be_bytes());
    }

    /// Bytes as they are (a fixed-width field, or the rest of a record).
    pub(crate) fn bytes(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    pub(crate) fn i64(&mut self, value: i64) {
        self.buf.extend_from_slice(&value.to_be_bytes());
    }

    /// A `u64` as Int64, saturating; [`Reader::u63`] reads it back and refuses a negative one.
    pub(crate) fn u63(&mut self, value: u64) {
        self.i64(i64::try_from(value).unwrap_or(i64::MAX));
    }

    /// The Int32 length that precedes a list of `n` items.
    pub(crate) fn count(&mut self, what: &'static str, n: usize) -> Result<(), StoreError> {
        let n = i32::try_from(n).map_err(|_| StoreError::BufferTooLarge {
            what,
            len: n,
            max: i32::MAX as usize,
        })?;
        self.i32(n);
        Ok(())
    }

    pub(crate) fn buffer(&mut self, what: &'static str, data: &[u8]) -> Result<(), StoreError> {
        let len = i32::try_from(data.len()).map_err(|_| StoreError::BufferTooLarge {
            what,
            len: data.len(),
            max: MAX_BUFFER_BYTES,
        })?;
        self.i32(len);
        self.buf.extend_from_slice(data);
        Ok(())
    }

    /// `wall Int64 | counter Int32 | node id Buffer`. Values from [`HybridClock`] always fit; a
    /// hand-made out-of-range one is clamped rather than wrapped (debug builds assert).
    ///
    /// [`HybridClock`]: mqstate_protocol::HybridClock
    pub(crate) fn hlc(&mut self, hlc: &Hlc) -> Result<(), StoreError> {
        debug_assert!(hlc.wall_ms <= MAX_WALL_MS && hlc.counter <= MAX_COUNTER);
        self.i64(i64::try_from(hlc.wall_ms).unwrap_or(i64::MAX));
        self.i32(i32::try_from(hlc.counter).unwrap_or(i32::MAX));
        self.buffer("HLC node id", hlc.node_id.as_bytes())
    }

    /// Overwrites the wall time and counter of an HLC written at `at` (its node id stays).
    pub(crate) fn patch_hlc_time(&mut self, at: usize, hlc: &Hlc) {
        let wall = i64::try_from(hlc.wall_ms).unwrap_or(i64::MAX);
        let counter = i32::try_from(hlc.counter).unwrap_or(i32::MAX);
        self.buf[at..at + 8].copy_from_slice(&wall.to_be_bytes());
        self.buf[at + 8..at + 12].copy_from_slice(&counter.to_be_bytes());
    }

    /// Overwrites an `Int32` written at `at`.
    pub(crate) fn patch_i32(&mut self, at: usize, value: i32) {
        self.buf[at..at + 4].copy_from_slice(&value.to_be_bytes());
    }

    pub(crate) fn nullable_hlc(&mut self, hlc: Option<&Hlc>) -> Result<(), StoreError> {
        self.bool(hlc.is_some());
        hlc.map_or(Ok(()), |h| self.hlc(h))
    }

    pub(crate) fn nullable_u64(&mut self, value: Option<u64>) {
        self.bool(value.is_some());
        if let Some(v) = value {
            debug_assert!(v <= MAX_WALL_MS);
            self.i64(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }
}

pub(crate) struct Reader<'a> {
    context: &'static str,
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(context: &'static str, data: &'a [u8]) -> Self {
        Reader {
            context,
            data,
            pos: 0,
        }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub(crate) fn invalid(&self, what: &'static str, reason: &'static str) -> StoreError {
        StoreError::Invalid {
            context: self.context,
            what,
            offset: self.pos,
            reason,
        }
    }

    fn take(&mut self, what: &'static str, len: usize) -> Result<&'a [u8], StoreError> {
        if len > self.remaining() {
            return Err(StoreError::Truncated {
                context: self.context,
                what,
                offset: self.pos,
            });
        }
        let slice = &self.data[self.pos..self.pos + len];
        self.pos += len;
        Ok(slice)
    }

    /// The bytes not read yet, all of them (the last field of a record).
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let rest = &self.data[self.pos..];
        self.pos = self.data.len();
        rest
    }

    pub(crate) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], StoreError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(what, N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, StoreError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn bool(&mut self, what: &'static str) -> Result<bool, StoreError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => {
                self.pos -= 1;
                Err(self.invalid(what, "a Bool byte must be 0 or 1"))
            }
        }
    }

    pub(crate) fn i32(&mut self, what: &'static str) -> Result<i32, StoreError> {
        Ok(i32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, StoreError> {
        Ok(i64::from_be_bytes(self.array(what)?))
    }

    /// A non-negative `Int64`.
    pub(crate) fn u63(&mut self, what: &'static str) -> Result<u64, StoreError> {
        let value = self.i64(what)?;
        u64::try_from(value).map_err(|_| self.invalid(what, "must not be negative"))
    }

    /// A non-negative `Int32` used as a length or count.
    pub(crate) fn len(&mut self, what: &'static str) -> Result<usize, StoreError> {
        let value = self.i32(what)?;
        usize::try_from(value).map_err(|_| self.invalid(what, "a length must not be negative"))
    }

    pub(crate) fn buffer(&mut self, what: &'static str) -> Result<&'a [u8], StoreError> {
        let len = self.len(what)?;
        self.take(what, len)
    }

    pub(crate) fn bytes(&mut self, what: &'static str) -> Result<Bytes, StoreError> {
        Ok(Bytes::copy_from_slice(self.buffer(what)?))
    }

    pub(crate) fn key(&mut self) -> Result<&'a [u8], StoreError> {
        let key = self.buffer("key")?;
        if key.is_empty() {
            return Err(self.invalid("key", "keys are never empty"));
        }
        Ok(key)
    }

    pub(crate) fn hlc(&mut self, what: &'static str) -> Result<Hlc, StoreError> {
        let wall_ms = self.u63(what)?;
        let counter = u32::try_from(self.i32(what)?)
            .map_err(|_| self.invalid(what, "the HLC counter must not be negative"))?;
        let node_id = std::str::from_utf8(self.buffer(what)?)
            .map_err(|_| self.invalid(what, "the HLC node id must be UTF-8"))?;
        validate_node_id(node_id)
            .map_err(|_| self.invalid(what, "the HLC node id must not contain ':'"))?;
        Ok(Hlc::new(wall_ms, counter, Arc::from(node_id)))
    }

    pub(crate) fn nullable_hlc(&mut self, what: &'static str) -> Result<Option<Hlc>, StoreError> {
        if self.bool(what)? {
            self.hlc(what).map(Some)
        } else {
            Ok(None)
        }
    }

    pub(crate) fn nullable_u63(&mut self, what: &'static str) -> Result<Option<u64>, StoreError> {
        if self.bool(what)? {
            self.u63(what).map(Some)
        } else {
            Ok(None)
        }
    }

    pub(crate) fn finish(&self) -> Result<(), StoreError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(StoreError::TrailingBytes {
                context: self.context,
                offset: self.pos,
                extra,
            }),
        }
    }
}
